"""Rebalancing the prefill:decode ratio, decided from a registry snapshot (no processes)."""

from __future__ import annotations

import pytest

from kvstore.protocol import WorkerInfo
from runtime.pool import plan


def w(wid: str, role: str, region: str = "eu", **kw: object) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, region=region, model="m", role=role,  # type: ignore[arg-type]
                      url=f"http://{wid}", max_num_seqs=8, capacity_tokens=1000, **kw)  # fmt: skip


POOL = [
    w("p1", "prefill", prefill_tokens=900),
    w("p2", "prefill", prefill_tokens=10),
    w("d1", "decode", decode_seqs=7),
    w("d2", "decode", decode_seqs=1),
    w("mx", "mixed"),
    w("gone", "decode", draining=True),
    w("us", "decode", region="us"),
]


def _ids(changes) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return [(c.worker.worker_id, c.role) for c in changes]


def test_more_prefill_takes_the_idlest_decode_workers() -> None:
    assert _ids(plan(POOL, "m", "eu", 3)) == [("d2", "prefill")]
    assert _ids(plan(POOL, "m", "eu", 4)) == [("d2", "prefill"), ("d1", "prefill")]


def test_fewer_prefill_releases_the_least_busy_prefill_workers() -> None:
    assert _ids(plan(POOL, "m", "eu", 1)) == [("p2", "decode")]
    assert _ids(plan(POOL, "m", "eu", 0)) == [("p2", "decode"), ("p1", "decode")]
    assert plan(POOL, "m", "eu", 2) == []


def test_all_regions_and_limits() -> None:
    # "us" runs no sequence: the idlest of all regions' decode workers goes first
    assert _ids(plan(POOL, "m", None, 5)) == [
        ("us", "prefill"),
        ("d2", "prefill"),
        ("d1", "prefill"),
    ]
    with pytest.raises(ValueError, match="has 4 prefill/decode workers in region eu"):
        plan(POOL, "m", "eu", 5)
    with pytest.raises(ValueError):
        plan(POOL, "m", "eu", -1)
    assert plan(POOL, "other", None, 0) == []
