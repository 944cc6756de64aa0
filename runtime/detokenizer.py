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
The one unbounded case: a model that emits a long run of byte tokens that never forms valid
UTF-8 keeps that run in the window until it ends.

`num_shown` counts the leading output tokens whose text has been returned, in part at least (a
token's text starts where the text stood when it arrived). Tokens that only made a stop string
that was cut, or nothing (a final end-of-sequence token), are never shown: per-token data such
as logprobs, given for the first `num_shown` tokens, adds up to the text, as OpenAI's does.
"""

from __future__ import annotations

from collections import deque

from runtime.tokenizer import Tokenizer

# Prompt tokens kept as context for the first output token (vLLM uses 5 as well).
_PROMPT_CONTEXT_TOKENS = 5


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
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_ids = tokenizer.all_special_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer.byte_fallback_ids
        self._skip_special_tokens = skip_special_tokens
        self._stops = [s for s in (stop or []) if s]
        self._include_stop = include_stop_str_in_output

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
        if new_text.startswith(prefix_text):
            self._decoded += new_text[len(prefix_text) :]
        else:  # an invalid byte made the run the context ends in all U+FFFD: the new tokens'
            self._decoded += decode(self._tokens[self._read_offset :], skip)  # text alone
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        # Drop tokens that fell out of the window, so the list stays short.
        if self._prefix_offset > 0:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _release(self, *, final: bool) -> str:
        """Return the part of `_decoded` not yet emitted that cannot be (part of) a stop string."""
        if self._stops:
            match = self._find_stop()
            if match is not None:
                stop, at = match
                end = at + len(stop) if self._include_stop else at
                self._decoded = self._decoded[:end]
                self.stop_matched = stop
                self._done = True
                return self._emit_to(end)
            if not final:
                return self._emit_to(len(self._decoded) - self._stop_prefix_len())
        return self._emit_to(len(self._decoded))

    def _emit_to(self, end: int) -> str:
        delta = self._decoded[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _find_stop(self) -> tuple[str, int] | None:
        """Earliest stop string in the text not yet emitted (a match may start in held-back text
        only: emitted text never contains the start of a stop string)."""
        best: tuple[str, int] | None = None
        for stop in self._stops:
            at = self._decoded.find(stop, self._emitted)
            if at >= 0 and (best is None or at < best[1]):
                best = (stop, at)
        return best

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the unemitted text that is a proper prefix of a stop."""
        pending = self._decoded[self._emitted :]
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:k]):
                    longest = k
                    break
        return longest
