"""`edgeinfer up --region R`: a region the catalog lacks is refused before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.regions import RegionCatalog
from kvstore.redis_server import find_free_port
from tests.stack import ROOT


def test_up_refuses_a_region_the_catalog_lacks_before_starting_anything(
    tmp_path: Path, stories_dir: Path
) -> None:
    """Our gateway refuses a region its catalog lacks, but it was started last: `up` had started
    a Redis and a worker (a model load) first, then ended with the gateway's error among their
    output. Now `up` says so at once, naming the known regions, and starts nothing."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EDGEINFER_")}
    log = tmp_path / "up.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "up", "--model", str(stories_dir), "--threads", "1",
         "--region", "mars-north", "--port", str(find_free_port())],
        cwd=ROOT, env=clean | {"PYTHONUNBUFFERED": "1"}, stdout=log.open("wb"),
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`edgeinfer up --region mars-north` still runs after 60 s:\n{log.read_text()}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    out = log.read_text()
    known = ", ".join(sorted(RegionCatalog.load().regions))
    assert code == 2, out  # (a refusal: status 2, as argparse's)
    assert "--region 'mars-north' is not in the region catalog" in out, out
    assert f"(known: {known})" in out, out
    assert "started redis-server" not in out and "worker" not in out, out  # (nothing started)
