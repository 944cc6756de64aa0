"""Structured output in the engine: every sample obeys its constraint (JSON schema, regex, choice),
on stories260K and on random-weight models, with speculative decoding and prefix caching; the
grammar is compiled once per schema; bad constraints are InvalidRequestErrors naming the field."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from runtime.llm import LLM
from runtime.sampler import Sampler, SamplingState, apply_token_bitmask
from runtime.sampling_params import InvalidRequestError, SamplingParams
from runtime.structured import StructuredOutputsParams, check, strict_schema
from runtime.structured_decoding import GrammarCompiler, RequestGrammar, bitmask_words
from runtime.tokenizer import Tokenizer

PROMPT = "Once upon a time"
KV = 4_000_000

# Every string and array bounded, so any model finishes well inside max_tokens.
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "home": {
                "type": "object",
                "properties": {
                    "town": {"type": "string", "maxLength": 10},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["town", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "home"],
        "additionalProperties": False,
    },
    "arrays_enums": {
        "type": "object",
        "properties": {
            "pets": {
                "type": "array",
                "items": {"enum": ["cat", "dog", "bird"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "mood": {"enum": ["happy", "sad", 3, None]},
        },
        "required": ["pets", "mood"],
        "additionalProperties": False,
    },
    "numbers_patterns": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 3, "maximum": 97},
            # a bounded number of digits: a free fraction lets a model write zeros until
            # max_tokens (stories260K does), which no grammar can prevent but a schema can
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5, "multipleOf": 0.25},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,3}$"},
            "ok": {"type": "boolean"},
        },
        "required": ["age", "score", "code", "ok"],
        "additionalProperties": False,
    },
    "optional_anyof": {
        "type": "object",
        "properties": {
            "id": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 999},
                    {"type": "string", "maxLength": 4},
                ]
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def stories(stories_dir: Path) -> LLM:
    return LLM(str(stories_dir), kv_cache_bytes=KV, block_size=16)


def _json(schema: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema)


def _assert_valid(text: str, schema: dict[str, Any], finish: str | None) -> None:
    assert finish == "stop", f"did not finish ({finish}): {text!r}"
    jsonschema.validate(json.loads(text), schema)


def test_200_seeded_samples_validate(stories: LLM) -> None:
    """50 seeds x 4 schemas, sampled at temperature 1 (with top_k / top_p on some)."""
    prompts, params, schemas = [], [], []
    for schema in SCHEMAS.values():
        for seed in range(50):
            prompts.append(PROMPT)
            params.append(
                SamplingParams(
                    max_tokens=200,
                    temperature=1.0,
                    seed=seed,
                    top_p=0.95 if seed % 3 == 0 else 1.0,
                    top_k=20 if seed % 3 == 1 else -1,
                    structured_outputs=_json(schema),
                )
            )
            schemas.append(schema)
    outs = stories.generate(prompts, params)
    assert len(outs) == 200
    for out, schema in zip(outs, schemas, strict=True):
        _assert_valid(out.outputs[0].text, schema, out.outputs[0].finish_reason)
    # each distinct schema was compiled once, whatever the number of requests using it
    assert stories.engine.grammars.compiled <= len(SCHEMAS) + 8  # + the other tests' grammars


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_random_weight_models_obey(tiny_model_dir, family: str) -> None:  # type: ignore[no-untyped-def]
    """Random weights: the output is noise, but noise that validates."""
    llm = LLM(str(tiny_model_dir(family)), kv_cache_bytes=KV, block_size=16)
    for name in ("nested", "numbers_patterns"):
        schema = SCHEMAS[name]
        params = [
            SamplingParams(
                max_tokens=200, temperature=1.0, seed=s, structured_outputs=_json(schema)
            )
            for s in range(12)
        ]
        for out in llm.generate([PROMPT] * len(params), params):
            _assert_valid(out.outputs[0].text, schema, out.outputs[0].finish_reason)
    regex = r"[a-z]{2,6}@[a-z]{3}\.(com|org)"
    params = [
        SamplingParams(
            max_tokens=40,
            temperature=1.0,
            seed=s,
            structured_outputs=StructuredOutputsParams(regex=regex),
        )
        for s in range(12)
    ]
    for out in llm.generate([PROMPT] * len(params), params):
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text


def test_regex_and_choice_hold(stories: LLM) -> None:
    regex = r"(yes|no), [0-9]{1,3} (cats|dogs)"
    params = [
        SamplingParams(
            max_tokens=40,
            temperature=1.2,
            seed=s,
            structured_outputs=StructuredOutputsParams(regex=regex),
        )
        for s in range(40)
    ]
    for out in stories.generate([PROMPT] * 40, params):
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
    choices = ["red ball", "blue kite", "a big dog", "Lily"]
    params = [
        SamplingParams(
            max_tokens=20,
            temperature=1.0,
            seed=s,
            structured_outputs=StructuredOutputsParams(choice=choices),
        )
        for s in range(40)
    ]
    seen = {o.outputs[0].text for o in stories.generate([PROMPT] * 40, params)}
    assert seen <= set(choices)


def test_json_object_and_n_sequences(stories: LLM) -> None:
    """json_object: any JSON object; n > 1: each sequence has its own grammar state. Free
    strings let stories260K write past max_tokens: a truncated output is still a prefix the
    grammar accepts."""
    spec = StructuredOutputsParams(json_object=True)
    params = SamplingParams(max_tokens=120, temperature=0.8, seed=3, n=6, structured_outputs=spec)
    out = stories.generate(PROMPT, params)[0]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.finish_reason == "length" and o.text.startswith("{")
            fresh = stories.engine.grammars.grammar(spec, "structured_outputs")
            assert fresh.matcher.consume_tokens(o.token_ids), fresh.matcher.get_error()


def test_truncation_at_max_tokens_is_a_length_finish(stories: LLM) -> None:
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    out = stories.generate(
        PROMPT, SamplingParams(max_tokens=6, temperature=0, structured_outputs=_json(schema))
    )[0]
    o = out.outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 6
    assert o.text.startswith('{"story"')


def test_greedy_constrained_is_the_masked_argmax(stories: LLM) -> None:
    """Greedy under a grammar: each token is the best token the grammar allows (checked by
    replaying the output with the sampler and an explicit mask)."""
    schema = SCHEMAS["arrays_enums"]
    out = stories.generate(
        PROMPT, SamplingParams(max_tokens=60, temperature=0, structured_outputs=_json(schema))
    )[0]
    _assert_valid(out.outputs[0].text, schema, out.outputs[0].finish_reason)
    unconstrained = stories.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.outputs[0].token_ids[:8] != unconstrained.outputs[0].token_ids


def test_speculative_decoding_keeps_the_grammar(stories_dir: Path, stories: LLM) -> None:
    """n-gram drafts verified under the mask: greedy output identical to the plain engine's,
    sampled output valid; the verify rows reject drafts the grammar refuses."""
    spec = LLM(
        str(stories_dir),
        kv_cache_bytes=KV,
        block_size=16,
        speculative={"method": "ngram", "num_tokens": 4, "max_batch_tokens": 64},
    )
    schema = SCHEMAS["arrays_enums"]  # repetitive ("cat", "cat", ...): n-gram drafts hit
    greedy = SamplingParams(max_tokens=80, temperature=0, structured_outputs=_json(schema))
    base = stories.generate(PROMPT, greedy)[0].outputs[0]
    fast = spec.generate(PROMPT, greedy)[0]
    assert fast.outputs[0].token_ids == base.token_ids
    params = [
        SamplingParams(
            max_tokens=200, temperature=1.0, seed=s, structured_outputs=_json(SCHEMAS["nested"])
        )
        for s in range(16)
    ]
    outs = spec.generate([PROMPT] * 16, params)
    for out in outs:
        _assert_valid(out.outputs[0].text, SCHEMAS["nested"], out.outputs[0].finish_reason)
    assert spec.engine.stats()["spec_proposed_tokens"] > 0


def test_prefix_cache_hit_keeps_the_grammar(stories: LLM) -> None:
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside."
    schema = SCHEMAS["nested"]
    params = SamplingParams(max_tokens=150, temperature=0, structured_outputs=_json(schema))
    first = stories.generate(prompt, params)[0]
    second = stories.generate(prompt, params)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].text == first.outputs[0].text
    _assert_valid(second.outputs[0].text, schema, second.outputs[0].finish_reason)


def test_grammar_compiled_once_per_schema(stories: LLM) -> None:
    g = stories.engine.grammars
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    before = g.compiled
    params = [
        SamplingParams(
            max_tokens=20, temperature=1.0, seed=s, structured_outputs=_json(dict(schema))
        )
        for s in range(10)
    ]
    stories.generate([PROMPT] * 10, params)
    assert g.compiled == before + 1


# A string pattern llguidance's lexer gives up on once enough of the string is written ("lexer
# error: too many expressions constructed", 31 tokens into LEXER_LIMIT_TEXT on stories260K)
LEXER_LIMIT = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "a": {"type": "string", "pattern": "^(.{0,50}){0,50}$"},
    },
    "required": ["n", "a"],
}
LEXER_LIMIT_TEXT = '{"n": 1, "a": "Yes, I can show you shake it all the way'


def _failed_grammar(stories: LLM) -> RequestGrammar:
    """A grammar of LEXER_LIMIT driven over LEXER_LIMIT_TEXT, each token under its mask, until
    the matcher fails (as the engine drives it: a mask, then the token)."""
    g = stories.engine.grammars.grammar(_json(LEXER_LIMIT), "structured_outputs")
    rows = np.zeros((1, bitmask_words(stories.engine.grammars.vocab_size)), dtype=np.int32)
    ids = stories.tokenizer.encode(LEXER_LIMIT_TEXT, add_special_tokens=False)[1:]  # (no "▁")
    for token in ids:
        g._fill(rows, [])
        if g.matcher.is_error():
            break
        g.accept([token])
    assert g.matcher.is_error(), "the lexer limit was not reached"
    assert (rows == stories.engine.grammars.eos_row).all() and g.finished  # it can only end
    return g


def test_a_matcher_error_is_logged_and_kept(stories: LLM, caplog: pytest.LogCaptureFixture) -> None:
    """A matcher that fails mid-request says why (it was replaced by an end-of-sequence mask
    without a word, and the request ended "stop" with JSON the schema does not accept)."""
    g = _failed_grammar(stories)
    assert g.error == "structured_outputs: lexer error: too many expressions constructed"
    assert "too many expressions" in caplog.text


def test_a_failed_grammar_leaves_the_cache(stories: LLM) -> None:
    """Copies of a compiled grammar share its lexer, so the failed one is evicted: the next
    request with the schema starts from a fresh lexer (every later request answered '{')."""
    _failed_grammar(stories)
    fresh = stories.engine.grammars.grammar(_json(LEXER_LIMIT), "structured_outputs")
    rows = np.zeros((1, bitmask_words(stories.engine.grammars.vocab_size)), dtype=np.int32)
    fresh.accept(stories.tokenizer.encode("{", add_special_tokens=False)[-1:])
    fresh._fill(rows, [])
    assert not fresh.matcher.is_error(), fresh.matcher.get_error()
    assert fresh.error is None


def test_a_failed_grammar_fails_the_request(stories: LLM) -> None:
    """A request whose grammar fails ends with finish reason "error" and llguidance's reason
    (it ended "stop" with JSON the schema does not accept), after the client's field that
    asked for it (it named none: the gateway's 400 said which), and so does the next one with
    the schema (it answered '{')."""
    prompt = stories.tokenizer.encode("user: hi\nassistant:", add_special_tokens=False)
    spec = _json(LEXER_LIMIT)
    spec.param = "guided_json"
    params = SamplingParams(max_tokens=60, temperature=0, structured_outputs=spec)
    for _ in range(2):
        o = stories.generate([prompt], params)[0].outputs[0]
        assert o.finish_reason == "error", o
        assert o.stop_reason == "guided_json: lexer error: too many expressions constructed"
        assert o.text.startswith('{"n": ') and len(o.token_ids) > 20, o.text


def test_an_ambiguous_grammar_fails_its_request_instead_of_slowing_every_step(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`s: s s | ...` is ambiguous: its Earley items per mask grow with every token (at
    llguidance's default bound a mask took 0.75 s after ~470 SmolLM2 tokens, the whole batch
    waiting on it). The matchers get STEP_MAX_ITEMS as their bound, which ends such a request
    with an error (here lowered to 300, so that it comes within a few dozen tokens)."""
    import numpy as np

    from runtime import structured_decoding
    from runtime.structured_decoding import bitmask_words

    assert structured_decoding.STEP_MAX_ITEMS == 5_000
    monkeypatch.setattr(structured_decoding, "STEP_MAX_ITEMS", 300)
    tok = Tokenizer.from_dir(stories_dir)
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
    spec = StructuredOutputsParams(grammar='start: s\ns: s s | "a" | "b" | " a" | " b"')
    g = compiler.grammar(spec, "guided_grammar")
    a = tok.encode(" a", add_special_tokens=False)[-1]
    rows = np.zeros((1, bitmask_words(tok.vocab_size)), dtype=np.int32)
    for _ in range(400):
        g._fill(rows, [])
        if g.error:
            break
        g.accept([a])
    assert g.error and "Too many items (limit 300" in g.error, g.error


def test_a_constraint_too_complex_for_the_first_mask_says_why(
    tmp_path: Path, stories_dir: Path
) -> None:
    """A regex llguidance's lexer gives up on while computing the first mask (here: over a
    vocabulary with an 80-character token) is a 400 with llguidance's reason; it said that the
    constraint "accepts no output"."""
    for name in ("tokenizer_config.json", "config.json"):
        shutil.copy(stories_dir / name, tmp_path / name)
    backend = HFTokenizer.from_file(str(stories_dir / "tokenizer.json"))
    backend.add_tokens(["abcdefghij" * 8])
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
    with pytest.raises(InvalidRequestError) as e:
        compiler.grammar(StructuredOutputsParams(regex="(.{0,50}){0,50}"), "guided_regex")
    assert e.value.param == "guided_regex"
    assert "too many expressions constructed" in str(e.value), e.value
    assert compiler.compiled == 0  # not cached


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (StructuredOutputsParams(json={"type": "foo"}), "Invalid type"),
        (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (StructuredOutputsParams(json={"$ref": "#/nope"}), "nope"),
        (StructuredOutputsParams(json="{not json"), "not valid JSON"),
        (StructuredOutputsParams(regex="[a-"), "regex"),
        (StructuredOutputsParams(choice=[]), "non-empty"),
        (StructuredOutputsParams(regex="a", choice=["a"]), "exactly one"),
        (StructuredOutputsParams(), "exactly one"),
        (StructuredOutputsParams(grammar="start: nope"), "nope"),
        # the compiler's multi-line messages whole, on one line: what is wrong, not just where
        (StructuredOutputsParams(regex="(a)\\1"), "backreferences are not supported"),
        (StructuredOutputsParams(json={"type": "string", "pattern": "("}), "unclosed group"),
        # nothing can satisfy these: refused, not answered with empty text that does not match
        (StructuredOutputsParams(grammar="start: a\na: a"), "accepts no output"),
        (StructuredOutputsParams(json={"$ref": "#"}), "accepts no output"),
    ],
)
def test_bad_constraints_are_refused(
    stories: LLM, spec: StructuredOutputsParams, text: str
) -> None:
    with pytest.raises(InvalidRequestError) as e:
        stories.generate(PROMPT, SamplingParams(max_tokens=4, structured_outputs=spec))
    assert e.value.param.startswith("structured_outputs")
    assert text in str(e.value)
    assert not stories.engine.has_unfinished()


def test_dict_from_the_wire_becomes_params() -> None:
    p = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert isinstance(p.structured_outputs, StructuredOutputsParams)
    with pytest.raises(InvalidRequestError, match="unknown fields"):
        SamplingParams(structured_outputs={"pattern": "x"})


def test_strict_schema_closes_objects() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {}}},
        "$defs": {"d": {"properties": {"x": {}}, "additionalProperties": True}},
    }
    out = strict_schema(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is True  # said explicitly: kept
    check(StructuredOutputsParams(json=out))


def test_strict_schema_leaves_data_and_schema_maps_alone(stories: LLM) -> None:
    """Strict mode closes object schemas only: not the data in const / enum / default /
    examples (a const was rewritten, and the output broke it), nor a map of schemas (a
    property named "properties" was taken for a schema's keyword)."""
    const = {"properties": {"x": 1}}
    data = {"properties": {}}
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    schema = {
        "type": "object",
        "properties": {
            "cfg": {"const": const},
            "properties": {"type": "object", "properties": {"y": digit}, "required": ["y"]},
            "e": {"enum": [data], "default": data, "examples": [data]},
        },
        "required": ["cfg", "properties"],
    }
    out = strict_schema(schema)
    assert out["properties"]["cfg"] == {"const": const}
    assert out["properties"]["e"] == schema["properties"]["e"]
    assert set(out["properties"]) == {"cfg", "properties", "e"}  # a map, not closed
    assert out["properties"]["properties"]["additionalProperties"] is False  # a schema: closed
    assert out["additionalProperties"] is False
    params = SamplingParams(max_tokens=120, temperature=0, structured_outputs=_json(out))
    o = stories.generate(PROMPT, params)[0].outputs[0]
    _assert_valid(o.text, schema, o.finish_reason)
    assert json.loads(o.text)["cfg"] == const


def test_apply_token_bitmask_matches_a_dense_mask() -> None:
    """The bit layout: token t is bit t % 32 of word t // 32; tokens past the mask forbidden."""
    gen = torch.Generator().manual_seed(0)
    vocab = 70
    logits = torch.randn(3, vocab, generator=gen)
    allowed = torch.rand(3, 96, generator=gen) < 0.3
    allowed[:, vocab:] = True  # bits past the vocabulary are ignored
    words = np.packbits(allowed.numpy().astype(np.uint8), axis=1, bitorder="little")
    bitmask = words.view(np.int32)  # (3, 3)
    out = apply_token_bitmask(logits, bitmask, [0, 1, 2])
    dense = logits.masked_fill(~allowed[:, :vocab], float("-inf"))
    forbidden = ~allowed[:, :vocab]
    assert torch.equal(out[~forbidden], logits[~forbidden])  # allowed tokens untouched
    assert (out[forbidden] <= torch.finfo(torch.float32).min / 2).all()
    assert torch.equal(torch.softmax(out, -1), torch.softmax(dense, -1))  # exactly 0 there
    assert torch.equal(apply_token_bitmask(logits, bitmask), out)  # all rows, in order
    short = apply_token_bitmask(logits[:, :70], bitmask[:, :2], None)  # 64 bits for 70 tokens
    assert (short[:, 64:] <= torch.finfo(torch.float32).min / 2).all()
    # the sampler applies a row's mask before choosing: greedy picks the best allowed token
    states = [
        SamplingState(SamplingParams(temperature=0), None, [], [], bitmask[i]) for i in range(3)
    ]
    picked = Sampler()(logits, states).token_ids
    assert picked == dense.argmax(dim=-1).tolist()


def test_llguidance_is_imported_with_the_first_grammar(stories_dir: Path) -> None:
    """The engine and the worker leave llguidance out of their imports (~25 ms of a worker's
    cold start, before its first token); the first constraint compiled brings it in, and its
    mask is filled."""
    script = """
import sys
from pathlib import Path
import numpy as np
import runtime.engine, runtime.worker, runtime.draft
from runtime.structured import StructuredOutputsParams
from runtime.structured_decoding import GrammarCompiler, bitmask_words
from runtime.tokenizer import Tokenizer
assert "llguidance" not in sys.modules, "imported at start-up"
tok = Tokenizer.from_dir(Path(sys.argv[1]))
compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
assert "llguidance" not in sys.modules, "imported by a GrammarCompiler"
g = compiler.grammar(StructuredOutputsParams(choice=["yes", "no"]), "guided_choice")
rows = np.zeros((1, bitmask_words(tok.vocab_size)), dtype=np.int32)
g._fill(rows, [])
print("llguidance" in sys.modules, int(np.count_nonzero(rows)) > 0)
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script, str(stories_dir)], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).parent.parent)  # fmt: skip
    assert out.stdout.strip() == "True True", out.stderr[-2000:]
