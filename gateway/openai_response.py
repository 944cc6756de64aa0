"""The OpenAI response side: worker events in, `chat.completion(.chunk)` / `text_completion` out.

A `ResponseAssembler` follows one request's event stream (`start`, `delta`..., `done`, or
`error`; see `kvstore.protocol`) and both streams and accumulates: `on_event` returns the SSE
chunk objects to send now (none when not streaming), `final` the whole object for a
non-streamed answer. One class for both modes keeps the two answers identical in content.
A completions batch (several prompts) has one stream per prompt, interleaved as they come:
`on_event(event, p)` numbers prompt p's choices from p * n, `usage` adds up, and the answer
is done (the usage chunk sent) once every prompt's stream is.

Chunk order for a streamed chat request with n choices (OpenAI's own order):
    per choice: {"delta": {"role": "assistant", "content": ""}}      on `start`
    per delta:  {"delta": {"content": "..."}, "logprobs": ...}       text and/or logprobs
                {"delta": {"tool_calls": [{"index", "id", "type", "function"}]}}
                                                    tool-call deltas (the worker parses them)
    per choice: {"delta": {}, "finish_reason": "stop" | "length"}    when the choice ends
    once:       {"choices": [], "usage": {...}}                       on `done`, if include_usage
Completions stream the same way with `text` in place of `delta`, and no role chunk; with `echo`,
each choice's first chunk is its prompt's text (and, with logprobs, its tokens' logprobs, the
first null: the worker's prompt logprobs, which ride on its first delta of the request).
A choice that made tool calls and stopped finishes with "tool_calls" (with "stop" when a call's
arguments are not whole JSON: a stop string cut them off, or the model wrote NaN; JSON as the
worker's parser reads it, raw control characters in strings included, and no arguments at all
are whole); its final message has `tool_calls` (deltas of one call joined: its arguments
concatenated) and `content` null when it said nothing else, as OpenAI answers.

Failures are raised as `APIError`, never returned, so the handler decides: before the first
byte it may answer with the error's status (or retry elsewhere when `retryable`); after it, it
sends `sse(err.body())` and closes the stream (a worker's error event: `error_from_event`).
- An `error` event -> 500 (server_error, code internal_error), or 503 when its code says the
  worker was going away ("draining", "shutdown", "aborted", "engine_dead"): the request may
  succeed elsewhere.
- finish_reason "abort" -> 503 with code "aborted". OpenAI has no such finish reason (its
  clients reject one they do not know), and a choice cut off by a draining worker is not an
  answer: reporting it as "stop" or "length" would pass truncated text off as complete. When
  the gateway itself aborts (the client went away) nobody reads the answer anyway.
- A malformed event, or a stream that ends without `done` (`final` called early) -> 502.

Logprobs the engine reports as -inf (or NaN) are sent as -9999.0, the value OpenAI uses:
JSON has no infinity, and orjson would write null, which clients reject.
"""

from __future__ import annotations

import codecs
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from gateway.errors import APIError, bad_gateway, internal, invalid, unavailable
from runtime.tool_parsers import is_json_object

if TYPE_CHECKING:
    from gateway.openai_api import RequestOptions

SSE_DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # stands in for -inf
FINISH_REASONS = frozenset({"stop", "length"})  # what workers send ("tool_calls" is ours)
# Error-event codes that mean "this worker is going away", not "this request is bad".
UNAVAILABLE_CODES = frozenset({"draining", "shutdown", "aborted", "engine_dead", "queue_full"})


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


@dataclass(slots=True)
class _TextOffsets:
    """Completions' `text_offset`: where each of a choice's tokens begins in the choice's text
    (the echoed prompt's tokens and the generated ones alike, OpenAI's meaning). The tokens'
    text, decoded from their bytes, is matched against the text as it comes:
    - a token whose text is at the text's next position begins there; so does one whose text
      is there but for a leading space (SentencePiece's "▁Once" begins a text "Once": the
      space the decoder strips; a detokenizer's cleanup drops " ," to ",");
    - a token whose text is still to come (the worker holds back what may start a stop
      string) begins where the text stands, and the rest of its text is matched as it comes;
    - a token that shows nothing in the text (a bos "<s>", any special token the text leaves
      out) is zero-width, at the position where the next text begins (0 for a leading bos);
    - after such tokens, the next is also looked for as far ahead as their text was long (an
      "<unk>" stands for characters the tokens lost), where it then begins.
    So offsets never decrease and stay within the text received so far. vLLM instead adds up
    the tokens' string lengths from 0, "<s>" and the first token's space included; the two
    agree where the tokens' text is the text (OpenAI's tokenizers: no bos, no dropped space).
    """

    at: int = 0  # the text before this position is the tokens' so far
    unread: str = ""  # the text received after `at` (empty while `pending` is not)
    pending: str = ""  # the tokens' text that the text has not shown yet
    missed: int = 0  # characters of the tokens not found in the text since the last found
    decoder: codecs.IncrementalDecoder = field(  # of the tokens' bytes
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace")
    )

    def add_text(self, text: str) -> None:
        """More of the choice's text: the rest of the tokens' text is looked for first."""
        self.unread += text
        if not self.pending:
            return
        for shown in _forms(self.pending):
            took = _take(shown, self.unread)
            if took is not None:
                self.at, self.unread = self.at + took, self.unread[took:]
                self.pending = shown[took:]
                return
        self.missed, self.pending = self.missed + len(self.pending), ""

    def add_token(self, raw: bytes) -> int:
        """A token (its bytes) after the tokens so far; returns its text_offset."""
        piece = self.decoder.decode(raw)
        if self.pending:  # an earlier token's text is still to come, then this one's
            self.pending += piece
            return self.at
        for shown in _forms(piece):
            took = _take(shown, self.unread)
            if took is not None:
                start = self.at
                self.at, self.unread = self.at + took, self.unread[took:]
                self.pending = shown[took:]
                self.missed = 0 if shown else self.missed
                return start
        for shown in _forms(piece) if self.missed else ():  # ahead, past what was missed
            q = self.unread.find(shown, 1, self.missed + len(shown)) if shown else -1
            if q > 0:
                start, end = self.at + q, q + len(shown)
                self.at, self.unread, self.missed = self.at + end, self.unread[end:], 0
                return start
        self.missed += len(piece)
        return self.at


def _forms(piece: str) -> tuple[str, ...]:
    """A token's text as the text may show it: whole, or without its leading space."""
    return (piece, piece[1:]) if piece[:1] == " " else (piece,)


def _take(shown: str, unread: str) -> int | None:
    """How much of `unread` a token's text `shown` takes where it begins it: all of `shown`,
    or all of `unread` when that is only the start of it (the rest to come); None if neither."""
    if unread.startswith(shown):
        return len(shown)
    if shown.startswith(unread):
        return len(unread)
    return None


@dataclass(slots=True)
class _Choice:
    """One completion of the request's n, as accumulated so far."""

    text: list[str] = field(default_factory=list)  # text pieces, joined by `final`
    text_len: int = 0  # characters so far (the next token's text_offset base)
    role_sent: bool = False  # streamed chat: the chunk carrying role "assistant" went out
    chat_logprobs: list[dict[str, Any]] = field(default_factory=list)  # chat `logprobs.content`
    tokens: list[str] = field(default_factory=list)  # completions `logprobs.tokens`
    # completions, per token (an echoed prompt's first token: null, nothing precedes it)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)  # completions, per token
    offsets: _TextOffsets = field(default_factory=_TextOffsets)  # completions: text_offset's
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool calls so far
    finish_reason: str | None = None  # "stop" | "length" | "tool_calls" once ended
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    echoed: bool = False  # completions' echo: the prompt went first


class ResponseAssembler:
    """Turns one request's worker events into OpenAI objects (see the module docstring)."""

    def __init__(self, options: RequestOptions, request_id: str, created: int) -> None:
        self.options = options
        self.chat = options.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"  # the response's id
        self.created = created  # unix seconds, the same in every chunk
        self.choices = [_Choice() for _ in range(options.prompts * options.n)]
        self.worker_id: str | None = None  # from `start`: the worker serving the request
        self.usage: dict[str, Any] | None = None  # from `done` (summed over the prompts)
        self.ended: set[int] = set()  # prompts whose stream sent `done`
        # echo: per prompt, (its text as the worker decoded it, its tokens' logprobs), from the
        # worker's first delta (kvstore.protocol.PromptDelta)
        self.prompt_logprobs: dict[int, tuple[str, list[dict[str, Any]]]] = {}
        # vLLM's prompt_logprobs, per prompt (from the same delta), cut to what was asked for
        self.prompt_ranked: dict[int, list[dict[str, dict[str, Any]] | None]] = {}
        self.done = False  # every prompt's `done` was seen: `final` may be called

    def on_event(self, event: dict[str, Any], prompt: int = 0) -> list[dict[str, Any]]:
        """Take one event of prompt `prompt`'s stream; return the chunks to stream now ([] when
        not streaming)."""
        kind = event.get("type")
        if kind == "error":
            raise error_from_event(event)
        try:
            if kind == "start":
                return self._on_start(event)
            if kind == "delta":
                return self._on_delta(event, prompt)
            if kind == "done":
                return self._on_done(event, prompt)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise bad_gateway(f"malformed {kind!r} event from the worker: {e!r}") from e
        return []  # an event type from a newer worker: nothing this gateway can show

    def final(self) -> dict[str, Any]:
        """The whole non-streamed response object; only after `done`."""
        if not self.done or self.usage is None:
            raise bad_gateway(
                "the worker's stream ended before the request finished", "incomplete_stream"
            )
        asked = self.options.prompt_logprobs is not None
        if asked and len(self.prompt_ranked) < self.options.prompts:
            raise bad_gateway("the worker sent no prompt_logprobs", "incomplete_stream")
        answer: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.options.model,
            "choices": [self._final_choice(i, c) for i, c in enumerate(self.choices)],
            "usage": self.usage,
        }
        if asked and self.chat:  # (vLLM's place for them: the response's)
            answer["prompt_logprobs"] = self.prompt_ranked[0]
        elif asked:  # each choice's, its prompt's
            for choice in answer["choices"]:
                choice["prompt_logprobs"] = self.prompt_ranked[choice["index"] // self.options.n]
        return answer

    # -- events -----------------------------------------------------------------------------

    def _on_start(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        self.worker_id = event.get("worker_id")
        if not (self.options.stream and self.chat):
            return []
        chunks = []
        for i, c in enumerate(self.choices):
            c.role_sent = True
            delta = {"role": "assistant", "content": ""}
            chunks.append(self._chunk([self._chunk_choice(i, delta, None)]))
        return chunks

    def _on_delta(self, event: dict[str, Any], prompt: int) -> list[dict[str, Any]]:
        n = self.options.n
        j = event["index"]
        if not isinstance(j, int) or not 0 <= j < n:
            raise ValueError(f"choice index {j!r} outside [0, {n})")
        i = prompt * n + j
        c = self.choices[i]
        if c.finish_reason is not None:
            raise ValueError(f"delta for choice {i} after it finished")
        text: str = event["text"]
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        chunks = []
        if self.options.prompt_logprobs is not None and event.get("prompt_ranked") is not None:
            self.prompt_ranked[prompt] = _ranked(event["prompt_ranked"], self.options.prompt_logprobs)
        if self.options.echo:
            prompt_lps = event.get("prompt_logprobs")
            if prompt_lps is not None:
                self.prompt_logprobs[prompt] = (str(event.get("prompt_text", "")), prompt_lps)
            if not c.echoed:
                chunks += self._echo(i, c, prompt)
        raw = event.get("logprobs")
        if self.options.echo_only:  # max_tokens 0: the one token generated is not shown
            text, raw = "", None
        new_logprobs = self._add_logprobs(c, text, raw)
        c.text.append(text)
        c.text_len += len(text)
        calls = event.get("tool_calls") or []
        for call in calls:
            _add_tool_call(c, call)

        finish = event.get("finish_reason")
        if finish == "abort":
            raise unavailable(
                f"the worker aborted choice {i} before it finished; retry the request",
                code="aborted",
            )
        if finish is not None and finish not in FINISH_REASONS:
            raise ValueError(f"unknown finish_reason {finish!r}")
        if finish is not None:
            if finish == "stop" and c.tool_calls and all(map(_complete, c.tool_calls)):
                finish = "tool_calls"
            c.finish_reason, c.stop_reason = finish, event.get("stop_reason")
            if self.options.echo_only:  # (the 0 tokens asked for)
                finish, c.finish_reason, c.stop_reason = "length", "length", None

        if not self.options.stream:
            return []
        if text or new_logprobs is not None or (self.chat and not c.role_sent):
            delta: dict[str, Any] = {"content": text}
            if self.chat and not c.role_sent:
                c.role_sent = True
                delta = {"role": "assistant", "content": text}
            chunks.append(self._chunk([self._chunk_choice(i, delta, new_logprobs)]))
        if calls and self.chat:
            chunks.append(self._chunk([self._chunk_choice(i, {"tool_calls": calls}, None)]))
        if finish is not None:
            end = self._chunk_choice(i, {}, None, finish)
            end["stop_reason"] = c.stop_reason  # vLLM's extension: which stop string/token
            chunks.append(self._chunk([end]))
        return chunks

    def _on_done(self, event: dict[str, Any], prompt: int) -> list[dict[str, Any]]:
        n = self.options.n
        ours = range(prompt * n, prompt * n + n)
        open_choices = [i for i in ours if self.choices[i].finish_reason is None]
        if open_choices:
            raise ValueError(f"done before choices {open_choices} finished")
        tokens = int(event["prompt_tokens"]), int(event["completion_tokens"])
        if self.options.echo_only:  # (none shown)
            tokens = (tokens[0], 0)
        cached = int(event.get("cached_tokens") or 0)
        if self.usage is not None:  # a batch's prompts: their usage adds up
            tokens = (tokens[0] + self.usage["prompt_tokens"],
                      tokens[1] + self.usage["completion_tokens"])  # fmt: skip
            cached += self.usage["prompt_tokens_details"]["cached_tokens"]
        self.usage = {
            "prompt_tokens": tokens[0],
            "completion_tokens": tokens[1],
            "total_tokens": sum(tokens),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        self.ended.add(prompt)
        self.done = len(self.ended) == self.options.prompts
        if self.done and self.options.stream and self.options.include_usage:
            return [self._chunk([], self.usage)]
        return []

    # -- shapes -----------------------------------------------------------------------------

    def _chunk(
        self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.options.model,
            "choices": choices,
        }
        if self.options.include_usage:
            chunk["usage"] = usage  # null on every chunk but the last, as OpenAI sends it
        return chunk

    def _chunk_choice(
        self,
        index: int,
        delta: dict[str, Any],
        logprobs: dict[str, Any] | None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            return {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        return {
            "index": index,
            "text": delta.get("content", ""),
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def _final_choice(self, index: int, c: _Choice) -> dict[str, Any]:
        text = "".join(c.text)
        logprobs: dict[str, Any] | None = None
        if self.options.logprobs is not None:
            if self.chat:
                logprobs = {"content": c.chat_logprobs, "refusal": None}
            else:
                logprobs = {
                    "tokens": c.tokens,
                    "token_logprobs": c.token_logprobs,
                    "top_logprobs": c.top_logprobs,
                    "text_offset": c.text_offset,
                }
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if c.tool_calls:
                choice["message"]["content"] = text or None
                choice["message"]["tool_calls"] = c.tool_calls
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = c.finish_reason
        choice["stop_reason"] = c.stop_reason
        return choice

    def _echo(self, index: int, c: _Choice, prompt: int) -> list[dict[str, Any]]:
        """Completions' echo: choice `index` (of prompt `prompt`) begins with the prompt's text
        and, with logprobs, its tokens' (the first null); the chunk that streams them."""
        c.echoed = True
        text = self.options.prompt_texts[prompt] if self.options.prompt_texts else None
        got = self.prompt_logprobs.get(prompt)
        if got is None and (text is None or self.options.logprobs is not None):
            raise ValueError("echo: the worker sent no prompt_logprobs")
        if text is None:
            assert got is not None
            text = got[0]
        part = None
        if self.options.logprobs is not None:
            assert got is not None
            at = len(c.tokens)
            part = self._add_logprobs(c, text, got[1])
            if part is not None and part["tokens"]:
                c.token_logprobs[at] = c.top_logprobs[at] = None
                part["token_logprobs"][0] = part["top_logprobs"][0] = None
            # the generated tokens' offsets go on from the prompt's end, whatever of it the
            # prompt's tokens did not account for (or did not end: a split character)
            c.offsets = _TextOffsets(at=c.text_len + len(text))
        c.text.append(text)
        c.text_len += len(text)
        if not self.options.stream:
            return []
        return [self._chunk([self._chunk_choice(index, {"content": text}, part)])]

    def _add_logprobs(self, c: _Choice, text: str, raw: object) -> dict[str, Any] | None:
        """Record a delta's token logprobs; return them in this endpoint's chunk shape."""
        top_n = self.options.logprobs
        if top_n is None or not raw:
            if top_n is not None and not self.chat:  # text held back for earlier tokens
                c.offsets.add_text(text)
            return None
        if not isinstance(raw, list):
            raise TypeError(f"logprobs must be a list, got {type(raw).__name__}")
        if self.chat:
            entries = [
                {
                    "token": t["token"],
                    "logprob": _logprob(t["logprob"]),
                    "bytes": t.get("bytes"),
                    "top_logprobs": [
                        {
                            "token": a["token"],
                            "logprob": _logprob(a["logprob"]),
                            "bytes": a.get("bytes"),
                        }
                        for a in t.get("top_logprobs", [])[:top_n]
                    ],
                }
                for t in raw
            ]
            c.chat_logprobs.extend(entries)
            return {"content": entries, "refusal": None}
        c.offsets.add_text(text)  # text_offset: where each token begins (see _TextOffsets)
        part: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for t in raw:
            chosen = _logprob(t["logprob"])
            part["tokens"].append(t["token"])
            part["token_logprobs"].append(chosen)
            # the legacy API's alternatives always hold the chosen token (up to logprobs + 1
            # of them, as OpenAI and vLLM give them; with logprobs 0, the chosen one alone)
            top = {t["token"]: chosen}
            for a in t.get("top_logprobs", [])[:top_n]:
                top.setdefault(a["token"], _logprob(a["logprob"]))
            part["top_logprobs"].append(top)
            b = t.get("bytes")
            raw_bytes = t["token"].encode() if b is None else bytes(b)
            part["text_offset"].append(c.offsets.add_token(raw_bytes))
        c.tokens.extend(part["tokens"])
        c.token_logprobs.extend(part["token_logprobs"])
        c.top_logprobs.extend(part["top_logprobs"])
        c.text_offset.extend(part["text_offset"])
        return part


def _ranked(raw: object, top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs as the worker sent them, each token's alternatives cut to those
    ranked within `top` (the worker computes as many as echo needs too); logprobs JSON-safe."""
    if not isinstance(raw, list):
        raise TypeError(f"prompt_ranked must be a list, got {type(raw).__name__}")
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in raw:
        if entry is None:
            out.append(None)
            continue
        items = list(entry.items())  # the prompt token first, then its alternatives
        kept = [items[0], *(kv for kv in items[1:] if kv[1]["rank"] <= top)]
        out.append({k: {**v, "logprob": _logprob(v["logprob"])} for k, v in kept})
    return out


def _add_tool_call(c: _Choice, call: object) -> None:
    """Fold one tool-call delta into the choice's calls (a new call, or more arguments)."""
    if not isinstance(call, dict):
        raise TypeError(f"a tool call delta must be an object, got {type(call).__name__}")
    index, fn = call["index"], call["function"]
    if index == len(c.tool_calls):
        c.tool_calls.append({"id": call["id"], "type": "function",
                             "function": {"name": fn["name"], "arguments": fn["arguments"]}})  # fmt: skip
    elif 0 <= index < len(c.tool_calls):
        c.tool_calls[index]["function"]["arguments"] += fn["arguments"]
    else:
        raise ValueError(f"tool call index {index} out of order")


def _complete(call: dict[str, Any]) -> bool:
    """A call's arguments are a whole JSON object (not cut off by a stop string, say; a call
    without arguments has "{}" from the worker, and "" is one cut off right after its name; not
    `null`, a list or a number, which OpenAI's arguments never are and which the gateway refuses
    when the client sends the call back in its history). JSON as the worker's parser reads it
    (orjson refuses the raw newlines and tabs that models write in code)."""
    return is_json_object(call["function"]["arguments"])


def _logprob(value: object) -> float:
    """A JSON-safe log-probability: -inf and NaN (and a missing value) become -9999.0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if value is None:
            return MIN_LOGPROB
        raise TypeError(f"logprob must be a number, got {type(value).__name__}")
    return float(value) if math.isfinite(value) else MIN_LOGPROB


def error_from_event(event: dict[str, Any]) -> APIError:
    """The error a worker's error event stands for, typed as the same failure before the first
    byte would be answered (a worker going away: a 503 server_error; a constraint that
    failed: invalid_request_error); mid-stream, its `body()` is the stream's last chunk."""
    message = event.get("message")
    code = event.get("code")
    text = message if isinstance(message, str) and message else "the worker failed the request"
    return _error_for(text, code if isinstance(code, str) and code else "internal_error")


def _error_for(text: str, code: str) -> APIError:
    """The error a worker's error event with `code` stands for."""
    if code in UNAVAILABLE_CODES:
        return unavailable(text, code=code)
    if code == "constraint_failed":  # the output constraint failed: the same on any worker
        return invalid(None, text, code)
    return internal(text, code)
