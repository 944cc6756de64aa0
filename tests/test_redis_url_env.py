"""A Redis URL may hold a password (redis://:PW@host): the processes that `edgeinfer pool` and
`edgeinfer up` start get it in their environment (EDGEINFER_REDIS), never on their command line,
which anyone on the node can read (ps, /proc/PID/cmdline). Real processes against a real
redis-server that asks for the password."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis

from kvstore.redis_server import LocalRedis, find_free_port
from runtime.lifeline import Lifeline
from tests.stack import ROOT, SECRET, Proc, chat_model, get_json, start_gateway, wait_until

PASSWORD = "hunter2-s3cret"
CATALOG = "regions:\n  - {name: local, latitude: 50.11, longitude: 8.68, settings: {}}\n"
WORKER_ARGS = "--threads 1 --kv-cache-bytes 4000000 --heartbeat 0.3 --ttl 1.5 --drain-timeout 5"
LIFELINE = Lifeline()  # what the pool starts stops by itself should this test process die


@pytest.fixture
def locked_redis() -> Iterator[tuple[str, str]]:
    """A redis-server that asks for PASSWORD: (its URL with the password, the same URL with a
    wrong one, which is refused)."""
    with LocalRedis() as server:
        redis.Redis(port=server.port).config_set("requirepass", PASSWORD)
        with pytest.raises(redis.exceptions.AuthenticationError):  # (it does ask)
            redis.Redis(port=server.port).ping()
        yield (f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0",
               f"redis://:wrong-pw@127.0.0.1:{server.port}/0")  # fmt: skip


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, theirs, ...), from /proc's parent links."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # (exited meanwhile)
            continue
        parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _command_lines(pids: list[int]) -> dict[int, bytes]:
    out = {}
    for pid in pids:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # (exited meanwhile)
            continue
    return out


def _clean_env() -> dict[str, str]:
    """Our environment without EDGEINFER_* (a developer's EDGEINFER_REDIS must not decide)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("EDGEINFER_")}


@pytest.mark.parametrize(
    "spawn, given",
    # exec: the pool's pod (its URL from the Secret, as EDGEINFER_REDIS), workers started fresh;
    # fork: the pool given --redis, and an EDGEINFER_REDIS with a wrong password beside it, which
    # neither it nor its workers may take
    [("exec", "env"), ("fork", "flag")],
)  # fmt: skip
def test_a_pools_workers_log_in_with_a_password_that_is_on_no_command_line(
    tmp_path: Path, stories_dir: Path, locked_redis: tuple[str, str], spawn: str, given: str
) -> None:
    url, wrong = locked_redis
    model = chat_model(stories_dir, tmp_path / "stories-chat")
    (tmp_path / "regions.yaml").write_text(CATALOG)
    argv = ["pool", "--region", "local", "--models", f"stories={model}", "--min-workers", "1",
            "--worker-args", WORKER_ARGS, *(["--no-zygote"] if spawn == "exec" else []),
            *(["--redis", url] if given == "flag" else [])]  # fmt: skip
    env = _clean_env() | {"EDGEINFER_SECRET": SECRET, "PYTHONUNBUFFERED": "1",
                          "EDGEINFER_REDIS": url if given == "env" else wrong} | LIFELINE.env  # fmt: skip
    log = tmp_path / "pool.log"
    popen = subprocess.Popen([sys.executable, "-m", "runtime.cli", *argv], cwd=ROOT, env=env,
                             stdout=log.open("wb"), stderr=subprocess.STDOUT,
                             pass_fds=LIFELINE.pass_fds)  # fmt: skip
    pool = Proc("pool", popen, "", log, 0)
    gateway = start_gateway("gw", url, tmp_path / "regions.yaml", tmp_path)
    try:
        # registered in the Redis that asks for the password: the worker logged in with it
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["workers"] == 1, 120,
                   "the pool's worker to register", pool)  # fmt: skip
        found = re.search(r"start \S+ for stories \(.*\): pid (\d+) \((\w+)\)", pool.tail(200))
        assert found and found.group(2) == spawn, pool.tail(200)
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0,
                               timeout=60)  # fmt: skip
        r = client.chat.completions.create(
            model="stories", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert r.choices[0].message.content
        children = _descendants(popen.pid)
        assert int(found.group(1)) in children
        lines = _command_lines(children)
        assert int(found.group(1)) in lines  # (the worker's, read)
        leaked = {pid: line for pid, line in lines.items() if PASSWORD.encode() in line}
        assert not leaked, leaked
    finally:
        gateway.stop()
        pool.stop(60)


def test_an_up_stacks_children_log_in_with_a_password_that_is_on_no_command_line(
    tmp_path: Path, stories_dir: Path, locked_redis: tuple[str, str]
) -> None:
    """`up --redis URL`: its worker and gateway use that Redis (not the EDGEINFER_REDIS beside
    it, whose password is wrong), and neither has the password on its command line."""
    url, wrong = locked_redis
    model = chat_model(stories_dir, tmp_path / "stories-chat")
    port = find_free_port()
    log = tmp_path / "up.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "up", "--model", str(model), "--port", str(port),
         "--redis", url, "--threads", "1", "--kv-cache-bytes", "4000000"],
        cwd=ROOT, env=_clean_env() | {"PYTHONUNBUFFERED": "1", "EDGEINFER_REDIS": wrong},
        stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(lambda: "edgeinfer is up" in log.read_text() or proc.poll() is not None, 90,
                   "the stack")  # fmt: skip
        assert proc.poll() is None, log.read_text()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0, timeout=60)  # fmt: skip
        r = client.chat.completions.create(
            model="stories-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert r.choices[0].message.content
        lines = _command_lines(_descendants(proc.pid))
        assert sum(b"runtime.cli\0worker" in line for line in lines.values()) == 1, lines
        assert sum(b"runtime.cli\0gateway" in line for line in lines.values()) == 1, lines
        leaked = {pid: line for pid, line in lines.items() if PASSWORD.encode() in line}
        assert not leaked, leaked
        assert PASSWORD not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the stack stops in order
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
