"""The chat templates' jinja2 environment (sandboxed, with transformers' extras), apart from
runtime.tokenizer so that jinja2 is imported only when a template is first compiled: its import
takes ~85 ms (its lexer's Unicode identifier pattern alone ~80 ms on a 2-vCPU host), a worker's
start-up does not need it, and a worker compiles its template once it serves
(Tokenizer.warm_chat_template).

A render is bounded (a template comes with the model, and a worker renders it on a thread that
nothing can stop): at most MAX_RENDER_STEPS steps (the items of every `range()`, of every
`{% for %}`, of a recursive loop's `loop(items)` and of every filter that goes item by item,
an iterator's as they come, every call, attribute and item lookup, every piece of output,
every item of a container turned into text, every word lipsum() may make, every item a
string's split() may make, every item of what is compared or hashed, as many times as it is
reached, and every 64 characters of a string compared, searched or given to a method), a
prompt of at most MAX_RENDER_CHARS characters, no string or container of more than
MAX_RENDER_CHARS characters or items built by a filter, a method, a slice, '*', '%', '+',
'-', '~' or a block, and at most MAX_BUILT_CHARS of them built in all, no '*' or '**' of
integers past MAX_INT_BITS bits. Past one,
ChatTemplateError names the limit. Real templates are far inside them: a conversation of
thousands of messages takes some 10,000 steps.

What one call builds is checked before it is built where its size comes from an argument (a
width, a count, a repeated or inserted string, the items of a container turned into text:
`center(3000000000)`, `'%3000000000s' % x`, `'{:>3000000000}'.format(x)`, `s.ljust(n)`,
`replace('', s)`, `join` of a list that holds one long string many times, `batch(n, fill)`,
`tojson(indent=n)`), and after it is built where it is at most a few times its input (`upper`,
`urlencode`, `s.encode()`): so one call builds at most a few times MAX_RENDER_CHARS, and a
loop of them stops at MAX_BUILT_CHARS. Filters are jinja2's, wrapped (and so never folded into
constants as the template compiles: that would build their result there, outside any render);
the methods of str and bytes, of containers and the constructors (dict(), namespace()) are
checked in the sandbox's `call`, '*', '%' and '-' in `call_binop`, '+', '~', slices,
comparisons, a dict's keys and `{% for %}` by the code generator.

What is compared or hashed is counted by its size, not bounded by its nesting depth: a list
that holds another one twice, 26 deep, is 2^26 items to compare, but so are three levels of
`[x] * 400`, and no depth limit that real templates stay under stops the latter."""

from __future__ import annotations

import builtins
import collections
import contextvars
import functools
import json
import re
import types
from collections.abc import Callable, ItemsView, Iterable, Iterator, KeysView, Sized, ValuesView
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2 import TemplateSyntaxError
from jinja2.compiler import CodeGenerator, Frame, operators, optimizeconst
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter, safe_range
from jinja2.utils import _PassArg, pass_context
from markupsafe import EscapeFormatter, Markup

from runtime.tokenizer import ChatTemplateError

__all__ = ["TemplateRaised", "TemplateSyntaxError", "compile_template", "render"]

MAX_RENDER_STEPS = 2_000_000  # per render: range items, calls, lookups, pieces of output
MAX_RENDER_CHARS = 32 << 20  # the rendered prompt; a string or list one filter/method/op builds
MAX_BUILT_CHARS = 4 * MAX_RENDER_CHARS  # per render: all that filters, methods and ops build
# (bytes: a character is one, a container's item eight, a pointer's)
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
    """Steps and characters left to the render in progress (one per render, in _BUDGET)."""

    __slots__ = ("built", "steps")

    def __init__(self) -> None:
        self.steps = MAX_RENDER_STEPS
        self.built = MAX_BUILT_CHARS  # characters (or items) filters, methods, ops may build


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
            f"at most {MAX_RENDER_STEPS} steps (range and loop items, calls, lookups, output "
            "pieces)"
        )


def _room(size: int, what: str) -> None:
    """TemplateLimit unless `what` (of `size` characters or items) fits in MAX_RENDER_CHARS."""
    if size > MAX_RENDER_CHARS:
        raise TemplateLimit(f"{what}: a string or list of at most {MAX_RENDER_CHARS} characters")


def _built(value: Any, what: str) -> Any:
    """`value` (just built by `what`: a string, a container, an int from bytes), checked: at
    most MAX_RENDER_CHARS characters or items (or bytes), and counted against the render's
    MAX_BUILT_CHARS unless it is short (what makes a short one is a step, or at most a few for
    each step)."""
    if isinstance(value, _BUILT):
        size = len(value)
        if size < _SHORT:
            return value
        _room(size, what)
        # a container's item is a pointer at least (8 bytes): counted as 8 against the render's
        # cap (as one, ~1 GB of lists fitted under it)
        _charge(size if isinstance(value, (str, bytes)) else 8 * size)
    elif isinstance(value, jinja2.utils.Namespace):
        _built(value._Namespace__attrs, what)
    elif isinstance(value, int) and value.bit_length() >= 8 * _SHORT:  # (int.from_bytes)
        _room(value.bit_length() // 8, what)
        _charge(value.bit_length() // 8)
    return value


_SHORT = 4096  # characters or items: what builds fewer is not counted against MAX_BUILT_CHARS
_SCALARS = (int, float, bool, type(None))
_SIZED = (str, bytes, list, tuple, dict, set, frozenset, collections.deque, range)
_BUILT = (str, bytes, list, tuple, dict, set, frozenset, collections.deque)
_SIZED_FIRST = (*_SIZED, Sized)  # (the concrete types first: quicker)


def _text_size(value: Any, what: str, indent: int = 0) -> int:
    """About len(str(value)) (or of its JSON with `indent`), known before it is built:
    TemplateLimit once it passes MAX_RENDER_CHARS. Each item of a container is a step (a list
    may hold one long string many times, or itself nested: its text is what is unbounded).
    Escapes (repr's, JSON's) are not counted: they make a text at most a few times longer."""
    if isinstance(value, (str, bytes)):
        return len(value)
    total, stack = 0, [(value, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, (str, bytes)):
            total += len(x) + 2
        elif isinstance(x, int) and not isinstance(x, bool):
            total += x.bit_length() // 3 + 2
        elif isinstance(x, _SCALARS):
            total += 24
        elif isinstance(x, (dict, jinja2.utils.Namespace)):
            items = x._Namespace__attrs if isinstance(x, jinja2.utils.Namespace) else x
            _spend(len(items))
            total += 2 + len(items) * (4 + indent * depth)
            stack.extend((v, depth + 1) for kv in items.items() for v in kv)
        elif isinstance(x, (list, tuple, set, frozenset, collections.deque, KeysView, ValuesView)):
            _spend(len(x))
            total += 2 + len(x) * (2 + indent * depth)
            stack.extend((v, depth + 1) for v in x)
        elif isinstance(x, ItemsView):
            _spend(len(x))
            total += 2 + len(x) * (6 + indent * depth)
            stack.extend((v, depth + 1) for kv in x for v in kv)
        else:  # (an object whose text is its name: a generator, a macro, Undefined)
            total += 80
        _room(total, what)
    return total


# Values that are compared and hashed without going into other values (a string: a step for each
# _SCAN characters, in _compared)
_LEAVES = (str, bytes, int, float, bool, type(None))
_SCAN = 64
# Values that are compared and hashed item by item (a jinja2 namespace is compared by identity)
_MAPPINGS = (dict, types.MappingProxyType)
_COLLECTIONS: Any = (
    list, tuple, set, frozenset, collections.deque, type({}.keys()), type({}.values())
)
_ITEMS: Any = type({}.items())


def _compared(value: Any, times: int = 1) -> Any:
    """`value`, about to be compared or hashed `times` times ('==', '<', 'in', a dict key, an
    item of what sort or unique take): every item of every container in it a step, as many
    times as it is reached (a list may hold another one many times, and that one another one
    many times: Python compares and hashes each of them each time, with no limit on nesting
    depth that would help: three levels of [x] * 4000 are 64e9 items), spent before; a string
    a step for each _SCAN characters ('in' scans it, '==' compares it)."""
    if isinstance(value, (str, bytes)):
        if len(value) >= _SCAN:
            _spend(times * (len(value) // _SCAN))
        return value
    if isinstance(value, _LEAVES):
        return value
    budget = _BUDGET.get()
    if budget is None:
        return value
    left, stack, n = budget.steps // times + 1, [value], 0
    while stack:
        x = stack.pop()
        if isinstance(x, (str, bytes)):
            n += len(x) // _SCAN
        elif isinstance(x, _LEAVES):
            continue
        elif isinstance(x, _MAPPINGS):
            n += len(x)
            if n <= left:
                stack.extend(x.keys())
                stack.extend(x.values())
        elif isinstance(x, _COLLECTIONS):
            n += len(x)
            if n <= left:
                stack.extend(x)
        elif isinstance(x, _ITEMS):
            n += 2 * len(x)
            if n <= left:
                stack.extend(v for kv in x for v in kv)
        if n > left:
            break
    _spend(n * times)
    return value


def _compared_items(value: Any) -> Any:
    """_compared, for what 'in', the in test, dict() and set methods go through item by item
    and compare or hash: an iterator read into a list first (its items counted as they came,
    but not their size)."""
    if not isinstance(value, _LEAVES) and isinstance(value, Iterator):
        value = list(value)
    return _compared(value)


def _each_a_step(items: Iterable[Any]) -> Iterator[Any]:
    """`items` (an iterator: a generator of a filter, a reversed list), each a step as it
    comes."""
    for item in items:
        _spend(1)
        yield item


def _counted(items: Any) -> Any:
    """What is gone through item by item, each item a step: spent at once where its size is
    known, else as each item comes."""
    if isinstance(items, _SIZED_FIRST):
        _spend(len(items))
        return items
    if isinstance(items, Iterable) and not isinstance(items, jinja2.Undefined):
        return _each_a_step(items)
    return items


def _int_arg(value: Any) -> int:
    """An argument that is a size: its value if an int (bools too), else 0 (the call itself
    raises the TypeError)."""
    return value if isinstance(value, int) else 0


# ----- '%' and str.format --------------------------------------------------------------------

# A '%' conversion: key, width, precision, type (Python's printf-style syntax)
_PRINTF = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.?)", re.S)


def _printf_size(fmt: str | bytes, args: Any, what: str) -> None:
    """TemplateLimit unless `fmt % args` fits: its widths and precisions (a '*' takes one from
    `args`) and its arguments' text."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    items = list(args) if isinstance(args, tuple) else [args]
    size, i = len(text), 0
    for _key, width, precision, kind in _PRINTF.findall(text):
        for n in (width, precision):
            if n == "*":
                size += _int_arg(items[i]) if i < len(items) else 0
                i += 1
            elif n:
                size += int(n) if len(n) < 12 else MAX_RENDER_CHARS + 1
        if kind != "%" and not _key:
            i += 1
        _room(size, what)
    _room(size + _text_size(args, what), what)


# The numbers in a format spec: its width and precision (a digit as fill counts too: harmless)
_SPEC_NUMBERS = re.compile(r"\d+")


class _BoundedFormatter(SandboxedFormatter):
    """str.format in the sandbox, with each field's width, precision and text counted before
    it is formatted (the whole call at most MAX_RENDER_CHARS)."""

    size = 0

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self.size = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        for n in _SPEC_NUMBERS.findall(format_spec):
            self.size += int(n) if len(n) < 12 else MAX_RENDER_CHARS + 1
        self.size += _text_size(value, "str.format()")
        _room(self.size, "str.format()")
        return super().format_field(value, format_spec)


# ----- methods of str and bytes ----------------------------------------------------------------


def _padded(what: str, s: str | bytes, width: Any, *_: Any) -> None:  # center, ljust, ...
    _room(max(len(s), _int_arg(width)), what)


def _expanded(what: str, s: str | bytes, tabsize: Any = 8) -> None:
    tab = "\t" if isinstance(s, str) else b"\t"
    _room(len(s) + s.count(tab) * max(_int_arg(tabsize), 0), what)  # type: ignore[arg-type]


def _replaced(what: str, s: Any, old: Any, new: Any, count: Any = -1) -> None:
    if type(s) is not type(old) or type(s) is not type(new):
        return  # (replace() raises the TypeError)
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    _room(len(s) + n * (len(new) - len(old)), what)


def _translated(what: str, s: str | bytes, table: Any, *_: Any) -> None:
    values = table.values() if isinstance(table, dict) else table
    if isinstance(values, (list, tuple, ValuesView)):
        longest = max((len(v) for v in values if isinstance(v, (str, bytes))), default=1)
        _room(len(s) * longest, what)


def _joined(what: str, sep: str | bytes, items: list[Any]) -> None:
    _room(len(sep) * max(len(items) - 1, 0) + _text_size(items, what), what)


def _split(what: str, s: Any, sep: Any = None, maxsplit: Any = -1) -> None:
    """split, rsplit: each item a step (a new object: a list of short ones costs more than its
    text), spent before."""
    # (without `sep`, words: a character and a space each at least)
    items = s.count(sep) + 1 if type(sep) is type(s) and sep else len(s) // 2 + 1
    if isinstance(maxsplit, int) and maxsplit >= 0:
        items = min(items, maxsplit + 1)
    _spend(items)


def _splitlines(what: str, s: str | bytes, *_: Any, **__: Any) -> None:
    _spend(len(s) // 2 + 1)  # (lines of a character and a break at least; empty ones are free)


# name -> the check of a call of the method with that name of a str or bytes (what the call is
# named in an error, then the arguments as the method takes them); every other method builds at
# most a few times its string (encode: 10 times)
_METHOD_CHECKS: dict[str, Callable[..., None]] = {
    "center": _padded,
    "ljust": _padded,
    "rjust": _padded,
    "zfill": _padded,
    "expandtabs": _expanded,
    "replace": _replaced,
    "translate": _translated,
    "split": _split,
    "rsplit": _split,
    "splitlines": _splitlines,
}


# ----- filters ---------------------------------------------------------------------------------


def _check_value(what: str, value: Any, *args: Any, **kwargs: Any) -> Any:
    """A filter that makes text of its value: the value's text fits."""
    _text_size(value, what)
    return value


def _check_center(what: str, value: Any, width: Any = 80) -> Any:
    _room(max(_text_size(value, what), _int_arg(width)), what)
    return value


def _check_indent(what: str, s: Any, width: Any = 4, *args: Any, **kwargs: Any) -> Any:
    size = _text_size(s, what)
    indention = len(width) if isinstance(width, str) else _int_arg(width)
    lines = (s.count("\n") if isinstance(s, str) else 0) + 2
    _room(indention, what)
    _room(size + lines * indention, what)
    return s


def _check_wordwrap(
    what: str,
    s: Any,
    width: Any = 79,
    break_long_words: Any = True,
    wrapstring: Any = None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    size = _text_size(s, what)
    sep = len(wrapstring) if isinstance(wrapstring, str) else 1
    _room(size + (size + 1) * sep, what)
    _spend(size // 8)  # (textwrap's work is per word, in Python)
    return s


def _check_format(what: str, value: Any, *args: Any, **kwargs: Any) -> Any:
    if isinstance(value, str):
        _printf_size(value, kwargs or args, what)
    return value


def _check_replace(what: str, s: Any, old: Any, new: Any, count: Any = None) -> Any:
    _text_size(s, what)
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        _replaced(what, s, old, new, -1 if count is None else count)
    return s


def _check_batch(what: str, value: Any, linecount: Any, fill_with: Any = None) -> Any:
    if fill_with is not None:
        _room(_int_arg(linecount), what)
    return value


def _check_slice(what: str, value: Any, slices: Any, fill_with: Any = None) -> Any:
    _room(_int_arg(slices), what)
    _spend(max(_int_arg(slices), 0))  # (each slice a list)
    return value


def _check_urlize(what: str, value: Any, *args: Any, **kwargs: Any) -> Any:
    size = _text_size(value, what)
    extra = sum(len(v) for v in (*args, *kwargs.values()) if isinstance(v, str))
    _room(3 * size + (size // 2 + 1) * (60 + extra), what)
    return value


# name -> the check of a filter's arguments before it runs (what the filter is named in an
# error, then its value and arguments); it returns the value to filter
_FILTER_CHECKS: dict[str, Callable[..., Any]] = {
    "center": _check_center,
    "indent": _check_indent,
    "wordwrap": _check_wordwrap,
    "format": _check_format,
    "replace": _check_replace,
    "batch": _check_batch,
    "slice": _check_slice,
    "urlize": _check_urlize,
}
_FILTER_CHECKS.update(
    dict.fromkeys(
        ["capitalize", "e", "escape", "forceescape", "lower", "upper", "pprint", "safe",
         "string", "striptags", "title", "trim", "truncate", "urlencode", "wordcount",
         "xmlattr"],
        _check_value,
    )
)
# Filters that go through their value item by item (a new object for each, or Python's work):
# each item a step, spent before (a list of a long string's characters costs gigabytes), or as
# it comes where the value is an iterator (_counted)
_ITERATING = frozenset(
    {"batch", "dictsort", "groupby", "items", "list", "map", "max", "min", "reject",
     "rejectattr", "reverse", "select", "selectattr", "slice", "sort", "unique", "wordcount"}
)
# Filters that compare or hash the items of their value: name -> whether they sort (each item
# compared some log2(n) times); each item's size a step for each time (_compared)
_COMPARING = {"dictsort": True, "groupby": True, "sort": True, "max": False, "min": False,
              "unique": False}
# Filters that return what they were given, or a part of it: nothing built to count
_NOT_BUILDING = frozenset({"attr", "d", "default", "first", "last", "max", "min", "random"})


def _bounded_filter(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` with its check first and what it built counted after (_built). It takes the
    context, as jinja2 filters may: the compiler never folds it into a constant, which would run
    it as the template compiles, outside any render's limits."""
    check = _FILTER_CHECKS.get(name)
    pass_arg = _PassArg.from_obj(original)
    counts = name not in _NOT_BUILDING
    iterates = name in _ITERATING
    sorts = _COMPARING.get(name)
    what = f"the {name} filter"

    @pass_context
    def bounded(context: Context, value: Any, *args: Any, **kwargs: Any) -> Any:
        if check is not None:
            value = check(what, value, *args, **kwargs)
        if iterates:
            value = _counted(value)
        if sorts is not None:
            if not isinstance(value, Sized) and isinstance(value, Iterator):
                value = list(value)  # (each item counted as it came; the filter reads it all)
            times = len(value).bit_length() if sorts and isinstance(value, Sized) else 1
            _compared(value, max(times, 1))
        if pass_arg is _PassArg.context:
            result = original(context, value, *args, **kwargs)
        elif pass_arg is _PassArg.eval_context:
            result = original(context.eval_ctx, value, *args, **kwargs)
        elif pass_arg is _PassArg.environment:
            result = original(context.environment, value, *args, **kwargs)
        else:
            result = original(value, *args, **kwargs)
        return _built(result, what) if counts else result

    bounded.__name__ = bounded.__qualname__ = f"bounded_{name}"
    return bounded


# Tests that compare or hash their value with their argument ('is eq', 'is in', and so selectattr)
_COMPARING_TESTS = frozenset(
    {"eq", "equalto", "==", "ne", "!=", "lt", "lessthan", "<", "le", "<=", "gt", "greaterthan",
     ">", "ge", ">=", "in"}
)


def _bounded_test(original: Any) -> Any:
    """A comparing test, what it compares counted first (_compared)."""

    def bounded(value: Any, *args: Any) -> Any:
        _compared(value)
        args = tuple(map(_compared_items, args))
        return original(value, *args)

    return bounded


@pass_context
def _join(context: Context, value: Any, d: Any = "", attribute: Any = None) -> str:
    """jinja2's join, its items' text counted first."""
    if attribute is not None:
        value = map(jinja2.filters.make_attrgetter(context.environment, attribute), value)
    items = list(value)
    _spend(len(items))
    what = "the join filter"
    sep = _text_size(d, what)
    _room(sep * max(len(items) - 1, 0) + _text_size(items, what), what)
    return _built(jinja2.filters.sync_do_join(context.eval_ctx, items, d), what)


@pass_context
def _sum(context: Context, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """jinja2's sum, with each partial sum of lists or tuples counted as it would be built."""
    if attribute is not None:
        iterable = map(jinja2.filters.make_attrgetter(context.environment, attribute), iterable)
    items = list(iterable)
    _spend(len(items))
    if isinstance(start, (list, tuple)):
        size, built = len(start), 0
        for item in items:
            size += len(item) if isinstance(item, (list, tuple)) else 0
            built += size
            _room(size, "the sum filter")
        _charge(8 * built)  # (items: pointers, as _built counts them)
    return sum(items, start)


def _charge(size: int) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.built -= size
        if budget.built < 0:
            raise TemplateLimit(
                f"at most {MAX_BUILT_CHARS} bytes (a character one, a container's item eight) "
                "built in all by filters, methods and operators"
            )


def _lipsum(n: Any = 5, html: Any = True, min: Any = 20, max: Any = 100) -> str:
    """jinja2's lipsum, each of the words it may make a step."""
    _spend(builtins.max(_int_arg(n), 0) * builtins.max(_int_arg(max), 0))
    return _built(jinja2.utils.generate_lorem_ipsum(n, html, min, max), "lipsum()")



# ----- the environment -------------------------------------------------------------------------


def _check_product(left: Any, right: Any) -> None:
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
            _room(len(seq) * n, "'*'")
    both_ints = isinstance(left, int) and isinstance(right, int)
    if both_ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
        raise TemplateLimit(f"'*' and '**' build integers of at most {MAX_INT_BITS} bits")


def _check_power(base: Any, exponent: Any) -> None:
    both_ints = isinstance(base, int) and isinstance(exponent, int)
    if both_ints and abs(base) > 1 and (abs(base).bit_length() - 1) * exponent > MAX_INT_BITS:
        raise TemplateLimit(f"'*' and '**' build integers of at most {MAX_INT_BITS} bits")


def _finalize(value: Any) -> Any:
    """An output piece, unchanged: the text of one that is not a string fits."""
    if not isinstance(value, str):
        _text_size(value, "an output piece")
    return value


def _concat(pieces: Any) -> str:
    """The output of a block, a macro or a `{% set %}` body joined, its size checked first."""
    pieces = list(pieces)
    _room(sum(map(len, pieces)), "the output of a block or macro")
    return _built("".join(pieces), "the output of a block or macro")


def _bounded_str_join(join: Callable[[Any], str], pieces: tuple[Any, ...]) -> str:
    """'~' of `pieces` (join: jinja2's str_join or markup_join), its size checked first."""
    _room(sum(_text_size(p, "'~'") for p in pieces), "'~'")
    return _built(join(pieces), "'~'")


def _sliced(value: Any, part: slice) -> Any:
    """`value[part]` (the template's `value[a:b:c]`), a step, what it builds counted (_built)."""
    _spend(1)
    return _built(value[part], "a slice")


def _bounded_add(first: Any, *others: Any) -> Any:
    """`first + others[0] + others[1] ...` (a chain of '+', as Python does it, left to right),
    what each '+' builds counted (_built): short strings, the usual, pass at once."""
    result = first
    for other in others:
        result = result + other
        if type(result) is not str or len(result) >= _SHORT:
            _built(result, "'+'")
    return result


class _CodeGenerator(CodeGenerator):
    """jinja2's, with '+' counted by _bounded_add (a chain of them one call: cheaper than the
    sandbox's call_binop for each, and '+' is what real templates do most), '~' checked by
    _bounded_str_join before it joins, and what '==', '<', 'in' ... compare and a dict's keys
    counted by _compared before."""

    @optimizeconst
    def visit_Add(self, node: jinja2.nodes.BinExpr, frame: Frame) -> None:
        terms = [node.right]  # (a chain `a + b + c` is Add(Add(a, b), c): one call for it)
        while isinstance(node.left, jinja2.nodes.Add):
            node = node.left
            terms.append(node.right)
        terms.append(node.left)
        self.write("environment.bounded_add(")
        for term in reversed(terms):
            self.visit(term, frame)
            self.write(", ")
        self.write(")")

    @optimizeconst
    def visit_Compare(self, node: jinja2.nodes.Compare, frame: Frame) -> None:
        self.write("(")
        self._visit_compared(node.expr, frame)
        for operand in node.ops:
            self.write(f" {operators[operand.op]} ")
            self._visit_compared(operand.expr, frame, operand.op in ("in", "notin"))
        self.write(")")

    def visit_Dict(self, node: jinja2.nodes.Dict, frame: Frame) -> None:
        self.write("{")
        for item in node.items:
            self._visit_compared(item.key, frame)
            self.write(": ")
            self.visit(item.value, frame)
            self.write(", ")
        self.write("}")

    @optimizeconst
    def visit_Getitem(self, node: jinja2.nodes.Getitem, frame: Frame) -> None:
        if not isinstance(node.arg, jinja2.nodes.Slice):  # (obj[key]: a dict's key is hashed)
            self.write("environment.getitem(")
            self.visit(node.node, frame)
            self.write(", ")
            self._visit_compared(node.arg, frame)
            self.write(")")
            return
        self.write("environment.sliced(")  # (jinja2 writes obj[a:b], counted by nothing)
        self.visit(node.node, frame)
        self.write(", slice(")
        for part in (node.arg.start, node.arg.stop, node.arg.step):
            if part is None:
                self.write("None")
            else:
                self.visit(part, frame)
            self.write(", ")
        self.write("))")

    def _visit_compared(
        self, node: jinja2.nodes.Expr, frame: Frame, searched: bool = False
    ) -> None:
        """`node`, about to be compared or hashed (or, `searched`, its items), counted first
        (_compared, _compared_items), unless a constant (what the template's text holds)."""
        if isinstance(node, jinja2.nodes.Const):
            self.visit(node, frame)
            return
        self.write("environment.compared_items(" if searched else "environment.compared(")
        self.visit(node, frame)
        self.write(")")

    @optimizeconst
    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            join = "markup_join"
        else:
            join = "str_join"
        self.write(f"environment.bounded_str_join({join}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


# Methods of containers (and int's) that build a new one: what they build counted (_built)
_CONTAINER_BUILDERS = frozenset(
    {"copy", "fromkeys", "union", "intersection", "difference", "symmetric_difference",
     "to_bytes", "from_bytes"}
)
# Methods that hash the items of their argument (an iterator is read into a list first)
_HASHING_ITEMS = _CONTAINER_BUILDERS | {"isdisjoint"}
# The template's globals that build a container of their arguments (set in _environment)
_CONSTRUCTORS: tuple[Any, ...] = (dict, jinja2.utils.Namespace, jinja2.utils.Cycler)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with each call and lookup a step of the render's budget, what the operators,
    the methods of strings and the filters build checked (before, where its size comes from an
    argument), and '*' and '**' of integers checked before they build something too large."""

    intercepted_binops = frozenset({"*", "**", "%", "-"})
    code_generator_class = _CodeGenerator
    concat = staticmethod(_concat)  # type: ignore[assignment]
    bounded_str_join = staticmethod(_bounded_str_join)
    bounded_add = staticmethod(_bounded_add)
    compared = staticmethod(_compared)
    compared_items = staticmethod(_compared_items)
    sliced = staticmethod(_sliced)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            _check_product(left, right)
            return _built(left * right, "'*'")
        if operator == "%" and isinstance(left, (str, bytes)):
            _printf_size(left, right, "'%'")
            return _built(left % right, "'%'")
        if operator == "**":
            _check_power(left, right)
        if operator == "-" and not isinstance(left, _LEAVES):  # (d.keys() - x: a set)
            _compared(left)
            return _built(left - _compared_items(right), "'-'")
        return super().call_binop(context, operator, left, right)

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        """The template's tree, each `{% for %}` going through _loop_items (what it loops over
        is as many steps as it has items)."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(jinja2.nodes.For):
            loop.iter = jinja2.nodes.Filter(
                loop.iter, _LOOP_ITEMS, [], [], None, None, lineno=loop.iter.lineno
            )
        return tree

    def getattr(self, obj: Any, attribute: str) -> Any:
        _spend(1)
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _spend(1)
        return super().getitem(obj, argument)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _spend(1)
        if len(args) + len(kwargs) >= _SHORT:  # (f(*items, **mapping): copied)
            _charge(8 * (len(args) + len(kwargs)))
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, bytes)):
            return __self._call_str_method(__context, __obj, owner, *args, **kwargs)
        if isinstance(__obj, LoopContext) and args:  # (loop(items) of a recursive loop)
            args = (_counted(args[0]), *args[1:])
        elif owner is not None or (isinstance(__obj, type) and __obj in _CONSTRUCTORS):
            # a method (of a list, a dict, a set, an int, a type, a loop: index, get, fromkeys,
            # changed) or a constructor: what it may compare or hash counted first, and what it
            # builds after (copy, fromkeys, union, to_bytes, dict(), namespace())
            name = getattr(__obj, "__name__", "")
            if name in _HASHING_ITEMS or (owner is None and __obj is not jinja2.utils.Cycler):
                args = tuple(map(_compared_items, args))  # (what they hash, an iterator read)
            for arg in (*args, *kwargs.values()):
                _compared(arg)
            if name in ("index", "count") and not isinstance(owner, _LEAVES):
                _compared(owner)
            if name == "to_bytes" and isinstance(owner, int):
                _room(_int_arg(args[0] if args else kwargs.get("length", 1)), "int.to_bytes()")
            if name in _CONTAINER_BUILDERS or owner is None:
                result = super().call(__context, __obj, *args, **kwargs)
                return _built(result, f"{name}()")
        return super().call(__context, __obj, *args, **kwargs)

    def _call_str_method(
        __self, __context: Context, __obj: Any, owner: str | bytes, *args: Any, **kwargs: Any
    ) -> Any:
        """A call of a method of a string (`owner`): checked before where what it builds has a
        size from its arguments, counted after; a step for each _SCAN characters it may scan."""
        if len(owner) >= _SCAN:
            _spend(len(owner) // _SCAN)
        name = getattr(__obj, "__name__", "")
        what = f"{type(owner).__name__}.{name}()"
        # (the arguments as the method takes them: jinja2 adds these for its context's sake)
        given = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
        if name == "join" and len(args) == 1 and not given:
            args = (list(args[0]),)  # (read once, here: it may be an iterator)
            _joined(what, owner, args[0])
        elif name in _METHOD_CHECKS:
            _METHOD_CHECKS[name](what, owner, *args, **given)
        result = _built(super().call(__context, __obj, *args, **kwargs), what)
        if isinstance(result, (list, tuple)):  # (split, partition: new strings, each counted)
            chars = sum(len(p) for p in result if isinstance(p, (str, bytes)))
            if chars >= _SHORT:
                _room(chars, what)
                _charge(chars)
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """jinja2's, with _BoundedFormatter: each field's width, precision and text counted
        before it is formatted."""
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        f_self = value.__self__
        formatter: _BoundedFormatter
        if isinstance(f_self, Markup):
            formatter = _BoundedEscapeFormatter(self, escape=f_self.escape)
        else:
            formatter = _BoundedFormatter(self)
        is_format_map = value.__name__ == "format_map"
        str_type = type(f_self)

        def bounded(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(
                        f"format_map() takes exactly one argument ({len(args)} given)"
                    )
                kwargs, args = args[0], ()
            return _built(str_type(formatter.vformat(f_self, args, kwargs)), "str.format()")

        return functools.update_wrapper(bounded, value)


class _BoundedEscapeFormatter(_BoundedFormatter, EscapeFormatter):
    """_BoundedFormatter for a Markup string's format (its fields escaped)."""


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) and
    render its body unchanged; we never need the assistant mask."""

    tags = {"generation"}  # type: ignore[misc]  # noqa: RUF012 (jinja2 declares it a plain attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    _text_size(message, "raise_exception()")  # (its text is what the caller makes of it)
    raise TemplateRaised(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; chat templates want plain JSON.
    step = len(indent) if isinstance(indent, str) else _int_arg(indent)
    _room(step, "the tojson filter")
    if isinstance(separators, (tuple, list)):
        step += sum(len(s) for s in separators if isinstance(s, str))
    _text_size(x, "the tojson filter", indent=step + 1)
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    """The time now as `fmt` says, its widths counted first (C's strftime pads %5000000Y)."""
    if isinstance(fmt, str):
        numbers = _SPEC_NUMBERS.findall(fmt)
        _room(len(fmt) + sum(int(n) if len(n) < 12 else MAX_RENDER_CHARS + 1 for n in numbers),
              "strftime_now()")
    return _built(datetime.now().strftime(fmt), "strftime_now()")


_LOOP_ITEMS = "edgeinfer_loop_items"  # (a name no template uses; a call of it is harmless)


@pass_context
def _loop_items(context: Context, items: Any) -> Any:
    """What a `{% for %}` loops over, each item a step, spent at once (a loop in a loop over a
    long string is what runs forever), or as it comes from an iterator (_counted)."""
    return _counted(items)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        finalize=_finalize,
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters["join"] = _join
    env.filters["sum"] = _sum
    for name in _COMPARING_TESTS:
        env.tests[name] = _bounded_test(env.tests[name])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _range
    env.globals["lipsum"] = _lipsum
    env.filters[_LOOP_ITEMS] = _loop_items
    return env


def _range(*args: int) -> range:
    """jinja2's sandboxed range (at most its MAX_RANGE items), each item a step of the render
    (spent at once: range() in a loop of range() is what runs forever)."""
    rng = safe_range(*args)
    _spend(len(rng))
    return rng
