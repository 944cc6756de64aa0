"""A completion request's life in the gateway, as named phases over one context object.

    validate -> resolve model -> prefix lookup -> route -> forward -> stream -> record

A session's first request is placed (claimed in Redis) as the last step of `route`, before it is
forwarded: gateways that place one new session at once all send it to the claim's winner.

Disaggregated (a prefill and a decode worker serve the model): `route` picks the decode worker
as usual and then a prefill worker, whose KV transfer address goes to the decode worker in
`kv_source`; the decode worker pulls the prompt's KV from it and streams the answer. A failed
transfer (502 `kv_transfer_failed`, before any byte reached the client) sets that prefill worker
aside and the request is tried again with another (or computed on the decode worker when none is
left); a prefill worker that refuses the pull (503 `kv_source_refused`: its KV cache full, say)
is passed over for this request only, not set aside. Such prefill-side failures do not use up
`max_attempts` (the decode worker did nothing wrong): at most MAX_PREFILL_TRIES prefill workers
are tried per request, and then (or at once when no prefill worker's KV cache can hold the
prompt) the decode worker computes the prompt itself, as a colocated worker would: prefill
workers that all refuse (a load spike) cost requests latency, not a 503. The decode worker
answers 200 at once and sends keepalives while it pulls, so the usual idle timeout fails a hung
decode worker (a slow pull keeps talking); a refusal of the pull comes as an error event with
the status it stands for (kvstore/protocol.py), and is taken as that answer (`_refused`), as if
it had come before the stream.

A completions batch (several prompts) is one request to the client and one `Call` per prompt to
the workers: each prompt is looked up, routed and forwarded on its own, all at once (a failure
of one calls the others off), and their answers are interleaved into one response.

`forward` may try several workers (`max_attempts`), but only while nothing has gone to the
client: a streamed request commits to its worker when the first token arrives (the prefill is
still retryable), a non-streamed one when its whole answer has arrived. After that, a worker
failure ends the stream with an error event. A client that goes away closes the connection to
the worker and sends it an abort, so the worker frees the request's KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import socket
import struct
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode

from gateway.cluster import ClusterView
from gateway.errors import (
    CLIENT_GONE_STATUS,
    APIError,
    at_capacity,
    bad_gateway,
    client_gone,
    clip,
    from_exception,
    invalid,
    model_not_found,
    too_large,
    unavailable,
    unsupported_encoding,
)
from gateway.openai_api import (
    SSE_DONE,
    RequestOptions,
    ResponseAssembler,
    error_from_event,
    sse,
)
from gateway.routing import Route
from gateway.structured import GUIDED_FIELDS
from gateway.telemetry import GatewayTelemetry
from gateway.tokenization import prompt_token_ids
from kvstore.block_hash import block_hashes, cache_seed
from kvstore.demand import ModelStatus
from kvstore.placement import Placement
from kvstore.protocol import SECRET_HEADER, GenerateRequest, WorkerInfo, decode_event
from runtime.serving import BodyEncodingError, inflate
from runtime.tokenizer import LONG_TEXT_CHARS

log = logging.getLogger("edgeinfer.gateway")

SESSION_HEADER = "x-session-affinity"
MAX_SESSION_ID = 256
HOLD_POLL_S = 0.05  # how often a request waiting for a starting worker looks for it
# How often a held request renews its entry in the wait set: a Redis restarted without its data
# (or failed over to a replica that had not received it) lost the entry, and with it the pool's
# only signal that the request waits; the request then waited out its whole hold for a worker
# nobody started. (The pool reads the wait sets every tick: no wake-up is needed.)
REHOLD_S = 5.0
REHOLD_TIMEOUT_S = 1.0  # the longest a renewal may take
WAKE_EVERY_S = 5.0  # how often a gateway serving a model from afar wakes a nearer pool for it
END_READ_S = 1.0  # how long a finished worker stream may take to end its body
HOLD_THROUGH_FAILURES = 2  # failed starts in a row after which a waiting request gets its 503
MAX_UNREACHED = 16  # workers that refused the connection a request passes over (see forward)
# what aiohttp raises for a worker URL it cannot request (a registry entry that is not a URL,
# one with a port out of range, or not http): the request never left, as when nothing listens
_BAD_URL = (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError)
# a decode worker's refusal codes that are the prefill worker's doing (kvstore/kv_transfer.py)
_PREFILL_SIDE = frozenset({"kv_transfer_failed", "kv_source_refused"})
# prefill workers a request's prompt is offered to before its decode worker computes it itself;
# their failures and refusals do not count against max_attempts
MAX_PREFILL_TRIES = 2
_GRAMMAR_FIELDS = GUIDED_FIELDS | {"tools", "response_format"}  # fields whose check compiles one
Parser = Callable[..., tuple[list[GenerateRequest], RequestOptions]]
Events = AsyncGenerator[list[dict[str, Any]], None]  # a worker's events, in batches
# the request's id, given by the app's outermost middleware: x-request-id, logs, spans
REQUEST_ID = web.RequestKey("request_id", str)


class WorkerFailed(Exception):
    """A worker could not finish its part: unreachable, busy or broken (`_refusal`), or cut off."""

    def __init__(self, worker: WorkerInfo, error: APIError, dead: bool) -> None:
        super().__init__(error.message)
        self.worker = worker
        self.error = error  # what the client gets if no other worker can take the request
        self.dead = dead  # the worker itself is unreachable or broken (set it aside), not busy


@dataclass(slots=True)
class Call:
    """Per-request context carried through the phases."""

    request_id: str  # the request's id (REQUEST_ID), sent to the worker (a batch's prompts:
    # with "-p" added, in `gen`) and returned as x-request-id
    session_id: str | None  # the x-session-affinity header
    started: float  # perf_counter() at arrival
    forwarded: float = 0.0  # perf_counter() when the first attempt went to a worker
    answered: float = 0.0  # perf_counter() when the request was committed to the serving
    # worker: its first token when streaming, its whole answer (`done`) otherwise
    first_token: float = 0.0  # perf_counter() when the serving worker's first delta came (TTFT)
    stream_tokens: dict[int, int] = field(default_factory=dict)  # choice index -> output tokens
    # the serving worker sent (TPOT's count); it and first_token start again with each attempt
    gen: GenerateRequest | None = None  # the validated request, as the worker gets it
    options: RequestOptions | None = None  # what the response needs
    model_known: bool = False  # the model is one a registry snapshot showed (a metric label)
    placement: Placement | None = None  # the session's placement before this request (a new
    # session's: as `place` claimed it, before forwarding)
    worker: WorkerInfo | None = None  # the worker that serves it
    route_reason: str = ""  # why that worker (session | local | remote)
    cost: int = 0  # estimated tokens, counted against the worker while in flight
    tried: set[str] = field(default_factory=set)  # workers that failed this request
    prompt_tokens: int = 0  # the prompt's length, when the gateway tokenized it
    # the prompt (text) and messages as the client sent them, once their token ids replaced
    # them in `gen` (prefix_lookup); None otherwise
    client_prompt: tuple[str | list[int] | None, list[dict[str, Any]] | None] | None = None
    cached: dict[str, int] = field(default_factory=dict)  # worker id -> prompt tokens it caches
    roles: tuple[str, ...] = ("mixed",)  # roles that may serve (decode side when disaggregated)
    disaggregated: bool = False  # prefill runs on a prefill worker, decode on `worker`
    prefill: WorkerInfo | None = None  # the prefill worker of the current attempt, if any
    tried_prefill: set[str] = field(default_factory=set)  # prefill workers that failed it
    # decode workers that refused the prompt's KV import (no room within their wait), and
    # those that then take it whole, once no other worker is left (forward)
    import_full: set[str] = field(default_factory=set)
    whole: set[str] = field(default_factory=set)
    held_s: float = 0.0  # seconds waited for a pool to start a worker (scale from zero)
    operation: str = ""  # gen_ai.operation.name: chat | text_completion
    span: Span | None = None  # the request's root span (a no-op one when nothing records)
    trace_ctx: Context | None = None  # the root span's context: parent of the phases' spans
    attempts: int = 0  # workers called so far (the forward spans' edgeinfer.attempt)
    route_started: float = 0.0  # perf_counter() when the current attempt's routing began
    assembler: ResponseAssembler | None = None  # the response, once the worker committed
    stream_error: APIError | None = None  # what ended a stream after its first byte, if anything
    # the gateway's drain ran out while this answer streamed (`Proxy._drain_over`): its worker
    # stream was closed under it, and its end is the drain's error event, not a worker failure
    cut: bool = False
    upstream: aiohttp.ClientResponse | None = None  # the worker's stream while it is read
    # the client took none of a write within client_write_timeout_s (`Proxy._write`): its
    # connection is reset once the worker streams are closed (`respond`)
    stalled: bool = False

    def part(self, gen: GenerateRequest) -> Call:
        """Another prompt of the same request (a completions batch), to be routed on its own:
        the request's id, session, options and spans, none of its routing."""
        return Call(self.request_id, self.session_id, self.started, gen=gen, options=self.options,
                    placement=self.placement, operation=self.operation, span=self.span,
                    trace_ctx=self.trace_ctx, route_started=self.route_started)  # fmt: skip


# the request's calls, one per prompt (the first one's telemetry is the request's), for the
# headers of an error response
CALLS = web.RequestKey[list[Call]]("calls")


def _client_names(e: APIError, call: Call) -> None:
    """A worker's error in the client's words: its `prompt` is a chat request's `messages` (as
    OpenAI names them), its `max_tokens` the `max_completion_tokens` a chat client sent."""
    if e.param == "prompt" and call.operation == "chat":
        e.param = "messages"
        e.message = e.message.replace("prompt: ", "messages: ", 1).replace("the prompt", "the messages")
    elif e.param == "max_tokens" and call.options and call.options.max_tokens_field != "max_tokens":
        e.param = call.options.max_tokens_field
        e.message = e.message.replace("max_tokens", e.param)


class Proxy:
    def __init__(
        self, view: ClusterView, http: aiohttp.ClientSession, tel: GatewayTelemetry
    ) -> None:
        self.view = view
        self.http = http
        self.tel = tel
        self.config = view.config
        self._background: set[asyncio.Task[Any]] = set()
        self._woken: dict[tuple[str, str], float] = {}  # (model, region) -> its last wake-up
        # (model, region) -> when the pool's start status was last asked for, and the answer
        # (shared by every request held for that model: one Redis read a poll, not one each)
        self._statuses: dict[tuple[str, str], tuple[float, asyncio.Future[ModelStatus | None]]] = {}
        self._holds = itertools.count()  # numbers each hold's entry in a wait set
        self._warned: set[tuple[str, ...]] = set()  # misconfigurations logged (`_warn_once`)
        self._unasked: str | None = None  # the Redis problem last logged by `_pool_unasked`
        self.shutting_down = False  # `shut_down` was called: no request is held any more
        # done at `shut_down`: the holds wait on it beside their polls (made in the loop's
        # first hold: a Proxy may be made outside one)
        self._shutdown: asyncio.Future[None] | None = None
        self._holding = 0  # requests held now (`hold_for_worker`)
        # the handlers of the API requests in flight (`handle`), and those the drain's end cut
        self._in_flight: dict[asyncio.Task[Any], list[Call]] = {}
        self._cut: set[asyncio.Task[Any]] = set()  # cancelled by the drain's end, not yet answered
        self._streaming: set[asyncio.Task[Any]] = set()  # those whose SSE answer has begun

    # ------------------------------------------------------------------ phases
    async def handle(
        self, request: web.Request, parse: Parser, operation: str
    ) -> web.StreamResponse:
        call = Call(request[REQUEST_ID], None, time.perf_counter())
        calls = request[CALLS] = [call]
        tel = self.tel
        tel.start(call, request.headers, operation)
        err: APIError | None = None
        task = asyncio.current_task()
        if task is not None:
            self._in_flight[task] = calls
        try:
            call.session_id = _session_id(request)  # validate
            body = await _read_json(request, self.config.max_body_bytes, self.config.body_timeout_s)
            if _compiles_grammars(body):  # (its tools' or format's schemas: up to ~1 s)
                gens, call.options = await asyncio.to_thread(
                    parse, body, call.request_id, call.session_id
                )
            else:
                gens, call.options = parse(body, call.request_id, call.session_id)
            for gen in gens:
                gen.operation = call.operation
            n = call.options.n if call.options is not None else 1
            _check_sequences(len(gens), n, self.config.max_request_seqs)
            call.gen = gens[0]
            self.resolve_model(call)
            tel.validated(call, gens)
            tel.phase(call, "gateway.validate", call.started)
            call.route_started = time.perf_counter()  # route: placement, prefix lookup, choice
            if call.session_id is not None:
                call.placement = await self.view.placement(call.session_id)
            calls += [call.part(gen) for gen in gens[1:]]
            streams = await self.dispatch_all(calls)
            try:
                return await self.respond(request, calls, streams)
            finally:
                for c in calls:
                    assert c.worker is not None
                    self.view.router.done(c.worker.worker_id, c.cost)
        except APIError as e:
            err = e
            _client_names(e, call)
            raise
        except asyncio.CancelledError:
            if task is None or task not in self._cut:  # the client went away
                err = client_gone()
                raise
            # the drain ran out before the answer began (`_drain_over` cancels only those): a
            # 503 it may retry
            self._cut.discard(task)
            task.uncancel()
            err = self._drain_over_error()
            raise err from None
        except ConnectionError:  # the client went away
            err = client_gone()
            raise
        except Exception as e:  # (the app's error middleware answers and logs it)
            err = from_exception(e, request.method, request.path, self.config.max_body_bytes)
            raise
        finally:
            if task is not None:
                self._in_flight.pop(task, None)
                self._cut.discard(task)
                self._streaming.discard(task)
            tel.finish(calls, call.assembler, err or call.stream_error)

    async def dispatch(self, call: Call) -> tuple[Events, list[dict[str, Any]]]:
        """One prompt: prefix lookup, route + forward (with retries), record the session's
        placement. Returns what `forward` does."""
        await self.prefix_lookup(call)
        events, head = await self.forward(call)
        assert call.worker is not None
        if call.session_id is not None:  # record: off the hot path
            self._spawn(self.view.record(call.session_id, call.placement, call.worker))
        return events, head

    async def dispatch_all(self, calls: list[Call]) -> list[tuple[Events, list[dict[str, Any]]]]:
        """Every prompt's `dispatch` at once. When one fails, the others are called off (those
        already answering are hung up on) and its error raised."""
        if len(calls) == 1:
            return [await self.dispatch(calls[0])]
        tasks = [asyncio.ensure_future(self._dispatch_prompt(c, p)) for p, c in enumerate(calls)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            for c, outcome in zip(calls, outcomes, strict=True):
                if isinstance(outcome, tuple) and c.worker is not None:
                    await outcome[0].aclose()
                    self.view.router.done(c.worker.worker_id, c.cost)
            raise

    async def _dispatch_prompt(self, call: Call, p: int) -> tuple[Events, list[dict[str, Any]]]:
        """`dispatch` for prompt p of a batch: a refusal of its prompt (too long for the context)
        names it as the client sent it, prompt[p], not `prompt`, which does not say which."""
        try:
            return await self.dispatch(call)
        except APIError as e:
            if e.param == "prompt":
                e.param = f"prompt[{p}]"
                e.message = e.message.replace("prompt: ", f"prompt[{p}]: ", 1)
            raise

    def resolve_model(self, call: Call) -> None:
        """404 for a model no registry snapshot (nor the region catalog) has shown; 503 while
        this gateway has never read the registry (started during a Redis outage: it cannot
        know the model is unknown, and a 404 is not retried)."""
        assert call.gen is not None
        view = self.view
        if call.gen.model not in view.seen_models:
            if not view.refreshed_at:
                kind, error = _redis_fault(view.redis_problem)
                why = f"Redis refused its reads: {error}" if kind == "refused" else "Redis is unreachable"
                raise unavailable(
                    f"cannot tell whether model {call.gen.model!r} is served: this gateway has "
                    f"not read the cluster's registry yet ({why})",
                    self.config.retry_after_s,
                    "registry_unavailable",
                )
            raise model_not_found(call.gen.model)
        call.model_known = True

    async def prefix_lookup(self, call: Call) -> None:
        """Tokenize the prompt here and ask the prefix index which workers hold its blocks.

        Workers of one model may lay out their caches differently (another revision, block size
        or KV dtype during a rolling change: another `cache_id`): each such group's blocks are
        hashed with its own seed, block size and tokenizer, so that every worker is scored. The
        token ids then travel to the worker, so both sides hash the same tokens, when one
        tokenizer serves every live worker of the model; otherwise the prompt goes as it came
        and each worker tokenizes it (as its group's hashes did).

        Skipped (the worker tokenizes, routing goes by load) when the session's worker will
        take the request anyway, or when one worker serves the model (there is nothing to
        choose: an edge region's usual case, ~0.2 ms of tokenizing and a Redis round trip off
        each request), unless prefill and decode are disaggregated (whether a prompt is worth a
        transfer goes by its tokens that worker does not hold: a conversation's next turn is
        mostly in its cache); when Redis is down or its index is being rebuilt after a restart
        (`ClusterView.recovering`), or while no tokenizer bundle is available.
        """
        assert call.gen is not None
        view = self.view
        if not view.redis_ok or view.router.policy != "cache-aware" or view.recovering:
            return
        workers = [w for w in view.live_workers() if w.model == call.gen.model and w.cache_id]
        if not workers:
            return
        disaggregated = view.router.serving_roles(call.gen.model, workers)[1]
        if len(workers) == 1 and not disaggregated:
            return
        if call.placement is not None and not disaggregated:
            placed = next((w for w in workers if w.worker_id == call.placement.worker_id), None)
            if placed is not None and not placed.overloaded and not placed.draining:
                return
        groups: dict[str, list[WorkerInfo]] = {}
        for w in workers:
            groups.setdefault(w.cache_id, []).append(w)
        ids_of: dict[int, list[int]] = {}  # id(tokenizer) -> the prompt's ids
        group_ids: dict[str, list[int]] = {}
        for cache_id in groups:
            tok = await view.tokenizers.get(call.gen.model, cache_id)
            if tok is None:
                continue
            if id(tok) not in ids_of:
                tokenize = functools.partial(
                    prompt_token_ids, tok, call.gen.prompt, call.gen.messages,
                    model=call.gen.model, tools=call.gen.tools,
                )  # fmt: skip
                # a long prompt on a thread (tokenized without the GIL: Tokenizer.encode): ~0.5 s
                # a MB of text held every stream and probe of the gateway while it ran on the loop
                big = call.gen.text_chars() > LONG_TEXT_CHARS
                ids_of[id(tok)] = await asyncio.to_thread(tokenize) if big else tokenize()
            group_ids[cache_id] = ids_of[id(tok)]
        if not group_ids:
            return
        if len(ids_of) == 1 and len(group_ids) == len(groups):  # one tokenizer for all
            if not isinstance(call.gen.prompt, list):
                call.client_prompt = call.gen.prompt, call.gen.messages
            call.gen.prompt, call.gen.messages = next(iter(ids_of.values())), None
        call.prompt_tokens = len(next(iter(group_ids.values())))
        t0 = time.perf_counter()
        for cache_id, ids in group_ids.items():
            bs = groups[cache_id][0].block_size
            usable = (len(ids) - 1) // bs * bs  # the engine always computes the last token
            if usable == 0:
                continue
            hashes = block_hashes(cache_seed(cache_id), ids[:usable], bs)
            members = [w.worker_id for w in groups[cache_id]]
            try:
                longest = await view.prefix.longest_prefixes(call.gen.model, hashes, members)
            except Exception as e:  # a stale or unreachable index: a cache miss, never an error
                self.tel.redis("prefix_lookup", time.perf_counter() - t0, type(e).__name__)
                view.redis_failed(e)  # (and no lookup until Redis answers the refresh again:
                return  # a frozen Redis cost each request its timeouts until then)
            call.cached |= {wid: n * bs for wid, n in longest.items()}
        self.tel.redis("prefix_lookup", time.perf_counter() - t0)

    async def forward(self, call: Call) -> tuple[Events, list[dict[str, Any]]]:
        """Pick a worker and read until the request is committed to it; retry elsewhere on failure.

        Returns the worker's remaining event stream and the events already read (`head`).
        """
        assert call.gen is not None and call.options is not None
        last: APIError | None = None
        router = self.view.router
        # A worker that refused the connection never had the request: not an attempt (three
        # workers of one host killed together spent the three attempts in 2 ms, a 503 while a
        # live worker idled). Each is set aside, and at most MAX_UNREACHED are passed over.
        attempts = unreached = 0
        while attempts < self.config.max_attempts:
            live = [w for w in self.view.live_workers() if w.model == call.gen.model]
            if call.import_full and all(w.worker_id in call.tried for w in live):
                # no worker is left but those that had no KV room to import the prompt: they
                # take it whole instead (computed there, queued like any request), not a 503
                call.tried -= call.import_full
                call.whole |= call.import_full
                call.import_full.clear()
            # per attempt: once the last decode (or prefill) worker has failed, the side left
            # serves whole requests, and a retry goes there
            call.roles, call.disaggregated = router.serving_roles(
                call.gen.model, [w for w in live if w.worker_id not in call.tried]
            )
            if last is not None:
                call.route_started = time.perf_counter()
            worker = await self.route_or_hold(call, last)
            # counted against its worker before anything awaits, so that requests routed
            # meanwhile see it (the claim below is a Redis round trip: first turns of many
            # sessions at once all went to one worker, and it overflowed)
            call.cost = _cost(call.gen)
            router.sent(worker.worker_id, call.cost)
            if call.session_id is not None and call.placement is None:
                try:
                    placed = await self.place(call, worker, last)
                except BaseException:  # (the client went away, or no worker is left)
                    router.done(worker.worker_id, call.cost)
                    raise
                if placed is not worker:  # another gateway placed the session first
                    router.done(worker.worker_id, call.cost)
                    router.sent(placed.worker_id, call.cost)
                    worker = placed
            self.tel.phase(call, "gateway.route", call.route_started)
            self.tel.routed(call.route_reason)
            if last is not None:
                self.tel.retried()
            call.worker = worker
            call.forwarded = call.forwarded or time.perf_counter()
            prefill_cost = self.pick_prefill(call, worker)
            events = self.worker_events(call, worker)
            head: list[dict[str, Any]] = []
            try:
                async for batch in events:
                    worker = call.worker or worker  # (the one that answered: `_answered_by`)
                    head += batch
                    kinds = {e["type"] for e in batch}
                    if "error" in kinds:
                        error = next(e for e in batch if e["type"] == "error")
                        if error.get("code") == "constraint_failed":  # the same anywhere: no retry
                            param = error.get("param")  # (the client's field, if named)
                            raise invalid(param if isinstance(param, str) else None,
                                          str(error.get("message")), "constraint_failed")
                        status = error.get("status")
                        if isinstance(status, int) and 400 <= status < 600:
                            # a refusal sent in the stream (a decode worker's, of its KV pull):
                            # taken as that answer, as if it had come before the stream
                            body = {"error": error.get("error") or {
                                "message": error.get("message"), "code": error.get("code")}}
                            raise _refused(worker, status, body, error.get("retry_after"))
                        raise WorkerFailed(worker, _event_error(error), dead=False)
                    if "done" in kinds or (call.options.stream and "delta" in kinds):
                        call.answered = time.perf_counter()
                        self._prefill_done(call, prefill_cost)
                        return events, head
                raise WorkerFailed(worker, bad_gateway("worker stream ended early"), dead=True)
            except WorkerFailed as e:
                worker = call.worker or worker
                await events.aclose()
                router.done(worker.worker_id, call.cost)
                prefill = call.prefill
                self._prefill_done(call, prefill_cost)
                failed = worker
                if e.error.code in _PREFILL_SIDE and prefill is not None:
                    # the prefill side failed (set aside) or refused the pull (its KV cache
                    # full, ...: passed over), not the decode worker: prefill elsewhere
                    failed = prefill
                    call.tried_prefill.add(prefill.worker_id)
                    if e.error.code == "kv_transfer_failed":
                        self.view.mark_failed(prefill.worker_id)
                    # not an attempt: bounded by MAX_PREFILL_TRIES (pick_prefill), after which
                    # the decode worker computes the prompt, so a request every prefill worker
                    # refuses is still served
                    attempts -= 1
                else:
                    if e.dead:
                        self.view.mark_failed(worker.worker_id)
                    call.tried.add(worker.worker_id)
                    if (isinstance(e.__cause__, (aiohttp.ClientConnectorError, *_BAD_URL))
                            and unreached < MAX_UNREACHED):  # fmt: skip
                        unreached += 1
                        attempts -= 1
                    if e.error.code == "kv_cache_full" and call.gen.kv_source is not None:
                        call.import_full.add(worker.worker_id)
                last = e.error
                attempts += 1
                log.warning(
                    "request %s: worker %s failed: %s", call.request_id, failed.worker_id, e
                )
            except BaseException as e:  # a refusal to relay (400/404), or the client went away
                worker = call.worker or worker
                await events.aclose()
                router.done(worker.worker_id, call.cost)
                self._prefill_done(call, prefill_cost)
                if not (isinstance(e, APIError) and e.status == 413 and call.client_prompt):
                    raise
                # the prompt's token ids made the body larger than the worker takes (an id may
                # take 4 bytes and more where its text took one: a 1.2 MB request got the
                # worker's 413 for 4 MB): sent again as the client sent it, tokenized there
                call.gen.prompt, call.gen.messages = call.client_prompt
                call.client_prompt = None
        assert last is not None
        raise last

    def pick_prefill(self, call: Call, worker: WorkerInfo) -> int:
        """Disaggregated: choose the prefill worker the decode `worker` pulls the prompt's KV
        from (sets `call.prefill` and `call.gen.kv_source`). Returns the prompt tokens counted
        against it while in flight."""
        assert call.gen is not None
        call.prefill, call.gen.kv_source = None, None
        if not call.disaggregated or worker.role == "prefill" or worker.worker_id in call.whole:
            return 0
        if len(call.tried_prefill) >= MAX_PREFILL_TRIES:
            return 0  # prefill workers refused or failed it: the decode worker computes it
        if call.gen.sampling.get("prompt_logprobs") is not None:
            return 0  # (the prompt's logits, which a pulled KV lacks: the decode worker's own)
        uncached = call.prompt_tokens - call.cached.get(worker.worker_id, 0)
        if call.prompt_tokens and uncached < self.config.disagg_min_tokens:
            return 0  # a short prefill costs the decode worker less than a transfer
        candidates = self.view.router.prefill_candidates(
            call.gen.model,
            self.view.live_workers(),
            frozenset(call.tried_prefill),
            cached=call.cached,
            prompt_tokens=call.prompt_tokens,
            cache_id=worker.cache_id,
        )
        if not candidates:  # every prefill worker failed this request, or none can hold the
            return 0  # prompt (its KV cache is smaller): the decode worker computes it
        call.prefill = candidates[0]
        call.gen.kv_source = call.prefill.kv_addr
        cost = uncached if call.prompt_tokens else _prompt_estimate(call.gen)
        self.view.router.sent_prefill(call.prefill.worker_id, cost)
        return cost

    def _prefill_done(self, call: Call, cost: int) -> None:
        if call.prefill is not None and cost:
            self.view.router.done_prefill(call.prefill.worker_id, cost)

    async def route_or_hold(self, call: Call, last: APIError | None) -> WorkerInfo:
        """Route; when no worker serves the model but a pool can start one, hold the request
        until one is up (scale from zero), then route again. Workers this request already tried
        that still serve (one that answered 429 or 503, busy) are serving: their answer is the
        request's (held, it waited hold_timeout_s for a start no pool makes while they serve,
        then got a 503 `worker_starting`)."""
        route = self._route(call)
        held = not route.candidates and route.reason == "no_workers"
        if held and call.tried and not (last is not None and last.code == "draining"):
            # (a worker that answered "draining" is leaving, whatever the snapshot says yet: a
            # pool's scale-down; the request waits for the worker that replaces it)
            held = self._route(call, exclude_tried=False).reason == "no_workers"
        if held and await self.hold_for_worker(call):
            route = self._route(call)
            route.reason = "cold_start"
        worker = self.chosen(call, route, last)
        if route.reason == "remote":
            self.wake_nearer_pool(call.gen.model, worker.region)  # type: ignore[union-attr]
        return worker

    def wake_nearer_pool(self, model: str, serving: str) -> None:
        """A request served from region `serving`, far away, while a pool in a nearer region
        (this gateway's own, first) can start `model`: wake that pool, at most every
        WAKE_EVERY_S, as a held request would (without holding this one: it is served where it
        went). The pool starts a worker, since none serves the model in its region; the next
        requests go to it. Otherwise the pool never heard of them and never started one while
        anywhere else served the model."""
        view = self.view
        region = view.pool_region(model)
        if region is None or region == serving or not view.redis_ok:
            return
        if view.catalog.nearest_first(self.config.region, [region, serving])[0] != region:
            return
        now = time.monotonic()
        if now - self._woken.get((model, region), -WAKE_EVERY_S) < WAKE_EVERY_S:
            return
        self._woken[(model, region)] = now
        self._spawn(self._wake(model, region))

    async def _wake(self, model: str, region: str) -> None:
        try:
            await self.view.demand.wake(model, region)
        except Exception as e:  # (Redis failing: the next request far away tries again)
            log.debug("cannot wake the pool of %s in %s: %s", model, region, e)
            return
        log.info("woke the pool of region %s for %s (served from farther away)", region, model)

    async def place(self, call: Call, worker: WorkerInfo, last: APIError | None) -> WorkerInfo:
        """Claim a new session for the routed `worker` before the request goes there: gateways
        that place the same new session at once then all send it to the claim's winner (routed
        to as any placed session is), rather than each to its own pick. One Redis round trip,
        on a session's first request only: the claim `record` would make after it anyway."""
        assert call.session_id is not None
        call.placement = await self.view.claim(call.session_id, worker)
        if call.placement is None or call.placement.worker_id == worker.worker_id:
            return worker
        return self.chosen(call, self._route(call), last)

    def _route(self, call: Call, exclude_tried: bool = True) -> Route:
        assert call.gen is not None
        return self.view.router.route(
            call.gen.model,
            self.view.live_workers(),
            call.placement,
            frozenset(call.tried) if exclude_tried else frozenset(),
            cached=call.cached,
            prompt_tokens=call.prompt_tokens,
            roles=call.roles,
        )

    async def hold_for_worker(self, call: Call) -> bool:
        """Wait for a pool to start a worker for the model; True once one is up.

        False at once when no pool offers the model. The request counts as waiting in Redis (the
        pool's scale-from-zero signal) while it waits; a pool that reports failed starts
        (HOLD_THROUGH_FAILURES in a row, or one whose next try comes after the hold), no pool
        offering the model in its region any more (for `pool_gone_grace_s`), no worker within
        `hold_timeout_s`, or the gateway shutting down (`shut_down`) ends the wait with 503 and
        Retry-After.
        """
        assert call.gen is not None
        model, view = call.gen.model, self.view
        region = view.pool_region(model)
        if region is None:
            return False
        if self.shutting_down:  # (it listens no more: this one came in just before)
            raise self._shutting_down_error()
        if not view.redis_ok:
            raise self._pool_unasked(model, region)
        t0 = time.perf_counter()
        deadline = time.time() + self.config.hold_timeout_s
        # This hold's own entry: when a request is held again (retried after its worker
        # failed), the late release of its earlier hold (spawned, below) cannot remove it.
        member = f"{call.gen.request_id}/{next(self._holds)}"
        self._holding += 1
        try:  # (released whatever happens once written: the wake-up after it may fail, or the
            # client go away meanwhile, and the entry counted as demand for the whole hold)
            try:
                await view.demand.hold(model, region, member, deadline)
            except Exception as e:  # refused (out of memory, a replica, an ACL), or unreachable
                view.redis_failed(e)  # (noted for readiness; logged when it begins)
                raise self._pool_unasked(model, region) from e
            self._unasked = None
            log.info("request %s waits for a %s worker in %s", call.request_id, model, region)
            # The wait, raced against shutdown: a poll may wait on Redis (a renewal, a refresh,
            # the start status), and the shutdown must not wait for it. Before, a SIGTERM left
            # held requests to aiohttp's shutdown timeout, which cancelled them unanswered (an
            # empty reply ~10 s later): now each gets its 503 at once, safe to retry elsewhere.
            waiting = asyncio.ensure_future(self._wait_for_worker(call, region, member, deadline))
            waiting.add_done_callback(_retrieved)
            try:
                done, _ = await asyncio.wait(
                    (waiting, self._shutdown_future()), return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                waiting.cancel()  # (the client went away, or the gateway shuts down)
            if waiting not in done:
                raise self._shutting_down_error()
            return waiting.result()
        finally:
            self._holding -= 1
            call.held_s += time.perf_counter() - t0
            self._spawn(self._release(model, region, member))

    async def _wait_for_worker(self, call: Call, region: str, member: str, deadline: float) -> bool:
        """`hold_for_worker`'s polls, every HOLD_POLL_S: True once a worker serves the model;
        503 when its pool failed to start one, has gone, or the hold timed out."""
        assert call.gen is not None
        model, view = call.gen.model, self.view
        renew_at = time.monotonic() + REHOLD_S
        gone_since: float | None = None  # when the snapshot first listed no pool for it
        while True:
            if time.monotonic() >= renew_at and view.redis_ok:
                renew_at = time.monotonic() + REHOLD_S
                try:  # (bounded: a Redis that hangs does not hold up the wait's polls)
                    async with asyncio.timeout(REHOLD_TIMEOUT_S):
                        await view.demand.hold(model, region, member, deadline, wake=False)
                except Exception as e:  # (Redis down: the next renewal, once it is back)
                    view.redis_failed(e)
            await view.refresh_soon(HOLD_POLL_S)
            call.roles, call.disaggregated = view.router.serving_roles(model, view.live_workers())
            if self._route(call).candidates:
                return True
            status = await self._start_status(model, region)
            if (
                status is not None
                and status.state == "failed"
                # a first failure (a worker that crashed early, killed for memory, ...)
                # whose next try comes within the hold: wait for it, not a 503 at once
                and (status.attempts >= HOLD_THROUGH_FAILURES or status.retry_at >= deadline)
            ):
                raise unavailable(
                    f"no worker for model {model!r} could be started in region {region} "
                    f"({status.attempts} failed attempts; the last: {status.error})",
                    status.retry_after(),
                    "worker_start_failed",
                )
            # (a snapshot kept through a Redis outage still lists the pools it had: only a
            # registry read that no longer lists one counts)
            if any(p.region == region and model in p.models for p in view.pools):
                gone_since = None
            elif gone_since is None:
                gone_since = time.monotonic()
            if gone_since is not None and (
                time.monotonic() - gone_since >= self.config.pool_gone_grace_s
                or time.time() >= deadline
            ):
                raise self._pool_gone(model, region)
            if time.time() >= deadline and status is not None and status.state == "full":
                raise unavailable(
                    f"no worker for model {model!r} could start in region {region} within "
                    f"{self.config.hold_timeout_s:.0f}s: every worker its pool may run "
                    "(--max-workers) is busy serving other models",
                    self.config.retry_after_s,
                    "pool_full",
                )
            if time.time() >= deadline:
                raise unavailable(
                    f"no worker for model {model!r} was ready within "
                    f"{self.config.hold_timeout_s:.0f}s; it is still starting",
                    self.config.retry_after_s,
                    "worker_starting",
                )
            await asyncio.sleep(HOLD_POLL_S)

    def _pool_gone(self, model: str, region: str) -> APIError:
        """The 503 of a request held for a pool of `region` that no longer offers `model` (it
        stopped, or its entry expired), none having taken its place within pool_gone_grace_s."""
        elsewhere = self.view.pool_region(model)
        retry = (
            f"; a pool in region {elsewhere} offers it: a retry waits for that one"
            if elsewhere is not None
            else ""
        )
        return unavailable(
            f"no worker serves model {model!r} and no pool in region {region} offers it any "
            f"more: the pool that was to start its worker has gone{retry}",
            self.config.retry_after_s,
            "pool_unavailable",
        )

    def shut_down(self) -> None:
        """The gateway shuts down (it listens no more: app.on_shutdown): every request still
        held, which never reached a worker, is answered 503 `gateway_shutting_down` with
        Retry-After at once, so that the client or its load balancer retries it on another
        gateway; said once in the log, with their count. Requests already at a worker finish."""
        if self.shutting_down:
            return
        self.shutting_down = True
        if self._holding:
            log.warning("shutting down: %d request(s) waiting for a worker to start are answered "
                        "503 (to be retried on another gateway)", self._holding)  # fmt: skip
        if self._shutdown is not None and not self._shutdown.done():
            self._shutdown.set_result(None)
        at_workers = len(self._in_flight) - self._holding
        if at_workers > 0:
            log.warning("shutting down: %d request(s) in flight get up to %gs to finish "
                        "(--drain-timeout)", at_workers, self.config.drain_timeout_s)  # fmt: skip
        with contextlib.suppress(RuntimeError):  # (no loop: nothing can be in flight either)
            asyncio.get_running_loop().call_later(self.config.drain_timeout_s, self._drain_over)

    def _drain_over(self) -> None:
        """The drain's end: every request still in flight ends now, a 503 if its answer had not
        begun, else a closing error event on its stream (`handle`, `_stream`); closing its
        worker stream aborts it there. aiohttp's shutdown timeout, a little later, would have
        cancelled them unanswered (an empty reply, or a stream that just stops)."""
        tasks = [t for t in self._in_flight if not t.done()]
        if tasks:
            log.warning("drain timeout (%gs) over: %d request(s) still in flight end now (503, "
                        "or a closing error event; the client may retry them)",
                        self.config.drain_timeout_s, len(tasks))  # fmt: skip
        for t in tasks:
            if t in self._streaming:
                # Not cancelled: the handler may be waiting on a slow client's drain(), whose
                # future aiohttp shares per connection, and a cancel there left every later
                # write failing (no error event ever sent). Its worker streams are closed
                # instead, which its relay loop takes for their end (`_stream`).
                for c in self._in_flight[t]:
                    c.cut = True
                    if c.upstream is not None:
                        c.upstream.close()
            else:
                self._cut.add(t)
                t.cancel()

    def _drain_over_error(self) -> APIError:
        return unavailable(
            f"this gateway is shutting down and its drain timeout ({self.config.drain_timeout_s:g}"
            "s) ran out before the answer ended; retry the request, on another gateway",
            self.config.retry_after_s,
            "gateway_shutting_down",
        )

    def _shutdown_future(self) -> asyncio.Future[None]:
        if self._shutdown is None:
            self._shutdown = asyncio.get_running_loop().create_future()
            if self.shutting_down:
                self._shutdown.set_result(None)
        return self._shutdown

    def _shutting_down_error(self) -> APIError:
        return unavailable(
            "this gateway is shutting down: the request had not reached a worker (it waited for "
            "one to start); retry it, on another gateway",
            self.config.retry_after_s,
            "gateway_shutting_down",
        )

    def _pool_unasked(self, model: str, region: str) -> APIError:
        """The 503 of a request for `model`, which no worker serves and a pool of `region` can
        start, while Redis cannot take the request's hold: it refuses this gateway's writes (out
        of memory, a replica, an ACL) or is unreachable. At once, with Retry-After and the
        reason: the hold is the pool's only word of the request, and out of memory or with Redis
        gone a worker it started could not register either, so a wait would only have ended in
        the hold's timeout. Logged when the reason changes, not per request (a warning each,
        under an OOM, whose 503 said only that no worker served the model)."""
        problem = self.view.redis_problem or "unreachable"
        kind, error = _redis_fault(problem)
        why = {"refused": "refuses this gateway's writes", "failed": "fails"}.get(
            kind, "is unreachable"
        ) + (f" ({error})" if error else "")
        if self._unasked != problem:
            self._unasked = problem
            log.warning("cannot ask the pools for workers while Redis %s: requests for a model "
                        "that only a pool serves (%s, in %s) are answered 503 until it takes "
                        "their holds", why, model, region)  # fmt: skip
        return unavailable(
            f"no worker serves model {model!r} and its pool in region {region} cannot be "
            f"asked to start one: Redis {why}",
            self.config.retry_after_s,
            "pool_unavailable",
        )

    async def _start_status(self, model: str, region: str) -> ModelStatus | None:
        """What the pool says of its start of a worker for the model; None while Redis cannot
        say (down, or failing now): the request keeps waiting for a worker to show in the
        registry snapshot (refreshed once Redis is back) until the hold's timeout (503).

        One read per HOLD_POLL_S for all the requests held for the model: each polled on its
        own, a burst of 1,000 held requests made ~20,000 Redis reads a second."""
        if not self.view.redis_ok:
            return None
        key, now = (model, region), time.monotonic()
        last = self._statuses.get(key)
        if last is None or now - last[0] >= HOLD_POLL_S:
            last = now, asyncio.ensure_future(self._read_status(model, region))
            self._statuses[key] = last
        # (shielded: a request that goes away does not cancel the others' read)
        return await asyncio.shield(last[1])

    async def _read_status(self, model: str, region: str) -> ModelStatus | None:
        try:
            return await self.view.demand.status(model, region)
        except Exception as e:  # connection refused, timeout
            log.debug("cannot read the start status of %s in %s: %s", model, region, e)
            return None

    async def _release(self, model: str, region: str, request_id: str) -> None:
        with contextlib.suppress(Exception):
            await self.view.demand.release(model, region, request_id)

    def chosen(self, call: Call, route: Route, last: APIError | None) -> WorkerInfo:
        assert call.gen is not None
        if route.candidates:
            call.route_reason = route.reason
            return route.candidates[0]
        if last is not None:  # every worker tried failed: say why the last one did
            if last.status in (429, 503) and last.retry_after is None:  # (and when to retry)
                last.retry_after = self.config.retry_after_s
            raise last
        retry = self.config.retry_after_s
        if route.reason == "at_capacity":
            raise at_capacity(retry, f"all workers for model {call.gen.model!r} are at capacity")
        raise unavailable(
            f"no worker is serving model {call.gen.model!r} right now", retry, "no_workers"
        )

    async def worker_events(self, call: Call, worker: WorkerInfo) -> Events:
        """The worker's events, in batches of whatever arrived together (one write per batch
        downstream), up to the one that ends its stream (`done` or `error`); any failure, a
        stream cut short included, becomes WorkerFailed. Closing it hangs up on the worker.
        Its span (gateway.forward) lasts until the worker's stream ends. Notes on `call` when
        the first delta arrived and each choice's tokens (`_count_tokens`)."""
        gen = call.gen
        assert gen is not None
        call.first_token, call.stream_tokens = 0.0, {}  # (a failed attempt's do not count)
        timeout = aiohttp.ClientTimeout(  # (a decode worker pulling KV sends keepalives too)
            total=None,
            sock_connect=self.config.connect_timeout_s,
            sock_read=self.config.worker_idle_timeout_s,
        )
        headers = {SECRET_HEADER: self.config.worker_secret, "Content-Type": "application/json"}
        span = self.tel.forward(call, worker.worker_id, headers)
        url = f"{worker.url}/internal/generate"
        finished = first = False
        try:
            async with self.http.post(
                url, data=gen.to_json(), headers=headers, timeout=timeout
            ) as resp:
                if resp.status != 200:
                    raise await _refusal(resp, worker)
                call.upstream = resp  # (the drain's end closes it: `_drain_over`)
                tail = b""
                async for data in resp.content.iter_any():
                    *lines, tail = (tail + data).split(b"\n")
                    lines = [line for line in lines if line]  # (blank: a keepalive)
                    if not lines:
                        continue
                    batch = [decode_event(line) for line in lines]
                    if not first:
                        first = True
                        answered = self._answered_by(call, worker, batch[0])
                        if answered is None:
                            await self.abort(worker, gen.request_id)  # (before a retry: the
                            # same worker may be reached again, and would refuse the same id)
                            raise WorkerFailed(worker, bad_gateway(
                                f"worker {worker.worker_id} answered as another worker",
                                "worker_failed"), dead=True)  # fmt: skip
                        worker = answered
                    finished = batch[-1]["type"] in ("done", "error")
                    if batch[-1]["type"] == "error":  # (the attempt failed, retried or not)
                        code = batch[-1].get("code") or "worker_error"
                        span.set_attribute("error.type", str(code))
                        span.set_status(Status(StatusCode.ERROR, str(batch[-1].get("message"))[:200]))
                    _count_tokens(call, batch)
                    if finished:  # (read to its end before the caller may close this)
                        await _read_to_end(resp)
                    yield batch
                    if finished:
                        return
                raise WorkerFailed(worker, bad_gateway("worker stream ended early"), dead=True)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            if isinstance(e, _BAD_URL):
                self._warn_once(("url", worker.worker_id, worker.url),
                                "worker %s is registered with an unusable URL %r (%s): set "
                                "aside until its next heartbeat", worker.worker_id, worker.url,
                                e)  # fmt: skip
            log.info("request %s: worker %s failed: %r", gen.request_id, worker.worker_id, e)
            error = unavailable(f"worker {worker.worker_id} failed ({_failure(e)})",
                                code="worker_failed")  # fmt: skip
            failed = WorkerFailed(worker, error, dead=True)
            span.set_status(Status(StatusCode.ERROR, str(failed)[:200]))
            raise failed from e
        except (WorkerFailed, APIError) as e:
            span.set_status(Status(StatusCode.ERROR, str(e)[:200]))
            raise
        except (GeneratorExit, asyncio.CancelledError):
            if not finished:  # the client went away: make sure the worker stops computing
                self._spawn(self.abort(worker, gen.request_id))
            raise
        finally:
            span.end()

    def _answered_by(
        self, call: Call, worker: WorkerInfo, event: dict[str, Any]
    ) -> WorkerInfo | None:
        """The worker that answered the request routed to `worker` (its first event, `start`,
        names it). A registry entry whose URL reaches another worker (a worker started on the
        port of one that died before its entry expired, a wrong --url) would otherwise put the
        request, and the session's placement, on a worker the gateway does not know it is on.
        The entry is set aside (until its next heartbeat) and the mix-up logged. When the worker
        that answered is a live one of the model at that URL, the answer is taken as its own
        (`call.worker`, its load, the placement to be recorded); otherwise None: the answer is
        refused and the request tried elsewhere, before any byte reached the client."""
        if event.get("type") != "start" or event.get("worker_id") == worker.worker_id:
            return worker
        other = event.get("worker_id")
        self._warn_once(("start", worker.worker_id, worker.url, str(other)),
                        "worker %s is registered at %s, where worker %r answers: set aside "
                        "until its next heartbeat (a worker on the port of one that died, or "
                        "a wrong --url?)", worker.worker_id, worker.url, other)  # fmt: skip
        self.view.mark_failed(worker.worker_id)
        real = next((w for w in self.view.live_workers() if w.worker_id == other
                     and w.url == worker.url and w.model == worker.model), None)  # fmt: skip
        if real is None:
            return None
        router = self.view.router
        router.done(worker.worker_id, call.cost)
        router.sent(real.worker_id, call.cost)
        call.worker = real
        return real

    def _warn_once(self, key: tuple[str, ...], msg: str, *args: object) -> None:
        """A misconfigured worker, logged once a gateway's life as an ERROR (it comes back with
        each heartbeat and fails each request sent to it again, logged as a failed attempt)."""
        if key not in self._warned:
            if len(self._warned) >= 1024:  # (bounded: ids of workers come and go)
                self._warned.clear()
            self._warned.add(key)
            log.error(msg, *args)

    async def abort(self, worker: WorkerInfo, request_id: str) -> None:
        try:
            async with self.http.post(
                f"{worker.url}/internal/abort",
                data=orjson.dumps({"request_id": request_id}),
                headers={SECRET_HEADER: self.config.worker_secret},
                timeout=aiohttp.ClientTimeout(total=5),
            ) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            pass  # the worker is gone; its blocks went with it

    async def respond(
        self,
        request: web.Request,
        calls: list[Call],
        streams: list[tuple[Events, list[dict[str, Any]]]],
    ) -> web.StreamResponse:
        """Answer with every prompt's events (`streams`, as `dispatch` returned them), their
        choices numbered from p * n for prompt p; closes the streams."""
        call = calls[0]
        assert call.options is not None
        assembler = ResponseAssembler(call.options, call.request_id, int(time.time()))
        call.assembler = assembler
        headers = routed_headers(calls) | {"Server-Timing": _server_timing(call)}
        try:
            if not call.options.stream:
                for p, (_, head) in enumerate(streams):
                    for event in head:
                        assembler.on_event(event, p)
                return await self._answer(request, call, orjson.dumps(assembler.final()), headers)
            return await self._stream(request, call, assembler, headers, streams)
        finally:
            for events, _ in streams:
                await events.aclose()
            if call.stalled:  # (after the streams, whose closing aborts the request at the
                _reset(request)  # worker: aiohttp cancels a handler whose connection is lost)

    async def _answer(
        self, request: web.Request, call: Call, body: bytes, headers: dict[str, str]
    ) -> web.StreamResponse:
        """A whole (not streamed) answer, written here rather than by aiohttp after the handler
        returns, so that a client that does not read it is dropped after client_write_timeout_s
        (`_write`) instead of holding the connection and the answer for as long as it likes."""
        resp = web.StreamResponse(headers=headers)
        resp.content_type = "application/json"
        resp.content_length = len(body)
        await resp.prepare(request)
        task = asyncio.current_task()
        if task is not None and task in self._in_flight:  # (begun: the drain's end cancels it
            self._streaming.add(task)  # no more, which would answer 503 after these headers)
        try:
            await self._write(request, resp, body, eof=True)
        except ClientStalled:
            self._stalled(call)
        except ConnectionError:  # the client went away (nothing to abort: the answer is whole)
            call.stream_error = client_gone()
        return resp

    async def _write(
        self, request: web.Request, resp: web.StreamResponse, data: bytes, eof: bool = False
    ) -> None:
        """Write `data` (and end the response: `eof`) to the client; ClientStalled when the
        client takes none of it for client_write_timeout_s (its connection's buffers stay full:
        it has stopped reading): `_stalled`, and the connection is reset (`respond`). A client
        that reads, however slowly, is waited for. A worker's stream is not read meanwhile, and
        aiohttp stops that stream's idle timeout (worker_idle_timeout_s) while its buffer is
        full: a slow client is never taken for a silent worker."""
        transport = request.transport
        if transport is not None and transport.get_write_buffer_size() + len(data) < FREE_WRITE:
            # (nothing waits for the client: the socket takes it, or the transport's buffer
            # does, below aiohttp's drain mark: no timers for a stream's small chunks)
            await resp.write(data)
            if eof:
                await resp.write_eof()
            return
        try:
            async with asyncio.timeout(self.config.client_write_timeout_s) as deadline:
                watch = _Progress(transport, deadline, self.config.client_write_timeout_s)
                try:
                    await resp.write(data)
                    if eof:
                        await resp.write_eof()
                finally:
                    watch.cancel()
        except TimeoutError:
            raise ClientStalled from None

    def _stalled(self, call: Call) -> None:
        """The client was dropped (`_write`): recorded as a client that went away, and said in
        the log (an INFO line: a client's fault, not the service's)."""
        call.stalled = True
        log.info("request %s: the client took none of the answer for %gs "
                 "(client_write_timeout_s): its connection is reset, its worker streams closed",
                 call.request_id, self.config.client_write_timeout_s)  # fmt: skip
        call.stream_error = APIError(
            CLIENT_GONE_STATUS,
            f"the client took none of the answer for {self.config.client_write_timeout_s:g} s "
            "(client_write_timeout_s); dropped",
            "client_error",
            None,
            "client_stalled",
        )

    async def _stream(
        self,
        request: web.Request,
        call: Call,
        assembler: ResponseAssembler,
        headers: dict[str, str],
        streams: list[tuple[Events, list[dict[str, Any]]]],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers=headers
            | {
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await resp.prepare(request)
        task = asyncio.current_task()
        if task is not None and task in self._in_flight:
            self._streaming.add(task)
        events = _interleaved([rest for rest, _ in streams])
        client = _ClientWriter(self, request, resp)
        try:
            for p, (_, head) in enumerate(streams):  # (no error event: `forward` raised those)
                await self._relay(client, assembler, p, head)
            async for p, batch in events:
                failed = await self._relay(client, assembler, p, batch)
                if failed is not None:  # (sent as the stream's last chunk)
                    self._stream_failed(call, failed)
                    break
        except WorkerFailed as e:
            if call.cut:  # the drain's end closed the worker stream: no worker failed
                error = self._drain_over_error()
                self._stream_failed(call, error)
                await self._send_last(call, client, sse(error.body()) + SSE_DONE)
                return resp
            if e.dead:
                self.view.mark_failed(e.worker.worker_id)
            log.warning("request %s: worker failed mid-stream: %s", call.request_id, e)
            self._stream_failed(call, e.error)
            # the client's own words: the worker's id and the aiohttp error stay in the log
            why = ("it stopped answering" if isinstance(e.__cause__, TimeoutError) else
                   "its connection broke" if e.dead else e.error.message)  # fmt: skip
            # typed as the same failure before the first byte is answered (a worker that went
            # away: a 503's server_error, which clients retry)
            error = APIError(e.error.status, f"the worker serving this request failed after the "
                             f"stream began ({why}); retry the request", e.error.type, None,
                             e.error.code or "worker_failed")  # fmt: skip
            await self._send_last(call, client, sse(error.body()) + SSE_DONE)
            return resp
        except APIError as e:  # the worker's stream broke the protocol after the first byte
            log.warning("request %s: %s", call.request_id, e.message)
            self._stream_failed(call, e)
            await self._send_last(call, client, sse(e.body()) + SSE_DONE)
            return resp
        except ConnectionError:  # the client went away; closing the streams aborts on workers
            call.stream_error = client_gone()  # (recorded, not counted as an answer's error)
            return resp
        except ClientStalled:  # the client stopped reading: dropped (as if it had gone away)
            self._stalled(call)
            return resp
        finally:
            await events.aclose()  # (before the streams: it may be reading them)
        await self._send_last(call, client, SSE_DONE)
        return resp

    async def _send_last(self, call: Call, client: _ClientWriter, data: bytes) -> None:
        """The stream's last chunk, and its end; a client gone or stalled by then misses it."""
        try:
            await client.write(data, eof=True)
        except ConnectionError:
            pass
        except ClientStalled:  # (reset all the same: aiohttp would wait on it to end it)
            if call.stream_error is None:
                self._stalled(call)
            call.stalled = True

    def _stream_failed(self, call: Call, err: APIError) -> None:
        call.stream_error = err
        self.tel.error(err)  # the client got 200 and then an error event: count it here

    @staticmethod
    async def _relay(
        resp: _Writer,
        assembler: ResponseAssembler,
        prompt: int,
        batch: list[dict[str, Any]],
    ) -> APIError | None:
        """Send a batch of prompt `prompt`'s worker events as SSE chunks in one write; the error
        when it ended in an error event (sent as an error chunk), which ends the whole answer."""
        out: list[bytes] = []
        failed = None
        for event in batch:
            if event["type"] == "error":  # (the worker's code: "shutdown", "engine_dead"...)
                failed = error_from_event(event)
                out.append(sse(failed.body()))
                break
            out += [sse(c) for c in assembler.on_event(event, prompt)]
        if out:
            await resp.write(b"".join(out))
        return failed

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=5)


# ---------------------------------------------------------------------- helpers
# A write that leaves the transport's buffer under this cannot wait for the client (aiohttp
# drains from 64 KiB): `Proxy._write` arms no deadline for it
FREE_WRITE = 16 << 10


class ClientStalled(Exception):
    """The client took none of a write within client_write_timeout_s (`Proxy._write`)."""


class _Writer(Protocol):
    async def write(self, data: bytes) -> None: ...


class _ClientWriter:
    """A response's writes to its client, each bounded by client_write_timeout_s
    (`Proxy._write`)."""

    def __init__(self, proxy: Proxy, request: web.Request, resp: web.StreamResponse) -> None:
        self._proxy, self._request, self._resp = proxy, request, resp

    async def write(self, data: bytes, eof: bool = False) -> None:
        await self._proxy._write(self._request, self._resp, data, eof)


class _Progress:
    """Moves a write's deadline (`Proxy._write`) on while the client takes some of what is
    buffered for it: checked every quarter of the timeout, so that a client is dropped between
    1 and 1.25 timeouts after it last took a byte, not when one write outlasts the timeout (a
    whole answer of megabytes, or a buffer's worth to a client reading kilobytes a second)."""

    def __init__(
        self, transport: asyncio.Transport | None, deadline: asyncio.Timeout, timeout_s: float
    ) -> None:
        self._transport = transport
        self._deadline = deadline
        self._timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._left = self._buffered()
        self._check = self._loop.call_later(timeout_s / 4, self._checked)

    def _buffered(self) -> int:
        t = self._transport
        return t.get_write_buffer_size() if t is not None and not t.is_closing() else 0

    def _checked(self) -> None:
        left = self._buffered()
        if left < self._left:  # it took some: the client is reading
            self._deadline.reschedule(self._loop.time() + self._timeout_s)
        self._left = left
        self._check = self._loop.call_later(self._timeout_s / 4, self._checked)

    def cancel(self) -> None:
        self._check.cancel()


def _reset(request: web.Request) -> None:
    """Drop the client's connection with a reset (SO_LINGER 0): a plain close would leave what
    its socket still holds for the client queued in the kernel, retried for minutes."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _check_sequences(prompts: int, n: int, limit: int) -> None:
    """400 for a request of more sequences (prompts x n) than `limit` (max_request_seqs)."""
    if prompts * n <= limit:
        return
    if prompts == 1:
        raise invalid("n", f"n is {n}; at most {limit} sequences per request (this gateway's "
                      "max_request_seqs)", "too_many_sequences")  # fmt: skip
    raise invalid(
        "n" if n > 1 else "prompt",
        f"prompt holds {prompts} prompts and n is {n}: {prompts * n} sequences (prompts x n); at "
        f"most {limit} per request (this gateway's max_request_seqs): send the prompts in "
        "several requests",
        "too_many_sequences",
    )


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A task's outcome taken, whatever it is: one left behind (cancelled, or ended as its
    awaiter was) logs no "exception was never retrieved"."""
    if not task.cancelled():
        task.exception()


def routed_headers(calls: list[Call]) -> dict[str, str]:
    """Where the request went, once a worker was chosen (an error's response says it too): a
    batch's prompts' distinct values, comma-separated, in prompt order."""
    routed = [(c, c.worker) for c in calls if c.worker is not None]
    if not routed:
        return {}
    headers = {
        "x-edgeinfer-worker": _listed(w.worker_id for _, w in routed),
        "x-edgeinfer-region": _listed(w.region for _, w in routed),
        "x-edgeinfer-route": _listed(c.route_reason for c, _ in routed),
    }
    prefill = [c.prefill.worker_id for c, _ in routed if c.prefill is not None]
    if prefill:  # disaggregated: where the prompt's KV was computed
        headers["x-edgeinfer-prefill-worker"] = _listed(prefill)
    return headers


def _listed(values: Iterable[str]) -> str:
    return ", ".join(dict.fromkeys(values))


async def _interleaved(
    streams: list[Events],
) -> AsyncGenerator[tuple[int, list[dict[str, Any]]], None]:
    """The batches of several streams, each with its stream's index, as they come (of one: as
    it is). Closing this cancels the reads under way; the streams are the caller's to close."""
    if len(streams) == 1:
        async for batch in streams[0]:
            yield 0, batch
        return
    reads = {asyncio.ensure_future(anext(s)): p for p, s in enumerate(streams)}
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for read in done:
                p = reads.pop(read)
                try:
                    batch = read.result()
                except StopAsyncIteration:
                    continue
                reads[asyncio.ensure_future(anext(streams[p]))] = p
                yield p, batch
    finally:
        for read in reads:
            read.cancel()
        await asyncio.gather(*reads, return_exceptions=True)


def _count_tokens(call: Call, batch: list[dict[str, Any]]) -> None:
    """The first delta's arrival and each choice's output tokens, for the GenAI metrics (a
    malformed event is the ResponseAssembler's to refuse: it counts nothing here)."""
    for event in batch:
        if event["type"] != "delta":
            continue
        call.first_token = call.first_token or time.perf_counter()
        index, ids = event.get("index"), event.get("token_ids")
        if isinstance(index, int) and isinstance(ids, list):
            call.stream_tokens[index] = call.stream_tokens.get(index, 0) + len(ids)


def _server_timing(call: Call) -> str:
    """Where the time to the first token went: `gateway` is this process's own work on that path
    (validate, route, forward; relay up to the response headers), `worker` the wait for the
    worker's first token (engine queueing and prefill, earlier failed attempts included)."""
    now = time.perf_counter()
    own = (call.forwarded - call.started - call.held_s) + (now - call.answered)
    timing = (
        f"gateway;dur={own * 1000:.3f}, worker;dur={(call.answered - call.forwarded) * 1000:.3f}"
    )
    if call.held_s:
        timing += f", cold-start;dur={call.held_s * 1000:.3f}"
    return timing


def _compiles_grammars(body: object) -> bool:
    """Whether validating `body` compiles grammars (its tools' parameters, a response_format,
    structured outputs): done off the event loop, on a thread (llguidance's compiler runs
    without the GIL), as a large set of tools takes up to a second (90 tools of 200 patterned
    properties in a 0.9 MB body: 0.8-1.1 s), during which every other stream of this gateway
    stalled."""
    return isinstance(body, dict) and any(body.get(k) for k in _GRAMMAR_FIELDS)


def _session_id(request: web.Request) -> str | None:
    value = request.headers.get(SESSION_HEADER)
    if value is None:
        return None
    value = value.strip()
    if not value or len(value) > MAX_SESSION_ID or "{" in value or "}" in value:
        raise invalid(
            SESSION_HEADER,
            f"{SESSION_HEADER} must be 1-{MAX_SESSION_ID} characters without braces",
        )
    if not value.isprintable():  # (bytes that are not UTF-8 arrive as surrogates: not printable)
        raise invalid(
            SESSION_HEADER, f"{SESSION_HEADER} must be printable UTF-8 text, without control "
            "characters",
        )  # fmt: skip
    return value


async def _read_json(request: web.Request, limit: int, timeout_s: float) -> object:
    """The request body as JSON: 413 for a declared or actual size over `limit` (before
    reading, for a declared one; after decompressing, for a gzip or deflate body), 408 for a
    body that does not arrive within `timeout_s` (a client that stops sending holds no
    connection for ever), 415 for a Content-Encoding other than those, 400 for a body that
    cannot be decoded (a corrupt gzip or deflate stream) or is not JSON. `Expect:
    100-continue` is answered here, once the declared size passed; any other Expect is a 417."""
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    expect = request.headers.get("Expect")
    if expect is not None:  # (once auth and the declared size passed: app._expect_later)
        if expect.lower() != "100-continue":
            raise APIError(417, f"Expect {clip(expect)!r} is not supported (only 100-continue)",
                           "invalid_request_error", "Expect", "expectation_failed")  # fmt: skip
        if request.version == aiohttp.HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # (the response proper has not begun: aiohttp's way)
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()  # aiohttp enforces client_max_size (413) while reading
    except web.HTTPRequestEntityTooLarge:
        raise
    except TimeoutError as e:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s",
                       "invalid_request_error", None, "request_timeout") from e  # fmt: skip
    except RequestPayloadError as e:
        cause = e.__cause__ or e
        raise invalid(None, f"the request body cannot be decoded ({cause})", "invalid_body") from e
    raw = _decompressed(raw, request.headers.get("Content-Encoding", ""), limit)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise invalid(None, f"the request body is not valid JSON: {e}", "invalid_json") from e


def _decompressed(raw: bytes, encoding: str, limit: int) -> bytes:
    """A body as it was before its Content-Encoding (runtime.serving.inflate), its faults as
    the gateway's errors: 415, 400 invalid_body, 413."""
    try:
        return inflate(raw, encoding, limit)
    except BodyEncodingError as e:
        if e.status == 415:
            raise unsupported_encoding(e.encoding) from None
        if e.status == 413:
            raise too_large(limit) from None
        raise invalid(None, e.message, "invalid_body") from e


def _failure(e: BaseException) -> str:
    """What went wrong with a worker, in a few words for the client (the full exception goes
    to the gateway's log)."""
    if isinstance(e, aiohttp.ClientConnectorError):
        return "cannot connect"
    if isinstance(e, TimeoutError | aiohttp.ServerTimeoutError):
        return "no answer in time"
    if isinstance(e, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return "the connection broke"
    if isinstance(e, _BAD_URL):
        return "its registered URL is not a valid http(s) URL"
    if isinstance(e, ValueError):
        return "a malformed answer"
    return type(e).__name__


def _prompt_estimate(gen: GenerateRequest) -> int:
    """Rough prompt length in tokens when the gateway did not tokenize: ~4 bytes per token."""
    if isinstance(gen.prompt, list):
        return len(gen.prompt)
    if isinstance(gen.prompt, str):
        return len(gen.prompt) // 4 + 1
    return sum(len(str(m.get("content") or "")) for m in gen.messages or []) // 4 + 1


def _cost(gen: GenerateRequest) -> int:
    """Rough token count of the request (no tokenizer here)."""
    out = gen.sampling.get("max_tokens") or 256
    return (_prompt_estimate(gen) + int(out)) * int(gen.sampling.get("n", 1))


async def _refusal(resp: aiohttp.ClientResponse, worker: WorkerInfo) -> WorkerFailed:
    """What a worker's answer other than 200 means. The request is at fault (400, 404, 413,
    422: no worker would take it): the worker's error is raised, for the client. The worker is
    busy (429, or 503 with Retry-After: its queue or KV cache is full, it drains): another may
    take the request. Otherwise the worker is broken (5xx) or refuses the gateway (401, 403: a
    shared secret that differs, a misconfiguration): it is set aside like a dead one, and the
    client never sees its auth error."""
    try:
        body: object = orjson.loads(await resp.read())
    except (orjson.JSONDecodeError, aiohttp.ClientError):
        body = None
    return _refused(worker, resp.status, body, resp.headers.get("Retry-After"))


def _refused(worker: WorkerInfo, status: int, body: object, retry_after: object) -> WorkerFailed:
    """`_refusal`, of a worker's status, JSON body and Retry-After (None: none given); also of
    an error event that stands for one (kvstore/protocol.py)."""
    err = APIError.from_body(status, body)
    if status == 429 or (status == 503 and retry_after is not None):
        err.retry_after = _seconds(None if retry_after is None else str(retry_after))
        return WorkerFailed(worker, err, dead=False)
    if status < 500 and status not in (401, 403):
        raise err  # the request itself is bad: no other worker will take it either
    if status in (401, 403):
        log.warning("worker %s refused the gateway (HTTP %d: %s): is its --secret the "
                    "gateway's?", worker.worker_id, status, err.message)  # fmt: skip
        err = bad_gateway(f"worker {worker.worker_id} refused the gateway (HTTP {status})",
                          "worker_failed")  # fmt: skip
    elif status not in (502, 503):  # (a worker's 500 is the gateway's 502: a worker failed)
        err.status = 502
    return WorkerFailed(worker, err, dead=True)


def _redis_fault(problem: str | None) -> tuple[str, str]:
    """The view's `redis_problem` ("refused: OutOfMemoryError", cluster._describe) as its kind
    (refused, failed or unreachable; unreachable when none is known) and the error's type."""
    kind, _, error = (problem or "unreachable").partition(": ")
    return kind, error


def _seconds(retry_after: str | None) -> float:
    """A worker's Retry-After in seconds; 1 when it sent none, or no number we can use (an HTTP
    date, garbage, infinity)."""
    try:
        seconds = float(retry_after or 1)
    except ValueError:
        return 1.0
    return seconds if 0 <= seconds <= 3600 else 1.0


def _event_error(event: dict[str, Any]) -> APIError:
    return unavailable(f"worker failed the request: {event.get('message')}", code=event.get("code"))


async def _read_to_end(resp: aiohttp.ClientResponse) -> None:
    """Read what is left of a worker's finished stream (the end of its chunked body, which may
    arrive after the last event), so that its connection goes back to the pool for the next
    request. Left unread, aiohttp closes the connection, and every request paid a new TCP
    connection to its worker (a handshake and the worker's accept, ~0.5-1 ms on the first-token
    path on a 2-vCPU host). A worker that sends nothing more within END_READ_S only loses its
    connection."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
        async with asyncio.timeout(END_READ_S):
            while await resp.content.readany():
                pass
