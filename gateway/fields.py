"""Reading fields of an untrusted JSON object, each failure a 400 that names the field and limit.

The body of a request is whatever `orjson.loads` gave: any JSON type, any nesting. `Fields`
wraps it and offers one typed getter per kind of value; each getter checks type and range and
raises `APIError(400)` with `param` set to the field, and a message that states the accepted
range ("must be an integer in [1, 16], got 17"), so no TypeError or KeyError can escape from
parsing. JSON `null` means "not given" for every optional field: some OpenAI clients send
explicit nulls for unset parameters.

Booleans are not numbers here (Python's `True == 1` would let `"n": true` through), and NaN or
infinities are refused: orjson never produces them, but a body decoded by another parser
(Python's json accepts `NaN`) must not carry them into the sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard

from gateway.errors import invalid, unsupported

INT32_MAX = 2**31 - 1  # token ids and token counts fit here
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds: what torch.Generator and orjson accept


@dataclass(frozen=True, slots=True)
class Range:
    """A numeric interval, printed in the messages as users read it: "[0, 2]", "(0, 1]", ">= 1"."""

    lo: float | None = None  # lower bound; None = unbounded
    hi: float | None = None  # upper bound (always included); None = unbounded
    lo_open: bool = False  # the lower bound itself is excluded (top_p > 0, repetition_penalty > 0)

    def __contains__(self, x: float) -> bool:
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return False
        return self.hi is None or x <= self.hi

    def __str__(self) -> str:
        lo, hi = _fmt(self.lo), _fmt(self.hi)
        if self.lo is not None and self.hi is not None:
            return f"{'(' if self.lo_open else '['}{lo}, {hi}]"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {lo}"
        if self.hi is not None:
            return f"<= {hi}"
        return "any value"


def _fmt(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


def type_name(value: object) -> str:
    """The JSON name of a value's type, for messages ("got string", not "got str")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def is_int(value: object) -> TypeGuard[int]:
    """An integer that is not a boolean (JSON `true` is not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(param: str, value: object, rng: Range) -> int:
    """An integer inside `rng`; the message always states the range."""
    if not is_int(value):
        raise invalid(param, f"{param} must be an integer in {rng}, got {type_name(value)}")
    if value not in rng:
        raise invalid(param, f"{param} must be an integer in {rng}, got {value}")
    return value


def check_number(param: str, value: object, rng: Range) -> float:
    """A finite number inside `rng`, returned as float (ints are welcome: `"temperature": 1`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(param, f"{param} must be a number in {rng}, got {type_name(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise invalid(param, f"{param} must be a finite number in {rng}, got {value}")
    if value not in rng:
        raise invalid(param, f"{param} must be a number in {rng}, got {value}")
    return float(value)


class Fields:
    """The top-level object of a request body, read one declared field at a time.

    `known` is the set of fields the endpoint accepts. Reading a field outside it is a bug in
    the parser (the OpenAPI spec is tested against `known`, so an undeclared read would let the
    spec drift), hence an assert rather than a user-facing error. Fields the client sends that
    are not in `known` are ignored: OpenAI clients send extras this gateway has no use for
    (`metadata`, `store`, `service_tier`), which change nothing in the answer. A field that would
    change the answer and is not implemented must be declared and read with `only_default`, so
    that it is refused rather than ignored.
    """

    def __init__(self, body: object, known: frozenset[str]) -> None:
        if not isinstance(body, dict):
            raise invalid(None, f"request body must be a JSON object, got {type_name(body)}")
        self.body: dict[str, Any] = body
        self.known = known

    def raw(self, name: str) -> object:
        """The value as sent; None when absent or null."""
        assert name in self.known, f"parser reads undeclared field {name!r}"
        return self.body.get(name)

    def given(self, name: str) -> bool:
        return self.raw(name) is not None

    def required_str(self, name: str) -> str:
        value = self.raw(name)
        if value is None:
            raise invalid(name, f"{name} is required")
        if not isinstance(value, str) or not value:
            got = "an empty string" if value == "" else type_name(value)
            raise invalid(name, f"{name} must be a non-empty string, got {got}")
        return value

    def opt_str(self, name: str) -> str | None:
        value = self.raw(name)
        if value is not None and not isinstance(value, str):
            raise invalid(name, f"{name} must be a string, got {type_name(value)}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(name, f"{name} must be a boolean, got {type_name(value)}")
        return value

    def opt_int(self, name: str, rng: Range) -> int | None:
        value = self.raw(name)
        return None if value is None else check_int(name, value, rng)

    def integer(self, name: str, default: int, rng: Range) -> int:
        value = self.opt_int(name, rng)
        return default if value is None else value

    def number(self, name: str, default: float, rng: Range) -> float:
        value = self.raw(name)
        return default if value is None else check_number(name, value, rng)

    def opt_object(self, name: str) -> dict[str, Any] | None:
        value = self.raw(name)
        if value is not None and not isinstance(value, dict):
            raise invalid(name, f"{name} must be an object, got {type_name(value)}")
        return value

    def str_list(self, name: str, max_items: int) -> list[str]:
        """A string or a list of non-empty strings (OpenAI's `stop`); [] when absent."""
        value = self.raw(name)
        if value is None:
            return []
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise invalid(
                name,
                f"{name} must be a string or an array of at most {max_items} strings, "
                f"got {type_name(value)}",
            )
        if len(items) > max_items:
            raise invalid(name, f"{name} may hold at most {max_items} strings, got {len(items)}")
        for i, item in enumerate(items):
            if not isinstance(item, str) or not item:
                where = name if isinstance(value, str) else f"{name}[{i}]"
                got = "an empty string" if item == "" else type_name(item)
                raise invalid(where, f"{where} must be a non-empty string, got {got}")
        return list(items)

    def int_list(self, name: str, max_items: int, rng: Range) -> list[int]:
        """A list of integers in `rng`; [] when absent."""
        value = self.raw(name)
        if value is None:
            return []
        if not isinstance(value, list):
            raise invalid(name, f"{name} must be an array of integers, got {type_name(value)}")
        if len(value) > max_items:
            raise invalid(name, f"{name} may hold at most {max_items} items, got {len(value)}")
        return [check_int(f"{name}[{i}]", v, rng) for i, v in enumerate(value)]

    def only_default(self, name: str, defaults: tuple[object, ...], what: str) -> None:
        """Refuse a feature we do not implement unless it is set to a value meaning "off".

        Ignoring `tools` or `response_format` would return an answer the client did not ask
        for (plain text instead of a tool call or JSON), which is worse than a clear 400.
        """
        value = self.raw(name)
        if value is not None and not any(same_json(value, d) for d in defaults):
            raise unsupported(name, f"{name} is not supported yet ({what})")


def same_json(a: object, b: object) -> bool:
    """Equal as JSON values: Python's `False == 0` and `1 == 1.0` would let `"min_tokens": false`
    or `"echo": 0` pass for "off"."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        assert isinstance(b, list)
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    return a == b
