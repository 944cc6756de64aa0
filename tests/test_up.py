"""`edgeinfer up` (what `make run` runs): the whole single-node stack starts, serves, and stops."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest

from kvstore.redis_server import find_free_port, find_free_ports
from tests.stack import ROOT, SECRET, chat_model, get_json, wait_until


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _up(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`edgeinfer up ARGS` with no EDGEINFER_* setting but `env`, its output in tmp_path/up.log,
    in a session of its own (as a terminal's foreground job: os.killpg is a Ctrl-C)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EDGEINFER_")}
    return subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "up", *args],
        cwd=ROOT, env=clean | {"PYTHONUNBUFFERED": "1"} | (env or {}),
        stdout=(tmp_path / "up.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """`up` killed outright, if it still runs: its children stop by themselves (its lifeline, the
    kernel's parent-death signal; test_up_killed_outright_leaves_no_worker_or_gateway_serving)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _process_group(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])


@pytest.mark.parametrize("roles", [None, "prefill,decode"])
def test_up_serves_and_stops_cleanly(tmp_path: Path, stories_dir: Path, roles: str | None) -> None:
    model = chat_model(stories_dir, tmp_path / "stories-chat")
    port = find_free_port()  # the workers' ports, then their KV servers': 2 or 4 in a row
    # given with --roles; else up's default, a free run it finds
    worker_port = find_free_ports(4, avoid=frozenset({port})) if roles else None
    log = tmp_path / "up.log"
    proc = _up(tmp_path, "--model", str(model), "--port", str(port), "--threads", "1",
               "--kv-cache-bytes", "4000000",
               *(["--roles", roles, "--worker-port", str(worker_port)] if roles else []))  # fmt: skip
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
        _kill(proc)
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
    log = tmp_path / "up.log"
    proc = _up(tmp_path, "--model", str(stories_dir), "--port", str(port), "--worker-port",
               str(worker_port), "--threads", "1", "--kv-cache-bytes", "4000000")  # fmt: skip
    children: list[int] = []
    try:
        wait_until(lambda: "edgeinfer is up" in log.read_text(), 90, "the stack")
        found = re.search(r"started redis-server on redis://127\.0\.0\.1:(\d+)/", log.read_text())
        assert found, log.read_text()
        redis_port = int(found.group(1))
        assert _port_open(redis_port)
        children = _children(proc.pid)  # (in sessions of their own)
        proc.kill()
        proc.wait()
        wait_until(lambda: not _port_open(port) and not _port_open(worker_port), 30,
                   "the gateway and the worker to stop after `up` was killed")  # fmt: skip
        wait_until(lambda: not _port_open(redis_port), 10, "redis-server to stop")
    finally:
        _kill(proc)
        for pid in children:  # whatever did not stop
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_ctrl_c_stops_the_stack_in_order_and_ends_every_stream(
    tmp_path: Path, stories_dir: Path
) -> None:
    """A Ctrl-C at a terminal signals its whole foreground process group. Only `up` may act on
    it (its children run in sessions of their own): it stops the gateway, then the workers
    (draining: DRAIN_TIMEOUT_S, then what still runs ends with an error event), then Redis, so
    every stream in flight ends with [DONE] within the gateway's 5 s shutdown timeout."""
    port = find_free_port()
    log = tmp_path / "up.log"
    # one request at a time: the streams queue behind one another, more work than the drain
    proc = _up(tmp_path, "--model", str(stories_dir), "--port", str(port), "--threads", "1",
               "--kv-cache-bytes", "4000000", "--max-num-seqs", "1",
               env={"EDGEINFER_SECRET": SECRET})  # fmt: skip
    try:
        wait_until(lambda: "edgeinfer is up" in log.read_text(), 90, "the stack")
        children = _children(proc.pid)  # redis-server, the worker, the gateway
        assert len(children) == 3, log.read_text()
        assert all(_process_group(c) == c for c in children), "a child in `up`'s process group"
        found = re.search(r"ready: model .*, (http://127\.0\.0\.1:\d+),", log.read_text())
        assert found, log.read_text()
        stats = f"{found.group(1)}/internal/stats"
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": stories_dir.name, "prompt": "Once upon a time", "max_tokens": 480,
                "ignore_eos": True, "stream": True}  # fmt: skip

        async def run(n: int) -> tuple[list[tuple[int, list[bytes]]], float]:
            answered = 0

            async def one(s: aiohttp.ClientSession) -> tuple[int, list[bytes]]:
                nonlocal answered
                async with s.post(url, json=body) as r:
                    if r.status != 200:  # never started: refused when the worker stopped
                        return r.status, [await r.read()]
                    lines = [line.strip() async for line in r.content if line.strip()]
                    answered += 1
                    return 200, lines

            async with aiohttp.ClientSession() as s:
                streams = [asyncio.ensure_future(one(s)) for _ in range(n)]
                # Ctrl-C once the worker holds every request not answered yet: one runs, the
                # rest wait their turn
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    async with s.get(stats, headers={"x-edgeinfer-secret": SECRET}) as r:
                        if (await r.json())["open_requests"] == n - answered:
                            break
                    await asyncio.sleep(0.02)
                else:
                    pytest.fail("the worker never held all the requests")
                os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
                t0 = time.monotonic()
                done = await asyncio.gather(*streams)
                return done, time.monotonic() - t0

        results, took = asyncio.run(run(32))
        assert proc.wait(30) == 0, log.read_text()
    finally:
        _kill(proc)
    out = log.read_text()
    assert took < 5.0, (took, out)
    cut, refused = 0, 0
    for status, lines in results:
        if status != 200:  # never committed to the client: no token had reached the gateway
            assert status == 503, (status, lines)
            assert orjson.loads(lines[0])["error"]["code"] in ("shutdown", "draining"), lines
            refused += 1
            continue
        assert lines[-1] == b"data: [DONE]", lines[-3:]
        last = orjson.loads(lines[-2].removeprefix(b"data: "))
        if "error" in last:  # cut off by the drain
            assert last["error"]["code"] == "shutdown", last
            cut += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length", last
    # the one running when the drain ran out is cut mid-stream; the rest never started (503).
    # When the drain ran out just as one began, before its first token reached the gateway,
    # that one is refused too (the gateway commits a stream to a worker at its first token).
    # Either way every request the drain aborted is one of the two
    assert cut <= 1 and refused >= 1, results
    assert f"drain timeout: aborting {cut + refused} requests" in out, (cut, refused, out)
    stopped = re.search(r"stopped the gateway in ([\d.]+)s", out)
    assert stopped and float(stopped.group(1)) < 5.0, out
    order = ["stopping: gateway", "stopped the gateway", "stopped 1 worker(s)",
             "stopped redis-server"]  # fmt: skip
    assert [out.index(line) for line in order] == sorted(out.index(line) for line in order), out
    # Redis outlived the workers: the worker left the registry and the prefix index
    assert "redis unreachable" not in out and "could not remove worker" not in out, out
    assert not _port_open(port)


@contextlib.contextmanager
def _foreign_server(status: int = 200, body: bytes = b'{"ready": true}') -> Iterator[int]:
    """Another HTTP server, on the port it yields: it answers every GET `status` and `body`."""

    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("flag", ["--port", "--worker-port"])
def test_up_refuses_a_port_another_server_holds(
    tmp_path: Path, stories_dir: Path, flag: str
) -> None:
    with _foreign_server() as taken:
        ports = {"--port": find_free_port(), "--worker-port": find_free_port(), flag: taken}
        proc = _up(tmp_path, "--model", str(stories_dir), "--threads", "1",
                   *(str(f) for item in ports.items() for f in item))  # fmt: skip
        try:
            code = proc.wait(60)
        finally:
            _kill(proc)
    out = (tmp_path / "up.log").read_text()
    assert code == 2 and "edgeinfer is up" not in out, out  # (a refusal: status 2, as argparse's)
    assert f"port {taken} is taken; use edgeinfer up {flag} N (make run ARGS='{flag} N')" in out
    assert "started redis-server" not in out, out  # (nothing started)


def test_up_waits_for_its_own_gateway_and_says_what_it_waits_for(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Readiness is our gateway's own ready line, then its /readyz: a server on the port that
    answers 200 is not taken for it. Meanwhile `up` says what is still missing, and a child
    that exits is named, with its last lines."""
    from runtime import launcher

    monkeypatch.setattr(launcher, "PROGRESS_EVERY_S", 0.3)

    def child(name: str, code: str) -> launcher._Child:
        return launcher._Child(name, [sys.executable, "-c", code], dict(os.environ),
                               ready_line=launcher.GATEWAY_READY)  # fmt: skip

    silent = child("the gateway (port 1)", "import time; time.sleep(30)")
    listening = child("the gateway (port 1)",
                      f"import time; print({launcher.GATEWAY_READY!r}); time.sleep(30)")  # fmt: skip
    crashing = child("worker 1 (mixed, port 2)",
                     "import sys; print('about to fail'); sys.exit('boom: no such thing')")  # fmt: skip
    try:
        with _foreign_server() as port:  # 200, but not from our gateway
            url = f"http://127.0.0.1:{port}/readyz"
            with pytest.raises(RuntimeError, match="still waiting for the gateway to listen"):
                launcher._wait_ready(url, silent, [silent], 1.0)
            assert "waiting for the gateway to listen" in capsys.readouterr().err
            with pytest.raises(RuntimeError) as failed:
                launcher._wait_ready(url, silent, [silent, crashing], 10.0)
            assert "worker 1 (mixed, port 2) exited with code 1" in str(failed.value)
            assert "about to fail" in str(failed.value), str(failed.value)
            assert "boom: no such thing" in str(failed.value), str(failed.value)
            wait_until(listening.ready.is_set, 10, "the gateway's ready line")
            launcher._wait_ready(url, listening, [listening], 1.0)  # now it is ours
        missing = b'{"ready": false, "redis": true, "workers": 0, "pools": 0}'
        with (
            _foreign_server(503, missing) as port,
            pytest.raises(RuntimeError, match="waiting for a worker to load the model"),
        ):
            launcher._wait_ready(f"http://127.0.0.1:{port}/readyz", listening, [listening], 1.0)
        assert "waiting for a worker to load the model and register" in capsys.readouterr().err
        # two workers started, one registered: ready for /readyz, not yet for `up`, which said
        # "edgeinfer is up" while the second (or a disaggregated pair's other role) still loaded
        one = b'{"ready": true, "redis": true, "workers": 1, "pools": 0}'
        with (
            _foreign_server(200, one) as port,
            pytest.raises(RuntimeError, match="still waiting for 1 of 2 workers to load"),
        ):
            launcher._wait_ready(f"http://127.0.0.1:{port}/readyz", listening, [listening], 1.0, 2)
        with _foreign_server(200, one) as port:
            launcher._wait_ready(f"http://127.0.0.1:{port}/readyz", listening, [listening], 1.0, 1)
    finally:
        for c in (silent, listening):
            c.popen.kill()
            c.popen.wait()


def test_up_refuses_an_unreachable_redis_at_once(tmp_path: Path, stories_dir: Path) -> None:
    dead = f"redis://127.0.0.1:{find_free_port()}/0"  # nothing listens there
    proc = _up(tmp_path, "--model", str(stories_dir), "--port", str(find_free_port()),
               env={"EDGEINFER_REDIS": dead})  # fmt: skip
    try:
        code = proc.wait(30)  # (not the readiness wait's 600 s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`edgeinfer up` with an unreachable Redis still runs after 30 s:\n"
                    f"{(tmp_path / 'up.log').read_text()}")  # fmt: skip
    finally:
        _kill(proc)
    out = (tmp_path / "up.log").read_text()
    assert code == 2, out
    assert f"cannot reach Redis at {dead}" in out, out
    assert "unset EDGEINFER_REDIS (or drop --redis) to use a throwaway one" in out, out
    assert "gateway ready" not in out and "worker" not in out, out


def test_up_prints_a_redis_url_without_its_password(tmp_path: Path, stories_dir: Path) -> None:
    """A Redis URL with a password (redis://:PW@host) is printed with *** for it: in the
    refusal here, and in the 'edgeinfer is up' line, both of which land in logs."""
    port = find_free_port()
    proc = _up(tmp_path, "--model", str(stories_dir), "--port", str(find_free_port()),
               env={"EDGEINFER_REDIS": f"redis://:s3cret-pw@127.0.0.1:{port}/0"})  # fmt: skip
    try:
        code = proc.wait(30)
    finally:
        _kill(proc)
    out = (tmp_path / "up.log").read_text()
    assert code == 2, out
    assert f"cannot reach Redis at redis://:***@127.0.0.1:{port}/0" in out, out
    assert "s3cret-pw" not in out, out
    from runtime.launcher import _shown

    assert _shown("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert _shown("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_up_takes_a_redis_cluster_url(redis_server) -> None:  # type: ignore[no-untyped-def]
    """`--redis redis+cluster://...`: the seed node answers the check (it was read as a plain
    URL, whose scheme redis-py refused: "cannot reach Redis"); a database is refused."""
    from runtime.launcher import _check_redis

    seed = redis_server.url.replace("redis://", "redis+cluster://").rsplit("/", 1)[0]
    _check_redis(seed)
    with pytest.raises(SystemExit, match="database 0 only"):
        _check_redis(seed + "/3")
