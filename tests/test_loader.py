"""Loading model folders: sharded checkpoints, and clear errors that name the file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runtime import LLM, ModelLoadError, SamplingParams
from runtime.config import ModelConfig
from runtime.loader import load_model, start_load
from runtime.weights import ReadStats

ROOT = Path(__file__).resolve().parents[1]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


def test_sharded_checkpoint_equals_single_file(stories_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories_dir / name, sharded / name)
    params = SamplingParams(temperature=0, max_tokens=24)
    a = LLM(stories_dir, kv_cache_bytes=1 << 20).generate("Once upon a time", params)
    b = LLM(sharded, kv_cache_bytes=1 << 20).generate("Once upon a time", params)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_missing_folder_and_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"not a folder"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match=r"config.json: missing"):
        load_model(tmp_path)


@pytest.mark.parametrize("part", ["pp stage 2 of 2", "chunks smaller than the header"])
def test_a_header_that_lies_is_caught_by_any_rank(
    stories_dir: Path, tmp_path: Path, part: str
) -> None:
    """A manifest's checksums cover each shard's header as well as its tensors, whatever part of
    the model a load reads: a later pipeline stage (its tensors all past the header's chunk),
    or a manifest whose chunks are smaller than the header. A layer's k_proj and v_proj names
    swapped in the header (layer 4's, layer 1's) loaded the wrong weights there, silently."""
    from runtime.parallel import ParallelConfig, RankPlace
    from tests.test_weights import write_checked_manifest

    d = copy_model(stories_dir, tmp_path / "m")
    weights = d / "model.safetensors"
    chunk = 64 << 10 if part.startswith("pp") else 4096  # (the header: 4,864 bytes)
    write_checked_manifest(d, [weights], chunk)
    place = RankPlace(ParallelConfig(pp=2), rank=1) if part.startswith("pp") else None
    model = start_load(d, place=place).finish()  # sound
    assert any(n.startswith("layers.4.") for n, _ in model.named_parameters())
    raw = bytearray(weights.read_bytes())
    layer = 4 if place is not None else 1  # (one named in the first 4,096 bytes)
    k = raw.find(f"layers.{layer}.self_attn.k_proj".encode())
    v = raw.find(f"layers.{layer}.self_attn.v_proj".encode())
    assert 0 < k < chunk and 0 < v < chunk  # (so the old code, reading chunks past it, missed it)
    raw[k + 19 : k + 20], raw[v + 19 : v + 20] = b"v", b"k"
    weights.write_bytes(raw)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: checksum mismatch in bytes 0\.\."):
        start_load(d, place=place).finish()


def test_corrupt_config(stories_dir: Path, tmp_path: Path) -> None:
    d = copy_model(stories_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        load_model(d)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"num_attention_heads": 0}, r"num_attention_heads must be a positive integer, got 0"),
        ({"hidden_size": -64}, r"hidden_size must be a positive integer, got -64"),
        ({"num_hidden_layers": 0}, r"num_hidden_layers must be a positive integer"),
        ({"vocab_size": "many"}, r"vocab_size must be an integer, got 'many'"),
        ({"max_position_embeddings": 1e400}, r"max_position_embeddings must be an integer, got inf"),
        ({"max_position_embeddings": 10**12}, r"max_position_embeddings must be at most 16777216"),
        ({"sliding_window": -5}, r"sliding_window must be a positive integer, got -5"),
        ({"architectures": 5}, r"architectures must be a list of names .* got 5"),
        ({"architectures": [["LlamaForCausalLM"]]}, r"architectures must be a list of names"),
        ({"architectures": "LlamaForCausalLM"}, r"architectures must be a list of names"),
        ({"tie_word_embeddings": "false"}, r"tie_word_embeddings must be true or false, got 'false'"),
        # sizes the checkpoint contradicts: before the model is built (it was, from these sizes:
        # the allocator's error for 256 TB, or a minute building layers)
        ({"vocab_size": 10**12}, r"tensor 'model\.embed_tokens\.weight' has "
         r"shape \(512, 64\), config\.json \(vocab_size x hidden_size\) implies \(1000000000000, 64\)"),
        ({"intermediate_size": 10**11}, r"tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has"),
        ({"num_hidden_layers": 20000}, r"num_hidden_layers is 20000, the checkpoint has layers 0-4"),
    ],
)
def test_config_values_that_cannot_be_meant(
    stories_dir: Path, tmp_path: Path, edit: dict, message: str  # type: ignore[type-arg]
) -> None:
    d = copy_model(stories_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | edit))
    with pytest.raises(ModelLoadError, match=r"(config\.json|model\.safetensors): " + message):
        load_model(d)
    (d / "config.json").write_text("[1]")
    with pytest.raises(ModelLoadError, match=r"config\.json: not a JSON object"):
        load_model(d)


@pytest.mark.parametrize(
    "weight_map", [["model.safetensors"], {"a": 5}, {"a": "../m/model.safetensors"}, {"a": ""}]
)
def test_an_index_that_names_no_file_of_the_folder(
    stories_dir: Path, tmp_path: Path, weight_map: object
) -> None:
    d = copy_model(stories_dir, tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match=r"index\.json: not a valid safetensors index"):
        load_model(d)


def test_unsupported_architecture(stories_dir: Path, tmp_path: Path) -> None:
    d = copy_model(stories_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"GPT2LMHeadModel.*not supported"):
        load_model(d)


def test_unsupported_rope_scaling(stories_dir: Path) -> None:
    raw = json.loads((stories_dir / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ModelLoadError, match=r"yarn"):
        ModelConfig.from_dict(raw)


def test_missing_and_corrupt_weights(stories_dir: Path, tmp_path: Path) -> None:
    d = copy_model(stories_dir, tmp_path / "m")
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt"):
        load_model(d)
    weights.unlink()
    with pytest.raises(ModelLoadError, match=r"no model.safetensors"):
        load_model(d)


def test_missing_shard_named(stories_dir: Path, tmp_path: Path) -> None:
    d = copy_model(stories_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    index = {
        "metadata": {},
        "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"},
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002.safetensors: missing"):
        load_model(d)


def test_wrong_shape_and_dtype_named(stories_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    d = copy_model(stories_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model.norm.weight' has shape \(65,\)"):
        load_model(d)
    tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int8)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model.norm.weight' has dtype torch.int8"):
        load_model(d)
    del tensors["model.norm.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing from the checkpoint: norm.weight"):
        load_model(d)


def test_a_layer_index_that_is_not_ascii_digits_is_named(stories_dir: Path, tmp_path: Path) -> None:
    """'²' is a digit to str.isdigit, not to int(): a ValueError that named no file."""
    from safetensors.torch import load_file

    d = copy_model(stories_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.\u00b2.input_layernorm.weight"] = tensors.pop(
        "model.layers.2.input_layernorm.weight"
    )
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: unexpected tensor "
                       r"'model\.layers\.\u00b2\.input_layernorm\.weight'"):  # fmt: skip
        load_model(d)


def test_cli_generate(stories_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "generate", "--model", str(stories_dir),
         "--max-tokens", "12", "--kv-cache-bytes", str(1 << 20), "Once upon a time"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Once upon a time, there was a little girl named Lily")


def test_cli_clear_error(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "generate", "--model", str(tmp_path), "hi"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 2
    assert "config.json: missing" in out.stderr and "Traceback" not in out.stderr


def _reference(hf: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    """What our parameter `name` must hold, built from the checkpoint's tensors by hand."""
    pieces = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    if name in ("embed_tokens", "lm_head"):
        key = "model.embed_tokens.weight" if name == "embed_tokens" else "lm_head.weight"
        return hf[key].to(dtype)
    parts = name.split(".")
    if parts[-2] in pieces:
        return torch.cat([hf["model." + ".".join([*parts[:-2], p, parts[-1]])].to(dtype)
                          for p in pieces[parts[-2]]])  # fmt: skip
    return hf["model." + name].to(dtype)


def _mixed_shards(src: Path, dst: Path, shards: int) -> dict[str, torch.Tensor]:
    """`src` re-written as `shards` packed shards (tensors at odd offsets), every other tensor in
    bfloat16, with an index and a manifest (16 KiB checksum chunks). Returns what is on disk."""
    from safetensors.torch import load_file

    from tests.test_weights import save_packed, write_checked_manifest

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    names = sorted(tensors, reverse=True)  # not the writer's usual order
    disk = {n: tensors[n].to(torch.bfloat16) if i % 2 else tensors[n] for i, n in enumerate(names)}
    files, weight_map = [], {}
    for k in range(shards):
        part = names[k::shards]
        files.append(dst / f"model-{k + 1:05d}-of-{shards:05d}.safetensors")
        save_packed({n: disk[n] for n in part}, files[-1])
        weight_map.update({n: files[-1].name for n in part})
    index = {"metadata": {}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    write_checked_manifest(dst, files, 16 << 10)
    return disk


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("staging", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parameters_bit_identical_to_the_checkpoint(
    tiny_model_dir, tmp_path: Path, family: str, dtype: str, staging: bool
) -> None:  # type: ignore[no-untyped-def]
    """Fused q/k/v and gate/up, bfloat16 and float32 on disk converted once to the model's dtype,
    tensors at offsets that are not multiples of their size, 3 shards checked chunk by chunk.
    qwen2: tied embeddings, q/k/v biases. `staging`: read as onto a GPU (through the staging
    buffers, into device-aligned parameters), on the CPU."""
    disk = _mixed_shards(tiny_model_dir(family), tmp_path / "m", 3)
    stats = ReadStats()
    model = start_load(tmp_path / "m", dtype, stats=stats, staging=staging).finish()
    want_dtype = getattr(torch, dtype)
    for name, param in model.named_parameters():
        want = _reference(disk, name, want_dtype)
        assert param.dtype == want_dtype and torch.equal(param, want), name
        offset = param.data_ptr() - param.untyped_storage().data_ptr()  # in the device arena
        assert not staging or offset % 256 == 0, name
    assert stats.verified > 3 and stats.bytes == sum(
        f.stat().st_size for f in (tmp_path / "m").glob("*.safetensors")
    )
    converted = sum(t.dtype != want_dtype for n, t in disk.items() if "rotary" not in n)
    assert stats.copied >= converted > 0


def _with_manifest(stories_dir: Path, dst: Path) -> tuple[Path, Path]:
    from tests.test_weights import write_checked_manifest

    d = copy_model(stories_dir, dst)
    write_checked_manifest(d, [d / "model.safetensors"], 64 << 10)
    return d, d / "model.safetensors"


def test_manifest_names_a_missing_truncated_or_corrupt_shard(
    stories_dir: Path, tmp_path: Path
) -> None:
    from tests.test_weights import flip_byte

    d, weights = _with_manifest(stories_dir, tmp_path / "m")
    good = weights.read_bytes()
    load_model(d)  # sound

    flip_byte(weights, len(good) - 1000)
    start = (len(good) - 1000) // (64 << 10) * (64 << 10)
    with pytest.raises(
        ModelLoadError, match=rf"model\.safetensors: checksum mismatch in bytes {start}\.\."
    ):
        load_model(d)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: checksum mismatch"):
        start_load(d, direct=False).finish()  # through the page cache too
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: checksum mismatch"):
        start_load(d, staging=True).finish()  # through the staging buffers (a GPU's load)

    weights.write_bytes(good[:-10])
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors: truncated: the manifest says "
                       rf"{len(good)} bytes, the file has {len(good) - 10}"):  # fmt: skip
        load_model(d)
    weights.unlink()
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: missing \(the manifest lists"):
        load_model(d)


def test_errors_before_any_read(stories_dir: Path, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A model larger than memory, an unexpected tensor, a tensor in two shards: errors naming
    the folder or file before a byte of weights is read."""
    import runtime.loader

    d = copy_model(stories_dir, tmp_path / "m")
    stats = ReadStats()
    monkeypatch.setattr(runtime.loader, "available_memory", lambda: 100_000)
    with pytest.raises(ModelLoadError, match=r"/m: the weights need 1\.\d MB of memory \(as "
                       r"torch\.float32\), only 0\.1 MB is available"):  # fmt: skip
        load_model(d, stats=stats)

    def built(*args: object) -> None:
        raise AssertionError("the model was built (its parameters allocated) first")

    monkeypatch.setattr(runtime.loader, "LlamaForCausalLM", built)  # (one tensor larger than
    with pytest.raises(ModelLoadError, match=r"/m: the weights need"):  # the host failed there)
        load_model(d, stats=stats)
    monkeypatch.undo()

    from safetensors.torch import load_file

    tensors = load_file(d / "model.safetensors")
    save_file(
        {**tensors, "model.layers.0.mlp.extra.weight": torch.ones(2)}, d / "model.safetensors"
    )
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: unexpected tensor 'model\.layers"
                       r"\.0\.mlp\.extra\.weight' for LlamaForCausalLM"):  # fmt: skip
        load_model(d, stats=stats)

    (d / "model.safetensors").unlink()
    save_file(tensors, d / "a.safetensors")
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, d / "b.safetensors")
    weight_map = {n: "a.safetensors" for n in tensors} | {"model.norm.weight": "b.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match=r"b\.safetensors: tensor 'model\.norm\.weight' is "
                       r"also in .*a\.safetensors"):  # fmt: skip
        load_model(d, stats=stats)
    assert stats.bytes == 0


def _plain_folder(dst: Path, seed: int, shards: int = 1, rows: int = 256) -> Path:
    """config.json and `shards` safetensors files of random float32 weights: folders of one
    `rows` and `shards` have the same config and byte-identical headers, whatever the seed."""
    g = torch.Generator().manual_seed(seed)
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map: dict[str, str] = {}
    for i, name in enumerate(names):
        tensors = {f"layers.{i}.{k}": torch.randn(rows, 256, generator=g) for k in "abcd"}
        save_file(tensors, dst / (name if shards > 1 else "model.safetensors"))
        weight_map |= dict.fromkeys(tensors, name)
    if shards > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def _header(path: Path) -> bytes:
    raw = path.read_bytes()
    return raw[: 8 + int.from_bytes(raw[:8], "little")]


@pytest.mark.parametrize(("shards", "rows"), [(1, 16), (1, 256), (3, 256)])
def test_plain_revision_tells_weights_apart(tmp_path: Path, shards: int, rows: int) -> None:
    """Same config and headers, other weights (a fine-tune of one architecture): two revisions;
    a byte-identical copy elsewhere: one. Small data (16 rows: 64 KiB) is hashed whole, larger
    is sampled."""
    from runtime.loader import model_revision

    a = _plain_folder(tmp_path / "a", seed=0, shards=shards, rows=rows)
    b = _plain_folder(tmp_path / "b", seed=1, shards=shards, rows=rows)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for f in files:
        if f.endswith(".safetensors"):
            assert _header(a / f) == _header(b / f)
        else:
            assert (a / f).read_bytes() == (b / f).read_bytes()
    rev = model_revision(a)
    assert len(rev) == 16 and int(rev, 16) >= 0
    assert model_revision(b) != rev
    copy = shutil.copytree(a, tmp_path / "elsewhere" / "copy")
    assert model_revision(copy) == rev


def test_plain_revision_reads_a_bounded_sample(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Of a sampled folder's weights, REVISION_SAMPLES pages and no more, none of them a page
    the loader probes to tell a file in the page cache (shard_reader._cached: the middle and
    the last), or the next start would read that file buffered instead of O_DIRECT."""
    import os

    from runtime.loader import REVISION_SAMPLES, model_revision

    d = _plain_folder(tmp_path / "m", seed=0, shards=3)
    sizes = {os.stat(f).st_ino: os.stat(f).st_size for f in d.glob("*.safetensors")}
    reads: list[tuple[int, int, int]] = []  # (file, offset, length)
    pread = os.pread

    def spy(fd: int, n: int, offset: int) -> bytes:
        reads.append((os.fstat(fd).st_ino, offset, n))
        return pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", spy)
    model_revision(d)
    pages = [r for r in reads if r[2] == 4096]
    assert len(pages) == REVISION_SAMPLES and len(reads) == len(pages) + 2 * 3  # + the headers
    for ino, offset, _ in pages:
        assert offset % 4096 == 0
        assert offset // 4096 not in (sizes[ino] // 2 // 4096, (sizes[ino] - 1) // 4096)
    assert len({ino for ino, _, _ in pages}) == 3  # every shard sampled


def test_pulled_revision_is_its_checksums(stories_dir: Path, tmp_path: Path) -> None:
    """A folder pulled into the store: its revision comes from the manifest's checksums, not
    its name, source or time, so two pulls of one model are one revision, and other weights
    another. The manifest is trusted (the revision reads no weights) because a load checks
    every chunk against it: a shard changed under its manifest fails to load."""
    from runtime.loader import model_revision
    from runtime.manifest import MANIFEST_NAME
    from runtime.model_store import ModelStore

    store = ModelStore(tmp_path / "store")
    first = store.pull(stories_dir, "first", shard_bytes=300_000)
    moved = copy_model(stories_dir, tmp_path / "moved")
    second = store.pull(moved, "second", shard_bytes=300_000)
    raw = json.loads((second / MANIFEST_NAME).read_text())
    raw["created"] = "2000-01-01T00:00:00Z"
    (second / MANIFEST_NAME).write_text(json.dumps(raw))
    assert raw["source"] != json.loads((first / MANIFEST_NAME).read_text())["source"]
    rev = model_revision(first)
    assert model_revision(second) == rev

    from safetensors.torch import load_file

    tuned = load_file(moved / "model.safetensors")
    tuned["model.norm.weight"] += 1e-3  # one small tensor: the checksums see every byte
    save_file(tuned, moved / "model.safetensors")
    assert model_revision(store.pull(moved, "tuned", shard_bytes=300_000)) != rev

    shard = sorted(second.glob("model-*.safetensors"))[-1]
    changed = bytearray(shard.read_bytes())
    changed[-100] ^= 1
    shard.write_bytes(changed)  # the manifest is stale now
    assert model_revision(second) == rev
    with pytest.raises(ModelLoadError, match=r"checksum mismatch"):
        load_model(second)


def test_a_folder_replaced_while_loading_keeps_the_revision_of_what_was_read(
    stories_dir: Path, tmp_path: Path
) -> None:
    """`pull --force` swaps a new version in while a worker reads the old one: the engine keys
    its prefix cache (and KV transfer) on the revision of the weights it read, not the new
    folder's."""
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.loader import model_revision

    m = copy_model(stories_dir, tmp_path / "m")
    v2 = copy_model(stories_dir, tmp_path / "v2")
    cfg = json.loads((v2 / "config.json").read_text())
    cfg["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-5) * 2  # another model: other KV
    (v2 / "config.json").write_text(json.dumps(cfg))
    old = model_revision(m)
    pending = start_load(m)
    m.rename(tmp_path / "m.old")  # the swap `pull --force` makes
    v2.rename(m)
    assert model_revision(m) != old
    engine = LLMEngine(EngineConfig(model=str(m), kv_cache_bytes=1 << 20), pending)
    assert engine.model_revision == old
