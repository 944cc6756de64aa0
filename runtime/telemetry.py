"""A worker's spans and metrics (the names are in kvstore/telemetry.py).

Each generate call continues the gateway's trace (its `traceparent` header); the engine's
phases become child spans after the fact, from the times the engine kept:

    generate MODEL            SERVER  child of the gateway's gateway.forward
    ├── kv_transfer.pull      CLIENT  disaggregated: the prompt's KV, pulled from a prefill worker
    │   └── kv_transfer.serve SERVER  on the prefill worker: PULL to ACK (its `traceparent` rides
    │       ├── queue                 in the PULL frame); the export's own queue and prefill
    │       └── prefill               (an export ends at its first token: no decode)
    ├── queue                         arrival (or the pull's end) to the first engine step, or
    │                                 to the end of one that never ran (aborted, its client gone)
    ├── prefill                       to the first token
    └── decode                        the first token to the end

Engine times are `time.monotonic()`; spans want wall-clock nanoseconds, so each is converted by
its distance from now.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kvstore import telemetry as names
from kvstore.protocol import GenerateRequest
from kvstore.telemetry import GenAIMetrics, Telemetry, capped


def wall_ns(monotonic: float, now_mono: float, now_ns: int) -> int:
    """A time.monotonic() instant as wall-clock nanoseconds, given one instant on both clocks."""
    return now_ns - int((now_mono - monotonic) * 1e9)


@dataclass(slots=True)
class RequestTimes:
    """Where a request's time on this worker went (time.monotonic(); 0: did not happen)."""

    received: float  # the generate call arrived
    pulled: float = 0.0  # disaggregated: the prompt's KV landed
    arrival: float = 0.0  # the request was handed to the engine
    scheduled: float = 0.0  # its first engine step
    first_token: float = 0.0  # its first output token reached this process
    ended: float = 0.0  # its last output (or failure)
    # the output tokens of its longest completion so far: TPOT's count (its n completions
    # decode side by side, a token each per step); 0: not kept, TPOT counts all of them
    longest_output: int = 0


class WorkerTelemetry:
    def __init__(self, tel: Telemetry, worker_id: str, region: str, model: str) -> None:
        self.tel = tel
        self.tracer = tel.tracer
        self.record_content = tel.config.record_content
        self.content_max_chars = tel.config.content_max_chars
        self.worker_id = worker_id
        self.labels = {"edgeinfer.region": region, "edgeinfer.worker.id": worker_id,
                       "model": model}  # fmt: skip
        self.span_attrs = {"edgeinfer.region": region, "edgeinfer.worker.id": worker_id}
        self.genai = GenAIMetrics(tel)
        self.kv_duration = tel.histogram(names.KV_TRANSFER_DURATION)
        self.cold_start_duration = tel.histogram(names.COLD_START)

    # ------------------------------------------------------------------ gauges and totals
    def watch(
        self,
        stats: Callable[[], Mapping[str, int]],
        kv_sent: Callable[[], int],
        kv_received: Callable[[], int],
    ) -> None:
        """Instruments read at each collection: the engine's load, preemptions and prefix-cache
        totals (`stats`, as AsyncLLM.stats gives them: a request's lookup counted once, where its
        prompt was computed, a disaggregated one's on its prefill worker, as /internal/stats
        says) and the KV bytes moved each way."""
        labels = self.labels

        def one(read: Callable[[Mapping[str, int]], float]) -> Callable[[], Iterable[Any]]:
            return lambda: [(read(stats()), labels)]

        self.tel.observe(names.WORKER_RUNNING, one(lambda s: s["running"]))
        self.tel.observe(names.WORKER_WAITING, one(lambda s: s["waiting"]))
        self.tel.observe(
            names.KV_USAGE,
            one(lambda s: 1.0 - s["free_kv_blocks"] / max(1, s["total_kv_blocks"])),
        )
        self.tel.observe(names.PREFIX_QUERY, one(lambda s: s["prefix_cache_query_tokens"]))
        self.tel.observe(names.PREFIX_HIT, one(lambda s: s["prefix_cache_hit_tokens"]))
        self.tel.observe(names.PREEMPTIONS, one(lambda s: s["num_preemptions"]))
        self.tel.observe(
            names.KV_TRANSFER_BYTES,
            lambda: [
                (kv_sent(), labels | {"direction": "sent"}),
                (kv_received(), labels | {"direction": "received"}),
            ],
        )

    def cold_start(self, phases: Mapping[str, float]) -> None:
        """This worker's start-up: seconds per phase (`total`: process start to ready)."""
        for phase, seconds in phases.items():
            self.cold_start_duration.record(seconds, self.labels | {"phase": phase})

    # ------------------------------------------------------------------ generate calls
    def start(self, headers: Mapping[str, str], req: GenerateRequest, role: str) -> Span:
        attrs: dict[str, Any] = self.span_attrs | {
            "gen_ai.operation.name": req.operation,
            "gen_ai.provider.name": names.PROVIDER,
            "gen_ai.request.model": req.model,
            "edgeinfer.request.id": req.request_id,
            "edgeinfer.worker.role": role,
        }
        if req.session_id is not None:
            attrs["gen_ai.conversation.id"] = req.session_id
        if req.kv_source is not None:
            attrs["edgeinfer.kv_source"] = req.kv_source
        return self.tracer.start_span(
            f"generate {req.model}",
            context=self.tel.extract(headers),
            kind=SpanKind.SERVER,
            attributes=attrs,
        )

    def finish(
        self,
        span: Span,
        req: GenerateRequest,
        times: RequestTimes,
        usage: tuple[int, int, int] | None,
        error: str | None,
        output: list[str] | None = None,
    ) -> None:
        """A generate call ended: `usage` is (prompt, output, cached) tokens when the engine took
        the request; `error` the error code when it failed. Records the phases' spans and the
        GenAI histograms, then ends `span`."""
        times.ended = times.ended or time.monotonic()
        attrs: dict[str, Any] = self.labels | {
            "gen_ai.operation.name": req.operation,
            "gen_ai.provider.name": names.PROVIDER,
            "gen_ai.request.model": req.model,
        }
        if error is not None:
            attrs["error.type"] = error
        counts = (usage[0], usage[1]) if usage is not None else None
        longest = times.longest_output or None
        self.genai.record(attrs, times.received, times.first_token, times.ended, counts, longest)
        now_mono, now_ns = time.monotonic(), time.time_ns()  # one pair: spans nest exactly
        if span.is_recording():
            ctx = trace.set_span_in_context(span)
            self._phases(ctx, times, now_mono, now_ns)
            if usage is not None:
                span.set_attribute("gen_ai.usage.input_tokens", usage[0])
                span.set_attribute("gen_ai.usage.output_tokens", usage[1])
                span.set_attribute("gen_ai.usage.cache_read.input_tokens", usage[2])
            if output is not None and self.record_content:
                text = capped(orjson.dumps(output).decode(), self.content_max_chars)
                span.set_attribute("gen_ai.output.messages", text)
            if error is not None:
                span.set_attribute("error.type", error)
                span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=wall_ns(times.ended, now_mono, now_ns))

    def _phases(self, ctx: Context, times: RequestTimes, now_mono: float, now_ns: int) -> None:
        queued = max(times.arrival, times.pulled)
        first = times.first_token or times.ended
        for name, a, b in (
            # one that left the queue unscheduled (aborted; its client gone) waited till its end
            ("queue", queued, times.scheduled or times.ended),
            ("prefill", times.scheduled, first),
            ("decode", times.first_token, times.ended),
        ):
            # a decode that never ran is no span: a prefill worker's export ends at its first
            # token (`served` is given that instant as both first_token and ended)
            never_decoded = name == "decode" and b == a
            if a and b and b >= a and not never_decoded:
                self.tracer.start_span(
                    name, context=ctx, start_time=wall_ns(a, now_mono, now_ns)
                ).end(end_time=wall_ns(b, now_mono, now_ns))

    # ------------------------------------------------------------------ KV transfer
    def pull_span(self, parent: Context, source: str) -> tuple[Span, str | None]:
        """The decode side's span of one KV pull, and the `traceparent` the PULL carries."""
        span = self.tracer.start_span(
            "kv_transfer.pull",
            context=parent,
            kind=SpanKind.CLIENT,
            attributes=self.span_attrs | {"edgeinfer.kv_source": source},
        )
        return span, self.tel.traceparent(trace.set_span_in_context(span))

    def pull_done(
        self, span: Span, seconds: float, nbytes: int, blocks: int, error: str | None
    ) -> None:
        labels = self.labels | {"direction": "received"}
        if error is not None:  # (a failed transfer's time is not a transfer's: told apart)
            labels["error.type"] = "failed"
        self.kv_duration.record(seconds, labels)
        if span.is_recording():
            span.set_attribute("edgeinfer.kv_transfer.bytes", nbytes)
            span.set_attribute("edgeinfer.kv_transfer.blocks", blocks)
            if error is not None:  # (error.type as on every failed span; the message says why)
                span.set_attribute("error.type", "failed")
                span.set_status(Status(StatusCode.ERROR, error[:200]))
        span.end()

    def served(
        self,
        traceparent: str | None,
        request_id: str,
        started: float,
        nbytes: int,
        ok: bool,
        engine: RequestTimes | None,
    ) -> None:
        """The prefill side served one pull (time.monotonic() `started`, until now)."""
        now_mono, now_ns = time.monotonic(), time.time_ns()
        labels = self.labels | {"direction": "sent"}
        if not ok:
            labels["error.type"] = "failed"
        self.kv_duration.record(now_mono - started, labels)
        parent = self.tel.extract({"traceparent": traceparent} if traceparent else {})
        span = self.tracer.start_span(
            "kv_transfer.serve",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=wall_ns(started, now_mono, now_ns),
            attributes=self.span_attrs
            | {"edgeinfer.request.id": request_id, "edgeinfer.kv_transfer.bytes": nbytes},
        )
        if span.is_recording():
            if engine is not None:
                self._phases(trace.set_span_in_context(span), engine, now_mono, now_ns)
            if not ok:
                span.set_status(Status(StatusCode.ERROR, "the pull ended without an ACK"))
        span.end(end_time=now_ns)
