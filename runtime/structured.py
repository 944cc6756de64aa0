"""Structured output: what a request's output must match, as a grammar for llguidance.

A constraint (`StructuredOutputsParams`, vLLM's `structured_outputs`) is one of: a JSON schema,
any JSON object, a regular expression, a choice among strings, or a Lark grammar (tool calls
with `tool_choice` required or named use one, built by runtime/tool_parsers.py). `grammar_text`
turns it into llguidance's grammar string, which is also the key of the compiled-grammar cache
(runtime/structured_decoding.py); `check` compiles it without a tokenizer and raises
`InvalidRequestError` naming the field when llguidance refuses it (an invalid schema, a schema
keyword it does not implement, a bad regex), so the gateway answers 400 before routing.

Why llguidance (measured on this project's CPU, bench/structured.py and bench/README.md): it
refuses the JSON-schema keywords it does not implement (`uniqueItems`, `not`, `if`/`then`,
`propertyNames`, `dependentRequired`) where xgrammar 0.2.8 silently ignores three of them and
lets output through that the schema forbids; a schema compiles in ~2 ms (xgrammar: ~280 ms,
which would stall a step); it depends on nothing (xgrammar needs torch, transformers, triton),
so the torch-free gateway validates with it too; its masks cost tens of microseconds a token.

JSON is generated compactly with the separators models write (", " and ": ") and no free
whitespace, so a model cannot loop on whitespace; a schema's own "x-guidance" options win.

Torch-free: the gateway imports this module; llguidance is imported on first use.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from runtime.sampling_params import InvalidRequestError

# llguidance's JSON options (a schema's "x-guidance" overrides them).
JSON_OPTIONS: Any = {  # llguidance's JsonCompileOptions (a TypedDict)
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
MAX_CHOICES = 1024  # strings in a choice constraint
MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar, as text
# levels of nested arrays and objects in a schema or a tool call's arguments: the limit of the
# JSON parser inside llguidance (serde_json's), so a schema nested deeper could not compile
MAX_JSON_DEPTH = 128
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the integers orjson can send on


@dataclass(slots=True)
class StructuredOutputsParams:
    """One constraint on a request's output; exactly one field is set."""

    json: dict[str, Any] | str | None = None  # a JSON schema (an object, or its JSON text)
    regex: str | None = None  # the whole output matches this regular expression
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a Lark grammar in llguidance's dialect
    json_object: bool = False  # the output is any JSON object
    # the client's field that asked for it ("guided_json", "tool_choice", ...), which errors
    # name: a worker's refusal (its compile with the tokenizer) names what the client sent
    param: str | None = None

    def validate(self, param: str | None = None) -> None:
        """Shape checks (types, exactly one constraint); `check` compiles it. Errors name
        `param`, else the field the constraint came from, else "structured_outputs"."""
        if self.param is not None and not isinstance(self.param, str):  # (before it names errors:
            # a param of 5 was reported as "5.param")
            raise InvalidRequestError(
                f"{param or 'structured_outputs'}.param",
                f"must be a string, got {type(self.param).__name__}",
            )
        param = param or self.param or "structured_outputs"
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise InvalidRequestError(
                param,
                "give exactly one of json, regex, choice, grammar, json_object; "
                f"got {given or 'none'}",
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError(f"{param}.json", "must be a JSON schema object or its text")
        if isinstance(self.json, str):
            try:
                self.json = json_loads(self.json)
            except ValueError as e:
                raise InvalidRequestError(f"{param}.json", str(e)) from e
            if not isinstance(self.json, dict):
                raise InvalidRequestError(f"{param}.json", "must be a JSON schema object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{param}.{name}", "must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, list)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise InvalidRequestError(
                    f"{param}.choice", "must be a non-empty array of non-empty strings"
                )
            if len(self.choice) > MAX_CHOICES:
                raise InvalidRequestError(
                    f"{param}.choice", f"at most {MAX_CHOICES} choices, got {len(self.choice)}"
                )
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError(f"{param}.json_object", "must be a boolean")

    @classmethod
    def coerce(cls, value: object, param: str = "structured_outputs") -> StructuredOutputsParams:
        """From a dict (as it crosses a process boundary) or an instance."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(param, "must be an object")
        unknown = set(value) - set(cls.__slots__)  # type: ignore[attr-defined]
        if unknown:
            raise InvalidRequestError(param, f"unknown fields {sorted(unknown)}")
        return cls(**value)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar string for a validated constraint."""
    import llguidance

    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else {"type": "object"}
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
    if spec.regex is not None:
        return str(llguidance.LLMatcher.grammar_from_regex(spec.regex))
    if spec.choice is not None:
        alternatives = " | ".join(json.dumps(c) for c in spec.choice)  # Lark string literals
        return str(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}"))
    assert spec.grammar is not None
    return str(llguidance.LLMatcher.grammar_from_lark(spec.grammar))


def check(spec: StructuredOutputsParams, param: str = "structured_outputs") -> str:
    """Validate and compile (without a tokenizer) a constraint; return its grammar text.

    `param` names the field in errors (the gateway passes the client's, e.g.
    "response_format.json_schema.schema").
    """
    import llguidance

    text = checked_text(spec, param)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        what = "JSON schema" if spec.json is not None else "constraint"
        raise InvalidRequestError(param, f"invalid or unsupported {what}: {_first(messages)}")
    return text


def checked_text(spec: StructuredOutputsParams, param: str = "structured_outputs") -> str:
    """`check` without its compile: the shape, size and number checks, and the grammar text. A
    worker, which compiles with the tokenizer (and finds what this compile would, and more),
    takes this: both cost a grammar near the size limit its compile time twice."""
    spec.validate(param)
    if spec.json is not None:  # (before json.dumps: a cycle or a value it cannot write)
        check_json_data(spec.json, param)
    size = len(json.dumps(spec.json)) if spec.json is not None else len(spec.regex or "")
    size = max(size, len(spec.grammar or ""), sum(len(c) for c in spec.choice or []))
    if size > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(param, f"at most {MAX_GRAMMAR_CHARS} characters, got {size}")
    low = _below_int64(spec.json) if spec.json is not None else _lark_below_int64(spec.grammar)
    if low is not None:  # (llguidance's compile would crash the process on it)
        raise InvalidRequestError(
            param, f"holds the number {_clip(str(low))}: the grammar engine takes no number at "
            "or below -2**63 (-9223372036854775808) where an integer may stand",
        )  # fmt: skip
    try:
        return grammar_text(spec)
    except ValueError as e:  # not a JSON object, or not serializable
        raise InvalidRequestError(param, f"invalid: {e}") from e


# llguidance (1.9) turns a schema's integers and integral bounds into 64-bit integers, saturating,
# and a range that ends at -2**63 at both ends (`{"type": "integer", "const": -1e19}`, an integer
# literal -9223372036854775808 in any const or enum, bounds such as minimum -1e30 and maximum
# -1e25) recurses until the process dies of SIGSEGV: the gateway with it, which compiles every
# schema to check it. A schema (or a Lark grammar's %json schema) holding such a number where
# an integer may stand is refused before llguidance sees it.
INT64_FLOOR = -(2.0**63)
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_JSON_AT = re.compile(r"%json\s*")


def _below_int64(schema: Any) -> int | float | None:
    """The first number of the JSON schema `schema` at or below -2**63 (as a 64-bit float:
    -2**63 + 512 rounds to it) that llguidance could take for an integer: an integer in a bound,
    const or enum; a float there in a schema of type "integer", or of no type in a schema that
    has one of type "integer" (allOf and $ref merge schemas); None if there is none. Read as a
    schema: a property named "const" or "default" is a schema, the values of `const` and `enum`
    are data (their "integer" is no type), and `default` and `examples` are not read
    (llguidance does not read them)."""
    nodes: list[dict[str, Any]] = []
    level, seen = [schema], 0
    while level and seen <= MAX_JSON_DEPTH:  # (check refuses deeper schemas)
        deeper: list[Any] = []
        for node in level:
            if isinstance(node, list):
                deeper.extend(node)
            elif isinstance(node, dict):
                nodes.append(node)
                for key, value in node.items():
                    if key in SCHEMA_MAPS and isinstance(value, dict):
                        deeper.extend(value.values())
                    elif key not in DATA_KEYWORDS and isinstance(value, (dict, list)):
                        deeper.append(value)
        level, seen = deeper, seen + 1

    def integer(kind: Any) -> bool:
        return kind == "integer" or (isinstance(kind, list) and "integer" in kind)

    any_integer = any(integer(n.get("type")) for n in nodes)
    for node in nodes:
        kind = node.get("type")
        floats = integer(kind) or (kind is None and any_integer)
        numbers = [node[k] for k in _BOUNDS if k in node]
        for v in numbers + _numbers([node[k] for k in ("const", "enum") if k in node]):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if isinstance(v, int) and v <= -(2**63) + 512:
                return v
            if isinstance(v, float) and floats and v <= INT64_FLOOR:
                return v
    return None


def _numbers(data: list[Any]) -> list[Any]:
    """Every number in JSON data (nested arrays and objects), level by level."""
    out: list[Any] = []
    level = data
    while level:
        deeper: list[Any] = []
        for v in level:
            if isinstance(v, dict):
                deeper.extend(v.values())
            elif isinstance(v, list):
                deeper.extend(v)
            else:
                out.append(v)
        level = deeper
    return out


def _lark_below_int64(grammar: str | None) -> int | float | None:
    """`_below_int64` for each %json schema of a Lark grammar (each read as JSON from where it
    starts, not the rest of the grammar: a "-10000000000000000000" in a string literal is
    text); None if there is none or it is not JSON (llguidance says what is wrong then)."""
    if grammar is None or "%json" not in grammar:
        return None
    decoder = json.JSONDecoder()
    for m in _JSON_AT.finditer(grammar):
        try:
            schema, _ = decoder.raw_decode(grammar, m.end())
        except (ValueError, RecursionError):
            continue
        if (low := _below_int64(schema)) is not None:
            return low
    return None


# JSON-schema keywords whose values are data, not schemas (nothing in them is a schema keyword:
# a "$ref" there is no reference, "properties" no properties); and those whose values map names
# to schemas (a property may be named "const" or "properties")
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                         "dependentSchemas"})  # fmt: skip


def strict_schema(schema: Any, depth: int = 0) -> Any:
    """A copy of a JSON schema where every object schema that lists `properties` and does not
    say `additionalProperties` forbids other properties (OpenAI's strict mode: the schema
    describes the whole object). Data (`const`, `enum`, `default`, `examples`) is left as it is,
    and a map of schemas (`properties`, `$defs`, ...) is no schema itself, only its values are.
    Below MAX_JSON_DEPTH levels the rest is left as it is: `check` refuses such a schema, and
    copying it would only recurse as deep as the client nested it."""
    if depth > MAX_JSON_DEPTH:
        return schema
    if isinstance(schema, list):
        return [strict_schema(s, depth + 1) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in DATA_KEYWORDS:
            out[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: strict_schema(s, depth + 2) for name, s in value.items()}
        else:
            out[key] = strict_schema(value, depth + 1)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_loads(text: str, strict: bool = True) -> Any:
    """JSON text as Python values, within what the service can carry; ValueError saying why
    not: text that is not JSON (Python's parser also takes NaN and Infinity, and makes 1e400
    infinity, all of which orjson would send on as null), an integer outside 64 bits (orjson
    cannot send it), or nesting deeper than MAX_JSON_DEPTH (deep enough, Python's parser runs
    out of stack). `strict=False` takes raw control characters (newlines, tabs) inside
    strings, as models write them in a tool call's arguments."""
    too_deep = f"nests deeper than {MAX_JSON_DEPTH} levels"
    try:
        value = json.loads(text, parse_int=_int64, parse_float=_float64, parse_constant=_not_json,
                           strict=strict)  # fmt: skip
    except RecursionError as e:
        raise ValueError(too_deep) from e
    except json.JSONDecodeError as e:
        raise ValueError(f"is not valid JSON: {e}") from e
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ValueError(too_deep)
    return value


def _int64(digits: str) -> int:
    value = int(digits) if len(digits) <= 20 else INT64_MAX + 1  # (no 4,300-digit conversions)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(
            f"holds the integer {_clip(digits)}, outside the 64-bit range [{INT64_MIN}, {INT64_MAX}]"
        )
    return value


def _float64(digits: str) -> float:
    value = float(digits)
    if not math.isfinite(value):  # (1e400: Python's json makes it infinity)
        raise ValueError(f"holds the number {_clip(digits)}, beyond the range of a 64-bit float")
    return value


def _clip(digits: str) -> str:
    return digits if len(digits) <= 24 else f"{digits[:24]}..."


def _not_json(name: str) -> Any:
    raise ValueError(f"is not valid JSON: {name} is not a JSON value")


def json_depth(value: Any) -> int:
    """Levels of nested arrays and objects in `value` (0 for a number or a string), counted
    level by level: no recursion, whatever the depth. Counting stops past MAX_JSON_DEPTH (it
    returns MAX_JSON_DEPTH + 1 then), and an array or object held several times in a level is
    read once there: Python values that refer to themselves (`s["self"] = s`) looped forever,
    or doubled a list each level until MemoryError, and `a = [a, a]` nested 30 times read 2**30
    leaves."""
    depth, level = 0, [value]
    while depth <= MAX_JSON_DEPTH:
        containers = {id(v): v for v in level if isinstance(v, (list, tuple, dict))}
        if not containers:
            break
        depth += 1
        level = [x for v in containers.values() for x in (v.values() if isinstance(v, dict) else v)]
    return depth


# Values (arrays, objects, strings, numbers, true, false, null) a schema may hold, counted as the
# JSON text writes them out (a value held twice, twice): each takes at least a character, so a
# schema holding more is longer than MAX_GRAMMAR_CHARS anyway, and no more are read
MAX_JSON_VALUES = MAX_GRAMMAR_CHARS


def check_json_data(value: Any, param: str) -> None:
    """Refuse (InvalidRequestError naming `param`) a schema given as Python values that is not
    JSON data, before json.dumps or llguidance read it: a value JSON has no type for (a set,
    bytes, an object: json.dumps raised TypeError), a key that is not a string, a number that
    is not finite (llguidance read inf as null), an array or object that holds itself (a cycle:
    json_depth looped forever), nesting deeper than MAX_JSON_DEPTH, or more than
    MAX_JSON_VALUES values as the text would write them (`a = [a, a]` nested 30 times holds
    2**31 leaves in a few objects: json.dumps would write them all). Errors say where (the keys
    and indices from the top)."""
    path: list[str | int] = []
    ancestors: set[int] = set()  # the arrays and objects `path` goes through
    left = MAX_JSON_VALUES

    def where() -> str:
        text = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path)
        return f" at {text.removeprefix('.')}" if path else ""

    def walk(v: Any) -> None:
        nonlocal left
        left -= 1
        if left < 0:
            raise InvalidRequestError(
                param, f"holds more than {MAX_JSON_VALUES} values (arrays, objects, strings, "
                f"numbers, ...) as JSON text: longer than the limit of {MAX_GRAMMAR_CHARS} "
                "characters (an object held in several places counts in each)",
            )  # fmt: skip
        if v is None or isinstance(v, (str, bool, int)):
            return
        if isinstance(v, float):
            if not math.isfinite(v):
                raise InvalidRequestError(param, f"holds the number {v}{where()}: JSON numbers "
                                          "are finite")  # fmt: skip
            return
        if not isinstance(v, (dict, list, tuple)):
            raise InvalidRequestError(
                param, f"holds a value of type {type(v).__name__}{where()}, which is not JSON "
                "(give objects, arrays, strings, numbers, true, false, null)",
            )  # fmt: skip
        if id(v) in ancestors:
            raise InvalidRequestError(
                param, f"holds itself{where()}: a cycle nests deeper than {MAX_JSON_DEPTH} "
                "levels, without end",
            )  # fmt: skip
        if len(ancestors) >= MAX_JSON_DEPTH:
            raise InvalidRequestError(param, f"nests deeper than {MAX_JSON_DEPTH} levels")
        ancestors.add(id(v))
        if isinstance(v, dict):
            for key, x in v.items():
                if not isinstance(key, str):
                    raise InvalidRequestError(
                        param, f"has the key {_clip(repr(key))} of type {type(key).__name__}"
                        f"{where()}: JSON object keys are strings",
                    )  # fmt: skip
                path.append(key)
                walk(x)
                path.pop()
        else:
            for i, x in enumerate(v):
                path.append(i)
                walk(x)
                path.pop()
        ancestors.discard(id(v))

    walk(value)


def _first(messages: list[str]) -> str:
    """The compiler's first message on one line (a regex error spans several: the pattern, a
    caret under the fault, then what is wrong)."""
    text = messages[0] if messages else "rejected by the grammar compiler"
    return " ".join(text.split())[:300]
