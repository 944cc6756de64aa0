"""Faults of structured output and speculative decoding that users of the OpenAI API hit, each
found by probing the service with adversarial requests: a schema that killed the gateway (and
the worker) process, field checks that let invalid names through."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvstore.redis_server import LocalRedis
from tests.stack import (
    ROOT,
    Proc,
    chat_model,
    get_json,
    start_gateway,
    start_worker,
    wait_until,
)

CATALOG = "regions:\n  - {name: local, latitude: 0, longitude: 0, settings: {models: [stories]}}\n"
USER = [{"role": "user", "content": "Once upon a time"}]


class Stack:
    """Redis, one stories260K worker (with a chat template) and a gateway."""

    def __init__(self, root: Path, stories: Path) -> None:
        (root / "regions.yaml").write_text(CATALOG)
        self.redis = LocalRedis().start()
        model = chat_model(stories, root / "stories-chat")
        self.worker: Proc = start_worker("w1", model, self.redis.url, root, "local")
        self.gateway = start_gateway("gw", self.redis.url, root / "regions.yaml", root, "local")
        wait_until(lambda: get_json(f"{self.gateway.url}/readyz")[1]["workers"] == 1, 30, "worker")

    def chat(self, **body: Any) -> tuple[int, dict[str, Any]]:
        """POST a chat completion to the gateway: the status and the JSON answer."""
        data = orjson.dumps({"model": "stories", "messages": USER, "max_tokens": 8, **body})
        req = urllib.request.Request(f"{self.gateway.url}/v1/chat/completions", data=data,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, orjson.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, orjson.loads(e.read())

    def close(self) -> None:
        self.gateway.stop()
        self.worker.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("structured_faults"), stories_dir)
    try:
        yield s
    finally:
        s.close()


def _rf(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}


# llguidance 1.9 recursed until SIGSEGV on an integer range that ends at -2**63 at both ends
NEGATIVE_BEYOND_INT64: list[dict[str, Any]] = [
    {"type": "integer", "const": -1e19},
    {"type": "integer", "minimum": -1e30, "maximum": -1e25},
    {"type": "integer", "enum": [-9223372036854775807]},  # (as a float: -2**63)
    {"type": "number", "const": -9223372036854775808},
    {"const": {"a": -9223372036854775808}},
    {
        "$defs": {"a": {"type": "integer", "maximum": -1e19}},
        "allOf": [{"$ref": "#/$defs/a"}, {"minimum": -1e20}],
    },
    # properties named as the keywords that are not read: schemas all the same (they were
    # skipped, and the process died)
    {"type": "object", "properties": {"default": {"type": "integer", "const": -1e19}}},
    {"type": "object", "properties": {"examples": {"type": ["integer", "null"], "const": -1e19}}},
]


def test_an_integer_beyond_int64_is_a_400_not_a_dead_process() -> None:
    """`check` (which the gateway runs on every schema, in its own process) refuses such a
    number before llguidance sees it: the process lives and says which number. A Lark grammar's
    %json schema likewise. Run in a child process: on the old code it died of SIGSEGV."""
    code = (
        "import json, sys\n"
        "from runtime.structured import StructuredOutputsParams, check\n"
        "from runtime.sampling_params import InvalidRequestError\n"
        "specs = [StructuredOutputsParams(json=s) for s in json.loads(sys.argv[1])]\n"
        'specs.append(StructuredOutputsParams(grammar=\'start: %json {"type": "integer", '
        '"const": -1e19}\'))\n'
        # (an escape spells "integer": read as JSON, not as text)
        'specs.append(StructuredOutputsParams(grammar=\'start: "x" j\\nj: %json {"type": '
        '"\\\\u0069nteger", "const": -1e19}\'))\n'
        "for spec in specs:\n"
        "    try:\n"
        "        check(spec, 'f')\n"
        "        print('accepted')\n"
        "    except InvalidRequestError as e:\n"
        "        print('refused', e.param, e.message)\n"
    )
    cases = orjson.dumps(NEGATIVE_BEYOND_INT64).decode()
    done = subprocess.run([sys.executable, "-c", code, cases], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    lines = done.stdout.splitlines()
    assert len(lines) == len(NEGATIVE_BEYOND_INT64) + 2, done.stdout
    assert all(line.startswith("refused f holds the number -") for line in lines), done.stdout


def test_numbers_llguidance_takes_stay_accepted() -> None:
    """Only what could crash is refused: a float bound of a number schema, an integer bound
    within 64 bits, a `default` (which llguidance does not read)."""
    from runtime.structured import StructuredOutputsParams, check

    for schema in [
        {"type": "number", "minimum": -1e30, "maximum": -1e30},
        {"type": "number", "const": -1e30},
        {"type": "integer", "minimum": -9223372036854775000, "maximum": 5},
        {"type": "integer", "default": -9223372036854775808},
        {"enum": [-1e19, "a"]},
        # a float of a number schema, beside an integer elsewhere (refused for the "integer")
        {"type": "object", "properties": {"n": {"type": "integer"},
                                          "v": {"type": "number", "const": -1e20}}},
        {"type": "object", "properties": {"t": {"const": "integer"}, "v": {"enum": [-1e20, 0.5]}}},
    ]:
        check(StructuredOutputsParams(json=schema), "f")
    # a string literal of a grammar with a %json schema is text, not a number
    check(StructuredOutputsParams(grammar='start: "x" j\nnum: "-10000000000000000000"\n'
                                          'j: %json {"type": "string"}\n'), "f")
    check(StructuredOutputsParams(grammar='start: %json {"type": "integer"} | "x"'), "f")


def test_the_gateway_survives_a_schema_beyond_int64(stack: Stack) -> None:
    """One request with such a schema killed the gateway (an empty reply, then nothing
    listening); now a 400 naming the field, and the next request is served."""
    status, body = stack.chat(response_format=_rf({"type": "integer", "const": -1e19}))
    assert status == 400, body
    assert body["error"]["param"] == "response_format.json_schema.schema"
    assert "-1e+19" in body["error"]["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "enum": [-1e30]}}}}}]  # fmt: skip
    status, body = stack.chat(tools=tools, tool_choice="required")
    assert status == 400 and body["error"]["param"] == "tools[0].function.parameters", body
    status, body = stack.chat(guided_grammar='start: %json {"const": -9223372036854775808}')
    assert status == 400 and body["error"]["param"] == "guided_grammar", body
    status, body = stack.chat(response_format=_rf({"type": "integer", "minimum": 0,
                                                   "maximum": 9}))  # fmt: skip
    assert status == 200, body
    assert 0 <= int(body["choices"][0]["message"]["content"]) <= 9


def test_names_with_a_trailing_newline_are_refused(stack: Stack) -> None:
    """`$` matched before a final newline, so "get_weather\\n" passed as a function name (and
    came back in the tool call) and as a response_format name."""
    params = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "get_weather\n", "parameters": params}}]
    status, body = stack.chat(tools=tools)
    assert status == 400 and body["error"]["param"] == "tools[0].function.name", body
    rf = {"type": "json_schema", "json_schema": {"name": "n\n", "schema": params}}
    status, body = stack.chat(response_format=rf)
    assert status == 400 and body["error"]["param"] == "response_format.json_schema.name", body


def test_grammars_that_build_a_huge_lexer_are_not_all_kept(stories_dir: Path) -> None:
    """`(a{1000}){1000}` compiles (~0.7 s) into a lexer of ~250 MB, kept with the compiled
    grammar; the cache kept 256 of them, so distinct regexes asked for in turn grew a worker by
    ~250 MB each, for good (~60 GB at 256). The cache now keeps at most CACHE_COMPILE_SECONDS of
    compile work, and always the newest grammar: with no budget, the newest alone (counted, not
    timed: whatever the machine's speed); with the default, every schema of a few milliseconds."""
    from runtime.structured import StructuredOutputsParams
    from runtime.structured_decoding import GrammarCompiler
    from runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(stories_dir)
    heavy = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids, compile_seconds=0.0)
    for i in range(3):
        spec = StructuredOutputsParams(regex=f"(a{{100}}){{100}}b{i}")
        g = heavy.grammar(spec, "regex")
        assert g.matcher.validate_tokens(tok.encode("aaa", add_special_tokens=False)[-1:]) == 1
        assert len(heavy._cache) == 1  # the newest alone
    assert heavy.compiled == 3
    heavy.grammar(StructuredOutputsParams(regex="(a{100}){100}b2"), "regex")  # the newest: kept
    assert heavy.compiled == 3
    light = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)  # the default budget
    schemas = [StructuredOutputsParams(json={"type": "object", "maxProperties": i}) for i in range(5)]
    for _ in range(2):
        for spec in schemas:
            light.grammar(spec, "json")
    assert light.compiled == 5 and len(light._cache) == 5  # each compiled once, all kept


def test_a_grammar_the_compiler_panics_on_is_a_400_without_a_backtrace(stack: Stack) -> None:
    """A Lark grammar of 70,000 symbols passes the gateway's check; the worker's compile hits an
    assertion of llguidance (a panic, caught): its 400 carried the panic's backtrace, some 40
    lines of "<unknown>" frames, to the client. Now the first line alone."""
    status, body = stack.chat(guided_grammar="start: " + " ".join(['"a"'] * 70_000))
    assert status == 400, body
    message = body["error"]["message"]
    assert "assertion failed" in message and "backtrace" not in message and "\n" not in message


SELF_REF = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": _rf(SELF_REF)}, "response_format.json_schema.schema"),
        ({"guided_json": SELF_REF}, "guided_json"),
        ({"guided_grammar": "start: " + " ".join(['"a"'] * 70_000)}, "guided_grammar"),
        ({"structured_outputs": {"json": SELF_REF}}, "structured_outputs"),
    ],
)
def test_a_refusal_of_the_worker_names_the_clients_field(
    stack: Stack, body: dict[str, Any], param: str
) -> None:
    """These pass the gateway's check (a compile without the model's tokenizer) and are
    refused by the worker's (with it), which named "structured_outputs" whatever the client
    sent; the field now travels with the constraint."""
    status, answer = stack.chat(**body)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    assert answer["error"]["message"].startswith(f"{param}: "), answer


def test_a_forced_tool_call_names_tool_choice() -> None:
    """The grammar of a required or named tool_choice is built in the worker: a refusal of it
    names tool_choice, not structured_outputs."""
    from runtime.sampling_params import SamplingParams
    from runtime.tool_parsers import RequestTools, make_parser

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    params = SamplingParams(max_tokens=4)
    RequestTools(make_parser("hermes", "", {}), tools, "required", True).constrain(params)
    spec = params.structured_outputs
    assert spec is not None and not isinstance(spec, dict) and spec.param == "tool_choice"


NEVER_ENDS = ['start: "x" start', 'start: a\na: "ab" a', 'start: "q" r\nr: "x" r']


@pytest.mark.parametrize("grammar", NEVER_ENDS)
def test_a_grammar_that_forces_endless_output_is_refused_naming_the_field(
    stack: Stack, grammar: str
) -> None:
    """Its output is forced and never ends: it passed every check, then failed at the first
    token with a 400 "constraint_failed" naming no field (llguidance's "Too many items")."""
    for body, param in [({"guided_grammar": grammar}, "guided_grammar"),
                        ({"structured_outputs": {"grammar": grammar}}, "structured_outputs")]:  # fmt: skip
        status, answer = stack.chat(**body)
        assert status == 400, answer
        assert answer["error"]["param"] == param, answer
        assert "never ends" in answer["error"]["message"], answer


def test_grammars_that_end_or_may_end_are_still_taken(stories_dir: Path) -> None:
    """Only forced endless output is refused at compile: a grammar that may go on (the model
    chooses), one that forces a long but finite text, and schemas stay accepted. A grammar
    that fails mid-request (here: a token it refuses) has an error naming the client's field."""
    from runtime.structured import StructuredOutputsParams
    from runtime.structured_decoding import GrammarCompiler
    from runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(stories_dir)
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
    for spec in [
        StructuredOutputsParams(grammar='start: ("x" | "y") start'),
        StructuredOutputsParams(grammar='start: "x" start | "y"'),
        StructuredOutputsParams(json={"const": "q" * 3000}),
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        StructuredOutputsParams(regex="(ab)+"),
    ]:
        compiler.grammar(spec, "f")
    spec = StructuredOutputsParams(grammar='start: "a" | "b" b\nb: "x" b', param="guided_grammar")
    g = compiler.grammar(spec, "structured_outputs")
    x = next(t for t in range(tok.vocab_size) if tok.decode([t]) == "x")
    g.accept([x])
    assert g.error is not None and g.error.startswith("guided_grammar: "), g.error
