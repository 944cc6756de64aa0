"""The CPU extensions (`csrc/*.cpp`: paged decode attention, small matmuls, RMSNorm, RoPE with
the KV-cache write and SiLU-and-mul, the Huffman decoder), compiled on first use and cached.

Building needs a C++ compiler and ninja (a dependency of this package); it takes about a minute
once per machine and Python/torch version, and is reused from the cache afterwards. Where it
cannot be built, the loaders return None, say why once on the log, and the callers use the
PyTorch reference (same results, slower decode).

A build runs in a folder of its own, `<name>.<hash>.build`, named by a hash of what went into it
(the source, its headers, the flags, the torch and Python versions), and leaves a copy of the
module named by that hash, `<name>.<hash>.so`; the folder is removed once the copy is in place.
A later process whose hash names an existing copy imports it directly, without
`torch.utils.cpp_extension` (whose import, ~0.1 s with setuptools, and ninja check per extension
cost a fresh process ~0.4 s of its start-up); a changed source, flag or version names no copy
and goes through the build, from scratch: a folder shared by every source had ninja take a
changed source whose file is older than the last build's objects (copied with its times kept:
`cp -p`, rsync, an unpacked archive) for up to date, and the other source's module was cached
under the new hash for good.

Copies of several sources live side by side (a developer's tree and a CI clone, two branches,
an A/B copy sharing one cache), so that switching between them imports instead of rebuilding
(~1 minute): each import marks its copy used (its mtime), and a build removes all but the
`_KEEP` most recently used copies of its extension.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
_GEMM_SOURCE = Path(__file__).parent / "csrc" / "small_gemm_cpu.cpp"
_NORM_SOURCE = Path(__file__).parent / "csrc" / "rms_norm_cpu.cpp"
_HUFFMAN_SOURCE = Path(__file__).parent / "csrc" / "huffman_decode_cpu.cpp"
_FUSED_SOURCE = Path(__file__).parent / "csrc" / "fused_cpu.cpp"
# Reassociation lets the compiler vectorize the dot products; no finite-math (-inf is used).
_CFLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
)
_LDFLAGS = ("-fopenmp",)
# Builds kept per extension, by last use: the trees and branches one machine switches between.
_KEEP = 4
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def build_dir() -> Path:
    """Where the compiled extension is cached (TORCH_EXTENSIONS_DIR, as torch names it): a folder
    per Python and torch version and per CPU, as `-march=native` compiles for the instruction
    set of the CPU that builds (a cache shared by hosts of different CPUs, a home on NFS or a
    live-migrated VM, would otherwise hand an AVX-512 build to an AVX2 host: SIGILL)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "edgeinfer" / "torch_extensions"
    import torch

    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    return base / tag.replace("+", "_") / f"cpu-{cpu_fingerprint()}"


def cpu_fingerprint(cpuinfo: str | None = None) -> str:
    """A short hash of what `-march=native` reads of this CPU: its vendor, model name and feature
    flags, from the first processor of `cpuinfo` (default: /proc/cpuinfo's text; where there is
    none, the platform's processor string)."""
    if cpuinfo is None:
        cpuinfo = _proc_cpuinfo()
    lines: list[str] = []
    for line in cpuinfo.splitlines():
        if not line.strip():
            if lines:
                break  # the first processor's block: the others repeat it
            continue
        if line.split(":", 1)[0].strip() in ("vendor_id", "model name", "flags", "Features", "CPU part"):
            lines.append(" ".join(line.split()))
    if not lines:
        import platform

        lines = [platform.machine(), platform.processor()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def cpu_vendor() -> str:
    """The CPU's vendor_id (GenuineIntel, AuthenticAMD), or "" where /proc/cpuinfo has none."""
    for line in _proc_cpuinfo().splitlines():
        if line.split(":", 1)[0].strip() == "vendor_id":
            return line.split(":", 1)[1].strip()
    return ""


@functools.cache
def _proc_cpuinfo() -> str:
    """/proc/cpuinfo's text, read once a process (every extension's build folder names it)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def load() -> ModuleType | None:
    """The paged decode attention module, building it on first call; None where it cannot be built."""
    return _build("edgeinfer_paged_decode_cpu", _SOURCE, "CPU attention extension")


def load_small_gemm() -> ModuleType | None:
    """The small-batch matmul module (`csrc/small_gemm_cpu.cpp`); None where it cannot be built."""
    return _build("edgeinfer_small_gemm_cpu", _GEMM_SOURCE, "CPU small-matmul extension")


def load_rms_norm() -> ModuleType | None:
    """The fused RMSNorm module (`csrc/rms_norm_cpu.cpp`); None where it cannot be built."""
    return _build("edgeinfer_rms_norm_cpu", _NORM_SOURCE, "CPU RMSNorm extension")


def load_fused() -> ModuleType | None:
    """The fused per-layer steps (`csrc/fused_cpu.cpp`: RoPE with the KV-cache write, SiLU and
    mul); None where they cannot be built."""
    return _build("edgeinfer_fused_cpu", _FUSED_SOURCE, "CPU fused-ops extension")


def load_huffman() -> ModuleType | None:
    """The Huffman bfloat16 decoder (`csrc/huffman_decode_cpu.cpp`); None where it cannot be built."""
    return _build("edgeinfer_huffman_cpu", _HUFFMAN_SOURCE, "CPU Huffman decoder")


def huffman_if_built() -> ModuleType | None:
    """The Huffman extension if this process has it or a built copy is cached (imported, never
    compiled here): what needs it only to go faster (a decode table; encoding the weights a
    GPU keeps compressed) asks this, so that a GPU worker never waits on a compile for it."""
    name = "edgeinfer_huffman_cpu"
    with _lock:
        if name in _state:
            return _state[name]
        try:
            built = _built_path(name, _HUFFMAN_SOURCE)
        except OSError:
            return None
    return load_huffman() if built.is_file() else None


def _built_path(name: str, source: Path) -> Path:
    """Where the build of `source` as it is now (flags and versions included) is cached."""
    return build_dir() / name / f"{name}.{_build_key(name, source)}.so"


def _build(name: str, source: Path, what: str) -> ModuleType | None:
    with _lock:
        if name in _state:
            return _state[name]
        try:
            built = _built_path(name, source)
            mod = _import_cached(name, built)
            if mod is None:
                mod = _compile(name, source, what, built)
        except Exception as e:  # no compiler, no ninja, a read-only home: use the reference
            log.warning("%s unavailable (%s); using the PyTorch reference", what, e)
            mod = None
        _state[name] = mod
        return mod


def _build_key(name: str, source: Path) -> str:
    """A hash of everything the build depends on that can change under the cached module."""
    import torch

    h = hashlib.sha256()
    for part in (name, sys.version, torch.__version__, *_CFLAGS, "|", *_LDFLAGS, "|"):
        h.update(part.encode() + b"\0")
    h.update(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):  # what the sources #include "..."
        h.update(header.name.encode() + b"\0" + header.read_bytes())
    return h.hexdigest()[:16]


def _compile(name: str, source: Path, what: str, built: Path) -> ModuleType:
    """Build and import the module, keep its copy `built`, and prune the older builds.

    Builds of one extension take turns on an flock (released by the kernel when its holder
    dies), and only its holder prunes. torch's own baton, a `lock` file it creates and removes,
    outlives a build that was killed (Ctrl-C during the first `make run`, a test run timed out)
    and makes every later build of the folder wait on it forever; under our flock no other build
    is running, so a `lock` file found there is such a leftover and is removed."""
    path = built.parent
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "build.flock", "a+b") as turn:
        try:
            fcntl.flock(turn, fcntl.LOCK_EX)  # released on close, or when this process dies
        except OSError as e:  # ENOLCK: an NFS home without its lock service
            # Nothing is pruned: another host may be building in a folder it would remove.
            log.warning("cannot lock %s (%s): building under torch's lock file alone", turn.name, e)
            return _compile_locked(name, source, what, built)
        mod = _import_cached(name, built)  # another process built it while this one waited
        if mod is not None:
            return mod
        stale = _work_dir(built) / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        mod = _compile_locked(name, source, what, built)
        _prune(path, name)
        return mod


def _compile_locked(name: str, source: Path, what: str, built: Path) -> ModuleType:
    from torch.utils import cpp_extension

    work = _work_dir(built)
    work.mkdir(exist_ok=True)
    log.info("building the %s in %s (once per machine and source)", what, work)
    mod: ModuleType = cpp_extension.load(
        name=name,
        sources=[str(source)],
        # copies: cpp_extension adds to the lists it is given
        extra_cflags=list(_CFLAGS),
        extra_ldflags=list(_LDFLAGS),
        build_directory=str(work),
        verbose=False,
    )
    # Copied, then renamed into place: a process that sees the name sees the whole file.
    tmp = built.parent / f".{built.name}.{os.getpid()}.tmp"
    shutil.copyfile(work / f"{name}.so", tmp)
    os.replace(tmp, built)
    return mod


def _work_dir(built: Path) -> Path:
    """The folder torch builds the copy `built` in: one per hash, so that one source's objects
    are never taken for another's."""
    return built.with_name(built.name.removesuffix(".so") + ".build")


def _prune(path: Path, name: str) -> None:
    """Remove all but the `_KEEP` most recently used copies of extension `name` in `path`, and
    its build folders: the one just copied from, and any left by a killed or failed build (the
    caller holds the build flock, so none is in use). A process that has a removed copy loaded
    keeps its mapping; one about to import it finds it gone and builds it again."""
    copies: list[tuple[float, Path]] = []
    for copy in path.glob(f"{name}.*.so"):
        try:
            copies.append((copy.stat().st_mtime, copy))
        except FileNotFoundError:  # removed by hand meanwhile
            continue
    for _, old in sorted(copies, reverse=True)[_KEEP:]:
        try:
            old.unlink(missing_ok=True)
        except OSError as e:  # another user's file in a shared cache: the build is still good
            log.warning("cannot remove the old build %s (%s)", old, e)
    for work in path.glob(f"{name}.*.build"):
        shutil.rmtree(work, ignore_errors=True)


def _import_cached(name: str, built: Path) -> ModuleType | None:
    """Import the cached copy `built`, marking it used (its mtime, which pruning ranks by);
    None where there is none, or where a build of another source pruned it just now."""
    try:
        os.utime(built)
    except FileNotFoundError:
        return None
    except OSError:  # a cache this user may read but not write: imported all the same
        pass
    try:
        return _import(name, built)
    except ImportError:
        if built.exists():
            raise
        return None


def _import(name: str, built: Path) -> ModuleType:
    """Import the extension module `name` from the shared library `built` (torch is in)."""
    spec = importlib.util.spec_from_file_location(name, built)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {name} from {built}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
