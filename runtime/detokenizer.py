"""Token ids -> text, one token at a time, with stop strings.

Decoding a token alone is wrong in two ways: a SentencePiece token "▁upon" decodes to "upon"
(the decoder strips the leading space of a whole decode), and a character split over several
byte tokens decodes to U+FFFD until its last byte arrives. So each step decodes a short window:

    tokens:   ... | prefix_offset ... read_offset | new tokens
                    \\_ already emitted; context _/

    delta = decode(tokens[prefix_offset:])[len(decode(tokens[prefix_offset:read_offset])):]

and emits it only when it is safe; then both offsets move forward (prefix to the old read
offset). The window holds the last emitted chunk plus the tokens not yet emitted, so the cost
per token is O(1). A delta is held back while

- the new text ends in U+FFFD (an incomplete UTF-8 character), or
- the last token is a byte-fallback token "<0xNN>": the ByteFallback decoder renders a run of
  byte tokens as one string, or as all U+FFFD if any byte in the run is invalid, so the run's text
  is only final once a non-byte token follows, or
- the text adds nothing yet (e.g. a lone "▁" at the start).

With `skip_special_tokens`, special tokens are dropped before they reach the window, exactly as
`decode` drops them. The initial context is the tail of the prompt, so the first output token
gets its leading space when the prompt has text before it. Hence, without stop strings,

    "".join(deltas) + flush() == decode(prompt + output)[len(decode(prompt)):]

which is `decode(output)` when the prompt decodes to "" (empty, or only a bos).

Stop strings are matched on the output text only. Text that could be the start of a stop string
is held back until it cannot be; on a match, `stop_matched` is set, the text ends before the
stop string (or after it with `include_stop_str_in_output`), and later appends return "".
Each stop string is scanned as the text grows (Knuth-Morris-Pratt, `_StopScan`), so a step costs
its new characters, not the held-back text (a hostile stop string of 60,000 characters, with
60,000 held back, cost about a second a step when each tail was compared). With `min_tokens`, a stop
string counts only where it ends in the text of the tokens after the first min_tokens (it may
start before): vLLM's rule.
The one unbounded case: a model that emits a long run of byte tokens that never forms valid
UTF-8 keeps that run in the window until it ends.

`num_shown` counts the leading output tokens whose text has been returned, in part at least (a
token's text starts where the text stood when it arrived). Tokens that only made a stop string
that was cut, or nothing (a final end-of-sequence token), are never shown: per-token data such
as logprobs, given for the first `num_shown` tokens, adds up to the text, as OpenAI's does, but
for a stop string that begins inside a token: that token is shown (its first characters are in
the text) and its data is whole.
"""

from __future__ import annotations

from collections import deque

from runtime.tokenizer import Tokenizer

# Prompt tokens kept as context for the first output token (vLLM uses 5 as well).
_PROMPT_CONTEXT_TOKENS = 5
_NEVER = 2**62  # a min_tokens floor not yet reached: no stop string ends past it


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas. Not thread-safe; one per sequence."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_ids = tokenizer.all_special_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer.byte_fallback_ids
        self._skip_special_tokens = skip_special_tokens
        self._scans = [_StopScan(s) for s in (stop or []) if s]
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._appended = 0  # output tokens appended
        # a stop string counts where it ends past this point of _decoded: the end of the first
        # min_tokens tokens' text, once the next token arrives (never before)
        self._stop_floor = 0 if min_tokens <= 0 else _NEVER
        # where the first min_tokens tokens end in the token window, while some of them wait to
        # be decoded (a byte run decodes with the token after it): the floor is set when they are
        self._floor_at: int | None = None
        self._scanned = 0  # the prefix of _decoded the stop scans have read

        context = [t for t in prompt_token_ids if t not in self._skip_ids]
        start = max(len(context) - _PROMPT_CONTEXT_TOKENS, 0)
        # A run of byte tokens decodes as one (all U+FFFD if any part is invalid): a context
        # that starts on a character's continuation byte would spoil the output bytes that
        # continue the run, so it starts on the character's first byte (at most 3 back; not at
        # the run's start, which an invalid output byte would spoil whole)
        for _ in range(3):
            if start == 0 or not self._continuation(context[start]):
                break
            start -= 1
        self._tokens = context[start:]  # window: context + not yet emitted
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

        self._decoded = ""  # output text decoded so far (may run ahead of what was emitted)
        self._emitted = 0  # length of the prefix of _decoded returned to the caller
        self.stop_matched: str | None = None  # the stop string that ended the text, if any
        self._done = False
        self.num_shown = 0  # leading output tokens whose text was returned (see the docstring)
        self._starts: deque[int] = deque()  # where each token not yet shown starts in _decoded

    @property
    def text(self) -> str:
        """All output text returned so far (the concatenation of the deltas)."""
        return self._decoded[: self._emitted]

    @property
    def finished(self) -> bool:
        """True once a stop string matched or `flush` was called."""
        return self._done

    def append(self, token_id: int) -> str:
        """Add one output token; return the text that is now safe to show (often "")."""
        if self._done:
            return ""
        self._appended += 1
        if self._appended == self._min_tokens + 1 and self._min_tokens > 0:
            if self._read_offset == len(self._tokens):  # their text is all decoded
                self._stop_floor = len(self._decoded)
            else:  # (their text's end, not what was decoded so far: `_decode_window` sets it)
                self._floor_at = len(self._tokens)
        self._starts.append(len(self._decoded))
        if token_id in self._skip_ids:
            self._show()
            return ""
        self._tokens.append(token_id)
        if token_id not in self._byte_ids:
            self._decode_window(final=False)
        return self._show(self._release(final=False))

    def flush(self) -> str:
        """End of output: return everything still held back (an incomplete character decodes as
        `decode` gives it). Later appends return ""."""
        if self._done:
            return ""
        self._decode_window(final=True)
        out = self._show(self._release(final=True))
        self._done = True
        return out

    def _show(self, delta: str = "") -> str:
        """Count the tokens whose text is out now; returns `delta`."""
        while self._starts and self._starts[0] < self._emitted:
            self._starts.popleft()
            self.num_shown += 1
        return delta

    # ----- internals -----------------------------------------------------------------------

    def _continuation(self, token_id: int) -> bool:
        """A byte-fallback token of a UTF-8 continuation byte (0x80-0xBF)."""
        if token_id not in self._byte_ids:
            return False
        b = self._tokenizer.token_bytes(token_id)
        return b is not None and 0x80 <= b[0] <= 0xBF

    def _decode_window(self, *, final: bool) -> None:
        """Move newly decodable text from the token window into `_decoded`."""
        if self._read_offset == len(self._tokens):
            return
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        prefix_text = decode(self._tokens[self._prefix_offset : self._read_offset], skip)
        new_text = decode(self._tokens[self._prefix_offset :], skip)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd")):
            return
        before = len(self._decoded)
        if new_text.startswith(prefix_text):
            self._decoded += new_text[len(prefix_text) :]
        else:  # an invalid byte made the run the context ends in all U+FFFD: the new tokens'
            self._decoded += decode(self._tokens[self._read_offset :], skip)  # text alone
        if self._floor_at is not None:  # the first min_tokens tokens' text ends in what came
            # (a character they only begin is not theirs: the text held back as vLLM's is)
            head = decode(self._tokens[self._prefix_offset : self._floor_at], skip)
            if head.startswith(prefix_text):
                own = len(head.rstrip("\ufffd")) - len(prefix_text)
            else:
                alone = decode(self._tokens[self._read_offset : self._floor_at], skip)
                own = len(alone.rstrip("\ufffd"))
            self._stop_floor = before + max(0, own)
            self._floor_at = None
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        # Drop tokens that fell out of the window, so the list stays short.
        if self._prefix_offset > 0:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _release(self, *, final: bool) -> str:
        """Return the part of `_decoded` not yet emitted that cannot be (part of) a stop string."""
        if self._scans:
            match = self._find_stop()
            if match is not None:
                stop, at = match
                end = at + len(stop) if self._include_stop else at
                self._decoded = self._decoded[:end]
                self.stop_matched = stop
                self._done = True
                return self._emit_to(end)
            if not final:
                held = max(scan.held for scan in self._scans)
                return self._emit_to(len(self._decoded) - held)
        return self._emit_to(len(self._decoded))

    def _emit_to(self, end: int) -> str:
        delta = self._decoded[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _find_stop(self) -> tuple[str, int] | None:
        """The earliest-starting stop string that ends in the text decoded since the last call
        (past the min_tokens floor). It starts in held-back text at the earliest: emitted text
        never holds the start of a stop string that could still be completed."""
        best: tuple[str, int] | None = None
        for scan in self._scans:
            end = scan.feed(self._decoded, self._scanned, self._stop_floor)
            if end is not None and (best is None or end - len(scan.stop) < best[1]):
                best = (scan.stop, end - len(scan.stop))
        self._scanned = len(self._decoded)
        return best


class _StopScan:
    """One stop string's Knuth-Morris-Pratt scan over the output text as it grows: `state`, the
    length of the longest tail of the text read that is a prefix of the stop. Each character
    costs O(1) amortised, whatever the stop's length. The prefix table (`_border`) is built only
    as far as the text has matched: a stop of 60,000 characters that the text never follows
    costs nothing to set up."""

    __slots__ = ("_pi", "state", "stop")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self._pi = [0]  # _pi[j]: the longest proper prefix of stop[: j + 1] that ends it
        self.state = 0

    @property
    def held(self) -> int:
        """Characters at the end of the text that could start this stop string (a whole match,
        ignored under min_tokens, holds what could start the next one)."""
        return self._border(self.state - 1) if self.state == len(self.stop) else self.state

    def _border(self, j: int) -> int:
        pi, s = self._pi, self.stop
        while len(pi) <= j:  # (extended in order: each entry reads the ones before it)
            i = len(pi)
            k = pi[i - 1]
            while k and s[i] != s[k]:
                k = pi[k - 1]
            pi.append(k + 1 if s[i] == s[k] else 0)
        return pi[j]

    def feed(self, text: str, start: int, floor: int) -> int | None:
        """Read text[start:]; the end of the first whole stop string in it that ends past
        `floor` (the scan stops there), or None."""
        s, n, state, i, end = self.stop, len(self.stop), self.state, start, len(text)
        while i < end:
            if state == n:  # a match that did not count: go on from its longest border
                state = self._border(n - 1)
            if state == 0:  # (skip to the next character that starts the stop, in C)
                i = text.find(s[0], i)
                if i < 0:
                    break
            c = text[i]
            while state and s[state] != c:
                state = self._border(state - 1)
            if s[state] == c:
                state += 1
            i += 1
            if state == n and i > floor:
                self.state = state
                return i
        self.state = state
        return None
