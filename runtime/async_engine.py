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

    def submit(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Validate and queue a request now; read its outputs from the returned stream.

        Raises InvalidRequestError (a ValueError) on bad input, QueueFullError when the waiting
        queue is at its bound, EngineDeadError after shutdown: all before anything is queued, so
        a server can answer with a status code before it starts streaming.
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._wake:
            if self._stopped:
                raise EngineDeadError("the engine is shut down")
            rid = request_id or self.engine.next_request_id()
            prompt_ids = self.engine.add_request(rid, prompt, params)
            self._streams[rid] = stream
            self._wake.notify()
        return RequestStream(self, rid, prompt_ids, stream.queue)

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

    @property
    def num_open_streams(self) -> int:
        """Requests submitted and not yet finished or aborted."""
        return len(self._streams)

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
        """Abort the request unless it already finished; its KV blocks are free on return."""
        if not self.finished:
            self.finished = True
            self._llm.abort(self.request_id)
