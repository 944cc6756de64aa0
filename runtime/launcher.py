"""`edgeinfer up`: the single-node stack (Redis, worker(s), gateway) as child processes.

Checks first that its ports are free and that a Redis it is given answers; starts a throwaway
Redis on a free local port unless one is configured, imports the default model on first use (in
this process, so its progress shows), starts the workers and the gateway with a fresh shared
secret, waits until its own gateway is ready (saying what is still missing every few seconds),
prints the URL and a curl to paste, and on Ctrl-C (or when any child dies) stops the gateway,
drains the workers, then stops Redis.

The children run in sessions of their own, so a Ctrl-C at the terminal reaches this process only
and the stack stops in that order; their output passes through this one. Should this process be
killed outright, they stop by themselves: the workers and the gateway watch its lifeline
(runtime.lifeline), and redis-server gets the kernel's parent-death signal.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

READY_TIMEOUT_S = 600.0  # a cold model load on a slow disk can take minutes
PROGRESS_EVERY_S = 5.0  # how often the wait for readiness says what it still waits for
STOP_TIMEOUT_S = 40.0  # after SIGTERM, how long a child has before SIGKILL (a safety net)
# How long a worker lets its in-flight requests run once `up` stops it; then each stream still
# running ends with a "shutdown" error event. Under the gateway's own drain (its --drain-timeout,
# 30 s by default, which `up` keeps), which it gives its streams before it ends them: a stream
# in flight at Ctrl-C finishes, or ends with that error and [DONE], instead of being cut off.
DRAIN_TIMEOUT_S = 3.0
REDIS_PING_TIMEOUT_S = 3.0
GATEWAY_READY = "gateway ready: "  # the line the gateway prints once it listens (gateway/app.py)
TAIL_LINES = 15  # a child's last output lines shown when it exits unasked


class _Child:
    """One child process of `up`, in a session of its own, its output (stdout and stderr)
    passed on to our stderr line by line; the last lines are kept, and `ready` is set once it
    prints a line starting with `ready_line`."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str],
                 pass_fds: tuple[int, ...] = (), ready_line: str | None = None) -> None:  # fmt: skip
        self.name = name  # for messages: "the gateway", "worker 1 (mixed, port 9001)"
        self.ready = threading.Event()
        self._ready_line = ready_line
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.popen = subprocess.Popen(
            cmd, env=env, pass_fds=pass_fds, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self._relay = threading.Thread(target=self._pass_output, name=name, daemon=True)
        self._relay.start()

    def _pass_output(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            line = raw.decode(errors="replace")
            self.tail.append(line.rstrip()[:4000])
            if self._ready_line is not None and line.startswith(self._ready_line):
                self.ready.set()
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):  # our stderr is gone: keep draining the pipe
                pass

    def exited(self) -> str | None:
        """None while it runs; else what to say: who exited, how, and its last lines."""
        code = self.popen.poll()
        if code is None:
            return None
        self._relay.join(timeout=1.0)  # (its last lines)
        how = f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
        tail = "".join(f"\n  | {line}" for line in self.tail) or " (it printed nothing)"
        return f"{self.name} {how}; its last lines:{tail}"

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        """Wait for it to exit (subprocess.TimeoutExpired after `timeout` s), and for its last
        lines to pass."""
        self.popen.wait(timeout=timeout)
        self._relay.join(timeout=1.0)


def _engine_flags(args: argparse.Namespace, worker: int = 0) -> list[str]:
    """The worker command-line flags for every engine option of `up` that is not at its default
    (all of `edgeinfer worker`'s engine options, so none is accepted by `up` and then dropped),
    for the `worker`-th worker: --dist-port is a port per worker (the next ones after the first:
    every worker's ranks meeting on one port, the second worker could not start)."""
    from runtime.cli import _engine_args  # runtime.cli imports this module's caller

    parser = argparse.ArgumentParser(add_help=False)
    _engine_args(parser)
    flags: list[str] = []
    for action in parser._actions:
        if action.dest == "model" or not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        if action.dest == "dist_port" and value:  # (0: a free one, for each worker)
            value += worker
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            flags.append(flag)
        elif isinstance(action, argparse._AppendAction):
            flags += [f for v in value for f in (flag, str(v))]
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def _ports_taken(ports: range, flag: str) -> None:
    """Refuse to start (SystemExit) when something on this machine holds one of `ports`."""
    from kvstore.redis_server import port_free

    taken = next((p for p in ports if not port_free(p)), None)
    if taken is not None:
        raise SystemExit(
            f"edgeinfer: error: port {taken} is taken; use edgeinfer up {flag} N "
            f"(make run ARGS='{flag} N')"
        )


def region_refusal(region: str, catalog_path: str | None = None) -> str | None:
    """Why `region` is refused: it is not in the catalog (`catalog_path`, --regions; default the
    packaged one, as the gateway's), naming the known ones; None when it is there. A catalog
    that does not load is a one-line SystemExit."""
    from gateway.regions import DEFAULT_CATALOG, CatalogError, RegionCatalog

    path = catalog_path or DEFAULT_CATALOG
    given = "--regions: " if catalog_path else ""  # (the packaged one: no flag to name)
    try:
        catalog = RegionCatalog.load(path)
    except CatalogError as e:
        raise SystemExit(f"edgeinfer: error: {given}{e}") from None
    except OSError as e:
        raise SystemExit(f"edgeinfer: error: {given}{path}: {e.strerror or e}") from None
    if region in catalog:
        return None
    return (f"--region {region!r} is not in the region catalog {path} "
            f"(known: {', '.join(sorted(catalog.regions))})")  # fmt: skip


def check_region(region: str, catalog_path: str | None = None) -> None:
    """Refuse to start (SystemExit) a region the catalog lacks (region_refusal). Our gateway
    refuses such a region, but only once it runs: `up` had started the workers by then, a model
    load and a Redis for nothing, and ended with the gateway's traceback in their output."""
    if (refusal := region_refusal(region, catalog_path)) is not None:
        raise SystemExit(f"edgeinfer: error: {refusal}")


def _chat_template(model_dir: str) -> bool:
    """Whether the model has a default chat template (chat_template.jinja, or a "chat_template"
    in its tokenizer_config.json, as runtime.tokenizer reads them): /v1/chat/completions then
    serves it; without one, only /v1/completions."""
    from runtime.tokenizer import _read_chat_templates

    try:
        config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = None
    try:
        templates = _read_chat_templates(Path(model_dir), config if isinstance(config, dict) else {})
    except ValueError:  # (TokenizerFileError: one the worker refuses chats for too)
        return False
    return "default" in templates


def _example(base: str, model: str, auth: str, chat: bool) -> str:
    """The curl `up` prints to paste: a chat completion, or a text completion for a model
    without a chat template (its chat completions are refused: 400, "has no chat template")."""
    if chat:
        path = "chat/completions"
        body = '"messages": [{"role": "user", "content": "Hello!"}]'
    else:
        path = "completions"
        body = '"prompt": "Once upon a time"'
    return (
        f"  curl {base}/v1/{path} -H 'Content-Type: application/json'{auth} \\\n"
        f"    -H 'x-session-affinity: my-session' \\\n"
        f'    -d \'{{"model": "{model}", {body}, "max_tokens": 64}}\'\n'
    )


def _check_redis(url: str) -> None:
    """Refuse to start (SystemExit) when the Redis we are given does not answer a PING."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from kvstore.client import cluster_seed

    try:
        # a Redis Cluster's URL: its seed node answers the PING (the stack's clients take the
        # cluster through it, kvstore.client.connect)
        node = cluster_seed(url) or url
        with redis.Redis.from_url(node, socket_connect_timeout=REDIS_PING_TIMEOUT_S,
                                  socket_timeout=REDIS_PING_TIMEOUT_S,
                                  retry=Retry(NoBackoff(), 0)) as client:  # fmt: skip
            client.ping()
    except (redis.exceptions.RedisError, ValueError, OSError) as e:
        raise SystemExit(
            f"edgeinfer: error: cannot reach Redis at {_shown(url)} ({e}); unset "
            "EDGEINFER_REDIS (or drop --redis) to use a throwaway one"
        ) from None


def _shown(url: str) -> str:
    """A Redis URL as printed: its password, if any, replaced (redis://:***@host)."""
    from runtime.proctitle import redact

    return redact([url])[0]


def _readyz(url: str) -> tuple[int, dict[str, object]]:
    """The gateway's /readyz: its status and body; (0, {}) when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:  # 503: not ready, and the body says why
        with e:
            return e.code, json.loads(e.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return 0, {}


def _missing(readyz: dict[str, object]) -> str:
    """What a /readyz body says the stack still lacks."""
    missing = []
    if not readyz.get("redis"):
        missing.append("Redis to answer the gateway")
    if not readyz.get("workers") and not readyz.get("pools"):
        missing.append("a worker to load the model and register")
    return " and ".join(missing) or "/readyz to answer 200"


def _unregistered(readyz: dict[str, object], workers: int) -> int:
    """How many of the `workers` started a ready /readyz body does not count yet."""
    registered = readyz.get("workers")
    return max(0, workers - registered) if isinstance(registered, int) else 0


def _wait_ready(
    url: str, gateway: _Child, children: list[_Child], timeout_s: float, workers: int = 1
) -> None:
    """Wait until our gateway (its own ready line: not another server on its port) answers
    `url` (/readyz) 200 with all `workers` registered (the first alone was "up" while a second,
    or a disaggregated pair's other role, was still loading); RuntimeError when a child exits
    first, or after `timeout_s`."""
    t0 = said = time.monotonic()
    missing = "the gateway to listen"
    while (now := time.monotonic()) < t0 + timeout_s:
        for child in children:
            if (exited := child.exited()) is not None:
                raise RuntimeError(exited)
        if gateway.ready.is_set():
            status, body = _readyz(url)
            if status != 200:
                missing = _missing(body)
            elif left := _unregistered(body, workers):
                missing = f"{left} of {workers} workers to load the model and register"
            else:
                return
        if now - said >= PROGRESS_EVERY_S:
            print(f"waiting for {missing} ({now - t0:.0f}s)", file=sys.stderr, flush=True)
            said = now
        time.sleep(0.25)
    raise RuntimeError(f"not ready after {timeout_s:.0f}s: still waiting for {missing}")


def _stop(what: str, children: list[_Child], t0: float) -> None:
    """Wait for `children`, signalled at `t0`, to exit; SIGKILL any still running after
    STOP_TIMEOUT_S."""
    deadline = t0 + STOP_TIMEOUT_S
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"{child.name} did not stop in {STOP_TIMEOUT_S:.0f}s; killing it",
                  file=sys.stderr)  # fmt: skip
            child.popen.kill()
            child.popen.wait()
    print(f"stopped {what} in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def up(args: argparse.Namespace) -> int:
    from kvstore.redis_server import LocalRedis, find_free_ports
    from runtime.cli import _model_dir
    from runtime.lifeline import Lifeline

    if args.workers < 1:
        raise SystemExit("edgeinfer: error: --workers must be at least 1")
    if args.roles is not None and args.workers != 1:  # (--workers was ignored)
        raise SystemExit("edgeinfer: error: --workers and --roles both say how many workers to "
                         "start; give one of them (--roles: one worker per role listed)")  # fmt: skip
    roles = args.roles.split(",") if args.roles is not None else ["mixed"] * args.workers
    bad = [r for r in roles if r not in ("mixed", "prefill", "decode")]
    if bad:
        raise SystemExit(f"edgeinfer: error: --roles: {bad} are not roles (mixed, prefill, decode)")
    check_region(args.region)
    # before anything starts: the ports (the workers' and their KV-transfer servers', when
    # given), and a Redis we are given
    _ports_taken(range(args.port, args.port + 1), "--port")
    given = {"--port": range(args.port, args.port + 1)}  # the ports each flag gives
    for flag, first, count in (("--worker-port", args.worker_port, 2 * len(roles)),
                               ("--dist-port", getattr(args, "dist_port", None), len(roles))):  # fmt: skip
        if first:
            if first + count - 1 > 65535:
                raise SystemExit(f"edgeinfer: error: {flag} {first}: the workers need {count} "
                                 f"ports from it, past 65535")  # fmt: skip
            _ports_taken(range(first, first + count), flag)
            for other, ports in given.items():  # free now, but two of ours would want one
                if first < ports.stop and ports.start < first + count:
                    raise SystemExit(
                        f"edgeinfer: error: {flag} {first}: the workers take ports {first}-"
                        f"{first + count - 1}, and {other} gives port "
                        f"{max(first, ports.start)} too; give ports that do not overlap"
                    )
            given[flag] = range(first, first + count)
    redis_url = args.redis or os.environ.get("EDGEINFER_REDIS")
    if redis_url is not None:
        _check_redis(redis_url)
    # Ctrl-C and SIGTERM both stop the stack. Set explicitly: a process started in the
    # background by a non-interactive shell inherits SIGINT ignored, and Python then keeps it so.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    model_dir = _model_dir(args.model)  # imports the default model on first use
    secret = os.environ.get("EDGEINFER_SECRET") or secrets.token_urlsafe(24)
    # the worker(s) and the gateway stop by themselves if this process is killed outright
    lifeline = Lifeline()
    env = os.environ | {"EDGEINFER_SECRET": secret, "PYTHONUNBUFFERED": "1"} | lifeline.env
    local_redis = None
    workers: list[_Child] = []
    gateway: _Child | None = None
    base = f"http://127.0.0.1:{args.port}"
    try:
        if redis_url is None:
            local_redis = LocalRedis(die_with_parent=True).start()  # (gone with us, however)
            redis_url = local_redis.url
            print(f"started redis-server on {redis_url}", file=sys.stderr)
        # the workers and the gateway take the Redis URL from their environment, not their
        # argv: a URL may hold a password, and a command line is anyone's to read on the node
        # (ps, /proc/PID/cmdline). Theirs only: redis-server, started before, never had it
        env["EDGEINFER_REDIS"] = redis_url
        # the workers' ports, then their KV-transfer servers': a free run unless told where
        ours = frozenset(p for ports in given.values() for p in ports)  # (--port, --dist-port)
        worker_port = args.worker_port or find_free_ports(2 * len(roles), ours)
        cli = [sys.executable, "-m", "runtime.cli"]
        for i, role in enumerate(roles):
            port = worker_port + i
            cmd = [
                *cli, "worker", "--model", model_dir, "--region", args.region,
                "--port", str(port),
                # the KV-transfer servers on the ports after the workers': on a free port each
                # (the default), the first worker's could take the next worker's port before
                # that worker bound it
                "--kv-port", str(worker_port + len(roles) + i),
                "--role", role,
                "--drain-timeout", str(DRAIN_TIMEOUT_S), *_engine_flags(args, i),
            ]  # fmt: skip
            workers.append(_Child(f"worker {i + 1} ({role}, port {port})", cmd, env,
                                  lifeline.pass_fds))  # fmt: skip
        keys = [f for k in args.api_key for f in ("--api-key", k)]
        gateway = _Child(
            f"the gateway (port {args.port})",
            [*cli, "gateway", "--region", args.region, "--port", str(args.port), *keys],
            env, lifeline.pass_fds, ready_line=GATEWAY_READY,
        )  # fmt: skip
        children = [gateway, *workers]
        _wait_ready(f"{base}/readyz", gateway, children, READY_TIMEOUT_S, len(workers))
        model = Path(model_dir).name
        # (the gateway takes $EDGEINFER_API_KEYS when no --api-key is given: so does the example)
        api_keys = args.api_key or [k for k in os.environ.get("EDGEINFER_API_KEYS", "").split(",") if k]
        auth = f' -H "Authorization: Bearer {api_keys[0]}"' if api_keys else ""
        print(
            f"\nedgeinfer is up: {base}/v1 (model {model!r}, workers: {', '.join(roles)}, "
            f"redis {_shown(redis_url)})\n\n"
            f"{_example(base, model, auth, _chat_template(model_dir))}\n"
            f"Ctrl-C stops everything.\n",
            flush=True,
        )
        while (exited := next(filter(None, (c.exited() for c in children)), None)) is None:
            time.sleep(0.5)
        print(f"edgeinfer: {exited}\nstopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # (a Redis we were given is left running: its data is not ours)
        redis_end = "then redis" if local_redis is not None else "leaving the given Redis running"
        print(f"\nstopping: gateway, then workers (draining, {DRAIN_TIMEOUT_S:.0f}s at most), "
              f"{redis_end}", file=sys.stderr)  # fmt: skip
        return 0
    except RuntimeError as e:
        print(f"edgeinfer: error: {e}", file=sys.stderr)
        return 1
    finally:
        # a second Ctrl-C or SIGTERM must not orphan the children
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # All signalled at once, the gateway first: it takes no new request from then on and
        # waits for its streams, which the workers finish or end (DRAIN_TIMEOUT_S) meanwhile
        t0 = time.monotonic()
        for child in [gateway, *workers]:
            if child is not None:
                child.terminate()
        if gateway is not None:
            _stop("the gateway", [gateway], t0)
        _stop(f"{len(workers)} worker(s)", workers, t0)
        if local_redis is not None:
            local_redis.stop()
            print("stopped redis-server", file=sys.stderr, flush=True)
