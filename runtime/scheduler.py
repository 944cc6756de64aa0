"""The scheduler: which requests run this step, and how many tokens each computes.

There are no prefill and decode modes. Each request has `num_tokens` (prompt + output so far) and
`num_computed_tokens` (those whose keys and values are in the cache); a step gives a request some
of the difference. A new prompt is many tokens, a chunked prefill is a smaller allotment, a
decode is one token, and a request preempted by recomputation simply has `num_computed_tokens`
reset to 0.

Policy, per step, under a token budget (`max_num_batched_tokens`):
1. Running requests, oldest first. Every running decode is reserved one token of the budget
   before any prefill chunk is sized, so prefills never starve decodes. When the KV cache has no
   room for a request's tokens, the newest running request is preempted (its blocks freed, put back
   at the head of the queue) until there is room. A KV export is aborted instead (`dropped`):
   its puller may be reading the blocks it reported, so they stay held until `release`.
2. Then waiting requests in arrival order (FCFS: the head blocks those behind it), while there is
   budget, a free seat (`max_num_seqs`) and KV-cache room, and no request was preempted this step.
   A request admitted with no blocks (new, or preempted) first takes the cached blocks of its
   longest cached prefix (prefix caching; not one whose prompt logprobs are still to compute):
   its `num_computed_tokens` starts there. Its first
   admission alone sets `num_cached_tokens` (usage) and counts in the prefix-cache hit rate
   (once per user request: the first of its n sequences, and not a KV import). The other
   sequences of an n > 1 request wait while the first computes their shared prompt, then find
   its full blocks cached (admitted beside it, each computed the whole prompt again).
After a step, every block that the computed tokens filled is hashed into the prefix cache.

Speculative decoding (runtime/speculative.py) fits the same view: a decode with k draft tokens
(`Request.spec_token_ids`) is 1 + k tokens to compute; drafts that do not fit the budget or the
KV cache are dropped, never the decode. The update appends what verification kept and moves
`num_computed_tokens` back to before the rejected drafts, freeing blocks only they used.

Pipeline parallelism keeps one step in flight per stage, each of a different batch: with
`lanes` > 1 every running request belongs to one lane, and `schedule(lane)` plans that lane's
step alone: its running requests, preempting only among them (the other lanes' requests may be
in flight, their blocks being written), and admitting waiting requests into it up to its fair
share (the running and waiting requests over the lanes) and `max_num_seqs` (per step, so per
lane, as in vLLM). A request aborted while its step is in flight frees its blocks at once: every
rank runs steps in launch order, so the blocks' next user writes them after that step is done.

Disaggregated serving needs nothing new here: a KV export (`Request.hold_kv`, the prefill side)
is an ordinary request whose blocks are held, not freed, when it finishes, until `release`; a KV
import (the decode side) is admitted already holding its blocks with `num_computed_tokens` set
to what the transfer filled, so it starts as a decode.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from runtime.kv_cache import BlockManager
from runtime.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified this step (the
    # last num_new_tokens - 1 of them; a decode with drafts computes 1 + len(drafts) tokens)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's tokens, so a token is sampled."""
        r = self.request
        return (
            r.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == r.num_tokens
        )

    def token_ids(self) -> list[int]:
        """The tokens this step computes: the request's, then the drafts."""
        r, start = self.request, self.request.num_computed_tokens
        if self.spec_token_ids:
            return [r.token_at(start), *self.spec_token_ids]
        return r.token_slice(start, start + self.num_new_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # in priority order
    preempted: list[str] = field(default_factory=list)  # request ids preempted this step
    # KV exports that needed room this step: aborted, not recomputed (a transfer may be sending
    # the blocks they reported), their blocks held until `release`
    dropped: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0  # sum of num_new_tokens

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class StepResult:
    """What the update did to one request."""

    request: Request
    new_tokens: list[int]  # tokens appended this step (more than one: accepted drafts)
    finished: RequestStatus | None  # set when the request finished this step


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 429)."""


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_waiting: int,
        lanes: int = 1,
    ):
        self.blocks = block_manager
        self.lanes = lanes
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # since start, for stats
        self.held: set[str] = set()  # finished KV exports whose blocks wait for `release`

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    def add(self, request: Request, check_room: bool = True) -> None:
        """Queue `request`; QueueFullError when max_waiting wait already, unless `check_room` is
        off (a KV import, admitted when its blocks were reserved)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if check_room and len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, lane: int = 0) -> SchedulerOutput:
        """The next step of lane `lane` (the only one unless `lanes` > 1)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running = [r for r in self.running if r.lane == lane]  # oldest first
        pending_decodes = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            drafts: list[int] = []
            if remaining == 1:
                pending_decodes -= 1
                # drafts ride along while the budget (decodes behind keep their token) and the
                # KV cache have room for them
                drafts = req.spec_token_ids[: max(0, budget - pending_decodes - 1)]
                if drafts:  # and the blocks: its own, and a token's for each decode behind
                    # (drafts that took the last free block preempted a later plain decode)
                    behind = sum(
                        self.blocks.blocks_needed(r.request_id, r.num_computed_tokens + 1)
                        for r in running[i + 1 :]
                        if r.num_tokens - r.num_computed_tokens == 1
                    )
                    need = self.blocks.blocks_needed(
                        req.request_id, req.num_computed_tokens + 1 + len(drafts)
                    )
                    if need + behind > self.blocks.num_free_blocks:
                        drafts = []
                n = 1 + len(drafts)
            else:
                n = min(remaining, budget - pending_decodes)
                if n <= 0:
                    i += 1
                    continue
            waits = False
            while not self.blocks.can_allocate(req.request_id, req.num_computed_tokens + n):
                if running[-1] is req and self.held:
                    # only finished KV exports hold the rest, until their transfers end:
                    # preempting req would recompute it, over and over, until then
                    waits = True
                    break
                victim = running.pop()
                if victim.hold_kv:
                    self.finish(victim.request_id, RequestStatus.FINISHED_ABORTED)
                    out.dropped.append(victim)
                else:
                    self._preempt(victim)
                    out.preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req itself was preempted (or dropped): everything after it was too
            if waits:
                break  # (req is the last left)
            self.blocks.allocate(req.request_id, req.num_computed_tokens + n)
            out.scheduled.append(ScheduledRequest(req, n, drafts))
            budget -= n
            i += 1
        seats = self.max_num_seqs
        if self.lanes > 1:  # a fair share of what runs and waits, so every lane has a batch
            share = -(-(len(self.running) + len(self.waiting)) // self.lanes)
            seats = min(seats, share)
        while self.waiting and budget > 0 and not (out.preempted or out.dropped):
            if len(running) >= seats:
                break
            req = self.waiting[0]
            first = req.first
            if (first is not None and first.status is RequestStatus.RUNNING
                    and first.num_computed_tokens < len(first.prompt_token_ids)):  # fmt: skip
                break  # its prompt is being computed: found in the cache once it is
            held = self.blocks.holds(req.request_id)  # a KV import's blocks (maybe none)
            if not held:
                # new, or preempted: start from the longest cached prefix of its tokens; not a
                # prompt whose logprobs are still to compute (cached blocks hold no logits: as
                # vLLM's, such a request skips the prefix cache until its prompt rows are done)
                req.num_computed_tokens = 0 if req.prompt_rows_left else self.blocks.match_prefix(
                    req.request_id, req.all_token_ids, count=False
                )
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.blocks.allocate(req.request_id, req.num_computed_tokens + n) is None:
                if not held:  # the cached blocks stay cached, and a tail it took is kept again
                    self.blocks.free(req.request_id, req.all_token_ids[: req.num_computed_tokens])
                    req.num_computed_tokens = 0
                if not self.running and self._unblock(budget):
                    continue  # nothing runs that would free blocks: room made, or another first
                break
            if req.num_cached_tokens < 0:  # first admission: what usage reports, and what
                # the hit rate counts, once (a request waiting for room is matched again at
                # every step; a preempted one again when readmitted, often finding its own
                # blocks: neither is a new query, as in vLLM, whose hit rate leaves them out)
                req.num_cached_tokens = req.num_computed_tokens
                if req.counts_lookup:  # (once per request: `Request.counts_lookup`)
                    self.blocks.count_query(len(req.all_token_ids), req.num_computed_tokens)
            if not req.scheduled_at:
                req.scheduled_at = time.monotonic()
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.lane = lane
            self.running.append(req)
            running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _unblock(self, budget: int) -> bool:
        """Nothing runs, and the head of the queue cannot get blocks: waiting requests hold them
        (KV imports, admitted with their prompt's blocks), and no step would ever free one. Put
        first a waiting holder that can take its next tokens now; if none can, preempt the
        newest holder (its blocks freed, its prompt recomputed when its turn comes). Returns
        whether anything changed (False: no waiting request holds a block)."""
        holders = [r for r in self.waiting if self.blocks.holds(r.request_id)]
        for r in holders:
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            if self.blocks.can_allocate(r.request_id, r.num_computed_tokens + n):
                self.waiting.remove(r)
                self.waiting.appendleft(r)
                return True
        if not holders:
            return False
        victim = holders[-1]
        self.blocks.free(victim.request_id, victim.all_token_ids[: victim.num_computed_tokens])
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req.request_id, req.all_token_ids[: req.num_computed_tokens])
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[StepResult]:
        """Advance each scheduled request; append sampled tokens (with speculation, the drafts
        verification kept and one more); finish what stopped; roll back rejected drafts."""
        results = []
        for s in out.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            tokens = sampled.get(req.request_id)
            computed = s.num_new_tokens - len(s.spec_token_ids)  # the request's own tokens
            new: list[int] = []
            status = None
            for t in tokens or ():
                req.output_token_ids.append(t)
                new.append(t)
                status = req.check_stop()
                if status is not None:
                    break  # a stop mid-draft: the rest is dropped
            if new:  # the drafts kept have their KV: all appended but the last, unless a stop
                computed += min(len(new), len(tokens or ()) - 1)  # cut the draft short
            req.num_computed_tokens += computed
            if req.num_computed_tokens // self.blocks.block_size > self.blocks.num_hashed(
                req.request_id
            ):
                self.blocks.commit(req.request_id, req.all_token_ids[: req.num_computed_tokens])
            if s.spec_token_ids and status is None:
                self.blocks.trim(req.request_id, req.num_tokens)  # rejected drafts' blocks
            if not new:
                continue  # a prefill chunk that did not reach the end
            if status is not None:
                self.finish(req.request_id, status)
            results.append(StepResult(req, new, status))
        return results

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request wherever it is; its blocks are freed at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.hold_kv and self.blocks.block_table(request_id):  # the blocks stay until
            # `release`, an aborted export's too: a transfer may still be sending the blocks it
            # reported (one aborted before it held any holds nothing: listed as held, it made
            # the last running request wait for a release, not preempt, until its deadline)
            self.held.add(request_id)
        else:  # its partial last block is kept for a next turn that continues it
            self.blocks.free(request_id, req.all_token_ids[: req.num_computed_tokens])
        req.status = status
        return req

    def release(self, request_id: str) -> int:
        """Free the blocks of a finished KV export; returns how many it held (0 if none)."""
        if request_id not in self.held:
            return 0
        self.held.discard(request_id)
        return self.blocks.free(request_id)
