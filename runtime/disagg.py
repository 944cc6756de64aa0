"""Prefill/decode disaggregation on a worker: serving KV pulls and pulling before decoding.

    gateway ──generate(kv_source=P)──▶ decode worker D ──PULL──▶ prefill worker P
                                       reserve blocks            prefill the prompt (held)
                                       ◀─────────── DATA frames as chunks complete
                                       ACK ────────────────────▶ free the held blocks
                                       decode the last prompt token → first output token, ...

D answers the gateway at once and keeps the stream alive (keepalives) while it waits for KV room
and pulls, so that the gateway's idle timeout tells a hung D from a slow pull; a refusal (no KV
room, a failed transfer) is then the stream's one event (runtime/worker.py `_pull`).

The prefill side computes the prompt minus its last token; the decode side computes that last
token as its first step (the same as a prefix-cache hit), so the sampler's state, seeds included,
lives on one worker only and the answer is the same as colocated serving. The wire protocol and
its checks are in kvstore/kv_transfer.py.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator

from opentelemetry.context import Context

from kvstore.kv_transfer import (
    DeviceKVPages,
    ExportProgress,
    KVPages,
    KVTransferError,
    KVTransferServer,
    PullRequest,
    PullResult,
    ServedFn,
    pull_kv,
)
from runtime.async_engine import AsyncLLM, RequestStream
from runtime.engine import RequestGroup
from runtime.ranks import RankedKVPages
from runtime.sampling_params import InvalidRequestError, SamplingParams
from runtime.scheduler import QueueFullError
from runtime.telemetry import WorkerTelemetry

log = logging.getLogger("edgeinfer.disagg")

EXPORT_PREFIX = "kvx-"  # engine request ids of KV exports (never clash with served requests)


class KVCacheFullError(RuntimeError):
    """The decode worker has no room for the prompt's KV: refused before any byte moved."""


IMPORT_WAIT_S = 10.0  # how long an import waits for KV room before it is refused
_ROOM_POLL_S = 0.01  # how often a waiting import tries again (requests end between steps)


def kv_pages(llm: AsyncLLM) -> KVPages:
    """The engine's KV cache as KV transfer sees it: whole, however many ranks hold it."""
    runner = llm.engine.runner
    if runner.ranks is not None:
        return RankedKVPages(runner, runner.ranks)
    if runner.kv.device.type != "cpu":
        return DeviceKVPages(runner.kv, llm.engine.config.block_size)
    return KVPages(runner.kv, llm.engine.config.block_size)


def export_server(
    llm: AsyncLLM, secret: str, hold_s: float, on_served: ServedFn | None = None
) -> KVTransferServer:
    """The prefill side: a KV transfer server whose pulls run as KV exports on this engine."""

    async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
        # greedy and one token: the sample is thrown away; only the held KV blocks matter
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            stream = llm.submit(pull.token_ids, params, EXPORT_PREFIX + pull.request_id,
                                hold_kv=True)  # fmt: skip
        except (QueueFullError, InvalidRequestError) as e:  # a refusal: this worker is sound
            raise KVTransferError(f"the prefill worker cannot take the prefill: {e}", False) from e
        try:
            async for out in stream:
                if out.finished and out.outputs[0].finish_reason == "abort":
                    # the KV cache had no room left for the rest of the prompt: the blocks
                    # reported so far stay held until the transfer's release
                    raise KVTransferError(
                        "the prefill worker gave the prefill up (KV cache full)", False
                    )
                yield ExportProgress(
                    computed_tokens=out.num_computed_tokens,
                    block_ids=out.block_ids or [],
                    done=out.finished,
                    cached_tokens=out.num_cached_tokens,
                    arrival_time=out.arrival_time,
                    scheduled_time=out.scheduled_time,
                )
        except (QueueFullError, InvalidRequestError) as e:  # refused on the engine thread (its
            # queue filled up since submit checked): a refusal still, not a failure
            raise KVTransferError(f"the prefill worker cannot take the prefill: {e}", False) from e
        finally:
            stream.close()  # aborts (frees) an unfinished prefill

    async def release(request_id: str) -> None:
        rid = EXPORT_PREFIX + request_id
        await llm.call(lambda engine: engine.release_kv(rid))

    engine = llm.engine
    return KVTransferServer(
        kv_pages(llm), engine.cache_id, secret, export, release, hold_s, on_served=on_served,
        stalled=llm.is_stalled,
        max_tokens=min(engine.max_model_len, engine.scheduler.capacity_tokens),
    )


class KVImporter:
    """The decode side: reserve blocks, pull the prompt's KV into them, queue the decode."""

    def __init__(
        self, llm: AsyncLLM, secret: str, telemetry: WorkerTelemetry | None = None,
        wait_s: float = IMPORT_WAIT_S,
    ) -> None:  # fmt: skip
        self.llm = llm
        self.secret = secret
        self.telemetry = telemetry
        self.wait_s = wait_s
        self.pages = kv_pages(llm)
        self.imports = 0  # transfers completed, since start
        self.bytes = 0  # KV bytes received, since start
        self.active = 0  # imports under way: waiting for room, reserved, pulling
        self.waiting = 0  # imports waiting for KV room (in arrival order: see _reserve)
        self._turn = asyncio.Lock()  # FIFO: the import whose turn it is to reserve

    async def submit(
        self, group: RequestGroup, source: str, trace_ctx: Context | None = None
    ) -> tuple[RequestStream, PullResult | None]:
        """Pull the prompt's KV of `group` (validated by `prepare_request`) from the prefill
        worker at `source` ("host:port"), then queue it; the pull's span is a child of
        `trace_ctx`. While the KV cache has no room for the prompt, the import waits for
        requests to end and free blocks (in arrival order, as a colocated request waits in the
        scheduler's queue; nothing is asked of the prefill worker meanwhile), at most `wait_s`.
        Raises KVCacheFullError before any byte moves when the blocks do not fit by then (or
        never can), QueueFullError when as many imports wait as the scheduler's queue holds,
        KVTransferError when the transfer fails; the reserved blocks are freed on every
        failure, a cancellation (the client left) included."""
        self.active += 1
        try:
            return await self._submit(group, source, trace_ctx)
        finally:
            self.active -= 1

    async def _submit(
        self, group: RequestGroup, source: str, trace_ctx: Context | None
    ) -> tuple[RequestStream, PullResult | None]:
        cached, dst = await self._reserve(group)
        try:
            result = None
            if dst:  # else every block is in this worker's prefix cache already
                result = await self._pull(group, source, cached, dst, trace_ctx)
            # (pull_kv checked the peer's count: within the tokens pulled, the prompt but its last)
            reused = max(cached, result.cached_tokens if result else 0)
            if not 0 <= reused < len(group.prompt_token_ids):
                raise KVTransferError(
                    f"{reused} cached tokens reported for a prompt of "
                    f"{len(group.prompt_token_ids)} tokens (at most all but its last)"
                )
            return self.llm.submit_import(group, reused), result
        except BaseException:  # pull_kv ends, cancelled or not, only once nothing writes to dst
            self.llm.call(lambda engine: engine.cancel_import(group))  # runs though not awaited
            raise

    async def _reserve(self, group: RequestGroup) -> tuple[int, list[int]]:
        """The prompt's blocks reserved (engine.reserve_import), waiting for room as `submit`
        says: imports take turns in arrival order, so a large prompt is not passed over by
        smaller ones that fit first."""
        engine = self.llm.engine
        need = -(-(len(group.prompt_token_ids) - 1) // engine.config.block_size)
        if need > engine.blocks.num_blocks:
            raise KVCacheFullError(
                f"the prompt's {len(group.prompt_token_ids)} tokens need {need} KV blocks; this "
                f"worker's cache has {engine.blocks.num_blocks}"
            )
        if self.waiting >= engine.scheduler.max_waiting:
            raise QueueFullError(
                f"{self.waiting} imports already wait for KV room (the waiting queue holds "
                f"{engine.scheduler.max_waiting})"
            )
        self.waiting += 1
        deadline = time.monotonic() + self.wait_s  # from its arrival, not from its turn
        try:
            try:  # imports take turns in arrival order
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._turn.acquire()
            except TimeoutError:
                raise self._full(group, "earlier imports still wait") from None
            try:
                while True:
                    reserved = await self._try_reserve(group)
                    if reserved is not None:
                        return reserved
                    if time.monotonic() >= deadline:
                        raise self._full(group, f"{self.llm.stats()['free_kv_blocks']} free blocks")
                    await asyncio.sleep(_ROOM_POLL_S)
            finally:
                self._turn.release()
        finally:
            self.waiting -= 1

    def _full(self, group: RequestGroup, why: str) -> KVCacheFullError:
        return KVCacheFullError(
            f"no KV room for the prompt's {len(group.prompt_token_ids)} tokens on this worker "
            f"within {self.wait_s:g} s ({why})"
        )

    async def _try_reserve(self, group: RequestGroup) -> tuple[int, list[int]] | None:
        """One reserve_import on the engine thread. A cancellation (the client left) while it
        is queued there does not stop it, so an undo is queued behind it: calls run in the
        order they were posted."""
        call = self.llm.call(lambda e: e.reserve_import(group))
        try:
            return await call
        except asyncio.CancelledError:
            self.llm.call(lambda e: e.cancel_import(group))
            raise

    async def _pull(
        self, group: RequestGroup, source: str, cached: int, dst: list[int],
        trace_ctx: Context | None,
    ) -> PullResult:  # fmt: skip
        tel = self.telemetry
        span, traceparent = tel.pull_span(trace_ctx or Context(), source) if tel else (None, None)
        t0 = time.monotonic()
        error: str | None = "cancelled"
        result: PullResult | None = None
        try:
            pull = PullRequest(
                # one id per pull: a retry of the request (the gateway's, through another
                # decode worker) may reach a prefill worker still holding this pull's export
                request_id=f"{group.request_id}.{secrets.token_hex(4)}",
                token_ids=group.prompt_token_ids[:-1],
                first_block=cached // self.llm.engine.config.block_size,
                cache_id=self.llm.engine.cache_id,
                secret=self.secret,
                traceparent=traceparent,
            )
            result = await pull_kv(source, pull, self.pages, dst)
            error = None
        except Exception as e:
            error = str(e)
            raise
        finally:
            nbytes = result.bytes if result else 0
            blocks = result.blocks if result else 0
            if tel is not None and span is not None:
                tel.pull_done(span, time.monotonic() - t0, nbytes, blocks, error)
        self.imports += 1
        self.bytes += result.bytes
        return result
