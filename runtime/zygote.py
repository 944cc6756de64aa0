"""A warm template process (a zygote) that forks worker processes with their imports done.

A worker spawned as a fresh process spends ~1.2 s of its ~1.5 s cold start importing Python,
torch and the serving stack before its first weight is read (bench/README: coldstart). A pool
manager (runtime.pool_manager) keeps one process that has made those imports and waits; each
worker it then starts is a fork of it, and begins reading its weights at once.

    pool (asyncio)                                zygote (`python -m runtime.zygote --fd N`)
      ZygoteClient.start() ── spawn ─────────────▶ imports the worker's modules, gc.freeze()
                            ◀──── {"ready": pid} ─
      spawn(argv, env) ── {"spawn": id, argv, env} + the write end of an output pipe ──▶ fork:
                            ◀─ {"spawned": id, "pid": P}      child: output pipe on fds 1 and 2,
      ForkedProcess: stdout (the pipe's read end),              stdin /dev/null, env applied,
        send_signal / kill (a pidfd: never another process),    `edgeinfer` argv run
        wait()          ◀─ {"exit": P, "code": C} ── SIGCHLD: the zygote reaps its children

One message per datagram (a SOCK_SEQPACKET socket pair), JSON. The zygote has started no thread
and run no parallel torch operation when it forks (an OpenMP runtime forked after use hangs);
its children are single-threaded at fork. It exits when the pool's end of the socket closes.
If it dies, the workers it forked keep running; the client then watches each through its pidfd
(its exit code is unknown: -1). `returncode` follows asyncio.subprocess.Process: -N for a
process killed by signal N.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any

log = logging.getLogger("edgeinfer.zygote")

MAX_MESSAGE = 1 << 20  # bytes of one message (argv and env)
READY_TIMEOUT_S = 300.0  # the template's imports (a first run compiles bytecode)


# ---------------------------------------------------------------------------- the zygote
def preload() -> None:
    """Import what `edgeinfer worker` imports before it reads its first weight."""
    import runtime.async_engine
    import runtime.cli
    import runtime.drive
    import runtime.engine
    import runtime.loader
    import runtime.ranks
    import runtime.service_cli
    import runtime.worker  # noqa: F401


def _send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(msg).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def _child(sock: socket.socket, sel: selectors.BaseSelector, wakeup: tuple[int, int],
           msg: dict[str, Any], out: int) -> None:  # fmt: skip
    """In the forked child: become the worker process `msg` asks for; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sel.close()  # (closes this process's descriptor; the zygote's registrations stay)
        sock.close()
        for fd in wakeup:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        os.environ.update(msg.get("env") or {})
        argv = [str(a) for a in msg["argv"]]
        sys.argv = ["edgeinfer", *argv]
        import torch

        torch.seed()  # not the template's generator state, shared by every fork

        from runtime.cli import main

        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        with contextlib.suppress(OSError):
            _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(fd: int) -> int:
    """The zygote's loop on the control socket `fd` (its pool's end is the other)."""
    import gc

    gc.disable()
    # Ctrl-C in a terminal reaches the whole process group: the pool stops its workers and then
    # closes the socket, which ends this process; it must not go first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    t0 = time.perf_counter()
    preload()
    gc.freeze()  # the children share these objects' pages: no collection rewrites them
    gc.enable()
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the pipe
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    _send(sock, {"ready": os.getpid(), "imports_s": round(time.perf_counter() - t0, 3)})
    while True:
        for key, _ in sel.select():
            if key.fileobj == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _reap(sock)
                continue
            try:
                data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 1)
            except InterruptedError:
                continue
            if not data:  # the pool is gone
                return 0
            msg = json.loads(data)
            if not fds:
                _send(sock, {"spawned": msg.get("spawn"), "error": "no output descriptor"})
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as e:
                os.close(fds[0])
                _send(sock, {"spawned": msg.get("spawn"), "error": f"fork: {e}"})
                continue
            if pid == 0:
                _child(sock, sel, (wake_r, wake_w), msg, fds[0])
            os.close(fds[0])
            _send(sock, {"spawned": msg.get("spawn"), "pid": pid})
            _reap(sock)  # a child that died at once


# ---------------------------------------------------------------------------- the pool's side
class ZygoteError(RuntimeError):
    """The template process is not there (failed to start, or died) or could not fork."""


class ForkedProcess:
    """A worker forked by the zygote, with the parts of asyncio.subprocess.Process that a pool
    uses: pid, returncode, stdout, wait(), send_signal(), terminate(), kill()."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._exited = asyncio.Event()
        self._pidfd = -1
        with contextlib.suppress(OSError, AttributeError):  # (pidfds: Linux 5.3+)
            self._pidfd = os.pidfd_open(pid)

    def _set_exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set()
        self._close_pidfd()

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """The zygote is gone: learn of the exit from the pidfd (the code is lost: -1)."""
        if self.returncode is not None:
            return
        if self._pidfd < 0:
            self._set_exit(-1)
            return
        loop.add_reader(self._pidfd, self._set_exit, -1)

    def _close_pidfd(self) -> None:
        if self._pidfd >= 0:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        if self._pidfd >= 0:
            signal.pidfd_send_signal(self._pidfd, sig)
        else:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ZygoteClient:
    """A pool's handle on its zygote: `await ZygoteClient.start()`, then `spawn(argv, env)`."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.imports_s = 0.0
        self._sock: socket.socket | None = None
        self._ids = 0
        self._pending: dict[int, asyncio.Future[int]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}  # exits reported before their spawn's answer
        self._reader: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[dict[str, Any]] | None = None

    @property
    def alive(self) -> bool:
        return self._sock is not None

    @classmethod
    async def start(cls, timeout_s: float = READY_TIMEOUT_S) -> ZygoteClient:
        """Spawn the zygote and wait until its imports are done (ZygoteError if it fails)."""
        self = cls()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "runtime.zygote", "--fd", str(theirs.fileno()),
                pass_fds=[theirs.fileno()], stdin=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
        except OSError as e:
            ours.close()
            raise ZygoteError(f"cannot start the template process: {e}") from e
        finally:
            theirs.close()
        self._sock = ours
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._reader = asyncio.ensure_future(self._read())
        try:
            ready = await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        except BaseException as e:  # (cancelled too: the process is not left behind)
            await self.close()
            if not isinstance(e, (TimeoutError, ZygoteError)):
                raise
            why = str(e) or f"not ready after {timeout_s:.0f}s"
            raise ZygoteError(f"the template process did not start: {why}") from e
        self.imports_s = float(ready.get("imports_s", 0.0))
        return self

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        try:
            while True:
                data = await loop.sock_recv(self._sock, MAX_MESSAGE)
                if not data:
                    break
                self._dispatch(json.loads(data))
        except (OSError, ValueError) as e:
            log.warning("template process: %s", e)
        finally:
            self._lost()

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if "ready" in msg:
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg)
        elif "spawned" in msg:
            fut = self._pending.pop(msg["spawned"], None)
            if fut is not None and not fut.done():
                if "pid" in msg:
                    fut.set_result(int(msg["pid"]))
                else:
                    fut.set_exception(ZygoteError(str(msg.get("error"))))
        elif "exit" in msg:
            pid, code = int(msg["exit"]), int(msg["code"])
            child = self._children.pop(pid, None)
            if child is not None:
                child._set_exit(code)
            else:
                self._early_exits[pid] = code

    def _lost(self) -> None:
        """The zygote is gone: fail what waits on it; watch its children through their pidfds."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        error = ZygoteError("the template process exited")
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)
        self._pending.clear()
        loop = asyncio.get_running_loop()
        for child in self._children.values():
            child._watch(loop)
        self._children.clear()

    async def spawn(self, argv: list[str], env: dict[str, str] | None = None) -> ForkedProcess:
        """Fork a process that runs `edgeinfer ARGV` with `env` added to its environment; its
        stdout and stderr come back together on the result's `stdout`."""
        if self._sock is None:
            raise ZygoteError("the template process is not running")
        loop = asyncio.get_running_loop()
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            self._ids += 1
            fut: asyncio.Future[int] = loop.create_future()
            self._pending[self._ids] = fut
            msg = {"spawn": self._ids, "argv": argv, "env": env or {}}
            try:
                _send(self._sock, msg, [w])
            except OSError as e:
                self._pending.pop(self._ids, None)
                raise ZygoteError(f"the template process is not answering: {e}") from e
            pid = await fut
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        reader = asyncio.StreamReader(limit=1 << 20)
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(r, "rb", buffering=0)
        )
        child = ForkedProcess(pid, reader)
        if pid in self._early_exits:
            child._set_exit(self._early_exits.pop(pid))
        elif self._sock is None:  # lost while we waited
            child._watch(loop)
        else:
            self._children[pid] = child
        return child

    async def close(self) -> None:
        """Stop the zygote: it exits once its end of the socket sees ours close. Its children
        are left running (the pool stops its workers first)."""
        if self._reader is not None:
            self._reader.cancel()  # its clean-up (`_lost`) closes the socket
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        self._lost()
        if self.proc is not None and self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), 10.0)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="edgeinfer's worker template (started by a pool)")
    ap.add_argument("--fd", type=int, required=True, help="the control socket's descriptor")
    return serve(ap.parse_args(argv).fd)


if __name__ == "__main__":
    sys.exit(main())
