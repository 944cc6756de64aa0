"""The OpenAI request side: a decoded JSON body in, a worker `GenerateRequest` out.

`parse_chat` and `parse_completion` are the gateway's "validate" phase. They check every field
the endpoint accepts (type, range, combinations) and raise `APIError(400)` naming the field and
the limit, so the worker only ever sees requests that `SamplingParams(**sampling)` accepts. The
response side (SSE chunks, the final object) lives in `gateway.openai_response` and is
re-exported here, so handlers import one module.

Decisions worth knowing:
- `sampling` always holds every `SamplingParams` field, defaults included: the gateway's
  defaults differ from the engine's (chat's `max_tokens` is None = up to the context, the
  engine's is 16), so nothing may be left to the worker's defaults.
- Unknown fields are ignored (OpenAI clients send extras such as `metadata` or `store`, which
  change nothing in the answer), but features that change the answer (`functions`,
  vLLM's `use_beam_search`, OpenAI's `reasoning_effort`, ... : `OFF_ONLY`,
  `CHAT_OFF_ONLY`) are refused unless set to their "off" value: silently ignoring them gives
  wrong answers. So are an assistant message's deprecated `function_call` and its `refusal`
  text, which the prompt would otherwise lose. (`prediction` is ignored: a predicted output
  only makes answering faster, never different.)
- Structured output (`response_format`, vLLM's `guided_*` / `structured_outputs`) and tool
  calling (`tools`, `tool_choice`, tool messages) are validated in `gateway.structured`.
- Role "developer" is sent to the worker as "system": it is OpenAI's new name for the same
  thing, and open models' chat templates only know "system".
- Text content parts are joined with "\\n" (what vLLM does), so a client that splits a message
  into parts gets the same prompt from both. An assistant message's refusal parts (what OpenAI
  answered in place of text) are text too.
- Completions' `echo` is served as vLLM serves it: the worker computes the prompt's logprobs
  (`prompt_logprobs`, with logprobs' count) and the answer puts the prompt first; `max_tokens: 0`
  is taken with echo only (one token is generated and left out). vLLM's own `prompt_logprobs`
  (both endpoints, not streamed) is answered in vLLM's shape: a completions choice's, a chat
  response's `prompt_logprobs`, [null, {"<id>": {"logprob", "rank", "decoded_token"}}, ...].
- A completions `prompt` may hold a batch (several strings, or several token arrays): each prompt
  becomes a `GenerateRequest` of its own (the proxy sends them to workers concurrently), and
  choice p * n + j of the answer is prompt p's j-th completion, as OpenAI numbers them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from gateway.errors import invalid, unsupported
from gateway.fields import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    Fields,
    Range,
    check_number,
    is_int,
    same_json,
    type_name,
)
from gateway.openai_response import (
    SSE_DONE,
    ResponseAssembler,
    error_from_event,
    sse,
)
from gateway.structured import GUIDED_FIELDS, constraint, tool_message_fields, tools_of
from kvstore.keys import MAX_ID_LEN
from kvstore.protocol import GenerateRequest
from runtime.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_REPETITION_PENALTY,
)

__all__ = [
    "CHAT_FIELDS",
    "CHAT_OFF_ONLY",
    "COMPLETION_FIELDS",
    "COMPLETION_OFF_ONLY",
    "OFF_ONLY",
    "SSE_DONE",
    "RequestOptions",
    "ResponseAssembler",
    "error_from_event",
    "parse_chat",
    "parse_completion",
    "sse",
]

MAX_N = 16  # completions per request; n sequences share the prompt's KV blocks
MAX_STOP = 16  # stop strings; each is matched against every new piece of text
MAX_STOP_TOKEN_IDS = 256  # extra stop tokens
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit)
MAX_PROMPTS = 64  # prompts in one completions request, each its own request to a worker
ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

# Fields that change the answer and that the engine does not implement, each refused (a 400
# naming it) unless it is null or holds a value meaning "off", which a client that does not use
# the feature may still send: name -> (the "off" values, what the feature is and what to send).
# The values are compared as JSON (`false` is not 0). /openapi.json lists exactly these values.
OFF_ONLY: dict[str, tuple[tuple[object, ...], str]] = {  # vLLM's extras, both endpoints
    "use_beam_search": ((False,), "beam search; send false"),
    "allowed_token_ids": ((), "a token allow-list; send null"),
    "bad_words": (([],), "banned words; send []"),
    "skip_special_tokens": ((True,), "special tokens are always left out of the text; send true"),
    "spaces_between_special_tokens": ((True,), "send true"),
    "truncate_prompt_tokens": (
        (),
        "prompt truncation; send null (a prompt too long for the context is a 400)",
    ),
    "guided_whitespace_pattern": ((), "the grammar's own whitespace is used; send null"),
    "logits_processors": ((), "custom logits processors; send null"),
    "return_tokens_as_token_ids": ((False,), "send false"),
    "return_token_ids": ((False,), "the prompt's and the output's token ids; send false"),
    "cache_salt": ((), "a prefix cache kept apart per tenant; send null"),
}
COMPLETION_OFF_ONLY: dict[str, tuple[tuple[object, ...], str]] = {  # vLLM's completion extras
    "add_special_tokens": (
        (True,),
        "a text prompt is tokenized with the tokenizer's special tokens (its leading bos); send "
        "true, or send the prompt as token ids",
    ),
}
CHAT_OFF_ONLY: dict[str, tuple[tuple[object, ...], str]] = {
    # vLLM's chat extras
    "echo": ((False,), "echoing the prompt; send false"),
    "add_generation_prompt": (
        (True,),
        "the prompt always ends with the start of the assistant's turn; send true",
    ),
    "continue_final_message": ((False,), "continuing the last message; send false"),
    "chat_template": ((), "the model's own chat template is used; send null"),
    "chat_template_kwargs": (({},), "chat template variables; send {}"),
    "add_special_tokens": ((False,), "the chat template places the special tokens; send false"),
    "documents": ((), "documents for the chat template; send null"),
    # OpenAI's
    "reasoning_effort": ((), "reasoning effort; send null"),
    "verbosity": ((), "answer length; send null"),
    "modalities": ((["text"],), 'text is the only output; send ["text"]'),
    "audio": ((), "audio output; send null"),
    "web_search_options": ((), "web search; send null"),
}

_SAMPLING_FIELDS = frozenset(
    {
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "n",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "stream",
        "stream_options",
        "user",
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "stop_token_ids",
        "include_stop_str_in_output",
        "logit_bias",
        "prompt_logprobs",
        "response_format",
    }
    | GUIDED_FIELDS
    | OFF_ONLY.keys()
)
# Every field each endpoint reads; the OpenAPI spec's request schemas are tested against these.
CHAT_FIELDS = _SAMPLING_FIELDS | {
    "model",
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    *CHAT_OFF_ONLY,
}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {
    "model",
    "prompt",
    "logprobs",
    "echo",
    "suffix",
    "best_of",
    *COMPLETION_OFF_ONLY,
}


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What building the response needs to know about the request (the worker gets the rest)."""

    kind: Literal["chat", "completion"]  # which OpenAI object family to answer with
    model: str  # the model name as the client asked for it, echoed in every response object
    stream: bool  # answer with SSE chunks instead of one JSON object
    include_usage: bool  # stream_options.include_usage: a last chunk with `usage`
    n: int  # completions per prompt; prompt p's are choices p * n .. p * n + n - 1
    logprobs: int | None  # top alternatives per token when logprobs were asked for; None = off
    user: str | None = None  # the client's end-user id, for logs only
    prompts: int = 1  # prompts in the request (a completions batch), each sent on its own
    # the client's name for the completion's length limit: the worker says max_tokens (chat's
    # max_completion_tokens is sent as it), errors name what the client sent
    max_tokens_field: str = "max_tokens"
    # completions' echo: each choice's text (and logprobs) begins with its prompt's; the prompt
    # texts as sent (None: token ids, whose text the worker decodes), by prompt
    echo: bool = False
    prompt_texts: tuple[str | None, ...] = ()
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, nothing generated
    # vLLM's prompt_logprobs (not streamed): alternatives per prompt token in the answer's
    # `prompt_logprobs` (a completions choice's, a chat response's); None: not asked for
    prompt_logprobs: int | None = None


def parse_chat(
    body: object, request_id: str, session_id: str | None = None
) -> tuple[list[GenerateRequest], RequestOptions]:
    """Validate a `POST /v1/chat/completions` body: one request for the worker."""
    f = Fields(body, CHAT_FIELDS)
    model = _model(f)
    messages = _messages(f.raw("messages"))

    max_tokens = f.opt_int("max_tokens", Range(1, INT32_MAX))
    max_completion = f.opt_int("max_completion_tokens", Range(1, INT32_MAX))
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise invalid(
            "max_tokens",
            f"max_tokens ({max_tokens}) and max_completion_tokens ({max_completion}) differ; "
            "send only max_completion_tokens",
        )
    logprobs = f.boolean("logprobs", False)
    top = f.opt_int("top_logprobs", Range(0, MAX_LOGPROBS))
    if top and not logprobs:  # (0 asks for nothing: accepted, as vLLM and OpenAI do)
        raise invalid("top_logprobs", "top_logprobs > 0 requires logprobs: true")
    n_logprobs = (top or 0) if logprobs else None

    f.only_default("functions", ([],), "the deprecated functions; send tools")
    f.only_default(
        "function_call", ("none", "auto"), "the deprecated function_call; send tool_choice"
    )
    for name, (off, what) in CHAT_OFF_ONLY.items():
        f.only_default(name, off, what)
    tools, tool_choice = tools_of(f)

    sampling, options = _common(f, "chat", model, max_completion or max_tokens, n_logprobs)
    if max_completion is not None and max_tokens is None:
        options = replace(options, max_tokens_field="max_completion_tokens")
    forced = isinstance(tool_choice, dict) or tool_choice == "required"
    if forced and sampling["structured_outputs"] is not None:
        raise invalid(
            "tool_choice",
            f"tool_choice {tool_choice!r} forces a tool call; it cannot be combined with "
            "response_format or guided decoding",
        )
    request = GenerateRequest(
        request_id=request_id,
        model=model,
        messages=messages,
        sampling=sampling,
        session_id=session_id,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=f.boolean("parallel_tool_calls", True),
    )
    return [request], options


def parse_completion(
    body: object, request_id: str, session_id: str | None = None
) -> tuple[list[GenerateRequest], RequestOptions]:
    """Validate a `POST /v1/completions` body: a request for the worker per prompt (a batch of
    several gets ids `{request_id}-{p}`)."""
    f = Fields(body, COMPLETION_FIELDS)
    model = _model(f)
    prompts = _prompts(f.raw("prompt"))
    echo = f.boolean("echo", False)
    if not echo and same_json(f.raw("max_tokens"), 0):  # (as vLLM: the prompt alone, echoed)
        raise invalid(
            "max_tokens",
            f"max_tokens must be an integer in [1, {INT32_MAX}] (0 only with echo: true), got 0",
        )
    max_tokens = f.integer("max_tokens", 16, Range(0 if echo else 1, INT32_MAX))
    logprobs = f.opt_int("logprobs", Range(0, MAX_LOGPROBS))
    if f.opt_str("suffix"):
        raise unsupported("suffix", "suffix is not supported yet (insertion)")
    for name, (off, what) in COMPLETION_OFF_ONLY.items():
        f.only_default(name, off, what)
    for name in ("tools", "functions", "tool_choice", "function_call"):  # chat's, not ours
        if isinstance(body, dict) and body.get(name) not in (None, [], "none"):
            raise unsupported(
                name, f"{name} is for /v1/chat/completions; a completion has no tool calls"
            )
    # chat's name for max_tokens: ignored, it gave 16 tokens to a client that asked for more
    limit = f.body.get("max_completion_tokens")
    if limit is not None and not same_json(limit, f.raw("max_tokens")):
        raise invalid(
            "max_completion_tokens",
            "max_completion_tokens is for /v1/chat/completions; a completion's length limit is "
            "max_tokens",
        )

    sampling, options = _common(f, "completion", model, max_tokens, logprobs)
    best_of = f.opt_int("best_of", Range(1, MAX_N))  # (more than n is never taken)
    if best_of is not None and best_of not in (1, options.n):
        raise unsupported("best_of", f"best_of must be null, 1 or n ({options.n}); got {best_of}")
    # echo (vLLM's way): the prompt's logprobs, with logprobs' alternatives, are the worker's
    # prompt_logprobs; without logprobs, a token-id prompt's text still comes from the worker
    # (with prompt_logprobs 0); max_tokens 0 generates one token, which the answer leaves out
    if max_tokens == 0:
        sampling["max_tokens"] = 1
    asked = options.prompt_logprobs
    requests = [
        GenerateRequest(
            request_id=request_id if len(prompts) == 1 else f"{request_id}-{p}",
            model=model,
            prompt=prompt,
            sampling={**sampling, "prompt_logprobs": _echo_logprobs(echo, logprobs, prompt, asked)},
            session_id=session_id,
        )
        for p, prompt in enumerate(prompts)
    ]
    options = replace(options, prompts=len(prompts))
    if echo:
        texts = tuple(p if isinstance(p, str) else None for p in prompts)
        options = replace(options, echo=True, prompt_texts=texts, echo_only=max_tokens == 0)
    return requests, options


def _common(
    f: Fields,
    kind: Literal["chat", "completion"],
    model: str,
    max_tokens: int | None,
    logprobs: int | None,
) -> tuple[dict[str, Any], RequestOptions]:
    """The fields both endpoints share: sampling settings and streaming."""
    n = f.integer("n", 1, Range(1, MAX_N))
    stream = f.boolean("stream", False)
    stream_options = f.opt_object("stream_options")
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise invalid("stream_options", "stream_options is only allowed when stream is true")
        value = stream_options.get("include_usage")
        if value is not None and not isinstance(value, bool):
            raise invalid(
                "stream_options.include_usage",
                f"stream_options.include_usage must be a boolean, got {type_name(value)}",
            )
        include_usage = bool(value)
        value = stream_options.get("continuous_usage_stats")
        if value is not None and not isinstance(value, bool):
            raise invalid(
                "stream_options.continuous_usage_stats",
                f"stream_options.continuous_usage_stats must be a boolean, got {type_name(value)}",
            )
        if value:
            raise unsupported(
                "stream_options.continuous_usage_stats",
                "stream_options.continuous_usage_stats is not supported yet (usage on every "
                "chunk); send include_usage for a last chunk with usage",
            )
    for name, (off, what) in OFF_ONLY.items():
        f.only_default(name, off, what)

    min_tokens = f.integer("min_tokens", 0, Range(0, INT32_MAX))  # (vLLM's extra)
    if max_tokens is not None and min_tokens > max_tokens:
        chat_name = kind == "chat" and f.given("max_completion_tokens")
        name = "max_completion_tokens" if chat_name else "max_tokens"
        raise invalid(
            "min_tokens", f"min_tokens must be at most {name} ({max_tokens}), got {min_tokens}"
        )
    sampling: dict[str, Any] = {
        "n": n,
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
        "temperature": f.number("temperature", 1.0, Range(0, 2)),
        "top_p": f.number("top_p", 1.0, Range(0, 1, lo_open=True)),
        "top_k": f.integer("top_k", -1, Range(-1, INT32_MAX)),
        "min_p": f.number("min_p", 0.0, Range(0, 1)),
        "seed": f.opt_int("seed", Range(INT64_MIN, INT64_MAX)),
        "repetition_penalty": f.number(
            "repetition_penalty", 1.0, Range(0, MAX_REPETITION_PENALTY, lo_open=True)
        ),
        "presence_penalty": f.number("presence_penalty", 0.0, Range(-2, 2)),
        "frequency_penalty": f.number("frequency_penalty", 0.0, Range(-2, 2)),
        "stop": f.str_list("stop", MAX_STOP),
        "stop_token_ids": f.int_list("stop_token_ids", MAX_STOP_TOKEN_IDS, Range(0, INT32_MAX)),
        "ignore_eos": f.boolean("ignore_eos", False),
        "logprobs": logprobs,
        "include_stop_str_in_output": f.boolean("include_stop_str_in_output", False),
        "structured_outputs": constraint(f),
        "logit_bias": _logit_bias(f),
        "prompt_logprobs": _prompt_logprobs(f, stream),
    }
    options = RequestOptions(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=include_usage,
        n=n,
        logprobs=logprobs,
        user=f.opt_str("user"),
        prompt_logprobs=sampling["prompt_logprobs"],
    )
    return sampling, options


def _echo_logprobs(
    echo: bool, logprobs: int | None, prompt: str | list[int], asked: int | None
) -> int | None:
    """The prompt_logprobs the worker computes for a completion: what the client `asked` for
    (vLLM's field) and what `echo` needs (logprobs' count, or 0 for a token-id prompt's text
    alone; nothing for a text prompt without logprobs: the gateway has its text), the larger."""
    need = None
    if echo and logprobs is not None:
        need = logprobs
    elif echo and isinstance(prompt, list):
        need = 0
    return max((n for n in (need, asked) if n is not None), default=None)


def _prompt_logprobs(f: Fields, stream: bool) -> int | None:
    """vLLM's prompt_logprobs: alternatives per prompt token, in [0, MAX_LOGPROBS]; not with
    stream (as vLLM refuses it)."""
    value = f.opt_int("prompt_logprobs", Range(0, MAX_LOGPROBS))
    if value is not None and stream:
        raise invalid(
            "prompt_logprobs", "prompt_logprobs is not available when stream is true (as in vLLM)"
        )
    return value


def _logit_bias(f: Fields) -> dict[str, float]:
    """OpenAI's logit_bias: an object of at most MAX_LOGIT_BIAS_TOKENS token ids (string keys,
    as JSON has them) to biases in [-100, 100]; sent on as {"<id>": float} (the worker checks
    the ids against its model's vocabulary). Zero biases change nothing and are left out."""
    value = f.opt_object("logit_bias")
    if not value:
        return {}
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise invalid(
            "logit_bias",
            f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(value)}",
        )
    out: dict[str, float] = {}
    seen: set[int] = set()
    rng = Range(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    for key, bias in value.items():
        # (the length first: int() of a key of over 4,300 digits raised ValueError, a 500)
        if (not (key.isascii() and key.isdigit()) or len(key) > len(str(INT32_MAX))
                or int(key) > INT32_MAX):  # fmt: skip
            raise invalid(
                "logit_bias",
                f"logit_bias keys must be token ids, integers in [0, {INT32_MAX}], got "
                f"{_desc(key)}",
            )
        number = check_number("logit_bias", bias, rng)
        if (token := int(key)) in seen:  # ("012" beside "12": the second silently won)
            raise invalid("logit_bias", f"logit_bias gives token {token} twice")
        seen.add(token)
        if number:
            out[str(token)] = number
    return out


def _model(f: Fields) -> str:
    """The model's name, as long as a registry key allows (a longer one is served nowhere)."""
    model = f.required_str("model")
    if len(model) > MAX_ID_LEN:
        raise invalid(
            "model", f"model must be at most {MAX_ID_LEN} characters long, got {len(model)}"
        )
    return model


def _messages(value: object) -> list[dict[str, Any]]:
    """Chat messages as the worker's chat template takes them: role, content string, name."""
    if value is None:
        raise invalid("messages", "messages is required")
    if not isinstance(value, list) or not value:
        raise invalid("messages", f"messages must be a non-empty array, got {_desc(value)}")
    out: list[dict[str, Any]] = []
    calls: dict[str, str] = {}  # tool call id -> function name, from earlier assistant messages
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid(where, f"{where} must be an object, got {type_name(msg)}")
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise invalid(
                f"{where}.role",
                f"{where}.role must be one of {sorted(ROLES)}, got {_desc(role)}",
            )
        _dropped_message_fields(where, msg)
        tool_fields = tool_message_fields(where, msg, role, calls)
        item: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": _content(f"{where}.content", msg.get("content"), role),
            **tool_fields,
        }
        name = msg.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise invalid(
                    f"{where}.name", f"{where}.name must be a string, got {type_name(name)}"
                )
            item["name"] = name
        out.append(item)
    return out


def _dropped_message_fields(where: str, msg: dict[str, Any]) -> None:
    """Refuse what a message may carry that the chat template would not show: the model would
    answer a conversation other than the client's."""
    if msg.get("function_call") is not None:
        raise unsupported(
            f"{where}.function_call",
            f"{where}.function_call (deprecated) is not supported; send tool_calls",
        )
    refusal = msg.get("refusal")
    if refusal is not None and refusal != "":
        raise unsupported(
            f"{where}.refusal",
            f"{where}.refusal is not supported; send the refusal as a content part "
            '({"type": "refusal", "refusal": ...})',
        )


def _content(param: str, value: object, role: str) -> str:
    """A message's text: a string, or text parts (and, from the assistant, refusal parts) joined
    with newlines; null only for assistant."""
    if isinstance(value, str):
        return value
    if value is None:
        if role == "assistant":
            return ""
        raise invalid(param, f"{param} is required for role {role!r}")
    if not isinstance(value, list) or not value:
        raise invalid(
            param,
            f"{param} must be a string or a non-empty array of text parts, got {_desc(value)}",
        )
    texts = []
    for j, part in enumerate(value):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid(where, f"{where} must be an object, got {type_name(part)}")
        kind = part.get("type")
        key = "refusal" if kind == "refusal" and role == "assistant" else "text"
        if kind != key:
            raise unsupported(
                f"{where}.type",
                "only text content parts (and refusal parts in assistant messages) are "
                f"supported, got type {_desc(kind)}",
            )
        text = part.get(key)
        if not isinstance(text, str):
            raise invalid(
                f"{where}.{key}", f"{where}.{key} must be a string, got {type_name(text)}"
            )
        texts.append(text)
    return "\n".join(texts)


def _prompts(value: object) -> list[str | list[int]]:
    """A completions prompt as the prompts it holds: text or token ids, or a batch (an array)
    of either, at most MAX_PROMPTS."""
    if value is None:
        raise invalid("prompt", "prompt is required")
    if not (isinstance(value, list) and value and isinstance(value[0], (str, list))):
        return [_prompt(value, "prompt")]
    if len(value) > MAX_PROMPTS:
        raise invalid(
            "prompt",
            f"prompt holds {len(value)} prompts; at most {MAX_PROMPTS} per request",
        )
    return [_prompt(p, f"prompt[{i}]") for i, p in enumerate(value)]


def _prompt(value: object, where: str) -> str | list[int]:
    """One prompt: non-empty text (the engine takes no empty one), or token ids."""
    if isinstance(value, str):
        if not value:  # (the engine takes none; the start of a document is the bos token id)
            raise invalid("prompt", f"{where} must be a non-empty string")
        return value
    if not isinstance(value, list) or not value:
        raise invalid(
            "prompt",
            f"{where} must be a non-empty string or a non-empty array of token ids, "
            f"got {_desc(value)}",
        )
    for k, tok in enumerate(value):
        if not is_int(tok) or not 0 <= tok <= INT32_MAX:
            raise invalid(
                "prompt",
                f"{where}[{k}] must be a token id, an integer in [0, {INT32_MAX}], "
                f"got {_desc(tok)}",
            )
    return list(value)


def _desc(value: object) -> str:
    """A value for a message: short literals as themselves, others by type."""
    if isinstance(value, str):
        return repr(value) if len(value) <= 32 else "a long string"
    if is_int(value):
        return str(value)
    if isinstance(value, list) and not value:
        return "an empty array"
    return type_name(value)
