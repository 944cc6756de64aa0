"""The CPU extensions' cache keeps a build per source: checkouts with different kernel sources
sharing one cache (a developer's tree and a CI clone, two branches) each import their own copy,
where each build deleted the others' and every switch rebuilt (~1 minute each). Real builds, of
a tiny module through the same code path (`cpu_ext._build`), in fresh processes as workers
starting from each checkout would be."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kernels import cpu_ext

ROOT = Path(__file__).resolve().parent.parent
NAME = "edgeinfer_cache_probe"
# Python's C API only: ~1 s to build, where torch's headers alone take most of a minute.
PROBE = """#include <Python.h>

static PyObject* value(PyObject*, PyObject*) { return PyLong_FromLong(VALUE); }
static PyMethodDef methods[] = {{"value", value, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, "edgeinfer_cache_probe", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_edgeinfer_cache_probe() { return PyModule_Create(&module); }
"""
LOAD = """
import json, sys
from pathlib import Path
from kernels import cpu_ext
mod = cpu_ext._build(sys.argv[1], Path(sys.argv[2]), "probe extension")
print(json.dumps({"value": None if mod is None else mod.value(),
                  "built": "torch.utils.cpp_extension" in sys.modules}))
"""


def _probe_source(folder: Path, value: int) -> Path:
    """A checkout's source of the probe module, whose value() says which source it was."""
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "probe.cpp"
    source.write_text(PROBE.replace("VALUE", str(value)))
    return source


def _load(cache: Path, source: Path) -> tuple[int, bool]:
    """Load the probe from `source` in a fresh process: (the value of the module it got, whether
    it went through torch's build; a cached copy is imported without it)."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", LOAD, NAME, str(source)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    if out["value"] is None:
        pytest.skip(f"the probe extension did not build here: {done.stderr[-1000:]}")
    return out["value"], out["built"]


def _cache_folder(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    return cpu_ext.build_dir() / NAME


def test_two_checkouts_keep_their_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    tree, clone = _probe_source(tmp_path / "tree", 1), _probe_source(tmp_path / "ci-clone", 2)
    assert _load(cache, tree) == (1, True)
    assert _load(cache, clone) == (2, True)
    # each switch imports the checkout's own copy: the other's build left it in place
    assert _load(cache, tree) == (1, False)
    assert _load(cache, clone) == (2, False)
    assert _load(cache, tree) == (1, False)
    folder = _cache_folder(cache, monkeypatch)
    copies = {p.name: p.stat().st_mtime for p in folder.glob(f"{NAME}.*.so")}
    tree_copy = cpu_ext._built_path(NAME, tree).name
    clone_copy = cpu_ext._built_path(NAME, clone).name
    assert copies.keys() == {tree_copy, clone_copy}
    # an import marks its copy used, which is what pruning ranks by
    assert copies[tree_copy] > copies[clone_copy]
    # the build folders went once their copies were in place
    assert not list(folder.glob("*.build"))


def test_a_changed_source_older_than_the_last_build_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source whose file is older than the last build's objects (copied with its times kept:
    `cp -p`, rsync -a, an unpacked archive) is still a changed source: in a build folder shared
    by every source, ninja took it for up to date and the old source's module was cached under
    the new source's hash, for good."""
    cache = tmp_path / "cache"
    source = _probe_source(tmp_path / "tree", 1)
    assert _load(cache, source) == (1, True)
    _probe_source(tmp_path / "tree", 2)
    os.utime(source, (1_577_836_800, 1_577_836_800))  # 2020-01-01
    assert _load(cache, source) == (2, True)
    assert _load(cache, source) == (2, False)


def test_pruning_keeps_the_most_recently_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "edgeinfer_rms_norm_cpu"
    copies = []
    for i in range(cpu_ext._KEEP + 2):  # made in this order, the last the newest
        copy = tmp_path / f"{name}.{i:016x}.so"
        copy.write_bytes(b"a build")
        os.utime(copy, (1e9 + i, 1e9 + i))
        copies.append(copy)
    monkeypatch.setattr(cpu_ext, "_import", lambda name, path: ModuleType(name))
    assert cpu_ext._import_cached(name, copies[0]) is not None  # the oldest, used just now
    killed = tmp_path / f"{name}.{99:016x}.build"  # left by a build that was killed
    killed.mkdir()
    (killed / "rms_norm_cpu.o").write_bytes(b"half an object")
    other = tmp_path / f"edgeinfer_fused_cpu.{0:016x}.so"  # another extension's: not counted
    other.write_bytes(b"a build")
    os.utime(other, (1, 1))

    cpu_ext._prune(tmp_path, name)
    kept = {copies[0], *copies[-(cpu_ext._KEEP - 1) :]}
    assert set(tmp_path.glob(f"{name}.*.so")) == kept
    assert not killed.exists() and other.exists()


def test_a_copy_pruned_before_its_import_is_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another checkout's build may prune a copy between this process finding it and importing
    it: the import then finds it gone and builds it (it got the PyTorch reference)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    source = _probe_source(tmp_path / "tree", 1)
    built = cpu_ext._built_path(NAME, source)
    built.parent.mkdir(parents=True)
    built.write_bytes(b"a build, about to be pruned")
    import_file = cpu_ext._import

    def pruned_meanwhile(name: str, path: Path) -> ModuleType:
        path.unlink()
        return import_file(name, path)

    monkeypatch.setattr(cpu_ext, "_import", pruned_meanwhile)
    monkeypatch.setattr(cpu_ext, "_compile", lambda *a: "built again")
    monkeypatch.setattr(cpu_ext, "_state", {})
    assert cpu_ext._build(NAME, source, "probe extension") == "built again"
