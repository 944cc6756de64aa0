"""The drive's own sequential read rate, measured once per device and remembered.

A worker's start-up timeline puts its weight read's GB/s beside the drive's. The drive's is
measured as `dd iflag=direct bs=8M` measures it: one thread, 8 MiB O_DIRECT reads in file order,
of the largest files in a folder on that drive (up to SAMPLE_BYTES), no page cache involved.
It is cached per device (st_dev) in a small JSON file, so that a worker never re-reads its
weights to measure: `edgeinfer drive-rate [PATH]` (re)measures it.

    <cache>/drive-rates.json     {"<st_dev>": {"gb_per_s": 1.31, "measured": "2026-11-22T18:00:00Z",
                                               "device": "vda", "path": "...", "bytes": 1073741824}}
"""

from __future__ import annotations

import json
import mmap
import os
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BLOCK = 8 << 20  # as dd bs=8M
SAMPLE_BYTES = 1 << 30  # enough for a steady figure; less if the folder holds less
CACHE_NAME = "drive-rates.json"


@dataclass(frozen=True, slots=True)
class DriveRate:
    gb_per_s: float  # sequential O_DIRECT read rate, 1e9 bytes per second
    measured: str  # when (UTC, ISO 8601)
    device: str  # the block device's name (from /sys), or major:minor
    path: str  # what was read
    bytes: int  # how much of it


def device_name(path: Path) -> str:
    """The block device a path lives on, as /sys names it (e.g. nvme0n1p2), else major:minor."""
    dev = path.stat().st_dev
    ident = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        return Path(f"/sys/dev/block/{ident}").resolve().name
    except OSError:
        return ident


def measure(path: Path, sample_bytes: int = SAMPLE_BYTES) -> DriveRate:
    """Read `path` (a file, or a folder's largest files) as dd iflag=direct bs=8M would; raises
    OSError when the filesystem refuses O_DIRECT or there is nothing to read."""
    path = Path(path)
    files = [path] if path.is_file() else _largest_files(path)
    if not files:
        raise OSError(f"{path}: no file to read")
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT wants
    view = memoryview(buf)
    done = 0
    t0 = time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        try:
            offset = 0
            while done < sample_bytes:
                n = os.preadv(fd, [view], offset)
                done += n
                offset += n
                if n < BLOCK:
                    break
        finally:
            os.close(fd)
        if done >= sample_bytes:
            break
    seconds = time.perf_counter() - t0
    view.release()
    buf.close()
    if done == 0 or seconds <= 0:
        raise OSError(f"{path}: nothing read")
    return DriveRate(
        gb_per_s=done / seconds / 1e9,
        measured=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        device=device_name(files[0]),
        path=str(path),
        bytes=done,
    )


def _largest_files(folder: Path) -> list[Path]:
    files = [f for f in folder.rglob("*") if f.is_file() and not f.is_symlink()]
    return sorted(files, key=lambda f: f.stat().st_size, reverse=True)


def remember(cache_dir: Path, path: Path, rate: DriveRate) -> Path:
    """Store `rate` as the figure of the device `path` is on (atomically: a temporary file
    renamed into place). Returns the cache file."""
    cache = Path(cache_dir) / CACHE_NAME
    rates = _load(cache)
    rates[str(Path(path).stat().st_dev)] = asdict(rate)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{CACHE_NAME}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rates, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, cache)
    return cache


def cached(cache_dir: Path, path: Path) -> DriveRate | None:
    """The remembered figure for the device `path` is on, or None."""
    try:
        raw = _load(Path(cache_dir) / CACHE_NAME).get(str(Path(path).stat().st_dev))
        rate = DriveRate(**raw) if isinstance(raw, dict) else None
    except (OSError, TypeError):
        return None
    # (a hand-edited or foreign file: a null rate failed a worker's start-up, in `describe`)
    if rate is None or not isinstance(rate.measured, str) or isinstance(rate.gb_per_s, bool):
        return None
    return rate if isinstance(rate.gb_per_s, int | float) else None


def describe(cache_dir: Path, path: Path) -> str:
    """The remembered figure for `path`'s drive in words (for a start-up timeline), or how to
    measure it."""
    rate = cached(cache_dir, path)
    if rate is None:
        return f"the drive's rate not measured yet: edgeinfer drive-rate {path}"
    return f"the drive {rate.gb_per_s:.2f} GB/s (dd-like O_DIRECT read, {rate.measured[:10]})"


def _load(cache: Path) -> dict[str, Any]:
    try:
        raw = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}
