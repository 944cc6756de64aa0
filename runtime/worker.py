"""The worker process: one engine behind an internal aiohttp API, registered in Redis.

    edgeinfer worker --model DIR --region R --role mixed --port P --redis URL

The API (documented with its messages in kvstore/protocol.py) is for gateways only and needs
the shared secret. The worker registers itself in the Redis registry with its region, model,
role, URL, capacity and load, renews that entry every `heartbeat_s` (so it expires when the
process dies), and on SIGTERM drains: it is marked draining at once (gateways stop sending),
refuses new requests with 503, lets in-flight ones finish (up to `drain_timeout_s`; then it
aborts them, each stream ending with a "shutdown" error event, which a gateway retries elsewhere
while no token has reached its client), deregisters and exits. Losing Redis does not stop a
worker: it serves on and re-registers when Redis is back; nor does it hold up its exit, whose
Redis work has EXIT_REDIS_S in all.
The tokenizer bundle (kvstore/tokenizer_store.py) is published beside the registration, best
effort: a gateway without it routes by load.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import hmac
import logging
import math
import os
import secrets
import signal
import socket
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
from aiohttp import HttpVersion11, web
from opentelemetry import trace
from redis.asyncio import Redis

from kvstore.client import connect, is_refusal, raise_if_cancelling, stop_task
from kvstore.kv_transfer import KVTransferError, ServedPull
from kvstore.prefix_index import CacheEventPublisher, PrefixIndex
from kvstore.protocol import (
    KEEPALIVE,
    KEEPALIVE_S,
    OPERATIONS,
    SECRET_HEADER,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    GenerateRequest,
    PromptDelta,
    Role,
    StartEvent,
    TokenLogprob,
    WorkerInfo,
    encode_event,
)
from kvstore.registry import Registry
from kvstore.telemetry import PROMETHEUS_CONTENT_TYPE, Telemetry, TelemetryConfig
from kvstore.tokenizer_files import TokenizerBundleError
from kvstore.tokenizer_store import publish_tokenizer
from runtime.async_engine import AsyncLLM, EngineDeadError, RequestStream
from runtime.disagg import IMPORT_WAIT_S, KVCacheFullError, KVImporter, export_server
from runtime.engine import LLMEngine, Prompt, RequestGroup
from runtime.lifeline import watch_lifeline
from runtime.outputs import CompletionOutput
from runtime.sampler import TokenLogprobs
from runtime.sampling_params import InvalidRequestError, SamplingParams
from runtime.scheduler import QueueFullError
from runtime.serving import MAX_HEADER_BYTES, MAX_HEADERS, BodyEncodingError, inflate, listen
from runtime.structured import StructuredOutputsParams
from runtime.structured_decoding import RequestGrammar
from runtime.telemetry import RequestTimes, WorkerTelemetry
from runtime.tokenizer import LONG_TEXT_CHARS, NoChatTemplateError, Tokenizer
from runtime.tool_parsers import CONTEXT_TOKENS, PARSERS, RequestTools

log = logging.getLogger("edgeinfer.worker")

ROLES: tuple[Role, ...] = ("prefill", "decode", "mixed")
# All of shutdown's Redis work together (the drain's "draining" mark, leaving the registry and
# the prefix index) gets this long, and none once Redis fails: a hung Redis made each of those
# calls take its client's timeouts in turn (~18 s), and the entries expire by their TTL anyway.
EXIT_REDIS_S = 2.0
IDLE_CONNECTION_S = 120.0  # an idle client connection's life (the gateway pools one 30 s)
WARM_TEMPLATE_AFTER_S = 0.5  # after ready: jinja2's import and the chat template's compile
# A request whose preparation (`_prepare`: a long prompt's tokenization, a grammar's compile)
# takes longer than this begins its stream (200, keepalives) while it goes on: the silence a
# stream's keepalives allow, below any gateway's idle timeout (which is above KEEPALIVE_S).
# Shorter ones (a schema's compile takes milliseconds, a MB of chat ~0.7 s) are answered as
# before, a refusal with its own status.
PREPARE_QUIET_S = KEEPALIVE_S
# The largest request body by default (--max-body-bytes), as sent and once decompressed: far
# above any gateway's sensible --max-body-bytes (its default is 1 MiB), as what a gateway
# forwards (the prompt or the messages and tools, as JSON) can be a little larger than the
# client's body it came from. At 4 MiB, a gateway started with --max-body-bytes 8000000 relayed
# this worker's 413 for a 5 MB completion, naming a limit its client could not know.
MAX_BODY_BYTES = 32 << 20
# The tokenizer bundle in Redis: to write ("pending"; "retrying" once a Redis error is logged),
# written (renewed at each heartbeat), or refused for good (too large, unreadable: logged once,
# never read again).
BundleState = Literal["pending", "retrying", "published", "refused"]


@dataclass(slots=True)
class WorkerConfig:
    model_name: str  # served model name (what clients put in "model")
    region: str  # region name from the catalog
    role: Role  # prefill | decode | mixed
    host: str  # interface to bind
    port: int  # port to bind
    url: str  # internal URL gateways use to reach this worker
    secret: str  # shared secret every internal call must carry
    redis_url: str | None  # cluster state; None runs unregistered (direct use, benchmarks)
    heartbeat_s: float = 2.0  # how often load is published and the registration renewed
    ttl_s: float = 10.0  # registry entry lifetime without a heartbeat
    drain_timeout_s: float = 30.0  # how long SIGTERM waits for in-flight requests
    max_body_bytes: int = MAX_BODY_BYTES  # largest request body, as sent and once decompressed
    kv_port: int = 0  # KV transfer server port (prefill side of disaggregation); 0: a free one
    kv_hold_s: float = 30.0  # how long pulled KV blocks are held for an acknowledgement
    kv_import_wait_s: float = IMPORT_WAIT_S  # how long an import waits for KV room (decode)
    worker_id: str = field(default="")  # unique id; generated when empty
    telemetry: TelemetryConfig | None = None  # traces/metrics export; None: /metrics only
    tool_call_parser: str | None = None  # tool-call format (runtime/tool_parsers.PARSERS);
    # None: the one the chat template points to
    # worker_id was given (--worker-id: a pod's name, a pool's numbering), not drawn at random:
    # an earlier process may have left entries under it (set by __post_init__)
    id_given: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.secret:
            raise ValueError("a shared secret is required (--secret or EDGEINFER_SECRET)")
        if not self.region or "{" in self.region or "}" in self.region:
            raise ValueError(f"invalid region name {self.region!r}")
        if self.heartbeat_s <= 0 or self.ttl_s <= self.heartbeat_s:
            raise ValueError("need 0 < heartbeat_s < ttl_s")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not 0 <= self.kv_port < 65536 or self.kv_hold_s <= 0 or self.kv_import_wait_s < 0:
            raise ValueError("need 0 <= kv_port < 65536, kv_hold_s > 0 and kv_import_wait_s >= 0")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {PARSERS}")
        self.id_given = bool(self.worker_id)
        if not self.worker_id:
            host = socket.gethostname().replace("{", "").replace("}", "")
            self.worker_id = f"{self.region}-{host}-{self.port}-{secrets.token_hex(3)}"


class Worker:
    """The worker's state: engine, configuration, drain flags, and its registry entry."""

    def __init__(
        self, config: WorkerConfig, llm: AsyncLLM, telemetry: Telemetry | None = None
    ) -> None:
        """`telemetry`: where traces and metrics go (tests pass one with in-memory exporters);
        default: as `config.telemetry` says."""
        self.config = config
        self.llm = llm
        tel = telemetry or Telemetry(
            config.telemetry
            or TelemetryConfig("edgeinfer-worker", config.region, instance=config.worker_id)
        )
        self.telemetry = WorkerTelemetry(tel, config.worker_id, config.region, config.model_name)
        self.tokenizer: Tokenizer = llm.engine.tokenizer
        self.stopping = False  # leaving for good (SIGTERM, a dead rank); nothing clears it
        self.cut_off = False  # the drain timed out: streams still served end with an error
        self.serving: set[str] = set()  # ids of the requests whose streams handlers serve
        # disaggregated requests pulling their prompt's KV (no engine stream yet): their
        # handlers, which an abort (or a drain that ran out) cancels
        self.pulling: dict[str, asyncio.Task[Any]] = {}
        self._changing_role = False  # a role change is draining the old role's work
        self.preparing = 0  # requests being prepared on threads, not yet in the engine (busy)
        self.started_at = time.time()
        self.last_active_at = self.started_at  # a request arrived (or was in flight: info())
        self._tokens: dict[int, tuple[str, list[int]]] = {}  # id -> token_of(id)
        self._anchor: list[int] | None = None
        self._anchor_text = ""
        self._registry: Registry | None = None
        self._redis: Redis | None = None
        self._bundle: BundleState = "pending"
        self._registered = False  # a heartbeat has written the registry entry once
        self._expired_stalled = False  # renewals skipped while the engine was stalled
        self._renewed_at = 0.0  # time.monotonic() of the last renewal Redis took
        self._publishing = asyncio.Lock()  # one registry write at a time (heartbeat, role, drain)
        self._left = False  # deregistered for good: no registry write any more
        self._heartbeat: asyncio.Task[None] | None = None  # heartbeat_loop, while the app runs
        self.publisher: CacheEventPublisher | None = None  # the prefix cache's events to Redis
        self._redis_ok = True  # the last registry write (or shutdown's Redis call) worked
        self._exit_redis_s = EXIT_REDIS_S  # what is left of shutdown's time for Redis
        # a step of shutdown's Redis work failed (not a heartbeat: Redis may be back since)
        self._exit_failed = False
        self.kv_server = export_server(llm, config.secret, config.kv_hold_s, self._served)
        self.importer = KVImporter(llm, config.secret, self.telemetry, config.kv_import_wait_s)
        self.telemetry.watch(
            llm.stats, lambda: self.kv_server.bytes_sent, lambda: self.importer.bytes
        )
        self.kv_addr = ""  # set once the KV transfer server listens
        self._role_change: asyncio.Lock = asyncio.Lock()

    def _served(self, s: ServedPull) -> None:
        """A pull this worker served as the prefill side: its span and duration."""
        times = None
        if s.arrival_time:
            times = RequestTimes(s.started, arrival=s.arrival_time, scheduled=s.scheduled_time,
                                 first_token=s.prefilled, ended=s.prefilled)  # fmt: skip
        self.telemetry.served(
            s.pull.traceparent, s.pull.request_id, s.started, s.bytes, s.ok, times
        )

    # ------------------------------------------------------------------ load and registry
    @property
    def draining(self) -> bool:
        """Refusing new work (gateways see it in the registry): stopping or changing roles."""
        return self.stopping or self._changing_role

    def info(self) -> WorkerInfo:
        s = self.llm.stats()
        if self.busy():
            self.last_active_at = time.time()
        return WorkerInfo(
            worker_id=self.config.worker_id,
            region=self.config.region,
            model=self.config.model_name,
            role=self.config.role,
            url=self.config.url,
            max_num_seqs=self.llm.engine.config.max_num_seqs,
            capacity_tokens=s["capacity_tokens"],
            running=s["running"],
            waiting=s["waiting"],
            load_tokens=s["load_tokens"],
            kv_addr=self.kv_addr,
            prefill_tokens=s["prefill_tokens"],
            decode_seqs=s["decode_seqs"],
            free_kv_blocks=s["free_kv_blocks"],
            total_kv_blocks=s["total_kv_blocks"],
            draining=self.draining,
            cache_id=self.llm.engine.cache_id,
            block_size=self.llm.engine.config.block_size,
            started_at=self.started_at,
            last_active_at=self.last_active_at,
            updated_at=time.time(),
            heartbeat_s=self.config.heartbeat_s,
        )

    async def publish(self) -> None:
        """Renew the registry entry with the current load (not after `leave`); logs (once) while
        Redis is down. The tokenizer bundle goes first the first time (a gateway that sees the
        worker can then tokenize for it: routing by load meanwhile cost early prefix hits), and
        after each renewal (which renews its TTL, or stores it again if it is gone); its failure
        never keeps the worker unregistered."""
        if self._registry is None or self.llm.is_stalled():  # (a hung engine: let it expire)
            return
        async with self._publishing:
            if self._left:
                return
            first = not self._registered
            if first:
                await self._publish_bundle()
            try:
                created = await self._registry.heartbeat(self.info())
                since = time.monotonic() - self._renewed_at
                if created and self._registered:  # Redis lost our entry: lost the rest too?
                    if self._expired_stalled:
                        why = "it expired while the engine was stalled"
                    elif since > self.config.ttl_s:  # (SIGSTOP, a frozen VM, a starved CPU)
                        why = (f"it expired: this worker last renewed it {since:.1f}s ago, past "
                               f"its {self.config.ttl_s:g}s ttl; was the process paused?")  # fmt: skip
                    else:
                        why = "Redis restarted or flushed?"
                    log.warning("registry entry was gone (%s): publishing the tokenizer and "
                                "the prefix cache's blocks again", why)  # fmt: skip
                    if self._bundle == "published":  # (a failure to write it is news again)
                        self._bundle = "pending"
                    if self.publisher is not None:
                        self.publisher.resync()
                self._registered = True
                self._expired_stalled = False
                self._renewed_at = time.monotonic()
            except Exception as e:  # redis errors, timeouts, connection refused
                if self._redis_ok:
                    if is_refusal(e):  # (OOM, READONLY, NOPERM, MISCONF: it answers)
                        log.warning("redis refused the heartbeat, serving on (the registry "
                                    "keeps this worker's last entry until it expires): %s: %s",
                                    type(e).__name__, e)  # fmt: skip
                    else:
                        log.warning("redis unreachable, serving on unregistered: %s", e)
                self._redis_ok = False
                return
            if not self._redis_ok:
                log.warning("redis is back; registration renewed")
            self._redis_ok = True
            if not first:  # (the first renewal tried it just before: next time)
                await self._publish_bundle()

    async def _publish_bundle(self) -> None:
        """Store the tokenizer bundle gateways tokenize with unless it is there, and renew its
        TTL (a week: one PEXPIRE a heartbeat keeps it while any worker uses it; the files are
        read and sent only when it is missing). A bundle that cannot be stored (too large, a
        file unreadable) is reported once and never tried again; a Redis error is tried again
        at the next heartbeat."""
        if self._redis is None or self._bundle == "refused":
            return
        engine = self.llm.engine
        try:
            await publish_tokenizer(
                self._redis, self.config.model_name, engine.cache_id, Path(engine.config.model)
            )
        except (TokenizerBundleError, FileNotFoundError) as e:  # the files: trying cannot help
            log.warning("tokenizer bundle not published, so gateways route %r by load, not by "
                        "prefix-cache hits: %s", self.config.model_name, e)  # fmt: skip
            self._bundle = "refused"
        except Exception as e:  # redis errors, timeouts
            if self._bundle == "pending":
                log.warning("tokenizer bundle not published yet (%s: %s); trying again at each "
                            "heartbeat", type(e).__name__, e)  # fmt: skip
            if self._bundle != "published":  # (a failed renewal: the next heartbeat renews)
                self._bundle = "retrying"
        else:
            if self._bundle == "retrying":
                log.warning("tokenizer bundle published")
            self._bundle = "published"

    async def heartbeat_loop(self) -> None:
        stalled = False
        while True:
            if self.llm.is_stalled():  # a hung engine: let the entry expire, no new work
                if not stalled:
                    log.error("the engine has made no progress for %.0f s (a hung step?): "
                              "not renewing the registry entry", self.llm.stalled_s())  # fmt: skip
                stalled = self._expired_stalled = True
            else:
                if stalled:
                    log.warning("the engine is making progress again")
                stalled = False
                await self.publish()
            raise_if_cancelling()
            await asyncio.sleep(self.config.heartbeat_s)

    async def leave(self) -> None:
        """Leave the registry for good (once: a second call does nothing): with the heartbeat
        stopped and after the registry write in flight, if any, so that nothing writes the entry
        again (a role change ending now included: it would list a worker on its way out as
        taking work). Its Redis work is shutdown's (`on_exit`)."""
        if self._registry is None or self._left:
            return
        self._left = True  # (no registry write starts any more: `publish` looks)
        if self._heartbeat is not None:
            await stop_task(self._heartbeat)
        registry, wid, model = self._registry, self.config.worker_id, self.config.model_name

        async def deregister() -> None:
            async with self._publishing:  # (a role change's write still in flight)
                await registry.deregister(wid, model)

        await self.on_exit("deregister", deregister())

    async def on_exit(self, what: str, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work`, a step of shutdown that talks to Redis, within what is left of
        EXIT_REDIS_S (all of shutdown's steps together); not at all once an earlier step has
        failed (its error, or no answer in time; a heartbeat that failed before does not count:
        Redis may be back). Never raises but a
        cancellation; a step cut short is logged, and the entries it would have written or
        removed expire by their TTL."""
        if self._exit_failed or self._exit_redis_s <= 0:
            work.close()
            log.info("shutdown: %s skipped (redis is failing)", what)
            return
        task = asyncio.ensure_future(work)
        t0 = time.monotonic()
        try:
            await asyncio.wait([task], timeout=self._exit_redis_s)
        finally:
            self._exit_redis_s -= time.monotonic() - t0
            if not task.done():  # (its connection goes with the client's close at exit)
                task.cancel()
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
        if task.done() and not task.cancelled() and task.exception() is None:
            return
        why = "no answer in time" if not task.done() or task.cancelled() else task.exception()
        log.warning("shutdown: %s failed (%s); the rest of shutdown's Redis work is skipped, "
                    "the entries expire by their TTL", what, why)  # fmt: skip
        self._redis_ok = False
        self._exit_failed = True

    def busy(self) -> bool:
        """Requests of any role still in flight: served streams, pulls being served (prefill),
        or imports under way (decode: pulling a prompt's KV, before their stream exists)."""
        return bool(
            self.llm.num_open_streams
            or self.kv_server.active
            or self.importer.active
            or self.preparing
        )

    async def _wait_idle(self, deadline: float | None = None) -> bool:
        """Wait until no work of any role is in flight, up to `deadline` (monotonic; default:
        `drain_timeout_s` from now); True if none."""
        if deadline is None:
            deadline = time.monotonic() + self.config.drain_timeout_s
        while self.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.busy()

    async def change_role(self, role: Role) -> float:
        """Switch roles while running: stop taking work (gateways see `draining`), let the old
        role's work finish (up to `drain_timeout_s`), switch, take work again. Returns the
        seconds spent draining."""
        if role not in ROLES:
            raise InvalidRequestError("role", f"must be one of {ROLES}, got {role!r}")
        t0 = time.monotonic()
        self._changing_role = True
        try:  # (a caller that hangs up during this write, Redis slow, left it draining for good)
            await self.publish()
            if not await self._wait_idle():
                raise TimeoutError(
                    f"work of role {self.config.role!r} still running after "
                    f"{self.config.drain_timeout_s:.0f}s; role unchanged"
                )
            log.warning("role %s -> %s", self.config.role, role)
            self.config.role = role
        finally:
            self._changing_role = False  # (still draining if stopping meanwhile)
            await self.publish()
        return time.monotonic() - t0

    async def drain(self) -> None:
        """Refuse new requests, let running ones finish (up to `drain_timeout_s`), then leave the
        registry. Requests still running then are aborted (their KV blocks freed before the
        engine's next step); each handler ends its stream with a "shutdown" error event."""
        self.stopping = True
        deadline = time.monotonic() + self.config.drain_timeout_s  # (from SIGTERM, not from
        await self.on_exit("marking the worker draining", self.publish())  # the Redis write)
        if not await self._wait_idle(deadline):
            log.warning("drain timeout: aborting %d requests", len(self.serving))
            self.cut_off = True
            for rid in self.serving:
                self.llm.abort(rid)
            for task in self.pulling.values():  # (the gateway retries them elsewhere)
                task.cancel()
        await self.leave()

    # ------------------------------------------------------------------ requests
    def prompt_of(self, req: GenerateRequest) -> Prompt:
        if req.messages is not None:
            if req.prompt is not None:
                raise InvalidRequestError("messages", "give either messages or prompt, not both")
            try:
                text = self.tokenizer.apply_chat_template(
                    req.messages, add_generation_prompt=True, tools=req.tools
                )
            except NoChatTemplateError as e:
                raise InvalidRequestError(
                    "messages",
                    f"model {self.config.model_name!r} has no chat template; use /v1/completions",
                ) from e
            except InvalidRequestError:
                raise  # (the template's raise_exception(): its message as it is)
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(
                    "messages", f"the chat template rejected them: {e}"
                ) from e
            return self.tokenizer.encode(text, add_special_tokens=False)
        if req.prompt is None:
            raise InvalidRequestError("prompt", "give a prompt or messages")
        return req.prompt

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        """The request's prompt as token ids (InvalidRequestError as `prompt_of`); safe to call
        from another thread."""
        prompt = self.prompt_of(req)
        return self.llm.engine.tokenize_prompt(prompt) if isinstance(prompt, str) else prompt

    def token_of(self, token_id: int) -> tuple[str, list[int]]:
        """A token as logprobs show it: its text and its bytes (which add up to the output's
        UTF-8). The text keeps its leading space: decoded after an anchor token, which is then
        cut off (decoding a lone token drops the space SentencePiece-style decoders strip). A
        token that holds part of a character has bytes that are not UTF-8 by themselves; its
        text is then those bytes escaped, "bytes:\\xf0\\x9f", as OpenAI writes it, so that
        alternatives stay apart (not all one U+FFFD)."""
        known = self._tokens.get(token_id)
        if known is not None:
            return known
        tok = self.tokenizer
        if self._anchor is None:
            self._anchor = tok.encode("a", add_special_tokens=False)[-1:]
            self._anchor_text = tok.decode(self._anchor, skip_special_tokens=False)
        both = tok.decode([*self._anchor, token_id], skip_special_tokens=False)
        if both.startswith(self._anchor_text):
            text = both[len(self._anchor_text) :]
        else:
            text = tok.decode([token_id], skip_special_tokens=False)
        raw = tok.token_bytes(token_id)
        if raw is None:
            raw = text.encode()
        try:
            raw.decode()
        except UnicodeDecodeError:
            text = "bytes:" + raw.decode(errors="backslashreplace")
        known = self._tokens[token_id] = text, list(raw)  # (shared: events only serialize it)
        return known

    def logprobs_of(self, lps: list[TokenLogprobs]) -> list[TokenLogprob]:
        out = []
        for lp in lps:
            top = []
            for i, v in lp.top:
                t, b = self.token_of(i)
                top.append({"token": t, "logprob": v, "bytes": b})
            text, raw = self.token_of(lp.token_id)
            out.append(TokenLogprob(text, lp.logprob, raw, top))
        return out


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> web.Response:  # fmt: skip
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )


WORKER = web.AppKey("worker", Worker)


@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    worker = request.app[WORKER]
    if request.path == "/metrics":  # Prometheus scrapes without the secret
        return await handler(request)
    # (bytes that are not UTF-8 arrive as surrogates: compared as the bytes sent, as the
    # gateway's _auth compares API keys; encoded strictly, they raised: a 500 and a traceback)
    given = request.headers.get(SECRET_HEADER, "").encode(errors="surrogateescape")
    if not hmac.compare_digest(given, worker.config.secret.encode(errors="surrogateescape")):
        return _error(401, "missing or wrong shared secret", "authentication_error")
    return await handler(request)


@web.middleware
async def _body_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """A body the worker will not read (over `max_body_bytes`, declared or as read or once
    decompressed; an `Expect` other than 100-continue; a Content-Encoding other than gzip and
    deflate) or cannot decode gets the worker's JSON error, not aiohttp's text/plain one or a
    500."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[WORKER].config.max_body_bytes
        return _error(413, f"request body is larger than the worker's limit of {limit} bytes "
                      "(edgeinfer worker --max-body-bytes)", "invalid_request_error", None,
                      "request_too_large")  # fmt: skip
    except _BadBody as e:
        return _error(e.status, str(e), "invalid_request_error", e.param, e.code)
    except web.RequestPayloadError as e:  # (its cause: aiohttp's error, with a message)
        why = getattr(e.__cause__, "message", e)
        return _error(400, f"the request body cannot be decoded: {why}", "invalid_request_error",
                      None, "invalid_body")  # fmt: skip


class _BadBody(Exception):
    """A request body `_body` will not read or cannot decode: `_body_errors` answers it."""

    def __init__(self, status: int, message: str, param: str | None, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


async def _expect_later(request: web.Request) -> None:
    """aiohttp answers `Expect` ahead of the middlewares: 100 Continue to a caller whose secret
    or declared body size were then refused, a text/plain 417 to any other expectation, and a
    500 (with a traceback in the log) to one that is not ASCII, before any secret was asked
    for. `_body` answers it instead, as the gateway's proxy does (gateway/app.py)."""


async def _body(request: web.Request) -> bytes:
    """The request body, decoded (the server runs with auto_decompress off: aiohttp answered an
    encoding it lacks a module for, br or zstd, in plain text before the app saw the request,
    and passed an unknown one on undecoded). `Expect: 100-continue` is answered here, once auth
    and the declared size passed; any other expectation is a 417. Over `max_body_bytes`
    (declared, as read, or once decompressed: at most that + 1 bytes are ever inflated):
    HTTPRequestEntityTooLarge; else _BadBody (a 415 for a Content-Encoding other than gzip and
    deflate, a 400 for one that does not decode)."""
    limit = request.app[WORKER].config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    expect = request.headers.get("Expect")
    if expect is not None:
        if expect.lower() != "100-continue":
            raise _BadBody(417, f"Expect {_clip(expect)!r} is not supported (only 100-continue)",
                           "Expect", "expectation_failed")  # fmt: skip
        if request.version == HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # (the response proper has not begun: aiohttp's way)
    raw = await request.read()  # (aiohttp enforces client_max_size while reading)
    encoding = request.headers.get("Content-Encoding", "")
    try:
        return inflate(raw, encoding, limit)
    except BodyEncodingError as e:
        if e.status == 413:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=e.size) from None
        if e.status == 415:
            raise _BadBody(415, f"Content-Encoding {_clip(e.encoding)!r} is not supported; send "
                           "the body uncompressed, or as gzip or deflate", "Content-Encoding",
                           "unsupported_encoding") from None  # fmt: skip
        raise _BadBody(400, e.message, None, "invalid_body") from e


def _clip(text: str, limit: int = 64) -> str:
    """A caller's header value, cut short for a message, which repr()s it: a byte that is not
    UTF-8 arrives as a surrogate, which the JSON answer cannot hold as it is."""
    return text if len(text) <= limit else f"{text[:limit]}..."


async def _no_route(request: web.Request) -> web.Response:
    """Any other path, or method: a JSON 404 or 405, after auth (aiohttp's are text/plain). Its
    catch-all route gives every request `_expect_later`: aiohttp's own expect handler, which
    runs for a path no route takes, would answer `Expect: \\xff` there with a 500."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not request.match_info.route.resource:
            allowed |= (await resource.resolve(request))[1]
    if allowed:
        return _error(405, f"method {_clip(request.method)!r} is not allowed here (allowed: "
                      f"{', '.join(sorted(allowed))})", "invalid_request_error",
                      headers={"Allow": ", ".join(sorted(allowed))})  # fmt: skip
    return _error(404, f"no such endpoint: {_clip(request.path)!r}", "not_found_error")


async def _generate(request: web.Request) -> web.StreamResponse:
    worker = request.app[WORKER]
    times = RequestTimes(time.monotonic())
    worker.last_active_at = time.time()
    if worker.draining:
        return _error(503, "worker is draining", "service_unavailable", code="draining",
                      headers={"Retry-After": "1"})  # fmt: skip
    try:
        req = _request_of(orjson.loads(await _body(request)))
    except InvalidRequestError as e:
        return _error(400, str(e), "invalid_request_error", e.param, e.code)
    except (orjson.JSONDecodeError, TypeError, ValueError) as e:
        return _error(400, f"bad generate request: {e}", "invalid_request_error")
    if req.model != worker.config.model_name:
        return _error(404, f"this worker serves {worker.config.model_name!r}, not {req.model!r}",
                      "not_found_error", "model", "model_not_found")  # fmt: skip
    tel = worker.telemetry
    span = tel.start(request.headers, req, worker.config.role)
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    quiet = _Keepalive(resp, worker.llm.is_stalled)
    # Being prepared on threads (a long prompt, a grammar) it is work in flight: a drain or a
    # role change waits for it, and it is refused after if one began (served under the new
    # role, or past a drain that had counted nothing, it was before)
    worker.preparing += 1
    try:
        params, tools, grammar = await _prepare_begun(request, resp, quiet, worker, req)
    except (asyncio.CancelledError, ConnectionError) as e:  # (the client left)
        quiet.stop()
        tel.finish(span, req, times, None, "client_gone")
        if isinstance(e, ConnectionError):
            return resp
        raise
    except _Refused as r:
        tel.finish(span, req, times, None, r.code)
        return await _refuse(resp, quiet, r)
    except Exception:  # a bug: answered 500 (or its begun stream cut short), and its span
        quiet.stop()  # ended (it was never exported)
        tel.finish(span, req, times, None, "internal_error")
        raise
    finally:
        worker.preparing -= 1
    if worker.draining:
        tel.finish(span, req, times, None, "draining")
        return await _refuse(resp, quiet, _Refused(503, "worker is draining",
                             "service_unavailable", code="draining", retry=True))  # fmt: skip
    try:
        taken = _accept(worker, req, params, grammar)
    except _Refused as r:
        tel.finish(span, req, times, None, r.code)
        return await _refuse(resp, quiet, r)
    except Exception:  # (as above)
        quiet.stop()
        tel.finish(span, req, times, None, "internal_error")
        raise
    if isinstance(taken, RequestStream):
        stream = taken
        times.arrival = time.monotonic()  # (its queue span's start, should it never run)
    else:
        assert req.kv_source is not None
        if req.request_id in worker.pulling:  # (refused by the engine, it took the place of the
            # one pulling, whose abort, or a drain's cut, then missed it)
            dup = _Refused.of(
                InvalidRequestError("request_id", f"{req.request_id!r} is already in use")
            )
            tel.finish(span, req, times, None, dup.code)
            return await _refuse(resp, quiet, dup)
        ctx = trace.set_span_in_context(span)
        task = asyncio.current_task()
        assert task is not None
        worker.pulling[req.request_id] = task
        try:
            stream = await _pull(request, resp, quiet, worker, taken, req.kv_source, ctx, times)
        except _Refused as r:  # the stream began: the refusal is its one event
            quiet.stop()
            with contextlib.suppress(ConnectionError):
                await resp.write(encode_event(r.event()))
            tel.finish(span, req, times, None, r.code)
            return resp
        except BaseException as e:  # the gateway hung up (its client left) during the pull, or
            quiet.stop()  # the request was aborted
            tel.finish(span, req, times, None, "client_gone")
            if isinstance(e, ConnectionError):
                return resp
            raise
        finally:
            if worker.pulling.get(req.request_id) is task:
                del worker.pulling[req.request_id]
    if tools is not None:  # what the output's text follows (to place a marker token's text)
        tools.context = stream.prompt_token_ids[-CONTEXT_TOKENS:]
    worker.serving.add(req.request_id)
    n_prompt = len(stream.prompt_token_ids)
    generated, cached = 0, 0
    error: str | None = "client_gone"
    aborted: str | None = None  # "aborted": the engine ended a completion with finish_reason abort
    texts: list[str] = []
    answered = False  # every completion ended at its call and the done event went out
    try:
        await resp.prepare(request)  # (done already when disaggregated: a no-op then)
        await resp.write(
            encode_event(StartEvent(req.request_id, worker.config.worker_id, n_prompt))
        )
        quiet.start()
        done: set[int] = set()
        sent: dict[int, int] = {}  # per completion: logprobs sent so far
        prompt_sent = False  # prompt_logprobs asked for: sent with the first delta (PromptDelta)
        outputs: dict[int, str] = {}  # per completion: its text where it ended (telemetry's)
        async for out in stream:
            if worker.cut_off:  # the drain timed out and aborted it: no answer, the error below
                raise _ShuttingDown("worker is shutting down (its drain timed out)")
            cached = out.num_cached_tokens
            times.arrival, times.scheduled = out.arrival_time, out.scheduled_time
            times.longest_output = max(len(o.token_ids) for o in out.outputs)  # TPOT's count
            lines, at_call = [], []
            for o in out.outputs:
                if o.finish_reason == "error":  # its constraint failed: no answer to give
                    spec = params.structured_outputs  # (the client's field it came from)
                    raise _ConstraintFailed(f"the output constraint failed: {o.stop_reason}",
                                            getattr(spec, "param", None))  # fmt: skip
                if o.finish_reason == "abort":  # (answered, but no success: the gateway
                    aborted = "aborted"  # answers 503 aborted)
                ended = o.index in done
                event = _delta(worker, o, done, sent, tools)
                if not ended and o.index in done:
                    outputs[o.index] = o.text
                    if not o.finished:  # it ended at its one call, before the engine ended it
                        at_call.append(o.index)
                if event is not None:
                    if not prompt_sent and out.prompt_logprobs is not None:
                        event = _with_prompt(worker, event, out.prompt_token_ids,
                                             out.prompt_logprobs)  # fmt: skip
                        prompt_sent = True
                    generated += len(event.token_ids)
                    lines.append(encode_event(event))
            if generated and not times.first_token:
                times.first_token = time.monotonic()
            if at_call:  # (run on the engine thread, in order with its outputs: not awaited)
                worker.llm.call(functools.partial(LLMEngine.end_at_next_token,
                                                  request_id=req.request_id, indices=at_call))
            if lines:
                quiet.wrote()
                await resp.write(b"".join(lines))
            if out.finished or len(done) == len(out.outputs):  # (or ended at their one call)
                texts = [outputs.get(o.index, o.text) for o in out.outputs]
                break
        times.ended = time.monotonic()
        await resp.write(encode_event(DoneEvent(n_prompt, generated, cached)))
        error = aborted
        if not stream.finished:  # its completions ended at their calls, answered: the engine
            # ends them at their next token (end_at_next_token); read on till then. The stream
            # closed unfinished would abort the request, counted as its client having gone
            # (num_aborted), which it is not even if the gateway goes now: left to the engine
            answered = True
            quiet.stop()  # (nothing follows the done event)
            # The body ends here, not after that step: the gateway reads a worker's body to its
            # end before it answers (its client's [DONE], or the whole answer, waited for the
            # step). Nothing writes to it after: the keepalives are stopped, the read below ends
            # with EngineDeadError at worst, and a bug's error event (`except Exception`) is a
            # RuntimeError there, suppressed
            with contextlib.suppress(ConnectionError):
                await resp.write_eof()
            with contextlib.suppress(EngineDeadError):
                async for _ in stream:
                    pass
    except (EngineDeadError, QueueFullError, _ConstraintFailed) as e:  # after the stream started
        error = ("shutdown" if isinstance(e, _ShuttingDown) else
                 "queue_full" if isinstance(e, QueueFullError) else
                 "constraint_failed" if isinstance(e, _ConstraintFailed) else "engine_dead")  # fmt: skip
        with contextlib.suppress(ConnectionError):
            param = e.param if isinstance(e, _ConstraintFailed) else None
            await resp.write(encode_event(ErrorEvent(str(e), error, param=param)))
    except InvalidRequestError as e:  # the engine refused it on its thread, after the stream
        # began (an id still held by a KV import or export): the refusal is its last event
        refused = _Refused.of(e)
        error = refused.code
        with contextlib.suppress(ConnectionError):
            await resp.write(encode_event(refused.event()))
    except ConnectionError:  # the gateway hung up (its client left): `finally` aborts it
        pass
    except Exception as e:  # a bug: the stream ends with an error event, which the gateway
        # answers (or retries elsewhere while nothing reached its client); the stream was cut
        # short instead, the gateway took this worker for broken, and it was counted as the
        # client having gone
        log.exception("request %s failed", req.request_id)
        error = "internal_error"
        with contextlib.suppress(ConnectionError, RuntimeError):  # (RuntimeError: unprepared)
            await resp.write(encode_event(ErrorEvent(f"the worker failed: {e!r}"[:500])))
    finally:
        quiet.stop()
        worker.serving.discard(req.request_id)
        if not answered:
            stream.close()  # no-op when finished; frees the blocks when the client went away
        tel.finish(span, req, times, (n_prompt, generated, cached), error, texts or None)
    return resp


class _Keepalive:
    """Writes protocol.KEEPALIVE on a stream that has been silent for KEEPALIVE_S (a request
    queued or prefilling), so that the gateway can tell a busy worker from a hung one.

    A timer on the event loop, not a task per request: a cancelled task leaves a reference cycle
    (task, CancelledError, traceback, frame) holding the response, and at ~400 requests/s those
    cycles made the collector's full passes take 5-9 ms every ~2 s, stalling the engine's loop."""

    def __init__(self, resp: web.StreamResponse, stalled: Callable[[], bool]) -> None:
        self._resp = resp
        self._stalled = stalled  # the engine is hung: say nothing, so the gateway times out
        self._last = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._writing: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Count silence from now (again, when already started: disaggregated, the KV pull)."""
        self._last = time.monotonic()
        if self._timer is None:
            self._arm(KEEPALIVE_S)

    def wrote(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._writing is not None and not self._writing.done():
            self._writing.cancel()

    def _arm(self, delay: float) -> None:
        self._timer = asyncio.get_running_loop().call_later(delay, self._tick)

    def _tick(self) -> None:
        now = time.monotonic()
        due = self._last + KEEPALIVE_S
        if now >= due and (self._writing is None or self._writing.done()) and not self._stalled():
            self._last = now
            self._writing = asyncio.ensure_future(self._write())
            due = now + KEEPALIVE_S
        self._arm(max(due - now, 0.05))

    async def _write(self) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):  # (the stream has ended)
            await self._resp.write(KEEPALIVE)


class _Refused(Exception):
    """The engine cannot take a request: the response that says why, and its error code."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None,
                 code: str | None = None, retry: bool = False) -> None:  # fmt: skip
        super().__init__(message)
        headers = {"Retry-After": "1"} if retry else None
        self.response = _error(status, message, kind, param, code, headers)
        self.error = {"message": message, "type": kind, "param": param, "code": code}
        self.code = code or kind
        self.status = status
        self.retry = retry

    @classmethod
    def of(cls, e: Exception) -> _Refused:
        """One of _REFUSALS as the response that says why, with its code."""
        if isinstance(e, KVCacheFullError):  # before any byte moved: another decode worker
            # may have room
            return cls(503, str(e), "service_unavailable", None, "kv_cache_full", True)
        if isinstance(e, KVTransferError) and not e.source_failed:  # the prefill worker
            # refused the pull (its KV cache or queue full, ...): prefill elsewhere, but it is
            # not failing
            return cls(503, str(e), "service_unavailable", "kv_source", "kv_source_refused", True)
        if isinstance(e, KVTransferError):  # the prefill side failed: prefill again elsewhere
            return cls(502, str(e), "bad_gateway", "kv_source", "kv_transfer_failed")
        if isinstance(e, InvalidRequestError):
            return cls(400, str(e), "invalid_request_error", e.param, e.code)
        if isinstance(e, QueueFullError):
            return cls(429, str(e), "rate_limit_error", None, "queue_full", True)
        return cls(503, str(e), "service_unavailable", None, "engine_dead")  # EngineDeadError

    def event(self) -> ErrorEvent:
        """The refusal as the one event of a stream already begun (a disaggregated request's,
        answered before its KV pull): its code, status and Retry-After, which the gateway takes
        as if the worker had answered them (gateway/proxy.py `_refused`)."""
        return ErrorEvent(str(self), self.code, status=self.status,
                          retry_after=1.0 if self.retry else None, error=self.error)  # fmt: skip


# what the engine (and a disaggregated request's KV import) refuses a request with: _Refused.of
_REFUSALS = (KVCacheFullError, KVTransferError, InvalidRequestError, QueueFullError,
             EngineDeadError)  # fmt: skip


class _ShuttingDown(EngineDeadError):
    """The worker aborted a request it was serving: its drain timed out."""


class _ConstraintFailed(Exception):
    """A completion's grammar failed mid-request (a limit of llguidance's): its output is not
    what the constraint asked for, so the request fails with an error event (code
    "constraint_failed", naming the client's field `param`) rather than finish "stop"."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


async def _prepare_begun(
    request: web.Request, resp: web.StreamResponse, quiet: _Keepalive, worker: Worker,
    req: GenerateRequest,
) -> tuple[SamplingParams, RequestTools | None, RequestGrammar | None]:  # fmt: skip
    """The request's sampling parameters, tools and grammar (`_parameters`, then `_prepare`
    for what may take long). When that takes longer than PREPARE_QUIET_S (a large grammar's
    compile takes seconds), the stream begins (200, then keepalives), as a disaggregated
    request's does while its KV is pulled, so that the gateway's idle timeout tells it from a
    hung worker. Before, a compile longer than that timeout (10 s) was taken for a failed
    worker and sent again to each of the gateway's attempts, every one of them compiling it
    anew, and the client got 503 worker_failed. A refusal after the stream began is its one
    event (`_refuse`), with the status it stands for: the gateway answers it as it would have.
    A request with nothing to do off the loop (short text, no grammar: most) takes no task
    and no wait (a task and its timed wait cost every request ~10 us, more under load)."""
    params, tools = _parameters(worker, req)
    long_text = req.text_chars() > LONG_TEXT_CHARS
    if not long_text and params.structured_outputs is None:
        return params, tools, None
    job = asyncio.ensure_future(_prepare(worker, req, params, long_text))
    try:
        done, _ = await asyncio.wait({job}, timeout=PREPARE_QUIET_S)
        if not done:
            await resp.prepare(request)
            await resp.write(KEEPALIVE)  # (the headers go out with it)
            quiet.start()
        return params, tools, await job
    except BaseException:  # (the client left, or the refusal: then done already)
        job.cancel()
        raise


async def _refuse(resp: web.StreamResponse, quiet: _Keepalive, r: _Refused) -> web.StreamResponse:
    """The refusal `r`: its response, or, when the stream has begun (`_prepare_begun`), its
    one event."""
    if not resp.prepared:
        return r.response
    quiet.stop()
    with contextlib.suppress(ConnectionError):
        await resp.write(encode_event(r.event()))
    return resp


def _parameters(
    worker: Worker, req: GenerateRequest
) -> tuple[SamplingParams, RequestTools | None]:
    """The request's sampling parameters (with the grammar of a required or named tool_choice)
    and its tools (None without). _Refused when the request cannot be taken."""
    try:
        tools = RequestTools.of(req.tools, req.tool_choice, req.parallel_tool_calls,
                                worker.tokenizer, worker.config.tool_call_parser)  # fmt: skip
        params = _sampling_params(req.sampling)
        if tools is not None:
            tools.constrain(params)  # tool_choice required / named: a grammar
    except _REFUSALS as e:
        raise _Refused.of(e) from e
    return params, tools


async def _prepare(
    worker: Worker, req: GenerateRequest, params: SamplingParams, long_text: bool
) -> RequestGrammar | None:
    """What may take long before `_accept`, on threads, not the loop: a long prompt
    (`long_text`) rendered and tokenized (without the GIL: Tokenizer.encode; a MB of chat held
    every stream and probe of the worker ~0.7 s, a chat the gateway did not tokenize: a region
    of one worker), and the request's grammar compiled (llguidance compiles without the GIL,
    and a regex's lexer, `(a{1000}){1000}`, takes ~0.7 s; the first also builds the
    tokenizer's, ~0.3-0.5 s at a 49k vocabulary). Returns the grammar, which `_accept` hands to
    the engine: the compiler's cache may have dropped it since (it keeps only ~2 s of compiles,
    the newest whatever its cost), and a compile in `_accept` would hold the loop, every stream
    and probe of the worker, for seconds. _Refused when the request cannot be taken."""
    try:
        if long_text:
            req.prompt, req.messages = await asyncio.to_thread(worker.prompt_ids, req), None
        if params.structured_outputs is None:
            return None
        spec = StructuredOutputsParams.coerce(params.structured_outputs)
        return await asyncio.to_thread(
            worker.llm.engine.grammars.grammar, spec, "structured_outputs"
        )
    except _REFUSALS as e:
        raise _Refused.of(e) from e


def _accept(
    worker: Worker, req: GenerateRequest, params: SamplingParams, grammar: RequestGrammar | None
) -> RequestStream | RequestGroup:
    """Take the prepared request (`_prepare`, its `grammar` compiled there): handed to the
    engine (its stream) or, disaggregated, checked and prepared for its KV pull (its group, for
    `_pull`). _Refused when it cannot be taken."""
    try:
        prompt = worker.prompt_of(req)
        # (prompt logprobs need the prompt's logits: its KV pulled from a prefill worker has
        # none, so such a request is computed here, its kv_source left unused)
        if req.kv_source is None or params.prompt_logprobs is not None:
            return worker.llm.submit(prompt, params, req.request_id, grammar=grammar)
        # disaggregated: the prompt's KV comes from a prefill worker
        return worker.llm.engine.prepare_request(req.request_id, prompt, params, grammar=grammar)
    except _REFUSALS as e:
        raise _Refused.of(e) from e


async def _pull(
    request: web.Request, resp: web.StreamResponse, quiet: _Keepalive, worker: Worker,
    group: RequestGroup, source: str, trace_ctx: Any, times: RequestTimes,
) -> RequestStream:  # fmt: skip
    """Disaggregated: answer 200 at once and pull the prompt's KV from the prefill worker at
    `source` behind keepalives, then queue it; its stream. The gateway so tells a hung decode
    worker from a slow pull (or one waiting for KV room) by its usual idle timeout. A refusal
    of the pull (kv_cache_full, kv_transfer_failed, kv_source_refused, queue_full, ...) is
    _Refused, for the caller to send as the stream's one event, with its status
    (`_Refused.event`); so is any other error of the pull (kv_transfer_failed)."""
    await resp.prepare(request)
    await resp.write(KEEPALIVE)  # (the headers go out with it)
    quiet.start()
    try:
        stream, _ = await worker.importer.submit(group, source, trace_ctx)
    except _REFUSALS as e:
        raise _Refused.of(e) from e
    except Exception as e:  # a bug, here or in what the prefill side sent: a failed transfer
        # (an event, prefilled elsewhere), not a stream cut short that blames this worker
        log.exception("request %s: KV pull from %s failed", group.request_id, source)
        raise _Refused.of(KVTransferError(f"KV pull from {source} failed: {e!r}")) from e
    times.pulled = time.monotonic()
    return stream


# GenerateRequest's text fields, and whether each may be null
_TEXT_FIELDS = (("request_id", False), ("model", False), ("operation", False),
                ("session_id", True), ("kv_source", True))  # fmt: skip


def _request_of(body: Any) -> GenerateRequest:
    """The generate request a JSON body holds: TypeError or ValueError when it is none, an
    InvalidRequestError naming a text field of another type (nothing after this checks them),
    or messages of another shape (`_check_messages`)."""
    req = GenerateRequest.from_dict(body)
    for name, optional in _TEXT_FIELDS:
        value = getattr(req, name)
        if not isinstance(value, str) and not (optional and value is None):
            raise InvalidRequestError(name, f"must be a string, got {type(value).__name__}")
    if req.operation not in OPERATIONS:  # (a label of the worker's metrics: a bounded set)
        raise InvalidRequestError(
            "operation", f"must be one of {OPERATIONS}, got {req.operation!r}"
        )
    if req.kv_source is not None:
        host, _, port = req.kv_source.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise InvalidRequestError(
                "kv_source", f"must be host:port (a port of 1-65535), got {req.kv_source!r}"
            )
    if req.messages is not None:
        _check_messages(req.messages)
    return req


def _check_messages(messages: Any) -> None:
    """Messages as the gateway sends them (gateway/openai_api.py `_messages`, which checks them
    first): a non-empty array of objects, each with a string role and a content that is a
    string, an array of text parts, or (for the assistant: beside its tool calls) null. Any
    other shape went through the chat template, which rendered whatever it was given (a
    string's characters as messages, a number as a role) and the worker generated from it."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(
            "messages", f"must be a non-empty array of messages, got {_type_of(messages)}"
        )
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(where, f"must be an object, got {_type_of(message)}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            raise InvalidRequestError(f"{where}.role", f"must be a string, got {_type_of(role)}")
        if isinstance(content, str) or (content is None and role == "assistant"):
            continue
        if content is None:
            raise InvalidRequestError(f"{where}.content", f"is required for role {role!r}")
        if not isinstance(content, list):
            raise InvalidRequestError(f"{where}.content", "must be a string or an array of text "
                                      f"parts, got {_type_of(content)}")  # fmt: skip
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):  # fmt: skip
                raise InvalidRequestError(f"{where}.content[{j}]", 'must be a text part, '
                                          '{"type": "text", "text": "..."}')  # fmt: skip


def _type_of(value: Any) -> str:
    """A JSON value's type, for a message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array" if value else "an empty array"
    return "an object"


def _sampling_params(sampling: dict[str, Any]) -> SamplingParams:
    """The request's `sampling` object as SamplingParams (InvalidRequestError if it is none)."""
    try:
        return SamplingParams(**sampling)
    except TypeError as e:  # not an object, or an unknown field
        raise InvalidRequestError("sampling", str(e)) from e


def _with_prompt(
    worker: Worker, event: DeltaEvent, prompt_ids: list[int], lps: list[TokenLogprobs | None]
) -> PromptDelta:
    first, raw = worker.token_of(prompt_ids[0])
    entries = [TokenLogprob(first, math.nan, raw, []),
               *worker.logprobs_of([lp for lp in lps[1:] if lp is not None])]  # fmt: skip
    text = worker.tokenizer.decode(prompt_ids)
    ranked: list[dict[str, dict[str, Any]] | None] = [None]
    for lp in lps[1:]:
        if lp is None:
            continue
        ranks = {**{t: r for r, (t, _) in enumerate(lp.top, 1)}, lp.token_id: lp.rank}
        ranked.append({str(t): {"logprob": v, "rank": ranks[t],
                                "decoded_token": worker.token_of(t)[0]}
                       for t, v in [(lp.token_id, lp.logprob), *lp.top]})  # fmt: skip
    return PromptDelta(**{f.name: getattr(event, f.name) for f in dataclasses.fields(event)},
                       prompt_logprobs=entries, prompt_text=text, prompt_ranked=ranked)  # fmt: skip


def _delta(
    worker: Worker,
    o: CompletionOutput,
    done: set[int],
    sent: dict[int, int],
    tools: RequestTools | None,
) -> DeltaEvent | None:
    if o.index in done or (not o.delta_token_ids and not o.delta_text and not o.finished):
        return None
    if o.finished:
        done.add(o.index)
    # the logprobs of the tokens whose text is out: sent with that text, never for a cut stop
    # string or a final end-of-sequence token (OpenAI's logprobs add up to the text; usage
    # counts every token, as OpenAI bills them; vLLM lists them all: README, logprobs)
    first = sent.get(o.index, 0)
    lps = o.logprobs[first : o.num_shown_tokens] if o.logprobs else None
    sent[o.index] = max(first, o.num_shown_tokens)
    text, calls, finish_reason = o.delta_text, None, o.finish_reason
    if tools is not None:  # content and tool-call deltas
        try:
            text, calls = tools.delta(o.index, text, o.delta_token_ids, o.finished)
        except Exception:  # a parser bug: the stream goes on, with the output as content
            log.exception("tool-call parsing failed; the rest of completion %d is content",
                          o.index)  # fmt: skip
            text = tools.give_up(o.index, o.delta_text)
        if not o.finished and tools.ended(o.index):  # its one call (parallel_tool_calls false)
            finish_reason = "stop"
            done.add(o.index)
    return DeltaEvent(
        index=o.index,
        text=text,
        tool_calls=calls or None,
        token_ids=list(o.delta_token_ids),
        logprobs=worker.logprobs_of(lps) if lps else ([] if o.logprobs is not None else None),
        finish_reason=finish_reason,
        stop_reason=o.stop_reason,
    )


async def _abort(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    try:
        rid = orjson.loads(await _body(request))["request_id"]
        if not isinstance(rid, str):
            raise TypeError("request_id must be a string")
    except (orjson.JSONDecodeError, KeyError, TypeError) as e:
        return _error(400, f"bad abort request: {e}", "invalid_request_error", "request_id")
    aborted = worker.llm.abort(rid)
    pulling = worker.pulling.get(rid)
    if not aborted and pulling is not None:  # still pulling its KV: no engine stream to abort
        pulling.cancel()  # (frees its reserved blocks; its connection closes)
        aborted = True
    return web.json_response({"aborted": aborted}, dumps=_dumps)


async def _role(request: web.Request) -> web.Response:
    """Change the worker's role; answers once the old role's work has drained."""
    worker = request.app[WORKER]
    try:
        role = orjson.loads(await _body(request))["role"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as e:
        return _error(400, f"bad role request: {e}", "invalid_request_error", "role")
    if role not in ROLES:
        return _error(400, f"role must be one of {list(ROLES)}, got {role!r}",
                      "invalid_request_error", "role")  # fmt: skip
    if worker._role_change.locked():
        return _error(409, "a role change is already running", "conflict_error", "role")
    async with worker._role_change:
        previous = worker.config.role
        try:
            drained = await worker.change_role(role)
        except TimeoutError as e:
            return _error(503, str(e), "service_unavailable", "role", "drain_timeout")
    body = {"role": role, "previous": previous, "drained_s": round(drained, 3)}
    return web.json_response(body, dumps=_dumps)


async def _health(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    if worker.llm.is_stalled():
        return web.json_response({"status": "stalled", "worker_id": worker.config.worker_id,
                                  "stalled_s": round(worker.llm.stalled_s(), 1)}, status=503)  # fmt: skip
    status = "draining" if worker.draining else "ok"
    return web.json_response({"status": status, "worker_id": worker.config.worker_id})


async def _stats(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    s = worker.llm.stats()
    body = dataclasses.asdict(worker.info()) | {
        "num_preemptions": s["num_preemptions"],
        "num_aborted": s["num_aborted"],
        "prefix_cache_query_tokens": s["prefix_cache_query_tokens"],
        "prefix_cache_hit_tokens": s["prefix_cache_hit_tokens"],
        "prefix_cached_blocks": s["prefix_cached_blocks"],
        "prefix_cached_tail_blocks": s["prefix_cached_tail_blocks"],
        "spec_proposed_tokens": s["spec_proposed_tokens"],
        "spec_accepted_tokens": s["spec_accepted_tokens"],
        "spec_acceptance_rate": s["spec_accepted_tokens"] / max(1, s["spec_proposed_tokens"]),
        "spec_mean_accepted_length": s["spec_accepted_tokens"] / max(1, s["spec_verifications"]),
        "open_requests": worker.llm.num_open_streams,
        "kv_exports_held": s["kv_exports_held"],
        "kv_imports_reserved": s["kv_imports_reserved"],
        "kv_pulls_served": worker.kv_server.pulls_served,
        "kv_pulls_failed": worker.kv_server.pulls_failed,
        "kv_connections_refused": worker.kv_server.connections_refused,
        "kv_bytes_sent": worker.kv_server.bytes_sent,
        "kv_imports": worker.importer.imports,
        "kv_bytes_received": worker.importer.bytes,
        "parallel": _parallel(worker.llm),
    }
    return web.json_response(body, dumps=_dumps)


def _parallel(llm: AsyncLLM) -> dict[str, Any]:
    """How the model is split: tp, pp, ep, its ranks, each stage's layers, and the lanes of
    requests whose steps are in flight together (pp of them, unless speculative decoding)."""
    model = llm.engine.model
    par = model.place.config
    return {"tp": par.tp, "pp": par.pp, "ep": par.ep, "ranks": par.world_size,
            "stages": [[r.start, r.stop] for r in model.place.stages],
            "lanes": llm.engine.lanes}  # fmt: skip


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[WORKER].telemetry.tel.prometheus()
    return web.Response(body=body, headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def make_app(worker: Worker) -> web.Application:
    """The worker's app. Run it with auto_decompress=False, as `serve` does: the app decodes
    compressed request bodies itself (`_body`)."""
    app = web.Application(
        middlewares=[_auth, _body_errors], client_max_size=worker.config.max_body_bytes
    )
    app[WORKER] = worker
    later = _expect_later  # (every route's: `_body` answers Expect)
    app.router.add_post("/internal/generate", _generate, expect_handler=later)
    app.router.add_post("/internal/abort", _abort, expect_handler=later)
    app.router.add_get("/internal/health", _health, expect_handler=later)
    app.router.add_get("/internal/stats", _stats, expect_handler=later)
    app.router.add_post("/internal/role", _role, expect_handler=later)
    app.router.add_get("/metrics", _metrics, expect_handler=later)
    app.router.add_route("*", "/{path:.*}", _no_route, expect_handler=later)  # (what no other
    # route takes: last)
    app.cleanup_ctx.append(_kv_transfer)
    app.cleanup_ctx.append(_registration)
    return app


async def _kv_transfer(app: web.Application) -> AsyncIterator[None]:
    """Serve KV pulls (any role can be the prefill side of one) for the app's life."""
    worker = app[WORKER]
    port = await worker.kv_server.start(worker.config.host, worker.config.kv_port)
    host = urllib.parse.urlsplit(worker.config.url).hostname or worker.config.host
    worker.kv_addr = f"{host}:{port}"
    try:
        yield
    finally:
        await worker.kv_server.close()


async def _registration(app: web.Application) -> AsyncIterator[None]:
    """Open the Redis client; keep the registry entry alive, publish the tokenizer bundle and the
    prefix cache's events for the app's life; leave the registry and the prefix index at exit."""
    worker = app[WORKER]
    if worker.config.redis_url is None:
        yield
        return
    redis = connect(worker.config.redis_url)
    worker._redis = redis
    worker._registry = Registry(redis, ttl_s=worker.config.ttl_s)
    # (an earlier run under a given id may have died unseen by any registry reader, whose
    # prune would have purged it: its marker gone by now, its blocks still listed)
    publisher = worker.publisher = CacheEventPublisher(
        PrefixIndex(redis), worker.config.model_name, worker.config.worker_id,
        purge_first=worker.config.id_given, paused=worker.llm.is_stalled,
    )  # fmt: skip
    worker.llm.set_cache_listener(publisher.record)
    worker._heartbeat = asyncio.create_task(worker.heartbeat_loop())
    publishing = asyncio.create_task(publisher.run())
    try:
        yield
    finally:
        await stop_task(publishing)

        async def leave_index() -> None:
            await publisher.close(held=worker.llm.engine.blocks.cached_hashes())

        await worker.on_exit("leaving the prefix index", leave_index())
        await worker.leave()  # (a no-op after a drain's: one deregister)
        await redis.aclose()


def _parent_gone(stop: asyncio.Event) -> None:
    log.warning("the pool or `edgeinfer up` that started this worker is gone: draining, exiting")
    stop.set()


def _watch_ranks(llm: AsyncLLM, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """Set when a rank of a split model dies (never, for a model on one rank)."""
    event = asyncio.Event()
    ranks = llm.engine.runner.ranks
    if ranks is not None:

        def failed(why: str) -> None:  # on the watchdog's thread
            loop.call_soon_threadsafe(event.set)

        ranks.on_failure.append(failed)
        if ranks.failed is not None:
            event.set()
    return event


async def _exit_on_rank_failure(worker: Worker, runner: web.AppRunner, llm: AsyncLLM) -> None:
    """A rank died: the model cannot run. Fail what is in flight (the gateway retries it
    elsewhere), leave the registry, and exit with an error; bounded, whatever the engine's
    thread is doing."""
    ranks = llm.engine.runner.ranks
    why = ranks.failed if ranks is not None else "a rank died"
    log.error("%s: failing %d in-flight requests, deregistering, exiting", why,
              llm.num_open_streams)  # fmt: skip
    worker.stopping = True
    with contextlib.suppress(Exception):
        async with asyncio.timeout(10):
            await runner.cleanup()  # leaves the registry
    with contextlib.suppress(Exception):
        worker.telemetry.tel.shutdown()
    logging.shutdown()
    os._exit(1)


async def serve(
    config: WorkerConfig, llm: AsyncLLM, startup: dict[str, float] | None = None
) -> None:
    """Run until SIGTERM/SIGINT, then drain and exit. `startup`: seconds per start-up phase,
    for the cold-start metric."""
    worker = Worker(config, llm)
    worker.telemetry.cold_start(startup or {})
    # keepalive_timeout: an idle connection stays open longer than the gateway keeps one in its
    # pool (gateway/app.py, 30 s), so that the gateway closes it first: a request sent on one
    # this side had just closed would fail as if the worker had died (no retry for a POST)
    runner = web.AppRunner(
        make_app(worker), handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
        keepalive_timeout=IDLE_CONNECTION_S, max_line_size=MAX_HEADER_BYTES,
        max_field_size=MAX_HEADER_BYTES, max_headers=MAX_HEADERS, auto_decompress=False,
    )  # fmt: skip
    # SIGTERM is a drain from before the registry entry is written (the app's set-up writes it):
    # taken by the default action in between, it left the entry listing a dead worker for ttl_s
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await runner.setup()
    warm: asyncio.TimerHandle | None = None
    try:  # whatever ends this (an error included), the app's cleanup stops its tasks
        await listen(runner, config.host, config.port, "worker")
        # The serving side's objects (the app, clients, telemetry) live as long as the process,
        # as the engine's do (frozen by the CLI): out of the collector's sight, so a full
        # collection scans only what requests made (no collect first: it would delay the first
        # request)
        gc.freeze()
        # jinja2 and the chat template, left out of the start-up (runtime.chat_template): soon
        # after, on a thread, once the first requests (those a cold start was for) had the GIL
        warm = loop.call_later(WARM_TEMPLATE_AFTER_S, loop.run_in_executor, None,
                               worker.tokenizer.warm_chat_template)  # fmt: skip
        watch_lifeline(loop, lambda: _parent_gone(stop))
        rank_failure = _watch_ranks(llm, loop)
        # (an output nobody reads any more, its pool gone, must not stop the worker here)
        with contextlib.suppress(OSError):
            print(f"worker {config.worker_id} ready: model {config.model_name!r}, region "
                  f"{config.region}, role {config.role}, {config.url}, kv transfer on "
                  f"{worker.kv_addr}", flush=True)  # fmt: skip
        stopped = asyncio.create_task(stop.wait())
        failed = asyncio.create_task(rank_failure.wait())
        await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
        if failed.done():
            await _exit_on_rank_failure(worker, runner, llm)
        failed.cancel()
        log.warning("stopping: draining %d in-flight requests", llm.num_open_streams)
        await worker.drain()
    finally:
        if warm is not None:
            warm.cancel()
        await runner.cleanup()
    llm.shutdown()
    worker.telemetry.tel.shutdown()  # flush spans and metrics still buffered
