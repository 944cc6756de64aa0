"""Which worker serves a request: session placement, then load in the own region, then geo.

The order, as the gateway applies it:
1. the session's placed worker (`x-session-affinity`), if it is alive, serves the model and is
   not overloaded: its KV cache holds the conversation;
2. the least-loaded worker in the gateway's own region (load = tokens still to compute on the
   worker, as its heartbeat published it, plus what this gateway has sent it since);
3. the least-loaded worker of the nearest region (great-circle distance) with capacity.
The result is an ordered list of candidates: the first is the choice, the rest are where a retry
goes when a worker fails before anything reached the client.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from gateway.regions import RegionCatalog
from kvstore.placement import Placement
from kvstore.protocol import WorkerInfo

LOAD_TIE_TOKENS = 256  # loads closer than this count as equal (heartbeats lag the truth)
SERVING_ROLES = ("mixed",)  # roles that serve a whole request (prefill/decode split: later)


@dataclass(slots=True)
class Route:
    """The routing decision for one request."""

    candidates: list[WorkerInfo]  # in preference order; empty when nothing can serve
    reason: str  # "session" | "local" | "remote" (why the first candidate), or why none:
    # "no_workers" (none alive for the model: 503) | "at_capacity" (all overloaded: 429)


class Router:
    """Routing policy over a snapshot of the registry. Holds only this gateway's in-flight counts."""

    def __init__(self, region: str, catalog: RegionCatalog) -> None:
        self.region = region
        self.catalog = catalog
        self.inflight_tokens: dict[
            str, int
        ] = {}  # worker id -> tokens this gateway sent, unfinished
        self._turn = itertools.count()  # rotates ties so equal workers share new sessions

    def load(self, w: WorkerInfo) -> int:
        return w.load_tokens + self.inflight_tokens.get(w.worker_id, 0)

    def route(
        self,
        model: str,
        workers: list[WorkerInfo],
        placement: Placement | None = None,
        exclude: frozenset[str] = frozenset(),
    ) -> Route:
        alive = [
            w
            for w in workers
            if w.model == model
            and w.role in SERVING_ROLES
            and not w.draining
            and w.worker_id not in exclude
        ]
        if not alive:
            return Route([], "no_workers")
        usable = [w for w in alive if not w.overloaded]
        if not usable:
            return Route([], "at_capacity")
        turn = next(self._turn)
        by_region: dict[str, list[WorkerInfo]] = {}
        for w in usable:
            by_region.setdefault(w.region, []).append(w)
        ordered: list[WorkerInfo] = []
        for region in self.catalog.nearest_first(self.region, list(by_region)):
            group = by_region[region]
            # least load first; among (nearly) equal loads, rotate so new sessions spread evenly
            group.sort(key=lambda w: (self.load(w), w.worker_id))
            # loads are a heartbeat old: treat a difference under one request's worth as a tie
            best = [w for w in group if self.load(w) <= self.load(group[0]) + LOAD_TIE_TOKENS]
            k = turn % len(best)
            ordered += best[k:] + best[:k] + group[len(best) :]
        reason = "local" if ordered[0].region == self.region else "remote"
        if placement is not None:
            placed = next((w for w in ordered if w.worker_id == placement.worker_id), None)
            if placed is not None:
                ordered.remove(placed)
                ordered.insert(0, placed)
                reason = "session"
        return Route(ordered, reason)

    def sent(self, worker_id: str, tokens: int) -> None:
        self.inflight_tokens[worker_id] = self.inflight_tokens.get(worker_id, 0) + tokens

    def done(self, worker_id: str, tokens: int) -> None:
        left = self.inflight_tokens.get(worker_id, 0) - tokens
        if left > 0:
            self.inflight_tokens[worker_id] = left
        else:
            self.inflight_tokens.pop(worker_id, None)
