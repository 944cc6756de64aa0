"""The asyncio front of the engine: stream tokens per request, abort at any time.

One background thread owns the engine and runs the synchronous step loop; the event loop never
waits for a step. Callers validate and tokenize a request on their own thread
(`LLMEngine.prepare_request`, so bad input fails at once with a status code) and post it to an
inbox; the engine thread moves the inbox into the scheduler between two steps, runs the step
with no lock held (torch releases the GIL inside its operators), and hands each request's
outputs to its asyncio queue with `call_soon_threadsafe`. An abort is posted the same way: the
request's KV blocks are free before the next step starts.

    caller (event loop)                engine thread
    submit: prepare_request  ──inbox──▶  enqueue ─▶ step ─▶ outputs ──call_soon_threadsafe──▶ queue
    abort                    ──inbox──▶  abort (blocks freed)
    call(fn)                 ──inbox──▶  fn(engine) between two steps ──▶ future

`call` is how the disaggregation code reserves, releases and commits KV blocks (which only the
engine thread may touch); `submit_import` queues a request whose prompt KV a transfer filled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from runtime.engine import LLMEngine, Prompt, RequestGroup
from runtime.outputs import RequestOutput
from runtime.sampling_params import InvalidRequestError, SamplingParams
from runtime.scheduler import QueueFullError
from runtime.structured_decoding import RequestGrammar

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down, or a step failed); the request did not complete."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


@dataclass(slots=True)
class _Add:
    group: RequestGroup  # validated and tokenized by the caller


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Import:
    group: RequestGroup  # its blocks reserved by reserve_import and filled by a transfer
    cached_tokens: int  # prompt tokens no worker computed for it (usage)


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]  # runs on the engine thread between two steps
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


T = TypeVar("T")

IDLE_WAIT_S = 0.005  # the engine thread's wait after a step that could run nothing
# A step (or call) on the engine thread that has finished no model layer for this long is taken
# for hung (a device call or a collective that never returns): the worker stops its streams'
# keepalives and its heartbeat, so that gateways time it out, retry elsewhere and stop routing
# to it. A layer takes milliseconds to about a second (a large prefill chunk on a CPU); a first
# prefill on a GPU may compile Triton kernels inside one for several seconds.
ENGINE_STALL_S = 60.0


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._cv = threading.Condition()  # guards the fields below, never held during a step
        self._inbox: list[_Add | _Abort | _Import | _Call] = []
        # what the engine thread took from the inbox this round (a call in it that the loop's
        # death cut short is failed with the rest: its caller would wait for ever)
        self._batch: list[_Add | _Abort | _Import | _Call] = []
        # sequences of the requests in the inbox (not in the waiting queue yet): submit counts
        # them against the queue's bound, which would otherwise let any number through during
        # one step, each failing later on a stream its caller already holds
        self._inbox_seqs = 0
        self._streams: dict[str, _Stream] = {}
        self._stats = engine.stats()  # refreshed by the engine thread after each change
        self._stopped = False
        self._cache_listener: Callable[[list[bytes], list[bytes]], None] | None = None
        self._busy_since: float | None = None  # when the engine thread's current pass began
        self._layers_at_start = 0  # the model's layer count then
        self._layers_seen, self._layers_at = -1, 0.0  # the count a caller saw move, and when
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        hold_kv: bool = False,
        grammar: RequestGrammar | None = None,
    ) -> RequestStream:
        """Validate and queue a request now; read its outputs from the returned stream.

        Raises InvalidRequestError (a ValueError) on bad input, QueueFullError when the waiting
        queue is at its bound, EngineDeadError after shutdown: all before anything is queued, so
        a server can answer with a status code before it starts streaming. Never waits for a step.
        `grammar`: params' grammar, compiled already (LLMEngine.prepare_request).
        """
        rid = request_id
        while not rid or (rid in self._streams and not request_id):
            rid = self.engine.next_request_id()  # (skipping a caller's, maybe not queued yet)
        group = self.engine.prepare_request(rid, prompt, params, hold_kv=hold_kv,
                                            grammar=grammar)
        return self._post(group, _Add(group))

    def submit_import(self, group: RequestGroup, cached_tokens: int) -> RequestStream:
        """Queue a request whose prompt KV (but its last token's) a transfer put into the blocks
        `LLMEngine.reserve_import` reserved for it; read its outputs from the returned stream."""
        return self._post(group, _Import(group, cached_tokens))

    def _post(self, group: RequestGroup, cmd: _Add | _Import) -> RequestStream:
        rid = group.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._cv:
            if self._stopped:
                raise EngineDeadError("the engine is shut down")
            if rid in self._streams:
                raise InvalidRequestError("request_id", f"{rid!r} is already in use")
            if isinstance(cmd, _Add):
                seqs = self._inbox_seqs + len(group.seqs)
                if not self.engine.has_room(seqs):
                    raise QueueFullError(
                        f"the waiting queue is full ({self.engine.scheduler.max_waiting})"
                    )
                self._inbox_seqs = seqs
            self._streams[rid] = stream
            self._inbox.append(cmd)
            self._cv.notify()
        return RequestStream(self, rid, group.prompt_token_ids, stream.queue)

    def call(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future[T]:
        """Run `fn(engine)` on the engine thread between two steps; await the returned future
        for its result or exception (or drop it: the call runs either way, in posting order)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._cv:
            if self._stopped:
                raise EngineDeadError("the engine is shut down")
            self._inbox.append(_Call(fn, loop, future))
            self._cv.notify()
        return future

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs, one per step that changed it, until finished.

        Closing the iterator early (a client that went away) aborts the request.
        """
        stream = self.submit(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> bool:
        """Stop a request; returns whether it was still open. Its KV blocks are freed before the
        engine's next step; its stream ends with the aborted output."""
        return self._abort(request_id, None)

    def _abort(
        self, request_id: str, queue: asyncio.Queue[RequestOutput | BaseException] | None
    ) -> bool:
        """`abort`, or with `queue` only while the open request of that id is the one whose
        outputs go to `queue` (a stream closed after its request ended, unread, must not abort
        a later request given the same id)."""
        with self._cv:
            stream = self._streams.get(request_id)
            if stream is None or (queue is not None and stream.queue is not queue):
                return False
            self._inbox.append(_Abort(request_id))
            self._cv.notify()
        return True

    def set_cache_listener(self, listener: Callable[[list[bytes], list[bytes]], None]) -> None:
        """Call `listener(stored, evicted)` (block hashes) from the engine thread after each step
        that changed the prefix cache. It must be quick and thread-safe: it runs between steps."""
        with self._cv:
            self.engine.blocks.record_events = True
            self._cache_listener = listener

    def stalled_s(self) -> float:
        """Seconds the engine thread has spent in its current pass (a step, the calls before
        it) without the model finishing a layer; 0 while it waits for work. Grows without bound
        when a step never returns."""
        since = self._busy_since
        if since is None:
            return 0.0
        now = time.monotonic()
        layers = self._layers_run()
        if layers == self._layers_at_start:  # none this pass
            return now - since
        if layers != self._layers_seen:  # when it last moved, as the callers sample it
            self._layers_seen, self._layers_at = layers, now
        return now - max(since, self._layers_at)

    def _layers_run(self) -> int:
        """Layers run by the engine's models: the target's and a draft model's (which drafts
        before the target's layers, a new request's whole prompt at once)."""
        n = int(getattr(self.engine.runner.model, "layers_run", 0))
        spec = self.engine.spec
        draft = getattr(spec.proposer, "model", None) if spec is not None else None
        return n + int(getattr(draft, "layers_run", 0))

    def is_stalled(self) -> bool:
        return self.stalled_s() > ENGINE_STALL_S

    def stats(self) -> dict[str, int]:
        """Load figures as of the last step (no waiting for a running step)."""
        with self._cv:
            return dict(self._stats)

    @property
    def num_open_streams(self) -> int:
        """Requests submitted and not yet finished or aborted."""
        return len(self._streams)

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=30)
        self._fail_all("the engine shut down")

    def _fail_all(self, reason: str) -> None:
        """End every open stream and pending call with EngineDeadError(reason); `_stopped`
        must be set (nothing new is accepted)."""
        with self._cv:
            streams, self._streams = self._streams, {}
            calls = [c for c in (*self._batch, *self._inbox) if isinstance(c, _Call)]
            self._inbox, self._batch, self._inbox_seqs = [], [], 0
        for call in calls:  # never ran, or ran into the loop's death: the engine is gone
            # (one already answered is done by the time this runs: _fail leaves it)
            _post(call.loop, _fail, call.future, reason)
        for stream in streams.values():
            _post(stream.loop, stream.queue.put_nowait, EngineDeadError(reason))

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug outside a step: nothing would ever answer again
            log.exception("the engine loop died")
            with self._cv:
                self._stopped = True  # submit and call raise EngineDeadError from now on
            self._fail_all(f"the engine loop died: {e!r}")

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._stopped and not self._inbox and not engine.has_unfinished():
                    self._cv.wait()
                if self._stopped:
                    return
                inbox, self._inbox = self._inbox, []
                self._batch = inbox
            self._layers_at_start = self._layers_run()  # (before _busy_since: see stalled_s)
            self._busy_since = time.monotonic()
            deliveries: list[tuple[str, RequestOutput | BaseException]] = []
            taken = 0  # sequences of the requests taken from the inbox
            for cmd in inbox:
                if isinstance(cmd, _Add | _Import):
                    try:
                        if isinstance(cmd, _Import):
                            engine.commit_import(cmd.group, cmd.cached_tokens)
                        else:
                            taken += len(cmd.group.seqs)
                            engine.enqueue(cmd.group)
                    except Exception as e:  # the queue filled up since submit checked
                        deliveries.append((cmd.group.request_id, e))
                elif isinstance(cmd, _Call):
                    _settle(cmd, engine)
                else:
                    try:
                        out = engine.abort(cmd.request_id)
                    except Exception as e:  # its blocks and id are freed whatever failed
                        log.exception("aborting %s failed", cmd.request_id)
                        out = None
                        deliveries.append((cmd.request_id, EngineDeadError(f"abort failed: {e!r}")))
                    if out is not None:
                        deliveries.append((cmd.request_id, out))
            if taken:  # in the waiting queue now (or refused): the queue's length counts them
                with self._cv:
                    self._inbox_seqs -= taken
            idle = False
            try:
                outputs = engine.step()
                idle = engine.last_step_idle
            except Exception as e:  # a bug in a step: fail its requests, keep serving
                log.exception("engine step failed")
                for rid in engine.unfinished_request_ids():
                    with contextlib.suppress(Exception):  # (abort frees whatever it raises)
                        engine.abort(rid)
                    deliveries.append((rid, EngineDeadError(f"engine step failed: {e!r}")))
                outputs = []
            deliveries += [(out.request_id, out) for out in outputs]
            if self._cache_listener is not None:
                stored, evicted = engine.blocks.drain_events()
                if stored or evicted:
                    try:
                        self._cache_listener(stored, evicted)
                    except Exception:  # the index is best effort: a lost event costs hits
                        log.exception("the prefix-cache listener failed")
            self._deliver(deliveries, engine.stats())
            self._busy_since = None
            if idle and not deliveries:
                # requests wait that nothing can run yet (their blocks held by KV imports still
                # pulling, say): wait for a call or a new request rather than spin a core
                with self._cv:
                    if not self._inbox and not self._stopped:
                        self._cv.wait(IDLE_WAIT_S)

    def _deliver(
        self, deliveries: list[tuple[str, RequestOutput | BaseException]], stats: dict[str, int]
    ) -> None:
        with self._cv:
            self._stats = stats
            routed = []
            for rid, item in deliveries:
                stream = self._streams.get(rid)
                if stream is None:
                    continue
                if isinstance(item, BaseException) or item.finished:
                    del self._streams[rid]
                routed.append((stream, item))
        for stream, item in routed:
            delivered = _post(stream.loop, stream.queue.put_nowait, item)
            if not delivered and not (isinstance(item, BaseException) or item.finished):
                self._abort(item.request_id, stream.queue)  # its reader is gone: free its blocks


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
    """Run fn(*args) on `loop`, from the engine thread; False when that loop has closed (its
    caller is gone: a client's request handler, a test's asyncio.run). The engine thread must
    not die of it: every later call and request would wait on it for ever."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed"
        return False
    return True


def _fail(future: asyncio.Future[Any], reason: str) -> None:
    if not future.done():
        future.set_exception(EngineDeadError(reason))


def _settle(cmd: _Call, engine: LLMEngine) -> None:
    """Run a call on the engine thread and hand its outcome to the caller's loop."""
    try:
        result, error = cmd.fn(engine), None
    except Exception as e:
        result, error = None, e

    def done() -> None:
        if cmd.future.cancelled():
            return
        if error is not None:
            cmd.future.set_exception(error)
        else:
            cmd.future.set_result(result)

    _post(cmd.loop, done)


class RequestStream:
    """The outputs of one submitted request, as an async iterator; `close()` aborts it."""

    def __init__(
        self,
        llm: AsyncLLM,
        request_id: str,
        prompt_token_ids: list[int],
        queue: asyncio.Queue[RequestOutput | BaseException],
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids  # the prompt as tokenized
        self._llm = llm
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it already finished; its KV blocks are freed before the
        engine's next step."""
        if not self.finished:
            self.finished = True
            self._llm._abort(self.request_id, self._queue)
