"""Loading models from corrupt or hostile folders: a clear error naming the file, never a
traceback, a model that computes NaN, or an engine that fails to start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runtime import LLM, ModelLoadError, SamplingParams
from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.loader import load_model


def linked_model(src: Path, dst: Path, **config: object) -> Path:
    """A copy of `src` whose files are links, but for its config.json, edited by `config`."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg | config))
    return dst


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # NaN and non-positive rotary settings made every angle NaN (or divided by zero at the
        # first forward): the model loaded and served garbage
        ({"rope_theta": -5}, r"rope_theta must be > 0, got -5"),
        ({"rope_theta": 0}, r"rope_theta must be > 0"),
        ({"rope_scaling": {"type": "linear", "factor": float("nan")}},
         r"rope_scaling factor must be > 0, got nan"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0}},
         r"low_freq_factor must be > 0"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 0}},
         r"high_freq_factor must be > 0"),
        ({"rms_norm_eps": float("nan")}, r"rms_norm_eps must be >= 0, got nan"),
        ({"rms_norm_eps": -1}, r"rms_norm_eps must be >= 0, got -1"),
        # head_dim 10**9: the allocator's RuntimeError (the fused qkv weight, 4 TB)
        ({"head_dim": 10**9}, r"tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' has shape "
         r"\(64, 64\), config\.json \(num_attention_heads \* head_dim x hidden_size\) implies"),
        ({"eos_token_id": -1}, r"eos_token_id -1 is not a token id \(vocab_size is 512\)"),
    ],
)  # fmt: skip
def test_config_values_that_break_the_model(
    stories_dir: Path, tmp_path: Path, edit: dict[str, object], message: str
) -> None:
    d = linked_model(stories_dir, tmp_path / "m", **edit)
    with pytest.raises(ModelLoadError, match=message):
        load_model(d)


@pytest.mark.parametrize("eos", [512, [2, 10**9]])
def test_an_eos_id_past_the_vocabulary_is_named(
    stories_dir: Path, tmp_path: Path, eos: object
) -> None:
    """An eos id >= vocab_size failed the engine's start with an IndexError (the structured
    output's eos mask); now the config error, naming the file."""
    d = linked_model(stories_dir, tmp_path / "m", eos_token_id=eos)
    with pytest.raises(ModelLoadError, match=r"config\.json: eos_token_id \d+ is not a token id"):
        LLMEngine(EngineConfig(model=str(d), kv_cache_bytes=1 << 22))
    shutil.rmtree(d)


@pytest.mark.parametrize("edit", [{"gb_per_s": None}, {"gb_per_s": "1.3"}, {"measured": 5}])
def test_a_corrupt_drive_rate_is_not_remembered(tmp_path: Path, edit: dict[str, object]) -> None:
    """A worker describes its drive's remembered rate after loading the model: an entry of the
    wrong type in drive-rates.json failed its start with a TypeError; now it is not measured."""
    from runtime.drive import CACHE_NAME, DriveRate, describe, remember

    rate = DriveRate(1.25, "2026-11-22T18:00:00Z", "vda", str(tmp_path), 1 << 20)
    cache = remember(tmp_path, tmp_path, rate)
    assert "1.25 GB/s" in describe(tmp_path, tmp_path)
    rates = json.loads(cache.read_text())
    (key,) = rates
    cache.write_text(json.dumps({key: rates[key] | edit}))
    assert describe(tmp_path, tmp_path).startswith("the drive's rate not measured yet")
    assert cache.name == CACHE_NAME


@pytest.mark.parametrize("key", ["eot_token_id", "eos_token_id", "bos_token_id", "padding_token_id"])  # fmt: skip
def test_a_gguf_special_token_past_the_vocabulary_is_left_out(tmp_path: Path, key: str) -> None:
    """A GGUF whose special token id is no token (llama.cpp ignores it as a "bad special
    token"): an eot id went into generation_config.json's eos ids and failed the engine's start
    with an IndexError; an eos, bos or pad id failed the import with one. Now the import leaves
    it out, and the folder serves."""
    from runtime.gguf_import import import_gguf
    from tests.test_gguf_import import _small_gguf

    path = _small_gguf(tmp_path / "odd.gguf", kv={f"tokenizer.ggml.{key}": 10**6})
    out = import_gguf(path, tmp_path / "hf")
    assert "1000000" not in (out / "generation_config.json").read_text()
    engine = LLMEngine(EngineConfig(model=str(out), kv_cache_bytes=1 << 22))
    assert all(0 <= e < engine.model.cfg.vocab_size for e in engine.eos_token_ids)


@pytest.mark.parametrize("where", ["files", "shard"])
def test_a_manifest_naming_a_file_with_a_nul_is_corrupt(
    stories_dir: Path, tmp_path: Path, where: str
) -> None:
    """A NUL in a name the manifest lists: `verify` and a pull from the store stopped on the
    bare ValueError that open() raises (no file named, no line per problem); now the manifest
    is corrupt, naming it, wherever it is read."""
    from runtime.model_store import ModelStore

    store = ModelStore(tmp_path / "store")
    folder = store.pull(stories_dir, "m")
    path = folder / "edgeinfer-manifest.json"
    raw = json.loads(path.read_text())
    if where == "files":
        raw["files"]["tokenizer\0.json"] = "0"
    else:
        old = raw["shards"][0]["file"]
        raw["shards"][0]["file"] = new = "model\0.safetensors"
        raw["tensors"] = {k: t | {"shard": new} if t["shard"] == old else t
                          for k, t in raw["tensors"].items()}  # fmt: skip
    path.write_text(json.dumps(raw))
    message = r"edgeinfer-manifest\.json: corrupt manifest .* is not a plain"
    with pytest.raises(ModelLoadError, match=message):
        store.verify("m")
    with pytest.raises(ModelLoadError, match=message):
        store.pull(folder, "copy")
    with pytest.raises(ModelLoadError, match=message):
        load_model(folder)


def test_a_compressed_header_that_lies_about_a_shape_allocates_nothing(tmp_path: Path) -> None:
    """A shard header (of a manifest without header checksums) that gives a coded record a
    shape far larger than the record: its memory was allocated from the shape before the
    record's own header was read (OSError ENOMEM from mmap for 2**36 x 300 values, or gigabytes
    taken for a smaller lie); now the header is corrupt, naming the shard."""
    from runtime.compression import load_compressed, verify_compressed
    from runtime.compression import read_manifest as read_compressed
    from tests.test_compression import _compressed

    out = _compressed(tmp_path)
    path = out / "model.ei11"
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[8:16], "little")
    header = json.loads(bytes(data[16 : 16 + n]))
    (x,) = [t for t in header["tensors"] if t["name"] == "x.weight"]
    assert x["encoding"] == "huffman"
    x["shape"] = [2**36, 300]
    text = json.dumps(header, separators=(",", ":")).encode()
    data[16 : 16 + n] = text + b" " * (n - len(text))
    path.write_bytes(data)
    manifest = out / "edgeinfer-compressed.json"
    raw = json.loads(manifest.read_text())
    for shard in raw["shards"]:
        del shard["header_xxh3_64"]  # (as a manifest written before they were recorded)
    manifest.write_text(json.dumps(raw))
    message = r"model\.ei11: corrupt header .*'x\.weight': a record of \d+ bytes cannot hold"
    with pytest.raises(ModelLoadError, match=message):
        list(load_compressed(out))
    (problem,) = verify_compressed(out, read_compressed(out))
    assert "cannot hold 20615843020800 values" in problem


@pytest.mark.parametrize("index", ["{not json", '{"weight_map": [1]}', "[]"])
def test_a_store_model_with_a_corrupt_index_is_named_when_pulled(
    stories_dir: Path, tmp_path: Path, index: str
) -> None:
    """A pull from a store's model whose manifest lists the shards (and, pulled by an older
    edgeinfer, has no checksums of the other files) read its index unchecked: a JSONDecodeError
    or a TypeError's traceback; now a StoreError naming the index."""
    from runtime.model_store import ModelStore, StoreError

    store = ModelStore(tmp_path / "store")
    folder = store.pull(stories_dir, "m")
    path = folder / "edgeinfer-manifest.json"
    raw = json.loads(path.read_text())
    del raw["files"]
    path.write_text(json.dumps(raw))
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(StoreError, match=r"index\.json: not a valid safetensors index"):
        store.pull(folder, "copy")
    assert [m.name for m in store.list()] == ["m"]


def test_an_index_mapping_a_tensor_to_a_list_is_named(stories_dir: Path, tmp_path: Path) -> None:
    """An index whose weight_map gives a tensor a list of files: a TypeError's traceback
    (unhashable type: 'list') from the loader and from a pull; now the index is named."""
    from runtime.model_store import ModelStore

    d = linked_model(stories_dir, tmp_path / "m")
    index = {"weight_map": {"model.norm.weight": ["model.safetensors"]}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    message = r"index\.json: not a valid safetensors index"
    with pytest.raises(ModelLoadError, match=message):
        load_model(d)
    with pytest.raises(ModelLoadError, match=message):
        ModelStore(tmp_path / "store").pull(d, "m")


@pytest.mark.parametrize(
    "edit", [{"num_local_experts": 10**8}, {"intermediate_size": 10**9}], ids=["experts", "inter"]
)
def test_an_moe_config_past_any_memory_is_named(tmp_path: Path, edit: dict[str, object]) -> None:
    """Mixtral sizes its checkpoint does not have and no allocator can reserve (its experts'
    tensors, which no check of the checkpoint's layout saw before the model was built): the
    allocator's RuntimeError; now a ModelLoadError naming config.json."""
    import torch
    import transformers as tf

    from tests.test_moe import _config

    torch.manual_seed(0)
    d = tmp_path / "mixtral"
    tf.AutoModelForCausalLM.from_config(_config("mixtral")).save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | edit))
    message = r"mixtral/config\.json: the model it describes cannot be allocated \([\d.]+ GB in one"
    with pytest.raises(ModelLoadError, match=message):
        load_model(d)


def test_an_eos_id_past_the_vocabulary_in_generation_config_is_left_out(
    stories_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An end-of-sequence id outside the vocabulary in generation_config.json (the tokenizer
    takes any integer there) crashed the engine's start with an IndexError (the structured-output
    eos mask); it is left out with a warning, as no such token can be sampled."""
    model = tmp_path / "model"
    shutil.copytree(stories_dir, model)
    (model / "generation_config.json").write_text('{"eos_token_id": [2, 600, -1]}')
    with caplog.at_level("WARNING", logger="edgeinfer.engine"):
        llm = LLM(str(model), kv_cache_bytes=4_000_000)
    assert 2 in llm.engine.eos_token_ids and 600 not in llm.engine.eos_token_ids
    assert -1 not in llm.engine.eos_token_ids and "[-1, 600]" in caplog.text
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) >= 1
