"""Telemetry faults found by review, each reproduced with the real components (see
tests/test_telemetry.py for the end-to-end checks)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from gateway.app import TELEMETRY
from gateway.app import make_app as gateway_app
from gateway.config import GatewayConfig
from gateway.proxy import Call
from gateway.telemetry import GatewayTelemetry
from kvstore import telemetry as names
from kvstore.protocol import SECRET_HEADER, GenerateRequest
from kvstore.redis_server import LocalRedis
from kvstore.telemetry import (
    CONTENT_MAX_CHARS,
    Telemetry,
    TelemetryConfig,
    capped,
    sample_key_of,
)
from runtime.telemetry import RequestTimes, WorkerTelemetry
from runtime.worker import Worker
from tests.stack import SECRET
from tests.test_telemetry import (
    CATALOG,
    STORY,
    Recorded,
    _by_name,
    _child_of,
    _one,
    _wait_for,
    in_process,
)


@pytest.mark.parametrize("ratio", [0.02, 1.0])
def test_a_client_cannot_choose_trace_ids_the_gateway_always_keeps(ratio: float) -> None:
    """The gateway keeps a client's trace at its own ratio: it did so by trace id
    (TraceIdRatioBased), which keeps every id whose low 64 bits are small, so a client sending
    such ids had each of its requests recorded, by the gateway and by the workers behind it
    (which follow its flag), at any ratio above 0."""
    config = TelemetryConfig("edgeinfer-gateway", "local", trace_sample_ratio=ratio,
                             trust_remote_sampled=False)  # fmt: skip
    tel = Telemetry(config, InMemorySpanExporter(), [])
    kept = 0
    for _ in range(300):
        # ids whose low 64 bits are small (one id is kept or dropped whole:
        # test_a_clients_trace_is_kept_or_dropped_whole)
        chosen = f"00-{secrets.token_hex(8)}0000000000000001-{secrets.token_hex(8)}-00"
        span = tel.tracer.start_span("chat m", context=tel.extract({"traceparent": chosen}))
        kept += span.is_recording()
        span.end()
    tel.shutdown()
    if ratio == 1.0:
        assert kept == 300
    else:  # ~6 expected; the old code kept all 300
        assert kept < 40, kept


# ---------------------------------------------------------------------- sampling
def _traceparent(trace_id: str, sampled: bool) -> str:
    return f"00-{trace_id}-{secrets.token_hex(8)}-{'01' if sampled else '00'}"


@pytest.mark.parametrize("client_sampled", [True, False])
def test_a_gateway_that_does_not_trace_lets_no_client_decide_what_workers_record(
    client_sampled: bool,
) -> None:
    """A gateway with no exporter (the no-op tracer) passed the client's `traceparent` on as it
    came, and its workers, which obey the sampled flag they get, recorded every request whose
    client said 01 (at any worker ratio) and none whose client said 00. The context now stops
    there: each worker decides at its own ratio, as for a request that came without one."""
    gateway = GatewayTelemetry(Telemetry(TelemetryConfig("edgeinfer-gateway", "local",
                                                         trust_remote_sampled=False)), "local")  # fmt: skip
    assert not gateway.tel.tracing
    # the worker keeps no new trace when the client said 01, and every one when it said 00
    ratio = 0.0 if client_sampled else 1.0
    worker_tel = Telemetry(TelemetryConfig("edgeinfer-worker", "local", trace_sample_ratio=ratio),
                           InMemorySpanExporter())  # fmt: skip
    worker = WorkerTelemetry(worker_tel, "w-1", "local", "stories")
    recorded = 0
    for i in range(20):
        call = Call(f"r-{i}", None, time.perf_counter())
        client = {"traceparent": _traceparent(secrets.token_hex(16), client_sampled)}
        gateway.start(call, client, "completion")
        headers: dict[str, str] = {}
        gateway.forward(call, "w-1", headers).end()
        span = worker.start(headers, GenerateRequest(f"r-{i}", "stories", prompt="x"), "mixed")
        recorded += span.is_recording()
        span.end()
    worker_tel.shutdown()
    assert recorded == (0 if client_sampled else 20), recorded  # the old code: 20, or 0


def test_a_clients_trace_is_kept_or_dropped_whole() -> None:
    """The gateway's decision for a trace a client began is the same for each of its requests
    (a keyed hash of the trace id): a random draw for each split a client's trace of several
    requests into kept and dropped ones. Gateways given the same key (`sample_key`) decide
    alike; without one, each process has its own (a client cannot learn ids that are kept)."""

    def gateway(key: bytes) -> Telemetry:
        return Telemetry(TelemetryConfig("edgeinfer-gateway", "local", trace_sample_ratio=0.5,
                                         trust_remote_sampled=False, sample_key=key),
                         InMemorySpanExporter())  # fmt: skip

    shared = sample_key_of("the cluster's secret")
    tels = [gateway(shared), gateway(shared), gateway(b""), gateway(b"")]
    decisions: list[list[bool]] = [[] for _ in tels]
    for _ in range(40):
        trace_id = secrets.token_hex(16)
        for tel, kept in zip(tels, decisions, strict=True):
            seen = set()
            for _ in range(8):  # one client trace, 8 requests
                span = tel.tracer.start_span("chat m", context=tel.extract(
                    {"traceparent": _traceparent(trace_id, True)}))  # fmt: skip
                seen.add(span.is_recording())
                span.end()
            assert len(seen) == 1, "one trace, kept in part"  # the old code: split 38-40 of 40
            kept.append(seen.pop())
    for tel in tels:
        tel.shutdown()
    assert all(5 <= sum(d) <= 35 for d in decisions)  # at the ratio, not all or none
    assert decisions[0] == decisions[1]  # one key, one decision
    assert decisions[2] != decisions[3] and decisions[2] != decisions[0]  # (2**-40 by chance)


def test_gateways_of_one_cluster_share_their_sampling_key(tmp_path: Path) -> None:
    """make_app derives the key from the workers' shared secret, which every gateway of the
    cluster has and no client: replicas keep the same client traces."""
    catalog = tmp_path / "regions.yaml"
    catalog.write_text(CATALOG)

    def key(secret: str) -> bytes:
        config = GatewayConfig(region="local", redis_url="redis://127.0.0.1:1/0",
                               worker_secret=secret, catalog_path=catalog)  # fmt: skip
        return gateway_app(config)[TELEMETRY].tel.config.sample_key

    assert key("s3cret") == key("s3cret") == sample_key_of("s3cret") != key("other")
    with pytest.raises(ValueError, match="sample_key"):
        TelemetryConfig("edgeinfer-gateway", "local", sample_key=b"k" * 65)


# ---------------------------------------------------------------------- content capture
def test_capped_says_what_it_cut() -> None:
    assert capped("abc", 64) == "abc"
    text = capped("x" * 4_000_000, 100)
    assert len(text) == 100 and text.endswith("[truncated: 4000000 characters]")
    with pytest.raises(ValueError, match="content_max_chars"):
        TelemetryConfig("edgeinfer-gateway", "local", content_max_chars=10)


def test_a_workers_recorded_output_is_capped_json() -> None:
    """A worker recorded its outputs whole (and as a Python repr, not JSON as the gateway)."""
    spans = InMemorySpanExporter()
    tel = Telemetry(TelemetryConfig("edgeinfer-worker", "local", record_content=True,
                                    content_max_chars=1000), spans)  # fmt: skip
    worker = WorkerTelemetry(tel, "w-1", "local", "stories")
    req = GenerateRequest("r-1", "stories", prompt="x")
    span = worker.start({}, req, "mixed")
    now = time.monotonic()
    times = RequestTimes(now, arrival=now, scheduled=now, first_token=now, ended=now)
    worker.finish(span, req, times, (1, 2, 0), None, ["y" * 50_000, "z"])
    span = worker.start({}, req, "mixed")
    worker.finish(span, req, times, (1, 2, 0), None, ["it's"])
    tel.shutdown()
    big, small = [(s.attributes or {})["gen_ai.output.messages"]
                  for s in spans.get_finished_spans() if s.name == "generate stories"]  # fmt: skip
    assert isinstance(big, str) and len(big) == 1000 and "truncated: 50008 characters" in big
    assert json.loads(str(small)) == ["it's"]


async def test_a_long_prompt_recorded_on_the_gateway_is_capped(
    redis: LocalRedis, tmp_path: Path, stories_dir: Path
) -> None:
    """Content capture put a prompt on the root span whole: 100,000 characters here (a 4 MB
    body, 4 MB), which collectors refuse (the span is lost) or store."""
    async with in_process(redis, tmp_path, stories_dir, ["mixed"], content=True) as stack:
        with pytest.raises(openai.APIStatusError):  # (longer than the model's context)
            await stack.client().completions.create(
                model="stories", prompt="Lily " * 20_000, max_tokens=2
            )
        spans = stack.gateway.finished()
    root = _one(_by_name(spans), "text_completion stories")
    recorded = str((root.attributes or {})["gen_ai.input.messages"])
    assert len(recorded) == CONTENT_MAX_CHARS  # the old code: 100,002
    assert recorded.startswith('"Lily Lily') and recorded.endswith("[truncated: 100002 characters]")


# ---------------------------------------------------------------------- prefix-cache counters
def _total(rec: Recorded, name: str) -> int:
    return sum(int(pt.value) for _, pt in rec.points(name))


async def test_prefix_cache_counters_count_a_request_once(
    redis: LocalRedis, tmp_path: Path, stories_dir: Path
) -> None:
    """The prefix-cache counters read the engine's totals, which count a lookup per sequence:
    a request for n=3 completions counted its prompt 3 times (and its hits 3 times)."""
    async with in_process(redis, tmp_path, stories_dir, ["mixed"]) as stack:
        _, rec = stack.workers["mixed"]
        usage = []
        for _ in range(2):  # the second finds the first's prompt cached
            out = await stack.client().completions.create(
                model="stories", prompt=STORY, max_tokens=3, n=3, temperature=1.0
            )
            assert out.usage is not None
            usage.append(out.usage)
        query, hit = _total(rec, names.PREFIX_QUERY), _total(rec, names.PREFIX_HIT)
    assert query == sum(u.prompt_tokens for u in usage), query  # the old code: 3 times that
    cached = sum((u.prompt_tokens_details.cached_tokens or 0 if u.prompt_tokens_details else 0)
                 for u in usage)  # fmt: skip
    assert 0 < hit == cached, (hit, cached)


async def test_a_disaggregated_request_is_counted_once_in_the_prefix_cache(
    redis: LocalRedis, tmp_path: Path, stories_dir: Path
) -> None:
    """Both sides counted a disaggregated request's prompt: its prefill worker's export and its
    decode worker's import, each a lookup in the engine's totals. It counts where it was
    computed, as the engine's own stats say (4f0459f)."""
    async with in_process(redis, tmp_path, stories_dir, ["prefill", "decode"]) as stack:
        out = await stack.client().completions.create(
            model="stories", prompt=STORY, max_tokens=3, temperature=0.0
        )
        assert out.usage is not None
        query = {role: _total(rec, names.PREFIX_QUERY) for role, (_, rec) in stack.workers.items()}
    # (the export is the prompt but its last token, which the decode worker computes)
    assert query == {"prefill": out.usage.prompt_tokens - 1, "decode": 0}, query


# ---------------------------------------------------------------------- engine-ended requests
@contextlib.asynccontextmanager
async def _held_engine(worker: Worker) -> AsyncIterator[threading.Event]:
    """The worker's engine thread held in a call until the event is set (at the latest on
    leaving): requests posted meanwhile wait, unscheduled, in its inbox."""
    gate = threading.Event()
    held = worker.llm.call(lambda _: gate.wait(10))
    try:
        yield gate
    finally:
        gate.set()
        await held


def _post_generate(worker: Worker, http: aiohttp.ClientSession, rid: str) -> Any:
    req = GenerateRequest(rid, "stories", prompt=STORY, sampling={"max_tokens": 20})
    return http.post(f"{worker.config.url}/internal/generate", data=req.to_json(),
                     headers={SECRET_HEADER: SECRET})  # fmt: skip


async def test_a_request_abandoned_in_the_queue_has_a_queue_span(
    redis: LocalRedis, tmp_path: Path, stories_dir: Path
) -> None:
    """A request whose client left before the engine first scheduled it had no queue span (nor
    any other): its wait, the whole of its time, showed nowhere in the trace."""
    async with in_process(redis, tmp_path, stories_dir, ["mixed"]) as stack:
        worker, rec = stack.workers["mixed"]
        async with aiohttp.ClientSession() as http, _held_engine(worker):

            async def call() -> None:
                async with _post_generate(worker, http, "r-left") as r:
                    await r.read()

            task = asyncio.create_task(call())
            await _wait_for(lambda: worker.llm.num_open_streams == 1, "the request queued")
            task.cancel()  # the client leaves
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await _wait_for(lambda: any(s.name == "generate stories" for s in rec.finished()),
                            "the request's span")  # fmt: skip
        spans = _by_name(rec.finished())
    gen = _one(spans, "generate stories")
    assert (gen.attributes or {})["error.type"] == "client_gone"
    queue = _one(spans, "queue")  # the old code: none
    assert _child_of(queue, gen) and queue.end_time == gen.end_time
    assert "prefill" not in spans and "decode" not in spans


async def test_a_request_the_engine_aborted_is_an_error(
    redis: LocalRedis, tmp_path: Path, stories_dir: Path
) -> None:
    """A request the engine ended with finish_reason "abort" (here by /internal/abort; a
    drain's cut or a preemption with no room would too) was recorded as a success: its span's
    status unset, its duration without error.type."""
    async with in_process(redis, tmp_path, stories_dir, ["mixed"]) as stack:
        worker, rec = stack.workers["mixed"]
        async with (
            aiohttp.ClientSession() as http,
            _held_engine(worker) as gate,
            _post_generate(worker, http, "r-abort") as r,
        ):
            await _wait_for(lambda: worker.llm.num_open_streams == 1, "the request")
            async with http.post(f"{worker.config.url}/internal/abort",
                                 json={"request_id": "r-abort"},
                                 headers={SECRET_HEADER: SECRET}) as a:  # fmt: skip
                assert a.status == 200
            gate.set()
            events = [json.loads(line) for line in (await r.read()).splitlines() if line]
        assert any(e.get("finish_reason") == "abort" for e in events), events
        assert events[-1]["type"] == "done"
        gen = _one(_by_name(rec.finished()), "generate stories")
        durations = {a.get("error.type"): pt.count for a, pt in rec.points(names.REQUEST_DURATION)}
    assert gen.status.status_code is StatusCode.ERROR  # the old code: UNSET
    assert (gen.attributes or {})["error.type"] == "aborted"
    assert durations == {"aborted": 1}  # the old code: {None: 1}


@pytest.mark.parametrize("where", ["_sampling_params", "_accept"])
async def test_a_worker_bug_before_the_stream_still_ends_the_span(
    redis: LocalRedis, tmp_path: Path, stories_dir: Path, monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:  # fmt: skip
    """An unexpected exception while a request was prepared or handed to the engine (a bug:
    aiohttp answers 500) left its span open for ever: never exported, and the request in no
    duration metric, so neither the traces nor the error rate showed the failure."""
    import runtime.worker as worker_module

    def bug(*args: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(worker_module, where, bug)
    async with in_process(redis, tmp_path, stories_dir, ["mixed"]) as stack:
        worker, rec = stack.workers["mixed"]
        async with aiohttp.ClientSession() as http, _post_generate(worker, http, "r-bug") as r:
            assert r.status == 500
        spans = _by_name(rec.finished())
        durations = {a.get("error.type"): pt.count for a, pt in rec.points(names.REQUEST_DURATION)}
    gen = _one(spans, "generate stories")  # the old code: none
    assert (gen.attributes or {})["error.type"] == "internal_error"
    assert gen.status.status_code is StatusCode.ERROR
    assert durations == {"internal_error": 1}


def test_forward_spans_number_every_attempt() -> None:
    """The forward span's edgeinfer.attempt was 1 + the workers set aside, which a retry after
    a prefill worker's failure or refusal leaves as they were (the decode worker is called
    again): two attempts both said 1."""
    spans = InMemorySpanExporter()
    gateway = GatewayTelemetry(Telemetry(TelemetryConfig("edgeinfer-gateway", "local"), spans),
                               "local")  # fmt: skip
    call = Call("r-1", None, time.perf_counter())
    gateway.start(call, {}, "completion")
    for _ in range(2):  # the decode worker, the prefill side refused; the same, again
        gateway.forward(call, "local-decode", {}).end()
    assert call.span is not None
    call.span.end()
    gateway.tel.shutdown()
    attempts = [(s.attributes or {})["edgeinfer.attempt"] for s in spans.get_finished_spans()
                if s.name == "gateway.forward"]  # fmt: skip
    assert attempts == [1, 2]  # the old code: [1, 1]


async def test_the_root_span_has_a_batchs_prompts_and_the_requests_choice_count(
    redis: LocalRedis, tmp_path: Path, stories_dir: Path
) -> None:
    """Content capture recorded a completions batch's first prompt alone (its output, every
    prompt's choices), and the root span lacked the GenAI conventions' request attributes
    gen_ai.request.choice.count (required when n is given and not 1), top_k and the
    penalties."""
    async with in_process(redis, tmp_path, stories_dir, ["mixed"], content=True) as stack:
        await stack.client().completions.create(
            model="stories", prompt=["Once", "Lily"], max_tokens=2, n=2, presence_penalty=0.5,
            frequency_penalty=0.25, extra_body={"top_k": 5},
        )  # fmt: skip
        spans = stack.gateway.finished()
    attrs = _one(_by_name(spans), "text_completion stories").attributes or {}
    assert json.loads(str(attrs["gen_ai.input.messages"])) == ["Once", "Lily"]  # old: "Once"
    assert len(json.loads(str(attrs["gen_ai.output.messages"]))) == 4
    assert attrs.get("gen_ai.request.choice.count") == 2
    assert attrs.get("gen_ai.request.top_k") == 5
    assert attrs.get("gen_ai.request.presence_penalty") == 0.5
    assert attrs.get("gen_ai.request.frequency_penalty") == 0.25
