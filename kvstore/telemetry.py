"""Traces and metrics (OpenTelemetry) for the gateway and the workers: one `Telemetry` per process.

It lives here because kvstore is the one torch-free package both the gateway and the workers
import (as the protocol messages do); it imports no torch and no aiohttp.

    tel = Telemetry(TelemetryConfig("edgeinfer-gateway", region="eu", otlp_endpoint=URL))
    span = tel.tracer.start_span("chat m", context=tel.extract(request.headers))
    tel.inject(headers, trace.set_span_in_context(span))  # W3C traceparent to the next hop
    tel.prometheus()                                       # the /metrics body
    tel.shutdown()                                         # flush what is still buffered
                                                           # (SHUTDOWN_TIMEOUT_S at most)

Traces are recorded only when somewhere receives them: an OTLP endpoint (the gateway's and the
worker's `--otlp-endpoint`, default `$OTEL_EXPORTER_OTLP_ENDPOINT`), or a test's exporter.
Otherwise the tracer is OpenTelemetry's no-op one, which still carries an incoming
`traceparent` on to the next hop. Spans are sampled parent-based, new traces at
`trace_sample_ratio`; a worker obeys its gateway's sampled flag, and the gateway keeps a
client's trace at its own ratio, whatever the client's flag says (a public client could
otherwise make it record every request: `trust_remote_sampled`), by a keyed hash of the trace
id (_KeyedRatio): every request of a client's trace gets the same decision, and the key, a
secret (`sample_key`: the gateways derive theirs from the cluster's shared secret, so that
replicas agree), keeps a client from choosing ids that are always kept. A gateway that does not
trace passes no client's context on (W3C Trace Context's restart at a front gate): its workers
start a trace of their own, sampled at their own ratio, as for a request that came without one;
passed on, the client's sampled flag decided what the workers record. Metrics are always
collected: the Prometheus `/metrics` endpoint reads them, and they go over OTLP as well when an
endpoint is set.

OTLP exports give up after EXPORT_TIMEOUT_S, retries included (in place of the SDK's
$OTEL_EXPORTER_OTLP_TIMEOUT, default 10 s, which held a worker's exit for 35-45 s behind an
unreachable collector: one timeout per queued batch), and `shutdown` waits SHUTDOWN_TIMEOUT_S
at most for what is still buffered; the rest is dropped.

Prompts and outputs are never put on a span unless `record_content` is set (`--otel-content`,
or `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`, the GenAI convention's switch);
then each is cut to `content_max_chars` (`capped`, which says so in the value), as
OpenTelemetry's attribute length limit would (a 4 MB prompt was a 4 MB attribute, which a
collector refuses whole, losing the span, or stores).

The metrics, by OpenTelemetry name (Prometheus name in brackets; `METRICS` lists them all):

    both gateway and workers (attributes gen_ai.operation.name, gen_ai.provider.name,
    gen_ai.request.model):
      gen_ai.server.time_to_first_token   s        [gen_ai_server_time_to_first_token_seconds]
      gen_ai.server.time_per_output_token s        [gen_ai_server_time_per_output_token_seconds]
      gen_ai.server.request.duration      s        [gen_ai_server_request_duration_seconds]
      gen_ai.client.token.usage           {token}  [gen_ai_client_token_usage], gen_ai.token.type
    workers (attributes edgeinfer.region, edgeinfer.worker.id):
      edgeinfer.worker.requests.running / .waiting          gauges
      edgeinfer.worker.kv_cache.usage                       gauge, fraction of KV blocks in use
      edgeinfer.worker.prefix_cache.query_tokens / .hit_tokens   counters, once per request
                                            (not per completion of n), where its prompt was
                                            computed (a disaggregated one: its prefill worker)
      edgeinfer.worker.preemptions                          counter
      edgeinfer.kv_transfer.bytes, edgeinfer.kv_transfer.duration   by direction (sent|received);
                                            a failed transfer's duration with error.type
      edgeinfer.worker.cold_start.duration                  by phase, once per worker start
    gateways (attribute edgeinfer.region):
      edgeinfer.gateway.routing.decisions   by kind (affinity | prefix | load | cross_region |
                                            cold_start)
      edgeinfer.gateway.retries, edgeinfer.gateway.errors (by error.type)
      edgeinfer.gateway.redis.duration      by operation, the calls made (error.type: failed ones)
      edgeinfer.gateway.workers             live workers in the registry, by region, model, role
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("edgeinfer.telemetry")

# --------------------------------------------------------------------------- the metric catalog
# gen_ai.provider.name, which the GenAI conventions require on their spans and metrics: the
# provider as the instrumentation knows it. edgeinfer serves the models itself (it is not one
# of the registry's hosted providers, whose value would make a backend expect that provider's
# own attributes), so it names itself, as a provider off the registry may.
PROVIDER = "edgeinfer"
TTFT = "gen_ai.server.time_to_first_token"
TPOT = "gen_ai.server.time_per_output_token"
REQUEST_DURATION = "gen_ai.server.request.duration"
TOKEN_USAGE = "gen_ai.client.token.usage"
WORKER_RUNNING = "edgeinfer.worker.requests.running"
WORKER_WAITING = "edgeinfer.worker.requests.waiting"
KV_USAGE = "edgeinfer.worker.kv_cache.usage"
PREFIX_QUERY = "edgeinfer.worker.prefix_cache.query_tokens"
PREFIX_HIT = "edgeinfer.worker.prefix_cache.hit_tokens"
PREEMPTIONS = "edgeinfer.worker.preemptions"
KV_TRANSFER_BYTES = "edgeinfer.kv_transfer.bytes"
KV_TRANSFER_DURATION = "edgeinfer.kv_transfer.duration"
COLD_START = "edgeinfer.worker.cold_start.duration"
ROUTING = "edgeinfer.gateway.routing.decisions"
RETRIES = "edgeinfer.gateway.retries"
ERRORS = "edgeinfer.gateway.errors"
REDIS_DURATION = "edgeinfer.gateway.redis.duration"
GATEWAY_WORKERS = "edgeinfer.gateway.workers"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # OpenTelemetry name
    kind: str  # histogram | counter | gauge
    unit: str  # UCUM, as the OpenTelemetry conventions write it
    prometheus: str  # the name the /metrics endpoint gives it (histograms: plus _bucket etc.)
    who: str  # gateway | worker | both
    description: str


def _prom(name: str, kind: str, unit: str) -> str:
    base = name.replace(".", "_")
    if unit == "s":
        base += "_seconds"
    return base + "_total" if kind == "counter" else base


def _spec(name: str, kind: str, unit: str, who: str, description: str) -> MetricSpec:
    return MetricSpec(name, kind, unit, _prom(name, kind, unit), who, description)


METRICS: tuple[MetricSpec, ...] = (
    _spec(TTFT, "histogram", "s", "both", "Time from a request's arrival to its first token"),
    _spec(TPOT, "histogram", "s", "both", "Time per output token after the first"),
    _spec(REQUEST_DURATION, "histogram", "s", "both", "A request's time from arrival to its end"),
    _spec(TOKEN_USAGE, "histogram", "{token}", "both", "Input and output tokens per request"),
    _spec(WORKER_RUNNING, "gauge", "{request}", "worker", "Requests running in the engine"),
    _spec(WORKER_WAITING, "gauge", "{request}", "worker", "Requests waiting for the engine"),
    _spec(KV_USAGE, "gauge", "1", "worker", "Fraction of the KV cache's blocks in use"),
    _spec(
        PREFIX_QUERY, "counter", "{token}", "worker", "Prompt tokens looked up in the prefix cache"
    ),
    _spec(PREFIX_HIT, "counter", "{token}", "worker", "Prompt tokens found in the prefix cache"),
    _spec(PREEMPTIONS, "counter", "{preemption}", "worker", "Requests preempted for KV room"),
    _spec(KV_TRANSFER_BYTES, "counter", "By", "worker", "KV cache bytes moved between workers"),
    _spec(KV_TRANSFER_DURATION, "histogram", "s", "worker", "Time of one KV transfer"),
    _spec(COLD_START, "histogram", "s", "worker", "A worker's start-up, by phase"),
    _spec(ROUTING, "counter", "{decision}", "gateway", "Routing decisions, by kind"),
    _spec(
        RETRIES, "counter", "{retry}", "gateway", "Requests sent to another worker after a failure"
    ),
    _spec(ERRORS, "counter", "{error}", "gateway", "Requests answered with an error, by type"),
    _spec(REDIS_DURATION, "histogram", "s", "gateway", "Time of one Redis operation"),
    _spec(GATEWAY_WORKERS, "gauge", "{worker}", "gateway", "Live workers in the registry"),
)
_BY_NAME = {m.name: m for m in METRICS}

# Bucket boundaries: the GenAI conventions' advice for the gen_ai.* histograms; ours cover a
# Redis round trip (sub-millisecond) to a cold start (minutes).
BUCKETS: dict[str, Sequence[float]] = {
    TTFT: (
        0.001,
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.25,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        # past the conventions' advice (which stops at 10 s): a request held while a pool starts
        # a worker (scale from zero) waits up to the gateway's --hold-timeout, 60 s by default,
        # before its first token; with 10 s the top bucket, histogram_quantile drew them flat
        15.0,
        20.0,
        30.0,
        45.0,
        60.0,
        90.0,
        120.0,
    ),
    # the conventions' advice starts at 10 ms; a decode step of a small model takes 1-3 ms
    TPOT: (
        0.001,
        0.0025,
        0.005,
        0.01,
        0.025,
        0.05,
        0.075,
        0.1,
        0.15,
        0.2,
        0.3,
        0.4,
        0.5,
        0.75,
        1.0,
        2.5,
    ),
    REQUEST_DURATION: (
        0.01,
        0.02,
        0.04,
        0.08,
        0.16,
        0.32,
        0.64,
        1.28,
        2.56,
        5.12,
        10.24,
        20.48,
        40.96,
        81.92,
    ),
    TOKEN_USAGE: (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576),
    KV_TRANSFER_DURATION: (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    COLD_START: (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0),
    REDIS_DURATION: (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
}


CONTENT_MAX_CHARS = 16_384  # TelemetryConfig.content_max_chars' default
CONTENT_MIN_CHARS = 64  # its least: room for `capped`'s note and some text
EXPORT_TIMEOUT_S = 2.0  # one OTLP export, its retries included (the SDK's default: 10 s)
SHUTDOWN_TIMEOUT_S = 3.0  # Telemetry.shutdown's wait for the last exports


@dataclass(slots=True)
class TelemetryConfig:
    service: str  # service.name: edgeinfer-gateway | edgeinfer-worker | ...
    region: str  # edgeinfer.region, on the resource and on every metric
    instance: str = ""  # service.instance.id (a worker's id); empty: the SDK makes one up
    otlp_endpoint: str | None = None  # OTLP/HTTP base URL (…/v1/traces, …/v1/metrics added)
    record_content: bool = False  # put prompts and outputs on spans (off: never recorded)
    # what one recorded prompt or output keeps of its text (`capped`): characters, as
    # OpenTelemetry's attribute length limit counts them
    content_max_chars: int = CONTENT_MAX_CHARS
    trace_sample_ratio: float = 1.0  # new traces kept; an incoming sampled flag is obeyed
    # unless this is False (the gateway: its callers are the public, whose `traceparent`
    # flags would decide its trace volume); then their traces are kept at the same ratio, by a
    # keyed hash of the trace id (_KeyedRatio), and the workers behind follow the gateway's flag
    trust_remote_sampled: bool = True
    # the key of that hash (a secret: who knows it can choose ids that are kept); processes
    # given the same one keep the same traces (a client's, through several gateways); empty:
    # a random one for this process
    sample_key: bytes = b""
    export_interval_s: float | None = None  # OTLP metric export period; None: the SDK's
    # ($OTEL_METRIC_EXPORT_INTERVAL milliseconds, else 60 s)
    attributes: dict[str, str] = field(default_factory=dict)  # more resource attributes

    def __post_init__(self) -> None:
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ValueError(f"trace_sample_ratio must be in [0, 1], got {self.trace_sample_ratio}")
        if type(self.content_max_chars) is not int or self.content_max_chars < CONTENT_MIN_CHARS:
            raise ValueError(f"content_max_chars must be an integer >= {CONTENT_MIN_CHARS}, "
                             f"got {self.content_max_chars!r}")  # fmt: skip
        if not isinstance(self.sample_key, bytes) or len(self.sample_key) > 64:
            raise ValueError("sample_key must be at most 64 bytes (BLAKE2b's key)")
        if self.export_interval_s is not None and self.export_interval_s <= 0:
            raise ValueError(f"export_interval_s must be > 0, got {self.export_interval_s}")
        if self.otlp_endpoint is not None:
            self.otlp_endpoint = self.otlp_endpoint.strip().rstrip("/") or None
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(
            ("http://", "https://")
        ):
            raise ValueError(
                f"the OTLP endpoint must be an http:// or https:// URL (OTLP over HTTP, e.g. "
                f"http://collector:4318), got {self.otlp_endpoint!r}"
            )


def content_capture_from_env(environ: Mapping[str, str]) -> bool:
    """The GenAI conventions' switch for recording prompts and outputs (entry points read it)."""
    value = environ.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def sample_key_of(secret: str) -> bytes:
    """A `sample_key` derived from a secret the gateways of a cluster share (and clients do not
    know), so that they all keep the same client traces."""
    return hashlib.blake2b(secret.encode(), digest_size=32, person=b"ei-trace-sample").digest()


def capped(text: str, limit: int) -> str:
    """`text` for a span attribute: whole when it has at most `limit` characters, else its start
    and a note of its full length, `limit` characters in all (a JSON value so cut is no longer
    JSON: the note says why)."""
    if len(text) <= limit:
        return text
    note = f"...[truncated: {len(text)} characters]"
    return text[: max(0, limit - len(note))] + note


class _KeyedRatio(TraceIdRatioBased):
    """TraceIdRatioBased by a keyed hash of the trace id, for a trace a caller began, whose id
    the caller chose: TraceIdRatioBased keeps every id whose low 64 bits are small (a client
    sending such ids had each of its requests recorded at any ratio above 0). The key is
    secret (`TelemetryConfig.sample_key`, else one for this process), so a client cannot tell
    which ids are kept; one id gets one decision, so the requests of a client's trace are kept
    or dropped together (a random draw, which b04aaf2 used, split them)."""

    def __init__(self, rate: float, key: bytes = b"") -> None:
        super().__init__(rate)
        self._key = key or secrets.token_bytes(32)

    def should_sample(self, parent_context: Context | None, trace_id: int, *args: Any,
                      **kwargs: Any) -> Any:  # fmt: skip
        digest = hashlib.blake2b(trace_id.to_bytes(16, "big"), digest_size=8, key=self._key)
        keyed = int.from_bytes(digest.digest(), "big")
        return super().should_sample(parent_context, keyed, *args, **kwargs)


class Telemetry:
    """One process's tracer, meter and exporters (see the module docstring).

    `span_exporter` and `metric_readers` are for tests (in-memory ones) and benchmarks; an OTLP
    endpoint in the config adds the OTLP exporters beside them."""

    def __init__(
        self,
        config: TelemetryConfig,
        span_exporter: SpanExporter | None = None,
        metric_readers: Sequence[MetricReader] = (),
    ) -> None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry

        self.config = config
        attrs: dict[str, str] = {"service.name": config.service, "edgeinfer.region": config.region}
        if config.instance:
            attrs["service.instance.id"] = config.instance
        self.resource = Resource.create(attrs | config.attributes)
        self.propagator = TraceContextTextMapPropagator()

        self._registry = CollectorRegistry(auto_describe=True)
        readers: list[MetricReader] = [PrometheusMetricReader(registry=self._registry)]
        readers += metric_readers
        exporters: list[SpanExporter] = [span_exporter] if span_exporter is not None else []
        if config.otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            exporters.append(
                OTLPSpanExporter(
                    endpoint=f"{config.otlp_endpoint}/v1/traces", timeout=EXPORT_TIMEOUT_S
                )
            )
            readers.append(
                PeriodicExportingMetricReader(
                    OTLPMetricExporter(
                        endpoint=f"{config.otlp_endpoint}/v1/metrics", timeout=EXPORT_TIMEOUT_S
                    ),
                    export_interval_millis=(
                        config.export_interval_s * 1000 if config.export_interval_s else None
                    ),
                )
            )
        self.meter_provider = MeterProvider(metric_readers=readers, resource=self.resource)
        self.meter: Meter = self.meter_provider.get_meter("edgeinfer")
        self.tracing = bool(exporters)  # spans are recorded (else: the no-op tracer)
        self.tracer_provider: TracerProvider | None = None
        if exporters:
            ratio = TraceIdRatioBased(config.trace_sample_ratio)
            keyed = _KeyedRatio(config.trace_sample_ratio, config.sample_key)  # (one key for both)
            sampler = (
                ParentBased(ratio)
                if config.trust_remote_sampled
                else ParentBased(
                    ratio, remote_parent_sampled=keyed, remote_parent_not_sampled=keyed
                )
            )
            self.tracer_provider = TracerProvider(resource=self.resource, sampler=sampler)
            for exporter in exporters:
                self.tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
            self.tracer: trace.Tracer = self.tracer_provider.get_tracer("edgeinfer")
        else:
            self.tracer = trace.NoOpTracer()

    # ------------------------------------------------------------------ instruments
    def histogram(self, name: str) -> Any:
        spec = _BY_NAME[name]
        return self.meter.create_histogram(
            name,
            unit=spec.unit,
            description=spec.description,
            explicit_bucket_boundaries_advisory=BUCKETS.get(name),
        )

    def counter(self, name: str) -> Any:
        spec = _BY_NAME[name]
        return self.meter.create_counter(name, unit=spec.unit, description=spec.description)

    def observe(
        self, name: str, read: Callable[[], Iterable[tuple[float, Mapping[str, str]]]]
    ) -> None:
        """An instrument whose values `read` gives at each collection: a gauge, or a counter
        (monotonic totals the process keeps anyway, such as the engine's)."""
        spec = _BY_NAME[name]

        def callback(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(value, dict(attrs)) for value, attrs in read()]

        make = (
            self.meter.create_observable_counter
            if spec.kind == "counter"
            else self.meter.create_observable_gauge
        )
        make(name, callbacks=[callback], unit=spec.unit, description=spec.description)

    # ------------------------------------------------------------------ context
    def extract(self, carrier: Mapping[str, str]) -> Context:
        """The trace context a request arrived with (a W3C `traceparent` header), if any.

        An empty context where the caller's sampled flag is not trusted and this process does
        not trace: the no-op tracer would pass the caller's context on unchanged, and the
        workers behind, which obey the flag they get, would record what the caller chose. The
        trace restarts at the next hop that traces, at its own ratio (W3C Trace Context's
        "restart" mutation, for a front gate)."""
        if not self.tracing and not self.config.trust_remote_sampled:
            return Context()
        return self.propagator.extract(carrier)

    def inject(self, carrier: MutableMapping[str, str], context: Context) -> None:
        """Write `context`'s `traceparent` (and `tracestate`) into outgoing headers."""
        self.propagator.inject(carrier, context=context)

    def traceparent(self, context: Context) -> str | None:
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=context)
        return carrier.get("traceparent")

    # ------------------------------------------------------------------ export
    def prometheus(self) -> bytes:
        """The Prometheus text exposition of every metric (the /metrics body)."""
        from prometheus_client import generate_latest

        return generate_latest(self._registry)

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
        """Flush buffered spans and metrics, waiting `timeout_s` at most: what a slow or
        unreachable collector has not taken by then is dropped. Returns whether the flush ended
        in time (its exports failed or not).

        Spans and metrics flush side by side, each in a daemon thread (the SDK bounds neither
        TracerProvider.shutdown nor the exports of the batches still queued, one timeout each),
        so that neither waits behind the other and a thread still stuck in an export holds no
        exit."""

        def run(step: Callable[[], object]) -> None:
            try:
                step()
            except Exception as e:  # (MeterProvider.shutdown raises what its readers did)
                log.warning("telemetry shutdown: %s", e)

        steps: list[Callable[[], object]] = [
            lambda: self.meter_provider.shutdown(timeout_millis=timeout_s * 1000)
        ]
        if self.tracer_provider is not None:
            steps.append(self.tracer_provider.shutdown)
        threads = [threading.Thread(target=run, args=(f,), name="otel-shutdown", daemon=True)
                   for f in steps]  # fmt: skip
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)


class GenAIMetrics:
    """The GenAI server histograms, recorded once per finished request, on gateways and workers
    alike (each with its own clock and attributes)."""

    def __init__(self, tel: Telemetry) -> None:
        self.ttft = tel.histogram(TTFT)
        self.tpot = tel.histogram(TPOT)
        self.duration = tel.histogram(REQUEST_DURATION)
        self.tokens = tel.histogram(TOKEN_USAGE)

    def record(
        self,
        attrs: dict[str, Any],
        started: float,
        first_token: float,
        ended: float,
        usage: tuple[int, int] | None,
        stream_tokens: int | None = None,
    ) -> None:
        """A request that arrived at `started` (any one clock), had its first token at
        `first_token` (0: never) and ended at `ended`; `usage` is (input, output) tokens when
        known, over all its completions. `stream_tokens`: the output tokens of its longest
        single completion (of n, or of a batch's prompts), which TPOT divides by: completions
        decode side by side, so the time per token is that of one stream, not of their sum;
        None: all the output is one stream.

        TTFT and TPOT are of successful responses only (no `error.type`), as the GenAI
        conventions define them: a stream that died 30 s after its third token gave a TPOT of
        15 s, and ones cut short (the client gone, the engine dead) weighed on the p99s that
        dashboards show; their duration, tokens and error count keep them."""
        self.duration.record(ended - started, attrs)
        ok = "error.type" not in attrs
        if first_token and ok:
            self.ttft.record(first_token - started, attrs)
        if usage is None:
            return
        n_in, n_out = usage
        self.tokens.record(n_in, attrs | {"gen_ai.token.type": "input"})
        self.tokens.record(n_out, attrs | {"gen_ai.token.type": "output"})
        if first_token and ok:
            per_stream = n_out if stream_tokens is None else stream_tokens
            if per_stream > 1:
                self.tpot.record((ended - first_token) / (per_stream - 1), attrs)


PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
