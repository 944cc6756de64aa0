"""Messages that cross a process boundary: gateway -> worker, worker -> Redis registry.

Plain dataclasses, serialized with orjson, importable without torch (the gateway never imports
torch). The worker's internal HTTP API (see runtime/worker.py):

    POST /internal/generate   body: GenerateRequest        -> NDJSON stream of events below
    POST /internal/abort      body: {"request_id": str}    -> {"aborted": bool}
    POST /internal/role       body: {"role": Role}         -> {"role", "previous", "drained_s"}
                              (drains the old role's work first; 409 while another change runs)
    GET  /internal/health                                  -> {"status": "ok" | "draining"}
    GET  /internal/stats                                   -> WorkerInfo as JSON (live load)

Every internal call carries the shared secret in the `x-edgeinfer-secret` header.

A generate stream is one JSON object per line:

    {"type": "start", ...StartEvent}          once, after the request was accepted
    {"type": "delta", ...DeltaEvent}          per step that produced tokens, per completion
                                              (the first one a PromptDelta when the request
                                              asked for prompt logprobs: see below)
    {"type": "done",  ...DoneEvent}           once, last line, with the usage counts
    {"type": "error", ...ErrorEvent}          instead of "done" when the request failed mid-way

A request whose `sampling` asks for `prompt_logprobs` (the gateway's completions `echo`, and
vLLM's `prompt_logprobs` on either endpoint) gets its prompt's in its first delta, a PromptDelta:
a DeltaEvent with three more fields, sent once per request (its n completions share the prompt):

    prompt_logprobs  [TokenLogprob] per prompt token, the first one's logprob null (nothing
                     precedes it) and without alternatives: what `echo` puts before the answer
    prompt_text      the prompt's token ids decoded (special tokens left out): the text `echo`
                     shows for a prompt sent as token ids
    prompt_ranked    vLLM's `prompt_logprobs` shape: per prompt token (the first null), token
                     id -> {"logprob", "rank", "decoded_token"}, the prompt's token first, then
                     its alternatives

A delta's `logprobs` are those of the tokens whose text is out, sent with that text: none for
the tokens of a stop string cut from the text or for a final stop token (end-of-sequence,
stop_token_ids), so that they add up to the text, as OpenAI's do; the done event's
`completion_tokens` counts every generated token (vLLM lists them all).

A request the worker refuses never starts a stream: it gets a 4xx/5xx JSON body
{"error": {"message", "type", "param", "code"}} in the OpenAI shape, which the gateway relays.
One exception: a disaggregated request (`kv_source` set) is answered 200 at once, and its stream
stays blank lines (KEEPALIVE) while the decode worker pulls the prompt's KV, so that a gateway
tells a hung worker from a slow pull by its usual idle timeout; a refusal of the pull
(kv_cache_full, kv_transfer_failed, queue_full, ...) is then the stream's one line, an "error"
event whose `status` (and `retry_after`) stand for the answer it would have had, which the
gateway takes as such.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import orjson

from kvstore.keys import as_text

SECRET_HEADER = "x-edgeinfer-secret"
Role = Literal["prefill", "decode", "mixed"]

OPERATIONS = ("chat", "text_completion")  # GenerateRequest.operation: gen_ai.operation.name


@dataclass(slots=True)
class GenerateRequest:
    """One generation request, as the gateway forwards it to a worker."""

    request_id: str  # unique per request; the handle for abort
    model: str  # served model name; the worker refuses a model it does not serve
    prompt: str | list[int] | None = None  # completions: text or token ids
    messages: list[dict[str, Any]] | None = None  # chat: rendered by the worker's chat template
    sampling: dict[str, Any] = field(default_factory=dict)  # runtime.SamplingParams fields
    session_id: str | None = None  # the x-session-affinity id, if any (logs, cache hints)
    kv_source: str | None = None  # "host:port" of a prefill worker's KV transfer server: pull
    # the prompt's KV from there instead of computing it (disaggregated prefill/decode)
    operation: str = "text_completion"  # gen_ai.operation.name (chat | text_completion), for
    # the worker's telemetry (a chat the gateway tokenized arrives as a prompt of token ids)
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI tool objects, rendered by the chat
    # template (also when the gateway tokenized the chat) and parsed out of the output
    tool_choice: str | dict[str, Any] | None = None  # "auto" | "none" | "required" |
    # {"type": "function", "function": {"name": ...}}; required and named are enforced by a grammar
    parallel_tool_calls: bool = True  # chat: False allows one call per completion (required:
    # a one-call grammar; auto: the completion ends once its first call is complete)

    def to_json(self) -> bytes:
        return orjson.dumps(self)  # orjson reads dataclasses itself, ~30x dataclasses.asdict

    def text_chars(self) -> int:
        """About how many characters of text tokenizing the prompt reads: a text prompt's; a
        chat's messages and tools as JSON, as the chat template writes the tools into the prompt
        and markup around each message (counted as the messages' content alone, 0.9 MB of tools
        beside a short message was tokenized on the gateway's loop: ~1 s). 0 for token ids."""
        if isinstance(self.prompt, str):
            return len(self.prompt)
        if self.messages is None:
            return 0
        parts = (self.messages, self.tools)
        return sum(len(orjson.dumps(part, default=str)) for part in parts if part)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GenerateRequest:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}")
        return cls(**raw)


@dataclass(slots=True)
class StartEvent:
    """The worker accepted the request and queued it."""

    request_id: str  # echoed back
    worker_id: str  # which worker serves it
    prompt_tokens: int  # the prompt's length in tokens (after the chat template)
    type: str = "start"


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one generated token, with the top alternatives (OpenAI shape)."""

    token: str  # the token's text
    logprob: float  # its log-probability
    bytes: list[int]  # its UTF-8 bytes (a token may hold part of a character)
    top_logprobs: list[dict[str, Any]]  # [{"token", "logprob", "bytes"}], best first


@dataclass(slots=True)
class DeltaEvent:
    """New output of one completion (of the request's n) since the previous event."""

    index: int  # which completion
    text: str  # new text (never a broken UTF-8 character)
    token_ids: list[int]  # new tokens
    logprobs: list[TokenLogprob] | None = None  # when asked for: one per token whose text is
    # out (none for a stop string cut from `text` or a final stop token: see above)
    finish_reason: str | None = None  # "stop" | "length" | "abort" once this completion ended
    stop_reason: str | int | None = None  # the stop string or token that ended it
    tool_calls: list[dict[str, Any]] | None = None  # tool-call deltas in OpenAI's chunk shape
    # ({"index", "id", "type", "function": {"name", "arguments"}} first, then arguments only);
    # `text` then holds only the content around the calls
    type: str = "delta"


@dataclass(slots=True)
class PromptDelta(DeltaEvent):
    """A request's first delta when it asked for prompt_logprobs (the gateway's completions
    `echo` does): the prompt's logprobs and text ride along, once per request (the n
    completions share the prompt). The gateway reads them as fields of the delta's dict
    (gateway.openai_response)."""

    # one per prompt token; the first token's logprob is NaN (null in JSON: nothing precedes
    # it) and it has no alternatives
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_text: str = ""  # the prompt's token ids decoded (special tokens left out)
    # the same in vLLM's `prompt_logprobs` shape: per prompt token (the first null), its id and
    # its alternatives' -> {"logprob", "rank", "decoded_token"}, the token itself first
    prompt_ranked: list[dict[str, dict[str, Any]] | None] = field(default_factory=list)


@dataclass(slots=True)
class DoneEvent:
    """The request finished; usage counts for the response."""

    prompt_tokens: int  # prompt length in tokens
    completion_tokens: int  # generated tokens over all n completions
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    type: str = "done"


@dataclass(slots=True)
class ErrorEvent:
    """The request failed after its stream started (engine failure, shutdown), or its
    disaggregated KV pull was refused (`status`)."""

    message: str  # what went wrong
    code: str = "internal_error"  # machine-readable kind
    type: str = "error"
    status: int | None = None  # a refusal sent in a stream already begun (a disaggregated
    # request's KV pull failed: see the module docstring): the HTTP status it stands for; None:
    # the request failed after it was accepted
    retry_after: float | None = None  # with `status`: the Retry-After it stands for, if any
    error: dict[str, Any] | None = None  # with `status`: the OpenAI error object it stands for
    param: str | None = None  # the client's field at fault, where one is (a constraint's)


Event = StartEvent | DeltaEvent | DoneEvent | ErrorEvent


# A blank line: "still here" from a worker whose request has nothing new to say yet (queued,
# prefilling, a long step). Readers skip it; a gateway fails a worker whose stream stays silent
# past its idle timeout, so a hung worker process costs a retry, not a stalled request.
KEEPALIVE = b"\n"
KEEPALIVE_S = 1.0  # silence on a stream after which the worker sends one


def encode_event(event: Event) -> bytes:
    """One NDJSON line."""
    return orjson.dumps(event) + b"\n"  # (orjson serializes dataclasses natively)


def decode_event(line: bytes) -> dict[str, Any]:
    """Parse one NDJSON line into a plain dict (the gateway reads fields, not classes)."""
    obj = orjson.loads(line)
    if not isinstance(obj, dict) or "type" not in obj:
        raise ValueError(f"not an event: {line[:80]!r}")
    return obj


@dataclass(slots=True)
class WorkerInfo:
    """A worker as the registry holds it (Redis hash `ei:w:{<worker_id>}`) and /internal/stats."""

    worker_id: str  # unique, stable for the process's life
    region: str  # region name from the catalog (infra/regions.yaml)
    model: str  # served model name
    role: Role  # prefill | decode | mixed
    url: str  # internal base URL, e.g. http://10.0.0.5:9001
    max_num_seqs: int  # requests it runs at once
    capacity_tokens: int  # KV-cache capacity in tokens
    running: int = 0  # requests running now
    waiting: int = 0  # requests queued
    load_tokens: int = 0  # tokens of running + waiting requests still to compute
    free_kv_blocks: int = 0  # free KV blocks
    total_kv_blocks: int = 0  # all KV blocks
    draining: bool = False  # refusing new requests (SIGTERM received)
    kv_addr: str = ""  # "host:port" of its KV transfer server (prefill side of a pull)
    prefill_tokens: int = 0  # prompt tokens of its running + waiting requests not yet computed
    decode_seqs: int = 0  # sequences past their prompt (decoding) now
    cache_id: str = ""  # prefix-cache identity (model revision, dtype, block size): equal ids,
    # equal block hashes for equal tokens; also names the tokenizer bundle in Redis
    block_size: int = 16  # tokens per KV block (block hashes cover this many tokens)
    started_at: float = 0.0  # unix time the worker started
    last_active_at: float = 0.0  # unix time a request last arrived or finished (idle detection)
    updated_at: float = 0.0  # unix time of the last heartbeat
    heartbeat_s: float = 0.0  # how often it heartbeats; 0: not said (an entry of an older worker)

    @property
    def overloaded(self) -> bool:
        """Every running slot is taken and requests are already queued behind them."""
        return self.draining or (self.running >= self.max_num_seqs and self.waiting > 0)

    def to_redis(self) -> dict[str, str]:
        return {k: orjson.dumps(v).decode() for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_redis(cls, raw: dict[bytes, bytes] | dict[str, str]) -> WorkerInfo:
        """The worker a registry hash describes. ValueError (naming the field) for a field of
        another type than the dataclass says: a hash written by something other than a worker
        of this version. Read as it was, one such entry (a count as a string) made every route
        of its model fail (TypeError comparing its load), for as long as it was there."""
        hints = _worker_field_types()  # (not `types`: the module of that name)
        values: dict[str, Any] = {}
        for k, v in raw.items():
            key = as_text(k)
            if key in hints:
                values[key] = _typed(key, hints[key], orjson.loads(v))
        return cls(**values)


@functools.cache
def _worker_field_types() -> dict[str, Any]:
    """WorkerInfo's fields and their types (resolved once: the annotations are strings)."""
    return typing.get_type_hints(WorkerInfo)


def _typed(name: str, hint: Any, value: Any) -> Any:
    """`value` if it is of type `hint` (a float field takes an int, as JSON writes 1.0 as 1;
    no number field takes a bool; an optional field takes null; a list or dict field a JSON
    array or object), else ValueError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{name} must be one of {args}, got {value!r}")
        return value
    if origin in (Union, types.UnionType):  # `X | None`: each of its types in turn
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _typed(name, arg, value)
            except ValueError:
                pass
        raise ValueError(f"{name} must be a JSON {hint}, got {value!r}")
    if origin in (list, dict):  # (the container's own type; its items are the writer's)
        hint = origin
    if hint is float and type(value) is int:  # (orjson reads one past 64 bits as a float)
        return float(value)
    if type(value) is not hint:
        raise ValueError(f"{name} must be a JSON {getattr(hint, '__name__', hint)}, got {value!r}")
    return value
