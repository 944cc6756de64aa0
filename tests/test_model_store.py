"""The local model store (runtime/model_store.py): a pull re-shards a model into aligned, checksummed
safetensors shards that read back bit-identical; verify names every missing, truncated or corrupt
shard; names resolve; replacing needs --force and is atomic; the CLI commands work end to end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import model_cache, model_store
from runtime.cli import _model_dir, main
from runtime.config import ModelLoadError
from runtime.manifest import MANIFEST_NAME, file_digests, read_manifest
from runtime.model_store import ModelStore, StoreError, parse_size, plan_shards
from runtime.weights import ReadStats, load_safetensors, read_header

SHARD = 64 << 10  # stories260K (1.1 MB) in 64 KiB shards: ~20 of them


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, unlike torch.equal on floats)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().flatten().view(torch.uint8),
                       b.contiguous().flatten().view(torch.uint8))  # fmt: skip


def _load_folder(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))  # each shard is a valid safetensors file on its own
    return out


def _check_layout(folder: Path, shard_bytes: int) -> None:
    """Every shard: data at a multiple of 4096, tensors at multiples of their element size,
    element sizes descending, at most shard_bytes of data unless one tensor alone; the manifest
    and the index agree with the files; nothing else left behind in the store."""
    manifest = read_manifest(folder)
    assert manifest is not None
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(f.name for f in folder.glob("*.safetensors"))
    n = len(files)
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert [s.file for s in manifest.shards] == files
    assert index["weight_map"] == {name: t.shard for name, t in manifest.tensors.items()}
    for entry in manifest.shards:
        path = folder / entry.file
        shard = read_header(path)
        assert shard.data_start % 4096 == 0
        sizes = [t.dtype.itemsize for t in shard.tensors]
        assert sizes == sorted(sizes, reverse=True)
        for t in shard.tensors:
            assert t.begin % t.dtype.itemsize == 0, t.name
            info = manifest.tensors[t.name]
            assert (info.shard, info.shape) == (entry.file, t.shape)
        data = sum(t.end - t.begin for t in shard.tensors)
        assert data <= shard_bytes or len(shard.tensors) == 1
        assert entry.bytes == path.stat().st_size
        assert entry.xxh3_64 == file_digests(path, manifest.chunk_bytes)
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".")] == []


def test_pull_stories_in_small_shards(tmp_path: Path, stories_dir: Path) -> None:
    store = ModelStore(tmp_path / "store")
    messages: list[str] = []
    folder = store.pull(stories_dir, shard_bytes=SHARD, progress=messages.append)
    assert folder == tmp_path / "store" / "stories260K"
    _check_layout(folder, SHARD)
    assert len(list(folder.glob("*.safetensors"))) > 10
    source = load_file(stories_dir / "model.safetensors")
    got = _load_folder(folder)
    assert sorted(got) == sorted(source)
    assert all(_same(got[k], source[k]) for k in source)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).read_bytes() == (stories_dir / name).read_bytes()
    assert "GB/s" in messages[-2] and "pulled stories260K" in messages[-1]
    manifest = read_manifest(folder)
    assert manifest is not None and manifest.name == "stories260K"
    assert manifest.source == str(stories_dir.resolve())
    assert store.verify("stories260K") == []


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"chunk_bytes": 1 << 42}, r"corrupt manifest \(chunk_bytes 4398046511104 is not a"),
        ({"chunk_bytes": float("inf")}, r"corrupt manifest"),
        ({"shards": [{"file": "x", "bytes": 1e400, "xxh3_64": []}]}, r"corrupt manifest"),
    ],
)
def test_a_manifest_that_cannot_be_meant_is_corrupt(
    tmp_path: Path,
    stories_dir: Path,
    edit: dict,  # type: ignore[type-arg]
    message: str,
) -> None:
    from runtime.config import ModelLoadError

    folder = ModelStore(tmp_path / "store").pull(stories_dir, shard_bytes=SHARD)
    path = folder / MANIFEST_NAME
    path.write_text(json.dumps(json.loads(path.read_text()) | edit))
    with pytest.raises(ModelLoadError, match=MANIFEST_NAME + ": " + message):
        read_manifest(folder)


def _mixed_source(folder: Path) -> dict[str, torch.Tensor]:
    """A two-file Hugging Face checkpoint of mixed dtypes and odd sizes, with an index, the
    usual side files, and things a pull must not copy."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.bf16": torch.randn(333, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(17, 29, generator=g),
        "c.i64": torch.arange(-5, 6, dtype=torch.int64) * (2**40),
        "d.u8": torch.arange(7, dtype=torch.uint8),
        "e.f16": torch.randn(3, 1001, generator=g).to(torch.float16),
        "f.bool": torch.tensor([True, False, True]),
        "g.big": torch.randn(4000, generator=g),  # 16000 bytes: more than a 4 KiB shard
        "h.empty": torch.empty(0, 3),
        "i.nan": torch.tensor([float("nan"), -0.0, float("inf")]),
        "j.f64": torch.randn(5, generator=g, dtype=torch.float64),
    }
    folder.mkdir()
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[:5],
             "model-00002-of-00002.safetensors": names[5:]}  # fmt: skip
    for file, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
    weight_map = {k: f for f, keys in parts.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "generation_config.json").write_text('{"eos_token_id": 2}')
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "pytorch_model.bin").write_bytes(b"old weights")  # another weight format
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs")
    (folder / "original").mkdir()  # a sub-folder (e.g. consolidated.pth)
    return tensors


def test_sharded_mixed_dtypes_round_trip(tmp_path: Path) -> None:
    tensors = _mixed_source(tmp_path / "src")
    folder = ModelStore(tmp_path / "store").pull(tmp_path / "src", "mixed", shard_bytes=4096)
    _check_layout(folder, 4096)
    got = _load_folder(folder)
    assert sorted(got) == sorted(tensors)
    assert all(_same(got[k], tensors[k]) for k in tensors)  # dtypes as they were on disk
    manifest = read_manifest(folder)
    assert manifest is not None
    assert {k: t.dtype for k, t in manifest.tensors.items()}["a.bf16"] == "BF16"
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".safetensors")) == [
        "chat_template.jinja",
        "config.json",
        "edgeinfer-manifest.json",
        "generation_config.json",
        "model.safetensors.index.json",
    ]
    stats = ReadStats()
    loaded = {n: t for _, n, t in load_safetensors(sorted(folder.glob("*.safetensors")),
                                                   direct=False, stats=stats)}  # fmt: skip
    assert stats.copied == 0  # every tensor a view of the aligned read buffer
    assert all(_same(loaded[k], tensors[k]) for k in tensors)


def test_source_errors(tmp_path: Path, stories_dir: Path) -> None:
    store = ModelStore(tmp_path / "store")
    _mixed_source(tmp_path / "src")
    index = tmp_path / "src" / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    weight_map["zz.ghost"] = weight_map.pop("j.f64")  # the index names a tensor nobody holds
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(StoreError, match=r"lists 10 tensors, .* \(2 differ, e.g. \['j.f64', 'zz"):
        store.pull(tmp_path / "src")
    (tmp_path / "nocfg").mkdir()
    with pytest.raises(StoreError, match=r"no config\.json"):
        store.pull(tmp_path / "nocfg")
    with pytest.raises(StoreError, match="no such folder or file"):
        store.pull(tmp_path / "nothing")
    with pytest.raises(StoreError, match="not a model name"):
        store.pull(stories_dir, "../escape")
    with pytest.raises(StoreError, match="must be positive"):
        store.pull(stories_dir, shard_bytes=0)
    assert not (tmp_path / "store").exists() or list((tmp_path / "store").iterdir()) == []


def test_verify_names_corrupt_truncated_and_missing_shards(
    tmp_path: Path, stories_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = ModelStore(tmp_path / "store")
    folder = store.pull(stories_dir, shard_bytes=SHARD)
    shards = sorted(folder.glob("*.safetensors"))
    with shards[1].open("r+b") as f:  # flip one byte of tensor data
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0x01]))
    os.truncate(shards[2], shards[2].stat().st_size - 100)
    shards[3].unlink()
    problems = store.verify("stories260K")
    assert len(problems) == 3
    assert problems[0].startswith(f"{shards[1]}: corrupt: checksum mismatch in bytes 0..")
    assert problems[1].startswith(f"{shards[2]}: truncated")
    assert problems[2].startswith(f"{shards[3]}: missing")

    assert main(["verify", "stories260K", "--store", str(store.root)]) == 1
    err = capsys.readouterr().err
    assert all(s.name in err for s in shards[1:4]) and "--force" in err

    (folder / MANIFEST_NAME).unlink()
    with pytest.raises(StoreError, match=r"no edgeinfer-manifest\.json"):
        store.verify("stories260K")


def test_a_corrupt_chunk_names_the_tensors_it_holds(
    tmp_path: Path, stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`verify` and a checked load name the tensor a corrupt byte range holds, not the range
    alone (which leaves the operator to parse the header to learn what is damaged)."""
    monkeypatch.setattr(model_store, "CHUNK_BYTES", 8192)
    store = ModelStore(tmp_path / "store")
    folder = store.pull(stories_dir, shard_bytes=SHARD)
    manifest = read_manifest(folder)
    assert manifest is not None and manifest.chunk_bytes == 8192
    big = next(
        (f, t) for f in sorted(folder.glob("*.safetensors")) for t in read_header(f).tensors
        if t.name == "model.embed_tokens.weight"
    )  # fmt: skip
    shard, t = big
    assert t.end - t.begin > 3 * 8192
    _flip(shard, (t.begin + t.end) // 2)  # a chunk wholly inside the embedding
    (problem,) = store.verify("stories260K")
    assert problem.startswith(f"{shard}: corrupt: checksum mismatch in bytes ")
    assert problem.endswith("(tensor 'model.embed_tokens.weight')")
    with pytest.raises(ModelLoadError, match=r"\(tensor 'model\.embed_tokens\.weight'\) \(xxh3"):
        list(load_safetensors([shard], manifest=manifest, skip_cached=False))

    _flip(shard, (t.begin + t.end) // 2)  # mended; now the header's first byte after the length
    _flip(shard, 9)
    (problem,) = store.verify("stories260K")
    assert problem.endswith("in bytes 0..8192 (header, which does not parse)")


def test_resolve_list_force_remove(tmp_path: Path, stories_dir: Path) -> None:
    store = ModelStore(tmp_path / "store")
    folder = store.pull(stories_dir, "tiny", shard_bytes=SHARD)
    assert store.resolve("tiny") == folder
    assert store.resolve(str(stories_dir)) == stories_dir  # a folder is taken as it is
    with pytest.raises(StoreError, match=r"it has: tiny\); pull it with: edgeinfer pull"):
        store.resolve("other")
    with pytest.raises(StoreError, match="no such model folder"):
        store.resolve("./no/such/dir")

    before = len(list(folder.glob("*.safetensors")))
    with pytest.raises(StoreError, match=r"already in the store.*--force"):
        store.pull(stories_dir, "tiny")
    assert len(list(folder.glob("*.safetensors"))) == before  # untouched
    store.pull(stories_dir, "tiny", shard_bytes=1 << 30, force=True)
    assert len(list(folder.glob("*.safetensors"))) == 1
    _check_layout(folder, 1 << 30)

    (tmp_path / "store" / "by-hand").mkdir()
    (tmp_path / "store" / "by-hand" / "config.json").write_text("{}")
    # one whose shard is a link to a file that is gone: its row says so (the listing failed)
    (tmp_path / "store" / "linked").mkdir()
    (tmp_path / "store" / "linked" / "config.json").write_text("{}")
    (tmp_path / "store" / "linked" / "model.safetensors").symlink_to(tmp_path / "gone")
    rows = store.list()
    assert [(m.name, m.shards, m.note.split(":")[0]) for m in rows] == [
        ("by-hand", 0, "no manifest"),
        ("linked", 1, "no manifest; unreadable"),
        ("tiny", 1, ""),
    ]
    assert "No such file or directory" in rows[1].note
    assert rows[2].total_bytes == (folder / "model-00001-of-00001.safetensors").stat().st_size

    assert store.remove("tiny") == folder
    assert not folder.exists()
    with pytest.raises(StoreError, match="not a model in the store"):
        store.remove("tiny")


def test_interrupted_pull_leaves_nothing(
    tmp_path: Path, stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ModelStore(tmp_path / "store")
    folder = store.pull(stories_dir, "tiny", shard_bytes=SHARD)
    real = model_store._write_shard
    calls = 0

    def ctrl_c_on_third(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(model_store, "_write_shard", ctrl_c_on_third)
    with pytest.raises(KeyboardInterrupt):
        store.pull(stories_dir, "tiny", shard_bytes=SHARD // 2, force=True)
    assert [p.name for p in store.root.iterdir()] == ["tiny"]  # no temporary folder left
    assert store.verify("tiny") == []  # the old model, whole
    assert len(list(folder.glob("*.safetensors"))) > 10


def test_plan_shards_and_sizes() -> None:
    assert plan_shards([], 10) == [[]]
    assert plan_shards([4, 4, 4], 10) == [[0, 1], [2]]
    assert plan_shards([30, 1, 1], 10) == [[0], [1, 2]]  # too big: a shard of its own
    # balanced: 3 shards of 4 for 12 units at 5 per shard, not 5 + 5 + 2
    assert plan_shards([1] * 12, 5) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert parse_size("512MB") == 512 * 10**6
    assert parse_size("1GiB") == parse_size("1g") == 2**30
    assert parse_size("64 KiB") == parse_size("64k") == 65536
    assert parse_size("4096") == parse_size("4096b") == 4096
    for bad in ("", "MB", "1x", "-5", "1.5.2GB"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)


def test_gguf_source(tmp_path: Path) -> None:
    from runtime.gguf_import import import_gguf
    from tests.test_gguf_import import gpt2_vocab, tiny_llama, train_byte_level_bpe, write_gguf

    vocab = gpt2_vocab(train_byte_level_bpe())
    write_gguf(tmp_path / "tiny.gguf", tiny_llama(len(vocab.tokens), tied=True), vocab)
    folder = ModelStore(tmp_path / "store").pull(tmp_path / "tiny.gguf", shard_bytes=SHARD)
    assert folder.name == "tiny"
    _check_layout(folder, SHARD)
    imported = import_gguf(tmp_path / "tiny.gguf", tmp_path / "imported")
    want, got = _load_folder(imported), _load_folder(folder)
    assert sorted(got) == sorted(want)
    assert all(_same(got[k], want[k]) for k in want)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (folder / name).read_bytes() == (imported / name).read_bytes()
    manifest = read_manifest(folder)
    assert manifest is not None and manifest.source == str((tmp_path / "tiny.gguf").resolve())


def test_default_model_through_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model SmolLM2-135M-Instruct` (or no --model) imports the bundled GGUF into the store
    once, with a manifest; here a tiny GGUF stands in for it."""
    from tests.test_gguf_import import gpt2_vocab, tiny_llama, train_byte_level_bpe, write_gguf

    vocab = gpt2_vocab(train_byte_level_bpe())
    write_gguf(tmp_path / "m.gguf", tiny_llama(len(vocab.tokens), tied=False), vocab)
    monkeypatch.setattr(model_cache, "bundled_gguf_path", lambda: tmp_path / "m.gguf")
    root = tmp_path / "store"
    folder = Path(_model_dir(model_cache.DEFAULT_MODEL, str(root)))
    assert folder == root / model_cache.DEFAULT_MODEL
    assert ModelStore(root).verify(model_cache.DEFAULT_MODEL) == []
    assert Path(_model_dir(None, str(root))) == folder  # no second import
    assert [p.name for p in root.iterdir()] == [model_cache.DEFAULT_MODEL]


def test_cli_pull_models_verify_generate_rm(
    tmp_path: Path, stories_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = str(tmp_path / "store")
    assert main(["models", "--store", store]) == 0
    assert "no models" in capsys.readouterr().err
    assert main(["pull", str(stories_dir), "--store", store, "--shard-size", "64KiB"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "store" / "stories260K") and "GB/s" in err
    assert main(["pull", str(stories_dir), "--store", store]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["models", "--store", store]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "SIZE", "SHARDS", "CREATED", "SOURCE"]
    assert table[1].split()[0] == "stories260K" and str(stories_dir.resolve()) in table[1]
    assert main(["verify", "stories260K", "--store", store]) == 0
    assert "every checksum matches" in capsys.readouterr().out

    gen = ["generate", "--max-tokens", "12", "--kv-cache-bytes", str(16 << 20), "Once upon"]
    assert main([*gen, "--model", str(stories_dir)]) == 0
    from_folder = capsys.readouterr().out
    assert main([*gen, "--model", "stories260K", "--store", store]) == 0
    assert capsys.readouterr().out == from_folder  # greedy: the same text from the store copy
    assert main([*gen, "--model", "nope", "--store", store]) == 2
    assert "edgeinfer pull" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exc:
        main(["pull", str(stories_dir), "--shard-size", "lots"])
    assert exc.value.code == 2
    assert "not a size" in capsys.readouterr().err
    assert main(["rm", "stories260K", "--store", store]) == 0
    assert main(["rm", "stories260K", "--store", store]) == 2


def test_a_compressed_copy_in_the_store_is_listed_and_served(
    tmp_path: Path, stories_dir: Path
) -> None:
    from runtime.compression import compress_model
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    store = ModelStore(tmp_path / "store")
    compress_model(stories_dir, store.root / "tiny-z", cast_bf16=True)
    (row,) = store.list()
    assert row.name == "tiny-z" and row.shards == 1 and row.source == str(stories_dir)
    assert row.note.startswith("compressed, 6") and row.total_bytes > 0
    folder = Path(_model_dir("tiny-z", str(store.root)))
    assert folder == store.root / "tiny-z"
    params = SamplingParams(temperature=0, max_tokens=8)
    out = LLM(folder, kv_cache_bytes=1 << 22).generate(["Once upon a time"], params)
    want = LLM(stories_dir, dtype="bfloat16", kv_cache_bytes=1 << 22).generate(
        ["Once upon a time"], params
    )
    assert out[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_leftovers_of_killed_pulls_are_swept(tmp_path: Path, stories_dir: Path) -> None:
    """A pull killed outright (no chance to clean up) leaves its temporary folder; the next pull
    deletes it, and a pull still running (its lock held) is left alone."""
    import subprocess
    import sys

    store = ModelStore(tmp_path / "store")
    code = (
        "import os, signal, sys\n"
        "from runtime.model_store import ModelStore\n"
        "with ModelStore(sys.argv[1]).staging('tiny') as tmp:\n"
        "    (tmp / 'model-00001-of-00002.safetensors').write_bytes(b'x' * 100000)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(store.root)], cwd=Path(__file__).parents[1])  # fmt: skip
    assert done.returncode == -9
    killed_rm = store.root / ".rm-old.0123456789ab"  # a remove killed between rename and delete
    (killed_rm / "model").mkdir(parents=True)
    (killed_rm / ".lock").touch()  # its process is gone: nobody holds the lock
    older_rm = store.root / ".rm-older.ba9876543210"  # a remove's from before removes locked
    older_rm.mkdir()
    os.utime(older_rm, (0, 0))  # (without a lock file: once it is a minute old)
    left = sorted(p.name for p in store.root.iterdir())
    assert len(left) == 3 and left[0].startswith(".pull-tiny."), left
    said: list[str] = []
    with store.staging("other") as running:  # a live pull beside the sweep
        store.pull(stories_dir, "tiny", shard_bytes=SHARD, progress=said.append)
        assert running.is_dir()
        assert sorted(p.name for p in store.root.iterdir()) == [running.name, "tiny"]
    assert [p.name for p in store.root.iterdir()] == ["tiny"]
    assert sum("left by an interrupted pull or remove" in m for m in said) == 3, said
    assert store.verify("tiny") == []


def _tiny_gguf(path: Path) -> Path:
    from tests.test_gguf_import import sentencepiece_vocab, tiny_llama, write_gguf

    vocab = sentencepiece_vocab()
    write_gguf(path, tiny_llama(len(vocab.tokens), tied=True), vocab)
    return path


def test_a_store_path_that_cannot_be_made_is_an_error_not_a_traceback(
    tmp_path: Path, stories_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A store path under a file (or a read-only store): the pull's staging folder cannot be
    made, a StoreError naming the target, and on the command line `edgeinfer: error:`, exit 2."""
    (tmp_path / "file").write_text("not a folder")
    store = ModelStore(tmp_path / "file" / "store")
    with pytest.raises(StoreError, match=r"pulling .* into .*file/store/stories260K: .*Not a dir"):
        store.pull(stories_dir)
    assert main(["pull", str(stories_dir), "--store", str(store.root)]) == 2
    assert capsys.readouterr().err.startswith("edgeinfer: error: pulling")


def test_a_name_too_long_for_the_stores_temporary_folders_is_refused(
    tmp_path: Path, stories_dir: Path
) -> None:
    store = ModelStore(tmp_path / "store")
    with pytest.raises(StoreError, match=r"240 characters, a name has 200 at most"):
        store.pull(stories_dir, "a" * 240)  # `.pull-<240 a>.<12 hex>`: over 255 characters
    assert store.pull(stories_dir, "b" * 200, shard_bytes=SHARD).name == "b" * 200
    assert [p.name for p in store.root.iterdir()] == ["b" * 200]
    # a model pulled under a longer name before the limit stays usable: verify, rm
    (store.root / ("b" * 200)).rename(store.root / ("c" * 230))
    assert store.verify("c" * 230) == []
    store.remove("c" * 230)
    assert list(store.root.iterdir()) == []


def test_a_full_disk_while_a_gguf_is_pulled_is_an_error_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """safetensors reports a full disk as SafetensorError, not an OSError: still a StoreError
    naming the target (and for import-gguf, `edgeinfer: error:`), exit 2, nothing left."""
    from safetensors import SafetensorError

    def full(*args: object, **kwargs: object) -> None:
        raise SafetensorError("Error while serializing: No space left on device (os error 28)")

    gguf = _tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr("runtime.gguf_import.save_file", full)
    store = ModelStore(tmp_path / "store")
    with pytest.raises(StoreError, match=r"into .*store/tiny: .*No space left on device"):
        store.pull(gguf)
    assert main(["pull", str(gguf), "--store", str(store.root)]) == 2
    assert "edgeinfer: error: pulling" in capsys.readouterr().err
    assert main(["import-gguf", str(gguf), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "edgeinfer: error: importing" in err and "No space left on device" in err
    assert list(store.root.iterdir()) == [] and not (tmp_path / "hf").exists()


def test_verify_checks_the_other_files_too(
    tmp_path: Path, stories_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """config.json, tokenizer.json, ...: a checksum each in the manifest, checked by verify; a
    manifest from before (no "files") still verifies its shards and says the rest is not
    covered; the model's revision is the same with or without them."""
    from runtime.loader import model_revision

    store = ModelStore(tmp_path / "store")
    folder = store.pull(stories_dir, "tiny", shard_bytes=SHARD)
    revision = model_revision(folder)
    with (folder / "tokenizer.json").open("ab") as f:
        f.write(b" ")
    (folder / "tokenizer_config.json").unlink()
    problems = store.verify("tiny")
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"{folder / 'tokenizer.json'}: corrupt: checksum mismatch")
    assert problems[1] == f"{folder / 'tokenizer_config.json'}: missing (the manifest lists it)"
    assert main(["verify", "tiny", "--store", str(store.root)]) == 1
    assert "tokenizer.json: corrupt" in capsys.readouterr().err
    manifest = read_manifest(folder)
    assert manifest is not None and manifest.files is not None
    assert sorted(manifest.files) == ["config.json", "model.safetensors.index.json",
                                      "tokenizer.json", "tokenizer_config.json"]  # fmt: skip

    raw = json.loads((folder / MANIFEST_NAME).read_text())
    del raw["files"]  # as pulled before the other files had checksums
    (folder / MANIFEST_NAME).write_text(json.dumps(raw))
    said: list[str] = []
    assert store.verify("tiny", progress=said.append) == []
    assert "they are not checked" in said[-1]
    assert main(["verify", "tiny", "--store", str(store.root)]) == 0
    assert "its other files have no checksums" in capsys.readouterr().out
    assert model_revision(folder) == revision


def test_rm_of_a_model_that_is_a_link_removes_the_link_alone(
    tmp_path: Path, stories_dir: Path
) -> None:
    elsewhere = ModelStore(tmp_path / "elsewhere")
    target = elsewhere.pull(stories_dir, "tiny", shard_bytes=SHARD)
    store = ModelStore(tmp_path / "store")
    store.root.mkdir()
    (store.root / "linked").symlink_to(target, target_is_directory=True)
    assert store.remove("linked") == store.root / "linked"
    assert list(store.root.iterdir()) == []  # no `.rm-linked.*` left either
    assert elsewhere.verify("tiny") == []  # what it pointed to, whole
    (store.root / "dangling").symlink_to(tmp_path / "gone")
    store.remove("dangling")
    (store.root / ".rm-old.0123456789ab").symlink_to(target)  # a remove killed mid-way
    assert store.sweep() == [store.root / ".rm-old.0123456789ab"]
    assert list(store.root.iterdir()) == [] and elsewhere.verify("tiny") == []


def test_verify_of_a_name_is_the_stores_model_whatever_the_working_folder_holds(
    tmp_path: Path, stories_dir: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    store = ModelStore(tmp_path / "store")
    store.pull(stories_dir, "tiny", shard_bytes=SHARD)
    (tmp_path / "cwd" / "tiny").mkdir(parents=True)
    (tmp_path / "cwd" / "tiny" / MANIFEST_NAME).write_text("not the store's")
    monkeypatch.chdir(tmp_path / "cwd")
    assert main(["verify", "tiny", "--store", str(store.root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny: ") and "every checksum matches" in out


def test_pulling_a_compressed_folder_says_what_to_do(tmp_path: Path, stories_dir: Path) -> None:
    from runtime.compression import compress_model

    compress_model(stories_dir, tmp_path / "z", cast_bf16=True)
    store = ModelStore(tmp_path / "store")
    with pytest.raises(StoreError, match=r"a compressed copy .*does not take compressed ones: "
                       rf"pull the original, .*edgeinfer compress --cast-bf16 {stories_dir} "):  # fmt: skip
        store.pull(tmp_path / "z")
    assert not store.root.exists() or list(store.root.iterdir()) == []
    # the command it suggests works as given (the original is float32: it said so it was cast)
    from runtime.cli import main

    try:
        store.pull(tmp_path / "z")
    except StoreError as e:
        suggested = str(e).rsplit("edgeinfer ", 1)[1].split()
    assert main(suggested) == 0
    assert store.verify(suggested[-1].rsplit("/", 1)[1]) == []


def test_leftovers_of_killed_compressions_into_the_store_are_swept(
    tmp_path: Path, stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`edgeinfer compress SRC <store>/NAME` killed outright leaves `.NAME.compress-<id>`:
    the next sweep deletes it once no live process holds its lock (one from before locks: once
    it is a minute old), and leaves a running compression's alone."""
    import runtime.compression as compression

    store = ModelStore(tmp_path / "store")
    killed = store.root / ".tiny-z.compress-0123456789ab"
    killed.mkdir(parents=True)
    (killed / ".lock").touch()  # its process is gone: nobody holds the lock
    (killed / "model.ei11").write_bytes(b"x" * 1000)
    older = store.root / ".old-z.compress-ba9876543210"  # from before compressions locked
    older.mkdir()
    os.utime(older, (0, 0))
    real, swept = compression._write_shard, []

    def sweep_meanwhile(*args, **kwargs):  # type: ignore[no-untyped-def]
        swept.extend(store.sweep())  # while this compression's folder is in use
        return real(*args, **kwargs)

    monkeypatch.setattr(compression, "_write_shard", sweep_meanwhile)
    compression.compress_model(stories_dir, store.root / "tiny-z", cast_bf16=True)
    assert swept == [older, killed]
    assert [p.name for p in store.root.iterdir()] == ["tiny-z"]
    assert store.verify("tiny-z") == []
    assert not (store.root / "tiny-z" / ".lock").exists()


def _flip(path: Path, at: int) -> None:
    """Flip one bit of byte `at` of a file (a negative `at` counts from the end)."""
    with path.open("r+b") as f:
        f.seek(at, os.SEEK_SET if at >= 0 else os.SEEK_END)
        where = f.tell()
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_corrupt_store_model_is_not_pulled_into_a_sound_looking_copy(
    tmp_path: Path, stories_dir: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """A pull whose source is a model of a store reads it checked against its manifest: a bit
    flipped in a shard, a changed config or a header that parses but lists another tensor is an
    error naming the file, and nothing is left in the store (not a new model with fresh
    checksums that `verify` passes). A sound one copies bit for bit, read in whole chunks."""
    with monkeypatch.context() as m:  # small checksum chunks: several per shard
        m.setattr(model_store, "CHUNK_BYTES", 8192)
        source = ModelStore(tmp_path / "src").pull(stories_dir, "tiny", shard_bytes=SHARD)
    manifest = read_manifest(source)
    assert manifest is not None and manifest.chunk_bytes == 8192
    store = ModelStore(tmp_path / "store")
    copy = store.pull(source, "copy", shard_bytes=3 * SHARD // 2)  # other shard boundaries
    _check_layout(copy, 3 * SHARD // 2)
    want, got = _load_folder(source), _load_folder(copy)
    assert sorted(got) == sorted(want) and all(_same(got[k], want[k]) for k in want)

    shard = source / manifest.shards[1].file
    _flip(shard, -1)  # the last byte of a tensor: copied by a pull that does not check
    with pytest.raises(ModelLoadError, match=rf"{shard}: checksum mismatch in bytes \d+\.\.\d+"):
        store.pull(source, "again")
    assert main(["pull", str(source), "--name", "again", "--store", str(store.root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgeinfer: error: ") and f"{shard}: checksum mismatch" in err
    assert [p.name for p in store.root.iterdir()] == ["copy"]
    _flip(shard, -1)  # mended

    (source / "config.json").write_text((source / "config.json").read_text() + " ")
    with pytest.raises(StoreError, match=rf"{source}/config.json: corrupt: checksum mismatch"):
        store.pull(source, "again")
    (source / "config.json").write_text((source / "config.json").read_text()[:-1])

    name = manifest.shards[0].file
    head = (source / name).read_bytes()
    t = next(iter(read_header(source / name).tensors)).name
    (source / name).write_bytes(head.replace(t.encode(), (t[:-1] + "X").encode(), 1))
    with pytest.raises(StoreError, match=rf"{name}: corrupt: its header has tensor .*X'"):
        store.pull(source, "again")
    assert [p.name for p in store.root.iterdir()] == ["copy"]
    assert store.verify("copy") == []


def test_a_remove_beside_another_remove_or_pull_finishes(
    tmp_path: Path, stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder a remove is deleting is locked: another remove's (or pull's) sweep, running
    meanwhile, leaves it alone, and both removes finish."""
    store = ModelStore(tmp_path / "store")
    for name in ("a", "b"):
        store.pull(stories_dir, name, shard_bytes=SHARD)
    real = model_store._delete
    deleting: list[Path] = []

    def another_remove_meanwhile(path: Path) -> None:
        deleting.append(path)
        if len(deleting) == 1:
            assert store.remove("b") == store.root / "b"  # its sweep runs while "a" is deleted
        real(path)

    monkeypatch.setattr(model_store, "_delete", another_remove_meanwhile)
    assert store.remove("a") == store.root / "a"
    assert len(deleting) == 2
    assert list(store.root.iterdir()) == []


def test_leftovers_of_killed_gguf_imports_into_the_store_are_swept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`edgeinfer import-gguf FILE <store>/NAME` killed outright leaves its locked temporary
    folder; the store's next sweep deletes it, and leaves a running import's alone."""
    import subprocess
    import sys

    from runtime import gguf_import

    gguf = _tiny_gguf(tmp_path / "tiny.gguf")
    store = ModelStore(tmp_path / "store")
    code = (
        "import os, signal, sys\n"
        "from runtime import gguf_import\n"
        "gguf_import.write_tokenizer = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        "gguf_import.import_gguf(sys.argv[1], sys.argv[2])\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(gguf), str(store.root / "tiny")],
                          cwd=Path(__file__).parents[1])  # fmt: skip
    assert done.returncode == -9
    left = list(store.root.iterdir())
    assert len(left) == 1 and left[0].name.startswith(".tiny."), left  # the import's, hidden
    real, swept = gguf_import.write_tokenizer, []

    def sweep_meanwhile(*args, **kwargs):  # type: ignore[no-untyped-def]
        swept.extend(store.sweep())  # while this import's folder is in use
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf_import, "write_tokenizer", sweep_meanwhile)
    said: list[str] = []
    assert gguf_import.import_gguf(gguf, store.root / "tiny", progress=said.append).is_dir()
    assert swept == left
    assert [p.name for p in store.root.iterdir()] == ["tiny"]
    assert not (store.root / "tiny" / ".lock").exists()
    assert ModelStore(store.root).sweep() == []


def test_the_default_models_name_taken_by_another_model_is_refused(
    tmp_path: Path, stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --model and a store model named SmolLM2-135M-Instruct that is not the bundled import
    (the user pulled it): it is neither replaced nor served as the default; the error says how
    to serve it (--model names it) or to remove it; --model naming it serves it as it is. Our
    own import, when stale, is still replaced."""
    from runtime.gguf_import import import_gguf
    from tests.test_gguf_import import gpt2_vocab, tiny_llama, train_byte_level_bpe, write_gguf

    vocab = gpt2_vocab(train_byte_level_bpe())
    write_gguf(tmp_path / "m.gguf", tiny_llama(len(vocab.tokens), tied=False), vocab)
    monkeypatch.setattr(model_cache, "bundled_gguf_path", lambda: tmp_path / "m.gguf")
    store = ModelStore(tmp_path / "store")
    theirs = store.pull(stories_dir, model_cache.DEFAULT_MODEL, shard_bytes=SHARD)
    with pytest.raises(StoreError, match=r"not the bundled import .*--model SmolLM2-135M-"
                       r"Instruct.*edgeinfer rm SmolLM2-135M-Instruct --store "):  # fmt: skip
        _model_dir(None, str(store.root))  # (before: imported the GGUF over it)
    manifest = read_manifest(theirs)
    assert manifest is not None and manifest.source == str(stories_dir.resolve())
    assert store.verify(model_cache.DEFAULT_MODEL) == []
    assert Path(_model_dir(model_cache.DEFAULT_MODEL, str(store.root))) == theirs
    assert [p.name for p in store.root.iterdir()] == [model_cache.DEFAULT_MODEL]
    # our own import, but stale (from before the store: no manifest): replaced
    store.remove(model_cache.DEFAULT_MODEL)
    import_gguf(tmp_path / "m.gguf", theirs)
    assert Path(_model_dir(None, str(store.root))) == theirs
    assert store.verify(model_cache.DEFAULT_MODEL) == []
    manifest = read_manifest(theirs)
    assert manifest is not None and manifest.source == str(tmp_path / "m.gguf")
