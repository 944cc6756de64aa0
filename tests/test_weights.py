"""The safetensors reader (runtime/weights.py) and the reader under it (runtime/shard_reader.py):
bit-identical to `safetensors` on single and sharded checkpoints with mixed dtypes and odd sizes,
through O_DIRECT and through the page cache; byte ranges scattered straight into memory exactly;
a flipped byte caught by the manifest's checksums; every lie a file can tell is an error naming
it."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.config import ModelLoadError
from runtime.manifest import Manifest, ShardEntry, file_digests, write_manifest
from runtime.shard_reader import ALIGN, Arena, DeviceArena, FileRead, ShardReads, Span
from runtime.weights import (
    ReadStats,
    chunk_checks,
    drop_page_cache,
    load_safetensors,
    read_header,
)
from tests.memory_tools import resident_pages, vm_flags


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {  # sizes that are not multiples of anything; a bf16 of odd length misaligns the next
        "a.f32": torch.randn(7, 3, generator=g),
        "b.bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.f32": torch.randn(1001, generator=g),
        "d.f16": torch.randn(3, 3, generator=g).to(torch.float16),
        "e.i64": torch.tensor([-(2**40), 7]),
        "f.u8": torch.arange(13, dtype=torch.uint8),
        "g.big": torch.randn(300, 1111, generator=g),  # ~1.3 MB: several reads
        "h.empty": torch.empty(0, 4),
    }


def save_packed(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A valid safetensors file with the tensors packed in the given order, no padding (the
    `safetensors` writer orders by alignment; other writers need not, so a tensor may sit at
    an offset that is not a multiple of its element size)."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.int64: "I64", torch.uint8: "U8"}  # fmt: skip
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        blob = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}  # fmt: skip
        blobs.append(blob)
        offset += len(blob)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(len(body).to_bytes(8, "little") + body + b"".join(blobs))


def _read(
    files: list[Path], direct: bool, skip_cached: bool = True
) -> tuple[dict[str, torch.Tensor], ReadStats]:
    stats = ReadStats()
    loaded = load_safetensors(files, 3, direct, stats, skip_cached=skip_cached)
    return {name: t for _, name, t in loaded}, stats


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("shards", [1, 2])
def test_bit_identical_to_safetensors(tmp_path: Path, direct: bool, shards: int) -> None:
    files, want = [], {}
    for i in range(shards):
        t = _tensors(i)
        t = {f"s{i}.{k}": v for k, v in t.items()}
        f = tmp_path / f"model-{i}.safetensors"
        save_packed(t, f)
        files.append(f)
        want.update(t)
        drop_page_cache(f)
    got, stats = _read(files, direct, skip_cached=False)  # O_DIRECT even where cached
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(
            g.view(torch.uint8) if g.numel() else g, w.view(torch.uint8) if w.numel() else w
        ), name
    assert stats.bytes == sum(f.stat().st_size for f in files)
    assert stats.copied_bytes == 0  # a whole file into its arena: every byte read in place
    assert stats.copied == 4 * shards  # c, e, g, h sit at offsets their element size misses
    if direct:  # ext4 allows O_DIRECT
        assert stats.direct == shards and stats.buffered == 0
    else:
        assert stats.buffered == shards


def test_cached_file_is_read_through_the_page_cache(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    save_file(_tensors(3), str(f))
    f.read_bytes()  # now cached
    got, stats = _read([f], direct=True)
    assert stats.buffered == 1 and stats.direct == 0
    assert torch.equal(got["g.big"], load_file(str(f))["g.big"])


def test_o_direct_refused_falls_back_to_buffered_reads(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """As on filesystems that refuse O_DIRECT (tmpfs before Linux 6.6, some FUSE and network
    filesystems): open() fails with EINVAL, and the file is read through the page cache."""
    import errno
    import os

    real_open = os.open

    def refusing_open(path, flags, *args):  # type: ignore[no-untyped-def]
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    f = tmp_path / "m.safetensors"
    save_file(_tensors(8), str(f))
    monkeypatch.setattr(os, "open", refusing_open)
    got, stats = _read([f], direct=True, skip_cached=False)
    assert stats.buffered == 1 and stats.direct == 0
    assert torch.equal(got["g.big"], load_file(str(f))["g.big"])


def _rewrite_header(f: Path, edit) -> None:  # type: ignore[no-untyped-def]
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    f.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n :])


def test_lies_and_damage_are_errors_naming_the_file(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    save_file(_tensors(4), str(f))
    good = f.read_bytes()

    f.write_bytes(good[:-100])
    with pytest.raises(
        ModelLoadError, match=r"m\.safetensors: truncated: its header needs \d+ bytes"
    ):
        read_header(f)

    f.write_bytes(good)
    _rewrite_header(f, lambda h: h["a.f32"].update(shape=[7, 4]))
    with pytest.raises(
        ModelLoadError, match=r"m\.safetensors: corrupt .*'a\.f32'.*needs 112 bytes"
    ):
        list(load_safetensors([f]))

    f.write_bytes(good)
    _rewrite_header(f, lambda h: h["a.f32"].update(dtype="F8_E9M9"))
    with pytest.raises(ModelLoadError, match=r"m\.safetensors: corrupt .*'a\.f32'"):
        list(load_safetensors([f]))

    f.write_bytes(b"\xff" * 16)
    with pytest.raises(
        ModelLoadError, match=r"m\.safetensors: corrupt safetensors file \(header of"
    ):
        list(load_safetensors([f]))

    f.write_bytes((12).to_bytes(8, "little") + b"not json!!!!")
    with pytest.raises(ModelLoadError, match=r"header is not JSON"):
        list(load_safetensors([f]))


@pytest.mark.parametrize(
    ("edit", "message"),
    [  # each a header's lie, or a value that JSON allows and a header cannot mean
        ({"data_offsets": [0, 1e400]}, r"'a\.f32': data_offsets must be a list of 2 integers >= 0"),
        ({"shape": [-4, -7]}, r"'a\.f32': shape must be a list of integers >= 0"),
        ({"shape": [7.9, 4.2]}, r"'a\.f32': shape must be a list of integers >= 0"),
        ({"shape": [True, 28]}, r"'a\.f32': shape must be a list of integers >= 0"),
        ({"shape": [2**70, 0]}, r"'a\.f32': shape must be a list of integers >= 0 \(below 2\*\*63\)"),
        ({"shape": None}, r"'a\.f32': shape must be a list"),
        ({"data_offsets": [112, 0]}, r"'a\.f32': data_offsets \[112, 0\] end before they begin"),
        ({"data_offsets": [0]}, r"'a\.f32': data_offsets must be a list of 2 integers"),
        ({"dtype": "F8_E4M3"}, r"tensor 'a\.f32' is F8_E4M3, a dtype edgeinfer cannot load"),
        ({"dtype": ["F32"]}, r"'a\.f32': no dtype \['F32'\]"),
    ],
)
def test_a_header_entry_that_cannot_be_meant_is_an_error_naming_the_file(
    tmp_path: Path, edit: dict, message: str  # type: ignore[type-arg]
) -> None:
    f = tmp_path / "m.safetensors"
    save_file(_tensors(4), str(f))
    _rewrite_header(f, lambda h: h["a.f32"].update(edit))
    with pytest.raises(ModelLoadError, match=r"m\.safetensors: .*" + message):
        read_header(f)


def test_a_header_longer_than_its_file_is_said_once(tmp_path: Path) -> None:
    """A length past the end of the file is that error alone, not also "header is not JSON"
    (the check raised inside the try that turns a JSON parser's ValueError into that one)."""
    f = tmp_path / "m.safetensors"
    save_file(_tensors(4), str(f))
    good = f.read_bytes()
    f.write_bytes((2 * len(good)).to_bytes(8, "little") + good[8:])
    with pytest.raises(ModelLoadError) as e:
        read_header(f)
    assert str(e.value) == (
        f"{f}: corrupt safetensors file (header of {2 * len(good)} bytes in a file of {len(good)})"
    )


@pytest.mark.parametrize(
    "header", [b"[" * 200_000 + b"]" * 200_000, b'{"a": ' + b"9" * 5001 + b"}"]
)
def test_a_header_python_cannot_parse_is_not_json(tmp_path: Path, header: bytes) -> None:
    f = tmp_path / "m.safetensors"
    f.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ModelLoadError, match=r"m\.safetensors: corrupt .*header is not"):
        read_header(f)


def test_every_header_is_checked_before_any_read(tmp_path: Path) -> None:
    good, bad = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(_tensors(5), str(good))
    save_file(_tensors(6), str(bad))
    bad.write_bytes(bad.read_bytes()[:-10])
    stats = ReadStats()
    with pytest.raises(ModelLoadError, match=r"b\.safetensors: truncated"):
        next(load_safetensors([good, bad], stats=stats))
    assert stats.bytes == 0  # nothing was read


def test_overlapping_tensors_are_an_error(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    save_packed({"a": torch.zeros(4), "b": torch.ones(4)}, f)
    _rewrite_header(f, lambda h: h["b"].update(data_offsets=[8, 24]))
    with pytest.raises(ModelLoadError, match=r"m\.safetensors: corrupt .*'a' and 'b' overlap"):
        read_header(f)


def write_checked_manifest(folder: Path, files: list[Path], chunk_bytes: int) -> Manifest:
    """A manifest for `files` (in `folder`) with per-chunk checksums, as `edgeinfer pull` writes."""
    shards = [ShardEntry(f.name, f.stat().st_size, file_digests(f, chunk_bytes)) for f in files]
    manifest = Manifest(folder.name, "tests", chunk_bytes, shards)
    write_manifest(folder, manifest)
    return manifest


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("direct", [True, False])
def test_manifest_checks_every_chunk_and_names_a_corrupt_one(tmp_path: Path, direct: bool) -> None:
    files = []
    for i in range(2):
        files.append(tmp_path / f"model-{i}.safetensors")
        save_packed({f"s{i}.{k}": v for k, v in _tensors(10 + i).items()}, files[-1])
    chunk = 64 << 10
    manifest = write_checked_manifest(tmp_path, files, chunk)
    stats = ReadStats()
    got = {n: t for _, n, t in load_safetensors(files, 3, direct, stats, skip_cached=False,
                                                manifest=manifest)}  # fmt: skip
    assert stats.verified == sum(len(s.xxh3_64) for s in manifest.shards)
    assert stats.direct == (2 if direct else 0)
    assert torch.equal(got["s1.g.big"], _tensors(11)["g.big"])

    flip_byte(files[1], 3 * chunk + 100)
    with pytest.raises(
        ModelLoadError,
        match=rf"model-1\.safetensors: checksum mismatch in bytes {3 * chunk}\.\.{4 * chunk} ",
    ):
        list(load_safetensors(files, 3, direct, skip_cached=False, manifest=manifest))


def _scatter(size: int, seed: int, device: bool = False) -> tuple[list[Span], list[Arena | DeviceArena]]:
    """Disjoint spans over a file of `size` bytes, of every awkward length, into two arenas at
    offsets that sit where the bytes do modulo ALIGN (read in place) or do not (copied).
    `device`: the second arena is a DeviceArena (on the CPU, zeroed), reached through staging."""
    rng = random.Random(seed)
    arenas: list[Arena | DeviceArena] = [Arena(size + 64 * ALIGN), Arena(size + 64 * ALIGN)]
    if device:
        arenas[1] = DeviceArena(size + 64 * ALIGN, "cpu")
        arenas[1].tensor().zero_()
    spans, pos, ends = [], rng.randrange(0, 3 * ALIGN), [0, 0]
    while pos < size:
        n = min(size - pos, rng.choice([1, 7, ALIGN - 1, ALIGN, ALIGN + 1, 5 * ALIGN + 3, 70_000]))
        i = rng.randrange(2)
        shift = 0 if rng.random() < 0.6 else rng.randrange(1, ALIGN)
        at = ends[i] + (pos - ends[i]) % ALIGN + shift  # in line with the file, or `shift` off
        spans.append(Span(pos, pos + n, arenas[i], at))
        ends[i] = at + n
        pos += n + rng.choice([0, 0, 1, 300, ALIGN])  # gaps: bytes nobody asked for
    return spans, arenas


def _contents(arena: Arena | DeviceArena) -> bytes:
    return bytes(arena.view) if isinstance(arena, Arena) else arena.tensor().numpy().tobytes()


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize(("chunk_kib", "device"), [(16, False), (64, False), (16, True)])
def test_spans_land_exactly_where_asked(
    tmp_path: Path, direct: bool, chunk_kib: int, device: bool
) -> None:
    """The loader's reads: each span's bytes at its place, nothing written anywhere else, and the
    checksum of chunks read into several places at once still checked (a flipped byte named).
    `device`: half the spans go to a DeviceArena, so chunks go through the staging ring, with
    their host spans copied out of it (a GPU load's path, run on the CPU)."""
    f = tmp_path / "blob.bin"
    data = random.Random(1).randbytes(600_001)
    f.write_bytes(data)
    chunk = chunk_kib << 10
    manifest = write_checked_manifest(tmp_path, [f], chunk)
    for seed in range(3):
        spans, arenas = _scatter(len(data), seed, device)
        stats = ReadStats()
        reads = ShardReads([FileRead(f, len(data), spans)], threads=3, direct=direct,
                           skip_cached=False, chunk_bytes=chunk,
                           verify=chunk_checks(manifest)[1], stats=stats)  # fmt: skip
        reads.wait(0)
        reads.close()
        assert stats.direct == direct and stats.verified == len(manifest.shards[0].xxh3_64)
        total = sum(s.end - s.begin for s in spans)
        staged = sum(s.end - s.begin for s in spans if isinstance(s.arena, DeviceArena))
        assert max(staged, 1) <= stats.copied_bytes < total  # both kinds
        expect = [bytearray(a.nbytes) for a in arenas]
        for s in spans:
            expect[arenas.index(s.arena)][s.offset : s.offset + s.end - s.begin] = data[
                s.begin : s.end
            ]
        assert [_contents(a) for a in arenas] == [bytes(e) for e in expect], seed

    flip_byte(f, len(data) - 5)
    spans, _ = _scatter(len(data), 0, device)
    reads = ShardReads([FileRead(f, len(data), spans)], direct=direct, skip_cached=False,
                       chunk_bytes=chunk, verify=chunk_checks(manifest)[1])  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"blob\.bin: checksum mismatch in bytes"):
        reads.wait(0)
    reads.close()


class _Later:
    """A GPU's copy-stream event, on the CPU: the copies it marks happen only when it is
    synchronized (or the stream is), reading their source buffer as it is then, as queued
    copies on a GPU run some time after they were sent."""

    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor]]):
        self.copies = copies

    def query(self) -> bool:
        return not self.copies

    def synchronize(self) -> None:
        for dst, src in self.copies:
            dst.copy_(src)
        self.copies = []


def test_staged_reads_wait_for_their_copies(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The staging ring's protocol with copies that finish late: a buffer is read into again
    only after its copies ran, and `wait` returns only once every copy has (each of which,
    skipped, leaves another chunk's bytes or nothing in the device arena). Many 16 KiB chunks
    over 3 threads, so buffers are reused; half the chunks partly to a host arena as well."""
    from runtime.shard_reader import StagingRing

    lock, sent = threading.Lock(), []

    def launch(self, copies):  # type: ignore[no-untyped-def]
        with lock:
            sent.append(_Later(copies))
            return sent[-1]

    def synchronize(self) -> None:  # type: ignore[no-untyped-def]
        with lock:
            for event in sent:
                event.synchronize()

    monkeypatch.setattr(StagingRing, "_launch", launch)
    monkeypatch.setattr(StagingRing, "synchronize", synchronize)
    data = random.Random(3).randbytes(1_000_003)
    files = [tmp_path / "a.bin", tmp_path / "b.bin"]  # the second: the first one's copy
    for f in files:
        f.write_bytes(data)
    device, host = DeviceArena(2 * len(data), "cpu"), Arena(len(data))
    half, n = 500_000, len(data) - 70_001  # each file: n bytes to the device, 70_001 to host
    jobs = [FileRead(files[0], len(data), [Span(0, half, device, 0),
                                           Span(half, half + 70_001, host, 0),
                                           Span(half + 70_001, len(data), device, half)]),
            FileRead(files[1], len(data), [Span(0, len(data), device, n)])]  # fmt: skip
    reads = ShardReads(jobs, threads=3, skip_cached=False, chunk_bytes=16 << 10)
    try:
        reads.wait(0)  # (the second file may still be reading)
        assert device.tensor()[:n].numpy().tobytes() == data[:half] + data[half + 70_001 :]
        assert bytes(host.view[:70_001]) == data[half : half + 70_001]
        reads.wait(1)
        assert device.tensor()[n : n + len(data)].numpy().tobytes() == data
        assert len(sent) > 2 * 60  # every chunk's copies went through the late events
    finally:
        reads.close()


@pytest.mark.parametrize("direct", [True, False])
def test_chunks_mostly_outside_the_spans_are_checked_too(tmp_path: Path, direct: bool) -> None:
    """A chunk whose bytes mostly land in the reader's scratch chunk (a rank's few rows of a
    large tensor, headers, bytes nobody asked for) is checked in its reading thread, the others
    on the checking threads: both kinds in one load, and a flipped byte in either is named."""
    f = tmp_path / "blob.bin"
    chunk = 4 << 20
    data = random.Random(2).randbytes(3 * chunk + 12_345)
    f.write_bytes(data)
    manifest = write_checked_manifest(tmp_path, [f], chunk)
    arena = Arena(len(data))
    # chunk 0 whole (in place); chunks 1 and 2 only a few KiB each (the rest: scratch); the tail
    spans = [Span(0, chunk, arena, 0), Span(chunk + 100, chunk + 9_000, arena, chunk + 100),
             Span(2 * chunk, 2 * chunk + ALIGN, arena, 2 * chunk),
             Span(3 * chunk, len(data), arena, 3 * chunk)]  # fmt: skip

    def load() -> ReadStats:
        stats = ReadStats()
        reads = ShardReads([FileRead(f, len(data), spans)], threads=2, direct=direct,
                           skip_cached=False, chunk_bytes=chunk,
                           verify=chunk_checks(manifest)[1], stats=stats)  # fmt: skip
        try:
            reads.wait(0)
        finally:
            reads.close()
        return stats

    assert load().verified == 4
    for s in spans:
        assert bytes(arena.view[s.offset : s.offset + s.end - s.begin]) == data[s.begin : s.end]
    for at, index in ((chunk + 2 * ALIGN + 7, 1), (100, 0)):  # outside any span; in place
        flip_byte(f, at)
        with pytest.raises(ModelLoadError, match=rf"blob\.bin: checksum mismatch in bytes "
                           rf"{index * chunk}\.\.{(index + 1) * chunk} "):  # fmt: skip
            load()
        flip_byte(f, at)  # back


def test_a_file_that_shrinks_while_read_is_named(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    save_file(_tensors(7), str(f))
    arena = Arena(f.stat().st_size)
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[: size // 2])  # the header said more (checked before)
    reads = ShardReads([FileRead(f, size, [Span(0, size, arena, 0)])], skip_cached=False)
    with pytest.raises(
        ModelLoadError, match=rf"m\.safetensors: truncated while reading \(\d+ of {size}"
    ):
        reads.wait(0)
    reads.close()


def test_drive_rate_is_measured_and_remembered_per_device(tmp_path: Path) -> None:
    from runtime import drive

    f = tmp_path / "blob.bin"
    f.write_bytes(random.Random(2).randbytes(3 << 20))
    assert drive.cached(tmp_path / "cache", f) is None
    assert "edgeinfer drive-rate" in drive.describe(tmp_path / "cache", f)
    rate = drive.measure(tmp_path)  # a folder: its largest files
    assert rate.bytes == 3 << 20 and rate.gb_per_s > 0 and rate.path == str(tmp_path)
    drive.remember(tmp_path / "cache", f, rate)
    assert drive.cached(tmp_path / "cache", tmp_path) == rate  # same device, same figure
    assert f"{rate.gb_per_s:.2f} GB/s" in drive.describe(tmp_path / "cache", f)


def _resident_pages(arena: Arena, start: int, end: int) -> int:
    return resident_pages(arena.addr + start, end - start)


def _vm_flags(arena: Arena) -> list[str]:
    return vm_flags(arena.addr)


def test_arena_commit_faults_pages_in_and_keeps_contents() -> None:
    arena = Arena(64 * ALIGN)
    assert _resident_pages(arena, 0, arena.nbytes) == 0  # committed only when touched
    arena.view[5 * ALIGN + 7] = 42
    arena.commit(4 * ALIGN, 20 * ALIGN)
    assert _resident_pages(arena, 0, 4 * ALIGN) == 0
    assert _resident_pages(arena, 4 * ALIGN, 20 * ALIGN) == 16
    assert _resident_pages(arena, 20 * ALIGN, arena.nbytes) == 0
    assert arena.view[5 * ALIGN + 7] == 42 and arena.view[6 * ALIGN] == 0
    arena.commit()
    assert _resident_pages(arena, 0, arena.nbytes) == 64


def test_arena_commit_without_populate_write_touches_every_page(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import ctypes
    import errno

    import runtime.shard_reader as sr

    class OldKernel:  # madvise(MADV_POPULATE_WRITE) is Linux 5.14+; older kernels say EINVAL
        def madvise(self, addr: int, length: int, advice: int) -> int:
            ctypes.set_errno(errno.EINVAL)
            return -1

    monkeypatch.setattr(sr, "_libc", OldKernel())
    arena = Arena(16 * ALIGN)
    arena.view[3 * ALIGN + 1] = 9
    assert arena.commit(ALIGN, 9 * ALIGN)
    assert _resident_pages(arena, ALIGN, 9 * ALIGN) == 8
    assert _resident_pages(arena, 9 * ALIGN, arena.nbytes) == 0
    assert arena.view[3 * ALIGN + 1] == 9
    # a caller that may be writing the range meanwhile asks for no rewriting: nothing is done
    assert not arena.commit(9 * ALIGN, 12 * ALIGN, rewrite=False)
    assert _resident_pages(arena, 9 * ALIGN, arena.nbytes) == 0


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                    reason="kernel without transparent huge pages")  # fmt: skip
def test_arenas_ask_for_huge_pages_unless_told_not_to(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    assert "hg" in _vm_flags(Arena(4 << 20, huge=True))  # madvise(MADV_HUGEPAGE)
    assert "hg" not in _vm_flags(Arena(4 << 20))  # weights: plain pages (see Arena)
    assert "hg" not in _vm_flags(Arena(64 << 10, huge=True))  # smaller than a huge page
    monkeypatch.setenv("EDGEINFER_HUGE_PAGES", "0")
    assert "hg" not in _vm_flags(Arena(4 << 20, huge=True))
