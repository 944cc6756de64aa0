"""Tool calling: the parsers (hermes, llama3_json, mistral) and their streamed deltas; required
and named tool_choice enforced by a grammar on stories260K (every call parses into its arguments
schema); and the service end to end with the real `openai` client: required / named / auto,
streamed deltas that reassemble into the non-streamed answer, a two-turn conversation with tool
messages, response_format json_schema, and the 400s that name the field."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import openai
import orjson
import pydantic
import pytest
from tokenizers import Tokenizer as HFTokenizer

from kvstore.protocol import DoneEvent, StartEvent
from kvstore.redis_server import LocalRedis
from runtime import tool_parsers
from runtime.detokenizer import IncrementalDetokenizer
from runtime.llm import LLM
from runtime.outputs import CompletionOutput
from runtime.sampling_params import SamplingParams
from runtime.structured_decoding import GrammarCompiler
from runtime.tokenizer import Tokenizer
from runtime.tool_parsers import (
    HermesParser,
    RequestTools,
    ToolCallStream,
    _scan_value,
    _Scans,
    is_json_object,
    make_parser,
)
from runtime.worker import _delta
from tests.stack import Proc, get_json, start_gateway, start_worker, wait_until
from tests.test_openai_response import _chat, _events, _feed

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


class Addr(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    addr: Addr


# parameters that refer into themselves: pydantic's nested models ("#/$defs/Addr") and a
# recursive schema written by hand ("#" for the root, "#/definitions/...")
PERSON = openai.pydantic_function_tool(Person)
TREE = {
    "type": "object",
    "properties": {
        "v": {"$ref": "#/definitions/digit"},
        "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1},
    },
    "required": ["v"],
    "additionalProperties": False,
    "definitions": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}},
}
# refs resolved against the schema's own "$id", and to an "$anchor" (both were a 400 forced:
# "Pointer '/$defs/t/$defs/Y' does not exist"); no "type" (the arguments were a JSON string)
IDD = {"$id": "https://x.example/t.json", "type": "object", "properties": {"a": {"$ref":
       "#/$defs/Y"}}, "required": ["a"], "additionalProperties": False,
       "$defs": {"Y": {"type": "boolean"}}}  # fmt: skip
ANCHORED = {"type": "object", "properties": {"a": {"$ref": "#yes"}}, "required": ["a"],
            "additionalProperties": False,
            "$defs": {"Y": {"$anchor": "yes", "type": "boolean"}}}  # fmt: skip
UNTYPED = {"properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["a"],
           "additionalProperties": False}  # fmt: skip
REF_TOOLS: list[Any] = [
    PERSON,
    {"type": "function", "function": {"name": "tree", "parameters": TREE}},
    {"type": "function", "function": {"name": "idd", "parameters": IDD}},
    {"type": "function", "function": {"name": "anchored", "parameters": ANCHORED}},
    {"type": "function", "function": {"name": "untyped", "parameters": UNTYPED}},
]
REF_SCHEMAS = {"Person": PERSON["function"]["parameters"], "tree": TREE, "idd": IDD,
               "anchored": ANCHORED, "untyped": UNTYPED}  # fmt: skip
# A Hermes/Qwen-style chat template for stories260K: tools in a system turn (by name and
# description only: their schemas would fill its 512-token context), calls in <tool_call>
# blocks, tool results as their own turn.
TOOL_TEMPLATE = (
    "{% if tools %}system: You may call {% for t in tools %}{{ t['function']['name'] }} "
    "({{ t['function'].get('description', '') }}) {% endfor %}as <tool_call>{...}</tool_call>\n"
    "{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' and m.get('tool_calls') %}assistant:"
    "{% for c in m['tool_calls'] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "\n</tool_call>{% endfor %}\n"
    "{% elif m['role'] == 'tool' %}tool {{ m['name'] }}: {{ m['content'] }}\n"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


# ------------------------------------------------------------------------------- parsers
def _reassemble(deltas: list[tuple[str, list[dict[str, Any]]]]) -> tuple[str, list[dict[str, Any]]]:
    content, calls = "", []
    for text, tc in deltas:
        content += text
        for d in tc:
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function"
                calls.append(
                    {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}
                )
            else:
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, calls


def _stream(parser_name: str, text: str, step: int) -> tuple[str, list[dict[str, Any]]]:
    stream = ToolCallStream(make_parser(parser_name, "", {}))
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    return _reassemble([stream.feed(p, [], i == len(pieces) - 1) for i, p in enumerate(pieces)])


CALL_A = '{"name": "get_weather", "arguments": {"city": "Pa\\"ris }", "unit": "celsius"}}'
CALL_B = '{"arguments": {"zone": "UTC"}, "name": "get_time"}'
PARSE_CASES = [
    (
        "hermes",
        f"Let me look.\n<tool_call>\n{CALL_A}\n</tool_call>\n<tool_call>\n{CALL_B}\n</tool_call>",
        "Let me look.",
        [
            ("get_weather", '{"city": "Pa\\"ris }", "unit": "celsius"}'),
            ("get_time", '{"zone": "UTC"}'),
        ],
    ),
    (
        "hermes",
        "No tools needed: 2 < 3 and <tool is not a tag.",
        "No tools needed: 2 < 3 and <tool is not a tag.",
        [],
    ),
    ("hermes", "Hmm <tool_call>\nnot json", "Hmm <tool_call>\nnot json", []),
    (
        "llama3_json",
        '{"name": "get_time", "parameters": {"zone": "CET"}}; '
        '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
        "",
        [("get_time", '{"zone": "CET"}'), ("get_weather", '{"city": "Oslo", "unit": "celsius"}')],
    ),
    (
        "llama3_json",
        "<|python_tag|>" + '{"name": "get_time", "arguments": {"zone": "CET"}}',
        "",
        [("get_time", '{"zone": "CET"}')],
    ),
    (  # raw control characters in a string (code tools): JSON as it was before a0c1269
        "hermes",
        '<tool_call>\n{"name": "run", "arguments": {"code": "print(1)\nprint(2)\tx"}}'
        "\n</tool_call>",
        "",
        [("run", '{"code": "print(1)\nprint(2)\tx"}')],
    ),
    # a call without arguments: "{}" (OpenAI's, and JSON: the gateway finishes "tool_calls")
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', "", [("get_time", "{}")]),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_time"}, {"name": "f"}]',
        "",
        [("get_time", "{}"), ("f", "{}")],
    ),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "  Just text.", "  Just text.", []),
    (
        "mistral",
        'Sure [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "EST"}}, '
        '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}]',
        "Sure",
        [("get_time", '{"zone": "EST"}'), ("get_weather", '{"city": "Rome", "unit": "celsius"}')],
    ),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), PARSE_CASES)
def test_parsers_and_streamed_deltas(
    parser: str, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    """Whatever the chunking (1 character to all at once), the deltas add up to the same."""
    expected = (content, [{"name": n, "arguments": a} for n, a in calls])
    for step in (1, 2, 3, 7, len(text)):
        assert _stream(parser, text, step) == expected, step


def test_an_end_marker_inside_an_argument_string_is_text() -> None:
    """ "</tool_call>" inside a string argument (code a model writes) does not end the call: its
    arguments came out cut (invalid JSON), and differently by chunking."""
    text = ('<tool_call>\n{"name": "write", "arguments": {"code": "print(\'</tool_call>\')"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')  # fmt: skip
    want = ("", [{"name": "write", "arguments": '{"code": "print(\'</tool_call>\')"}'},
                 {"name": "g", "arguments": "{}"}])  # fmt: skip
    for step in (1, 5, len(text)):
        assert _stream("hermes", text, step) == want, step


def test_truncated_call_streams_what_it_has() -> None:
    content, calls = _stream("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', 4)
    assert content == "" and calls == [{"name": "f", "arguments": '{"a": [1, 2'}]


# The reviewer's tool: a one-digit argument (the grammar of a forced call writes it whole)
GET = {"type": "function", "function": {"name": "get", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"], "additionalProperties": False}}}  # fmt: skip
NAMED_GET = {"type": "function", "function": {"name": "get"}}
# two calls of `get` as each format's forced grammar writes them (a named choice: the first)
FORCED_TEXT = {
    "hermes": '<tool_call>\n{"name": "get", "arguments": {"a": 9}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get", "arguments": {"a": 1}}\n</tool_call>',
    "llama3_json": '{"name": "get", "parameters": {"a": 9}}; {"name": "get", "parameters": {"a": 1}}',
    "mistral": '[TOOL_CALLS][{"name": "get", "arguments": {"a": 9}}, '
    '{"name": "get", "arguments": {"a": 1}}]',
}


def _feed_tools(tools: RequestTools, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    return _reassemble([tools.delta(0, p, [], i == len(pieces) - 1) for i, p in enumerate(pieces)])


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_cut_anywhere_leaves_no_content(parser_name: str, choice: str) -> None:
    """A forced call's output is the grammar's text alone. Cut by max_tokens at any character,
    streamed a character at a time or read whole, it is no content, never the half-written
    markup (it was: cut inside hermes' end marker, '<', '</t', '</tool'; inside the next
    call's marker or before its name, '\n<tool_call>\n{"'; for "required", anywhere before
    the first call's name); the calls whose names were out stand, their arguments as written
    (whole once written whole), and a call of "required" cut before its name is none (a named
    choice's one call is that call, with arguments "", as before)."""
    parser = make_parser(parser_name, "", {})
    tool_choice: object = "required" if choice == "required" else NAMED_GET
    text = FORCED_TEXT[parser_name]
    if choice == "named":  # (its grammar writes one call)
        text = text[: text.index('"a": 9}') + 7] + {"hermes": "}\n</tool_call>",
                                                     "llama3_json": "}", "mistral": "}]"}[parser_name]  # fmt: skip
    args = ['{"a": 9}', '{"a": 1}']
    for n in range(1, len(text) + 1):
        cut = text[:n]
        by_char = _feed_tools(RequestTools(parser, [GET], tool_choice, True), list(cut))
        whole = _feed_tools(RequestTools(parser, [GET], tool_choice, True), [cut])
        assert by_char == whole, cut
        content, calls = whole
        assert content == "", cut
        named = cut.count('"get"')
        assert len(calls) == (named if choice == "required" else 1), cut
        for i, call in enumerate(calls):
            assert call["name"] == "get" and args[i].startswith(call["arguments"]), cut
            if cut.count(args[i]) or i < len(calls) - 1:  # (written whole)
                assert call["arguments"] == args[i], cut


def test_an_auto_call_cut_in_its_end_marker_is_the_call() -> None:
    """In "auto" mode the end marker a cut left half-written, after a hermes block's call, is
    the block's (vLLM reads it as one token: never content); it came out as content ('</t').
    A block cut before its call's name is no call yet: content, as it was."""
    call = '<tool_call>\n{"name": "get", "arguments": {"a": 9}}\n</tool_call>'
    for n in range(len(call) - len("</tool_call>"), len(call) + 1):
        for step in (1, n):
            assert _stream("hermes", "Sure.\n" + call[:n], step) == (
                "Sure.",
                [{"name": "get", "arguments": '{"a": 9}'}],
            ), (n, step)
    content, calls = _stream("hermes", f'Sure.\n{call}\n<tool_call>\n{{"na', 1)
    assert content.endswith('\n<tool_call>\n{"na') and [c["name"] for c in calls] == ["get"]


def _scan_reference(s: str, i: int) -> int | None:
    """JSON value scanning a character at a time (the parsers' scanner before it went on from
    where it stopped): the end of the value at s[i], None while it is incomplete."""
    if s[i] not in '"{[':
        j = i
        while j < len(s) and s[j] not in ",}] \t\n\r":
            j += 1
        return j if j < len(s) else None
    depth, j, in_string = 0, i, False
    while j < len(s):
        c = s[j]
        if in_string:
            if c == "\\":
                j += 1
            elif c == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def test_value_scans_go_on_where_they_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value's scan at each step goes on from the step before's (a long call was quadratic:
    bench/tool_calls.py) and finds what a scan from the start finds: on random JSON-like text
    (escapes, a backslash as a step's last character, brackets inside strings) growing a few
    characters at a time, two texts interleaved on one set of scans, and a text that does not
    continue the last one (a scan must not be taken for it). Every scan kept, however short."""
    monkeypatch.setattr(tool_parsers, "SCAN_KEPT_CHARS", 0)
    rng = random.Random(7)
    alphabet = ['"', "\\", "{", "}", "[", "]", ",", ":", " ", "a", "1", "\n"]
    for _ in range(60):
        texts = ["".join(rng.choice(alphabet) for _ in range(120)) for _ in range(2)]
        texts = [rng.choice('{["') + t for t in texts]
        scans = _Scans()
        for n in range(1, 122, rng.randint(1, 4)):
            for t in texts:
                for at in (0, 1):  # (two places in one text)
                    if at < n:
                        assert _scan_value(t[:n], at, scans) == _scan_reference(t[:n], at), (t, n)
        other = texts[0][:60] + "x" + texts[0][61:]  # not a continuation of what was scanned
        assert _scan_value(other, 0, scans) == _scan_reference(other, 0)


class _Counted:
    """A compiled pattern that counts the characters its scans go over (up to the match's
    start for a search, its end for a match; to the end of the text when it fails)."""

    def __init__(self, pattern: re.Pattern[str], counts: list[int]) -> None:
        self.pattern, self.counts = pattern, counts

    def match(self, s: str, pos: int = 0) -> re.Match[str] | None:
        m = self.pattern.match(s, pos)
        self.counts[0] += (m.end() if m else len(s)) - pos
        return m

    def search(self, s: str, pos: int = 0) -> re.Match[str] | None:
        m = self.pattern.search(s, pos)
        self.counts[0] += (m.start() if m else len(s)) - pos
        return m


def _code_call(chars: int, tag: str = "") -> str:
    code = tag + ("x = 'q'  # \"\u00e9\" \\ {[\n" * (chars // 20 + 1))[:chars]
    return (
        f'<tool_call>\n{{"name": "run", "arguments": {json.dumps({"code": code})}}}\n</tool_call>'
    )


LINEAR_CASES = {
    "one long call": ("hermes", [_code_call(8000)]),
    "a call repeated": ("hermes", [_code_call(4000) + "\n" + _code_call(4000)]),
    "eight calls": ("hermes", ["\n".join(_code_call(1000, str(k)) for k in range(8))]),
    "eight completions": ("hermes", [_code_call(2000, str(k)) for k in range(8)]),
}


@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_streamed_calls_are_scanned_in_linear_work(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Streamed 4 characters a step, the output's scans go over each character a bounded number
    of times, not once a step: a call repeated (its scan taken for the first's, and dropped),
    more calls than the scans kept held, the completions of one request sharing them, were each
    quadratic (seconds of the worker's event loop for 20,000 characters). Counted, not timed.
    (A run of separators after a marker, whitespace or brackets, is still scanned again at each
    step, in the regular expression: 0.1-0.2 s for 20,000 characters, where a Python loop took
    4-5 s.)"""
    counts = [0]
    for name in ("_STRING_REST", "_STRUCTURE", "_SCALAR", "_SPACE", "_BETWEEN_CALLS"):
        monkeypatch.setattr(tool_parsers, name, _Counted(getattr(tool_parsers, name), counts))
    parser_name, texts = LINEAR_CASES[case]
    tools = RequestTools(make_parser(parser_name, "", {}), [], "auto", True)
    for at in range(0, max(map(len, texts)), 4):
        for index, text in enumerate(texts):
            if at < len(text):
                tools.delta(index, text[at : at + 4], [], at + 4 >= len(text))
    total = sum(map(len, texts))
    assert counts[0] < 40 * total, (counts[0], total)


def test_long_calls_stream_whole() -> None:
    """Calls of many characters (a program in a string, many small objects), a few characters a
    step: the streamed arguments are the call's, and nothing is content."""
    code = "".join(f'def f{i}(x):\n    return x * {i}  # "q" \\ \u00e9\n' for i in range(150))
    rows = [{"id": i, "name": f"n{i}", "tags": ["a", "]"], "ok": None} for i in range(150)]
    for args in ({"code": code}, {"rows": rows}):
        text = f'<tool_call>\n{{"name": "run", "arguments": {json.dumps(args)}}}\n</tool_call>'
        content, calls = _stream("hermes", text, 3)
        assert content == "" and len(calls) == 1 and json.loads(calls[0]["arguments"]) == args


def test_marker_special_token_is_seen_by_id() -> None:
    """A marker that is a special token never reaches the text: its id stands for it."""
    parser = make_parser("mistral", "", {"[TOOL_CALLS]": 77})
    stream = ToolCallStream(parser)
    out = [
        stream.feed("", [77], False),
        stream.feed('[{"name": "f", "arguments": {}}]', [5, 6], True),
    ]
    assert _reassemble(out) == ("", [{"name": "f", "arguments": "{}"}])
    assert "<[77]>" in parser.grammar(TOOLS, True)


def test_an_end_marker_special_token_is_seen_by_id() -> None:
    """Tokenizers that make "</tool_call>" a special token too (the detokenizer drops it): the
    end stands where its token was, and the calls after the first are calls (the second was
    read as part of the first region, and lost)."""
    parser = make_parser("hermes", "", {"<tool_call>": 77, "</tool_call>": 78})
    stream = ToolCallStream(parser)
    steps = [("", [77]), ('\n{"name": "f", "arguments": {"a": 1}}\n', [5, 6]), ("", [78]),
             ("\n", [9]), ("", [77]), ('\n{"name": "g", "arguments": {}}\n', [5]), ("", [78])]  # fmt: skip
    out = [stream.feed(t, ids, k == len(steps) - 1) for k, (t, ids) in enumerate(steps)]
    assert _reassemble(out) == ("", [{"name": "f", "arguments": '{"a": 1}'},
                                     {"name": "g", "arguments": "{}"}])  # fmt: skip


# what a model may write in a call that is not JSON: a bad literal, a bad escape, a bare word,
# and NaN / Infinity (which Python's json takes, and no client's parser does). Before the
# call's name it is no call: its text is content. After the name it is a call (streamed, its
# name has gone out by then), its arguments the model's text: the gateway finishes it "stop",
# not "tool_calls". Keys after the name other than the arguments are skipped. (1e999 is JSON,
# kept as written: arguments that are no object finish "stop" too.)
NOT_JSON: list[tuple[str, str, list[tuple[str, str]] | None]] = [
    ("hermes", '<tool_call>\n{"name": tru, "arguments": {}}', None),
    ("hermes", '<tool_call>\n{"\\q": 1}', None),
    ("hermes", '<tool_call>\n{"name": "f\\q", "arguments": {}}\n</tool_call>', None),
    ("hermes", '<tool_call>\n{"arguments": {"a": NaN}, "name": "f"}\n</tool_call>', None),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": abc}', [("f", "abc")]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": NaN}}', [("f", '{"a": NaN}')]),
    ("hermes", '<tool_call>\n{"name": "f", "\\q": 1, "arguments": {"a": 1}}', [("f", '{"a": 1}')]),
    ("hermes", '<tool_call>\n{"name": "f", "name": 7}\n</tool_call>', [("f", "{}")]),
    ("hermes", '<tool_call>\n{"name": "f", oops}\n</tool_call>', [("f", "")]),  # (read so far)
    ("llama3_json", '{"name": "f", "parameters": 1e999}', [("f", "1e999")]),
    ("llama3_json", '{"name": "f", "parameters": NaN}', [("f", "NaN")]),
    (
        "llama3_json",
        '{"name": "f", "parameters": {"a": [-Infinity]}}',
        [("f", '{"a": [-Infinity]}')],
    ),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": x1}]', [("f", "x1")]),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1.5e400}}, {"name": "g"}]',
        [("f", '{"x": 1.5e400}'), ("g", "{}")],
    ),
]


@pytest.mark.parametrize(("parser", "text", "calls"), NOT_JSON)
def test_a_call_that_is_not_json(
    parser: str, text: str, calls: list[tuple[str, str]] | None
) -> None:
    """A call that is not JSON before its name is content; after it, a call with the model's
    arguments. Whatever the steps (a character at a time, as tokens stream, or all at once),
    the same: a call whose name went out is never taken back, nor its text sent again as
    content. (Streamed, the call went out and then, once whole, its text came as content too,
    finishing "stop"; before that, it raised JSONDecodeError in the worker's stream: a 503, and
    the worker set aside.)"""
    expected = (
        (text, []) if calls is None else ("", [{"name": n, "arguments": a} for n, a in calls])
    )
    for step in (1, 3, len(text)):
        assert _stream(parser, text, step) == expected, step


RUN = {"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}


def _answer(
    text: str, step: int, stream: bool, parser: str = "hermes", offered: list[Any] | None = None
) -> tuple[Any, ...]:
    """`text` through the worker's delta path (`step` characters a step) and the gateway's
    assembler, TOOLS and RUN offered (or `offered`): (finish_reason, content, calls) of its
    final answer, and, streamed, of its chunks put together."""
    offered = [*TOOLS, RUN] if offered is None else offered
    tools = RequestTools(make_parser(parser, "", {}), offered, "auto", True)
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    events: list[Any] = [StartEvent("r1", "w-1", 3)]
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        o = CompletionOutput(0, delta_text=piece, delta_token_ids=[i],
                             finish_reason="stop" if final else None)  # fmt: skip
        events.append(_delta(None, o, set(), {}, tools))  # type: ignore[arg-type]
    asm = _chat(stream=stream)
    chunks = _feed(asm, _events(*events, DoneEvent(3, len(pieces))))
    openai.types.chat.ChatCompletion.model_validate(asm.final())  # (what clients read)
    msg = asm.final()["choices"][0]
    calls = [
        (c["function"]["name"], c["function"]["arguments"])
        for c in msg["message"].get("tool_calls", [])
    ]
    answer = (msg["finish_reason"], msg["message"]["content"], calls)
    if not stream:
        return answer, answer
    content, streamed, finish = "", [], None
    for chunk in chunks:
        for choice in chunk["choices"]:
            content += choice["delta"].get("content") or ""
            for d in choice["delta"].get("tool_calls") or []:
                if "id" in d:
                    streamed.append([d["function"]["name"], ""])
                streamed[d["index"]][1] += d["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return answer, (finish, content or None, [tuple(c) for c in streamed])


@pytest.mark.parametrize(
    ("text", "finish", "content", "calls"),
    [
        ('<tool_call>\n{"name": "get_time"}\n</tool_call>', "tool_calls", None,
         [("get_time", "{}")]),
        ('<tool_call>\n{"name": "run", "arguments": {"code": "print(1)\nprint(2)"}}\n</tool_call>',
         "tool_calls", None, [("run", '{"code": "print(1)\nprint(2)"}')]),
        ('Hi <tool_call>\n{"name": "get_time", "arguments": {"a": NaN}}\n</tool_call>', "stop",
         "Hi", [("get_time", '{"a": NaN}')]),
        ('Hi <tool_call>\n{"name": tru}\n</tool_call>', "stop",
         'Hi <tool_call>\n{"name": tru}\n</tool_call>', []),
    ],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_from_the_worker_to_the_answer(
    text: str, finish: str, content: str | None, calls: list[tuple[str, str]], stream: bool
) -> None:
    """Streamed by the worker a character a step (as tokens arrive), three, or at once, and
    answered streamed or not: the same answer. A call without arguments has "{}" and finishes
    "tool_calls" (it had "" and finished "stop"), so does a call whose strings hold raw
    newlines (code); a call that is not JSON after its name finishes "stop", its text not
    given again as content (streamed, it was: the call and its text twice)."""
    for step in (1, 3, len(text)):
        answer, streamed = _answer(text, step, stream)
        assert answer == (finish, content, calls), step
        assert streamed == answer, step


# a model's output that names a function the request did not offer (or is prose that holds a
# JSON object with a "name"): no call, its text the answer's content, byte for byte
UNKNOWN: list[tuple[str, str]] = [
    ("hermes", '<tool_call>\n{"name": "not_a_tool", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    ("hermes", 'Let me see. <tool_call>\n{"arguments": {}, "name": "get_tim"}\n</tool_call>\n'
               "Done. "),
    ("llama3_json", '{"name": "not_a_tool", "parameters": {"zone": "CET"}}'),
    ("llama3_json", '  {"name": "Ada Lovelace", "born": 1815} was the first programmer.'),
    ("llama3_json", '<|python_tag|>{"name": "not_a_tool", "parameters": {}}'),
    ("llama3_json", '{"name": "not_a_tool", "parameters": {}}; {"name": "get_time", '
                    '"parameters": {"zone": "CET"}}'),
    ("mistral", 'Sure [TOOL_CALLS][{"name": "not_a_tool", "arguments": {"x": 1}}]'),
    ("mistral", '[TOOL_CALLS][{"name": "not_a_tool"}, {"name": "get_time"}]'),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text"), UNKNOWN)
def test_a_call_of_a_function_not_offered_is_text(parser: str, text: str) -> None:
    """Streamed a character a step (as tokens arrive), a few, or at once (the non-streamed
    answer): no tool-call delta ever goes out, not even the start of one, and the content adds
    up to the model's text. (It was a call of a function the client never offered.)"""
    for step in (1, 2, 3, 7, len(text)):
        tools = RequestTools(make_parser(parser, "", {}), TOOLS, "auto", True)
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        content = ""
        for i, piece in enumerate(pieces):
            delta, calls = tools.delta(0, piece, [], i == len(pieces) - 1)
            assert calls == [], (step, i)
            content += delta
        assert content == text, step


@pytest.mark.parametrize(("parser", "text"), UNKNOWN)
@pytest.mark.parametrize("stream", [False, True])
def test_a_call_of_a_function_not_offered_is_text_in_the_answer(
    parser: str, text: str, stream: bool
) -> None:
    """Through the worker and the gateway, streamed or not: the model's text as the message's
    content, no tool_calls, finish "stop"."""
    for step in (1, 3, len(text)):
        answer, streamed = _answer(text, step, stream, parser)
        assert answer == ("stop", text, []), step
        assert streamed == answer, step


def test_a_hermes_block_not_offered_before_a_call_is_content() -> None:
    """A block naming a function not offered, then a call: the block is content (the text
    before the first call), sent as soon as it closes, not held back to the end nor lost; the
    call is a call."""
    block = '<tool_call>\n{"name": "not_a_tool", "arguments": {"a": 1}}\n</tool_call>'
    text = f"Hm. {block}\n<tool_call>\n{CALL_B}\n</tool_call>"
    for step in (1, 4, len(text)):
        tools = RequestTools(make_parser("hermes", "", {}), TOOLS, "auto", True)
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        deltas = [tools.delta(0, p, [], i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert _reassemble(deltas) == (f"Hm. {block}", [{"name": "get_time",
                                                        "arguments": '{"zone": "UTC"}'}]), step  # fmt: skip
        if step < len(text):  # (out before the call's name is)
            announced = next(k for k, (_, calls) in enumerate(deltas) if calls)
            assert "".join(d for d, _ in deltas[:announced]) == f"Hm. {block}", step


# a call followed by one that is no call: a function not offered, or text that is not a call's
# JSON. The first is a call; the second's text is content (it was dropped without a word).
# Hermes blocks stand alone (a call after such a block is a call); in llama3_json and mistral
# the rest of the output from the first object that is no call is content.
NO_CALL = '<tool_call>\n{"name": "not_a_tool", "arguments": {"a": 1}}\n</tool_call>'
AFTER_A_CALL: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("hermes", f"Hm. <tool_call>\n{CALL_B}\n</tool_call>\n{NO_CALL}", f"Hm. \n{NO_CALL}",
     [("get_time", '{"zone": "UTC"}')]),
    ("hermes", f"<tool_call>\n{CALL_B}\n</tool_call>\n<tool_call>\nnot json\n</tool_call>",
     "\n<tool_call>\nnot json\n</tool_call>", [("get_time", '{"zone": "UTC"}')]),
    ("hermes", f"<tool_call>\n{CALL_B}\n</tool_call>\n{NO_CALL}\n<tool_call>\n{CALL_A}\n"
     "</tool_call>\nDone.", f"\n{NO_CALL}\n\nDone.",
     [("get_time", '{"zone": "UTC"}'),
      ("get_weather", '{"city": "Pa\\"ris }", "unit": "celsius"}')]),
    ("hermes", f"<tool_call>\n{CALL_B}\n</tool_call>\n<tool_call>\n{{\"name\": \"get_",
     "\n<tool_call>\n{\"name\": \"get_", [("get_time", '{"zone": "UTC"}')]),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "CET"}}; '
     '{"name": "not_a_tool", "parameters": {}}', '{"name": "not_a_tool", "parameters": {}}',
     [("get_time", '{"zone": "CET"}')]),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "CET"}} is the call.',
     "is the call.", [("get_time", '{"zone": "CET"}')]),
    ("mistral", 'Sure [TOOL_CALLS][{"name": "get_time"}, {"name": "not_a_tool"}, '
     '{"name": "get_time"}]', 'Sure {"name": "not_a_tool"}, {"name": "get_time"}]',
     [("get_time", "{}")]),
    ("mistral", '[TOOL_CALLS][{"name": "get_time"}, {"name": tru}]', '{"name": tru}]',
     [("get_time", "{}")]),
    # an object that closes with no name is no call (it was a nameless call, which scrambled
    # the text after it when streamed a token a step, and lost the calls after it)
    ("llama3_json", '{"answer": 42} is the result.', '{"answer": 42} is the result.', []),
    ("mistral", 'Sure [TOOL_CALLS][{"x": 1}] done', 'Sure [TOOL_CALLS][{"x": 1}] done', []),
    ("llama3_json", '{"name": "get_time", "parameters": {}}; {"x": 1}; '
     '{"name": "get_time", "parameters": {"zone": "UTC"}}',
     '{"x": 1}; {"name": "get_time", "parameters": {"zone": "UTC"}}', [("get_time", "{}")]),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "content", "calls"), AFTER_A_CALL)
def test_what_follows_a_call_and_is_no_call_is_content(
    parser: str, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    """Streamed a character a step, a few, or at once: the calls, and the text that is no call
    as content, the same whatever the steps (the call that followed a call and was not one,
    and any text after the calls, were lost)."""
    expected = (content.rstrip(), [{"name": n, "arguments": a} for n, a in calls])
    for step in (1, 2, 3, 7, len(text)):
        tools = RequestTools(make_parser(parser, "", {}), TOOLS, "auto", True)
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        deltas = [tools.delta(0, p, [], i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert _reassemble(deltas) == expected, step


@pytest.mark.parametrize(("parser", "text", "content", "calls"), AFTER_A_CALL)
@pytest.mark.parametrize("stream", [False, True])
def test_what_follows_a_call_and_is_no_call_is_content_in_the_answer(
    parser: str, text: str, content: str, calls: list[tuple[str, str]], stream: bool
) -> None:
    """Through the worker and the gateway, streamed or not: the calls, finish "tool_calls"
    (each call is whole; "stop" with none), and the text that is no call as the message's
    content."""
    for step in (1, 3, len(text)):
        answer, streamed = _answer(text, step, stream, parser)
        assert answer == ("tool_calls" if calls else "stop", content.rstrip(), calls), step
        assert streamed == answer, step


class _BrokenHermes(HermesParser):
    """A parser with a bug: it raises once the tool region starts."""

    def parse(
        self, text: str, final: bool, names: frozenset[str] | None = None
    ) -> tuple[str, list[Any], bool]:
        if self.marker in text:
            raise RuntimeError("parser bug")
        return super().parse(text, final, names)


def test_a_parser_failure_leaves_the_text_as_content() -> None:
    """The worker's delta path survives a parser that raises: it logs it and sends the output
    from there on as content, nothing lost (the exception broke the stream)."""
    tools = RequestTools(_BrokenHermes(), TOOLS, "auto", True)
    steps = ["Well ", "<tool_", "call>\n{", '"name": "f"}', " end"]
    texts: list[str] = []
    for i, piece in enumerate(steps):
        final = i == len(steps) - 1
        o = CompletionOutput(0, delta_text=piece, delta_token_ids=[i],
                             finish_reason="stop" if final else None)  # fmt: skip
        event = _delta(None, o, set(), {}, tools)  # type: ignore[arg-type]
        assert event is not None and not event.tool_calls
        texts.append(event.text)
    assert "".join(texts) == "".join(steps)


@pytest.fixture(scope="module")
def marker_tokenizer(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path) -> Tokenizer:
    """stories260K's tokenizer with mistral's [TOOL_CALLS] as a special token: its text never
    reaches the output, only its id."""
    d = tmp_path_factory.mktemp("marker_tokenizer")
    for name in ("tokenizer_config.json", "config.json"):
        shutil.copy(stories_dir / name, d / name)
    backend = HFTokenizer.from_file(str(stories_dir / "tokenizer.json"))
    backend.add_special_tokens(["[TOOL_CALLS]"])
    backend.save(str(d / "tokenizer.json"))
    return Tokenizer.from_dir(d)


@pytest.mark.parametrize(
    ("before", "stop", "arguments"),
    [
        ("Sure, the time.", None, '{"zone": "UTC"}'),
        ("Sure 😊", None, '{"zone": "UTC"}'),  # (its bytes are held back until after the marker)
        ("Ok", ['"z'], "{"),  # (text that may begin the stop string is held back, then cut)
    ],
)
def test_marker_token_inside_a_step_of_several_tokens(
    marker_tokenizer: Tokenizer, before: str, stop: list[str] | None, arguments: str
) -> None:
    """A step may hold several tokens (speculative decoding): text, the marker's special token,
    the call. The marker goes where its token was, whatever the steps' sizes and the text the
    detokenizer holds back (it was put at the step's start: the text before it was taken for
    the tool region, and the call was lost)."""
    tok = marker_tokenizer
    marker = tok.added_tokens["[TOOL_CALLS]"]
    call = '[{"name": "get_time", "arguments": {"zone": "UTC"}}]'
    ids = [
        *tok.encode(before, add_special_tokens=False),
        marker,
        *tok.encode(call, add_special_tokens=False),
    ]
    prompt = tok.encode("Once upon a time")
    for size in (1, 2, 3, 5, len(ids)):  # (after a first step of one token, as the engine's)
        detok = IncrementalDetokenizer(tok, prompt, stop=stop)
        tools = RequestTools.of(TOOLS, "auto", True, tok, "mistral")
        assert tools is not None and tools.parser.marker_token_id == marker
        tools.context = prompt[-8:]  # (the worker sets the prompt's last tokens)
        deltas, at = [], 0
        while not detok.finished:
            step = ids[at : at + (size if at else 1)]
            at += len(step)
            text = "".join(detok.append(t) for t in step)
            text += detok.flush() if at == len(ids) else ""
            deltas.append(tools.delta(0, text, step, detok.finished))
        calls = [{"name": "get_time", "arguments": arguments}]
        assert _reassemble(deltas) == (f" {before}", calls), size  # (" ": after the prompt)


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
def test_without_parallel_calls_a_completion_ends_at_its_first_call(parser_name: str) -> None:
    """parallel_tool_calls false, tool_choice auto: the first call is the only one, and the
    completion ends once it is complete (whatever the model writes next)."""
    text = dict(
        hermes=f"<tool_call>\n{CALL_A}\n</tool_call>\n<tool_call>\n{CALL_B}\n</tool_call>",
        llama3_json=f"{CALL_A}; {CALL_B}",
        mistral=f"[TOOL_CALLS][{CALL_A}, {CALL_B}]",
    )[parser_name]
    tools = RequestTools(make_parser(parser_name, "", {}), TOOLS, "auto", False)
    deltas, steps = [], 0
    while not tools.ended(0):  # a character a step
        deltas.append(tools.delta(0, text[steps], [], False))
        steps += 1
    assert steps == text.index(CALL_A) + len(CALL_A)  # the step that closed the first call
    args = '{"city": "Pa\\"ris }", "unit": "celsius"}'
    assert _reassemble(deltas) == ("", [{"name": "get_weather", "arguments": args}])


def test_parser_from_template() -> None:
    assert make_parser(None, "... <tool_call> ...", {}).name == "hermes"
    assert make_parser(None, "... [TOOL_CALLS] ...", {}).name == "mistral"
    assert make_parser(None, "... <|python_tag|> ...", {}).name == "llama3_json"
    assert make_parser(None, "no markers", {}).name == "hermes"
    assert make_parser("mistral", "<tool_call>", {}).name == "mistral"
    with pytest.raises(ValueError, match="one of"):
        make_parser("nope", "", {})


# ------------------------------------------------------------------------ grammar on stories
@pytest.fixture(scope="module")
def stories(stories_dir: Path) -> LLM:
    return LLM(str(stories_dir), kv_cache_bytes=4_000_000, block_size=16)


def _calls_of(
    parser_name: str, tokenizer: Any, token_ids: list[int], text: str
) -> list[dict[str, Any]]:
    stream = ToolCallStream(make_parser(parser_name, "", tokenizer.added_tokens))
    return _reassemble([stream.feed(text, token_ids, True)])[1]


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize(
    ("choice", "parallel"), [("required", True), ("required", False), ("get_time", True)]
)
def test_forced_calls_always_parse(
    stories: LLM, parser_name: str, choice: str, parallel: bool
) -> None:
    """30 seeded samples each: the output is one or more calls (exactly one, of the named
    function, or with parallel_tool_calls false) whose arguments validate against that
    function's schema. "required" allows any number of calls: one that max_tokens cut off is a
    prefix of a valid call, the ones before it validate."""
    _forced_calls(stories, parser_name, TOOLS, SCHEMAS, choice, parallel)


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("choice", ["required", "Person", "tree", "idd", "anchored", "untyped"])
def test_forced_calls_with_refs_in_parameters(stories: LLM, parser_name: str, choice: str) -> None:
    """Parameters with `$defs` / `definitions` and `$ref`s into them or to their own root
    compile into the grammar (they were a 400: "Pointer '/$defs/Addr' does not exist"), and
    every call validates against them."""
    _forced_calls(stories, parser_name, REF_TOOLS, REF_SCHEMAS, choice, True)


def _forced_calls(
    stories: LLM,
    parser_name: str,
    offered: list[Any],
    schemas: dict[str, Any],
    choice: str,
    parallel: bool,
) -> None:
    tok = stories.tokenizer
    tool_choice: object = choice
    if choice != "required":
        tool_choice = {"type": "function", "function": {"name": choice}}
    parser = make_parser(parser_name, "", tok.added_tokens)
    tools = RequestTools(parser, offered, tool_choice, parallel)
    params = []
    for seed in range(30):
        p = SamplingParams(max_tokens=160, temperature=1.0, seed=seed)
        tools.constrain(p)
        params.append(p)
    for out in stories.generate(["Once upon a time"] * 30, params):
        o = out.outputs[0]
        calls = _calls_of(parser_name, tok, o.token_ids, o.text)
        assert calls, o.text
        if choice != "required":
            assert [c["name"] for c in calls] == [choice]
        if choice != "required" or not parallel:
            assert o.finish_reason == "stop" and len(calls) == 1, o.text
        complete = calls if o.finish_reason == "stop" else calls[:-1]
        assert o.finish_reason == "stop" or complete, o.text
        for c in complete:
            arguments = json.loads(c["arguments"])
            assert isinstance(arguments, dict), c  # (an object, whatever the schema says)
            jsonschema.validate(arguments, schemas[c["name"]])


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
def test_a_named_call_cut_by_max_tokens_is_still_the_call(stories: LLM, parser_name: str) -> None:
    """A named tool_choice's grammar allows nothing but that call. Cut by max_tokens at any
    point, even before its name is complete (`<tool_call>\\n{"name": "get_`), the answer is that
    call, streamed or not, with the arguments generated so far; never the grammar's half-written
    text as content (it was, for every cut before the name's closing quote)."""
    tok = stories.tokenizer
    parser = make_parser(parser_name, "", tok.added_tokens)
    choice = {"type": "function", "function": {"name": "get_time"}}
    params = []
    for n in range(1, 25):
        p = SamplingParams(max_tokens=n, temperature=0)
        RequestTools(parser, TOOLS, choice, True).constrain(p)
        params.append(p)
    cut_in_name = 0
    for out in stories.generate(["Once upon a time"] * len(params), params):
        o = out.outputs[0]
        ids = list(o.token_ids)
        whole = RequestTools(parser, TOOLS, choice, True, tok.decode)
        streamed = RequestTools(parser, TOOLS, choice, True, tok.decode)
        content, calls = _reassemble([whole.delta(0, o.text, ids, True)])
        pieces = []  # a token at a time, as the worker streams
        for i in range(len(ids)):
            text = tok.decode(ids[: i + 1])[len(tok.decode(ids[:i])) :]
            pieces.append(streamed.delta(0, text, ids[i : i + 1], i == len(ids) - 1))
        assert (content, [c["name"] for c in calls]) == ("", ["get_time"]), (o.text, content)
        assert _reassemble(pieces) == (content, calls), o.text
        if o.finish_reason == "length" and '"get_time"' not in o.text:
            cut_in_name += 1
            assert calls[0]["arguments"] == ""
    assert cut_in_name >= 3  # (the cuts this test is about happened)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_cut_by_max_tokens_leave_no_content(stories: LLM, choice: str) -> None:
    """The reviewer's request on the engine (hermes; the formats' cuts are all read above):
    `get` forced ("required", or by name), cut by max_tokens after every token of its output
    (greedy) and streamed a token at a time as the worker streams: no content at any cut (cuts
    inside the end marker gave '<', '</t', '</tool'; inside a second call,
    '\n<tool_call>\n{"'), the calls whose names were out stand, and those before the cut
    validate."""
    tok = stories.tokenizer
    parser = make_parser("hermes", "", tok.added_tokens)
    tool_choice: object = "required" if choice == "required" else NAMED_GET
    params = []
    for n in range(1, 100):
        p = SamplingParams(max_tokens=n, temperature=0)
        RequestTools(parser, [GET], tool_choice, True).constrain(p)
        params.append(p)
    cuts = set()
    for out in stories.generate(["Once upon a time"] * len(params), params):
        o = out.outputs[0]
        ids = list(o.token_ids)
        tools = RequestTools(parser, [GET], tool_choice, True, tok.decode)
        pieces = []
        for i in range(len(ids)):
            text = tok.decode(ids[: i + 1])[len(tok.decode(ids[:i])) :]
            pieces.append(tools.delta(0, text, ids[i : i + 1], i == len(ids) - 1))
        content, calls = _reassemble(pieces)
        assert content == "", o.text
        names = o.text.count('"get"') if choice == "required" else 1
        assert [c["name"] for c in calls] == ["get"] * names, o.text
        for c in calls[:-1] if o.finish_reason == "length" else calls:
            jsonschema.validate(json.loads(c["arguments"]), GET["function"]["parameters"])
        cuts.add(o.text)
    assert len(cuts) > 25  # (the output was cut at many places, markers' insides among them)


# ------------------------------------------------------------------------------ the service
CATALOG = "regions:\n  - {name: local, latitude: 0, longitude: 0, settings: {models: [stories]}}\n"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Stack:
    def __init__(self, root: Path, stories: Path) -> None:
        model = root / "stories-tools"
        model.mkdir()
        for f in stories.iterdir():
            (model / f.name).symlink_to(f)
        (model / "chat_template.jinja").write_text(TOOL_TEMPLATE)
        (root / "regions.yaml").write_text(CATALOG)
        self.redis = LocalRedis().start()
        self.worker: Proc = start_worker("w1", model, self.redis.url, root, "local")
        self.gateway = start_gateway("gw", self.redis.url, root / "regions.yaml", root, "local")
        wait_until(lambda: get_json(f"{self.gateway.url}/readyz")[1]["workers"] == 1, 30, "worker")
        self.client = openai.OpenAI(
            base_url=f"{self.gateway.url}/v1", api_key="none", max_retries=0, timeout=60
        )

    def close(self) -> None:
        self.gateway.stop()
        self.worker.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path):  # type: ignore[no-untyped-def]
    s = Stack(tmp_path_factory.mktemp("tools"), stories_dir)
    try:
        yield s
    finally:
        s.close()


def _check_calls(message: Any, truncated: bool = False) -> list[Any]:
    """Every call validates (but the last, cut off by max_tokens, when `truncated`)."""
    assert message.tool_calls, message
    for call in message.tool_calls[: -1 if truncated else None]:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return list(message.tool_calls)


def test_required_and_named_through_the_gateway(stack: Stack) -> None:
    for seed in range(5):
        r = stack.client.chat.completions.create(
            model="stories",
            messages=USER,
            tools=TOOLS,
            tool_choice="required",  # type: ignore[arg-type]
            max_tokens=160,
            temperature=1.0,
            seed=seed,
        )
        finish = r.choices[0].finish_reason
        assert finish in ("tool_calls", "length")  # required: one call or more
        _check_calls(r.choices[0].message, truncated=finish == "length")
    r = stack.client.chat.completions.create(
        model="stories",
        messages=USER,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=160,
        temperature=0,
    )
    calls = _check_calls(r.choices[0].message)
    assert [c.function.name for c in calls] == ["get_weather"]
    assert r.choices[0].message.content is None
    # cut by max_tokens inside the grammar's text, before the name: still the named call
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        kwargs: Any = {"model": "stories", "messages": USER, "tools": TOOLS, "max_tokens": 2}
        if not stream:
            r = stack.client.chat.completions.create(**kwargs, tool_choice=named)
            message = r.choices[0].message
            assert r.choices[0].finish_reason == "length" and message.content is None
            assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
                ("get_weather", "")
            ]
            continue
        chunks = list(stack.client.chat.completions.create(**kwargs, tool_choice=named,
                                                           stream=True))  # fmt: skip
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert not "".join(d.content or "" for d in deltas)
        assert [t.function.name for d in deltas for t in d.tool_calls or []] == ["get_weather"]
        assert chunks[-1].choices[0].finish_reason == "length"


def test_nested_pydantic_tool_through_the_gateway(stack: Stack) -> None:
    """A tool from `openai.pydantic_function_tool` of a model with a nested model (`$defs`,
    `$ref`), forced by name: the client's own parse() reads the call back into the model (it
    was a 400: "Pointer '/$defs/Addr' does not exist")."""
    r = stack.client.chat.completions.parse(
        model="stories",
        messages=USER,
        tools=[PERSON],
        tool_choice={"type": "function", "function": {"name": "Person"}},
        max_tokens=160,
        temperature=0,
    )
    calls = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert isinstance(calls[0].function.parsed_arguments, Person)


def test_parallel_tool_calls_false_makes_one_call(stack: Stack) -> None:
    """Required and named: a grammar of one call. Auto: the completion ends after its first
    call; stories260K writes none by itself, so guided_choice makes it write two."""
    kwargs: dict[str, Any] = dict(model="stories", messages=USER, tools=TOOLS, max_tokens=160,
                                  temperature=1.0, parallel_tool_calls=False)  # fmt: skip
    for seed in range(5):
        r = stack.client.chat.completions.create(**kwargs, tool_choice="required", seed=seed)
        assert r.choices[0].finish_reason == "tool_calls"
        assert len(_check_calls(r.choices[0].message)) == 1
    two = "".join(f"<tool_call>\n{call}\n</tool_call>\n" for call in (CALL_B, CALL_A))
    tokens = {}
    for parallel in (True, False):
        r = stack.client.chat.completions.create(
            **kwargs | {"parallel_tool_calls": parallel, "temperature": 0},
            extra_body={"guided_choice": [two]},
        )
        calls = r.choices[0].message.tool_calls or []
        assert r.choices[0].finish_reason == "tool_calls"
        names = ["get_time", "get_weather"] if parallel else ["get_time"]
        assert [c.function.name for c in calls] == names
        assert r.usage is not None
        tokens[parallel] = r.usage.completion_tokens
    assert tokens[False] < tokens[True] - 20  # it stopped there, not after the second call


def test_auto_and_none_answer_in_text(stack: Stack) -> None:
    """stories260K never writes a <tool_call> by itself: auto and none give plain content."""
    for choice in ("auto", "none"):
        r = stack.client.chat.completions.create(
            model="stories",
            messages=USER,
            tools=TOOLS,
            tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=20,
            temperature=0,
        )
        assert r.choices[0].message.content and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_calls_reassemble_into_the_answer(stack: Stack) -> None:
    kwargs: dict[str, Any] = dict(
        model="stories",
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=160,
        temperature=1.0,
    )
    for seed in (1, 2, 3):
        whole = stack.client.chat.completions.create(**kwargs, seed=seed).choices[0]
        content, calls, finish = "", [], None
        for chunk in stack.client.chat.completions.create(**kwargs, seed=seed, stream=True):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.id:
                    assert d.index == len(calls)
                    calls.append(
                        {"id": d.id, "name": d.function.name, "arguments": d.function.arguments}
                    )
                else:
                    calls[d.index]["arguments"] += d.function.arguments
            finish = chunk.choices[0].finish_reason or finish
        assert finish == whole.finish_reason and finish in ("tool_calls", "length")
        assert content == (whole.message.content or "")
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []
        ]


def test_two_turn_tool_conversation(stack: Stack) -> None:
    first = stack.client.chat.completions.create(
        model="stories",
        messages=USER,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=160,
        temperature=0,
    )
    call = _check_calls(first.choices[0].message)[0]
    messages: list[Any] = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    second = stack.client.chat.completions.create(
        model="stories",
        messages=messages,
        tools=TOOLS,
        max_tokens=24,
        temperature=0,  # type: ignore[arg-type]
    )
    assert second.choices[0].message.content
    # the tool turn reached the prompt, rendered by the model's own template
    assert second.usage is not None and first.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_response_format_json_schema(stack: Stack) -> None:
    schema = {
        "type": "object",
        "properties": {
            "hero": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["hero", "age"],
    }
    for seed in range(4):
        r = stack.client.chat.completions.create(
            model="stories",
            messages=USER,
            max_tokens=80,
            temperature=1.0,
            seed=seed,
            response_format={
                "type": "json_schema",  # type: ignore[typeddict-item]
                "json_schema": {"name": "hero", "schema": schema, "strict": True},
            },
        )
        assert r.choices[0].finish_reason == "stop"
        value = json.loads(r.choices[0].message.content or "")
        jsonschema.validate(value, schema)
        assert set(value) == {"hero", "age"}  # strict: no other properties
    # vLLM's extensions, through the completions endpoint
    r2 = stack.client.completions.create(
        model="stories",
        prompt="Once upon a time",
        max_tokens=12,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert r2.choices[0].text in ("yes", "no")


def _post(stack: Stack, body: dict[str, Any] | bytes) -> tuple[int, dict[str, Any]]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"{stack.gateway.url}/v1/chat/completions",
        data=body if isinstance(body, bytes) else orjson.dumps(body),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, orjson.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, orjson.loads(e.read())


def _tool(params: object) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": params}}]


BAD: list[tuple[dict[str, Any], str, str]] = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strnig"}},
            }
        },
        "response_format.json_schema.schema",
        "Invalid type",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
            }
        },
        "response_format.json_schema.schema",
        "uniqueItems",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema.name",
        "1-64",
    ),
    ({"guided_regex": "[a-"}, "guided_regex", "regex"),
    ({"guided_choice": "yes"}, "guided_choice", "non-empty array"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "both"),
    (
        {"tools": _tool({"type": "object", "properties": {"a": {"type": "nope"}}})},
        "tools[0].function.parameters",
        "Invalid type",
    ),
    ({"tools": _tool("not a schema")}, "tools[0].function.parameters", "JSON schema object"),
    ({"tools": _tool({"type": "array"})}, "tools[0].function.parameters", "object"),
    (
        {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
        "tools[0].function.name",
        "1-64",
    ),
    ({"tools": [*_tool(None), *_tool(None)]}, "tools[1].function.name", "twice"),
    (
        {"tools": _tool(None), "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice.function.name",
        "not among tools",
    ),
    ({"tools": _tool(None), "tool_choice": "sometimes"}, "tool_choice", "'required'"),
    (
        {
            "tools": _tool(None),
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "tool_choice",
        "cannot be combined",
    ),
    (
        {"messages": [*USER, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
        "messages[1].tool_call_id",
        "matches no tool call",
    ),
    (
        {"messages": [*USER, {"role": "tool", "content": "1"}]},
        "messages[1].tool_call_id",
        "required",
    ),
]


def _called(arguments: object) -> dict[str, Any]:
    """Messages where an assistant called a tool with `arguments` (JSON text, as sent)."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"messages": [*USER, {"role": "assistant", "tool_calls": [call]}]}


ARGS = "messages[1].tool_calls[0].function.arguments"
BAD.append((_called(7), ARGS, "must be a string"))

# Arguments that hold no JSON object the service can carry: a call max_tokens cut, and what
# Python's json takes and orjson cannot send on (a 500), or sends on as null. OpenAI takes any
# string; the chat template gets the text as sent.
NOT_AN_OBJECT = [
    "{oops", "", '{"city": "Par', "[1, 2]", '"x"', '{"a": 99999999999999999999}',
    '{"a": -9223372036854775809}', '{"a": ' + "[" * 300 + "]" * 300 + "}",
    '{"a": ' + "[" * 3000 + "]" * 3000 + "}", '{"a": NaN}', '{"a": -Infinity}', '{"a": 1e400}',
]  # fmt: skip


@pytest.mark.parametrize("arguments", NOT_AN_OBJECT)
def test_arguments_that_hold_no_object_reach_the_template_as_text(arguments: str) -> None:
    from gateway.structured import tool_message_fields

    calls: dict[str, str] = {}
    msg = _called(arguments)["messages"][1]
    fields = tool_message_fields("messages[1]", msg, "assistant", calls)
    assert fields["tool_calls"][0]["function"] == {"name": "f", "arguments": arguments}
    assert calls == {"c": "f"}
    msg = _called('{"a": [1, {"b": null}]}')["messages"][1]
    fields = tool_message_fields("messages[1]", msg, "assistant", calls)
    assert fields["tool_calls"][0]["function"]["arguments"] == {"a": [1, {"b": None}]}


def test_a_call_cut_by_max_tokens_can_be_sent_back(stack: Stack) -> None:
    """A named call that max_tokens cut comes back with arguments that are no JSON (or "",
    cut in its name); sent back in the next request's history, as OpenAI's client sends it,
    it was a 400 on `arguments`. Now the conversation goes on, the text shown as it was."""
    for max_tokens in (4, 12):
        first = stack.client.chat.completions.create(
            model="stories", messages=USER, tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=max_tokens, temperature=0,
        )  # fmt: skip
        choice = first.choices[0]
        assert choice.finish_reason == "length", choice
        call = (choice.message.tool_calls or [])[0]
        assert call.function.name == "get_weather"
        with pytest.raises(ValueError):
            json.loads(call.function.arguments)  # (cut: no JSON)
        history: list[Any] = [*USER, choice.message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": call.id, "content": "rain"}]  # fmt: skip
        second = stack.client.chat.completions.create(
            model="stories", messages=history, tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=4, temperature=0,
        )  # fmt: skip
        assert second.choices[0].finish_reason in ("length", "stop", "tool_calls"), second
        assert second.usage is not None and first.usage is not None
        assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_a_forced_call_cut_in_its_end_marker_has_no_content(stack: Stack) -> None:
    """The reviewer's repro through the gateway: a named `get`, cut by max_tokens in the last
    tokens of its call (its end marker: content was '<', '</t', '</tool'), answers content
    null with the whole call, streamed or not, and streams no content delta."""
    kwargs: Any = {"model": "stories", "messages": [{"role": "user", "content": "Tell me a story"}],
                   "tools": [GET], "tool_choice": NAMED_GET, "temperature": 0, "seed": 0}  # fmt: skip
    whole = stack.client.chat.completions.create(**kwargs, max_tokens=160)
    assert whole.choices[0].finish_reason == "tool_calls" and whole.usage is not None
    end = whole.usage.completion_tokens
    want = [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []
    ]
    assert [name for name, _ in want] == ["get"]
    for max_tokens in range(end - 8, end):
        r = stack.client.chat.completions.create(**kwargs, max_tokens=max_tokens)
        choice = r.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None, choice
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert len(calls) == 1 and calls[0][0] == "get", choice
        assert want[0][1].startswith(calls[0][1]), choice  # (whole, but cut in its "}}")
        chunks = list(stack.client.chat.completions.create(**kwargs, max_tokens=max_tokens,
                                                           stream=True))  # fmt: skip
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == "", max_tokens
        names = [t.function.name for d in deltas for t in d.tool_calls or [] if t.id and t.function]
        assert names == ["get"] and chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(("patch", "param", "text"), BAD)
def test_bad_input_is_a_400_naming_the_field(
    stack: Stack, patch: dict[str, Any], param: str, text: str
) -> None:
    status, body = _post(stack, {"model": "stories", "messages": USER, "max_tokens": 4, **patch})
    assert status == 400, body
    assert body["error"]["param"] == param, body
    assert body["error"]["type"] == "invalid_request_error"
    assert text in body["error"]["message"], body


def test_a_call_with_raw_newlines_in_its_arguments_can_be_sent_back(stack: Stack) -> None:
    """Arguments as models write them in code (a raw newline inside a string) finish
    "tool_calls"; the conversation that sends such a call back is taken, not a 400."""
    status, body = _post(stack, {"model": "stories", "max_tokens": 4,
                                 **_called('{"code": "print(1)\nprint(2)\tx"}')})  # fmt: skip
    assert status == 200, body


DEEP = '{"type": "array", "items": ' * 1000 + "{}" + "}" * 1000  # JSON orjson cannot write
DEEP_BODIES = [
    (f'{{"type": "json_schema", "json_schema": {{"name": "x", "strict": {strict}, '
     f'"schema": {DEEP}}}}}', "response_format", "response_format.json_schema.schema")
    for strict in ("true", "false")
] + [
    (f'[{{"type": "function", "function": {{"name": "f", "strict": {strict}, '
     f'"parameters": {{"type": "object", "properties": {{"a": {DEEP}}}}}}}}}]', "tools",
     "tools[0].function.parameters")
    for strict in ("true", "false")
]  # fmt: skip


@pytest.mark.parametrize(("value", "field", "param"), DEEP_BODIES)
def test_a_deeply_nested_schema_is_a_400_naming_the_field(
    stack: Stack, value: str, field: str, param: str
) -> None:
    """Nested 1,000 levels (the body's JSON may nest 1,024): strict or not, the schema is
    refused for its depth, as llguidance would refuse it, never a RecursionError (500)."""
    body = f'{{"model": "stories", "max_tokens": 4, "messages": {json.dumps(USER)}, '
    status, err = _post(stack, f'{body}"{field}": {value}}}'.encode())
    assert status == 400, err
    assert err["error"]["param"] == param, err
    assert "nests deeper than 128 levels" in err["error"]["message"], err


def test_worker_flag_offers_every_parser() -> None:
    """`edgeinfer worker --tool-call-parser` lists the parsers there are (a literal, so that the
    CLI does not import the grammar engine to build its help)."""
    import argparse

    from runtime.service_cli import add_service_commands
    from runtime.tool_parsers import PARSERS

    parser = argparse.ArgumentParser()
    add_service_commands(parser.add_subparsers(), lambda p: None)
    args = parser.parse_args(["worker", "--tool-call-parser", "mistral"])
    assert args.tool_call_parser == "mistral"
    worker = next(
        a
        for a in parser._subparsers._group_actions[0].choices["worker"]._actions  # type: ignore[union-attr]
        if a.dest == "tool_call_parser"
    )
    assert tuple(worker.choices) == PARSERS


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
def test_forced_calls_of_tools_whose_anchors_share_a_name(stories: LLM, parser_name: str) -> None:
    """Two tools that each name an anchor "yes" (a boolean in one, a digit in the other), either
    called: each call's arguments validate against its own tool's schema (the tools' schemas
    share one document, where both refs resolved to one of the anchors)."""
    digit = {"type": "object", "properties": {"a": {"$ref": "#yes"}}, "required": ["a"],
             "additionalProperties": False,
             "$defs": {"D": {"$anchor": "yes", "type": "integer", "minimum": 0, "maximum": 9}}}  # fmt: skip
    offered = [{"type": "function", "function": {"name": "anchored", "parameters": ANCHORED}},
               {"type": "function", "function": {"name": "digit", "parameters": digit}}]  # fmt: skip
    _forced_calls(stories, parser_name, offered, {"anchored": ANCHORED, "digit": digit},
                  "required", True)  # fmt: skip


# numbers a forced call's grammar lets a model write (llguidance's JSON numbers, of any size,
# as JSON's grammar has them) that a 64-bit float or integer cannot hold
BIG = {"type": "object", "properties": {"x": {"type": "number"}, "n": {"type": "integer"}},
       "required": ["x", "n"], "additionalProperties": False}  # fmt: skip
BIG_ARGS = '{"x": -1.5e400, "n": 123456789012345678901234567890}'


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
def test_a_forced_call_with_numbers_beyond_64_bits_is_a_whole_call(
    stories_dir: Path, parser_name: str
) -> None:
    """A call that tool_choice "required" forces may hold a number beyond a 64-bit float or
    integer: the grammar takes it, and so does the parser: the call is whole (finish
    "tool_calls"), its arguments the model's text, as the grammar made them (the parser took
    1e400 for no JSON: the forced call finished "stop", as if cut off)."""
    tok = Tokenizer.from_dir(stories_dir)
    parser = make_parser(parser_name, "", tok.added_tokens)
    offered = [{"type": "function", "function": {"name": "big", "parameters": BIG}}]
    call = f'{{"name": "big", "{parser.arg_keys[0]}": {BIG_ARGS}}}'
    text = dict(hermes=f"<tool_call>\n{call}\n</tool_call>", llama3_json=call,
                mistral=f"[TOOL_CALLS][{call}]")[parser_name]  # fmt: skip
    params = SamplingParams(max_tokens=160)
    RequestTools(parser, offered, "required", True).constrain(params)
    assert params.structured_outputs is not None
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
    matcher = compiler.grammar(params.structured_outputs, "tool_choice").matcher
    assert all(matcher.consume_token(t) for t in compiler.tokenizer().tokenize_str(text))
    assert matcher.is_accepting()
    for step in (1, 3, len(text)):
        for stream in (False, True):
            answer, streamed = _answer(text, step, stream, parser_name, offered)
            assert answer == ("tool_calls", None, [("big", BIG_ARGS)]), step
            assert streamed == answer, step


def test_json_numbers_of_any_size_are_json() -> None:
    """The parsers read JSON as its grammar has it: a number is JSON whatever its size (an
    integer of more digits than Python converts, 4,300, was no JSON either); NaN and Infinity
    are not JSON."""
    assert is_json_object('{"a": 1e400, "b": -2E-999, "c": ' + "9" * 5000 + "}")
    assert not is_json_object('{"a": NaN}') and not is_json_object('{"a": -Infinity}')
    # an exponent beyond Decimal's: not JSON here (it raised, and the gateway answered 500)
    assert not is_json_object('{"a": 1e9999999999999999999}')


def test_parameters_without_a_type_describe_an_object() -> None:
    """A function's parameters with no "type" (the gateway takes them as an object) constrain a
    forced call's arguments to an object: without it any JSON value matched, and a model that
    wrote a string got plain text as its "arguments"."""
    parser = make_parser("hermes", "", {})
    tool = {"type": "function", "function": {"name": "u", "parameters": UNTYPED}}
    args = parser._call_schema([tool])["properties"]["arguments"]
    assert args["type"] == "object" and args["properties"] == UNTYPED["properties"]
