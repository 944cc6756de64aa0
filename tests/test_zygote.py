"""The warm template process (runtime.zygote): real forked `edgeinfer` processes, a real worker
answering on its internal API, exit codes, signals, the template's death, and the pool's fresh
process when there is no template."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

import runtime.zygote as zygote_module
from runtime.pool_manager import Pool, PoolConfig
from runtime.proctitle import redact
from runtime.zygote import ForkedProcess, ZygoteClient, ZygoteError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_argv(model: Path, port: int) -> list[str]:
    return ["worker", "--model", str(model), "--no-redis", "--port", str(port), "--threads", "1",
            "--kv-cache-bytes", "2000000", "--drain-timeout", "5", "--served-model-name", "m"]  # fmt: skip


async def _lines_until(proc: ForkedProcess, marker: str, timeout_s: float = 120.0) -> list[str]:
    """The process's output lines up to the first containing `marker`."""
    lines: list[str] = []
    while True:
        raw = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
        if not raw:
            raise AssertionError(f"output ended before {marker!r}: {lines}")
        lines.append(raw.decode().rstrip())
        if marker in lines[-1]:
            return lines


async def _generate(port: int, secret: str) -> tuple[int, bytes]:
    body = {"request_id": "z1", "model": "m", "prompt": "Once upon a time",
            "sampling": {"max_tokens": 4, "temperature": 0}}  # fmt: skip
    url = f"http://127.0.0.1:{port}/internal/generate"
    headers = {"x-edgeinfer-secret": secret}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, data=orjson.dumps(body), headers=headers) as resp,
    ):
        return resp.status, await resp.read()


@contextlib.asynccontextmanager
async def _template() -> AsyncIterator[ZygoteClient]:
    """A started template; whatever it forked and is still running when the test ends (a
    failed assertion included) is killed, and the template closed."""
    zygote = await ZygoteClient.start()
    spawn, children = zygote.spawn, []

    async def tracked(argv: list[str], env: dict[str, str] | None = None) -> ForkedProcess:
        children.append(await spawn(argv, env))
        return children[-1]

    zygote.spawn = tracked  # type: ignore[method-assign]
    try:
        yield zygote
    finally:
        for p in children:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(p.wait(), 10)
        if zygote.proc is not None:  # (a fork no spawn() returned: an abandoned one)
            for pid in _live_children(zygote.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        await zygote.close()


def test_forked_commands_run_with_their_own_output_env_and_exit_code(
    tmp_path: Path, stories_dir: Path
) -> None:
    async def main() -> None:
        async with _template() as zygote:
            # a command that exits at once: its output and its code
            p = await zygote.spawn(["models", "--store", str(tmp_path / "store")])
            assert b"no models in" in await p.stdout.read()
            assert await p.wait() == 0 and p.returncode == 0
            assert p.pid != zygote.proc.pid  # type: ignore[union-attr]
            # a failing one: the error names the folder, the code is the command's
            p = await zygote.spawn(["worker", "--model", str(tmp_path / "none"), "--no-redis",
                                    "--secret", "s"])  # fmt: skip
            out = await p.stdout.read()
            assert await p.wait() == 2 and b"no such model folder" in out, out
            # a worker: the secret comes from the environment it was given; it serves, then
            # drains and exits 0 on SIGTERM
            port = _free_port()
            p = await zygote.spawn(_worker_argv(stories_dir, port), {"EDGEINFER_SECRET": "z-s"})
            lines = await _lines_until(p, " ready: ")
            assert any(line.startswith("start-up: imports") for line in lines), lines
            status, body = await _generate(port, "z-s")
            assert status == 200 and b'"delta"' in body, body
            assert (await _generate(port, "wrong"))[0] == 401
            p.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(p.wait(), 30) == 0
            with pytest.raises(ProcessLookupError):
                p.kill()
            # killed by a signal: -N, as asyncio's processes report it
            p = await zygote.spawn(
                _worker_argv(stories_dir, _free_port()), {"EDGEINFER_SECRET": "s"}
            )
            await _lines_until(p, " ready: ")
            p.kill()
            assert await asyncio.wait_for(p.wait(), 30) == -signal.SIGKILL
        assert zygote.proc is not None and zygote.proc.returncode == 0  # left when we closed

    asyncio.run(main())


def test_ps_names_each_forked_worker_by_its_own_command(stories_dir: Path) -> None:
    async def main() -> None:
        async with _template() as zygote:
            port = _free_port()
            argv = [*_worker_argv(stories_dir, port), "--secret", "hidden-secret"]
            p = await zygote.spawn(argv)
            await _lines_until(p, " ready: ")
            cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes().rstrip(b"\0").decode()
            assert cmdline.startswith(f"edgeinfer worker --model {stories_dir} --no-redis "
                                      f"--port {port} "), cmdline  # fmt: skip
            assert cmdline.endswith("--secret ***") and "hidden" not in cmdline, cmdline
            assert Path(f"/proc/{p.pid}/comm").read_text().strip() == "ei-worker"
            assert zygote.proc is not None
            template = Path(f"/proc/{zygote.proc.pid}/cmdline").read_bytes()
            assert template.startswith(b"edgeinfer zygote: a pool's warm worker template")
            assert Path(f"/proc/{zygote.proc.pid}/comm").read_text().strip() == "ei-zygote"
            assert (await _generate(port, "hidden-secret"))[0] == 200  # the real one still works

    asyncio.run(main())
    assert redact(["gateway", "--api-key=k1", "--secret", "s", "--port", "1"]) == [
        "gateway", "--api-key=***", "--secret", "***", "--port", "1"]  # fmt: skip
    assert redact(["--redis", "redis://:pw@h:6379/0", "--redis=rediss://u:p@h/1", "http://h:1/x"]) == [
        "--redis", "redis://:***@h:6379/0", "--redis=rediss://u:***@h/1", "http://h:1/x"]  # fmt: skip
    # a password holding '@' or '/', and one given as a query parameter (a reviewer's cases)
    assert redact(["redis://:p@ss@h:1/0", "redis://:ab/cd@h/0", "redis://h:1/0?password=s3&db=1",
                   "redis://u@h/0"]) == [
        "redis://:***@h:1/0", "redis://:***@h/0", "redis://h:1/0?password=***&db=1",
        "redis://u@h/0"]  # fmt: skip


def test_a_dead_template_leaves_its_workers_serving_and_watched(stories_dir: Path) -> None:
    async def main() -> None:
        async with _template() as zygote:
            port = _free_port()
            p = await zygote.spawn(_worker_argv(stories_dir, port), {"EDGEINFER_SECRET": "s"})
            await _lines_until(p, " ready: ")
            assert zygote.proc is not None
            os.kill(zygote.proc.pid, signal.SIGKILL)
            await zygote.proc.wait()
            for _ in range(100):  # the client notices the socket close
                if not zygote.alive:
                    break
                await asyncio.sleep(0.05)
            assert not zygote.alive
            with pytest.raises(ZygoteError, match="not running"):
                await zygote.spawn(["models"])
            assert (await _generate(port, "s"))[0] == 200  # the orphan still serves
            p.terminate()
            assert await asyncio.wait_for(p.wait(), 30) == -1  # through its pidfd; code unknown

    asyncio.run(main())


def _live_children(pid: int) -> list[int]:
    """Processes whose parent is `pid` and that are not zombies."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def test_signals_races_and_abandoned_spawns(tmp_path: Path, stories_dir: Path) -> None:
    async def main() -> None:
        async with _template() as zygote:
            assert zygote.proc is not None
            # SIGTERM to the template (a service manager stopping the process group) is left to
            # the pool: the template stays and still forks
            zygote.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            assert zygote.alive and zygote.proc.returncode is None
            # a process that has exited, its exit not yet read from the template: a signal to it
            # is no error (as with asyncio's processes), and its exit code is its own
            p = await zygote.spawn(["models", "--store", str(tmp_path)])
            time.sleep(2.0)  # the loop blocked: the child exits and is reaped meanwhile
            p.kill()
            assert await asyncio.wait_for(p.wait(), 30) == 0
            with pytest.raises(ProcessLookupError):
                p.terminate()
            # a spawn given up before the answer: the process forked for it is killed
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(
                    zygote.spawn(
                        _worker_argv(stories_dir, _free_port()), {"EDGEINFER_SECRET": "s"}
                    ),
                    0.001,
                )
            for _ in range(100):
                await asyncio.sleep(0.05)
                if not _live_children(zygote.proc.pid):
                    break
            assert not _live_children(zygote.proc.pid)
            assert not zygote._starting and not zygote._pending
            # cancelled after the answer, while its output pipe is being connected: the
            # process is killed too (it ran on, in no one's list)
            loop = asyncio.get_running_loop()
            connect = loop.connect_read_pipe

            async def cancelled(*args: object) -> None:
                raise asyncio.CancelledError

            loop.connect_read_pipe = cancelled  # type: ignore[method-assign,assignment]
            try:
                with pytest.raises(asyncio.CancelledError):
                    await zygote.spawn(
                        _worker_argv(stories_dir, _free_port()), {"EDGEINFER_SECRET": "s"}
                    )
            finally:
                loop.connect_read_pipe = connect  # type: ignore[method-assign]
            for _ in range(100):
                await asyncio.sleep(0.05)
                if not _live_children(zygote.proc.pid):
                    break
            assert not _live_children(zygote.proc.pid)
            assert not zygote._starting and not zygote._pending and not zygote._children

    asyncio.run(main())


def test_pool_starts_a_fresh_process_without_a_template(tmp_path: Path) -> None:
    async def main() -> None:
        pool = Pool(PoolConfig(region="r", models={"m": "/x"}, redis_url="", secret="s"))

        async def failed() -> ZygoteClient:
            raise ZygoteError("the template process did not start: test")

        broken = pool._zygote = asyncio.ensure_future(failed())
        pool._zygote_started = time.monotonic()
        proc, how = await pool._spawn_process(["models", "--store", str(tmp_path)], {})
        assert how == "exec"
        assert proc.stdout is not None and b"no models in" in await proc.stdout.read()
        assert await proc.wait() == 0
        assert pool._zygote is broken  # not tried again within a minute
        pool._zygote_started -= 60.0
        proc, how = await pool._spawn_process(["models", "--store", str(tmp_path)], {})
        assert how == "exec"  # this one did not wait for the new template
        await proc.wait()
        assert pool._zygote is not broken
        zygote = await pool._zygote  # which starts
        proc, how = await pool._spawn_process(["models", "--store", str(tmp_path)], {})
        assert how == "fork" and await proc.wait() == 0
        await zygote.close()

    asyncio.run(main())


def test_a_spawn_that_fails_beside_another_leaves_the_other_s_answer_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each spawn() forgot, on its error path, the id of the latest spawn() begun rather than its
    # own: the other call's answer found no one waiting, its process was killed as abandoned,
    # and the call failed after SPAWN_TIMEOUT_S
    monkeypatch.setattr(zygote_module, "SPAWN_TIMEOUT_S", 3.0)

    async def main() -> None:
        async with _template() as zygote:
            argv = ["models", "--store", str(tmp_path)]
            given_up = asyncio.ensure_future(zygote.spawn(argv))
            other = asyncio.ensure_future(zygote.spawn(argv))
            await asyncio.sleep(0)  # both sent, neither answered
            given_up.cancel()
            p = await other
            assert b"no models in" in await p.stdout.read()
            assert await p.wait() == 0
            with pytest.raises(asyncio.CancelledError):
                await given_up
            assert not zygote._pending and not zygote._starting

    asyncio.run(main())


def test_a_template_that_hangs_is_killed_and_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A template alive but not answering (here stopped) was kept: every spawn waited on it,
    # and the pool, which replaces only a template that is gone, never replaced it
    monkeypatch.setattr(zygote_module, "SPAWN_TIMEOUT_S", 1.0)
    argv = ["models", "--store", str(tmp_path)]

    async def main() -> None:
        pool = Pool(PoolConfig(region="r", models={"m": "/x"}, redis_url="", secret="s"))
        pool._start_zygote()
        hung = pool._zygote
        assert hung is not None
        zygote = await hung
        assert zygote.proc is not None
        try:
            os.kill(zygote.proc.pid, signal.SIGSTOP)
            pool._zygote_started -= 60.0  # (a template is started again once a minute at most)
            proc, how = await pool._spawn_process(argv, {})
            assert how == "exec" and await proc.wait() == 0
            assert not zygote.alive
            assert await asyncio.wait_for(zygote.proc.wait(), 10) == -signal.SIGKILL
            with pytest.raises(ZygoteError, match="not running"):
                await zygote.spawn(argv)
            assert pool._zygote is not hung  # a new one, which forks
            fresh = await pool._zygote
            proc, how = await pool._spawn_process(argv, {})
            assert how == "fork" and await proc.wait() == 0
            await fresh.close()
        finally:
            with contextlib.suppress(ProcessLookupError):
                zygote.proc.kill()
            await zygote.close()

    asyncio.run(main())


_DIES_AS_IT_ANSWERS = """
import os, sys
import runtime.zygote as z
send = z._send
def dies(sock, msg, fds=None):
    if "pid" in msg:  # forked, and killed before the pool hears of it
        os._exit(9)
    send(sock, msg, fds)
z._send = dies
z.serve(int(sys.argv[1]))
"""


def test_a_child_whose_template_dies_before_answering_runs_nothing(tmp_path: Path) -> None:
    """The template dies between a fork and its answer: the child ran its command all the same,
    a process no pool knew of (a worker serving on that nothing would stop). It exits instead,
    having run nothing: its output pipe closes empty."""
    import json
    import subprocess
    import sys

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    template = subprocess.Popen(
        [sys.executable, "-c", _DIES_AS_IT_ANSWERS, str(theirs.fileno())],
        pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
    )  # fmt: skip
    theirs.close()
    try:
        assert "ready" in json.loads(ours.recv(1 << 16))
        r, w = os.pipe()
        spawn = {"spawn": 1, "argv": ["models", "--store", str(tmp_path)], "env": {}}
        socket.send_fds(ours, [json.dumps(spawn).encode()], [w])
        os.close(w)
        with os.fdopen(r, "rb") as out:
            output = out.read()  # until the child's end closes: it has exited
        assert template.wait(30) == 9
        assert output == b"", output  # (the old template's child: "no models in ...")
    finally:
        ours.close()
        if template.poll() is None:
            template.kill()
            template.wait()
