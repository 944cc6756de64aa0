"""Faults in text handling found by review, each against the real stories260K tokenizer and
transformers as the reference: streamed text after a prompt that ends in byte tokens, chat
messages with keys set to None, and special tokens that tokenizer.json has as plain added
tokens, and a GGUF import of a Llama 3 vocabulary. `stories_dir` comes from conftest.py."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from runtime.detokenizer import IncrementalDetokenizer
from runtime.gguf_common import Metadata
from runtime.gguf_tokenizer import write_tokenizer
from runtime.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok(stories_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(stories_dir)


def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def _continuation(tok: Tokenizer, prompt: list[int], output: list[int]) -> str:
    full, head = tok.decode(prompt + output), tok.decode(prompt)
    assert full.startswith(head)
    return full[len(head) :]


# ----- streaming after a prompt that ends in a run of byte tokens ----------------------------


def test_output_bytes_continuing_the_prompts_byte_run(tok: Tokenizer) -> None:
    """In stories260K "日本語" is nine byte tokens, one run. The context the detokenizer kept
    was the prompt's last five tokens, which start inside that run: the run no longer decoded as
    UTF-8, and output bytes that continue it came out as U+FFFD."""
    prompt = tok.encode("Once upon a 日本")
    assert tok.convert_ids_to_tokens(prompt)[-6:] == [f"<0x{b:02X}>" for b in "日本".encode()]
    output = tok.encode("日本語 x", add_special_tokens=False)[-5:]
    assert tok.convert_ids_to_tokens(output) == ["<0xE8>", "<0xAA>", "<0x9E>", "▁", "x"]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.append(i) for i in output] + [detok.flush()]
    assert "".join(deltas) == _continuation(tok, prompt, output) == "語 x"


def test_random_prompts_ending_in_byte_tokens(tok: Tokenizer) -> None:
    rng = random.Random(7)
    byte_ids = sorted(tok.byte_fallback_ids)
    pieces = ["日本語", "😀", "é", "a", " ", "cat"]
    checked = 0
    for trial in range(800):
        prompt = tok.encode("".join(rng.choice(pieces) for _ in range(rng.randrange(1, 8))))
        if trial % 2:
            prompt += [rng.choice(byte_ids) for _ in range(rng.randrange(0, 9))]
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 6)))
        output = tok.encode(text, add_special_tokens=False)
        if trial % 3 == 0:
            output = [rng.choice(byte_ids) for _ in range(rng.randrange(0, 6))] + output
        full, head = tok.decode(prompt + output), tok.decode(prompt)
        # (not where the prompt's own bytes are invalid, or the output's spoil the prompt's run:
        # the text of bytes that continue an invalid run is not a suffix of any decode)
        if "\ufffd" in head or not full.startswith(head):
            continue
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = [detok.append(i) for i in output] + [detok.flush()]
        assert "".join(deltas) == full[len(head) :], (prompt, output)
        checked += 1
    assert checked > 400


def test_an_invalid_output_byte_after_a_prompt_ending_in_byte_tokens(tok: Tokenizer) -> None:
    """A stray continuation byte after a prompt that ends in a run of byte tokens: one U+FFFD, as
    decoding the output alone gives, not the whole run of the prompt spoilt with it (a context
    that began at the run's start gave 7 for a three-character run, 121 for sixty)."""
    for text in ("Once upon a 日本語", "Once upon a " + "日本語" * 20):
        prompt = tok.encode(text)
        stray = tok.encode("語", add_special_tokens=False)[-1:]  # <0x9E>
        output = stray + tok.encode(" x", add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt)
        got = "".join(detok.append(i) for i in output) + detok.flush()
        assert got == tok.decode(output) and got.count("\ufffd") == 1, (text, got)


# ----- chat messages with keys set to None -------------------------------------------------


NONE_TEMPLATE = """{% for message in messages %}
<|{{ message['role'] }}|>{{ message['content'] | trim }}
{% if 'tool_calls' in message %}calls:{{ message.tool_calls | length }}{% endif %}
{% endfor %}"""


def test_message_keys_set_to_none_render_as_transformers(stories_dir: Path, tmp_path: Path) -> None:
    """An OpenAI-style assistant message ({"content": None, "tool_calls": None, ...}, as the
    OpenAI SDK's model_dump() gives it): transformers leaves the None keys out. Ours rendered
    "None" for the content and raised TypeError on `tool_calls | length`."""
    d = _copy_model(stories_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text(NONE_TEMPLATE)
    ours = Tokenizer.from_dir(d)
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": None, "tool_calls": None, "refusal": None},
        {"role": "assistant", "content": "ok", "tool_calls": [{"id": "1"}]},
    ]
    expected = theirs.apply_chat_template(messages, tokenize=False)
    assert ours.apply_chat_template(messages) == expected
    assert "None" not in expected and "calls:1" in expected
    assert messages[1]["content"] is None  # the caller's messages are left as they were


# ----- special tokens that tokenizer.json has as plain added tokens ------------------------


@pytest.mark.parametrize(
    "key",
    ["eos_token", "pad_token", "image_token", "extra_special_tokens", "additional_special_tokens"],
)
def test_config_special_token_that_tokenizer_json_has_as_plain(
    stories_dir: Path, tmp_path: Path, key: str
) -> None:
    """tokenizer_config.json names "<|end|>" its eos (or pad, or image) token, or names it in
    a dict of extra special tokens; tokenizer.json has it as a plain added token. transformers
    makes it special (decode with skip_special_tokens drops it, and so must the streamed text);
    ours kept it plain, so its text showed in the output. (A token in a list of additional
    special tokens stays plain in both.)"""
    d = _copy_model(stories_dir, tmp_path / key)
    backend = HFTokenizer.from_file(str(d / "tokenizer.json"))
    backend.add_tokens([AddedToken("<|end|>", special=False, normalized=False)])
    backend.save(str(d / "tokenizer.json"))
    config = json.loads((d / "tokenizer_config.json").read_text())
    values: dict[str, Any] = {"extra_special_tokens": {"image_token": "<|end|>"}}
    values["additional_special_tokens"] = ["<|end|>"]
    config[key] = values.get(key, "<|end|>")
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_dir(d)
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))

    ids = ours.encode("a cat<|end|> sat")
    assert ids == theirs("a cat<|end|> sat")["input_ids"] and 512 in ids
    text = theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids) == text
    assert ("<|end|>" in text) == (key == "additional_special_tokens")
    assert (512 in ours.all_special_ids) == (key != "additional_special_tokens")
    assert ours.vocab_size == len(theirs) == 513
    detok = IncrementalDetokenizer(ours, ids[:1])
    assert "".join([detok.append(i) for i in ids[1:]] + [detok.flush()]) == text


# ----- GGUF import of a Llama 3 vocabulary ---------------------------------------------------


def _gpt2_gguf(path: Path, pre: str) -> Path:
    """A GGUF holding only a byte-level vocabulary: bos, eos, then a, b, c, ab, bc, abc, whose
    merges ("b c" first) never build "abc" from "a" + "bc"."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(["<|begin_of_text|>", "<|end_of_text|>", "a", "b", "c", "ab", "bc", "abc"])
    w.add_token_types([3, 3, 1, 1, 1, 1, 1, 1])
    w.add_token_merges(["b c", "a b", "ab c"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(("pre", "bos", "word"), [("llama-bpe", [0], [7]), ("default", [], [2, 6])])
def test_gguf_llama3_vocabulary_takes_whole_words_and_a_bos(
    tmp_path: Path, pre: str, bos: list[int], word: list[int]
) -> None:
    """For Llama 3's pre-tokenizer (and no add_bos_token key, as in older files), llama.cpp
    takes a word the vocabulary holds whole as one token and adds a bos, as Llama 3's own
    tokenizer.json does ("ignore_merges": true, a bos post-processor). The import ran the
    merges ("abc" became "a" "bc") and added no bos. GPT-2's pre-tokenizer does neither."""
    src = _gpt2_gguf(tmp_path / "m.gguf", pre)
    out = tmp_path / "hf"
    out.mkdir()
    write_tokenizer(out, Metadata(gguf.GGUFReader(src), src), {"max_position_embeddings": 64}, src)
    tok = Tokenizer.from_dir(out)
    assert tok.encode("abc") == bos + word
    assert tok.encode("abc", add_special_tokens=False) == word
    assert tok.decode(bos + word) == "abc"
