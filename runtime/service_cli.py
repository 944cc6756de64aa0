"""The service commands of the `edgeinfer` CLI: worker, gateway, up, set-role, rebalance.

Environment variables are read here only (the entry point):
  EDGEINFER_SECRET    the workers' shared secret (gateways and workers must agree)
  EDGEINFER_REDIS     the cluster state's Redis URL
  EDGEINFER_API_KEYS  comma-separated bearer tokens the gateway accepts (unset = open)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, NoReturn

from runtime.cli import (
    _at_least,
    name_flags,
    non_negative_int,
    port_arg,
    port_or_zero,
    positive_float,
)

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
API_KEY_HELP = ("accepted bearer token (repeatable; default: $EDGEINFER_API_KEYS, comma-separated; "
                "none: the API is open)")  # fmt: skip




def _host_for_url(host: str) -> str:
    """The host of the URL a worker advertises when none is given (--advertise-url): where it
    listens, this machine's loopback for every interface (IPv4's for 0.0.0.0; IPv6's for "::",
    on which it listens IPv6 only: 127.0.0.1 was advertised, and nothing answered there), an
    IPv6 address in brackets (without them "http://::1:8000" is no URL)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _check_advertise_url(url: str | None) -> None:
    """Refuse (a one-line SystemExit) an --advertise-url that is no http(s)://HOST[:PORT] URL:
    the worker registered it and said it was ready, and no gateway could reach it
    ("10.0.0.5:9001", without the scheme, is read as scheme "10.0.0.5")."""
    if url:  # (none, or "": the default, as a deployment's empty variable gives it)
        _check_http_url(url, "--advertise-url")


def _check_http_url(url: str, name: str) -> None:
    """Refuse (a one-line SystemExit naming `name`) a URL that is no http(s)://HOST[:PORT]."""
    import urllib.parse

    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is not one)
    except ValueError as e:
        raise SystemExit(f"edgeinfer: error: {name} {url!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SystemExit(f"edgeinfer: error: {name} {url!r} is not an http:// or https:// URL "
                         "with a host, e.g. http://10.0.0.5:9001")  # fmt: skip


def _check_worker_args(text: str, worker_args: list[str]) -> None:
    """Refuse (a one-line SystemExit) --worker-args that `edgeinfer worker` refuses (a flag it
    does not have, a bad value, a speculative option without its method): every worker the pool
    started exited at once with that usage error, and was started again, and again."""
    from runtime.cli import build_parser, check_speculative_flags

    subparsers = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    worker = subparsers.choices["worker"]

    def refuse(message: str) -> NoReturn:
        raise SystemExit(f"edgeinfer: error: --worker-args {text!r}: {message}")

    worker.error = refuse  # type: ignore[method-assign]
    args = worker.parse_args(["--model", "MODEL", *worker_args])  # (the pool gives --model)
    try:
        check_speculative_flags(args)
    except SystemExit as e:
        refuse(str(e.code).removeprefix("edgeinfer: error: "))


def _check_listen(host: str, port: int, flag: str, what: str) -> None:
    """Refuse (a one-line SystemExit naming `flag`) a port something listens on already, where
    the worker would listen (`host`), before the model loads (it loaded, then the server
    failed to bind; the --kv-port error named no flag). SO_REUSEADDR, as asyncio's servers
    bind: a port whose last connections linger in TIME_WAIT is free."""
    import socket

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)  # fmt: skip
    except socket.gaierror as e:
        raise SystemExit(f"edgeinfer: error: --host {host!r}: {e.strerror or e}") from None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                # (lower-case, as asyncio's bind error says it, which tests/stack.py retries)
                raise SystemExit(
                    f"edgeinfer: error: {flag} {port}: the {what} cannot listen on "
                    f"{host}:{port}: {(e.strerror or str(e)).lower()}; give another {flag}"
                ) from None


def _check_key_id(value: str, what: str) -> None:
    """Refuse (a one-line SystemExit naming `what`) a value no registry key can hold (the keys
    put ids in a Redis Cluster hash tag: kvstore.keys.check_id)."""
    from kvstore.keys import check_id

    try:
        check_id(value, what)
    except ValueError as e:
        raise SystemExit(f"edgeinfer: error: {e}") from None


def _check_region_or_warn(region: str, catalog: str | None) -> None:
    """A worker's or a pool's --region the catalog lacks: refused (a one-line SystemExit) when
    the catalog was given (--regions FILE, as its gateways are); else, against the packaged
    catalog, a warning: a deployment's gateways may read a catalog of their own (infra/deploy.py
    mounts it for them, --regions), which a worker is not given. A region no gateway's catalog
    has (`--region eu-wset`) registered, and gateways routed to it as another region's."""
    from runtime.launcher import region_refusal

    _check_key_id(region, "--region")  # (an error, not a catalog warning before it)
    refusal = region_refusal(region, catalog)
    if refusal is None:
        return
    if catalog is not None:
        raise SystemExit(f"edgeinfer: error: {refusal}")
    print(f"edgeinfer: warning: {refusal}; gateways whose catalog lacks it route to it as "
          "another region's (a typo?); give --regions FILE, the gateways' catalog, to refuse "
          "a region it lacks", file=sys.stderr, flush=True)  # fmt: skip


def _check_worker_flags(args: argparse.Namespace) -> None:
    """Refuse (a one-line SystemExit naming the flag) what WorkerConfig or the Redis registry
    would refuse only once the model had loaded, in its own field names ("need 0 < heartbeat_s
    < ttl_s"), or what a server would fail to bind then: before anything loads."""
    _check_region_or_warn(args.region, args.regions)
    for flag, value in (("--served-model-name", args.served_model_name),
                        ("--worker-id", args.worker_id)):  # fmt: skip
        if value is not None:
            _check_key_id(value, flag)
    if args.heartbeat <= 0:
        raise SystemExit(f"edgeinfer: error: --heartbeat must be > 0 seconds, got {args.heartbeat}")
    if args.ttl <= args.heartbeat:
        raise SystemExit(f"edgeinfer: error: --ttl ({args.ttl}) must be longer than --heartbeat "
                         f"({args.heartbeat}): the registry entry would expire between heartbeats")  # fmt: skip
    for flag, value, least, strict in (("--drain-timeout", args.drain_timeout, 0, False),
                                       ("--kv-hold", args.kv_hold, 0, True),
                                       ("--kv-import-wait", args.kv_import_wait, 0, False),
                                       ("--max-body-bytes", args.max_body_bytes, 1024, False)):  # fmt: skip
        if (value <= least) if strict else (value < least):
            limit = f"> {least}" if strict else f"at least {least}"
            raise SystemExit(f"edgeinfer: error: {flag} must be {limit}, got {value}")
    if args.kv_port and args.kv_port == args.port:
        raise SystemExit(f"edgeinfer: error: --kv-port {args.kv_port} is --port too; give "
                         "another (0: a free one)")  # fmt: skip
    _check_listen(args.host, args.port, "--port", "worker")
    if args.kv_port:  # (0: a free one, chosen when it listens)
        _check_listen(args.host, args.kv_port, "--kv-port", "worker's KV-transfer server")


def _secret(args: argparse.Namespace) -> str:
    secret = args.secret or os.environ.get("EDGEINFER_SECRET", "")
    if not secret:
        raise SystemExit(
            "edgeinfer: error: the workers' shared secret is required: --secret or EDGEINFER_SECRET"
        )
    return str(secret)


def _run(main: Coroutine[Any, Any, None]) -> None:
    """Run a server's main coroutine on uvloop: about half the per-hop cost of asyncio's loop."""
    import uvloop

    uvloop.run(main)


def _logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _process_age_s() -> float:
    """Seconds since this process started (Linux: /proc), for the start-up timeline."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


_at_least_64 = _at_least(64)  # kvstore.telemetry.CONTENT_MIN_CHARS (not imported: it loads the SDK)


def _telemetry_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--otlp-endpoint", default=None,
        help="OpenTelemetry collector, OTLP over HTTP (e.g. http://collector:4318): traces and "
        "metrics go there (default $OTEL_EXPORTER_OTLP_ENDPOINT; none: /metrics only)",
    )  # fmt: skip
    p.add_argument(
        "--otel-content", action="store_true",
        help="record prompts and outputs on spans (default off; also "
        "$OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true)",
    )  # fmt: skip
    p.add_argument(
        "--otel-content-max-chars", type=_at_least_64, default=None, metavar="N",
        help="with --otel-content, a prompt or output longer than N characters is cut to N, "
        "saying so (default 16384)",
    )  # fmt: skip
    p.add_argument("--otel-sample-ratio", type=float, default=1.0,
                   help="fraction of traces kept: new ones and, at the gateway, a client's "
                   "(whose sampled flag is not obeyed); a worker follows its gateway's "
                   "(default %(default)s)")  # fmt: skip


def _telemetry_config(args: argparse.Namespace, service: str, region: str, instance: str = ""):  # type: ignore[no-untyped-def]
    from kvstore.telemetry import CONTENT_MAX_CHARS, TelemetryConfig, content_capture_from_env

    return TelemetryConfig(
        service=service,
        region=region,
        instance=instance,
        otlp_endpoint=args.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None,
        record_content=args.otel_content or content_capture_from_env(os.environ),
        trace_sample_ratio=args.otel_sample_ratio,
        content_max_chars=args.otel_content_max_chars or CONTENT_MAX_CHARS,
        # (the gateway's callers are the public: their sampled flags are not obeyed)
        trust_remote_sampled=service != "edgeinfer-gateway",
    )


def cmd_worker(args: argparse.Namespace) -> int:
    # No cyclic garbage collection while starting: the imports and the engine allocate hundreds
    # of thousands of objects and no garbage to speak of, and the collector's passes over them
    # cost ~0.2 s of the ~1.4 s of imports (measured). Once the engine is up, what start-up made
    # is frozen (never scanned again) and collection resumes.
    import gc

    gc.disable()
    from runtime.cli import DEFAULT_CACHE, _model_dir, engine_kwargs, start_weights_early

    _logging()
    _check_advertise_url(args.advertise_url)  # before the model loads
    _check_worker_flags(args)
    _secret(args)
    model_dir = _model_dir(args.model)
    if args.served_model_name is None:  # (served under the folder's name: the same rule)
        _check_key_id(Path(model_dir).name, "the model folder's name (give --served-model-name)")
    # Start reading the weights now (a folder that cannot be served stops us here): the imports
    # below and the engine's own set-up run while the drive works. Split over ranks, this
    # starts the others and waits for their reads: a phase of its own, not imports.
    ranks_from = time.perf_counter()
    weights = start_weights_early(model_dir, args)
    ranks_started = (ranks_from, time.perf_counter()) if weights.ranks is not None else None
    from runtime.async_engine import AsyncLLM
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.worker import WorkerConfig, serve

    imports_done = time.perf_counter()
    process_start = imports_done - _process_age_s()
    host_for_url = _host_for_url(args.host)
    config = WorkerConfig(
        model_name=args.served_model_name or Path(model_dir).name,
        region=args.region,
        role=args.role,
        host=args.host,
        port=args.port,
        url=args.advertise_url or f"http://{host_for_url}:{args.port}",
        secret=_secret(args),
        redis_url=None
        if args.no_redis
        else (args.redis or os.environ.get("EDGEINFER_REDIS", DEFAULT_REDIS)),
        heartbeat_s=args.heartbeat,
        ttl_s=args.ttl,
        drain_timeout_s=args.drain_timeout,
        kv_port=args.kv_port,
        kv_hold_s=args.kv_hold,
        kv_import_wait_s=args.kv_import_wait,
        worker_id=args.worker_id or "",
        tool_call_parser=args.tool_call_parser,
        max_body_bytes=args.max_body_bytes,
    )
    config.telemetry = _telemetry_config(args, "edgeinfer-worker", args.region, config.worker_id)
    engine = LLMEngine(
        EngineConfig(
            model=model_dir,
            max_waiting=args.max_waiting,
            enable_prefix_caching=not args.no_prefix_caching,
            **engine_kwargs(args),  # type: ignore[arg-type]
        ),
        weights,
    )
    gc.freeze()
    gc.enable()
    from runtime.drive import describe

    drive = describe(DEFAULT_CACHE, Path(model_dir))
    startup = engine.startup
    print(startup.timeline(process_start, imports_done, drive, ranks_started), flush=True)
    phases = {"imports": imports_done - process_start, "total": startup.ready - process_start}
    if ranks_started is not None:
        phases["ranks started"] = ranks_started[1] - ranks_started[0]
        phases["imports"] -= phases["ranks started"]
    phases |= {name: end - start for name, (start, end) in startup.phases.items()}
    _run(serve(config, AsyncLLM(engine), phases))
    # Drained, deregistered, sockets closed: nothing is left to finish. The interpreter's own
    # teardown (every module of torch, triton and the rest) took ~1.4 s here after the last
    # atexit handler, during which a pool manager waits for the exit and the process holds its
    # memory and a core; skip it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cmd_drive_rate(args: argparse.Namespace) -> int:
    """Measure the drive's sequential O_DIRECT read rate and remember it for worker timelines."""
    from runtime.cli import DEFAULT_CACHE, _model_dir
    from runtime.drive import measure, remember

    path = Path(args.path or _model_dir(None))
    print(f"reading up to {args.gb:g} GB of {path} with O_DIRECT, 8 MiB at a time...")
    try:
        rate = measure(path, int(args.gb * 1e9))
    except OSError as e:
        print(f"edgeinfer: error: cannot measure {path}: {e}", file=sys.stderr)
        return 2
    cache = remember(DEFAULT_CACHE, path, rate)
    print(f"{rate.device}: {rate.gb_per_s:.2f} GB/s ({rate.bytes / 1e9:.2f} GB read); "
          f"remembered in {cache}")  # fmt: skip
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.app import serve

    _logging()
    keys = args.api_key or [k for k in os.environ.get("EDGEINFER_API_KEYS", "").split(",") if k]
    secret = _secret(args)
    try:
        config = _gateway_config(args, keys, secret)
    except ValueError as e:  # (its messages name its fields: the flags are named instead)
        message = name_flags(str(e).replace(" port (--port)", " --port"), GATEWAY_FLAGS)
        raise SystemExit(f"edgeinfer: error: {message}") from None
    _run(serve(config))
    return 0


# GatewayConfig's fields and the `edgeinfer gateway` flags that set them
GATEWAY_FLAGS = {
    "worker_idle_timeout_s": "--worker-idle-timeout",
    "body_timeout_s": "--body-timeout",
    "idle_timeout_s": "--idle-timeout",
    "hold_timeout_s": "--hold-timeout",
    "drain_timeout_s": "--drain-timeout",
    "client_write_timeout_s": "--client-write-timeout",
    "max_request_seqs": "--max-request-seqs",
    "pool_gone_grace_s": "--pool-gone-grace",
    "disagg_min_tokens": "--disagg-min-tokens",
    "max_body_bytes": "--max-body-bytes",
    "metrics_port": "--metrics-port",
    "cors_origins": "--cors-origins",
    "api keys": "--api-key values",
    "routing": "--routing",
}


def _gateway_config(args: argparse.Namespace, keys: list[str], secret: str):  # type: ignore[no-untyped-def]
    from gateway.config import GatewayConfig

    return GatewayConfig(
        region=args.region,
        redis_url=args.redis or os.environ.get("EDGEINFER_REDIS", DEFAULT_REDIS),
        worker_secret=secret,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        api_keys=frozenset(keys),
        cors_origins=frozenset(o.strip() for o in args.cors_origins.split(",") if o.strip()),
        catalog_path=Path(args.regions),
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        idle_timeout_s=args.idle_timeout,
        worker_idle_timeout_s=args.worker_idle_timeout,
        routing=args.routing,
        disagg_min_tokens=args.disagg_min_tokens,
        hold_timeout_s=args.hold_timeout,
        drain_timeout_s=args.drain_timeout,
        client_write_timeout_s=args.client_write_timeout,
        max_request_seqs=args.max_request_seqs,
        pool_gone_grace_s=args.pool_gone_grace,
        telemetry=_telemetry_config(args, "edgeinfer-gateway", args.region),
    )


def cmd_set_role(args: argparse.Namespace) -> int:
    """Change a running worker's role (it drains the old role's work first)."""
    import urllib.error
    import urllib.request

    import orjson

    url = args.worker_url
    _check_http_url(url, "worker_url")
    req = urllib.request.Request(
        f"{url.rstrip('/')}/internal/role",
        data=orjson.dumps({"role": args.role}),
        headers={"x-edgeinfer-secret": _secret(args), "Content-Type": "application/json"},
        method="POST",
    )
    print(f"asking {args.worker_url} to switch to {args.role} (drains its work first)...")
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            body = orjson.loads(resp.read())
    except urllib.error.HTTPError as e:
        with e:
            try:  # (an edgeinfer worker's OpenAI-style error; another server's page: its reason)
                err = orjson.loads(e.read() or b"{}").get("error", {})
                message = err.get("message", e.reason) if isinstance(err, dict) else e.reason
            except (orjson.JSONDecodeError, AttributeError, OSError):
                message = e.reason
        print(f"edgeinfer: error: {url} refused ({e.code}): {message}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as e:  # (as other commands: status 2)
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        if isinstance(reason, TimeoutError):  # (reached: its drain outlasted --timeout)
            raise SystemExit(f"edgeinfer: error: the worker at {url} did not answer in "
                             f"--timeout {args.timeout:g} s (its drain may still be going "
                             "on)") from None  # fmt: skip
        raise SystemExit(f"edgeinfer: error: cannot reach the worker at {url} ({reason})") from None
    print(f"role {body['previous']} -> {body['role']} after draining {body['drained_s']:.2f}s")
    return 0


def cmd_rebalance(args: argparse.Namespace) -> int:
    """Set how many of a model's prefill/decode workers do prefill."""
    from kvstore.client import connect
    from kvstore.registry import Registry
    from runtime.pool import apply, plan

    secret = _secret(args)
    redis_url = args.redis or os.environ.get("EDGEINFER_REDIS", DEFAULT_REDIS)

    async def main() -> int:
        redis = connect(redis_url)
        try:
            workers = await Registry(redis).workers(args.model)
        finally:
            await redis.aclose()
        try:
            changes = plan(workers, args.model, args.region, args.prefill)
        except ValueError as e:
            print(f"edgeinfer: error: {e}", file=sys.stderr)
            return 2
        if not changes:
            print(f"nothing to do: {args.prefill} prefill worker(s) already")
            return 0
        for c in changes:
            print(f"{c.worker.worker_id}: {c.worker.role} -> {c.role} (draining its work first)")
        await apply(changes, secret, args.timeout)
        for c in changes:
            print(f"{c.worker.worker_id}: {c.result}")
        return 0 if all(c.result.startswith("ok") for c in changes) else 1

    return asyncio.run(main())


def cmd_pool(args: argparse.Namespace) -> int:
    """Start and stop local workers as demand in Redis asks (scale from zero)."""
    from runtime.cli import _model_dir
    from runtime.model_specs import parse_models
    from runtime.pool_manager import PoolConfig, serve

    _logging()
    redis_url = args.redis or os.environ.get("EDGEINFER_REDIS", DEFAULT_REDIS)
    if args.events:
        return _print_pool_events(redis_url, args.region, args.events, args.regions)
    _check_region_or_warn(args.region, args.regions)
    if not args.models:
        raise SystemExit("edgeinfer: error: --models is required (e.g. --models M1,M2)")
    try:  # shell words: a quoted argument (a path with spaces) stays one
        worker_args = shlex.split(args.worker_args)
    except ValueError as e:  # shlex's "No closing quotation", "No escaped character"
        raise SystemExit(f"edgeinfer: error: --worker-args {args.worker_args!r}: {e}") from e
    if args.regions is not None and "--regions" not in worker_args:  # (its workers check too)
        worker_args += ["--regions", args.regions]
    try:
        models = parse_models(args.models, lambda name: _model_dir(name, args.store))
    except Exception as e:  # a name the model store does not have
        raise SystemExit(f"edgeinfer: error: --models: {e}") from e
    for name, folder in models.items():
        if not (Path(folder) / "config.json").is_file():
            raise SystemExit(
                f"edgeinfer: error: --models: {name!r}: {folder} is not a model folder "
                f"(no config.json)"
            )
    try:
        cfg = PoolConfig(
            region=args.region,
            models=models,
            redis_url=redis_url,
            secret=_secret(args),
            max_workers=args.max_workers,
            min_workers=args.min_workers,
            idle_s=args.idle,
            min_residency_s=args.min_residency,
            scale_up_queue=args.scale_up_queue,
            scale_up_after_s=args.scale_up_after,
            ready_timeout_s=args.ready_timeout,
            host=args.host,
            worker_args=worker_args,
            zygote=not args.no_zygote,
        )
    except ValueError as e:
        raise SystemExit(f"edgeinfer: error: {e}") from e
    _check_worker_args(args.worker_args, worker_args)
    asyncio.run(serve(cfg))
    return 0


def _print_pool_events(redis_url: str, region: str, count: int, catalog: str | None) -> int:
    """Print the region's last `count` pool events. None: a line saying so, or, for a region
    the catalog (`catalog`, --regions; default the packaged one) lacks, a refusal (a typo: it
    printed nothing and exited 0; a region of a catalog of one's own has events to show)."""
    from datetime import datetime

    from kvstore.client import connect
    from kvstore.demand import Demand

    async def main() -> list[dict[str, str]]:
        redis = connect(redis_url)
        try:
            return await Demand(redis).events(region, count)
        finally:
            await redis.aclose()

    events = asyncio.run(main())
    if not events:  # (it printed nothing, and exited 0, as if the command had not run)
        from runtime.launcher import region_refusal

        if (refusal := region_refusal(region, catalog)) is not None:
            raise SystemExit(f"edgeinfer: error: no events in region {region!r}: {refusal}")
        print(f"no events in region {region!r}", file=sys.stderr)  # (as `models` says none)
    for e in events:
        at = datetime.fromtimestamp(float(e.pop("at"))).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        what = e.pop("event")
        rest = " ".join(f"{k}={v}" for k, v in e.items())
        print(f"{at} {what:<9} {rest}")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from runtime.cli import _model_dir, check_model_folder, engine_config
    from runtime.launcher import _engine_flags, up

    # Refused here, not by each worker once `up` has started Redis, them and the gateway (each
    # worker died seconds later, its error printed twice, exit 1): the engine options given
    # (EngineConfig imports torch: only then), and a --model that is no model folder (the
    # default one is, once imported).
    if _engine_flags(args):
        engine_config("", args)
    if args.model or args.max_model_len:
        check_model_folder(_model_dir(args.model), args.max_model_len)
    return up(args)


def add_service_commands(sub: argparse._SubParsersAction, engine_args) -> None:  # type: ignore[type-arg, no-untyped-def]
    from gateway.regions import DEFAULT_CATALOG

    w = sub.add_parser("worker", help="serve a model to gateways (internal API, Redis registry)")
    engine_args(w)
    w.add_argument("--max-waiting", type=int, default=4096,
                   help="bound of the waiting queue (default %(default)s)")  # fmt: skip
    w.add_argument("--region", default="local",
                   help="region name from the catalog (default %(default)s)")  # fmt: skip
    w.add_argument("--regions", default=None, metavar="FILE",
                   help="the region catalog its gateways read (their --regions): a --region it "
                   f"lacks is refused (default: {DEFAULT_CATALOG}, where one it lacks is warned "
                   "about)")  # fmt: skip
    w.add_argument("--role", default="mixed", choices=["mixed", "prefill", "decode"],
                   help="the work it takes (default %(default)s)")  # fmt: skip
    w.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on (default %(default)s)")  # fmt: skip
    w.add_argument("--port", type=port_arg, default=9001, help="port to listen on (default %(default)s)")
    w.add_argument("--advertise-url", default=None,
                   help="http(s)://HOST:PORT gateways use (default from host/port)")  # fmt: skip
    w.add_argument("--served-model-name", default=None, help="default: the model folder's name")
    w.add_argument("--worker-id", default=None,
                   help="registry id (default: region-host-port-random; a pool names its workers)")  # fmt: skip
    w.add_argument(
        "--redis", default=None, help=f"cluster state (default $EDGEINFER_REDIS or {DEFAULT_REDIS})"
    )
    w.add_argument("--no-redis", action="store_true", help="serve unregistered (direct use)")
    w.add_argument("--secret", default=None, help="shared secret (default $EDGEINFER_SECRET)")
    w.add_argument("--heartbeat", type=float, default=2.0,
                   help="seconds between heartbeats (default %(default)s)")  # fmt: skip
    w.add_argument("--ttl", type=float, default=10.0,
                   help="registry entry lifetime, seconds (default %(default)s)")  # fmt: skip
    w.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets in-flight requests finish before it ends them with "
                   "an error (default %(default)s)")  # fmt: skip
    w.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt in full")
    # (runtime.worker.MAX_BODY_BYTES: not imported here, as it would import torch for every command)
    w.add_argument("--max-body-bytes", type=int, default=32 << 20,
                   help="largest request body, as sent and once decompressed (413 above it); "
                   "keep it above the gateways' --max-body-bytes: what a gateway forwards (the "
                   "prompt or the messages and tools, as JSON) can be a little larger than its "
                   "client's body (default %(default)s)")  # fmt: skip
    w.add_argument(
        "--kv-port",
        type=port_or_zero,
        default=0,
        help="KV transfer port (prefill side of disaggregation); default (0): a free port",
    )
    w.add_argument("--kv-hold", type=float, default=30.0,
                   help="seconds pulled KV blocks wait for the puller's acknowledgement "
                   "(default %(default)s)")  # fmt: skip
    w.add_argument("--kv-import-wait", type=float, default=10.0,
                   help="decode side: seconds a request whose prompt KV does not fit yet waits "
                   "for room before it is refused (503 kv_cache_full) (default %(default)s)")  # fmt: skip
    w.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "mistral"],
                   help="tool-call format of the model's output (default: the one its chat "
                   "template points to)")  # fmt: skip
    _telemetry_args(w)
    w.set_defaults(func=cmd_worker)

    g = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway of one region")
    g.add_argument("--region", default="local",
                   help="this gateway's region from the catalog (default %(default)s)")  # fmt: skip
    g.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on; 0.0.0.0 for every one (default %(default)s)")  # fmt: skip
    g.add_argument("--port", type=port_arg, default=8080, help="port to listen on (default %(default)s)")
    g.add_argument("--metrics-port", type=port_or_zero, default=0, metavar="PORT",
                   help="serve Prometheus /metrics on this port (same --host) and not on --port, "
                   "which may be public: the metrics ask for no API key; 0: on --port "
                   "(default %(default)s)")  # fmt: skip
    g.add_argument(
        "--redis", default=None, help=f"cluster state (default $EDGEINFER_REDIS or {DEFAULT_REDIS})"
    )
    g.add_argument(
        "--secret", default=None, help="workers' shared secret (default $EDGEINFER_SECRET)"
    )
    g.add_argument("--api-key", action="append", default=[], help=API_KEY_HELP)
    g.add_argument("--regions", default=str(DEFAULT_CATALOG),
                   help="region catalog YAML (default %(default)s)")  # fmt: skip
    g.add_argument("--cors-origins", default="",
                   help="origins browsers may call the API from, comma-separated "
                   "(https://app.example.com,http://localhost:5173), or * for any; default: "
                   "none (no CORS headers, preflights refused)")  # fmt: skip
    g.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body, as sent and once decompressed (413 above it) "
                   "(default %(default)s)")  # fmt: skip
    g.add_argument("--worker-idle-timeout", type=float, default=10.0,
                   help="seconds of silence (workers send a keepalive each second) after which a "
                   "worker's stream is failed: a request not yet answered is retried on another "
                   "worker, a streaming one ends with an error (default %(default)s)")  # fmt: skip
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request's body has to arrive once its headers have (408) "
                   "(default %(default)s)")  # fmt: skip
    g.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds a client connection may go without sending a whole request's "
                   "headers (from when it opened, or its last response) before it is closed "
                   "(default %(default)s)")  # fmt: skip
    g.add_argument(
        "--routing", default="cache-aware", choices=["cache-aware", "round-robin"],
        help="worker choice: sessions + prefix cache + load (default), or a round-robin baseline",
    )  # fmt: skip
    g.add_argument(
        "--disagg-min-tokens", type=int, default=32,
        help="with prefill and decode workers: prompts with fewer uncached tokens than this are "
        "computed on the decode worker (default 32)",
    )  # fmt: skip
    g.add_argument("--pool-gone-grace", type=float, default=30.0,
                   help="seconds a request held for a pool to start a worker waits on once no "
                   "pool of its region offers the model any more (one restarting within it "
                   "serves it), before a 503 pool_unavailable (default %(default)s)")  # fmt: skip
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets the requests in flight finish (the listener closed, "
                   "held requests answered 503 at once); those still going then end with a 503 "
                   "or a stream's closing error event, code gateway_shutting_down (default "
                   "%(default)s)")  # fmt: skip
    g.add_argument("--client-write-timeout", type=float, default=30.0,
                   help="seconds a client may take none of an answer (stopped reading) before "
                   "it is dropped and its request aborted at the worker (default %(default)s)")  # fmt: skip
    g.add_argument("--max-request-seqs", type=int, default=128,
                   help="most sequences one request may ask for, prompts x n (default "
                   "%(default)s: a worker's default --max-num-seqs); a 400 above it")  # fmt: skip
    g.add_argument(
        "--hold-timeout", type=float, default=60.0,
        help="seconds a request waits for a pool to start a worker for its model (scale from "
        "zero) before a 503 (default 60)",
    )  # fmt: skip
    _telemetry_args(g)
    g.set_defaults(func=cmd_gateway)

    r = sub.add_parser("set-role", help="change a running worker's role (prefill/decode/mixed)")
    r.add_argument("worker_url", help="the worker's internal URL, e.g. http://10.0.0.5:9001")
    r.add_argument("role", choices=["mixed", "prefill", "decode"])
    r.add_argument("--secret", default=None, help="shared secret (default $EDGEINFER_SECRET)")
    r.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the drain")
    r.set_defaults(func=cmd_set_role)

    b = sub.add_parser("rebalance", help="set how many of a model's prefill/decode workers prefill")
    b.add_argument("--model", required=True, help="served model name")
    b.add_argument("--region", default=None, help="only this region's workers (default: all)")
    b.add_argument("--prefill", type=non_negative_int, required=True,
                   help="prefill workers wanted (0 or more)")  # fmt: skip
    b.add_argument("--redis", default=None, help="cluster Redis URL (default $EDGEINFER_REDIS)")
    b.add_argument("--secret", default=None, help="shared secret (default $EDGEINFER_SECRET)")
    b.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the drains")
    b.set_defaults(func=cmd_rebalance)

    p = sub.add_parser("pool", help="start/stop local workers on demand (scale from zero)")
    p.add_argument("--region", default="local", help="the region its workers serve")
    p.add_argument("--regions", default=None, metavar="FILE",
                   help="the region catalog its gateways read (their --regions): a --region it "
                   "lacks is refused; passed on to its workers (default: "
                   f"{DEFAULT_CATALOG}, where one it lacks is warned about)")  # fmt: skip
    p.add_argument(
        "--models", default=None,
        help="models it may start: store names or folders, or name=FOLDER, comma-separated",
    )  # fmt: skip
    p.add_argument("--max-workers", type=int, default=4,
                   help="worker processes at most, all models (default %(default)s)")  # fmt: skip
    p.add_argument("--min-workers", type=int, default=0,
                   help="per model, kept even when idle (default %(default)s)")  # fmt: skip
    p.add_argument("--idle", type=float, default=300.0,
                   help="seconds idle before a worker stops (default %(default)s)")  # fmt: skip
    p.add_argument("--min-residency", type=float, default=5.0, metavar="S",
                   help="seconds a worker serves (and at least as long as its start took) before "
                   "--max-workers may stop it for another model's (default %(default)s)")  # fmt: skip
    p.add_argument("--scale-up-queue", type=int, default=4,
                   help="queued requests per worker that count as queueing (default 4)")  # fmt: skip
    p.add_argument("--scale-up-after", type=float, default=2.0,
                   help="seconds of queueing before another worker starts (default 2)")  # fmt: skip
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds a starting worker has to register before it counts as failed "
                   "(default %(default)s)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="interface the workers bind and advertise")
    p.add_argument("--worker-args", default="",
                   help='extra `edgeinfer worker` flags, split as a shell splits them (quote a '
                   'value with spaces), e.g. "--threads 2 --max-num-seqs 64"')  # fmt: skip
    p.add_argument("--no-zygote", action="store_true",
                   help="start each worker as a fresh process (default: fork it from a template "
                   "process that has made a worker's imports, ~1 s sooner to its first token)")  # fmt: skip
    p.add_argument("--redis", default=None, help="cluster Redis URL (default $EDGEINFER_REDIS)")
    p.add_argument("--secret", default=None, help="workers' shared secret ($EDGEINFER_SECRET)")
    p.add_argument("--store", default=None,
                   help="model store for --models names (default $EDGEINFER_STORE or "
                   "~/.cache/edgeinfer/models)")  # fmt: skip
    p.add_argument("--events", type=non_negative_int, default=0, metavar="N",
                   help="print the region's last N pool events (start/ready/stop/fail) and exit")  # fmt: skip
    p.set_defaults(func=cmd_pool)

    d = sub.add_parser("drive-rate", help="measure the drive's read rate (for worker timelines)")
    d.add_argument("path", nargs="?", default=None,
                   help="a file, or a folder whose largest files are read (default: the default "
                   "model's folder); the figure is kept for the device it is on")  # fmt: skip
    d.add_argument("--gb", type=positive_float, default=1.0,
                   help="read at most this much (default 1)")  # fmt: skip
    d.set_defaults(func=cmd_drive_rate)

    u = sub.add_parser(
        "up", help="start Redis (if needed), a worker and a gateway on this machine",
        description="Start Redis (if needed), the worker(s) and a gateway on this machine. The "
        "workers' shared secret is $EDGEINFER_SECRET, else a random one: export it first to "
        "run `edgeinfer set-role` or `edgeinfer rebalance` against these workers.",
    )  # fmt: skip
    engine_args(u)
    u.add_argument("--workers", type=int, default=1,
                   help="worker processes, mixed role (default %(default)s)")  # fmt: skip
    u.add_argument(
        "--roles", default=None,
        help="one worker per listed role instead, e.g. prefill,decode (disaggregated serving)",
    )  # fmt: skip
    u.add_argument("--port", type=port_arg, default=8080,
                   help="the gateway's port (default %(default)s)")  # fmt: skip
    u.add_argument("--worker-port", type=port_arg, default=None,
                   help="first worker's port; the workers take the next ones, then their "
                   "KV-transfer servers the ones after those (default: a run of free ports)")  # fmt: skip
    u.add_argument("--redis", default=None,
                   help="use this Redis (URL) instead of starting a throwaway one (default "
                   "$EDGEINFER_REDIS; unset: a throwaway one)")  # fmt: skip
    u.add_argument("--region", default="local",
                   help="the region its gateway and workers serve (default %(default)s)")  # fmt: skip
    u.add_argument("--api-key", action="append", default=[], help=API_KEY_HELP)
    u.set_defaults(func=cmd_up)
