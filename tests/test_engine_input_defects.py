"""Input the engine took badly from the Python API (`LLM.generate`, `LLM.chat`, `LLM(model,
**settings)`): JSON schemas that hold themselves or values JSON has no type for, numpy's numbers
in SamplingParams and prompts, engine switches given as strings, a max_model_len past the
model's, and chat messages without a role or with a number for content."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig, ModelConfig
from runtime.sampling_params import InvalidRequestError
from runtime.structured import MAX_GRAMMAR_CHARS, MAX_JSON_DEPTH, json_depth
from tests.stack import ROOT, chat_model

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_model(stories_dir, tmp_path_factory.mktemp("input-defects") / "chat")


@pytest.fixture(scope="module")
def llm(model: Path) -> LLM:
    # (the model's own context length, asked for outright: taken)
    return LLM(str(model), kv_cache_bytes=1_000_000, num_threads=1, max_model_len=512)


def _schema(llm: LLM, schema: Any) -> InvalidRequestError:
    params = SamplingParams(max_tokens=4, structured_outputs={"json": schema})
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(["Hi"], params)
    assert err.value.param == "structured_outputs", err.value
    assert not llm.engine.has_unfinished()
    return err.value


# ---------------------------------------------------------------- 1. schemas that hold themselves


@pytest.mark.timeout(30)  # (the old code looped here forever)
def test_a_schema_that_holds_itself_is_refused(llm: LLM) -> None:
    """`s["properties"]["self"] = s` looped forever in json_depth while `generate` prepared the
    request (AsyncLLM's `submit`: the event loop with it)."""
    s: dict[str, Any] = {"type": "object", "properties": {}}
    s["properties"]["self"] = s
    err = _schema(llm, s)
    assert err.message == (f"holds itself at properties.self: a cycle nests deeper than "
                           f"{MAX_JSON_DEPTH} levels, without end")  # fmt: skip
    assert json_depth(s) == MAX_JSON_DEPTH + 1  # (counting stops past the limit)
    # the engine serves on
    (out,) = llm.generate(["Hi"], GREEDY)
    assert len(out.outputs[0].token_ids) == 4


# The cases whose old behaviour ate memory (a list doubled each level until MemoryError, 2**31
# leaves) run in a child with its memory and time bounded, so that a regression fails here
# rather than taking the machine's memory or hanging the run.
_CHILD = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    from runtime.sampling_params import InvalidRequestError
    from runtime.structured import StructuredOutputsParams, check, json_depth

    two = {"type": "object", "properties": {}}
    two["properties"]["a"] = two
    two["properties"]["b"] = two
    bomb = {"type": "integer"}
    for _ in range(30):
        bomb = [bomb, bomb]
    for name, schema in (("two", two), ("bomb", {"anyOf": bomb})):
        try:
            check(StructuredOutputsParams(json=schema))
            print(name, "taken")
        except InvalidRequestError as e:
            print(name, e.param, "|", e.message)
        print(name, "depth", json_depth(schema))
""")


def test_schemas_that_would_expand_without_bound_are_refused_in_bounded_work() -> None:
    """Two self-references doubled json_depth's list each level until MemoryError; `a = [a, a]`
    nested 30 times (31 levels, within the depth limit) held 2**31 leaves, which json_depth and
    then json.dumps read one by one."""
    try:
        run = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the checks did not end in 60 s: {e.stdout!r}")
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines == [
        f"two structured_outputs | holds itself at properties.a: a cycle nests deeper than "
        f"{MAX_JSON_DEPTH} levels, without end",
        f"two depth {MAX_JSON_DEPTH + 1}",
        f"bomb structured_outputs | holds more than {MAX_GRAMMAR_CHARS} values (arrays, objects, "
        f"strings, numbers, ...) as JSON text: longer than the limit of {MAX_GRAMMAR_CHARS} "
        "characters (an object held in several places counts in each)",
        "bomb depth 32",
    ], run.stdout


def test_a_schema_sharing_an_object_within_the_limits_is_taken(llm: LLM) -> None:
    """A subschema held in two places is no cycle: it is written twice, as json.dumps does."""
    digit = {"type": "string", "enum": ["1", "2"]}
    schema = {"type": "array", "prefixItems": [digit, digit], "items": False}
    params = SamplingParams(max_tokens=40, structured_outputs={"json": schema})
    (out,) = llm.generate(["Hi"], params)
    assert out.outputs[0].text in {f'["{a}", "{b}"]' for a in "12" for b in "12"}, out.outputs[0]


# ------------------------------------------------------------- 2. values JSON has no type for


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "string", "enum": {"a", "b"}}, "holds a value of type set at enum, which is not "
         "JSON (give objects, arrays, strings, numbers, true, false, null)"),
        ({"type": "string", "enum": ["a", b"b"]}, "holds a value of type bytes at enum[1]"),
        ({"type": "object", "properties": {"x": {"const": object()}}},
         "holds a value of type object at properties.x.const"),
        ({"type": "object", "properties": {1: {"type": "integer"}}},
         "has the key 1 of type int at properties: JSON object keys are strings"),
        ({"type": "number", "enum": [1.5, float("inf")]},  # (llguidance read it as null)
         "holds the number inf at enum[1]: JSON numbers are finite"),
    ],
)  # fmt: skip
def test_a_schema_holding_a_value_json_has_no_type_for_is_refused(
    llm: LLM, schema: dict[str, Any], message: str
) -> None:
    """A set raised TypeError ("Object of type set is not JSON serializable") from json.dumps;
    a non-string key was written as a string, and inf as null (an enum of [1.5, null])."""
    assert _schema(llm, schema).message.startswith(message)


def test_a_param_that_is_not_a_string_is_named_as_structured_outputs_param() -> None:
    """It named itself: "5.param: must be a string"."""
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(structured_outputs={"json": {}, "param": 5})
    assert err.value.param == "structured_outputs.param"
    assert err.value.message == "must be a string, got int"


# ------------------------------------------------------------------ 3. numpy's numbers


def test_numpy_numbers_are_taken_as_the_python_numbers_they_hold(llm: LLM) -> None:
    """`max_tokens=np.int64(5)` was refused ("must be an integer, got int64"), as were
    `temperature=np.float32(.5)`, a numpy seed, stop token ids and a prompt's token ids."""
    plain = SamplingParams(max_tokens=5, temperature=0.5, top_p=0.75, seed=7, top_k=20,
                           stop_token_ids=[3], ignore_eos=True, presence_penalty=0.5)  # fmt: skip
    numpy = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5),  # type: ignore[arg-type]
                           top_p=np.float64(0.75), seed=np.int64(7), top_k=np.int32(20),  # type: ignore[arg-type]
                           stop_token_ids=[np.int64(3)], ignore_eos=True,  # type: ignore[list-item]
                           presence_penalty=np.float16(0.5))  # type: ignore[arg-type]  # fmt: skip
    assert numpy == plain  # stored as Python's numbers (orjson and msgpack carry those)
    for name in ("max_tokens", "seed", "top_k"):
        assert type(getattr(numpy, name)) is int, name
    for name in ("temperature", "top_p", "presence_penalty"):
        assert type(getattr(numpy, name)) is float, name
    assert type(numpy.stop_token_ids[0]) is int
    ids = llm.tokenizer.encode("Once upon")
    (want,) = llm.generate([ids], plain)
    (got,) = llm.generate([np.int64(t) for t in ids], numpy)  # one prompt of numpy ids
    assert got.prompt_token_ids == ids and all(type(t) is int for t in got.prompt_token_ids)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert len(got.outputs[0].token_ids) == 5 or got.outputs[0].finish_reason == "stop"
    # still refused: a bool, a float where an integer goes, a numpy array
    for bad, message in ((dict(max_tokens=True), "max_tokens: must be an integer, got bool"),
                         (dict(seed=np.float64(1.0)), "seed: must be an integer, got float64"),
                         (dict(temperature=np.array([0.5])), "temperature: must be a number, got "
                          "ndarray")):  # fmt: skip
        with pytest.raises(InvalidRequestError, match=f"^{message}$"):
            SamplingParams(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=r"^prompt: token ids must be integers, got "):
        llm.engine.tokenize_prompt([1, np.float64(1.0)])  # type: ignore[list-item]


# ------------------------------------------------------------- 4. engine switches as strings


BOOL_SETTINGS = [f.name for f in fields(EngineConfig) if f.type == "bool"]


def test_every_engine_switch_takes_only_true_or_false(stories_dir: Path) -> None:
    """`LLM(model, enable_prefix_caching="no")` turned the prefix cache on ("no" is true)."""
    assert {"enable_prefix_caching", "packed_weights", "keep_weights_compressed",
            "cuda_graphs"} <= set(BOOL_SETTINGS)  # fmt: skip
    for name in BOOL_SETTINGS:
        for bad in ("no", 0, 1, None, np.bool_(False)):
            with pytest.raises(ValueError, match=f"^{name} must be True or False, got "):
                EngineConfig(model=str(stories_dir), device="cpu", **{name: bad})
    with pytest.raises(
        ValueError, match=r"^enable_prefix_caching must be True or False, got 'no'$"
    ):
        LLM(str(stories_dir), enable_prefix_caching="no")
    for value in (True, False):
        EngineConfig(model=str(stories_dir), device="cpu", enable_prefix_caching=value,
                     packed_weights=value, cuda_graphs=value)  # fmt: skip


# ------------------------------------------------------------ 5. max_model_len past the model's


def test_a_max_model_len_past_the_models_is_refused(stories_dir: Path, llm: LLM) -> None:
    """`LLM(stories, max_model_len=10**6)` served 512 tokens, silently (the engine took the
    smaller); vLLM refuses it, as the CLI did."""
    with pytest.raises(ValueError) as err:
        LLM(str(stories_dir), kv_cache_bytes=1_000_000, num_threads=1, max_model_len=10**6)
    assert str(err.value) == (
        "max_model_len 1000000 is greater than the model's context length, 512 "
        f"(max_position_embeddings in {stories_dir / 'config.json'}); give at most 512, or "
        "leave max_model_len out for 512"
    )
    assert llm.engine.max_model_len == 512  # (the fixture's: the model's own, asked for)
    # what sets the limit is named, as the CLI names it: a sliding window shorter than the
    # positions (Mistral)
    raw = {"architectures": ["MistralForCausalLM"], "vocab_size": 512, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
           "max_position_embeddings": 1024, "sliding_window": 128}  # fmt: skip
    cfg = ModelConfig.from_dict(raw)
    assert cfg.max_model_len_refusal("/m", 128, "max_model_len") is None
    assert cfg.max_model_len_refusal("/m", None, "max_model_len") is None
    assert cfg.max_model_len_refusal("/m", 129, "--max-model-len") == (
        "--max-model-len 129 is greater than the model's context length, 128 (its "
        "sliding_window in /m/config.json); give at most 128, or leave --max-model-len out for 128"
    )


# ------------------------------------------------------------------ 6. chat messages


@pytest.mark.parametrize(
    ("messages", "param", "message"),
    [
        ([{"content": "Hi"}], "messages[0].role",
         "must be a non-empty string (user, assistant, system, tool, developer), got none"),
        ([{"role": 3, "content": "Hi"}], "messages[0].role",
         "must be a non-empty string (user, assistant, system, tool, developer), got int 3"),
        ([{"role": "user", "content": 5}], "messages[0].content",
         "must be a string or a list of text parts, got int"),
        ([{"role": "user"}], "messages[0].content", "is required for role 'user'"),
        ([[{"role": "user", "content": "Hi"}], [{"role": "system", "content": "a"},
                                                {"role": "user", "content": {"t": 1}}]],
         "messages[1][1].content", "must be a string or a list of text parts, got dict"),
    ],
)  # fmt: skip
def test_chat_refuses_a_message_without_a_role_or_with_content_not_text(
    llm: LLM, messages: Any, param: str, message: str
) -> None:
    """They went to the chat template unchecked: a turn rendered with no role (": Hi"), the
    content 5 as "5"."""
    with pytest.raises(InvalidRequestError) as err:
        llm.chat(messages, GREEDY)
    assert (err.value.param, err.value.message) == (param, message)
    assert not llm.engine.has_unfinished()


def test_chat_takes_an_assistant_message_without_content(llm: LLM) -> None:
    """As OpenAI's (and the gateway's) assistant turn that only called tools."""
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
            {"role": "user", "content": "Go on"}]  # fmt: skip
    (out,) = llm.chat(conv, GREEDY)
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    ("setting", "value"), [("cuda_graph_max_batch", "8"), ("kv_cache_fraction", "0.5"),
                           ("kv_cache_fraction", True)]
)  # fmt: skip
def test_numeric_engine_settings_of_another_type_are_named(setting: str, value: object) -> None:
    """A string for these was a TypeError from a comparison ('<' not supported between 'str'
    and 'int'), naming no setting."""
    with pytest.raises(ValueError, match=f"^{setting} must be"):
        EngineConfig(model="x", **{setting: value})
