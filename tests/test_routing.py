"""Routing policy and region catalog, driven step by step (no processes, no Redis)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.regions import DEFAULT_CATALOG, CatalogError, RegionCatalog
from gateway.routing import Router
from kvstore.placement import Placement
from kvstore.protocol import WorkerInfo

CATALOG = RegionCatalog.load(DEFAULT_CATALOG)


def worker(wid: str, region: str = "eu-west", load: int = 0, **kw: object) -> WorkerInfo:
    fields: dict = dict(  # type: ignore[type-arg]
        worker_id=wid, region=region, model="m", role="mixed", url=f"http://{wid}",
        max_num_seqs=4, capacity_tokens=1000, load_tokens=load,
    )  # fmt: skip
    fields.update(kw)
    return WorkerInfo(**fields)


def test_least_loaded_local_first_then_nearest_region() -> None:
    r = Router("eu-west", CATALOG)
    ws = [
        worker("a", load=5000),
        worker("b", load=100),
        worker("far", "ap-southeast"),
        worker("near", "eu-central"),
    ]
    route = r.route("m", ws)
    assert [w.worker_id for w in route.candidates] == ["b", "a", "near", "far"]
    assert route.reason == "local"


def test_session_placement_wins_unless_overloaded_or_gone() -> None:
    r = Router("eu-west", CATALOG)
    ws = [worker("a"), worker("b", load=9000)]
    route = r.route("m", ws, Placement("b", "eu-west"))
    assert route.candidates[0].worker_id == "b" and route.reason == "session"
    busy = [worker("a"), worker("b", running=4, waiting=3)]
    assert r.route("m", busy, Placement("b", "eu-west")).candidates[0].worker_id == "a"
    assert r.route("m", ws, Placement("gone", "eu-west")).candidates[0].worker_id == "a"


def test_remote_region_when_local_has_no_capacity() -> None:
    r = Router("eu-west", CATALOG)
    ws = [
        worker("local", running=4, waiting=1),
        worker("us", "us-east"),
        worker("tokyo", "ap-northeast"),
    ]
    route = r.route("m", ws)
    assert [w.worker_id for w in route.candidates] == ["us", "tokyo"]
    assert route.reason == "remote"


def test_no_workers_vs_at_capacity_vs_excluded() -> None:
    r = Router("eu-west", CATALOG)
    assert r.route("m", []).reason == "no_workers"
    assert r.route("other", [worker("a")]).reason == "no_workers"
    assert r.route("m", [worker("a", draining=True)]).reason == "no_workers"
    assert r.route("m", [worker("a", role="prefill")]).reason == "no_workers"
    assert r.route("m", [worker("a", running=4, waiting=2)]).reason == "at_capacity"
    ws = [worker("a"), worker("b")]
    assert [w.worker_id for w in r.route("m", ws, exclude=frozenset({"a"})).candidates] == ["b"]


def test_ties_rotate_and_inflight_counts() -> None:
    r = Router("eu-west", CATALOG)
    ws = [worker("a"), worker("b", load=10)]  # within the tie margin: rotate
    firsts = {r.route("m", ws).candidates[0].worker_id for _ in range(4)}
    assert firsts == {"a", "b"}
    r.sent("a", 10_000)
    assert all(r.route("m", ws).candidates[0].worker_id == "b" for _ in range(4))
    r.done("a", 10_000)
    assert r.inflight_tokens == {}


def test_workers_that_hold_the_same_prefix_share_new_sessions() -> None:
    """Every worker holds a shared system prompt: new sessions rotate over them (they all
    went to the first worker id); a worker holding more of the prompt still wins."""
    r = Router("eu-west", CATALOG)
    ws = [worker("a"), worker("b"), worker("c")]
    same = {"a": 64, "b": 64, "c": 64}
    firsts = [r.route("m", ws, cached=same, prompt_tokens=100).candidates[0].worker_id
              for _ in range(6)]  # fmt: skip
    assert sorted(firsts) == ["a", "a", "b", "b", "c", "c"]
    more = {"a": 64, "b": 96, "c": 64}
    routes = [r.route("m", ws, cached=more, prompt_tokens=100) for _ in range(3)]
    assert {(x.candidates[0].worker_id, x.reason) for x in routes} == {("b", "prefix")}


def test_great_circle_distances() -> None:
    assert CATALOG.distance_km("eu-west", "eu-west") == 0
    d = CATALOG.distance_km("us-east", "eu-west")  # Ashburn - Dublin, about 5,450 km
    assert 5200 < d < 5700
    assert CATALOG.nearest_first("eu-west", ["ap-southeast", "us-east", "eu-central"]) == [
        "eu-central",
        "us-east",
        "ap-southeast",
    ]
    assert CATALOG.distance_km("eu-west", "mars") == float("inf")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("regions: []", "non-empty"),
        ("regions: [{name: a, latitude: 91, longitude: 0}]", "latitude"),
        ("regions: [{name: 'a b', latitude: 0, longitude: 0}]", "name"),
        ("regions: [{name: a, latitude: 0, longitude: 0}, {name: a, latitude: 1, longitude: 1}]", "duplicate"),
        ("regions: [{name: a, latitude: x, longitude: 0}]", "number"),
        (": : :", "YAML"),
    ],
)  # fmt: skip
def test_catalog_errors_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "regions.yaml"
    path.write_text(text)
    with pytest.raises(CatalogError, match=message):
        RegionCatalog.load(path)
    with pytest.raises(CatalogError, match="cannot read"):
        RegionCatalog.load(tmp_path / "missing.yaml")


# ---------------------------------------------------------------------- disaggregation
def test_roles_decide_whether_requests_are_disaggregated() -> None:
    p, d, m = worker("p", role="prefill"), worker("d", role="decode"), worker("m", role="mixed")
    assert Router.serving_roles("m", [p, d, m]) == (("decode", "mixed"), True)
    assert Router.serving_roles("m", [p, m]) == (("mixed",), False)
    assert Router.serving_roles("m", [d]) == (("decode",), False)  # one side up: it serves all
    assert Router.serving_roles("m", [p, worker("d", role="decode", draining=True)]) == (
        ("prefill",),
        False,
    )
    assert Router.serving_roles("other", [p, d]) == (("mixed",), False)
    r = Router("eu-west", CATALOG)
    route = r.route("m", [p, d, m], roles=("decode", "mixed"))
    assert {w.worker_id for w in route.candidates} == {"d", "m"}


def test_prefill_worker_by_prefill_load_then_prefix_hits() -> None:
    r = Router("eu-west", CATALOG)
    busy = worker("busy", role="prefill", kv_addr="h:1", prefill_tokens=4000)
    idle = worker("idle", role="prefill", kv_addr="h:2")
    holder = worker("holder", role="prefill", kv_addr="h:3", prefill_tokens=100)
    no_addr = worker("noaddr", role="prefill")
    decode = worker("d", role="decode", kv_addr="h:4")
    ws = [busy, idle, holder, no_addr, decode]
    order = [w.worker_id for w in r.prefill_candidates("m", ws, prompt_tokens=500)]
    assert order[-1] == "busy" and set(order) == {"busy", "idle", "holder"}
    # the holder has 480 of the 500 prompt tokens cached: 100 + 20 beats 0 + 500
    cached = {"holder": 480}
    order = [w.worker_id for w in r.prefill_candidates("m", ws, cached=cached, prompt_tokens=500)]
    assert order == ["holder", "idle", "busy"]
    # what this gateway sent counts until it is done; failed workers are excluded
    r.sent_prefill("holder", 5000)
    order = [w.worker_id for w in r.prefill_candidates("m", ws, cached=cached, prompt_tokens=500)]
    assert order[0] == "idle"
    r.done_prefill("holder", 5000)
    assert r.inflight_prefill == {}
    order = r.prefill_candidates("m", ws, frozenset({"holder", "idle"}), cached, 500)
    assert [w.worker_id for w in order] == ["busy"]


def test_prefill_workers_whose_kv_the_decode_worker_cannot_take_are_skipped() -> None:
    # a decode worker with a bfloat16 KV cache refuses a float32 worker's blocks (its cache id
    # differs): that prefill worker is no candidate, however idle, rather than a failed pull
    r = Router("eu-west", CATALOG)
    same = worker("same", role="prefill", kv_addr="h:1", prefill_tokens=900, cache_id="r-float32-kvbfloat16-b16")
    other = worker("other", role="prefill", kv_addr="h:2", cache_id="r-float32-b16")
    ws = [same, other]
    order = r.prefill_candidates("m", ws, prompt_tokens=50, cache_id="r-float32-kvbfloat16-b16")
    assert [w.worker_id for w in order] == ["same"]
    order = r.prefill_candidates("m", ws, prompt_tokens=50)  # no id known: all, by load
    assert [w.worker_id for w in order] == ["other", "same"]


def test_new_sessions_spread_over_decode_workers_when_each_also_picks_a_prefill_worker() -> None:
    """Disaggregated, each request routes once and picks a prefill worker once: both rotated
    ties on one count, so the decode route saw only even turns and two idle decode workers
    never shared (every new session went to the first one, and stayed there)."""
    r = Router("eu-west", CATALOG)
    ws = [worker("d1", role="decode", kv_addr="h:1"), worker("d2", role="decode", kv_addr="h:2"),
          worker("p1", role="prefill", kv_addr="h:3"), worker("p2", role="prefill", kv_addr="h:4")]  # fmt: skip
    roles, disaggregated = Router.serving_roles("m", ws)
    assert disaggregated
    decode, prefill = [], []
    for _ in range(4):  # one request at a time: nothing in flight breaks the ties
        decode.append(r.route("m", ws, roles=roles, prompt_tokens=100).candidates[0].worker_id)
        prefill.append(r.prefill_candidates("m", ws, prompt_tokens=100)[0].worker_id)
    assert sorted(decode) == ["d1", "d1", "d2", "d2"]
    assert sorted(prefill) == ["p1", "p1", "p2", "p2"]


def _catalog(tmp_path: Path, text: str) -> RegionCatalog:
    path = tmp_path / "regions.yaml"
    path.write_text(text)
    return RegionCatalog.load(path)


def test_the_own_region_comes_first_among_regions_at_one_place(tmp_path: Path) -> None:
    """Two regions at one point of presence (the same coordinates) are 0 km apart: ties went by
    name, so a gateway of "b" preferred region "a"'s workers to its own, idle, ones ("remote")."""
    catalog = _catalog(tmp_path, "regions: [{name: a, latitude: 48.8, longitude: 2.3}, "
                                 "{name: b, latitude: 48.8, longitude: 2.3}, "
                                 "{name: c, latitude: 50.1, longitude: 8.7}]")  # fmt: skip
    assert catalog.distance_km("a", "b") == 0
    assert catalog.nearest_first("b", ["c", "a", "b"]) == ["b", "a", "c"]
    route = Router("b", catalog).route("m", [worker("in-a", "a"), worker("in-b", "b")])
    assert [w.worker_id for w in route.candidates] == ["in-b", "in-a"]
    assert route.reason == "local"


def test_antipodal_and_polar_regions_have_finite_distances(tmp_path: Path) -> None:
    """Points on opposite sides of the earth are half its circumference apart (rounding may put
    the haversine's argument a hair above 1, outside asin's domain), at the poles too."""
    import math

    catalog = _catalog(tmp_path, "regions: [{name: a, latitude: 10, longitude: 20}, "
                                 "{name: b, latitude: -10, longitude: -160}, "
                                 "{name: n, latitude: 90, longitude: 0}, "
                                 "{name: s, latitude: -90, longitude: 180}]")  # fmt: skip
    half = math.pi * 6371.0
    for x, y in (("a", "b"), ("n", "s")):
        assert catalog.distance_km(x, y) == pytest.approx(half)
    assert catalog.nearest_first("a", ["b", "n", "s"])[-1] == "b"


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_catalog_refuses_coordinates_that_are_not_finite(tmp_path: Path, value: str) -> None:
    with pytest.raises(CatalogError, match="latitude"):
        _catalog(tmp_path, f"regions: [{{name: a, latitude: {value}, longitude: 0}}]")
