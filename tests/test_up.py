"""`edgeinfer up` (what `make run` runs): the whole single-node stack starts, serves, and stops."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from kvstore.redis_server import find_free_port, find_free_ports
from tests.stack import ROOT, chat_model, get_json, wait_until


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("roles", [None, "prefill,decode"])
def test_up_serves_and_stops_cleanly(tmp_path: Path, stories_dir: Path, roles: str | None) -> None:
    model = chat_model(stories_dir, tmp_path / "stories-chat")
    port = find_free_port()  # the workers' ports, then their KV servers': 2 or 4 in a row
    # given with --roles; else up's default, a free run it finds
    worker_port = find_free_ports(4, avoid=frozenset({port})) if roles else None
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEINFER_")}
    log = tmp_path / "up.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "up", "--model", str(model), "--port", str(port),
         "--threads", "1", "--kv-cache-bytes", "4000000",
         *(["--roles", roles, "--worker-port", str(worker_port)] if roles else [])],
        cwd=ROOT, env=env | {"PYTHONUNBUFFERED": "1"}, stdout=log.open("wb"),
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while "edgeinfer is up" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        out = log.read_text()
        assert (
            f"http://127.0.0.1:{port}/v1" in out and "curl" in out and "started redis-server" in out
        )
        if worker_port is None:  # from the worker's line (it may follow up's by a moment)
            ready = r"ready: model .*, http://127\.0\.0\.1:(\d+),"
            wait_until(lambda: re.search(ready, log.read_text()), 10, "the worker's ready line")
            worker_port = int(re.search(ready, log.read_text()).group(1))  # type: ignore[union-attr]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(
            model="stories-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=8
        )
        assert r.choices[0].message.content
        if roles:  # a prompt long enough to be worth a transfer goes through the prefill worker
            wait_until(lambda: get_json(f"http://127.0.0.1:{port}/readyz")[1]["workers"] == 2,
                       30, "both workers registered")  # fmt: skip
            raw = client.chat.completions.with_raw_response.create(
                model="stories-chat", max_tokens=8,
                messages=[{"role": "user", "content": "Tell me a long story about a cat. " * 6}],
            )  # fmt: skip
            assert raw.headers.get("x-edgeinfer-prefill-worker"), out
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`edgeinfer up` did not stop within 90 s of SIGINT:\n{log.read_text()}")
        assert code == 0, log.read_text()
        assert (
            "stopped the gateway" in log.read_text() and "stopped redis-server" in log.read_text()
        )
    finally:
        if proc.poll() is None:  # take its children (redis, worker, gateway) down with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not _port_open(port) and not _port_open(worker_port)


def test_up_passes_every_engine_option_to_its_workers() -> None:
    # `up` accepts all of the worker's engine options: each one given must reach the workers.
    from runtime.cli import build_parser, engine_kwargs
    from runtime.launcher import _engine_flags

    given = ["--dtype", "float32", "--weight-dtype", "bfloat16", "--kv-cache-bytes", "5000000",
             "--kv-cache-fraction", "0.1", "--kv-cache-commit", "eager", "--kv-cache-dtype",
             "bfloat16", "--max-num-seqs", "7",
             "--max-num-batched-tokens", "99", "--max-model-len", "300", "--threads", "1",
             "--device", "cpu", "--no-cuda-graphs", "--speculative", "ngram",
             "--num-speculative-tokens", "3", "--spec-ngram", "2", "5", "--tp", "2",
             "--dist-port", "4567"]  # fmt: skip
    parser = build_parser()
    up = parser.parse_args(["up", *given])
    flags = _engine_flags(up)
    worker = parser.parse_args(["worker", "--region", "r", "--port", "1", *flags])
    assert engine_kwargs(worker) == engine_kwargs(up)
    assert engine_kwargs(up) != engine_kwargs(parser.parse_args(["up"]))
    assert _engine_flags(parser.parse_args(["up"])) == []  # defaults: the worker's own


def test_up_killed_outright_leaves_no_worker_or_gateway_serving(
    tmp_path: Path, stories_dir: Path
) -> None:
    """SIGKILL gives `up` no chance to stop its children: they watch its lifeline
    (runtime.lifeline), and the worker drains and the gateway stops by themselves; the
    redis-server it started gets the kernel's parent-death signal."""
    port = find_free_port()  # the worker's port, then its KV server's (a CI run once found
    worker_port = find_free_ports(2, avoid=frozenset({port}))  # the second taken: a failed up)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEINFER_")}
    log = tmp_path / "up.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "up", "--model", str(stories_dir), "--port",
         str(port), "--worker-port", str(worker_port), "--threads", "1", "--kv-cache-bytes",
         "4000000"],
        cwd=ROOT, env=env | {"PYTHONUNBUFFERED": "1"}, stdout=log.open("wb"),
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(lambda: "edgeinfer is up" in log.read_text(), 90, "the stack")
        found = re.search(r"started redis-server on redis://127\.0\.0\.1:(\d+)/", log.read_text())
        assert found, log.read_text()
        redis_port = int(found.group(1))
        assert _port_open(redis_port)
        proc.kill()
        proc.wait()
        wait_until(lambda: not _port_open(port) and not _port_open(worker_port), 30,
                   "the gateway and the worker to stop after `up` was killed")  # fmt: skip
        wait_until(lambda: not _port_open(redis_port), 10, "redis-server to stop")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # (redis-server, and whatever did not stop)
