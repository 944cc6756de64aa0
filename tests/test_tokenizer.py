"""Tokenizer: parity with transformers' AutoTokenizer on the real stories260K tokenizer, and on
tokenizer folders built from it (special tokens, bos handling, chat templates, broken files).
`stories_dir` comes from conftest.py."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from runtime.sampling_params import InvalidRequestError
from runtime.tokenizer import ChatTemplateError, NoChatTemplateError, Tokenizer, TokenizerFileError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Once upon a time",
    "",
    " ",
    "  leading and trailing  ",
    "Hello, world! It's 3.14 o'clock.\nNew line\ttab",
    "émoji 😀 and CJK 你好 and a combining é",
    "<s> inside </s> text <unk>",
    'Lily said: "Let\'s play!" and ran to the park.',
    "🎉🎉",
]

CHAT_TEMPLATE = """{{ bos_token }}
{%- if tools %}
<|tools|>{{ tools | tojson }}
{% endif %}
{% for message in messages %}
  {% if message['role'] not in ['system', 'user', 'assistant'] %}
    {{ raise_exception('unknown role ' + message['role']) }}
  {% endif %}
  {% if loop.index0 > 8 %}{% break %}{% endif %}
<|{{ message['role'] }}|>
{{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": 'Say "ok" 😀'},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again <s>"},
    ],
]


@pytest.fixture(scope="module")
def tok(stories_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(stories_dir)


@pytest.fixture(scope="module")
def hf(stories_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(stories_dir))


def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# ----- encode / decode parity ----------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf: Any, text: str) -> None:
    assert tok.encode(text) == hf(text)["input_ids"]
    assert (
        tok.encode(text, add_special_tokens=False)
        == hf(text, add_special_tokens=False)["input_ids"]
    )


def test_known_encoding_has_one_bos(tok: Tokenizer) -> None:
    # From the model's README; the bos comes from the post-processor, once.
    assert tok.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert tok.encode("Once upon a time", add_special_tokens=False) == [403, 407, 261, 378]


def test_decode_matches_transformers_on_random_ids(tok: Tokenizer, hf: Any) -> None:
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
        assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_round_trip(tok: Tokenizer) -> None:
    for text in TEXTS:
        if "<s>" not in text:  # special tokens are skipped on decode
            assert tok.decode(tok.encode(text)) == text


def test_special_ids_and_sizes(tok: Tokenizer, hf: Any) -> None:
    assert tok.bos_token_id == hf.bos_token_id == 1
    assert tok.eos_token_ids == frozenset({hf.eos_token_id}) == frozenset({2})
    assert tok.vocab_size == len(hf) == 512
    assert tok.all_special_ids == frozenset(hf.all_special_ids)
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"
    # stories260K falls back to bytes: 256 "<0xNN>" tokens.
    assert len(tok.byte_fallback_ids) == 256
    assert tok.convert_ids_to_tokens(sorted(tok.byte_fallback_ids)[:1]) == ["<0x00>"]


def test_config_tokens_missing_from_tokenizer_json_are_added(
    stories_dir: Path, tmp_path: Path
) -> None:
    d = _copy_model(stories_dir, tmp_path / "m")
    _edit_json(
        d / "tokenizer_config.json",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        image_token="<img>",
    )
    ours = Tokenizer.from_dir(d)
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    text = "hi <pad> <|im_start|>user x<|im_end|> <img> <s>"
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.vocab_size == len(theirs) == 516
    assert ours.all_special_ids == frozenset(theirs.all_special_ids)
    ids = ours.encode(text)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)


@pytest.mark.parametrize(
    "case",
    ["add_bos_false", "no_post_processor_add_bos_true", "add_eos_true"],
)
def test_bos_handling_matches_transformers(stories_dir: Path, tmp_path: Path, case: str) -> None:
    """tokenizer.json's post-processor decides; add_bos_token/add_eos_token in the config do not
    (transformers >= 5 ignores them when tokenizer.json exists), so nothing is added twice."""
    d = _copy_model(stories_dir, tmp_path / case)
    if case == "add_bos_false":
        _edit_json(d / "tokenizer_config.json", add_bos_token=False)
    elif case == "no_post_processor_add_bos_true":
        _edit_json(d / "tokenizer.json", post_processor=None)
        _edit_json(d / "tokenizer_config.json", add_bos_token=True)
    else:
        _edit_json(d / "tokenizer_config.json", add_bos_token=True, add_eos_token=True)
    ours = Tokenizer.from_dir(d)
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    for text in ("Once upon a time", ""):
        assert ours.encode(text) == theirs(text)["input_ids"]
        assert ours.encode(text).count(1) <= 1


def test_eos_ids_union_config_and_generation_config(stories_dir: Path, tmp_path: Path) -> None:
    d = _copy_model(stories_dir, tmp_path / "m")
    (d / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 7], "bos_token_id": 1})
    )
    _edit_json(d / "config.json", eos_token_id=[2, 9])
    tok = Tokenizer.from_dir(d)
    assert tok.eos_token_ids == frozenset({2, 7, 9})
    assert tok.bos_token_id == 1


def test_bos_id_from_config_when_tokenizer_config_has_none(
    stories_dir: Path, tmp_path: Path
) -> None:
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(stories_dir / "tokenizer.json", d / "tokenizer.json")
    (d / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tok = Tokenizer.from_dir(d)
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == frozenset({2})
    assert tok.bos_token is None


def test_byte_level_bpe_matches_transformers(tmp_path: Path) -> None:
    """A GPT-2 style byte-level BPE (SmolLM2's kind), trained here on a few sentences."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(["Once upon a time there was a girl.", "héllo café"] * 20, trainer)
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"})
    )
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 0}))
    ours = Tokenizer.from_dir(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == theirs(text)["input_ids"]
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 20))]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_ids == frozenset({0, 2}) and ours.bos_token_id == 1
    assert ours.vocab_size == len(theirs) and not ours.byte_fallback_ids


# ----- errors ----------------------------------------------------------------------------------


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("tokenizer.json", "{not json"),
        ("tokenizer.json", '{"model": {"type": "Nope"}}'),
        ("tokenizer_config.json", "{broken"),
        ("tokenizer_config.json", "[1, 2]"),
        ("generation_config.json", '{"eos_token_id": "two"}'),
        ("config.json", "\xff\xfe garbage"),
    ],
)
def test_corrupt_file_names_the_file(
    stories_dir: Path, tmp_path: Path, name: str, content: str
) -> None:
    d = _copy_model(stories_dir, tmp_path / "m")
    (d / name).write_text(content)
    with pytest.raises(TokenizerFileError) as err:
        Tokenizer.from_dir(d)
    assert name in str(err.value)
    assert isinstance(err.value, ValueError)


# ----- chat templates ----------------------------------------------------------------------


@pytest.fixture(params=["jinja_file", "tokenizer_config"])
def chat_dir(request: pytest.FixtureRequest, stories_dir: Path, tmp_path: Path) -> Path:
    d = _copy_model(stories_dir, tmp_path / "chat")
    if request.param == "jinja_file":
        (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    else:
        _edit_json(d / "tokenizer_config.json", chat_template=CHAT_TEMPLATE)
    return d


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    chat_dir: Path, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    ours = Tokenizer.from_dir(chat_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(chat_dir))
    tools = [{"type": "function", "function": {"name": "f", "description": "ünï <b>"}}]
    for kwargs in ({}, {"tools": tools}):
        expected = theirs.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
        got = ours.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, **kwargs
        )
        assert got == expected
    assert got.startswith("<s>")
    # The rendered prompt already holds the bos text: encode it without adding another.
    ids = ours.encode(got, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 1 + sum("<s>" in m["content"] for m in conversation)


def test_chat_template_helpers(stories_dir: Path, tmp_path: Path) -> None:
    d = _copy_model(stories_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text(
        "{% generation %}{{ messages | tojson }}{% endgeneration %}|{{ strftime_now('%Y') }}"
        "|{{ extra_var }}|{{ documents }}"
    )
    tok = Tokenizer.from_dir(d)
    out = tok.apply_chat_template([{"role": "user", "content": "<é>"}], extra_var=42)
    body, year, extra, documents = out.split("|")
    assert json.loads(body) == [{"role": "user", "content": "<é>"}]
    assert '"<é>"' in body  # plain JSON: no HTML escaping, no \\u escapes
    assert year.isdigit() and len(year) == 4
    assert extra == "42" and documents == "None"


def test_chat_template_raise_exception_is_a_request_error(chat_dir: Path) -> None:
    tok = Tokenizer.from_dir(chat_dir)
    with pytest.raises(InvalidRequestError) as err:
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    assert err.value.param == "messages"
    assert "unknown role robot" in err.value.message


def test_chat_template_is_sandboxed(stories_dir: Path, tmp_path: Path) -> None:
    """A sandbox violation is a ChatTemplateError (a ValueError: the worker and the gateway
    answer it 400), jinja2's SecurityError its cause."""
    import jinja2.exceptions

    d = _copy_model(stories_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    tok = Tokenizer.from_dir(d)
    with pytest.raises(ChatTemplateError) as err:
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert isinstance(err.value.__cause__, jinja2.exceptions.SecurityError)
    assert isinstance(err.value, ValueError)


def test_jinja2_is_imported_with_the_first_chat_template(stories_dir: Path,
                                                         tmp_path: Path) -> None:  # fmt: skip
    """runtime.tokenizer, and a worker's or gateway's whole start-up up to its Tokenizer, leave
    jinja2 out (~85 ms of a cold start); rendering or warming a template brings it in."""
    script = """
import sys
from pathlib import Path
import runtime.tokenizer, runtime.worker, gateway.tokenization, runtime.engine
assert "jinja2" not in sys.modules, "imported at start-up"
tok = runtime.tokenizer.Tokenizer.from_dir(Path(sys.argv[1]))
assert "jinja2" not in sys.modules, "imported by a Tokenizer"
tok.warm_chat_template()
assert "jinja2" in sys.modules
print("ok")
"""
    import subprocess
    import sys

    d = _copy_model(stories_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    out = subprocess.run([sys.executable, "-c", script, str(d)], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).parent.parent)  # fmt: skip
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_named_templates_pick_tool_use(stories_dir: Path, tmp_path: Path) -> None:
    d = _copy_model(stories_dir, tmp_path / "m")
    _edit_json(
        d / "tokenizer_config.json",
        chat_template=[
            {"name": "default", "template": "plain"},
            {"name": "tool_use", "template": "tools:{{ tools | length }}"},
        ],
    )
    tok = Tokenizer.from_dir(d)
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "plain"
    assert tok.apply_chat_template(msgs, tools=[{"a": 1}]) == "tools:1"


def test_no_chat_template_is_a_clear_error(tok: Tokenizer) -> None:
    assert not tok.has_chat_template
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_bad_template_syntax_names_the_model(stories_dir: Path, tmp_path: Path) -> None:
    d = _copy_model(stories_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text("{% for %}")
    tok = Tokenizer.from_dir(d)
    with pytest.raises(TokenizerFileError, match="chat template does not compile"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_warming_a_template_that_does_not_compile_raises_nothing(
    stories_dir: Path, tmp_path: Path
) -> None:
    """The warm-up is best effort (the gateway runs it as it builds a tokenizer: an error there
    would lose the tokenizer for completions too); the first chat request says why."""
    for template in ["{% for m in messages %}{{ m.content }}",  # no endfor
                     "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}"]:  # past the parser's depth
        d = _copy_model(stories_dir, tmp_path / f"m{len(template)}")
        (d / "chat_template.jinja").write_text(template)
        tok = Tokenizer.from_dir(d)
        tok.warm_chat_template()
        with pytest.raises(TokenizerFileError, match="chat template does not compile"):
            tok.apply_chat_template([{"role": "user", "content": "x"}])
