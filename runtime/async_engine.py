"""The asyncio front of the engine: stream tokens per request, abort at any time.

One background thread runs the synchronous step loop (torch releases the GIL inside its
operators, so the event loop stays responsive). Callers on any event loop submit requests and
read outputs from a per-request asyncio queue fed with `call_soon_threadsafe`. A lock serializes
the engine between the loop thread and callers: an abort takes effect between two steps, and the
request's KV blocks are free when `abort` returns.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from runtime.engine import LLMEngine, Prompt
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down, or a step failed); the request did not complete."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs, one per step that changed it, until finished.

        Raises InvalidRequestError (a ValueError) before yielding anything on bad input, and
        QueueFullError when the engine's waiting queue is at its bound. Closing the iterator
        early (a client that went away) aborts the request.
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._wake:
            if self._stopped:
                raise EngineDeadError("the engine is shut down")
            rid = request_id or self.engine.next_request_id()
            self.engine.add_request(rid, prompt, params)
            self._streams[rid] = stream
            self._wake.notify()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> bool:
        """Stop a request; returns whether it was still running. Its blocks are freed on return."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            out = self.engine.abort(request_id)
        if stream is not None and out is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        return out is not None

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self.engine.stats()

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)
        self._fail_all(EngineDeadError("the engine shut down"))

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self.engine.has_unfinished():
                    self._wake.wait()
                if self._stopped:
                    return
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a bug in a step: fail its requests, keep serving
                    log.exception("engine step failed")
                    self._abort_all_locked(e)
                    continue
                deliveries = []
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if out.finished:
                        del self._streams[out.request_id]
                    deliveries.append((stream, out))
            for stream, out in deliveries:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _abort_all_locked(self, error: Exception) -> None:
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            self.engine.abort(rid)
            err = (
                error
                if isinstance(error, EngineDeadError)
                else EngineDeadError(f"engine step failed: {error!r}")
            )
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, err)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            self._abort_all_locked(error)
