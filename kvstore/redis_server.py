"""A throwaway local `redis-server` for `edgeinfer up` and the test suite.

It binds 127.0.0.1 on a free port, keeps nothing on disk (no RDB, no AOF; its working folder is a
temporary directory), and can be stopped and started again on the same port, which is how tests
check that clients recover from a Redis restart. The server is a child process: `stop()` (or
leaving the `with` block, or the interpreter exiting) ends it; with `die_with_parent`, so does
the end of the thread that started it however it ends, SIGKILL included (Linux: the kernel's
parent-death signal), as `edgeinfer up`'s other children stop through their lifeline.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

START_TIMEOUT_S = 10.0  # how long start() waits for the first PONG
STOP_TIMEOUT_S = 5.0  # how long stop() waits after SIGTERM before SIGKILL


LOWEST_PICKED_PORT = 20000  # below this, ports are left to services people configure


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections (Linux's ip_local_port_range)."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return lo, hi


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, for a server we start.

    Picked at random outside the kernel's ephemeral range where there is room: a port the
    kernel picks (bind to 0) comes from the range it also hands to outgoing connections, and
    between our pick and the server's bind one of the many connections a busy host opens could
    take it (a worker then failed to start with "address already in use"). Within the range
    only when nothing is left outside it.
    """
    lo, hi = _ephemeral_range()
    spans = [(a, b) for a, b in ((LOWEST_PICKED_PORT, lo - 1), (hi + 1, 65535)) if a <= b]
    total = sum(b - a + 1 for a, b in spans)
    for _ in range(64 if total else 0):
        k = random.randrange(total)
        for a, b in spans:
            if k <= b - a:
                if port_free(a + k):
                    return a + k
                break
            k -= b - a + 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    """True when a server could listen on 127.0.0.1:`port` now: nothing listens on it, there
    or on every interface (SO_REUSEADDR, as asyncio's servers bind: a port whose last
    connections linger in TIME_WAIT counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def find_free_ports(n: int, avoid: frozenset[int] = frozenset()) -> int:
    """The first of `n` consecutive TCP ports on 127.0.0.1 that nothing listens on right now,
    none of them in `avoid` (for what takes a port and the ones after it, as `edgeinfer up`
    does for its workers and their KV-transfer servers)."""
    for _ in range(100):
        first = find_free_port()
        ports = range(first, first + n)
        if first + n <= 65536 and not avoid.intersection(ports) and all(map(port_free, ports)):
            return first
    raise OSError(f"no {n} consecutive free ports found on 127.0.0.1")


def _ping(port: int) -> bool:
    """True when a Redis on `port` answers PING."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited in STOP_TIMEOUT_S; always reaps it."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent thread ends


def _parent_death_signal(parent: int) -> Callable[[], None]:
    """What the child runs before redis-server's exec: SIGTERM when the parent is gone (and at
    once, should it have gone before this ran). prctl is looked up here, before the fork: the
    child only calls prctl, getppid and kill."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


class LocalRedis:
    """One local redis-server child process; see the module docstring."""

    def __init__(self, port: int | None = None, executable: str = "redis-server",
                 die_with_parent: bool = False, args: tuple[str, ...] = ()) -> None:  # fmt: skip
        found = shutil.which(executable)
        if found is None:
            raise RuntimeError(
                f"{executable!r} is not on PATH: run `make setup` or `apt-get install redis-server`"
            )
        self.executable = found  # absolute path of redis-server
        self.die_with_parent = die_with_parent
        self.args = args  # further redis-server options (LocalRedisCluster's cluster mode)
        self.port = port if port is not None else find_free_port()  # kept across restarts
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None  # working folder and log
        self._finalizer: weakref.finalize[[subprocess.Popen[bytes]], LocalRedis] | None = None

    @property
    def url(self) -> str:
        """redis://127.0.0.1:<port>/0"""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        """True while the child process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> LocalRedis:
        """Start the server on `self.port` (the same port after a stop) and wait for PONG."""
        if self.running:
            return self
        self.stop()  # a server that died by itself leaves its folder behind
        self._dir = tempfile.TemporaryDirectory(prefix="edgeinfer-redis-")
        log = Path(self._dir.name) / "redis.log"
        cmd = [
            self.executable,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--logfile", str(log),
            "--daemonize", "no",
            *self.args,
        ]  # fmt: skip
        # In a session of its own: a Ctrl-C at the terminal signals the whole foreground
        # process group, and the server must outlive its clients (`edgeinfer up` stops it last)
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            preexec_fn=_parent_death_signal(os.getpid()) if self.die_with_parent else None,
            start_new_session=True,
        )  # fmt: skip
        self._finalizer = weakref.finalize(self, _terminate, self._proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ping(self.port):
            exited = self._proc.poll()
            if exited is not None or time.monotonic() > deadline:
                why = f"exited with code {exited}" if exited is not None else "did not answer PING"
                tail = self._log_tail(log)
                self.stop()
                raise RuntimeError(
                    f"redis-server on port {self.port} {why} within {START_TIMEOUT_S:.0f} s; "
                    f"log tail:\n{tail}"
                )
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and delete its working folder. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()  # runs _terminate once, and no more at interpreter exit
            self._finalizer = None
        self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    @staticmethod
    def _log_tail(log: Path, lines: int = 20) -> str:
        try:
            return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) or "(empty)"
        except OSError as e:
            return f"(no log: {e})"

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


CLUSTER_SLOTS = 16384  # hash slots of a Redis Cluster


class LocalRedisCluster:
    """A throwaway local Redis Cluster of `primaries` primaries (no replicas), each a LocalRedis
    in cluster mode on a free port, its cluster bus on another: for tests of the code that
    shares state through a cluster (connect it with `url`, a redis+cluster:// URL).

    The slots are split evenly in order (the first node holds 0..., the last ...16383), and
    start() returns once every node sees them all served (cluster_state:ok), about 2 s (a new
    primary waits that long before it serves). Needs redis-server 7 or later (--cluster-port).
    """

    def __init__(self, primaries: int = 3, executable: str = "redis-server") -> None:
        if primaries < 1:
            raise ValueError(f"primaries must be >= 1, got {primaries}")
        ports: set[int] = set()
        while len(ports) < 2 * primaries:
            ports.add(find_free_port())
        picked = sorted(ports)
        self.bus_ports = picked[primaries:]  # the nodes' cluster bus ports, in order
        self.nodes: list[LocalRedis] = []
        for port, bus in zip(picked[:primaries], self.bus_ports, strict=True):
            args = (
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",  # (in the node's own working folder)
                "--cluster-port", str(bus),
            )  # fmt: skip
            self.nodes.append(LocalRedis(port, executable, args=args))

    @property
    def url(self) -> str:
        """redis+cluster://127.0.0.1:<the first node's port>"""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def slots(self, i: int) -> range:
        """The hash slots that start() gives node `i` (an index in `nodes`)."""
        n = len(self.nodes)
        return range(i * CLUSTER_SLOTS // n, (i + 1) * CLUSTER_SLOTS // n)

    def node_of(self, key: str) -> int:
        """The index in `nodes` of the node that serves `key` (its hash tag's slot)."""
        from redis.crc import key_slot

        slot = key_slot(key.encode())
        return next(i for i in range(len(self.nodes)) if slot in self.slots(i))

    def start(self) -> LocalRedisCluster:
        """Start the nodes, assign the slots, join the nodes, and wait for cluster_state:ok."""
        import redis  # (here: `edgeinfer up` imports this module for LocalRedis alone)

        clients: list[redis.Redis] = []
        try:
            for node in self.nodes:
                node.start()
                clients.append(redis.Redis(port=node.port, socket_timeout=START_TIMEOUT_S))
            for i, c in enumerate(clients):
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                c.execute_command("CLUSTER", "ADDSLOTS", *self.slots(i))
            for c in clients[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port,
                                  self.bus_ports[0])  # fmt: skip
            deadline = time.monotonic() + START_TIMEOUT_S
            while not all(_cluster_ok(c, len(clients)) for c in clients):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"local Redis Cluster on ports {[nd.port for nd in self.nodes]} did not "
                        f"reach cluster_state:ok within {START_TIMEOUT_S:.0f} s"
                    )
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        finally:
            for c in clients:
                c.close()
        return self

    def stop(self) -> None:
        """Stop every node and delete their working folders. Idempotent."""
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _cluster_ok(client: Any, nodes: int) -> bool:
    """True when the node behind `client` (a sync redis.Redis) knows `nodes` nodes and sees
    every slot served."""
    info = client.cluster("INFO")
    return bool(
        info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == nodes
    )
