"""The gateway's spans and metrics, over a request's phases (see gateway/proxy.py).

One trace per request, continued from the client's `traceparent` when it sent one:

    chat MODEL                       SERVER  the whole request, GenAI attributes, usage at the end
    ├── gateway.validate             parse the body, resolve the model
    ├── gateway.route                session placement, prefix lookup, the worker choice (and the
    │                                wait for a pool to start one); one per attempt
    └── gateway.forward              CLIENT  one per attempt: the call to the worker, until its
        └── (worker spans)           stream ends; carries `traceparent` to the worker

Prompts and outputs go on the root span only when the operator turned content capture on, cut
to its `content_max_chars` each.
The metrics are named in kvstore/telemetry.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kvstore import telemetry as names
from kvstore.telemetry import GenAIMetrics, Telemetry, capped

if TYPE_CHECKING:
    from gateway.cluster import ClusterView
    from gateway.errors import APIError
    from gateway.openai_response import ResponseAssembler
    from gateway.proxy import Call
    from kvstore.protocol import GenerateRequest

# why the router chose a worker (gateway.routing.Route.reason) -> the routing-mix kind
ROUTE_KINDS = {
    "session": "affinity",
    "prefix": "prefix",
    "local": "load",
    "remote": "cross_region",
    "cold_start": "cold_start",
}
OPERATIONS = {"chat": "chat", "completion": "text_completion"}
UNKNOWN_MODEL = "unknown"  # the model label of a request for a model the cluster does not serve


class GatewayTelemetry:
    def __init__(self, tel: Telemetry, region: str) -> None:
        self.tel = tel
        self.tracer = tel.tracer
        self.region = region
        self.record_content = tel.config.record_content
        self.content_max_chars = tel.config.content_max_chars
        self.genai = GenAIMetrics(tel)
        self.routing = tel.counter(names.ROUTING)
        self.retries = tel.counter(names.RETRIES)
        self.errors = tel.counter(names.ERRORS)
        self.redis_duration = tel.histogram(names.REDIS_DURATION)
        self._where = {"edgeinfer.region": region}

    def watch_workers(self, view: ClusterView) -> None:
        """Live workers in the registry, by region, model and role (read at each collection)."""

        def read() -> Iterable[tuple[float, Mapping[str, str]]]:
            counts: dict[tuple[str, str, str], int] = {}
            for w in view.live_workers():
                key = (w.region, w.model, w.role)
                counts[key] = counts.get(key, 0) + 1
            return [
                (n, self._where | {"worker_region": r, "model": m, "role": role})
                for (r, m, role), n in counts.items()
            ]

        self.tel.observe(names.GATEWAY_WORKERS, read)

    # ------------------------------------------------------------------ spans
    def start(self, call: Call, headers: Mapping[str, str], operation: str) -> None:
        """The request's root span, child of the client's trace context if it sent one."""
        call.operation = OPERATIONS.get(operation, operation)
        span = self.tracer.start_span(
            call.operation,
            context=self.tel.extract(headers),
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": call.operation,
                "gen_ai.provider.name": names.PROVIDER,
                "edgeinfer.region": self.region,
                "edgeinfer.request.id": call.request_id,
            },
        )
        call.span = span
        call.trace_ctx = trace.set_span_in_context(span)

    def validated(self, call: Call, gens: Sequence[GenerateRequest]) -> None:
        """The request's attributes, once validated: `gens`, its prompts (a completions batch
        has several; `call.gen` is the first)."""
        assert call.gen is not None and call.span is not None
        call.span.update_name(f"{call.operation} {call.gen.model}")
        call.span.set_attribute("gen_ai.request.model", call.gen.model)
        if call.session_id is not None:
            call.span.set_attribute("gen_ai.conversation.id", call.session_id)
        sampling = call.gen.sampling
        for key, attr in (("max_tokens", "gen_ai.request.max_tokens"),
                          ("temperature", "gen_ai.request.temperature"),
                          ("top_p", "gen_ai.request.top_p"),
                          ("top_k", "gen_ai.request.top_k"),
                          ("presence_penalty", "gen_ai.request.presence_penalty"),
                          ("frequency_penalty", "gen_ai.request.frequency_penalty"),
                          ("seed", "gen_ai.request.seed")):  # fmt: skip
            if sampling.get(key) is not None and not (key == "top_k" and sampling[key] < 0):
                call.span.set_attribute(attr, sampling[key])
        if sampling.get("n", 1) != 1:  # (the conventions' condition: given and not 1)
            call.span.set_attribute("gen_ai.request.choice.count", sampling["n"])
        if self.record_content and call.span.is_recording():
            content: Any = call.gen.messages if call.gen.messages is not None else call.gen.prompt
            if len(gens) > 1:  # a batch: every prompt (the output holds every one's choices)
                content = [g.prompt for g in gens]
            text = capped(orjson.dumps(content).decode(), self.content_max_chars)
            call.span.set_attribute("gen_ai.input.messages", text)

    def phase(self, call: Call, name: str, started: float) -> None:
        """A finished phase as a child span of the request: `started` is its perf_counter()
        start; it ends now."""
        if call.span is None or not call.span.is_recording():
            return
        end = time.time_ns()
        begin = end - int((time.perf_counter() - started) * 1e9)
        self.tracer.start_span(name, context=call.trace_ctx, start_time=begin).end(end_time=end)

    def forward(self, call: Call, worker_id: str, headers: dict[str, str]) -> Span:
        """The span of one attempt at a worker; its context goes into `headers`. Attempts are
        counted on `call`: `tried`, the workers set aside, misses a retry after the prefill
        worker failed or refused (the same decode worker is called again)."""
        call.attempts += 1
        span = self.tracer.start_span(
            "gateway.forward",
            context=call.trace_ctx,
            kind=SpanKind.CLIENT,
            attributes={"edgeinfer.worker.id": worker_id, "edgeinfer.attempt": call.attempts},
        )
        self.tel.inject(headers, trace.set_span_in_context(span))
        return span

    # ------------------------------------------------------------------ metrics
    def routed(self, reason: str) -> None:
        self.routing.add(1, self._where | {"kind": ROUTE_KINDS.get(reason, reason)})

    def retried(self) -> None:
        self.retries.add(1, self._where)

    def redis(self, operation: str, seconds: float, error: str | None = None) -> None:
        """One call that reached Redis (or tried to): `error`, its error's type if it failed."""
        labels = self._where | {"operation": operation}
        if error is not None:
            labels["error.type"] = error
        self.redis_duration.record(seconds, labels)

    def error(self, err: APIError) -> None:
        """A request answered with an error, whichever phase raised it (the app's error
        middleware counts those; the proxy those that end a stream already under way)."""
        self.errors.add(1, self._where | {"error.type": err.code or err.type})

    def finish(
        self, calls: list[Call], assembler: ResponseAssembler | None, err: APIError | None
    ) -> None:
        """The request ended (answered, failed mid-stream, or refused with `err`): usage and
        timings on the root span and the GenAI histograms; ends the root span. `calls`: one per
        prompt, the first one's telemetry the request's.

        TTFT runs to the first token of any prompt, streamed or not; TPOT divides the time from
        there to the end by the tokens of the longest choice (n choices and a batch's prompts
        decode side by side), not by the usage's sum over all of them."""
        call = calls[0]
        error = (err.code or err.type) if err is not None else None
        now = time.perf_counter()
        attrs: dict[str, Any] = self._where | {
            "gen_ai.operation.name": call.operation,
            "gen_ai.provider.name": names.PROVIDER,
        }
        if call.gen is not None:  # (a model not served is the client's choice: no new series;
            # nor one this gateway could not look up: the registry unreachable, say)
            attrs["gen_ai.request.model"] = call.gen.model if call.model_known else UNKNOWN_MODEL
        span = call.span
        usage = assembler.usage if assembler is not None else None
        if error is not None:
            attrs["error.type"] = error
        counts = (int(usage["prompt_tokens"]), int(usage["completion_tokens"])) if usage else None
        first_token = min((c.first_token for c in calls if c.first_token), default=0.0)
        longest = max((n for c in calls for n in c.stream_tokens.values()), default=0)
        self.genai.record(attrs, call.started, first_token, now, counts, longest or None)
        if span is None:
            return
        if span.is_recording():
            if call.worker is not None:
                span.set_attribute("edgeinfer.worker.id", call.worker.worker_id)
                span.set_attribute("edgeinfer.worker.region", call.worker.region)
                span.set_attribute("edgeinfer.route", ROUTE_KINDS.get(call.route_reason, ""))
            if call.prefill is not None:
                span.set_attribute("edgeinfer.prefill_worker.id", call.prefill.worker_id)
            if usage is not None:
                span.set_attribute("gen_ai.usage.input_tokens", int(usage["prompt_tokens"]))
                span.set_attribute("gen_ai.usage.output_tokens", int(usage["completion_tokens"]))
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                span.set_attribute("gen_ai.usage.cache_read.input_tokens", int(cached))
            if assembler is not None:
                span.set_attribute("gen_ai.response.id", assembler.id)
                reasons = [c.finish_reason for c in assembler.choices if c.finish_reason]
                if reasons:
                    span.set_attribute("gen_ai.response.finish_reasons", reasons)
                if self.record_content:
                    texts = ["".join(c.text) for c in assembler.choices]
                    text = capped(orjson.dumps(texts).decode(), self.content_max_chars)
                    span.set_attribute("gen_ai.output.messages", text)
            if err is not None:
                span.set_attribute("error.type", str(error))
                span.set_attribute("http.response.status_code", err.status)
                span.set_status(Status(StatusCode.ERROR, err.message[:200]))
        span.end()
