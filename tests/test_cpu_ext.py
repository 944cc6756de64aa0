"""Where the CPU extensions are cached: a folder per CPU, since they are built with
`-march=native` (an AVX-512 build found by an AVX2 host would die with SIGILL)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kernels import cpu_ext

AVX512 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx avx2 fma avx512f avx512bw
cpu MHz\t\t: 2100.000

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx avx2 fma avx512f avx512bw
cpu MHz\t\t: 2300.000
"""


def test_fingerprint_names_the_instruction_set() -> None:
    avx2 = AVX512.replace(" avx512f avx512bw", "")
    amd = AVX512.replace("GenuineIntel", "AuthenticAMD")
    assert cpu_ext.cpu_fingerprint(AVX512) != cpu_ext.cpu_fingerprint(avx2)
    assert cpu_ext.cpu_fingerprint(AVX512) != cpu_ext.cpu_fingerprint(amd)
    # what changes while the machine runs (clock speed) or differs between its cores' blocks
    # does not rebuild anything
    calmer = AVX512.replace("2100.000", "800.000")
    one_core = AVX512.split("\n\n")[0]
    assert cpu_ext.cpu_fingerprint(calmer) == cpu_ext.cpu_fingerprint(AVX512)
    assert cpu_ext.cpu_fingerprint(one_core) == cpu_ext.cpu_fingerprint(AVX512)
    assert len(cpu_ext.cpu_fingerprint(AVX512)) == 12


def test_this_machine_has_a_fingerprint() -> None:
    # /proc/cpuinfo here: its flags are what is hashed, not the platform string (the fallback)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        pytest.skip("no /proc/cpuinfo here")
    if "flags" not in text:
        pytest.skip("this /proc/cpuinfo lists no flags")
    assert cpu_ext.cpu_fingerprint() == cpu_ext.cpu_fingerprint(text)
    assert cpu_ext.cpu_fingerprint() != cpu_ext.cpu_fingerprint("")  # no cpuinfo: the fallback


def test_build_folder_is_per_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_ext, "cpu_fingerprint", lambda: "aaaaaaaaaaaa")
    first = cpu_ext.build_dir()
    monkeypatch.setattr(cpu_ext, "cpu_fingerprint", lambda: "bbbbbbbbbbbb")
    second = cpu_ext.build_dir()
    assert first != second and first.parent == second.parent
    assert first.is_relative_to(tmp_path) and first.name == "cpu-aaaaaaaaaaaa"
    # a build cached by the first CPU is not where the second looks, so it compiles its own
    name = "edgeinfer_paged_decode_cpu"
    key = cpu_ext._build_key(name, cpu_ext._SOURCE)
    (first / name).mkdir(parents=True)
    (first / name / f"{name}.{key}.so").write_bytes(b"not for this CPU")
    assert not (second / name / f"{name}.{key}.so").exists()


def test_every_source_compiles_for_an_avx2_machine() -> None:
    """The extensions are built with -march=native, so this machine (AVX-512) compiles only its
    own branches of each kernel; the AVX2 and generic ones are what an AMD Zen or an older Xeon
    builds. Check that they compile (syntax and types only: ~15 s a file). A declaration read as
    a function (`std::vector<float> row(size_t(K))`) in the generic packed matmul kept the
    small-matmul extension from building on AVX2 machines for three days, unseen here. A pass
    is remembered beside the built extensions, keyed by the sources, flags, compiler and torch,
    so the compiles run again only when one of those changed."""
    import hashlib
    import shutil
    import subprocess
    import sysconfig
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from torch.utils.cpp_extension import include_paths

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (the extensions fall back to the references)")
    sources = sorted((Path(cpu_ext.__file__).parent / "csrc").glob("*.cpp"))
    assert len(sources) >= 5
    includes = [f"-isystem{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    flags = ["-std=c++20", "-fsyntax-only", "-fopenmp", "-march=x86-64-v3", "-w",
             "-DTORCH_EXTENSION_NAME=check", "-DTORCH_API_INCLUDE_EXTENSION_H"]  # fmt: skip

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join([*flags, version, torch.__version__]).encode()
        + b"".join(p.read_bytes() for p in sorted(sources[0].parent.iterdir()) if p.is_file())
    ).hexdigest()[:24]
    passed = cpu_ext.build_dir() / "avx2-syntax-check" / key
    if passed.exists():
        return

    def check(src: Path) -> tuple[Path, int, str]:
        done = subprocess.run([cxx, *flags, *includes, f"-I{src.parent}", str(src)],
                              capture_output=True, text=True)  # fmt: skip
        return src, done.returncode, done.stderr[-2000:]

    with ThreadPoolExecutor(max(1, min(len(sources), os.cpu_count() or 1))) as pool:
        failed = [(s.name, err) for s, rc, err in pool.map(check, sources) if rc != 0]
    assert not failed, failed
    passed.parent.mkdir(parents=True, exist_ok=True)
    passed.touch()


def test_a_killed_build_s_lock_file_does_not_block_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's baton (`lock`, created and removed by cpp_extension.load) is left behind by a
    build that was killed, and every later load of the folder would wait on it forever; under
    the build flock it is known stale and removed before the build."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = "edgeinfer_rms_norm_cpu"
    built = cpu_ext._built_path(name, cpu_ext._NORM_SOURCE)
    cpu_ext._work_dir(built).mkdir(parents=True)
    (cpu_ext._work_dir(built) / "lock").touch()  # what a build killed mid-compile leaves
    seen: list[bool] = []

    def compile_locked(name: str, source: Path, what: str, built: Path) -> object:
        seen.append((cpu_ext._work_dir(built) / "lock").exists())
        return "module"

    monkeypatch.setattr(cpu_ext, "_compile_locked", compile_locked)
    assert cpu_ext._compile(name, cpu_ext._NORM_SOURCE, "test", built) == "module"
    assert seen == [False]


def test_builds_of_one_folder_take_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that finds another building the same extension waits for it, then imports
    what it built instead of compiling again."""
    import fcntl
    import threading

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = "edgeinfer_rms_norm_cpu"
    built = cpu_ext._built_path(name, cpu_ext._NORM_SOURCE)
    built.parent.mkdir(parents=True)
    calls: list[str] = []

    def imported(name: str, path: Path) -> str:
        calls.append(f"imported {path.name}")
        return "module"

    monkeypatch.setattr(cpu_ext, "_compile_locked", lambda *a: calls.append("compiled"))
    monkeypatch.setattr(cpu_ext, "_import", imported)
    waiter = threading.Thread(target=cpu_ext._compile,
                              args=(name, cpu_ext._NORM_SOURCE, "test", built))  # fmt: skip
    with open(built.parent / "build.flock", "a+b") as holder:  # the other build, under way
        fcntl.flock(holder, fcntl.LOCK_EX)
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive() and calls == []  # waiting for its turn
        built.write_bytes(b"the other build's module")
    # the other build ended (its flock went with the file)
    waiter.join(10)
    assert not waiter.is_alive() and calls == [f"imported {built.name}"]


def test_a_home_without_flock_still_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flock refused (ENOLCK: an NFS home without its lock service): the build goes on under
    torch's own lock file, which it then must not take for a leftover."""
    import errno

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = "edgeinfer_rms_norm_cpu"
    built = cpu_ext._built_path(name, cpu_ext._NORM_SOURCE)
    cpu_ext._work_dir(built).mkdir(parents=True)
    (cpu_ext._work_dir(built) / "lock").touch()  # another host's build, under way

    def no_locks(fd: object, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(cpu_ext.fcntl, "flock", no_locks)
    monkeypatch.setattr(cpu_ext, "_compile_locked", lambda *a: "module")
    assert cpu_ext._compile(name, cpu_ext._NORM_SOURCE, "test", built) == "module"
    assert (cpu_ext._work_dir(built) / "lock").exists()


def _longest_stall(call: Callable[[], object]) -> tuple[float, float]:
    """(seconds `call` took, the longest a Python thread beside it went without running)."""
    import threading
    import time

    gaps: list[float] = []
    started, stop = threading.Event(), threading.Event()

    def spin() -> None:
        last = time.perf_counter()
        started.set()
        while not stop.is_set():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=spin)
    t.start()
    started.wait()
    t0 = time.perf_counter()
    call()
    took = time.perf_counter() - t0
    stop.set()
    t.join()
    return took, max(gaps)


@pytest.mark.parametrize("kernel", ["small_linear", "rms_norm", "silu_and_mul"])
def test_the_kernels_let_other_threads_run(kernel: str) -> None:
    """The C++ kernels release the interpreter lock while they compute, as torch's own ops do:
    held, a worker's event loop (its HTTP server, the streams it writes, its heartbeat) stood
    still for every call of a step (a thread beside a call stalled for all of it)."""
    import torch

    gemm, norm, fused = cpu_ext.load_small_gemm(), cpu_ext.load_rms_norm(), cpu_ext.load_fused()
    if gemm is None or norm is None or fused is None:
        pytest.skip("the extensions did not build here")
    x, weight = torch.randn(256, 4096), torch.randn(4096, 4096)
    big, w = torch.randn(8192, 8192), torch.ones(8192)  # (one call each, of 0.05-0.3 s here)
    calls: dict[str, Callable[[], object]] = {
        "small_linear": lambda: gemm.small_linear(x, weight, None),
        "rms_norm": lambda: norm.rms_norm(big, w, 1e-6),
        "silu_and_mul": lambda: fused.silu_and_mul(big),
    }
    for _ in range(3):  # (a scheduler's hiccup can stall the thread once: the longest of 3 tries)
        took, stall = _longest_stall(calls[kernel])
        if stall < took / 2:
            break
    assert stall < took / 2, (kernel, took, stall)
