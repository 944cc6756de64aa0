"""`edgeinfer up`: the single-node stack (Redis, worker(s), gateway) as child processes.

Starts a throwaway Redis on a free local port unless one is configured, imports the default
model on first use (in this process, so its progress shows), starts the workers and the gateway
with a fresh shared secret, waits until the gateway is ready, prints the URL and a curl to paste,
and on Ctrl-C (or when any child dies) stops the gateway, drains the workers, then stops Redis.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

READY_TIMEOUT_S = 600.0  # a cold model load on a slow disk can take minutes
STOP_TIMEOUT_S = 40.0  # workers drain in-flight requests (30 s) before they exit


def _engine_flags(args: argparse.Namespace) -> list[str]:
    """The worker command-line flags for every engine option of `up` that is not at its default
    (all of `edgeinfer worker`'s engine options, so none is accepted by `up` and then dropped)."""
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


def _wait_ready(url: str, procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args!r} exited with code {p.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"not ready after {timeout_s:.0f}s: {url}")


def _stop(what: str, procs: list[subprocess.Popen[bytes]]) -> None:
    t0 = time.monotonic()
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = t0 + STOP_TIMEOUT_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"{what} did not stop in {STOP_TIMEOUT_S:.0f}s; killing it", file=sys.stderr)
            p.kill()
            p.wait()
    print(f"stopped {what} in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def up(args: argparse.Namespace) -> int:
    from kvstore.redis_server import LocalRedis, find_free_ports
    from runtime.cli import _model_dir
    from runtime.lifeline import Lifeline

    if args.workers < 1:
        raise SystemExit("edgeinfer: error: --workers must be at least 1")
    roles = args.roles.split(",") if args.roles else ["mixed"] * args.workers
    bad = [r for r in roles if r not in ("mixed", "prefill", "decode")]
    if bad:
        raise SystemExit(f"edgeinfer: error: --roles: {bad} are not roles (mixed, prefill, decode)")
    # Ctrl-C and SIGTERM both stop the stack. Set explicitly: a process started in the
    # background by a non-interactive shell inherits SIGINT ignored, and Python then keeps it so.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    model_dir = _model_dir(args.model)  # imports the default model on first use
    secret = os.environ.get("EDGEINFER_SECRET") or secrets.token_urlsafe(24)
    # the worker(s) and the gateway stop by themselves if this process is killed outright
    lifeline = Lifeline()
    env = os.environ | {"EDGEINFER_SECRET": secret, "PYTHONUNBUFFERED": "1"} | lifeline.env
    redis_url = args.redis or os.environ.get("EDGEINFER_REDIS")
    local_redis = None
    if redis_url is None:
        local_redis = LocalRedis(die_with_parent=True).start()  # (gone with us, however we end)
        redis_url = local_redis.url
        print(f"started redis-server on {redis_url}", file=sys.stderr)
    # the workers' ports, then their KV-transfer servers': a free run unless told where
    worker_port = args.worker_port or find_free_ports(2 * len(roles), frozenset({args.port}))
    cli = [sys.executable, "-m", "runtime.cli"]
    workers = [
        subprocess.Popen(
            [
                *cli,
                "worker",
                "--model",
                model_dir,
                "--region",
                args.region,
                "--port",
                str(worker_port + i),
                # the KV-transfer servers on the ports after the workers': on a free port each
                # (the default), the first worker's could take the next worker's port before
                # that worker bound it
                "--kv-port",
                str(worker_port + len(roles) + i),
                "--redis",
                redis_url,
                "--role",
                role,
                *_engine_flags(args),
            ],
            env=env,
            pass_fds=lifeline.pass_fds,
        )
        for i, role in enumerate(roles)
    ]
    keys = [f for k in args.api_key for f in ("--api-key", k)]
    gateway = subprocess.Popen(
        [*cli, "gateway", "--region", args.region, "--port", str(args.port), "--redis", redis_url,
         *keys],
        env=env, pass_fds=lifeline.pass_fds,
    )  # fmt: skip
    procs = [gateway, *workers]
    base = f"http://127.0.0.1:{args.port}"
    try:
        _wait_ready(f"{base}/readyz", procs, READY_TIMEOUT_S)
        model = Path(model_dir).name
        auth = f' -H "Authorization: Bearer {args.api_key[0]}"' if args.api_key else ""
        print(
            f"\nedgeinfer is up: {base}/v1 (model {model!r}, workers: {', '.join(roles)}, "
            f"redis {redis_url})\n\n"
            f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            f"    -H 'x-session-affinity: my-session' \\\n"
            f'    -d \'{{"model": "{model}", "messages": [{{"role": "user", "content": '
            f'"Hello!"}}], "max_tokens": 64}}\'\n\n'
            f"Ctrl-C stops everything.\n",
            flush=True,
        )
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        dead = next(p for p in procs if p.poll() is not None)
        print(f"edgeinfer: a child exited (code {dead.returncode}); stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping: gateway, then workers (draining), then redis", file=sys.stderr)
        return 0
    except RuntimeError as e:
        print(f"edgeinfer: error: {e}", file=sys.stderr)
        return 1
    finally:
        # a second Ctrl-C or SIGTERM must not orphan the children
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop("the gateway", [gateway])
        _stop(f"{len(workers)} worker(s)", workers)
        if local_redis is not None:
            local_redis.stop()
            print("stopped redis-server", file=sys.stderr, flush=True)
