"""Constrained decoding in the engine: compiled grammars, per-request grammar state, token masks.

    prepare_request   GrammarCompiler.grammar(text): the compiled matcher for the grammar text
                      (compiled once per distinct schema, on a thread of its own that requests
                      for the same text wait on, for COMPILE_TIMEOUT_S at most, and not at all
                      once none waits when its turn comes; kept in an LRU cache), copied for
                      each of the request's n sequences (`Request.grammar`)
    step: schedule    TokenMasks.start(scheduled): one job on a helper thread fills the bitmask
                      of every constrained request that samples this step, while the model's
                      forward pass runs (llguidance releases the GIL); a request with k
                      speculative drafts gets k + 1 rows: its state, then its state after each
                      draft the grammar accepts (the drafts are consumed, then rolled back)
    step: execute     the sampler (and speculative verification) joins the job and sets the
                      logits of disallowed tokens to -inf (runtime.sampler.apply_token_bitmask)
    step: update      RequestGrammar.accept(tokens): the grammar advances over the tokens the
                      step appended, only accepted drafts among them; a grammar that can take
                      nothing more but end-of-sequence ends the request (finish reason "stop")

A matcher can fail mid-request: llguidance stops at a resource limit ("lexer error: too many
expressions constructed", a regex such as `(.{0,50}){0,50}` once enough text is in it), and a
failed matcher stays failed. Its mask is then end-of-sequence alone, so the request ends at once,
and `RequestGrammar.error` says why (the output is not what the grammar asked for, whatever its
finish reason). Copies of a matcher share its lexer, failure included, so the compiled grammar
that failed leaves the cache: the next request with that constraint compiles it afresh.

A bitmask row is (ceil(V / 32),) int32, bit t of word t // 32 set when token t is allowed (the
layout of llguidance, xgrammar and vLLM). A draft the grammar refuses is never allowed by its
row's mask, so verification rejects it (greedy: it is not the masked argmax; sampled: its
target probability is 0) and the residual draw is a token the grammar accepts.

Prefix caching and preemption need nothing: the grammar state follows the output tokens, which
neither changes.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from runtime.sampling_params import InvalidRequestError
from runtime.scheduler import QueueFullError
from runtime.structured import checked_text
from runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance

    from runtime.scheduler import ScheduledRequest
    from runtime.structured import StructuredOutputsParams

log = logging.getLogger("edgeinfer.structured")

CACHE_GRAMMARS = 256  # compiled grammars kept (an LRU over grammar texts)
# Seconds that the grammars kept took to compile (and fill their first mask), together: the
# lexer a grammar builds is kept with it, and its size follows that work, not the grammar's
# text (`(a{1000}){1000}`: ~0.7 s and ~250 MB, kept; 256 such regexes asked for in turn held
# ~60 GB). A JSON schema takes milliseconds; the newest grammar is kept whatever its cost.
CACHE_COMPILE_SECONDS = 2.0
_NO_EXTENSION = "NoExtensionBias"  # llguidance's error when no token can extend the output
# How long a request waits for its grammar's compile: past it, the request is refused (400
# naming the limit), and the compile, which cannot be stopped, runs on and is kept as any other
# (a request sent again takes it, or waits for the same compile). A request that spent the
# greater part of this waiting for its compile's turn (COMPILE_THREADS), its compile not begun or
# run less than half of it, is not blamed: it is told to retry (QueueFullError, the worker's 429
# with Retry-After), the compile, if begun, kept for the retry. The slowest compile measured
# of a grammar the gateway takes (~65,000 alternatives, near llguidance's symbol limit) takes
# ~3.5 s on one core of a 2-core machine, stories260K or SmolLM2's 49k vocabulary alike (the
# grammar's own lexer, not the tokenizer, is the cost); four at once, ~10 s each.
COMPILE_TIMEOUT_S = 20.0
# Compiles that run at once; more wait for a turn (their wait counts in their requests'
# COMPILE_TIMEOUT_S). Each holds its lexer (~150 MB near the size limit), and a compile whose
# request stopped waiting runs on: distinct large grammars sent over and over would otherwise
# run as many compiles at once as they were sent. A compile that no request waits for any more
# when its turn comes does not run: before, each such compile ran in its turn, and a backlog of
# them (requests that had given up) made a schema of milliseconds wait past the timeout, refused
# with the timeout's 400 as if it were too large.
COMPILE_THREADS = 4


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class RequestGrammar:
    """One sequence's grammar state and this step's mask rows."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        eos_row: np.ndarray,
        on_error: Callable[[], None] | None = None,
        param: str = "structured_outputs",
    ) -> None:
        self.matcher = matcher
        # why the matcher failed (the client's field, then llguidance's first line), if it did
        self.error: str | None = None
        self.param = param  # the client's field that asked for the constraint
        self._eos_row = eos_row  # (W,) only end-of-sequence allowed: the mask after an error
        self._on_error = on_error  # called once when the matcher fails (the compiler's eviction)
        self._job: Future[None] | None = None  # the step's mask job
        self._rows: np.ndarray | None = None  # (1 + drafts, W) int32, filled by the job

    def copy(self) -> RequestGrammar:
        """A state at the same point (one per sequence of an n > 1 request); it shares the
        lexer, so a failure in one is seen by all."""
        return RequestGrammar(self.matcher.deep_copy(), self._eos_row, self._on_error, self.param)

    def accept(self, tokens: list[int]) -> int:
        """Advance over tokens appended to the output (sampled under this grammar's mask).
        Returns how many of them are output: all, or those up to the one that ended the grammar
        (an accepted draft can: the step's tokens after it, its end-of-sequence bonus token
        included, are not), or up to one it refused; the first always."""
        self._job, self._rows = None, None
        m = self.matcher
        for i, token in enumerate(tokens):
            if m.is_stopped():  # the grammar ended at the token before (or had failed: the
                self._check()  # first token, sampled under its end-of-sequence mask, is output)
                return max(i, 1)
            if not m.consume_token(token):
                log.warning("grammar refused generated token %d of %s", token, tokens)
                self._check()
                return i + 1
        self._check()
        return len(tokens)

    @property
    def finished(self) -> bool:
        """Nothing but end-of-sequence can follow (or the grammar is in an error state)."""
        return bool(self.matcher.is_stopped())

    def mask(self) -> np.ndarray:
        """This step's rows (1 + drafts, W); waits for the mask job if it is still running."""
        assert self._job is not None and self._rows is not None, "no mask started this step"
        self._job.result()
        return self._rows

    def _fill(self, rows: np.ndarray, drafts: list[int]) -> None:
        """Row 0: the current state; row i + 1: after drafts[: i + 1] (as far as they are
        accepted; rows past a refused draft are never read, verification stops there)."""
        from llguidance.numpy import fill_next_token_bitmask  # (loaded by the compiler)

        m = self.matcher
        if not m.is_error():
            fill_next_token_bitmask(m, rows, 0)
            ok = m.validate_tokens(drafts) if drafts and not m.is_error() else 0
            for i in range(ok):
                m.consume_token(drafts[i])
                fill_next_token_bitmask(m, rows, i + 1)
            if ok and not m.is_error():
                m.rollback(ok)
        if self._check():  # failed now or before: the request can only end
            rows[:] = self._eos_row

    def _check(self) -> bool:
        """Whether the matcher has failed; the first time, log why and tell the compiler."""
        if not self.matcher.is_error():
            return False
        if self.error is None:
            why = self.matcher.get_error().split("\n", 1)[0][:300]
            self.error = f"{self.param}: {why}"
            log.warning("structured output failed, the request ends here: %s", self.error)
            if self._on_error is not None:
                self._on_error()
        return True


# The Earley items one token's mask may build. llguidance's default (50,000) let an ambiguous
# grammar (`s: s s | "a" | "b"`) grow its mask's cost with every token, cubically: 0.75 s a
# token after 474 tokens, every request in the batch waiting on it. At 5,000 such a grammar
# fails its request (finish_reason "error") within ~13 ms a mask; JSON schemas, regexes and
# choices build a few hundred items.
STEP_MAX_ITEMS = 5_000


def parser_limits() -> llguidance.LLParserLimits:
    import llguidance

    return llguidance.LLParserLimits(step_max_items=STEP_MAX_ITEMS)


class GrammarCompiler:
    """llguidance matchers for one tokenizer, compiled once per grammar text (thread-safe:
    requests are prepared off the step thread)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        capacity: int = CACHE_GRAMMARS,
        compile_seconds: float = CACHE_COMPILE_SECONDS,
        timeout_s: float = COMPILE_TIMEOUT_S,
    ) -> None:
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = tokenizer
        self._lltok: llguidance.LLTokenizer | None = None  # built on first use (~0.5 s at 49k)
        # grammar text -> (its compiled template, the seconds its compile took)
        self._cache: OrderedDict[str, tuple[llguidance.LLMatcher, float]] = OrderedDict()
        self._capacity = capacity
        self._budget = compile_seconds  # the most compile seconds kept (CACHE_COMPILE_SECONDS)
        self._cost = 0.0  # compile seconds of the grammars kept
        # grammar text -> its compile, while it waits for a turn or runs (requests for the same
        # text wait for it), oldest first
        self._compiling: dict[str, _Compile] = {}
        self._timeout = timeout_s  # how long a request waits for a compile (COMPILE_TIMEOUT_S)
        self._turns = threading.BoundedSemaphore(COMPILE_THREADS)  # compiles running at once
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (cache misses), for tests and stats
        self.abandoned = 0  # compiles not run: no request waited for them when their turn came
        eos = np.zeros(bitmask_words(vocab_size) * 32, dtype=np.uint8)
        eos[self.eos_token_ids] = 1
        self.eos_row = np.packbits(eos, bitorder="little").view(np.int32)  # (W,)

    def tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        with self._lock:
            if self._lltok is None:
                self._lltok = llguidance.LLTokenizer(
                    self._tokenizer.to_json_str(),
                    n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None,
                )
            return self._lltok

    def grammar(self, spec: StructuredOutputsParams, param: str) -> RequestGrammar:
        """A fresh grammar state for `spec` (InvalidRequestError naming the client's field it
        came from, `spec.param`, or else `param`, if refused, or if its compile took longer than
        the compile timeout; QueueFullError if the wait for it was spent mostly waiting for a
        turn, behind other compiles). Requests with the same grammar text share one compile:
        those that come while it waits or runs wait for it."""
        param = spec.param or param
        text = checked_text(spec, param)
        with self._lock:
            entry = self._cache.get(text)
            if entry is not None:
                self._cache.move_to_end(text)
                job: _Compile | None = None
            else:
                job = self._compiling.get(text)
                if job is None:
                    job = self._compiling[text] = _Compile()
                    what = "JSON schema" if spec.json is not None else "constraint"
                    threading.Thread(target=self._compile, args=(text, what, job), daemon=True,
                                     name="edgeinfer-grammar").start()  # fmt: skip
                job.waiting += 1
        if job is None:
            assert entry is not None
            template = entry[0]
        else:
            try:
                template = job.done.result(self._timeout)
            except TimeoutError:
                raise self._late(text, job, param) from None
            except _Refusal as e:  # (raised in every request that waited for the compile)
                raise InvalidRequestError(param, str(e)) from None
            finally:  # (settled, timed out, or the wait interrupted: this request waits no more)
                with self._lock:
                    job.waiting -= 1
        evict = functools.partial(self._evict, text, template)
        return RequestGrammar(template.deep_copy(), self.eos_row, evict, param)

    def _late(self, text: str, job: _Compile, param: str) -> Exception:
        """Why a request waited for `job` longer than the timeout: a 400 when the compile itself
        ran for the greater part of that (at least half), else, the wait spent mostly waiting
        for a turn, QueueFullError (retry) naming the compiles ahead of it."""
        with self._lock:
            ran = 0.0 if job.started is None else time.perf_counter() - job.started
            ahead = 0  # older compiles that run or will (oldest first: they take turns first)
            for other, older in self._compiling.items():
                if other == text:
                    break
                ahead += older.started is not None or older.waiting > 0
        if ran >= self._timeout / 2:
            return InvalidRequestError(
                param, f"the constraint did not compile within {self._timeout:g} s (the "
                "limit of the worker's grammar compile): send a smaller grammar or schema "
                "(fewer alternatives or rules)",
            )  # fmt: skip
        begun = "had not begun" if job.started is None else f"had run only {ran:.1f} s"
        return QueueFullError(
            f"{param}: the worker's grammar compiles are busy: this request's compile {begun} "
            f"after {self._timeout:g} s ({ahead} grammar compiles ahead of it, "
            f"{COMPILE_THREADS} run at once); retry"
        )

    def _compile(self, text: str, what: str, job: _Compile) -> None:
        """Compile `text` (on a thread of its own, when one of COMPILE_THREADS is free: a
        request that stops waiting for it does not stop it once begun), keep it and settle `job`
        with it, or with the _Refusal that says why not (`what` the constraint is, for its
        message: "JSON schema" or "constraint"). A compile that no request waits for when its
        turn comes is dropped instead (its future cancelled): a request for the text after that
        starts a new one. The compile's own errors are those the gateway's check
        (runtime.structured.check) finds, so the worker does not run that check's compile too."""
        import llguidance  # (here, not at the top: ~25 ms of a worker's cold start otherwise)

        try:
            with self._turns:
                with self._lock:
                    if job.waiting == 0:  # (every request for it stopped waiting: none will)
                        del self._compiling[text]
                        job.done.cancel()
                        self.abandoned += 1
                        return
                    job.started = start = time.perf_counter()
                template = llguidance.LLMatcher(self.tokenizer(), text, log_level=0,
                                                limits=parser_limits())  # fmt: skip
                if template.is_error():  # (on one line, as the gateway's check says it: a regex
                    # error spans several; a panic's backtrace is left out)
                    error = " ".join(template.get_error().split("<backtrace>", 1)[0].split())
                    raise _Refusal(f"invalid or unsupported {what}: {error[:300]}")
                self._check_satisfiable(template)
                cost = time.perf_counter() - start
        except BaseException as e:  # (a refusal, or a bug: raised in each waiting request)
            with self._lock:
                del self._compiling[text]
            job.done.set_exception(e)
            return
        with self._lock:
            del self._compiling[text]
            self.compiled += 1
            self._drop(text)
            self._cache[text] = (template, cost)
            self._cost += cost
            while len(self._cache) > self._capacity or (
                self._cost > self._budget and len(self._cache) > 1
            ):
                self._drop(next(iter(self._cache)))
        job.done.set_result(template)

    def _evict(self, text: str, template: llguidance.LLMatcher) -> None:
        """Drop a compiled grammar whose lexer failed (its copies share it): the next request
        compiles afresh. Called from the mask thread."""
        with self._lock:
            entry = self._cache.get(text)
            if entry is not None and entry[0] is template:  # (not a newer compile of the text)
                self._drop(text)

    def _drop(self, text: str) -> None:
        """Forget the compiled grammar of `text`, if kept (under the lock)."""
        entry = self._cache.pop(text, None)
        if entry is not None:
            self._cost -= entry[1]

    def _check_satisfiable(self, template: llguidance.LLMatcher) -> None:
        """Refuse a constraint no output can satisfy: before any token, only end-of-sequence is
        allowed, yet the empty output does not match (a grammar rule with no way out, such as
        `a: a`, or a schema that only refers to itself). It would otherwise end every request
        at once with empty text that does not match it. A constraint whose first mask already
        exceeds llguidance's limits (a regex such as `(.{0,300}){0,300}` over a large vocabulary)
        is refused with llguidance's reason."""
        from llguidance.numpy import fill_next_token_bitmask

        row = np.zeros((1, bitmask_words(self.vocab_size)), dtype=np.int32)
        fill_next_token_bitmask(template, row, 0)
        error = template.get_error().split("\n", 1)[0][:300] if template.is_error() else ""
        if error and error != _NO_EXTENSION:  # a resource limit, reached on the first mask
            raise _Refusal(f"the constraint is too complex for the grammar engine: {error}")
        allowed = np.unpackbits(row.view(np.uint8), bitorder="little")[: self.vocab_size]
        allowed[self.eos_token_ids] = 0
        if error or (not allowed.any() and not template.is_accepting()):
            raise _Refusal(
                "the constraint accepts no output: no token can begin it and the empty "
                "output does not match it (a rule that never ends, or a schema that only refers "
                "to itself?)",
            )  # fmt: skip
        # Output the grammar forces without end (`start: "x" start`, a rule that only repeats
        # itself): llguidance extends the forced text on the first token until its item limit,
        # so every request would fail there. Its forced tokens, consumed on a copy, show it.
        # Only that limit: another error there (a lexer's, on a regex that forces a long but
        # finite text such as `(a{1000}){1000}b`) is no sign of an endless rule, and such a
        # constraint served requests before this check (a sampled first token needs no forced
        # text); it fails, if it does, as it did, naming the field.
        probe = template.deep_copy()
        forced = probe.compute_ff_tokens()
        if forced:
            probe.consume_tokens(forced)
        why = probe.get_error().split("\n", 1)[0][:300] if probe.is_error() else ""
        if "Too many items" in why and "ff_tokens" in why:
            raise _Refusal(
                "the constraint forces output that never ends (a rule that only repeats "
                f"itself, such as `start: \"x\" start`?): {why}",
            )  # fmt: skip


class _Refusal(Exception):
    """The compile refused a grammar: why (the request that waited names its field)."""


@dataclass(eq=False)
class _Compile:
    """One grammar text's compile, from its request until it is settled (under the compiler's
    lock but `done`)."""

    done: Future[llguidance.LLMatcher] = field(default_factory=Future)  # its matcher, or why not
    waiting: int = 0  # requests waiting for it now (none when its turn comes: it does not run)
    started: float | None = None  # when its turn came (perf_counter); None while it waits


class TokenMasks:
    """Fills each step's masks on one helper thread, while the forward pass runs."""

    def __init__(self, vocab_size: int) -> None:
        self.words = bitmask_words(vocab_size)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="edgeinfer-masks")

    def start(self, scheduled: list[ScheduledRequest]) -> None:
        """Start filling the masks of the constrained requests that sample this step."""
        todo = [
            (s.request.grammar, s.spec_token_ids)
            for s in scheduled
            if s.request.grammar is not None and s.samples
        ]
        if not todo:
            return
        rows = np.empty((sum(1 + len(d) for _, d in todo), self.words), dtype=np.int32)
        at = 0
        parts: list[tuple[RequestGrammar, np.ndarray, list[int]]] = []
        for g, drafts in todo:
            parts.append((g, rows[at : at + 1 + len(drafts)], drafts))
            at += 1 + len(drafts)
        job = self._pool.submit(_fill_all, parts)
        for g, part, _ in parts:
            g._job, g._rows = job, part

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _fill_all(parts: list[tuple[RequestGrammar, np.ndarray, list[int]]]) -> None:
    for g, rows, drafts in parts:
        g._fill(rows, drafts)
