"""Read safetensors checkpoints at drive speed: headers first, then large aligned reads.

    parse every shard's header ─▶ validate (sizes, offsets, file length) ─▶ one aligned arena
    per shard ─▶ read it in CHUNK_BYTES pieces on `threads` threads (O_DIRECT, bypassing the page
    cache, unless the file is already cached there or the filesystem refuses O_DIRECT) ─▶
    tensors are views into the arena (no per-tensor copy after the read)

A tensor whose byte offset in its shard is not a multiple of its element size (possible with
mixed dtypes) cannot be a view of a 4096-aligned arena: it alone is copied out. Everything that
can be wrong with a file (a header that lies about sizes, a truncated file, an unknown dtype) is
an error naming the file and what was expected, raised before any weight is read.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.config import ModelLoadError

ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and lengths (the logical block size)
CHUNK_BYTES = 16 << 20  # one read
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


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


@dataclass(slots=True)
class ReadStats:
    """What a load did, for the start-up timeline."""

    bytes: int = 0  # bytes read from the files
    seconds: float = 0.0  # wall time of the reads
    direct: int = 0  # files read with O_DIRECT
    buffered: int = 0  # files read through the page cache (cached already, or O_DIRECT refused)
    copied: int = 0  # tensors copied out of the arena (misaligned for their dtype)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


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
            raw = json.loads(f.read(n))
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: corrupt safetensors file (header is not JSON: {e})") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors file (header is not an object)")
    shard = Shard(path, size, 8 + n)
    data_len = 0
    for name, info in raw.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(
                f"{path}: corrupt safetensors file (tensor {name!r}: {e!r})"
            ) from e
        numel = 1
        for d in shape:
            numel *= d
        want = numel * torch.empty((), dtype=dtype).element_size()
        if begin < 0 or end - begin != want:
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
    shard.tensors.sort(key=lambda t: t.begin)  # file order
    return shard


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to drop a file's pages from the page cache (so that the next read goes to
    the drive: cold-start benchmarks and tests). Advisory: pages in use may stay."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cached(fd: int, size: int) -> bool:
    """Whether the file's pages are in the page cache (a few probes, none of which waits)."""
    buf = bytearray(1)
    for offset in (0, size // 2, max(0, size - 1)):
        try:
            if os.preadv(fd, [buf], offset, os.RWF_NOWAIT) < 1:
                return False
        except BlockingIOError:
            return False
        except OSError:  # RWF_NOWAIT unsupported here: assume not cached
            return False
    return True


def _aligned_arena(nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """A uint8 tensor of `nbytes` (rounded up to ALIGN) whose first byte is ALIGN-aligned, and a
    writable view of it. (An anonymous mmap is page-aligned; torch shares its memory.)"""
    size = -(-nbytes // ALIGN) * ALIGN
    buf = mmap.mmap(-1, max(size, ALIGN))
    arena = torch.frombuffer(buf, dtype=torch.uint8)
    return arena, memoryview(buf)


def _read_file(shard: Shard, direct: bool, skip_cached: bool, pool: ThreadPoolExecutor,
               stats: ReadStats) -> torch.Tensor:  # fmt: skip
    arena, view = _aligned_arena(shard.size)
    fd = os.open(shard.path, os.O_RDONLY)
    use_direct = False
    try:
        if direct and not (skip_cached and _cached(fd, shard.size)):
            try:
                dfd = os.open(shard.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:  # tmpfs and some filesystems refuse O_DIRECT
                dfd = -1
            if dfd >= 0:
                os.close(fd)
                fd, use_direct = dfd, True

        def read(offset: int) -> int:
            length = min(CHUNK_BYTES, len(view) - offset)
            got = 0
            while got < length:  # a buffered read may come back short; O_DIRECT only at EOF
                n = os.preadv(fd, [view[offset + got : offset + length]], offset + got)
                if n == 0:
                    break
                got += n
            return got

        total = sum(pool.map(read, range(0, len(view), CHUNK_BYTES)))
    except OSError as e:
        raise ModelLoadError(f"{shard.path}: cannot read ({e})") from e
    finally:
        os.close(fd)
    if total < shard.size:
        raise ModelLoadError(
            f"{shard.path}: truncated while reading ({total} of {shard.size} bytes)"
        )
    stats.bytes += shard.size
    if use_direct:
        stats.direct += 1
    else:
        stats.buffered += 1
    return arena


def load_safetensors(files: list[Path], threads: int = 4, direct: bool = True,
                     stats: ReadStats | None = None,
                     skip_cached: bool = True) -> Iterator[tuple[str, str, torch.Tensor]]:  # fmt: skip
    """(file, tensor name, tensor) for every tensor of `files`: headers checked first, then each
    file read whole into an aligned arena, its tensors views of it (file by file, in file
    order). `direct`: use O_DIRECT where the filesystem allows it, except (`skip_cached`) for a
    file already in the page cache, which reads faster from there."""
    stats = stats if stats is not None else ReadStats()
    shards = [read_header(Path(f)) for f in files]  # every header before any weight
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="weights") as pool:
        for shard in shards:
            t0 = time.perf_counter()
            arena = _read_file(shard, direct, skip_cached, pool, stats)
            stats.seconds += time.perf_counter() - t0
            for t in shard.tensors:
                size = torch.empty((), dtype=t.dtype).element_size()
                raw = arena[t.begin : t.end]
                if t.begin % size:  # not a valid view for this dtype: copy this one out
                    raw = raw.clone()
                    stats.copied += 1
                yield str(shard.path), t.name, raw.view(t.dtype).view(t.shape)
