"""The chat templates' jinja2 environment (sandboxed, with transformers' extras), apart from
runtime.tokenizer so that jinja2 is imported only when a template is first compiled: its import
takes ~85 ms (its lexer's Unicode identifier pattern alone ~80 ms on a 2-vCPU host), a worker's
start-up does not need it, and a worker compiles its template once it serves
(Tokenizer.warm_chat_template).

A render is bounded (a template comes with the model, and a worker renders it on a thread that
nothing can stop): at most MAX_RENDER_STEPS steps (the items of every `range()`, every call,
attribute and item lookup, every piece of output), a prompt of at most MAX_RENDER_CHARS
characters, no '*' that builds a longer string or list, no '*' or '**' of integers past
MAX_INT_BITS bits. Past one, ChatTemplateError names the limit. Real templates are far inside
them: a conversation of thousands of messages takes some 10,000 steps."""

from __future__ import annotations

import contextvars
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2 import TemplateSyntaxError
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from runtime.tokenizer import ChatTemplateError

__all__ = ["TemplateRaised", "TemplateSyntaxError", "compile_template", "render"]

MAX_RENDER_STEPS = 2_000_000  # per render: range items, calls, lookups, pieces of output
MAX_RENDER_CHARS = 32 << 20  # the rendered prompt; a string or list a '*' builds
MAX_INT_BITS = 1 << 16  # an integer a '*' or '**' builds


def compile_template(source: str) -> jinja2.Template:
    """`source` compiled in the sandboxed environment (TemplateSyntaxError if it does not)."""
    return _environment().from_string(source)


def render(template: jinja2.Template, context: dict[str, Any]) -> str:
    """The template rendered; TemplateRaised for its raise_exception(), ChatTemplateError (a
    ValueError) for anything else that stops it (the error its cause): a template error (a
    sandbox violation, an undefined call), or a Python error raised by what the template does
    with the conversation ('+' of a string and a list of content parts: a TypeError; `1 // 0`).
    Either way the conversation is what the template cannot take: left as they were, the
    latter were tracebacks (`edgeinfer chat`, `LLM.chat`) or 500s (a ZeroDivisionError in the
    gateway and the worker, which answer a ValueError or TypeError 400)."""
    budget = _BUDGET.set(_Budget())
    try:
        pieces, chars = [], 0
        for piece in template.generate(**context):  # (what render joins, counted as it comes)
            chars += len(piece)
            if chars > MAX_RENDER_CHARS:
                raise TemplateLimit(f"a prompt of at most {MAX_RENDER_CHARS} characters")
            _spend(1)
            pieces.append(piece)
        return "".join(pieces)
    except TemplateRaised:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(str(e)) from e
    except Exception as e:  # (not BaseException: Ctrl-C stays an interrupt)
        raise ChatTemplateError(f"{type(e).__name__}: {e}") from e
    finally:
        _BUDGET.reset(budget)


class TemplateRaised(jinja2.TemplateError):
    """A template called raise_exception(message)."""


class TemplateLimit(jinja2.TemplateRuntimeError):
    """A render went past one of the module's limits (the message says which)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"the chat template went past a limit: {what}")


class _Budget:
    """Steps left to the render in progress (one per render, in _BUDGET)."""

    __slots__ = ("steps",)

    def __init__(self) -> None:
        self.steps = MAX_RENDER_STEPS


# The render in progress on this thread (or task): None outside `render`, which sets it
_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "chat_template_budget", default=None
)


def _spend(steps: int) -> None:
    budget = _BUDGET.get()
    if budget is None:
        return
    budget.steps -= steps
    if budget.steps < 0:
        raise TemplateLimit(
            f"at most {MAX_RENDER_STEPS} steps (range items, calls, lookups, output pieces)"
        )


def _range(*args: int) -> range:
    """jinja2's sandboxed range (at most its MAX_RANGE items), each item a step of the render
    (spent at once: range() in a loop of range() is what runs forever)."""
    rng = safe_range(*args)
    _spend(len(rng))
    return rng


def _check_product(left: Any, right: Any) -> None:
    for seq, n in ((left, right), (right, left)):
        if (
            isinstance(seq, (str, list, tuple))
            and isinstance(n, int)
            and len(seq) * n > MAX_RENDER_CHARS
        ):
            raise TemplateLimit(f"'*' builds a string or list of at most {MAX_RENDER_CHARS} items")
    both_ints = isinstance(left, int) and isinstance(right, int)
    if both_ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
        raise TemplateLimit(f"'*' and '**' build integers of at most {MAX_INT_BITS} bits")


def _check_power(base: Any, exponent: Any) -> None:
    both_ints = isinstance(base, int) and isinstance(exponent, int)
    if both_ints and abs(base) > 1 and (abs(base).bit_length() - 1) * exponent > MAX_INT_BITS:
        raise TemplateLimit(f"'*' and '**' build integers of at most {MAX_INT_BITS} bits")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with each call and lookup a step of the render's budget, and '*' and '**'
    checked before they build something too large."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            _check_product(left, right)
        elif operator == "**":
            _check_power(left, right)
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _spend(1)
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _spend(1)
        return super().getitem(obj, argument)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _spend(1)
        return super().call(__context, __obj, *args, **kwargs)


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) and
    render its body unchanged; we never need the assistant mask."""

    tags = {"generation"}  # type: ignore[misc]  # noqa: RUF012 (jinja2 declares it a plain attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; chat templates want plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _range
    return env
