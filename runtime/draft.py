"""The draft-model proposer: a small model with its own paged KV cache drafts k tokens.

It shares the target's tokenizer (checked at start: the same token at every id both models have,
`_check_tokenizer`). Its vocabulary may be wider than the target's (padded: its logits are cut to
the target's width, so no padding id is ever drafted) or narrower (Qwen2.5-0.5B's 151,936 rows
drafting for Qwen2.5-7B's 152,064: its logits are widened to the target's with -inf, so it drafts
only ids it has, and a sampled draft's q is over the target's width, zero past the draft's). An
id the target emits (or a prompt holds) past the draft's vocabulary is read by the draft as id
`STAND_IN` in its own context (it cannot embed it): only its guesses after it suffer, and the
target verifies every draft. It has its own `ModelRunner` and `BlockManager` (no prefix caching),
sized by `draft_kv_cache_bytes`. For each request it keeps a shadow `Request`: the tokens it
knows and how many of them its KV cache holds (`num_computed_tokens`). Each engine step, for the
requests that speculate (decodes) and those whose target prefill is under way (`prefilling`:
those that will speculate once it ends):

    sync      the draft's computed count moves back to the longest prefix its tokens share with
              the request's (the accepted drafts stay, rejected ones are overwritten next), and
              blocks past it go back to its pool (`BlockManager.trim`)
    catch up  one forward pass over the tokens the draft has not computed, at most the engine's
              `max_num_batched_tokens` of them a step, as the target's prefill is chunked (a
              long prompt in one pass stalled every other request's step). A decode's catch-up
              is what verification appended (or a prompt the target found cached); a prefilling
              request's is its prompt up to what the target has computed and computes this step
              at most, short of its last token, so that its draft KV keeps pace with the
              target's prefill (a step behind) and it drafts from its first decode steps (begun
              only then, a prompt of n budgets decoded n steps plainly after its prefill). The
              decodes take the budget first, the nearest caught up first, then the prefills; a
              decode that cannot catch up this step computes a chunk and drafts nothing (it
              decodes plainly until its draft KV has caught up). A request's blocks for its whole
              catch-up and drafts (a prefill's: those of its first decode) are reserved before
              any chunk is computed: a prompt the draft's cache cannot hold is never computed.
              A caught-up decode's last row gives draft 1
    draft     k - 1 single-token steps, batched over the requests still drafting, each feeding
              the draft before it (the last draft is never fed: the target scores it)

Greedy requests draft the argmax; sampled ones draw from q = `target_probs` of the draft's logits
(the target's temperature, min_p, top_k, top_p), and q rides along to `verify` in
`Request.spec_draft_probs`. A constrained request (structured output) drafts under its grammar's
mask, advanced over its drafts as they are made and rolled back after (`_GrammarDrafts`): an
unmasked draft the grammar refuses is always rejected, and with it every draft after it. A
request's draft blocks are freed when it finishes (`forget`) or is no longer running when the
next step proposes (preempted).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer

from kernels.dispatch import FORCE_TRITON
from runtime.config import EngineConfig, ModelConfig, ModelLoadError
from runtime.kv_cache import BlockManager
from runtime.loader import load_model
from runtime.model_runner import ModelRunner, kv_block_bytes, kv_cache_dtype
from runtime.request import Request
from runtime.sampler import GREEDY_TEMPERATURE_EPS, MASKED_BELOW, apply_token_bitmask
from runtime.scheduler import ScheduledRequest
from runtime.speculative import draw, target_probs
from runtime.structured_decoding import RequestGrammar, bitmask_words

# what a draft narrower than the target reads in place of an id it has no row for (documented in
# README.md's speculative section); any id it has would do: only its acceptance rate is at stake
STAND_IN = 0


def _vocab(model_dir: Path) -> dict[str, int]:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"speculative draft_model: {path} is missing; the draft must share the target's "
            "tokenizer"
        )
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception on bad files
        raise ValueError(f"speculative draft_model: {path} is not a valid tokenizer ({e})") from e
    return backend.get_vocab(with_added_tokens=True)


def _check_tokenizer(draft_dir: Path, target_dir: Path, width: int) -> None:
    """Both tokenizers name the same token at every id below `width`, the narrower of the two
    models' vocabularies (a token named by one and not the other there is a difference too).
    Past it each may name more: a padded draft's padding tokens (never drafted: the draft's
    logits are cut to the target's width, `DraftProposer._run`), or the target's tokens that a
    narrower draft cannot embed (read as `STAND_IN`, `DraftProposer._readable`); verification
    judges every draft."""
    draft, target = _vocab(draft_dir), _vocab(target_dir)
    by_id_draft = {i: t for t, i in draft.items() if i < width}
    by_id_target = {i: t for t, i in target.items() if i < width}
    if by_id_draft != by_id_target:
        first = min(i for i in by_id_draft.keys() | by_id_target.keys()
                    if by_id_draft.get(i) != by_id_target.get(i))  # fmt: skip
        raise ValueError(
            f"speculative draft_model {draft_dir}: a draft model with another vocabulary "
            f"(its tokenizer differs from the target's: id {first} is "
            f"{by_id_draft.get(first)!r} in the draft, {by_id_target.get(first)!r} in the target)"
        )


class DraftProposer:
    """Drafts with a small model (see the module docstring); `SpecController`'s proposer."""

    def __init__(self, config: EngineConfig, target_vocab_size: int, max_model_len: int) -> None:
        spec = config.speculative
        assert spec is not None and spec.draft_model is not None
        path = Path(spec.draft_model)
        try:  # (the errors name a file; beside the target's, which model's was not said)
            draft_vocab = ModelConfig.from_dir(path).vocab_size
            _check_tokenizer(path, Path(config.model), min(draft_vocab, target_vocab_size))
            self.model = load_model(path, config.dtype, weight_dtype=config.weight_dtype)
        except ModelLoadError as e:
            raise ModelLoadError(f"speculative draft_model (--draft-model): {e}") from e
        # on the target's device (a GPU target's draft on the host drafted at the host's speed,
        # and its KV cache came out of host memory); its logits come back to the host, where
        # the drafts are drawn and verified beside the target's (ModelRunner.finish)
        cuda = config.device == "cuda"
        if cuda:
            self.model.to(config.device)
        self.max_model_len = min(max_model_len, self.model.cfg.max_model_len)
        self.vocab_size = target_vocab_size  # the logits' width (past the draft's own: -inf)
        self.readable = min(self.model.cfg.vocab_size, target_vocab_size)  # ids it can embed
        self.max_chunk = config.max_num_batched_tokens  # catch-up tokens one step computes
        # its KV in the target's kind of cache (the draft model's dtype is the target's)
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.model, cuda or FORCE_TRITON)
        block_bytes = kv_block_bytes(self.model, config.block_size, kv_dtype)
        num_blocks = spec.draft_kv_cache_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"speculative draft_kv_cache_bytes={spec.draft_kv_cache_bytes} holds no block "
                f"of {config.block_size} tokens ({block_bytes} bytes each)"
            )
        self.blocks = BlockManager(num_blocks, config.block_size, caching=False)
        self.runner = ModelRunner(
            self.model, num_blocks, config.block_size, config.attention, config.cpu_kernels,
            packed_weights=config.packed_weights, kv_dtype=kv_dtype,
        )  # fmt: skip
        self.model.rope_rows(min(self.max_model_len, num_blocks * config.block_size))  # now
        if not cuda:
            self.runner.pack_weights()  # load_model has read every weight
        # what the draft holds: its weights and its KV cache (the target's budget leaves it out)
        self.nbytes = num_blocks * block_bytes + sum(
            t.nbytes for t in (*self.model.parameters(), *self.model.buffers())
        )
        self._shadows: dict[str, Request] = {}  # request id -> the draft's view of it
        self._base: dict[str, int] = {}  # request id -> leading shadow tokens that are its own

    # ------------------------------------------------------------------ Proposer
    def forget(self, request_id: str) -> None:
        if self._shadows.pop(request_id, None) is not None:
            self.blocks.free(request_id)
            self._base.pop(request_id, None)

    @torch.inference_mode()
    def propose(
        self,
        batch: list[tuple[Request, int]],
        running: list[Request],
        prefilling: Sequence[tuple[Request, int]] = (),
    ) -> None:
        live = {r.request_id for r in running}
        for rid in [rid for rid in self._shadows if rid not in live]:
            self.forget(rid)  # preempted: its draft KV goes with its target KV
        wanted: list[_CatchUp] = []
        for r, k in batch:
            tokens = self._readable(r.all_token_ids)
            if len(tokens) + k - 1 > self.max_model_len:
                continue
            grammar = r.grammar
            if grammar is not None and (grammar.matcher.is_error() or grammar.matcher.is_stopped()):
                continue  # only end-of-sequence can follow (or nothing): no draft to make
            shadow = self._sync(r, tokens)
            wanted.append(_CatchUp(r, shadow, k, shadow.num_tokens, len(tokens) + k - 1))
        for r, k in prefilling:
            tokens = self._readable(r.all_token_ids)
            if len(tokens) + k > self.max_model_len:
                continue  # (its first decode could draft nothing)
            shadow = self._sync(r, tokens)
            # what the target has computed and computes this step at most; not the last token,
            # whose row gives draft 1 at the first decode (and whose KV the sync would drop)
            upto = min(len(tokens) - 1, r.num_computed_tokens + self.max_chunk)
            # reserved: the first decode's whole catch-up and drafts (its tokens then, k - 1)
            wanted.append(_CatchUp(r, shadow, 0, upto, len(tokens) + k))
        # the step's catch-up tokens are bounded: the requests that draft this step take them
        # first, the nearest caught up first (a decode's few accepted tokens before a new
        # prompt's thousands), then the target's prefills, the nearest caught up first
        wanted.sort(key=lambda w: (w.k == 0, w.upto - w.shadow.num_computed_tokens))
        budget = self.max_chunk
        work: list[tuple[Request, Request, int]] = []  # caught up this step: these draft
        behind: list[tuple[Request, int]] = []  # (shadow, tokens): a chunk of its catch-up only
        for w in wanted:
            r, shadow, k = w.request, w.shadow, w.k
            missing = w.upto - shadow.num_computed_tokens
            n = min(missing, budget)
            if n <= 0:
                continue  # caught up to the target, or no budget left this step: no drafts
            # the whole catch-up and its drafts, even while a chunk of it is computed: reserved a
            # chunk at a time, a prompt larger than the draft's cache was computed chunk after
            # chunk until the cache ran out, forgotten, and begun again, every step of its life
            if self.blocks.allocate(r.request_id, w.reserve) is None:
                self.forget(r.request_id)  # no room in the draft's cache: no drafts this time
                continue
            budget -= n
            if k and n == missing:
                work.append((r, shadow, k))
            else:
                behind.append((shadow, n))
        if not work and not behind:
            return
        drafts: list[list[int]] = [[] for _ in work]
        probs: list[list[torch.Tensor]] = [[] for _ in work]
        rows = list(range(len(work)))
        # the first pass: every drafting row's catch-up (its last row gives draft 1), then the
        # chunks of those still behind (their logits unused)
        shadows = [sh for _, sh, _ in work] + [sh for sh, _ in behind]
        sizes = [sh.num_tokens - sh.num_computed_tokens for _, sh, _ in work]
        sizes += [n for _, n in behind]
        grammars = [None if r.grammar is None else _GrammarDrafts(r.grammar) for r, _, _ in work]
        done: set[int] = set()  # rows whose grammar allows no further draft
        try:
            for step in range(max((k for _, _, k in work), default=1)):
                if step:
                    rows = [i for i in rows if work[i][2] > step and i not in done]
                    if not rows:
                        break
                    for i in rows:
                        work[i][1].prompt_token_ids.append(drafts[i][-1])  # feed the last draft
                    shadows, sizes = [work[i][1] for i in rows], [1] * len(rows)
                logits = self._run(shadows, sizes)  # (len(shadows), V): rows' first
                for j, i in enumerate(rows):
                    r, g, row = work[i][0], grammars[i], logits[j : j + 1]
                    if g is not None:
                        row = g.masked(row)
                        if float(row.max()) < -MASKED_BELOW:  # only ids past the draft's allowed
                            done.add(i)
                            continue
                    q = None
                    if r.params.temperature < GREEDY_TEMPERATURE_EPS:
                        token = int(row[0].argmax())
                    else:
                        q = target_probs(row, r.params)[0]  # (V,)
                        token = draw(q, r.generator)
                    if g is not None and not g.advance(token):
                        done.add(i)  # the grammar refuses it (nothing was allowed): stop here
                        continue
                    drafts[i].append(token)
                    if q is not None:
                        probs[i].append(q)
                    if g is not None and g.finished:
                        done.add(i)  # only end-of-sequence can follow: the target adds it
        finally:
            for g in grammars:
                if g is not None:
                    g.rollback()
        for i, (r, _, _) in enumerate(work):
            r.spec_token_ids = drafts[i]
            r.spec_draft_probs = torch.stack(probs[i]) if probs[i] else None  # (k, V)

    # ------------------------------------------------------------------ internals
    def _readable(self, tokens: list[int]) -> list[int]:
        """`tokens` as the draft reads them: an id past its vocabulary (one of a wider target's)
        as `STAND_IN`. Its guesses after it are worse (the acceptance rate dips there), never
        wrong output: the target verifies every draft, and drafts are ids the draft has."""
        if self.readable >= self.vocab_size or max(tokens, default=0) < self.readable:
            return tokens
        return [t if t < self.readable else STAND_IN for t in tokens]

    def _sync(self, r: Request, tokens: list[int]) -> Request:
        """The request's shadow, rolled back to the prefix it shares with `tokens`."""
        rid = r.request_id
        shadow = self._shadows.get(rid)
        if shadow is None:
            shadow = Request(rid, [], r.params, 0, frozenset())
            self._shadows[rid] = shadow
        known, base = shadow.prompt_token_ids, self._base.get(rid, 0)
        m, end = base, min(len(known), len(tokens), shadow.num_computed_tokens)
        while m < end and known[m] == tokens[m]:  # the drafts fed last time that were accepted
            m += 1
        shadow.num_computed_tokens = min(m, shadow.num_computed_tokens, len(tokens) - 1)
        shadow.prompt_token_ids = list(tokens)
        self._base[rid] = len(tokens)
        self.blocks.trim(rid, shadow.num_computed_tokens)
        return shadow

    def _run(self, shadows: list[Request], sizes: list[int]) -> torch.Tensor:
        """One draft forward pass computing `sizes[i]` tokens of each shadow; the logits at
        each one's last token (len(shadows), V), in the order given."""
        scheduled = [ScheduledRequest(sh, n) for sh, n in zip(shadows, sizes, strict=True)]
        # decodes first (the runner's batch layout), shortest context first
        order = sorted(
            range(len(scheduled)),
            key=lambda i: (scheduled[i].num_new_tokens != 1, shadows[i].num_computed_tokens),
        )
        tables = {sh.request_id: self.blocks.block_table(sh.request_id) for sh in shadows}
        hidden = self.runner.forward([scheduled[i] for i in order], tables)  # (T, hidden)
        last = torch.tensor([scheduled[i].num_new_tokens for i in order]).cumsum(0) - 1  # (B,)
        # (B, V) in `order`, on the host; a padded vocabulary's rows past the target's cut off,
        # a narrower one's widened with -inf (never drafted; a sampled draft's q zero there)
        logits = self.model.logits(hidden[last.to(hidden.device)])[:, : self.vocab_size].cpu()
        if logits.shape[1] < self.vocab_size:
            logits = F.pad(logits, (0, self.vocab_size - logits.shape[1]), value=-math.inf)
        for sh, n in zip(shadows, sizes, strict=True):
            sh.num_computed_tokens += n
        back = torch.empty(len(order), dtype=torch.int64)
        back[torch.tensor(order)] = torch.arange(len(order))
        return logits[back]  # (B, V) in the order given


@dataclass(slots=True)
class _CatchUp:
    """A request the draft computes for this step (its catch-up ahead of any draft)."""

    request: Request  # the target's request
    shadow: Request  # the draft's view of it, synced
    k: int  # drafts to make once caught up; 0: the target is prefilling, none this step
    upto: int  # the shadow's tokens to have computed before drafting (or at most, prefilling)
    reserve: int  # tokens its draft blocks are reserved for before any of them is computed


class _GrammarDrafts:
    """A constrained request's grammar while the draft model drafts for it: the mask of the
    state after the drafts made so far, advanced over each draft, and rolled back once they are
    made, so that the grammar stands where the request does when the step fills its own masks
    (runtime.structured_decoding.TokenMasks, after the proposals)."""

    def __init__(self, grammar: RequestGrammar) -> None:
        self.matcher = grammar.matcher
        self.consumed = 0  # drafts the matcher has been advanced over
        self._row: np.ndarray | None = None

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (1, V) with the tokens the grammar does not allow next pushed to -max."""
        from llguidance.numpy import fill_next_token_bitmask  # (a grammar loaded it)

        if self._row is None:
            self._row = np.empty((1, bitmask_words(logits.shape[1])), dtype=np.int32)
        fill_next_token_bitmask(self.matcher, self._row, 0)
        return apply_token_bitmask(logits, self._row)

    def advance(self, token: int) -> bool:
        """Advance over `token` if the grammar allows it (checked first: consuming a refused
        token would put the request's own matcher in its error state); whether it did."""
        m = self.matcher
        if m.is_error() or m.validate_tokens([token]) != 1 or not m.consume_token(token):
            return False
        self.consumed += 1
        return True

    @property
    def finished(self) -> bool:
        return bool(self.matcher.is_stopped())

    def rollback(self) -> None:
        if self.consumed:
            self.matcher.rollback(self.consumed)
            self.consumed = 0
