"""Gateway settings, checked once at start."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gateway.regions import DEFAULT_CATALOG
from kvstore.telemetry import TelemetryConfig


@dataclass(slots=True)
class GatewayConfig:
    region: str  # this gateway's region (must be in the catalog)
    redis_url: str  # the cluster state: registry, session placement
    worker_secret: str  # shared secret of the workers' internal API
    host: str = "127.0.0.1"  # interface to bind
    port: int = 8080  # port to bind
    # /metrics on a listener of its own on this port (same host), and then not on `port`, which
    # may be public (a LoadBalancer): the metrics name models, workers, regions and error rates
    # and ask for no API key. 0: /metrics on `port`, beside the API (one machine, `make run`)
    metrics_port: int = 0
    api_keys: frozenset[str] = frozenset()  # accepted bearer tokens; empty = open
    # origins (scheme://host[:port]) browsers may call the API from, "*" for any; empty: no CORS
    cors_origins: frozenset[str] = frozenset()
    catalog_path: Path = DEFAULT_CATALOG  # the region catalog (infra/regions.yaml)
    max_body_bytes: int = 1 << 20  # largest request body (413 above it)
    body_timeout_s: float = 30.0  # for a request's body to arrive once its headers have (408)
    # a client connection is closed when it has not sent a whole request's headers this long
    # after it opened, or after its last response (a slow-header client, "slowloris", holds a
    # connection no longer than this; aiohttp's default, an hour, would let it hold one that long)
    idle_timeout_s: float = 30.0
    registry_refresh_s: float = 0.5  # how often the worker list is re-read from Redis
    session_ttl_s: float = 1800.0  # a session placement expires after this long unused
    connect_timeout_s: float = 2.0  # to open a connection to a worker
    # longest silence on a worker's stream before failing it (a worker sends a keepalive after
    # each second of silence: a request that has not started streaming is then tried elsewhere)
    worker_idle_timeout_s: float = 10.0
    max_attempts: int = 3  # workers tried per request before giving up (only before first byte)
    # a client that accepts none of an answer's bytes for this long (its connection's buffers
    # full: it stopped reading) is dropped, and its request aborted at the worker, whose KV
    # blocks are freed at once; before, it held the connection, the answer buffered for it and
    # the worker's blocks until it closed. Each write must complete within it: a client that
    # reads at all, however slowly, is not dropped
    client_write_timeout_s: float = 30.0
    # most sequences one request may ask for, prompts x n (a completions batch of 64 prompts at
    # n=16 is 1,024: it held a worker for minutes, and everyone queued behind it); a worker runs
    # at most max_num_seqs at once (default 128). 400 above it
    max_request_seqs: int = 128
    retry_after_s: float = 1.0  # Retry-After for 429/503
    routing: str = "cache-aware"  # "cache-aware" | "round-robin" (a baseline for benchmarks)
    hold_timeout_s: float = 60.0  # a request for a model no worker serves, that a pool can
    # start a worker for, waits this long for the worker (scale from zero) before a 503
    # How long a held request outlives the last pool that offered its model in its region, as
    # the registry snapshot shows it (a pool that stops withdraws at once; one killed leaves
    # when its entry expires, 10 s): a pool restarting within it (a rollout: the old pool drains
    # its workers, up to their drain timeout, before the new one starts) finds the request
    # still waiting; then 503 pool_unavailable. Before, the request waited out its whole hold
    # for a worker nobody would start, told "it is still starting".
    pool_gone_grace_s: float = 30.0
    # on SIGTERM, requests in flight get this long to finish (the listener closed); those still
    # going then end: a 503, or a stream's closing error event (code gateway_shutting_down)
    drain_timeout_s: float = 30.0
    disagg_min_tokens: int = 32  # disaggregated: prompts with fewer uncached tokens on the
    # decode worker are computed there (a transfer costs more than such a prefill)
    telemetry: TelemetryConfig | None = None  # traces/metrics export; None: /metrics only

    def __post_init__(self) -> None:
        if not self.worker_secret:
            raise ValueError("the workers' shared secret is required (--secret / EDGEINFER_SECRET)")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(
                f"metrics_port (--metrics-port) must be 0-65535, got {self.metrics_port}"
            )
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(
                f"metrics_port (--metrics-port) must differ from port (--port), both {self.port}: "
                "0 serves /metrics on the main port"
            )
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.worker_idle_timeout_s <= 1.0:
            raise ValueError(
                f"worker_idle_timeout_s must be above the workers' 1 s keepalive, got "
                f"{self.worker_idle_timeout_s}"
            )
        if self.body_timeout_s <= 0:
            raise ValueError(f"body_timeout_s must be positive, got {self.body_timeout_s}")
        if self.idle_timeout_s <= 0:
            raise ValueError(
                f"idle_timeout_s (--idle-timeout) must be positive, got {self.idle_timeout_s}"
            )
        if self.registry_refresh_s <= 0 or self.session_ttl_s <= 0:
            raise ValueError("registry_refresh_s and session_ttl_s must be positive")
        if self.client_write_timeout_s <= 0:
            raise ValueError(
                f"client_write_timeout_s must be positive, got {self.client_write_timeout_s}"
            )
        if self.max_request_seqs < 1:
            raise ValueError(f"max_request_seqs must be at least 1, got {self.max_request_seqs}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.routing not in ("cache-aware", "round-robin"):
            raise ValueError(f"routing must be cache-aware or round-robin, got {self.routing!r}")
        if not 0 < self.drain_timeout_s <= 3600:
            raise ValueError(
                f"drain_timeout_s (--drain-timeout) must be in (0, 3600], got {self.drain_timeout_s}"
            )
        if self.pool_gone_grace_s < 0:
            raise ValueError(
                f"pool_gone_grace_s (--pool-gone-grace) must be >= 0, got {self.pool_gone_grace_s}"
            )
        if self.hold_timeout_s < 0:
            raise ValueError(f"hold_timeout_s must be >= 0, got {self.hold_timeout_s}")
        if self.disagg_min_tokens < 0:
            raise ValueError(f"disagg_min_tokens must be >= 0, got {self.disagg_min_tokens}")
        if any(not k for k in self.api_keys):
            raise ValueError("api keys must be non-empty strings")
        for origin in self.cors_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(
                    f"cors_origins (--cors-origins): {origin!r} is neither * nor an origin "
                    "(scheme://host[:port], no path)"
                )
