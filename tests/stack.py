"""Real processes for service tests: workers and gateways started as `edgeinfer` would start them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from kvstore.redis_server import find_free_port
from runtime.lifeline import Lifeline

ROOT = Path(__file__).resolve().parents[1]
SECRET = "test-secret"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def chat_model(src: Path, dst: Path) -> Path:
    """`src` served as a chat model from `dst`, its files linked, not copied. A model without a
    chat template (stories260K ships none) gets CHAT_TEMPLATE; one with its own keeps it."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if not (dst / f.name).exists():
            (dst / f.name).symlink_to(f)
    config = src / "tokenizer_config.json"
    if (src / "chat_template.jinja").is_file() or (
        config.is_file() and "chat_template" in orjson.loads(config.read_bytes())
    ):
        return dst
    template = dst / "chat_template.jinja"
    template.unlink(missing_ok=True)  # a link would write the template into `src`
    template.write_text(CHAT_TEMPLATE)
    return dst


@dataclass
class Proc:
    name: str  # for messages
    popen: subprocess.Popen[bytes]
    url: str  # base URL
    log: Path  # stdout + stderr
    port: int
    meta: dict[str, str] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> None:
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait()


def get_json(url: str, secret: str | None = None, timeout: float = 5.0) -> tuple[int, dict]:  # type: ignore[type-arg]
    req = urllib.request.Request(url, headers={"x-edgeinfer-secret": secret} if secret else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, orjson.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, orjson.loads(e.read() or b"{}")


def wait_until(check, timeout: float, what: str, proc: Proc | None = None) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, ValueError):
            pass
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
        time.sleep(0.05)
    tail = f"\n{proc.tail()}" if proc is not None else ""
    raise TimeoutError(f"timed out waiting for {what}{tail}")


def _spawn(name: str, args: list[str], log_dir: Path, port: int, url: str) -> Proc:
    log = log_dir / f"{name}.log"
    env = os.environ | {"EDGEINFER_SECRET": SECRET, "PYTHONUNBUFFERED": "1"} | _LIFELINE.env
    popen = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        pass_fds=_LIFELINE.pass_fds,
    )
    return Proc(name, popen, url, log, port)


# Workers and gateways started here stop by themselves if this process dies without stopping
# them (a test run killed, a script that crashed): no orphan keeps a port and a core.
_LIFELINE = Lifeline()


def start_worker(
    name: str,
    model: Path,
    redis_url: str,
    log_dir: Path,
    region: str = "local",
    extra: list[str] | None = None,
    served: str = "stories",
) -> Proc:
    def args(port: int) -> list[str]:
        return [
            "worker", "--model", str(model), "--served-model-name", served, "--region", region,
            "--port", str(port), "--redis", redis_url, "--threads", "1", "--kv-cache-bytes",
            "4000000", "--heartbeat", "0.3", "--ttl", "1.5", "--drain-timeout", "20",
            *(extra or []),
        ]  # fmt: skip

    def up(proc: Proc) -> bool:
        return get_json(f"{proc.url}/internal/health", SECRET)[0] == 200

    proc = _start(name, args, log_dir, up, 120, f"worker {name}")
    proc.meta["worker_id"] = get_json(f"{proc.url}/internal/health", SECRET)[1]["worker_id"]
    return proc


def _start(name: str, args, log_dir: Path, up, timeout: float, what: str) -> Proc:  # type: ignore[no-untyped-def]
    """Spawn `args(port)` on a free port and wait until `up(proc)`. Started again on another
    port when the process could not listen because something took its port in the meantime
    (the port is free when picked, but nothing holds it until the process binds it)."""
    for attempt in range(3):
        port = find_free_port()
        proc = _spawn(name, args(port), log_dir, port, f"http://127.0.0.1:{port}")
        try:
            with _stopped_on_failure(proc):
                wait_until(lambda p=proc: up(p), timeout, what, proc)
            return proc
        except RuntimeError:
            if attempt == 2 or "address already in use" not in proc.tail():
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _stopped_on_failure(proc: Proc) -> Iterator[None]:
    """A process that never came up is not left running (its caller never got its handle)."""
    try:
        yield
    except BaseException:
        proc.kill()
        raise


def start_gateway(
    name: str,
    redis_url: str,
    catalog: Path,
    log_dir: Path,
    region: str = "local",
    extra: list[str] | None = None,
) -> Proc:
    def args(port: int) -> list[str]:
        return [
            "gateway", "--region", region, "--port", str(port), "--redis", redis_url,
            "--regions", str(catalog), *(extra or []),
        ]  # fmt: skip

    return _start(name, args, log_dir, lambda p: get_json(f"{p.url}/healthz")[0] == 200, 30,
                  f"gateway {name}")  # fmt: skip


def start_pool(name: str, redis_url: str, log_dir: Path, models: str, extra: list[str]) -> Proc:
    """`edgeinfer pool` for region `local` (it serves no HTTP: its url is empty)."""
    args = ["pool", "--region", "local", "--models", models, "--redis", redis_url, *extra]
    return _spawn(name, args, log_dir, 0, "")


def worker_stats(worker: Proc) -> dict:  # type: ignore[type-arg]
    return get_json(f"{worker.url}/internal/stats", SECRET)[1]


def generate(worker: Proc, request_id: str, prompt: str, max_tokens: int,
             served: str = "stories") -> int:  # fmt: skip
    """POST /internal/generate to the worker itself (no gateway; `ignore_eos`, so exactly
    `max_tokens` tokens); its HTTP status, once the answer has ended."""
    body = {"request_id": request_id, "model": served, "prompt": prompt,
            "sampling": {"max_tokens": max_tokens, "ignore_eos": True}}  # fmt: skip
    req = urllib.request.Request(f"{worker.url}/internal/generate", data=orjson.dumps(body),
                                 headers={"x-edgeinfer-secret": SECRET}, method="POST")  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def spawned_ranks(pid: int, zombies: bool = True) -> list[int]:
    """Processes whose parent is `pid` and that multiprocessing spawned (ranks); `zombies`:
    with those that exited and wait to be reaped."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and b"spawn_main" in cmdline and (zombies or fields[0] != "Z"):
            found.append(int(entry))
    return found


ONE_REGION = "regions:\n  - {name: local, latitude: 0, longitude: 0, settings: {}}\n"


@contextlib.contextmanager
def stories_client(root: Path, stories_dir: Path) -> Iterator[Any]:
    """Redis, one stories260K worker (served as "stories", with the tests' chat template) and
    one gateway, in `root`: the real `openai` client to the gateway (no retries)."""
    import openai

    from kvstore.redis_server import LocalRedis

    (root / "regions.yaml").write_text(ONE_REGION)
    redis = LocalRedis().start()
    procs = []
    try:
        procs.append(start_worker("stories", chat_model(stories_dir, root / "stories"),
                                  redis.url, root))  # fmt: skip
        gateway = start_gateway("gw", redis.url, root / "regions.yaml", root)
        procs.append(gateway)
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["workers"] == 1, 30, "workers")
        yield openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0,
                            timeout=60)  # fmt: skip
    finally:
        for p in reversed(procs):
            p.stop()
        redis.stop()
