"""The request fields of structured output and tool calling, validated at the gateway.

- Output constraints, at most one per request: `response_format` (OpenAI: `text`, `json_object`,
  `json_schema` with `strict`), vLLM's `guided_json` / `guided_regex` / `guided_choice` /
  `guided_grammar` (a Lark grammar in llguidance's dialect) and `structured_outputs` (`json`,
  `regex`, `choice`, `grammar`, `json_object`). Each becomes the worker's
  `sampling["structured_outputs"]` and is compiled here with llguidance (runtime.structured,
  torch-free), so an invalid schema or a keyword the engine does not implement is a 400 that
  names the client's field (`response_format.json_schema.schema`), before any routing.
- `tools` (functions only) and `tool_choice` ("none", "auto", "required", or a named function);
  each tool's `parameters` is compiled the same way (400 on `tools[i].function.parameters`).
  (`parallel_tool_calls`, a boolean, goes to the worker as it is.)
  `strict` schemas (response_format and tools) forbid properties they do not list.
- Chat messages with tool calls: an assistant message's `tool_calls` (their `arguments` JSON
  text is parsed into an object, which is what chat templates expect; text that holds no JSON
  object the service can carry, such as a call cut by max_tokens, goes to the template as the
  string it is, as OpenAI takes any string) and `tool` messages, whose `tool_call_id` must name
  a call of an earlier assistant message.
"""

from __future__ import annotations

import re
from typing import Any

from gateway.errors import invalid, unsupported
from gateway.fields import Fields, type_name
from runtime.sampling_params import InvalidRequestError
from runtime.structured import StructuredOutputsParams, check, json_loads, strict_schema
from runtime.tool_parsers import make_parser

MAX_TOOLS = 128  # tools per request
# function / schema names (OpenAI's rule, and "."); \Z: "$" also matched before a final newline
_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}\Z")
GUIDED_FIELDS = frozenset(
    {
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "structured_outputs",
    }
)


def constraint(f: Fields) -> dict[str, Any] | None:
    """The request's output constraint as `StructuredOutputsParams` fields, or None."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = f.raw("response_format")
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    guided = {
        "guided_json": "json",
        "guided_regex": "regex",
        "guided_choice": "choice",
        "guided_grammar": "grammar",
    }
    for name, key in guided.items():
        value = f.raw(name)
        if value is not None:
            found.append((name, _spec(name, {key: value})))
    backend = f.raw("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise invalid("guided_decoding_backend", "guided_decoding_backend must be a string")
    so = f.raw("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise invalid(
                "structured_outputs", f"structured_outputs must be an object, got {type_name(so)}"
            )
        known = {"json", "regex", "choice", "grammar", "json_object"}
        fields = {k: v for k, v in so.items() if v is not None and v is not False}
        unknown = set(fields) - known
        if unknown:
            raise unsupported(
                f"structured_outputs.{sorted(unknown)[0]}",
                f"structured_outputs supports {sorted(known)}",
            )
        found.append(("structured_outputs", _spec("structured_outputs", fields)))
    if len(found) > 1:
        raise invalid(
            found[1][0], f"{found[1][0]} and {found[0][0]} both constrain the output; send one"
        )
    if not found:
        return None
    spec = found[0][1]
    return {
        k: getattr(spec, k)
        for k in ("json", "regex", "choice", "grammar", "json_object", "param")
        if getattr(spec, k) not in (None, False)
    }


# The keys OpenAI's response_format takes, by type, and its json_schema's; any other is refused
# (as OpenAI does): a schema sent under another key would otherwise be dropped without a word.
_RF_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
_JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})


def _refuse_unknown(param: str, obj: dict[str, Any], known: set[str] | frozenset[str]) -> None:
    unknown = sorted(str(k) for k in obj if k not in known)
    if unknown:
        raise invalid(
            f"{param}.{unknown[0]}",
            f"{param} takes only {', '.join(sorted(known))} here; unknown: {', '.join(unknown)}",
        )


def _response_format(rf: object) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict):
        raise invalid("response_format", f"response_format must be an object, got {type_name(rf)}")
    kind = rf.get("type")
    if isinstance(kind, str) and kind in _RF_KEYS:
        _refuse_unknown("response_format", rf, _RF_KEYS[kind])
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("response_format", {"json_object": True})
    if kind != "json_schema":
        raise invalid(
            "response_format.type",
            "response_format.type must be one of "
            f"'text', 'json_object', 'json_schema', got {_short(kind)}",
        )
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise invalid(
            "response_format.json_schema",
            "response_format.json_schema must be an object with name and schema",
        )
    _refuse_unknown("response_format.json_schema", js, _JSON_SCHEMA_KEYS)
    name = js.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise invalid(
            "response_format.json_schema.name",
            "response_format.json_schema.name must "
            "be 1-64 characters of a-z, A-Z, 0-9, '_', '-', '.'",
        )
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(
            "response_format.json_schema.strict",
            "response_format.json_schema.strict must be a boolean",
        )
    schema = js.get("schema", {"type": "object"})
    param = "response_format.json_schema.schema"
    if not isinstance(schema, dict):
        raise invalid(param, f"{param} must be a JSON schema object, got {type_name(schema)}")
    return _spec(param, {"json": strict_schema(schema) if strict else schema})


def _spec(param: str, fields: dict[str, Any]) -> StructuredOutputsParams:
    """A compiled-and-checked constraint; 400 naming `param` when llguidance refuses it."""
    try:
        # (the field travels with it: the worker's compile, with the model's tokenizer, can
        # still refuse it, and names it then)
        spec = StructuredOutputsParams(**fields, param=param)
        check(spec, param)
    except InvalidRequestError as e:
        # structured_outputs' own fields are the client's (structured_outputs.regex); the other
        # fields hold one value each, named as sent
        where = e.param if param == "structured_outputs" else param
        raise invalid(where, f"{where}: {e.message}") from e
    except TypeError as e:
        raise invalid(param, f"{param}: {e}") from e
    return spec


def tools_of(f: Fields) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any] | None]:
    """(tools, tool_choice) for the worker: None, None when no tools are given."""
    raw = f.raw("tools")
    choice = f.raw("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        # (a subset of the tools the model may call, mode "auto" or "required": refused by name,
        # not as a misspelt named choice)
        raise unsupported(
            "tool_choice",
            "tool_choice {'type': 'allowed_tools', ...} is not supported; send the allowed tools "
            "as tools, with tool_choice 'auto' or 'required'",
        )
    if raw is None or raw == []:
        if choice is None or choice == "none":
            return None, None
        # (OpenAI's 400; "auto" was taken, as if no tool_choice were sent)
        raise invalid(
            "tool_choice",
            "tool_choice requires tools: tool_choice is only allowed when tools are specified, "
            f"got {_short(choice)} without tools",
        )
    if not isinstance(raw, list):
        raise invalid("tools", f"tools must be an array, got {type_name(raw)}")
    if len(raw) > MAX_TOOLS:
        raise invalid("tools", f"tools may hold at most {MAX_TOOLS} tools, got {len(raw)}")
    tools: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(raw):
        tools.append(_tool(f"tools[{i}]", tool, names))
    if choice is None:
        return tools, "auto"
    if choice == "required":
        _together(tools)
    if choice in ("none", "auto", "required"):
        return tools, choice
    if isinstance(choice, str):
        raise invalid(
            "tool_choice",
            "tool_choice must be 'none', 'auto', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {_short(choice)}",
        )
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise invalid(
            "tool_choice", "a named tool_choice is {'type': 'function', 'function': {'name': ...}}"
        )
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise invalid("tool_choice.function.name", "tool_choice.function.name must be a string")
    if name not in names:
        raise invalid(
            "tool_choice.function.name",
            f"tool_choice names function {_short(name)}, "
            f"which is not among tools ({sorted(names)})",
        )
    return tools, {"type": "function", "function": {"name": name}}


def _together(tools: list[dict[str, Any]]) -> None:
    """tool_choice "required" constrains the output to a call of any of `tools`: one schema
    holding them all, which llguidance may refuse where it took each alone ("schema too large":
    96 tools of 14 enum properties, 0.4 MB). Compiled here as the worker builds it
    (runtime/tool_parsers.py, whose formats differ in the text around it), so the 400 names
    `tools`, which the client can change: the worker's named tool_choice."""
    schema = make_parser("hermes", "", {})._call_schema(tools)
    try:
        check(StructuredOutputsParams(json=schema), "tools")
    except InvalidRequestError as e:
        raise invalid("tools", f"tools: {len(tools)} tools together are more than the grammar "
                      "engine takes for tool_choice 'required' (send fewer or smaller tools): "
                      f"{e.message}") from e  # fmt: skip


def _tool(where: str, tool: object, names: set[str]) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise invalid(where, f"{where} must be an object, got {type_name(tool)}")
    if tool.get("type") != "function":
        raise unsupported(f"{where}.type", f"{where}.type: only 'function' tools are supported")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise invalid(f"{where}.function", f"{where}.function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise invalid(
            f"{where}.function.name",
            f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, '_', '-', '.'",
        )
    if name in names:
        raise invalid(f"{where}.function.name", f"{where}.function.name: {name!r} is given twice")
    names.add(name)
    out: dict[str, Any] = {"name": name}
    desc = fn.get("description")
    if desc is not None:
        if not isinstance(desc, str):
            raise invalid(
                f"{where}.function.description", f"{where}.function.description must be a string"
            )
        out["description"] = desc
    params = fn.get("parameters")
    param = f"{where}.function.parameters"
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise invalid(param, f"{param} must be a JSON schema object, got {type_name(params)}")
    if params.get("type", "object") != "object":
        raise invalid(param, f"{param} must describe an object (type 'object')")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{where}.function.strict", f"{where}.function.strict must be a boolean")
    out["parameters"] = strict_schema(params) if strict else params
    _spec(param, {"json": out["parameters"]})
    return {"type": "function", "function": out}


def tool_message_fields(
    where: str, msg: dict[str, Any], role: str, calls: dict[str, str]
) -> dict[str, Any]:
    """The tool-calling fields of message `msg` for the chat template: an assistant's
    `tool_calls` (ids recorded in `calls`, id -> function name), a tool message's
    `tool_call_id` (and the function's `name`)."""
    out: dict[str, Any] = {}
    raw = msg.get("tool_calls")
    if raw is not None and raw != []:
        if role != "assistant":
            raise invalid(
                f"{where}.tool_calls",
                f"{where}.tool_calls: only assistant messages carry tool calls",
            )
        if not isinstance(raw, list):
            raise invalid(f"{where}.tool_calls", f"{where}.tool_calls must be an array")
        out["tool_calls"] = [_call(f"{where}.tool_calls[{j}]", c, calls) for j, c in enumerate(raw)]
    if role == "tool":
        cid = msg.get("tool_call_id")
        if not isinstance(cid, str) or not cid:
            raise invalid(
                f"{where}.tool_call_id",
                f"{where}.tool_call_id is required for role 'tool' (the id of the call it answers)",
            )
        if cid not in calls:
            raise invalid(
                f"{where}.tool_call_id",
                f"{where}.tool_call_id {_short(cid)} matches "
                "no tool call of an earlier assistant message",
            )
        out["tool_call_id"] = cid
        out["name"] = calls[cid]
    return out


def _call(where: str, call: object, calls: dict[str, str]) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise invalid(where, f"{where} must be an object, got {type_name(call)}")
    cid = call.get("id")
    if not isinstance(cid, str) or not cid:
        raise invalid(f"{where}.id", f"{where}.id must be a non-empty string")
    if call.get("type", "function") != "function":
        raise unsupported(f"{where}.type", f"{where}.type: only 'function' calls are supported")
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise invalid(f"{where}.function", f"{where}.function must be an object with a name")
    args, param = fn.get("arguments", "{}"), f"{where}.function.arguments"
    if not isinstance(args, str):
        raise invalid(param, f"{param} must be a string (the call's arguments as JSON text)")
    calls[cid] = fn["name"]
    function = {"name": fn["name"], "arguments": _arguments(args)}
    return {"id": cid, "type": "function", "function": function}


def _arguments(args: str) -> dict[str, Any] | str:
    """A call's arguments for the chat template: the object its JSON text holds (what
    templates expect, as vLLM's json.loads gives them), or else the text as it was sent. OpenAI
    takes any string here, and a call that max_tokens cut (`{"city": "Par`, or "" for a named
    call cut in its name) comes back in the next request's history as the answer gave it.
    The text is kept, too, where its object could not cross to the worker (an integer beyond
    64 bits, NaN, nesting deeper than MAX_JSON_DEPTH): a template shows it as it stands."""
    try:
        # (a model's own arguments, sent back: raw newlines in strings, as it wrote them)
        parsed = json_loads(args, strict=False)
    except ValueError:
        return args
    return parsed if isinstance(parsed, dict) else args


def _short(value: object) -> str:
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else "a long string"
    return type_name(value)
