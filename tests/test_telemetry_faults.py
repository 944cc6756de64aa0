"""Telemetry faults found by review, each reproduced with the real components (see
tests/test_telemetry.py for the end-to-end checks)."""

from __future__ import annotations

import secrets

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvstore.telemetry import Telemetry, TelemetryConfig


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
        chosen = f"00-ffffffffffffffff0000000000000001-{secrets.token_hex(8)}-00"
        span = tel.tracer.start_span("chat m", context=tel.extract({"traceparent": chosen}))
        kept += span.is_recording()
        span.end()
    tel.shutdown()
    if ratio == 1.0:
        assert kept == 300
    else:  # ~6 expected; the old code kept all 300
        assert kept < 40, kept
