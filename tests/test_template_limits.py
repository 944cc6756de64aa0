"""Chat templates: every way a template builds a long string or list in one call (a filter, a
method of a string, '%', str.format, '~', '+', a block) stops at MAX_RENDER_CHARS before it
builds it, a loop of such calls stops at MAX_BUILT_CHARS, and item-by-item work (loops over a
long string, a list of its characters, split) is counted in steps; while templates that stay
inside render exactly as a plain jinja2 sandbox renders them.

Sizes are just past the limits (some 40 million characters, not billions): on the old code each
route builds tens of megabytes and renders without an error, so the tests fail there without
taking gigabytes."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime.chat_template import (
    MAX_RENDER_CHARS,
    MAX_RENDER_STEPS,
    _environment,
    _GenerationTag,
    compile_template,
    render,
)
from runtime.tokenizer import ChatTemplateError

W = "{% set w = 'x' * 1000 %}"  # a short string, many references to it make the long text
CHARS = f"of at most {MAX_RENDER_CHARS} characters"
BUILT = "bytes (a character one, a container's item eight) built in all by filters, methods and operators"
STEPS = f"at most {MAX_RENDER_STEPS} steps"
# ns.a and ns.b: equal lists, each holding the one before twice, 22 deep (ns.a a tuple in TUPLES)
DAG = (
    "{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(22) %}{% set ns.a = [ns.a, ns.a] %}"
    "{% set ns.b = [ns.b, ns.b] %}{% endfor %}"
)
TUPLES = (
    "{% set ns = namespace(a=(1,)) %}{% for i in range(22) %}{% set ns.a = (ns.a, ns.a) %}"
    "{% endfor %}"
)

# name -> (template, what the error names): each a route that builds > MAX_RENDER_CHARS in one
# call (or, for the last ones, in a loop, or item by item)
ROUTES: dict[str, tuple[str, str]] = {
    "center filter": ("{{ ('x'|center(40000000))|length }}", "the center filter"),
    "filter block": (
        "{% set s %}{% filter center(40000000) %}x{% endfilter %}{% endset %}{{ s|length }}",
        "the center filter",
    ),
    "indent width": ("{{ (('a\n' * 10)|indent(4000000))|length }}", "the indent filter"),
    "indent string": ("{{ (('a\n' * 4000)|indent('x' * 10000))|length }}", "the indent filter"),
    "wordwrap": (
        "{{ (('a ' * 2000)|wordwrap(1, wrapstring='x' * 20000))|length }}",
        "the wordwrap filter",
    ),
    "format filter width": ("{{ ('%40000000s'|format('a'))|length }}", "the format filter"),
    "format filter star": ("{{ ('%*s'|format(40000000, 'a'))|length }}", "the format filter"),
    "'%' width": ("{{ ('%40000000s' % 'a')|length }}", "'%'"),
    "'%' precision": ("{{ ('%.40000000f' % 1.5)|length }}", "'%'"),
    "replace filter": ("{{ (('a' * 1000)|replace('', 'x' * 40000))|length }}", "the replace filter"),
    "join filter": (W + "{{ (([w] * 40000)|join)|length }}", "the join filter"),
    "string filter": (W + "{{ (([w] * 40000)|string)|length }}", "the string filter"),
    "pprint filter": (W + "{{ (([w] * 40000)|pprint)|length }}", "the pprint filter"),
    "tojson indent": ("{{ ([1, 2, 3]|tojson(indent=15000000))|length }}", "the tojson filter"),
    "batch fill": ("{{ ([1]|batch(40000000, 0)|first)|length }}", "the batch filter"),
    "str.format": ("{{ '{:>40000000}'.format('a')|length }}", "str.format()"),
    "str.format nested": ("{{ '{:>{w}}'.format('a', w=40000000)|length }}", "str.format()"),
    "str.format_map": ("{{ '{a:>40000000}'.format_map({'a': 1})|length }}", "str.format()"),
    "Markup.format": ("{{ ('{:>40000000}'|safe).format('a')|length }}", "str.format()"),
    "str.ljust": ("{{ 'x'.ljust(40000000)|length }}", "str.ljust()"),
    "str.rjust": ("{{ 'x'.rjust(40000000)|length }}", "str.rjust()"),
    "str.center": ("{{ 'x'.center(40000000)|length }}", "str.center()"),
    "str.zfill": ("{{ '1'.zfill(40000000)|length }}", "str.zfill()"),
    "str.expandtabs": ("{{ ('\t' * 1000).expandtabs(40000)|length }}", "str.expandtabs()"),
    "str.replace": ("{{ ('a' * 1000).replace('', 'x' * 40000)|length }}", "str.replace()"),
    "str.join": (W + "{{ ''.join([w] * 40000)|length }}", "str.join()"),
    "str.join in a loop": (
        W + "{% for i in range(1) %}{{ ''.join([w] * 40000)|length }}{% endfor %}",
        "str.join()",
    ),
    "str.ljust in a loop": (
        "{% for i in range(1) %}{{ 'x'.ljust(40000000)|length }}{% endfor %}",
        "str.ljust()",
    ),
    "str.translate": ("{{ ('a' * 1000).translate({97: 'x' * 40000})|length }}", "str.translate()"),
    "bytes '*'": ("{{ ('x'.encode() * 40000000)|length }}", "'*'"),
    "bytes.ljust": ("{{ 'x'.encode().ljust(40000000)|length }}", "bytes.ljust()"),
    "'~'": ("{% set w = 'x' * 20000000 %}{{ (w ~ w)|length }}", "'~'"),
    "'~' of a list": (W + "{{ (([w] * 40000) ~ '')|length }}", "'~'"),
    "'+' doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(26) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}{{ ns.s|length }}",
        "'+'",
    ),
    "set block": (
        W + "{% set b %}{% for i in range(40000) %}{{ w }}{% endfor %}{% endset %}{{ b|length }}",
        "the output of a block or macro",
    ),
    "macro": (
        W + "{% macro m() %}{% for i in range(40000) %}{{ w }}{% endfor %}{% endmacro %}"
        "{{ m()|length }}",
        "the output of a block or macro",
    ),
    "sum of lists": ("{{ ([[1] * 12000000] * 3)|sum(start=[])|length }}", "the sum filter"),
    "loop of builds": (
        "{% for i in range(5) %}{% set x = 'x' * 30000000 %}{% endfor %}{{ 1 }}",
        BUILT,
    ),
    "map of builds": ("{{ range(5)|map('center', 30000000)|list|length }}", BUILT),
    # lists are pointers: 30M items kept under a cap that counted an item as one character
    "list copies": ("{% set big = [1] * 5000000 %}{% set ns = namespace(k=[]) %}{% for i in "
                    "range(5) %}{% set ns.k = ns.k + [big.copy()] %}{% endfor %}{{ ns.k|length }}",
                    BUILT),

    "slice": ("{{ [1]|slice(3000000)|list|length }}", STEPS),
    "lipsum": ("{{ lipsum(21, min=99999, max=100000)|length }}", STEPS),
    "list of characters": ("{{ ('\u20ac' * 3000000)|list|length }}", STEPS),
    "split": ("{{ ('a ' * 3000000).split()|length }}", STEPS),
    "loop in a loop over a string": (
        "{% set s = 'x' * 3000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        STEPS,
    ),
    # the items of a recursive loop's loop(items), of a filter's iterator, of |reverse
    "recursive loop": (
        "{% set s = 'x' * 2100000 %}{% for c in [s] recursive %}"
        "{% if c|length > 1 %}{{ loop(c) }}{% endif %}{% endfor %}",
        STEPS,
    ),
    "loop over reverse": ("{% for x in ([0] * 2100000)|reverse %}{% endfor %}", STEPS),
    "loop over a filter's iterator": ("{% for x in ([1] * 1100000)|select %}{% endfor %}", STEPS),
    # what slices, methods of containers and ints, str.format, split and strftime build
    "slices": (
        "{% set s = 'x' * 30000000 %}{% for i in range(5) %}{% set t = s[i:] %}{% endfor %}",
        BUILT,
    ),
    "list.copy": (
        "{% set l = [0] * 20000000 %}{% for i in range(6) %}{% set c = l.copy() %}{% endfor %}",
        BUILT,
    ),
    "dict.copy": (
        "{% set d = {}.fromkeys(range(100000)) %}{% for i in range(1400) %}"
        "{% set c = d.copy() %}{% endfor %}",
        BUILT,
    ),
    "str.partition": (
        "{% set s = 'x' * 30000000 ~ 'y' %}{% for i in range(5) %}{% set p = s.partition('y') %}"
        "{% endfor %}",
        BUILT,
    ),
    "str.format of a long string": (
        "{% set s = 'x' * 30000000 %}{% for i in range(5) %}{% set t = '{}'.format(s) %}"
        "{% endfor %}",
        BUILT,
    ),
    "int.to_bytes": ("{{ (1).to_bytes(40000000, 'big')|length }}", "int.to_bytes()"),
    "strftime_now width": ("{{ strftime_now('%40000000Y')|length }}", "strftime_now()"),
    "raise_exception of a long text": (
        W + "{{ raise_exception([[w] * 100] * 1000) }}",
        "raise_exception()",
    ),
    # what comparisons and hashes go through: a list that holds another one twice, 22 deep, is
    # 4 million items to compare or hash; three levels of [x] * 200, 8 million
    "'==' of nested lists": (DAG + "{{ ns.a == ns.b }}", STEPS),
    "'in' of nested lists": (DAG + "{{ ns.a in [ns.b] }}", STEPS),
    "'==' of wide lists": (
        "{% set a = [[[1] * 200] * 200] * 200 %}{% set b = [[[1] * 200] * 200] * 200 %}"
        "{{ a == b }}",
        STEPS,
    ),
    "eq test": (DAG + "{{ ns.a is eq(ns.b) }}", STEPS),
    "loop.changed": (
        DAG + "{% for i in range(2) %}{{ loop.changed(ns.a if i else ns.b) }}{% endfor %}",
        STEPS,
    ),
    "'in' of an iterator": (
        "{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(16) %}"
        "{% set ns.a = [ns.a, ns.a] %}{% set ns.b = [ns.b, ns.b] %}{% endfor %}"
        "{{ ns.a in ([ns.b] * 20)|reverse }}",
        STEPS,
    ),
    "sort filter": (DAG + "{{ [ns.a, ns.b]|sort|length }}", STEPS),
    "list.count": (DAG + "{{ [ns.a].count(ns.b) }}", STEPS),
    "dict key": (TUPLES + "{{ {ns.a: 1}|length }}", STEPS),
    "item lookup": (TUPLES + "{{ {1: 2}[ns.a] is defined }}", STEPS),
    "unique filter": (TUPLES + "{{ [ns.a, ns.a]|unique|list|length }}", STEPS),
    "'in' of a long string": (
        "{% set s = 'x' * 30000000 %}{% for i in range(1000) %}{{ 'y' in s }}{% endfor %}",
        STEPS,
    ),
    "str.find": (
        "{% set s = 'x' * 30000000 %}{% for i in range(1000) %}{{ s.find('y') }}{% endfor %}",
        STEPS,
    ),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(ROUTES))
def test_each_route_stops_at_its_limit(name: str) -> None:
    source, what = ROUTES[name]
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="went past a limit") as e:
        render(compile_template(source), {"messages": []})
    assert what in str(e.value)
    if what not in (BUILT, STEPS):
        assert CHARS in str(e.value)  # (the limit named)
    assert time.perf_counter() - start < 5


def test_a_filter_is_not_run_as_the_template_compiles() -> None:
    """jinja2 folds a filter of constants into a constant as it compiles: 'x'|center(n) would
    build its string there (and write it into the compiled code), outside any render."""
    code = _environment().compile("{{ 'x'|center(40000000) }}", raw=True)
    assert len(code) < 10_000


# Real-looking templates: filters, methods, operators, macros, blocks, loops, as chat templates
# use them (Llama 3's, Qwen's, Mistral's, Hermes' tool prompts)
REAL_TEMPLATES = [
    # SmolLM2-135M-Instruct's
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}",
    # filters and methods
    "{{ bos_token }}{% set ns = namespace(sys='') %}{% for m in messages %}"
    "{% if m.role == 'system' %}{% set ns.sys = m.content|trim %}{% endif %}{% endfor %}"
    "{% if ns.sys %}<<SYS>>{{ ns.sys|indent(2) }}<</SYS>>{% endif %}"
    "{% for m in messages|rejectattr('role', 'equalto', 'system') %}"
    "{% set content = m.content.split('</think>')[-1].lstrip('\\n') %}"
    "[{{ m.role|upper|center(11) }}] {{ content|replace('\\n\\n', '\\n')|wordwrap(60) }}"
    "{{ '%-6s|%3d' % (m.role, loop.index) }}{{ '{:>8}|{:.2f}'.format(m.role, 1.5) }}"
    "{{ (loop.index ~ '/' ~ loop.length)|string }}{{ loop.cycle('a', 'b') }}\n{% endfor %}"
    "{{ messages|map(attribute='role')|join(', ') }}|{{ messages|length }}"
    "|{{ messages|selectattr('role', 'eq', 'user')|list|length }}"
    "|{{ (messages|last).content|truncate(20) }}|{{ messages|tojson }}"
    "|{{ messages[0]|tojson(indent=2) }}|{{ messages|map(attribute='content')|map('length')|sum }}"
    "|{{ 'a,b,c'.split(',')|batch(2, '-')|list }}|{{ range(7)|slice(3)|list }}"
    "|{{ ('x' * 3)|list|unique|join }}|{{ 12345678|filesizeformat }}|{{ 'ab'.ljust(5, '.') }}"
    "|{{ '%s' % messages[0] }}|{{ messages[0].content.replace(' ', '_').title() }}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    # macros, blocks, call blocks, '+' of lists, '*' of a short string
    "{% macro render(m) %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endmacro %}"
    "{% macro wrap() %}[{{ caller() }}]{% endmacro %}"
    "{% set all = messages + [{'role': 'tail', 'content': '-' * 10}] %}"
    "{% for m in all %}{% call wrap() %}{{ render(m) }}{% endcall %}{% endfor %}"
    "{% set body %}{% for m in messages %}{{ m.content|e }}{% endfor %}{% endset %}"
    "{{ body|wordcount }}{{ body|length }}{% filter upper %}{{ body[:30] }}{% endfilter %}"
    "{{ tools|tojson if tools else '' }}{{ dict(a=1)|dictsort }}{{ [3, 1, 2]|sort|first }}",
    # recursive loops, reverse, slices, comparisons, dict keys, tests, methods of containers
    "{% set tree = [{'name': 'a', 'children': [{'name': 'b', 'children': []}]}, "
    "{'name': 'c', 'children': []}] %}{% for node in tree recursive %}[{{ node.name }}"
    "{% if node.children %}{{ loop(node.children) }}{{ loop(node.children|reverse) }}{% endif %}]"
    "{% endfor %}{% for m in messages|reverse %}{{ m.role[:1] }}{{ loop.changed(m.role) }}"
    "{% endfor %}{% for m in messages[1:] %}{{ m.content[-5:] }}{{ m.content[::-3]|length }}"
    "{% endfor %}{% for m in messages[::-1] if m.role != 'system' %}{{ loop.index }}{% endfor %}"
    "{{ 1 < messages|length < 10000 }}{{ messages|length - 1 }}{{ 3.5 - 1 }}"
    "{% set d = {messages[0].role: 1, 'x': messages[-1].role, (1, 2): [3]} %}{{ d|length }}"
    "{{ {'b': 1, 'a': 2}|dictsort(by='value') }}{{ d[(1, 2)] }}{{ (d.keys() - ['x'])|list|length }}"
    "{{ messages[0].role in ['system', 'user'] }}{{ 'user' in messages|map(attribute='role') }}"
    "{{ messages|selectattr('role', 'eq', 'user')|list|length }}{{ messages|select('in', ['x'])|list }}"
    "{{ messages|map(attribute='role')|unique|list }}{{ messages|map(attribute='role')|sort|first }}"
    "{{ messages|map(attribute='content')|map('length')|max }}{{ messages|map(attribute='role')|min }}"
    "{% for g in messages|groupby('role') %}{{ g.grouper }}{{ g.list|length }}{% endfor %}"
    "{% set L = messages|map(attribute='role')|list %}{{ L.copy()|length }}{{ L.index('user') }}"
    "{{ L.count('user') }}{{ messages[0].copy()|length }}{{ dict(a=1, b=L)|length }}"
    "{{ dict([('a', 1)]) }}{% set ns = namespace(x=L) %}{{ ns.x|length }}{{ {}.fromkeys(L)|length }}"
    "{{ messages[0].get('role') }}{{ messages[0].content.partition(' ') }}"
    "{{ messages[-1].content.split(' ')|length }}{{ '{}-{}'.format(1, L|length) }}"
    "{{ (5).to_bytes(2, 'big') }}{{ messages[0] == messages[0] }}{{ messages == messages[:] }}"
    "{{ [L, L] == [L, L] }}{% for k, v in messages[0]|items %}{{ k }}{% endfor %}"
    "{% for b in L|batch(3) %}{{ b|length }}{% endfor %}{% for s in L|slice(2) %}{{ s|length }}"
    "{% endfor %}{{ L|reverse|list|length }}{{ 'abc'|reverse }}",
]

CONVERSATION = [
    {"role": "system", "content": "You are helpful.\n\nBe brief."},
    {"role": "user", "content": "Hello, who are you? " * 5},
    {"role": "assistant", "content": "<think>hmm</think>\n\nI am SmolLM & a <model>."},
    {"role": "user", "content": "Tell me a story " * 50},
]


def _plain_render(template: str, context: dict[str, Any]) -> str:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(template).render(**context)


@pytest.mark.parametrize("index", range(len(REAL_TEMPLATES)))
def test_templates_inside_the_limits_render_as_before(index: int) -> None:
    template = REAL_TEMPLATES[index]
    for messages in (CONVERSATION, CONVERSATION * 300):
        context = {
            "messages": messages,
            "bos_token": "<s>",
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "add_generation_prompt": True,
        }
        assert render(compile_template(template), context) == _plain_render(template, context)


def test_long_conversation_inside_the_limits_renders() -> None:
    """Near a megabyte of conversation (the gateway's default body limit) goes through every
    filter of a real-looking template twice over without reaching a limit."""
    messages = [{"role": "user", "content": "word " * 2000}] * 100
    context = {"messages": messages, "bos_token": "", "tools": None, "add_generation_prompt": True}
    for template in REAL_TEMPLATES:
        assert render(compile_template(template), context) == _plain_render(template, context)
