"""Read safetensors checkpoints at drive speed: headers first, then large aligned reads.

    parse every shard's header ─▶ validate (sizes, offsets, overlaps, file length) ─▶ one
    aligned arena per shard ─▶ runtime.shard_reader reads every shard into its arena, in
    CHUNK_BYTES pieces on `threads` threads (O_DIRECT unless cached or refused), checking each
    piece against the manifest when there is one ─▶ tensors are views into the arena

A tensor whose byte offset in its shard is not a multiple of its element size (possible with
mixed dtypes) cannot be a view of a 4096-aligned arena: it alone is copied out. Everything that
can be wrong with a file (a header that lies about sizes, a truncated file, an unknown dtype) is
an error naming the file and what was expected, raised before any weight is read.

The model loader (runtime/loader.py) uses the same headers and reader, but with its own
destinations: each tensor's bytes go straight into the model's parameters.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from runtime.config import ModelLoadError
from runtime.manifest import Manifest, verify_chunk
from runtime.shard_reader import (
    ALIGN,
    CHUNK_BYTES,
    Arena,
    DeviceArena,
    FileRead,
    ReadStats,
    ShardReads,
    Span,
    Verify,
    drop_page_cache,
)

__all__ = [  # ALIGN, CHUNK_BYTES, ReadStats and drop_page_cache live in runtime.shard_reader
    "ALIGN",
    "CHUNK_BYTES",
    "ReadStats",
    "Shard",
    "TensorEntry",
    "chunk_checks",
    "drop_page_cache",
    "load_safetensors",
    "read_header",
]

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
# safetensors dtypes the loader has no use for (FP8 and smaller floats, unsigned ints, complex)
_FILE_DTYPES = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "U16", "U32", "U64",
                "C64"}  # fmt: skip


@dataclass(slots=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offset in the file
    end: int


@dataclass(slots=True)
class Shard:
    """One safetensors file as its header describes it."""

    path: Path
    size: int  # bytes on disk
    data_start: int  # 8 + header length
    tensors: list[TensorEntry] = field(default_factory=list)


def naturals(key: str, value: object, count: int | None = None) -> tuple[int, ...]:
    """A header's list of integers >= 0 (a shape, data offsets); ValueError saying what is
    wrong (a float, a bool, a negative number, another count) otherwise."""
    if (
        not isinstance(value, list)
        or (count is not None and len(value) != count)
        or not all(type(v) is int and 0 <= v < 1 << 63 for v in value)  # (torch's int64)
    ):
        want = f"{count} " if count is not None else ""
        raise ValueError(
            f"{key} must be a list of {want}integers >= 0 (below 2**63), got {str(value)[:80]}"
        )
    return tuple(value)


def _tensor_entry(
    path: Path, name: str, info: object
) -> tuple[torch.dtype, tuple[int, ...], tuple[int, int]]:
    """A header entry's dtype, shape and data offsets, each checked for what it must be."""

    def corrupt(what: str) -> ModelLoadError:
        return ModelLoadError(f"{path}: corrupt safetensors file (tensor {name[:200]!r}: {what})")

    if not isinstance(info, dict):
        raise corrupt(f"an object with dtype, shape and data_offsets, got {str(info)[:80]}")
    code = info.get("dtype")
    if not isinstance(code, str) or code not in _DTYPES:
        if isinstance(code, str) and code in _FILE_DTYPES:
            raise ModelLoadError(
                f"{path}: tensor {name[:200]!r} is {code}, a dtype edgeinfer cannot load "
                f"(it loads {', '.join(_DTYPES)})"
            )
        raise corrupt(f"no dtype {str(code)[:40]} in safetensors")
    try:
        shape = naturals("shape", info.get("shape"))
        begin, end = naturals("data_offsets", info.get("data_offsets"), 2)
    except ValueError as e:
        raise corrupt(str(e)) from e
    if begin > end:
        raise corrupt(f"data_offsets {[begin, end]} end before they begin")
    return _DTYPES[code], shape, (begin, end)


def read_header(path: Path) -> Shard:
    """Parse and check a safetensors header without reading the weights."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{path}: corrupt safetensors file ({size} bytes, no header)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise ModelLoadError(
                    f"{path}: corrupt safetensors file (header of {n} bytes in a file of {size})"
                )
            text = f.read(n)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from e
    try:  # (apart from the reads: a ModelLoadError is a ValueError, not to be called "not JSON")
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:  # (not JSON, not UTF-8, a 5,000-digit number,
        # nesting deep enough to exhaust the parser's stack)
        raise ModelLoadError(f"{path}: corrupt safetensors file (header is not JSON: {e})") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors file (header is not an object)")
    shard = Shard(path, size, 8 + n)
    data_len = 0
    for name, info in raw.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = _tensor_entry(path, name, info)
        numel = 1
        for d in shape:
            numel *= d
        want = numel * dtype.itemsize
        if end - begin != want:
            raise ModelLoadError(
                f"{path}: corrupt safetensors file (tensor {name!r} of shape {shape} and dtype "
                f"{info['dtype']} needs {want} bytes, its offsets give {end - begin})"
            )
        shard.tensors.append(TensorEntry(name, dtype, shape, shard.data_start + begin,
                                         shard.data_start + end))  # fmt: skip
        data_len = max(data_len, end)
    if shard.data_start + data_len > size:
        raise ModelLoadError(
            f"{path}: truncated: its header needs {shard.data_start + data_len} bytes, "
            f"the file has {size}"
        )
    shard.tensors.sort(key=lambda t: (t.begin, t.end))  # file order
    for prev, t in zip(shard.tensors, shard.tensors[1:], strict=False):
        if t.begin < prev.end:
            raise ModelLoadError(
                f"{path}: corrupt safetensors file (tensors {prev.name!r} and {t.name!r} "
                f"overlap at bytes {t.begin - shard.data_start}..{prev.end - shard.data_start})"
            )
    return shard


def chunk_checks(manifest: Manifest | None) -> tuple[int, Verify | None]:
    """The read size and the check a reading thread runs on each chunk right after reading it:
    its xxh3-64 against the manifest's (a ModelLoadError naming the shard and the byte range
    when they differ). No manifest: CHUNK_BYTES reads, nothing to check.

    A chunk read straight into several tensors arrives as several pieces: they are hashed in
    file order as one stream, which gives the same digest as the chunk's bytes in one piece."""
    if manifest is None:
        return CHUNK_BYTES, None

    def verify(path: Path, index: int, pieces: Sequence[memoryview]) -> None:
        if len(pieces) == 1:
            verify_chunk(manifest, path, index, pieces[0])
            return
        entry = manifest.shard(path.name)
        if entry is None:
            return
        h = xxhash.xxh3_64()
        for piece in pieces:
            h.update(piece)
        if h.hexdigest() != entry.xxh3_64[index]:  # let verify_chunk word the error
            verify_chunk(manifest, path, index, b"".join(pieces))

    return manifest.chunk_bytes, verify


def load_safetensors(files: list[Path], threads: int = 4, direct: bool = True,
                     stats: ReadStats | None = None, skip_cached: bool = True,
                     manifest: Manifest | None = None, device: str | torch.device = "cpu"
                     ) -> Iterator[tuple[str, str, torch.Tensor]]:  # fmt: skip
    """(file, tensor name, tensor) for every tensor of `files`: headers checked first, then each
    file read whole into an aligned arena, its tensors views of it (file by file, in file order,
    later files reading while earlier ones are consumed). `direct`: use O_DIRECT where the
    filesystem allows it, except (`skip_cached`) for a file already in the page cache, which
    reads faster from there. `manifest`: check every chunk against its checksums. `device`: a
    GPU's arenas are filled through pinned staging buffers (runtime.shard_reader.StagingRing)."""
    stats = stats if stats is not None else ReadStats()
    shards = [read_header(Path(f)) for f in files]  # every header before any weight
    arenas: list[Arena | DeviceArena] = (
        [Arena(shard.size) for shard in shards]
        if torch.device(device).type == "cpu"
        else [DeviceArena(shard.size, device) for shard in shards]
    )
    # Each span is its arena's whole (aligned) length, so the file's last partial block is read
    # in place too (the reader stops at the end of the file).
    jobs = [FileRead(s.path, s.size, [Span(0, arenas[i].nbytes, arenas[i], 0)])
            for i, s in enumerate(shards)]  # fmt: skip
    chunk_bytes, verify = chunk_checks(manifest)
    reads = ShardReads(jobs, threads=threads, direct=direct, skip_cached=skip_cached,
                       chunk_bytes=chunk_bytes, verify=verify, stats=stats)  # fmt: skip
    try:
        for i, (shard, arena) in enumerate(zip(shards, arenas, strict=True)):
            reads.wait(i)
            whole = arena.tensor()
            for t in shard.tensors:
                raw = whole[t.begin : t.end]
                if t.begin % t.dtype.itemsize:  # not a valid view for this dtype: copy this one
                    raw = raw.clone()
                    stats.copied += 1
                yield str(shard.path), t.name, raw.view(t.dtype).view(t.shape)
    finally:
        reads.close()
