"""Which worker serves a request: session placement, then load in the own region, then geo.

The order, as the gateway applies it:
1. the session's placed worker (`x-session-affinity`), if it is alive, serves the model, is
   not overloaded and has KV room: its KV cache holds the conversation (else the session moves);
2. the cheapest worker in the gateway's own region: cost = load (tokens still to compute on the
   worker, as its heartbeat published it, plus what this gateway has sent it since) + the
   prompt tokens not in its prefix cache (from the cluster's prefix index); among workers of
   nearly equal cost the longest cached prefix wins; a worker without KV room for the prompt
   goes last;
3. the least-loaded worker of the nearest region (great-circle distance) with capacity.
The result is an ordered list of candidates: the first is the choice, the rest are where a retry
goes when a worker fails before anything reached the client.

Roles (`serving_roles`): while the model has both a prefill and a decode worker, requests are
disaggregated: the order above picks the decode worker among `decode` (and `mixed`) workers, and
`prefill_candidates` orders the `prefill` workers by prompt tokens still to compute there
(published prefill load, plus what this gateway sent since, plus the prompt tokens not in its
prefix cache), longest cached prefix first among near-equals; only those whose KV the decode
worker can take (the same cache id: model revision, dtypes, block size; a pull from another is
refused) and whose KV cache can hold the prompt (its published `capacity_tokens`: a smaller one
refuses the prefill; the decode worker computes the prompt when no prefill worker can hold it,
gateway/proxy.py). Otherwise `mixed` workers serve
whole requests, and a cluster with only prefill or only decode workers still serves on those.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from gateway.regions import RegionCatalog
from kvstore.placement import Placement
from kvstore.protocol import WorkerInfo

LOAD_TIE_TOKENS = 256  # loads closer than this count as equal (heartbeats lag the truth)


@dataclass(slots=True)
class Route:
    """The routing decision for one request."""

    candidates: list[WorkerInfo]  # in preference order; empty when nothing can serve
    reason: str  # "session" | "prefix" | "local" | "remote" (why the first one), or why none:
    # "no_workers" (none alive for the model: 503) | "at_capacity" (all overloaded: 429)


POLICIES = ("cache-aware", "round-robin")


class Router:
    """Routing policy over a snapshot of the registry. Holds only this gateway's in-flight counts.

    `cache-aware` (the default) is the order in the module docstring, with each worker's cost
    = its load + the prompt tokens it would have to compute (those not in its prefix cache).
    `round-robin` ignores sessions, caches, load and regions (a baseline for benchmarks).
    """

    def __init__(self, region: str, catalog: RegionCatalog, policy: str = "cache-aware") -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        self.region = region
        self.catalog = catalog
        self.policy = policy
        self.inflight_tokens: dict[str, int] = {}  # worker id -> tokens sent here, unfinished
        self.inflight_prefill: dict[str, int] = {}  # prefill worker id -> prompt tokens sent
        self._turn = itertools.count()  # rotates ties so equal workers share new sessions
        # prefill ties rotate on their own count: a request that takes a turn of each would
        # otherwise advance one count by two, and two tied decode workers saw only even turns
        # (every new session of a disaggregated cluster went to the first of them)
        self._prefill_turn = itertools.count()

    def load(self, w: WorkerInfo) -> int:
        return w.load_tokens + self.inflight_tokens.get(w.worker_id, 0)

    def route(
        self,
        model: str,
        workers: list[WorkerInfo],
        placement: Placement | None = None,
        exclude: frozenset[str] = frozenset(),
        cached: dict[str, int] | None = None,
        prompt_tokens: int = 0,
        roles: tuple[str, ...] = ("mixed",),
    ) -> Route:
        """Order the workers of `roles` that can serve `model`.

        `cached`: worker id -> prompt tokens its prefix cache holds (from the prefix index);
        `prompt_tokens`: the prompt's length when the gateway tokenized it (0 when unknown).
        """
        alive = [
            w
            for w in workers
            if w.model == model
            and w.role in roles
            and not w.draining
            and w.worker_id not in exclude
        ]
        if not alive:
            return Route([], "no_workers")
        usable = [w for w in alive if not w.overloaded]
        if not usable:
            return Route([], "at_capacity")
        turn = next(self._turn)
        hits = cached or {}

        def new_tokens(w: WorkerInfo) -> int:
            return max(0, prompt_tokens - hits.get(w.worker_id, 0))

        def has_room(w: WorkerInfo) -> bool:
            return w.free_kv_blocks * w.block_size >= new_tokens(w)

        def cost(w: WorkerInfo) -> int:
            return self.load(w) + new_tokens(w)

        by_region: dict[str, list[WorkerInfo]] = {}
        for w in usable:
            by_region.setdefault(w.region, []).append(w)
        ordered: list[WorkerInfo] = []
        if self.policy == "round-robin":  # every usable worker in turn, whatever its region
            everyone = sorted(usable, key=lambda w: w.worker_id)
            k = turn % len(everyone)
            ordered = everyone[k:] + everyone[:k]
            return Route(ordered, "local" if ordered[0].region == self.region else "remote")
        for region in self.catalog.nearest_first(self.region, list(by_region)):
            group = sorted(by_region[region], key=lambda w: w.worker_id)
            # workers with KV room for the prompt first, then by cost
            group.sort(key=lambda w: (not has_room(w), cost(w)))
            # loads are a heartbeat old: costs closer than one request's worth count as equal;
            # among those, the longest cached prefix wins, and workers that tie on it (every
            # one holding a shared system prompt, or none anything) rotate, so that new
            # sessions spread evenly rather than all going to the first worker id
            c0 = cost(group[0])
            best = [w for w in group if has_room(w) == has_room(group[0])
                    and cost(w) <= c0 + LOAD_TIE_TOKENS]  # fmt: skip
            top = max(hits.get(w.worker_id, 0) for w in best)
            tied = [w for w in best if hits.get(w.worker_id, 0) == top]
            k = turn % len(tied)
            rest = sorted((w for w in best if hits.get(w.worker_id, 0) < top),
                          key=lambda w: (-hits.get(w.worker_id, 0), cost(w)))  # fmt: skip
            best = tied[k:] + tied[:k] + rest
            ordered += best + [w for w in group if w not in best]
        first = ordered[0]
        reason = "local" if first.region == self.region else "remote"
        if reason == "local" and hits.get(first.worker_id, 0) > 0:
            reason = "prefix"
        if placement is not None and self.policy == "cache-aware":
            placed = next((w for w in ordered if w.worker_id == placement.worker_id), None)
            if placed is not None and has_room(placed):
                ordered.remove(placed)
                ordered.insert(0, placed)
                reason = "session"
        return Route(ordered, reason)

    @staticmethod
    def serving_roles(model: str, workers: list[WorkerInfo]) -> tuple[tuple[str, ...], bool]:
        """The roles whose workers take requests for `model` now, and whether prefill and
        decode are disaggregated (a live prefill worker and a live decode worker exist)."""
        present = {w.role for w in workers if w.model == model and not w.draining}
        if "prefill" in present and "decode" in present:
            return ("decode", "mixed"), True
        if "mixed" in present or not present:
            return ("mixed",), False
        return tuple(sorted(present)), False  # only one side is up: it serves whole requests

    def prefill_candidates(
        self,
        model: str,
        workers: list[WorkerInfo],
        exclude: frozenset[str] = frozenset(),
        cached: dict[str, int] | None = None,
        prompt_tokens: int = 0,
        cache_id: str = "",
    ) -> list[WorkerInfo]:
        """Prefill workers for `model`, best first (see the module docstring). `cache_id`: the
        decode worker's; a prefill worker that publishes another holds KV it cannot take (e.g.
        another --kv-cache-dtype), and its pull would fail and count against a healthy worker.
        A prefill worker whose KV cache holds fewer than `prompt_tokens` tokens (when known) is
        no candidate either: it would refuse the prefill (kv_source_refused)."""
        hits = cached or {}
        pool = [
            w
            for w in workers
            if w.model == model
            and w.role == "prefill"
            and w.kv_addr
            and not w.draining
            and w.worker_id not in exclude
            and (not cache_id or not w.cache_id or w.cache_id == cache_id)
            # (the export computes all but the last token and samples one: the whole prompt)
            and w.capacity_tokens >= prompt_tokens
        ]

        def cost(w: WorkerInfo) -> int:
            new = max(0, prompt_tokens - hits.get(w.worker_id, 0))
            return w.prefill_tokens + self.inflight_prefill.get(w.worker_id, 0) + new

        pool.sort(key=lambda w: (cost(w), w.worker_id))
        if pool:
            best = [w for w in pool if cost(w) <= cost(pool[0]) + LOAD_TIE_TOKENS]
            if max(hits.get(w.worker_id, 0) for w in best) > 0:
                best.sort(key=lambda w: -hits.get(w.worker_id, 0))
            else:
                k = next(self._prefill_turn) % len(best)
                best = best[k:] + best[:k]
            pool = best + [w for w in pool if w not in best]
        return pool

    def sent_prefill(self, worker_id: str, tokens: int) -> None:
        _count(self.inflight_prefill, worker_id, tokens)

    def done_prefill(self, worker_id: str, tokens: int) -> None:
        _count(self.inflight_prefill, worker_id, -tokens)

    def sent(self, worker_id: str, tokens: int) -> None:
        _count(self.inflight_tokens, worker_id, tokens)

    def done(self, worker_id: str, tokens: int) -> None:
        _count(self.inflight_tokens, worker_id, -tokens)


def _count(counts: dict[str, int], worker_id: str, tokens: int) -> None:
    """Add to a worker's in-flight count; a count that reaches zero is dropped."""
    left = counts.get(worker_id, 0) + tokens
    if left > 0:
        counts[worker_id] = left
    else:
        counts.pop(worker_id, None)
