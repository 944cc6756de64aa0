"""A warm template process (a zygote) that forks worker processes with their imports done.

A worker spawned as a fresh process spends ~1.2 s of its ~1.5 s cold start importing Python,
torch and the serving stack before its first weight is read (bench/README: coldstart). A pool
manager (runtime.pool_manager) keeps one process that has made those imports and waits; each
worker it then starts is a fork of it, and begins reading its weights at once.

    pool (asyncio)                                zygote (`python -m runtime.zygote --fd N`)
      ZygoteClient.start() ── spawn ─────────────▶ imports the worker's modules, gc.freeze()
                            ◀──── {"ready": pid} ─
      spawn(argv, env) ── {"spawn": id, argv, env} + the write end of an output pipe ──▶ fork:
                 ◀─ {"spawned": id, "pid": P} + a pidfd of P    child: output pipe on fds 1 and 2,
      ForkedProcess: stdout (the pipe's read end),              stdin /dev/null, env applied,
        send_signal / kill (the pidfd: never another process),  `edgeinfer` argv run
        wait()          ◀─ {"exit": P, "code": C} ── SIGCHLD: the zygote reaps its children

One message per datagram (a SOCK_SEQPACKET socket pair), JSON. The zygote opens each child's
pidfd before it can reap it, so the pool's handle names that process even once its pid is
reused. A child runs its command only once the template has sent its pid: one whose template
dies before that (killed between the fork and the answer) exits, rather than run on as a worker
no pool knows of. The zygote has run no parallel torch operation when it forks (an OpenMP
runtime forked after use hangs) and started no thread of its own (numpy's OpenBLAS keeps one,
which its fork handlers make safe). It ignores SIGINT and SIGTERM, which a terminal or a
service manager sends the whole process group: it exits when the pool's end of the socket
closes, after the pool has stopped its workers. If it dies, the workers it forked keep
running; the client then watches each through its pidfd (its exit code is unknown: -1). One
that does not answer a spawn within SPAWN_TIMEOUT_S hangs: it is killed, and so replaced by its
pool as one that died. `returncode` follows asyncio.subprocess.Process: -N for a process killed
by signal N. `ps` shows each forked process as its own command (`edgeinfer worker --model ...
--port ...`, secrets hidden; short name `ei-worker`) and the template as `edgeinfer zygote: ...`
(runtime.proctitle).
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

from runtime.proctitle import redact, set_title

log = logging.getLogger("edgeinfer.zygote")

MAX_MESSAGE = 1 << 20  # bytes of one message received (a SEQPACKET send takes ~200 KiB at most)
READY_TIMEOUT_S = 300.0  # the template's imports (a first run compiles bytecode)
# for the template's answer to a spawn, which takes milliseconds (a fork of a process that has
# imported torch): one that does not answer in this time hangs, and is killed (`spawn`)
SPAWN_TIMEOUT_S = 10.0
TITLE_ROOM = 400  # bytes of command line the template starts with, for its workers' titles


# ---------------------------------------------------------------------------- the zygote
def preload() -> None:
    """Import what `edgeinfer worker` imports before it reads its first weight."""
    import uvloop  # noqa: F401  (the worker's event loop)

    import runtime.async_engine
    import runtime.cli
    import runtime.drive
    import runtime.engine
    import runtime.loader
    import runtime.ranks
    import runtime.service_cli
    import runtime.worker  # noqa: F401


def _send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    """One message (and descriptors to pass) on a blocking socket."""
    data = json.dumps(msg).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def _child(sock: socket.socket, sel: selectors.BaseSelector, wakeup: tuple[int, int],
           msg: dict[str, Any], out: int, go: int) -> None:  # fmt: skip
    """In the forked child: become the worker process `msg` asks for, once the template has
    given the pool its pid (a byte on `go`; end-of-file: the template died first, and this
    process exits at once); never returns."""
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
        if os.read(go, 1) != b"1":
            os._exit(1)
        os.close(go)
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
        # `ps` shows this worker's own command, not the template's (runtime.proctitle)
        set_title(" ".join(redact(sys.argv)), f"ei-{argv[0]}" if argv else None)
        import torch

        torch.seed()  # not the template's generator state, shared by every fork

        from runtime.cli import main

        code = int(main(argv) or 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        # What an interpreter's exit runs (atexit: telemetry flushes, ranks closed), but not the
        # template's loop below, which this frame would otherwise unwind into.
        with contextlib.suppress(BaseException):
            import atexit

            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
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
    # Ctrl-C in a terminal (or a service manager's SIGTERM) reaches the whole process group: the
    # pool stops its workers and then closes the socket, which ends this process; it must not go
    # first (its children's exits would go unreported).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    set_title(f"edgeinfer zygote: a pool's warm worker template (parent {os.getppid()})",
              "ei-zygote")  # fmt: skip
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
    try:
        _send(sock, {"ready": os.getpid(), "imports_s": round(time.perf_counter() - t0, 3)})
    except OSError:  # the pool gave up waiting
        return 0
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
            # the child runs its command once the pool has its pid (a byte on this pipe): a
            # template that died between the fork and its answer (killed, out of memory) left
            # the child running, a worker no pool knew of, which nothing would stop; it reads
            # end-of-file instead, and exits
            go_r, go_w = os.pipe2(os.O_CLOEXEC)
            try:
                pid = os.fork()
            except OSError as e:
                for fd in (fds[0], go_r, go_w):
                    os.close(fd)
                _send(sock, {"spawned": msg.get("spawn"), "error": f"fork: {e}"})
                continue
            if pid == 0:
                os.close(go_w)
                _child(sock, sel, (wake_r, wake_w), msg, fds[0], go_r)
            os.close(fds[0])
            os.close(go_r)
            try:
                try:  # before any reaping: the pid is this child's until then
                    pidfd = [os.pidfd_open(pid)]
                except (OSError, AttributeError):  # (Linux before 5.3: the pool signals by pid)
                    pidfd = []
                try:
                    _send(sock, {"spawned": msg.get("spawn"), "pid": pid}, pidfd)
                except OSError:  # the pool is gone: the child is left to exit (its pipe closes)
                    return 0
                finally:
                    for fd in pidfd:
                        os.close(fd)
                os.write(go_w, b"1")
            finally:
                os.close(go_w)
            _reap(sock)  # a child that died at once


# ---------------------------------------------------------------------------- the pool's side
class ZygoteError(RuntimeError):
    """The template process is not there (failed to start, or died) or could not fork."""


class ForkedProcess:
    """A worker forked by the zygote, with the parts of asyncio.subprocess.Process that a pool
    uses: pid, returncode, stdout, wait(), send_signal(), terminate(), kill()."""

    def __init__(self, pid: int, pidfd: int, stdout: asyncio.StreamReader) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._exited = asyncio.Event()
        self._pidfd = pidfd  # -1: none (an old kernel); signals then go by pid

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
        """As asyncio's: ProcessLookupError once its exit has been seen. Before that, a process
        that has just exited (its exit on its way from the zygote) takes the signal silently."""
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        with contextlib.suppress(ProcessLookupError):
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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = 0
        self._pending: dict[int, asyncio.Future[tuple[int, int]]] = {}  # spawn id -> (pid, pidfd)
        self._children: dict[int, ForkedProcess] = {}
        self._starting: dict[
            int, int | None
        ] = {}  # pid -> exit code reported before spawn() took it
        self._ready: asyncio.Future[dict[str, Any]] | None = None

    @property
    def alive(self) -> bool:
        return self._sock is not None

    @classmethod
    async def start(
        cls, timeout_s: float = READY_TIMEOUT_S, pass_fds: tuple[int, ...] = ()
    ) -> ZygoteClient:
        """Spawn the zygote and wait until its imports are done (ZygoteError if it fails).
        `pass_fds`: descriptors it keeps open, which every process it forks inherits (a pool's
        lifeline: runtime.lifeline)."""
        self = cls()
        try:  # (out of descriptors: a ZygoteError, as any failure to start, which a pool's starts
            # get past with a fresh process; any other error failed each of them for good)
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as e:
            raise ZygoteError(f"cannot start the template process: {e}") from e
        ours.setblocking(False)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "runtime.zygote", "--fd", str(theirs.fileno()),
                "--title-room", "." * TITLE_ROOM,
                pass_fds=[theirs.fileno(), *pass_fds], stdin=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
        except OSError as e:
            ours.close()
            raise ZygoteError(f"cannot start the template process: {e}") from e
        finally:
            theirs.close()
        self._sock = ours
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._loop.add_reader(ours, self._readable)
        try:
            async with asyncio.timeout(timeout_s):
                ready = await asyncio.shield(self._ready)
        except BaseException as e:  # (cancelled too: the process is not left behind)
            await self.close()
            if self._ready.done() and not self._ready.cancelled():
                self._ready.exception()  # (retrieved: no "never retrieved" warning)
            if not isinstance(e, (TimeoutError, ZygoteError)):
                raise
            why = str(e) or f"not ready after {timeout_s:.0f}s"
            raise ZygoteError(f"the template process did not start: {why}") from e
        self.imports_s = float(ready.get("imports_s", 0.0))
        return self

    def _readable(self) -> None:
        """Every message waiting on the socket, with the descriptors passed along."""
        while self._sock is not None:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self._sock, MAX_MESSAGE, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("template process: %s", e)
                data, fds = b"", []
            if not data:
                for fd in fds:
                    os.close(fd)
                self._lost()
                return
            try:
                self._dispatch(json.loads(data), fds)
            except (ValueError, KeyError, TypeError) as e:
                log.warning("template process: a malformed message (%s)", e)
                for fd in fds:
                    os.close(fd)

    def _dispatch(self, msg: dict[str, Any], fds: list[int]) -> None:
        if "ready" in msg:
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg)
        elif "spawned" in msg:
            fut = self._pending.pop(msg["spawned"], None)
            pidfd = fds[0] if fds else -1
            if "pid" not in msg:
                if fut is not None and not fut.done():
                    fut.set_exception(ZygoteError(str(msg.get("error"))))
                return
            pid = int(msg["pid"])
            if fut is None or fut.done():  # its spawn() gave up waiting: no one will serve it
                log.warning("template process: killing pid %d, forked after its spawn gave up", pid)
                with contextlib.suppress(OSError):
                    if pidfd >= 0:
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                if pidfd >= 0:
                    os.close(pidfd)
                return
            self._starting[pid] = None
            fut.set_result((pid, pidfd))
        elif "exit" in msg:
            pid, code = int(msg["exit"]), int(msg["code"])
            child = self._children.pop(pid, None)
            if child is not None:
                child._set_exit(code)
            elif pid in self._starting:
                self._starting[pid] = code
            # else: a process no spawn() returned (killed above): nothing to tell

    def _kill_template(self, why: str) -> None:
        """The template hangs: kill it, and go on as when it dies (`_lost`)."""
        if self.proc is not None and self.proc.returncode is None:
            log.warning("template process (pid %d): %s; killing it", self.proc.pid, why)
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        self._lost(f"the template process was killed: {why}")

    def _lost(self, why: str = "the template process exited") -> None:
        """The zygote is gone: fail what waits on it; watch its children through their pidfds."""
        if self._sock is not None:
            if self._loop is not None:
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(self._sock)
            self._sock.close()
            self._sock = None
        error = ZygoteError(why)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)
        self._pending.clear()
        if self._loop is not None:
            for child in self._children.values():
                child._watch(self._loop)
        self._children.clear()

    async def spawn(self, argv: list[str], env: dict[str, str] | None = None) -> ForkedProcess:
        """Fork a process that runs `edgeinfer ARGV` with `env` added to its environment; its
        stdout and stderr come back together, line-buffered, on the result's `stdout`.

        The template made its imports under its own environment (the pool's): variables read at
        interpreter start or at import (PYTHON*, OMP_*, GOMP_*, MALLOC_*, EDGEINFER_CACHE and
        EDGEINFER_STORE) keep those values; `env` serves those read as the command runs (the
        worker's EDGEINFER_SECRET, EDGEINFER_REDIS, OTEL_*). ZygoteError if the template is gone
        or does not answer within SPAWN_TIMEOUT_S (it is then killed: `alive` turns False)."""
        if self._sock is None:
            raise ZygoteError("the template process is not running")
        loop = asyncio.get_running_loop()
        r, w = os.pipe2(os.O_CLOEXEC)
        # this call's own id: `self._ids` moves on with every spawn() begun meanwhile, and an
        # error path that took it dropped another call's wait (whose process was then killed as
        # abandoned, and the call failed after SPAWN_TIMEOUT_S)
        self._ids += 1
        sid = self._ids
        fut: asyncio.Future[tuple[int, int]] = loop.create_future()
        self._pending[sid] = fut
        try:
            try:
                _send(self._sock, {"spawn": sid, "argv": argv, "env": env or {}}, [w])
            except OSError as e:
                raise ZygoteError(f"the template process is not answering: {e}") from e
            finally:
                os.close(w)
            try:
                async with asyncio.timeout(SPAWN_TIMEOUT_S):
                    pid, pidfd = await fut
            except TimeoutError as e:
                # alive but not answering (stopped, deadlocked, swapped out): kept, it held every
                # later spawn for as long, and its pool never replaced it (it only replaces one
                # that is gone). Killed, it is gone: its workers are watched through their pidfds
                why = f"no answer from the template in {SPAWN_TIMEOUT_S:.0f}s"
                self._kill_template(why)
                raise ZygoteError(f"{why}: killed") from e
        except BaseException:
            self._pending.pop(sid, None)  # a late answer: its process is killed
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._kill_unreturned(*fut.result())  # answered, but this call was cancelled
            os.close(r)
            raise
        reader = asyncio.StreamReader(limit=1 << 20)
        pipe = os.fdopen(r, "rb", buffering=0)
        try:
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        except BaseException:  # cancelled here, the process would run on, tracked by no one
            self._kill_unreturned(pid, pidfd)
            pipe.close()
            raise
        child = ForkedProcess(pid, pidfd, reader)
        code = self._starting.pop(pid, None)
        if code is not None:  # it has exited already
            child._set_exit(code)
        elif self._sock is None:  # the template is gone
            child._watch(loop)
        else:
            self._children[pid] = child
        return child

    def _kill_unreturned(self, pid: int, pidfd: int) -> None:
        """Kill a process forked for a spawn() that ends without returning it."""
        self._starting.pop(pid, None)
        if pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)

    async def close(self) -> None:
        """Stop the zygote: it exits once its end of the socket sees ours close. Its children
        are left running (the pool stops its workers first)."""
        self._lost()
        if self.proc is not None and self.proc.returncode is None:
            try:
                async with asyncio.timeout(10.0):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="edgeinfer's worker template (started by a pool)")
    ap.add_argument("--fd", type=int, required=True, help="the control socket's descriptor")
    ap.add_argument("--title-room", default="",
                    help="ignored: room in the command line for the forked workers' titles")  # fmt: skip
    return serve(ap.parse_args(argv).fd)


if __name__ == "__main__":
    sys.exit(main())
