"""Hostile or corrupt model files get a clear error naming the file (ModelLoadError,
TokenizerFileError; exit status 2 from the CLI, no traceback), never a crash: JSON nested too
deep, numbers past a float, a tokenizer that cannot encode, a bos token the tokenizer lacks, a
corrupt compressed folder in the store, a bad config.json at pull or compress --cast-bf16; and
chat templates that would run forever or allocate gigabytes stop at a limit, while real
templates render exactly as a plain jinja2 sandbox renders them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import xxhash
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime import model_cache
from runtime.chat_template import _GenerationTag
from runtime.cli import main
from runtime.compression import COMPRESSED_MANIFEST_NAME, compress_model, read_shard
from runtime.config import ModelLoadError
from runtime.loader import load_model
from runtime.model_store import ModelStore
from runtime.sampling_params import InvalidRequestError
from runtime.tokenizer import ChatTemplateError, Tokenizer, TokenizerFileError

DEEP_LIST = "[" * 200_000 + "]" * 200_000
DEEP_OBJECT = '{"a":' * 200_000 + "1" + "}" * 200_000
GEN = ["generate", "--max-tokens", "3", "--kv-cache-bytes", str(4 << 20)]


@pytest.fixture
def model(tmp_path: Path, stories_dir: Path) -> Path:
    """A copy of stories260K to break (the original is never touched)."""
    return Path(shutil.copytree(stories_dir, tmp_path / "model"))


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(args)  # (an exception that escapes it is the traceback a user saw)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


# ----- 2: JSON nested too deep in the tokenizer's files -------------------------------------


@pytest.mark.parametrize(
    ("name", "text"),
    [("tokenizer_config.json", DEEP_LIST), ("generation_config.json", DEEP_OBJECT)],
)
def test_deep_json_in_tokenizer_files_is_named(
    model: Path, name: str, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (model / name).write_text(text)
    with pytest.raises(TokenizerFileError, match=re.escape(name)):
        Tokenizer.from_dir(model)
    rc, err = _cli([*GEN, "--model", str(model), "Once upon"], capsys)
    assert rc == 2 and f"{model / name}: cannot read JSON" in err


def test_deep_import_marker_is_not_current(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / model_cache.MANIFEST_NAME).write_text("{}")
    (folder / model_cache.IMPORT_MARKER).write_text(DEEP_LIST)
    assert model_cache._is_current(folder) is False


# ----- 6: a tokenizer that cannot encode, a bos token it does not have ------------------------


def _word_level_without_unk() -> Any:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    backend = HFTokenizer(WordLevel({"hi": 0, "Once": 1, "upon": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    return backend


def test_tokenizer_that_cannot_encode_is_refused_at_load(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _word_level_without_unk().save(str(model / "tokenizer.json"))
    with pytest.raises(TokenizerFileError, match=r"tokenizer\.json: cannot tokenize") as e:
        Tokenizer.from_dir(model)
    assert e.value.path == model / "tokenizer.json"
    rc, err = _cli([*GEN, "--model", str(model), "hi there"], capsys)
    assert rc == 2 and "tokenizer.json: cannot tokenize" in err


def test_encode_error_is_a_request_error() -> None:
    # (one that passed the probe at load and fails on a request's text)
    tok = Tokenizer(
        _word_level_without_unk(),
        special_tokens={},
        bos_token_id=None,
        eos_token_ids=frozenset(),
        chat_templates={},
        source="/m",
    )
    assert tok.encode("hi upon") == [0, 2]
    for text in ("hi there", "hi " * 10_000 + "there"):  # (a long text goes through encode_batch)
        with pytest.raises(InvalidRequestError, match=r"tokenizer\.json cannot tokenize"):
            tok.encode(text)


def test_bos_token_missing_from_tokenizer_is_refused(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = model / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["bos_token"] = "<|newbos|>"
    path.write_text(json.dumps(config))
    with pytest.raises(TokenizerFileError, match="newbos") as e:
        Tokenizer.from_dir(model)
    assert e.value.path == path
    rc, err = _cli([*GEN, "--model", str(model), "<|newbos|> Once"], capsys)
    assert rc == 2 and f"{path}:" in err and "<|newbos|>" in err


# ----- 3, 4, 9c: a corrupt compressed folder ---------------------------------------------------


@pytest.fixture(scope="module")
def compressed(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("compressed") / "c"
    compress_model(stories_dir, out, cast_bf16=True)
    return out


def _store_copy(compressed: Path, tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(compressed, tmp_path / "store" / name))


CORRUPT_MANIFESTS = {
    "bytes_inf": lambda t: re.sub(r'"bytes": \d+', '"bytes": 1e400', t, count=1),
    "bf16_inf": lambda t: re.sub(r'"bf16_bytes": \d+', '"bf16_bytes": 1e400', t),
    "bf16_zero": lambda t: re.sub(r'"bf16_bytes": \d+', '"bf16_bytes": "0"', t),
    "deep": lambda t: DEEP_LIST,
}


@pytest.mark.parametrize("case", sorted(CORRUPT_MANIFESTS))
def test_corrupt_compressed_manifest(
    compressed: Path, tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _store_copy(compressed, tmp_path, "c_bad")
    _store_copy(compressed, tmp_path, "c_good")
    manifest = folder / COMPRESSED_MANIFEST_NAME
    manifest.write_text(CORRUPT_MANIFESTS[case](manifest.read_text()))
    store = str(tmp_path / "store")

    rows = {m.name: m for m in ModelStore(store).list()}
    assert rows["c_good"].note.startswith("compressed")
    listed_corrupt = case != "bytes_inf"  # (the listing reads the totals, not the shards)
    assert rows["c_bad"].note.startswith("corrupt compressed manifest") == listed_corrupt
    rc, err = _cli(["models", "--store", store], capsys)
    assert rc == 0
    rc, err = _cli([*GEN, "--store", store, "--model", "nosuchmodel", "hi"], capsys)
    assert rc == 2 and "c_bad" in err and "c_good" in err
    if case == "bf16_zero":  # (read by the loader as a number: a sound manifest to it)
        return
    with pytest.raises(ModelLoadError, match=re.escape(f"{manifest}: corrupt manifest")):
        load_model(folder)
    rc, err = _cli(["verify", "c_bad", "--store", store], capsys)
    assert rc != 0 and f"{manifest}: corrupt manifest" in err
    rc, err = _cli([*GEN, "--model", str(folder), "hi"], capsys)
    assert rc == 2 and f"{manifest}: corrupt manifest" in err


def test_record_past_the_end_is_a_corrupt_header(compressed: Path, tmp_path: Path) -> None:
    folder = _store_copy(compressed, tmp_path, "c_past")
    shard = folder / "model.ei11"
    blob = shard.read_bytes()
    n = int.from_bytes(blob[8:16], "little")
    header = json.loads(blob[16 : 16 + n])
    last = header["tensors"][-1]
    last["data_offsets"] = [x + 64 * 10**9 for x in last["data_offsets"]]
    text = json.dumps(header).encode()
    assert len(text) <= n
    blob = blob[:16] + text.ljust(n) + blob[16 + n :]
    shard.write_bytes(blob)
    digest = xxhash.xxh3_64_hexdigest(blob[: 16 + n])
    with pytest.raises(ModelLoadError) as e:
        read_shard(shard, len(blob), digest)
    message = str(e.value)
    assert "corrupt header" in message and "past the end of the file" in message
    assert repr(last["name"]) in message and "wrong size" not in message


# ----- 8: a bad config.json at compress --cast-bf16 and at pull --------------------------------


@pytest.mark.parametrize("text", ["[1, 2]", DEEP_LIST, "{"])
def test_bad_config_refused_by_compress_and_pull(
    model: Path, tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (model / "config.json").write_text(text)
    out = tmp_path / "out"
    rc, err = _cli(["compress", "--cast-bf16", str(model), str(out)], capsys)
    assert rc == 2 and f"{model / 'config.json'}:" in err and not out.exists()
    store = tmp_path / "store"
    rc, err = _cli(["pull", str(model), "--store", str(store), "--name", "m"], capsys)
    assert rc == 2 and f"{model / 'config.json'}:" in err
    assert not (store / "m").exists()


# ----- 7: chat templates bounded in time and size ----------------------------------------------

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Loops, ranges, macros, namespace, filters, '*' of a short string, '**' of small numbers
BUSY_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% macro line(m) %}[{{ m.role|upper }}] {{ m.content }}"
    "{% endmacro %}{% for m in messages %}{% for i in range(3) %}{% set ns.n = ns.n + i %}"
    "{% endfor %}{{ line(m) }}{{ '-' * 5 }}{{ 2 ** 10 }}{{ m|tojson }}\n{% endfor %}"
    "{{ ns.n }}{{ range(5)|list|join(',') }}{% if add_generation_prompt %}>{% endif %}"
)
HOSTILE = {
    "nested range": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}",
    "string repetition": "{{ 'x' * 3000000000 }}",
    "list repetition": "{{ ([1] * 100000000)|length }}",
    "huge power": "{{ 2 ** 100000000 }}",
    "long output": "{% for i in range(100000) %}{{ messages[0]['content'] * 1000 }}{% endfor %}",
    "busy loop": "{% for i in range(100000) %}{% for m in range(99) %}{{ m.x }}{% endfor %}"
    "{% endfor %}",
}


def _tokenizer(stories_dir: Path, template: str) -> Tokenizer:
    tok = Tokenizer.from_dir(stories_dir)
    tok.chat_templates = {"default": template}
    return tok


def _plain_render(template: str, context: dict[str, Any]) -> str:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    return env.from_string(template).render(**context)


CONVERSATION = [
    {"role": "user", "content": "Hello, who are you?"},
    {"role": "assistant", "content": "I am SmolLM."},
    {"role": "user", "content": "Tell me a story " * 50},
]


@pytest.mark.parametrize("template", [SMOLLM2_TEMPLATE, BUSY_TEMPLATE])
def test_real_templates_render_as_before(stories_dir: Path, template: str) -> None:
    tok = _tokenizer(stories_dir, template)
    for messages in (CONVERSATION, CONVERSATION * 200):
        got = tok.apply_chat_template(messages)
        want = _plain_render(
            template,
            {**tok.special_tokens, "messages": messages, "add_generation_prompt": True},
        )
        assert got == want


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_stop_at_a_limit(stories_dir: Path, name: str) -> None:
    tok = _tokenizer(stories_dir, HOSTILE[name])
    with pytest.raises(ChatTemplateError, match="went past a limit"):
        tok.apply_chat_template([{"role": "user", "content": "y" * 1000}])
    # the budget is per render: a real one after it renders
    tok.chat_templates = {"default": SMOLLM2_TEMPLATE}
    assert tok.apply_chat_template(CONVERSATION).endswith("<|im_start|>assistant\n")
