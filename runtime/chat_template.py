"""The chat templates' jinja2 environment (sandboxed, with transformers' extras), apart from
runtime.tokenizer so that jinja2 is imported only when a template is first compiled: its import
takes ~85 ms (its lexer's Unicode identifier pattern alone ~80 ms on a 2-vCPU host), a worker's
start-up does not need it, and a worker compiles its template once it serves
(Tokenizer.warm_chat_template)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime.tokenizer import ChatTemplateError

__all__ = ["TemplateRaised", "TemplateSyntaxError", "compile_template", "render"]


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
    try:
        return template.render(**context)
    except TemplateRaised:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(str(e)) from e
    except Exception as e:  # (not BaseException: Ctrl-C stays an interrupt)
        raise ChatTemplateError(f"{type(e).__name__}: {e}") from e


class TemplateRaised(jinja2.TemplateError):
    """A template called raise_exception(message)."""


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
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
