"""Read byte ranges of files straight into their final memory, in large aligned pieces.

    files, each with spans: [begin, end) of the file ─▶ (arena, offset)   (sorted, disjoint)
      ─▶ every file cut into chunk_bytes pieces from offset 0, queued in file order, file by file
         (a piece no span touches is not read: a rank of a split model reads its layers' part)
      ─▶ `threads` threads: one preadv per chunk (O_DIRECT unless the file is in the page cache
         or the filesystem refuses it), its iovec pointing straight at the spans' memory
      ─▶ the chunk's checksum checked on the same thread, right after its read
      ─▶ `wait(i)`: file i is in memory (later files keep reading meanwhile)

Memory on a GPU (a DeviceArena) is reached through host memory: a chunk with bytes for it is read
whole into one of a StagingRing's page-locked (pinned) buffers, checked there, and copied on with
asynchronous host-to-device copies on a copy stream of the ring's own, while the next chunks are
read into the other buffers; a buffer is read into again only once its copies have finished.

O_DIRECT wants offsets, lengths and buffers aligned (ALIGN covers every logical block size). A
span's aligned middle goes into place directly when its memory sits at the same offset modulo
ALIGN as its bytes in the file (the loader places its tensors so that it does); everything else
in the chunk (headers, padding, the unaligned ends of spans, bytes nobody asked for) lands in a
per-thread scratch chunk, from which the spans' remaining bytes are copied. A file read whole
into one arena is all middle: no copy at all.

No torch at import (`Arena.tensor` imports it, and errors import runtime.config, which does): a
worker can start reading its weights before torch has finished importing.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and lengths (>= any logical block size)
CHUNK_BYTES = 16 << 20  # one read (and one checksum, runtime.manifest.CHUNK_BYTES)
IOV_MAX = 1024  # buffers per preadv (Linux)
# Commit the arenas' pages ahead of the reads, on a thread of their own (commit_ahead); off:
# each read faults in the pages it fills, inside its syscall
COMMIT_AHEAD = os.environ.get("EDGEINFER_COMMIT_AHEAD", "1") != "0"
COMMIT_STEP = 2 << 20  # bytes a madvise call commits: a load's end stops the thread soon
CHECK_THREADS = 2  # threads hashing chunks against the manifest (xxh3-64: ~11 GB/s a thread)
SYNC_CHECK_BYTES = 1 << 20  # a chunk with more of its bytes in the scratch chunk is checked in
# its reading thread (copying them out would cost about what hashing them does)

# (file, chunk index, the chunk's bytes in file order): raises if they are not what they should be
Verify = Callable[[Path, int, Sequence[memoryview]], None]


def _round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64, and arm64 with 4 KB pages)
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, now (not in Python's mmap)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def release_pages(addr: int, nbytes: int) -> int:
    """Give back to the system the whole pages inside bytes [addr, addr + nbytes) of anonymous
    memory that nothing will read again (MADV_DONTNEED: they read as zero if touched later);
    the partial pages at either end are kept. Returns the bytes released (0 where madvise
    refused)."""
    start = -(-addr // ALIGN) * ALIGN
    end = (addr + nbytes) // ALIGN * ALIGN
    if end <= start:
        return 0
    return end - start if _libc.madvise(start, end - start, mmap.MADV_DONTNEED) == 0 else 0


def trim_heap() -> None:
    """Give the heap's free memory back to the system (glibc's malloc_trim), where there is one:
    memory freed stays in malloc's arenas, counted as the process's, until trimmed."""
    with contextlib.suppress(AttributeError):  # (not glibc)
        _libc.malloc_trim(0)


def huge_pages_wanted() -> bool:
    """Whether arenas ask for transparent huge pages (EDGEINFER_HUGE_PAGES=0 turns it off)."""
    return os.environ.get("EDGEINFER_HUGE_PAGES", "1") != "0"


class Arena:
    """Page-aligned anonymous memory: zero until written, pages committed only when touched
    (or when `commit` is called). Tensors are views of `tensor()`; the memory lives as long as
    any of them does.

    Private, not shared, memory: the kernel gives transparent huge pages only to private
    anonymous mappings. `huge` asks for them (madvise MADV_HUGEPAGE, honoured where
    /sys/kernel/mm/transparent_hugepage/enabled is `madvise` or `always`; arenas of 2 MB and more):
    a KV cache committed at start-up does, since a decode step reads blocks scattered over it and
    2 MB pages spare the TLB misses of 4 KB ones (a 64-request decode step of SmolLM2 153 -> 147 ms
    on the 2-core Xeon guest, 2026-11-23). Nothing that is first touched while a worker starts or
    serves does: in a microVM guest a fresh 2 MB page can cost the host far more than 512 fresh
    4 KB ones, and not the same each time. Weights on huge pages read 1.13x dd's rate in one
    run, then 0.67x in the next, and the worker's first token went from 1.33 s to 1.3-2.0 s
    (2026-11-25); a lazily committed KV cache on them delayed a first token by up to 0.3 s."""

    __slots__ = ("addr", "buf", "nbytes", "view")

    def __init__(self, nbytes: int, huge: bool = False):
        self.nbytes = _round_up(max(nbytes, 1))
        self.buf = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge and self.nbytes >= HUGE_PAGE and huge_pages_wanted():
            madv = getattr(mmap, "MADV_HUGEPAGE", None)
            if madv is not None:
                with contextlib.suppress(OSError):  # a kernel built without THP: plain pages
                    self.buf.madvise(madv)
        self.view = memoryview(self.buf)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))

    def commit(self, start: int = 0, end: int | None = None, *, rewrite: bool = True) -> bool:
        """Commit the pages of bytes [start, end) now rather than on first touch; their contents
        are kept. One madvise(MADV_POPULATE_WRITE) call, which runs without the GIL and may run
        while other threads write the range. On kernels before 5.14, `rewrite`: each page is read
        and written back instead (only while nothing else writes the range); else nothing is
        done. Whether the pages were committed."""
        end = self.nbytes if end is None else min(end, self.nbytes)
        start = start // ALIGN * ALIGN
        if end <= start:
            return True
        if _libc.madvise(self.addr + start, end - start, MADV_POPULATE_WRITE) == 0:
            return True
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, f"committing {end - start} bytes of memory: {os.strerror(err)}")
        if not rewrite:
            return False
        import numpy as np

        pages = np.frombuffer(self.buf, dtype=np.uint8)[start:end:ALIGN]
        np.bitwise_or(pages, 0, out=pages)  # a write (of what is there) per page faults it in
        return True

    def tensor(self) -> torch.Tensor:
        """The whole arena as a uint8 tensor sharing its memory."""
        import torch

        return torch.frombuffer(self.buf, dtype=torch.uint8)


class DeviceArena:
    """Memory on a torch device, for weights read straight onto a GPU: a 1-D uint8 tensor, that
    parameters are views of as of an Arena's. Reads reach it through a StagingRing (see the
    module docstring). On the CPU it is how the tests run the GPU's path."""

    __slots__ = ("_tensor", "device", "nbytes")

    def __init__(self, nbytes: int, device: str | torch.device):
        import torch

        self.nbytes = _round_up(max(nbytes, 1))
        self._tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.device = self._tensor.device

    def tensor(self) -> torch.Tensor:
        return self._tensor


@dataclass(slots=True)
class Span:
    """Bytes [begin, end) of a file go to arena memory [offset, offset + end - begin)."""

    begin: int
    end: int
    arena: Arena | DeviceArena
    offset: int


class _Staged:
    """One of a StagingRing's buffers (page-aligned host memory, `arena`), and the event that
    says when the last copies out of it are done (None: nothing pending)."""

    __slots__ = ("arena", "event", "host", "pinned")

    def __init__(self, nbytes: int, pin: bool):
        self.arena = Arena(nbytes)
        self.arena.commit()
        self.pinned = False
        if pin:  # page-locked for every device's context (cudaHostRegisterPortable), as torch's
            import torch  # own pin_memory helper does: the copies out of it run asynchronously

            err = int(torch.cuda.cudart().cudaHostRegister(self.arena.addr, nbytes, 1))
            if err:
                raise _load_error(f"cannot pin {nbytes} bytes of host memory to stage the "
                                  f"weights' reads for the GPU (CUDA error {err})")  # fmt: skip
            self.pinned = True
        self.host = self.arena.tensor()
        self.event: torch.cuda.Event | None = None


class StagingRing:
    """The host buffers, one chunk each, that reads land in on their way to a DeviceArena:
    page-locked for a CUDA device, so that the copies out of them run asynchronously on the
    ring's copy stream, beside the reads into the other buffers and the model's set-up on the
    default stream. At most `count` buffers, made as they are first needed (outside the lock: a
    reading thread does not wait for another's buffer to be made); a buffer is handed out again
    only once the copies out of it have finished."""

    def __init__(self, chunk_bytes: int, count: int, device: torch.device):
        import torch

        self.chunk_bytes, self.count = chunk_bytes, max(1, count)
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.stream is not None:  # the arenas were allocated on the default stream, perhaps
            self.stream.wait_stream(torch.cuda.current_stream(device))  # from memory it frees
        self._free: deque[_Staged] = deque()  # given back, oldest first
        self._made: list[_Staged] = []
        self._making = 0
        self._cv = threading.Condition()

    def take(self) -> _Staged:
        """A buffer to read into: a free one whose copies are done, else a new one while fewer
        than `count` are made, else the one given back first, once its copies are done."""
        with self._cv:
            while True:
                staged = next((b for b in self._free if b.event is None or b.event.query()), None)
                if staged is not None:
                    self._free.remove(staged)
                    break
                if len(self._made) + self._making < self.count:
                    self._making += 1
                    break
                if self._free:
                    staged = self._free.popleft()
                    break
                self._cv.wait()
        if staged is None:
            try:
                staged = _Staged(self.chunk_bytes, self.cuda)
            finally:
                with self._cv:
                    self._making -= 1
                    if staged is not None:
                        self._made.append(staged)
                    self._cv.notify()
        if staged.event is not None:
            staged.event.synchronize()
            staged.event = None
        return staged

    def give(self, staged: _Staged) -> None:
        with self._cv:
            self._free.append(staged)
            self._cv.notify()

    def send(self, staged: _Staged, c0: int, c1: int, spans: Sequence[Span]) -> int:
        """Copy the bytes of `spans` in the chunk [c0, c1) that `staged` holds to their places:
        a DeviceArena's asynchronously (runs that are contiguous in the file and in the arena as
        one copy), an Arena's at once. Returns the bytes copied."""
        runs: list[list] = []  # [arena, offset, file begin, file end]
        copied = 0
        for s in spans:
            x, y = max(s.begin, c0), min(s.end, c1)
            if x >= y:
                continue
            at = s.offset + x - s.begin
            copied += y - x
            if isinstance(s.arena, Arena):
                ctypes.memmove(s.arena.addr + at, staged.arena.addr + x - c0, y - x)
            elif runs and runs[-1][0] is s.arena and runs[-1][3] == x and (
                runs[-1][1] + runs[-1][3] - runs[-1][2] == at
            ):
                runs[-1][3] = y
            else:
                runs.append([s.arena, at, x, y])
        if runs:
            staged.event = self._launch([(arena.tensor()[at : at + y - x],
                                          staged.host[x - c0 : y - c0]) for arena, at, x, y in runs])  # fmt: skip
        return copied

    def _launch(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event | None:
        """Queue the copies (destination, source) on the copy stream; the event that marks their
        end (None off a GPU: done already)."""
        import torch

        if self.stream is None:
            for dst, src in copies:
                dst.copy_(src)
            return None
        with torch.cuda.stream(self.stream):
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def synchronize(self) -> None:
        """Wait for every copy sent so far."""
        if self.stream is not None:
            self.stream.synchronize()

    def close(self) -> None:
        """Once every copy is done, let the buffers go (unpinned: the load is over)."""
        try:
            self.synchronize()
        finally:
            with self._cv:
                made, self._made = self._made, []
                self._free.clear()  # (the memory goes with the last reference)
            pinned = [b for b in made if b.pinned]
            if pinned:
                import torch

                for b in pinned:
                    err = int(torch.cuda.cudart().cudaHostUnregister(b.arena.addr))
                    if err:  # (its pages stay locked until the process ends)
                        log.warning("unpinning a weights staging buffer: CUDA error %d", err)


@dataclass(slots=True)
class FileRead:
    """One file to read: its size (checked by the caller) and where its bytes go."""

    path: Path
    size: int
    spans: list[Span]  # sorted by begin, disjoint; bytes no span covers are read and dropped


@dataclass(slots=True)
class ReadStats:
    """What a load did, for the start-up timeline."""

    bytes: int = 0  # bytes read from the files
    seconds: float = 0.0  # wall time from the first read's start to the last one's end
    direct: int = 0  # files read with O_DIRECT
    buffered: int = 0  # files read through the page cache (cached already, or O_DIRECT refused)
    copied: int = 0  # tensors copied after the read (misaligned, converted, or not congruent)
    copied_bytes: int = 0  # bytes that went through the scratch chunk instead of into place
    verified: int = 0  # chunks checked against the manifest's checksums (of a compressed
    # folder: tensors checked against theirs)
    started: float = 0.0  # time.perf_counter() of the first read's start
    finished: float = 0.0  # ... and of the last read's end

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


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


def open_for_read(path: Path, size: int, direct: bool, skip_cached: bool) -> tuple[int, bool]:
    """A descriptor for reading `path` (of `size` bytes), and whether it is O_DIRECT: with
    `direct`, unless the filesystem refuses it or (`skip_cached`) the file is already in the page
    cache, which reads faster from there."""
    fd = os.open(path, os.O_RDONLY)
    if not direct or (skip_cached and _cached(fd, size)):
        return fd, False
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:  # tmpfs and some filesystems refuse O_DIRECT
        return fd, False
    os.close(fd)
    return dfd, True


def preadv_all(fd: int, pieces: list[memoryview], offset: int) -> int:
    """Fill `pieces` from `offset` on, however many calls that takes (a buffered read may come
    back short; O_DIRECT only at the end of the file). Returns the bytes read."""
    todo, total = list(pieces), 0
    while todo:
        n = os.preadv(fd, todo[:IOV_MAX], offset + total)
        if n == 0:
            break
        total += n
        while n and todo:
            if n >= len(todo[0]):
                n -= len(todo.pop(0))
            else:
                todo[0], n = todo[0][n:], 0
    return total


class _File:
    """A FileRead being read: its descriptor, how, and the chunks queued for it."""

    __slots__ = ("chunks", "direct", "fd", "job", "starts")

    def __init__(self, job: FileRead, fd: int, direct: bool):
        self.job, self.fd, self.direct = job, fd, direct
        self.starts = [s.begin for s in job.spans]
        self.chunks: list[Future[Future[None] | None]] = []  # each read, and its check


class ShardReads:
    """Reads `jobs` in the background, as the module docstring draws it, from construction on.

    `wait(i)` returns once file i is in place (raising what its read raised: a truncated file, a
    failed read, a checksum mismatch, each naming the file); `close()` stops what is left.
    Errors opening a file are raised by the constructor, before anything is read.
    """

    def __init__(self, jobs: list[FileRead], *, threads: int = 4, direct: bool = True,
                 skip_cached: bool = True, chunk_bytes: int = CHUNK_BYTES,
                 verify: Verify | None = None, stats: ReadStats | None = None):  # fmt: skip
        if chunk_bytes <= 0 or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes {chunk_bytes} is not a positive multiple of {ALIGN}")
        self.stats = stats if stats is not None else ReadStats()
        self.chunk_bytes, self.verify = chunk_bytes, verify
        self._lock = threading.Lock()
        self._local = threading.local()  # each thread's scratch chunk
        self._files: list[_File] = []
        self._waited = 0
        targets = list(dict.fromkeys(s.arena for job in jobs for s in job.spans))
        devices = {a.device for a in targets if isinstance(a, DeviceArena)}
        if len(devices) > 1:
            raise ValueError(f"one load reads onto one device, not {sorted(map(str, devices))}")
        # two buffers beyond the reading threads': copies in flight while every thread reads
        self._ring = StagingRing(chunk_bytes, threads + 2, devices.pop()) if devices else None
        try:
            for job in jobs:
                self._files.append(self._open(job, direct, skip_cached))
        except BaseException:
            self._close_files()
            raise
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="weights")
        # Checksums on threads of their own: a reading thread goes on to its next read at once,
        # so the drive's queue stays full while chunks are hashed (checked in the reading thread,
        # SmolLM2's 0.54 GB took 0.32 s against 0.275 s unchecked; dd 0.27 s).
        self._checks = (
            ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="weights-check")
            if verify is not None
            else None
        )
        # The destination memory committed ahead of the reads (commit_ahead): an O_DIRECT read
        # into fresh pages faults each in before its I/O is issued.
        self._stop_commit = threading.Event()
        arenas = [a for a in targets if isinstance(a, Arena)]
        self._committer: threading.Thread | None = None
        if COMMIT_AHEAD and arenas:
            self._committer = threading.Thread(target=commit_ahead, name="weights-commit",
                                               args=(arenas, self._stop_commit), daemon=True)  # fmt: skip
            self._committer.start()
        for i, f in enumerate(self._files):  # file order: the drive reads ahead sequentially
            for c0 in range(0, max(f.job.size, 1), chunk_bytes):
                if self._spans_in(f, c0):
                    f.chunks.append(self._pool.submit(self._read_chunk, i, c0))

    @staticmethod
    def _open(job: FileRead, direct: bool, skip_cached: bool) -> _File:
        try:
            fd, is_direct = open_for_read(job.path, job.size, direct, skip_cached)
        except OSError as e:
            raise _load_error(f"{job.path}: cannot read ({e})") from e
        return _File(job, fd, is_direct)

    def _scratch(self) -> Arena:
        scratch: Arena | None = getattr(self._local, "arena", None)
        if scratch is None:
            scratch = self._local.arena = Arena(self.chunk_bytes)
        return scratch

    def _spans_in(self, f: _File, c0: int) -> list[Span]:
        """The spans with bytes in the chunk at c0."""
        c1 = min(c0 + self.chunk_bytes, _round_up(f.job.size))
        lo = max(0, bisect.bisect_right(f.starts, c0) - 1)
        hi = bisect.bisect_left(f.starts, c1)
        return [s for s in f.job.spans[lo:hi] if s.end > c0]

    def _read_chunk(self, index: int, c0: int) -> Future[None] | None:
        f = self._files[index]
        c1 = min(c0 + self.chunk_bytes, _round_up(f.job.size))
        mine = self._spans_in(f, c0)
        if self._ring is not None and any(isinstance(s.arena, DeviceArena) for s in mine):
            self._read_staged(self._ring, f, c0, c1, mine)
            return None
        host = [(s, s.arena) for s in mine if isinstance(s.arena, Arena)]  # (all of them)
        scratch = self._scratch()
        pieces: list[memoryview] = []
        placed: list[tuple[Span, int, int]] = []  # (span, a, b): file bytes [a, b) read in place
        cursor = c0
        for s, arena in host:
            a, b = _round_up(max(s.begin, c0)), min(s.end, c1) // ALIGN * ALIGN
            dest = s.offset + a - s.begin
            if a < b and (arena.addr + dest) % ALIGN == 0:
                if cursor < a:
                    pieces.append(scratch.view[cursor - c0 : a - c0])
                pieces.append(arena.view[dest : dest + b - a])
                placed.append((s, a, b))
                cursor = b
        if cursor < c1:
            pieces.append(scratch.view[cursor - c0 : c1 - c0])
        want, t0, t1 = self._read(f, pieces, c0, c1)
        check: Future[None] | None = None
        if self._checks is not None:  # (there is a manifest to check against)
            data = _first(pieces, want)
            # The scratch chunk is this thread's next read's: its part of the bytes is copied
            # for the check (a few KiB at tensor boundaries), or checked here when it is large.
            if sum(len(p) for p in data if p.obj is scratch.buf) > SYNC_CHECK_BYTES:
                self._check(f.job.path, c0 // self.chunk_bytes, data)
            else:
                data = [memoryview(bytes(p)) if p.obj is scratch.buf else p for p in data]
                check = self._checks.submit(self._check, f.job.path, c0 // self.chunk_bytes, data)
        direct = {id(s): (a, b) for s, a, b in placed}
        copied = 0
        for s, arena in host:  # what did not go in place comes from the scratch chunk
            x, y = max(s.begin, c0), min(s.end, c1)
            a, b = direct.get(id(s), (y, y))
            for u, v in ((x, a), (b, y)):
                if u < v:
                    ctypes.memmove(arena.addr + s.offset + u - s.begin,
                                   scratch.addr + u - c0, v - u)  # fmt: skip
                    copied += v - u
        self._account(want, copied, t0, t1)
        return check

    def _read(self, f: _File, pieces: list[memoryview], c0: int,
              c1: int) -> tuple[int, float, float]:  # fmt: skip
        """Read the chunk [c0, c1) of `f` into `pieces`: the bytes of the file it holds, and when
        the read began and ended (a failed or short read raised, naming the file)."""
        t0 = time.perf_counter()
        try:
            got = preadv_all(f.fd, pieces, c0)
        except OSError as e:
            raise _load_error(f"{f.job.path}: cannot read ({e})") from e
        t1 = time.perf_counter()
        size = f.job.size
        want = min(c1, size) - c0
        if got < want:
            raise _load_error(f"{f.job.path}: truncated while reading ({c0 + got} of {size} bytes)")
        return want, t0, t1

    def _account(self, nbytes: int, copied: int, t0: float, t1: float) -> None:
        with self._lock:
            st = self.stats
            st.bytes += nbytes
            st.copied_bytes += copied
            st.started = min(st.started, t0) if st.started else t0
            st.finished = max(st.finished, t1)

    def _read_staged(self, ring: StagingRing, f: _File, c0: int, c1: int,
                     mine: list[Span]) -> None:  # fmt: skip
        """A chunk with bytes for a device: into a staging buffer, on with the ring's copies,
        checked in this thread while they run (the buffer is read into again after both)."""
        staged = ring.take()
        try:
            want, t0, t1 = self._read(f, [staged.arena.view[: c1 - c0]], c0, c1)
            copied = ring.send(staged, c0, c1, mine)
            if self.verify is not None:
                self._check(f.job.path, c0 // self.chunk_bytes, [staged.arena.view[:want]])
        finally:
            ring.give(staged)
        self._account(want, copied, t0, t1)

    def _check(self, path: Path, index: int, data: Sequence[memoryview]) -> None:
        assert self.verify is not None
        self.verify(path, index, data)
        with self._lock:
            self.stats.verified += 1

    def wait(self, i: int) -> None:
        """Block until file i is in place (and checked); raise its read's error, if any."""
        f = self._files[i]
        for chunk in f.chunks:
            check = chunk.result()
            if check is not None:
                check.result()
        if self._ring is not None:  # the copies onto the device, too
            self._ring.synchronize()
        if f.fd < 0:  # waited for before
            return
        os.close(f.fd)
        f.fd = -1
        st = self.stats
        st.seconds = st.finished - st.started
        if f.direct:
            st.direct += 1
        else:
            st.buffered += 1
        self._waited += 1
        if self._waited == len(self._files):
            self._pool.shutdown()  # the threads and their scratch chunks go
            if self._checks is not None:
                self._checks.shutdown()
            if self._ring is not None:
                self._ring.close()

    def close(self) -> None:
        """Stop: queued chunks are dropped, running ones finish; every file is closed, and the
        spans (and through them the memory they point into) are let go."""
        self._stop_commit.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._committer is not None:
            self._committer.join()
            self._committer = None
        if self._checks is not None:  # (no check reads the memory once this returns)
            self._checks.shutdown(wait=True, cancel_futures=True)
        try:
            if self._ring is not None:  # nor a copy
                self._ring.close()
        finally:
            self._close_files()
        self._files = []

    def _close_files(self) -> None:
        for f in self._files:
            if f.fd >= 0:
                os.close(f.fd)
                f.fd = -1


def commit_ahead(arenas: Sequence[Arena], stop: threading.Event) -> None:
    """Commit `arenas`' memory, in order, ahead of what fills it (on a thread of its own, from
    the start of a load). A fresh page costs a fault when it is first written (~1 us a 4 KiB
    page on the 2-core Xeon guest: 0.07 s of CPU for SmolLM2's 270 MB); committed here, much of
    it is done while the first reads are still on the drive. Whatever fills a page first faults
    it in (the kernel serialises the two on each page). Nothing is done on kernels before 5.14
    (no MADV_POPULATE_WRITE), or if committing fails. Not on huge pages: in microVM guests a
    fresh 2 MiB page sometimes costs the host tenths of a second (see Arena)."""
    try:
        for arena in arenas:
            for at in range(0, arena.nbytes, COMMIT_STEP):
                if stop.is_set() or not arena.commit(at, at + COMMIT_STEP, rewrite=False):
                    return
    except OSError:  # e.g. out of memory now: the reads fault the pages in, or say so
        return


def _load_error(message: str) -> Exception:
    from runtime.config import ModelLoadError  # imports torch: only once something went wrong

    return ModelLoadError(message)


def _first(pieces: list[memoryview], n: int) -> list[memoryview]:
    """The first n bytes of `pieces`, as pieces (the end of a file's last chunk is not data)."""
    out = []
    for p in pieces:
        if n <= 0:
            break
        out.append(p[:n])
        n -= len(out[-1])
    return out
