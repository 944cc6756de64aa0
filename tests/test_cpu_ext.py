"""Where the CPU extensions are cached: a folder per CPU, since they are built with
`-march=native` (an AVX-512 build found by an AVX2 host would die with SIGILL)."""

from __future__ import annotations

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
