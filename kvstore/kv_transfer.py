"""KV-cache transfer between workers: the decode worker pulls a prompt's KV blocks from the
prefill worker over one streaming connection, in large frames, layer range by layer range.

    decode worker (D)                                   prefill worker (P)
    reserve destination blocks (refuse if no room)
    PULL {request, tokens, first_block, cache_id,
          nonce} + HMAC ──────────────────────────▶  check the HMAC and KV layout; start the
                                                        prefill of `tokens` (held, not freed)
                                        ◀─── ACCEPT {num_blocks, layout, proof}
                                        ◀─── DATA  layers [a, b) × blocks [i, j)  (as each
                                        ◀─── DATA  ...                 prefill chunk completes)
                                        ◀─── END   {frames, cached_tokens}
    every (layer, block) received once,
    sizes and checksums verified
    ACK ───────────────────────────────────────────────▶  free the held blocks (or at the deadline)

Every frame is a fixed 38-byte header and a payload:

    magic "EIKV" · kind u8 · pad · layer_start u16 · layer_count u16 · block_start u32 ·
    block_count u32 · request_tag u64 · payload_len u32 · xxh3_64(payload) u64

except that a DATA frame carries 0 in the header's checksum field and its payload's xxh3_64 in
8 bytes after the payload, so that each side hashes a chunk right after the socket copied it,
while it is still in the CPU's cache.

The shared secret never goes on the wire (version 2 of these frames; both sides must run the
same version: a version-1 peer, which sent the secret in its PULL, is refused). The puller
proves it knows it with a PULL frame followed by 32 bytes: HMAC-SHA256, keyed by the secret,
over "EIKV PULL v2" NUL and the PULL's JSON body, which holds a random `nonce` (16 bytes, in
hex) of the puller's; the prefill side proves it knows it too with ACCEPT's `proof`: the hex
HMAC-SHA256 over "EIKV ACCEPT v2" NUL, that nonce and the request tag (8 bytes, little-endian).
A puller whose peer's proof is missing or wrong fails the pull (it reached a prefill worker
that is not the cluster's: a registry entry anyone wrote). DATA is not authenticated (its
checksum catches corruption, not an attacker on the path), and a PULL seen on the path may be
replayed (to recompute that prefill): the secret guards the port, not the link.

DATA payloads must hold finite values: a DATA frame holding a NaN or an infinity (a faulty
prefill worker's, or a peer's that speaks the protocol) fails the pull, so that it reaches
neither the request nor the decode side's prefix cache (it would answer every later prompt
sharing those blocks). Checked as each chunk lands, beside its checksum (a few GB/s a core).

Control frames (PULL, ACCEPT, END, ACK, ERROR, KEEPALIVE) carry a JSON object (ERROR: `message`,
and `source_failed` false where the prefill side refused the pull, e.g. its KV cache full, rather
than failed); every field is checked, and a frame that breaks the protocol fails the transfer
(KVTransferError). The puller gives up after PULL_IDLE_S without a byte from the prefill side
(within a frame or between frames; keepalives count) and after PULL_DEADLINE_S in all. The
prefill side reads a PULL, before its HMAC is checked, only up to what the longest prompt's
PULL needs, as its bytes arrive, within AUTH_READ_S of the connection's accept, from at most
MAX_UNAUTHENTICATED connections at once: one more drops the one that has waited longest (a real
puller sends its PULL as it connects, so only connections that send nothing or drip it can
hold a place; none can keep a real pull waiting).

DATA frames carry the keys and values of `layer_count` layers for `block_count` blocks (block
indices within the request's block table, not physical ids), laid out (layers, 2, blocks,
block_size, kv_heads, head_dim) in the cache's dtype. `request_tag` (8 bytes of BLAKE2b of the
request id) names the request in every frame.

The transport is one interface (`pull_kv` on the decode side, `KVTransferServer` on the prefill
side) over asyncio TCP sockets (`FrameConn`); a GPU transport (NCCL send/recv) takes the same
PULL/ACCEPT/END exchange with DATA moved device to device. No copy is made on either side where
the blocks are consecutive in the cache (the usual case: a request's blocks are handed out in
order): the prefill side sends straight from the cache tensor, the decode side receives straight
into it, and each hashes the same memory (xxh3, ~10 GB/s). Scattered blocks go through one
gather or scatter copy. This is the only kvstore module that imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import orjson
import torch
import xxhash

log = logging.getLogger("edgeinfer.kv_transfer")

MAGIC = b"EIKV"
HEADER = struct.Struct("<4sBxHHIIQIQ")
PULL, ACCEPT, DATA, END, ACK, ERROR, KEEPALIVE = 1, 2, 3, 4, 5, 6, 7
KIND_NAMES = {PULL: "PULL", ACCEPT: "ACCEPT", DATA: "DATA", END: "END", ACK: "ACK", ERROR: "ERROR",
              KEEPALIVE: "KEEPALIVE"}  # fmt: skip
# The prefill side sends a KEEPALIVE after each KEEPALIVE_S without another frame (its prefill
# queued or computing), so the puller tells a busy prefill worker from a hung one: it gives up
# after PULL_IDLE_S of silence.
KEEPALIVE_S = 1.0
PULL_IDLE_S = 10.0
# The prefill side's limit on a send the puller takes nothing of: longer than a puller's read
# may pause while it is healthy (its landing write waits for its engine's step, which a worker
# takes for hung after runtime.async_engine.ENGINE_STALL_S = 60 s), so only a frozen or vanished
# puller is dropped (its export's KV blocks released) this way.
SEND_TIMEOUT_S = 70.0
# The longest a whole pull may take, keepalives included: the prefill's wait in its worker's
# queue and its compute, then the transfer. A healthy pull of the longest prompt ends well within
# it (a prefill worker's engine is taken for hung after ENGINE_STALL_S = 60 s without a step, and
# then sends no keepalives); past it the puller gives up and frees the blocks it reserved, so a
# prefill worker that sends keepalives for ever (a stuck export) cannot hold them for ever.
PULL_DEADLINE_S = 600.0
MAX_CONTROL_BYTES = 16 << 20  # a PULL carries the prompt's token ids; nothing else is large
# A PULL's body: its token ids (in JSON, at most 11 characters and a comma each: an int32) and
# its other fields (request id, cache id, secret, trace context), which fit in PULL_BASE_BYTES.
# The prefill side refuses a PULL longer than its tokens could need before reading it.
PULL_TOKEN_BYTES = 12
PULL_BASE_BYTES = 64 << 10
# Connections the prefill side reads a PULL from at once (not yet authenticated): together with
# the cap above, and bodies read as their bytes arrive, this bounds what unauthenticated peers
# can make it allocate. One more drops the oldest (none waits its turn: a real pull that queued
# behind connections sending nothing got no keepalives, and its puller gave up).
MAX_UNAUTHENTICATED = 64
# For a connection's whole PULL to arrive and be authenticated, from its accept: a real puller
# sends it as it connects (the longest prompt's, about 1.5 MB for 128K tokens, takes
# milliseconds in a cluster); a connection that sends nothing holds its place no longer.
AUTH_READ_S = 2.0
MAC = hashlib.sha256().digest_size  # a PULL's HMAC-SHA256, after its body
PULL_MAC_CONTEXT = b"EIKV PULL v2\0"  # what each HMAC is over begins with its context
ACCEPT_MAC_CONTEXT = b"EIKV ACCEPT v2\0"
NONCE_BYTES = 16
RECV_STEP_BYTES = 256 << 10  # a control body is read growing by this much at most at a time
MAX_ERROR_CHARS = 1000  # of a peer's ERROR message, kept in ours
DEFAULT_FRAME_BYTES = 8 << 20  # DATA frames hold whole layers up to about this size
MIN_RUN_BYTES = 64 << 10  # below this average, scattered blocks are gathered into one buffer
CHUNK_BYTES = 512 << 10  # DATA payloads are hashed and moved in pieces of this size (L2)
TRAILER = struct.Struct("<Q")  # a DATA payload's xxh3_64, after it
# Failures that anyone who can reach the port repeats at will (a client that connects and sends
# garbage, a health check or a scanner that connects and hangs up, accept() out of descriptors)
# are logged once with their detail, then counted and summed up at most once per this.
FAILURE_SUMMARY_S = 60.0


class KVTransferError(RuntimeError):
    """A transfer failed. `source_failed`: the prefill side is unreachable, died, or sent bad
    data (retry the prefill elsewhere); otherwise it refused the request (retry would not help)."""

    def __init__(self, message: str, source_failed: bool = True) -> None:
        super().__init__(message)
        self.source_failed = source_failed


def request_tag(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")


@dataclass(slots=True, frozen=True)
class KVLayout:
    """The shape of one worker's paged KV cache; both sides of a transfer must agree."""

    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32"

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def bytes_per_layer_block(self) -> int:
        """Keys and values of one block in one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy. Through uint8: numpy has no
    bfloat16, so `t.numpy()` refuses a bfloat16 KV cache."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


class KVPages:
    """A worker's KV cache tensor seen as blocks: read or write whole blocks of a layer range.

    `kv` is (layers, 2, num_blocks * block_size, kv_heads, head_dim), keys then values.
    `direct`: `runs` are the cache's own memory, which a pull may land in; a subclass whose
    cache is spread over processes (runtime.ranks.RankedKVPages) has copies, landed through
    `write`, and its reads and writes wait for the engine's step: they run off the event loop.
    """

    direct = True

    def __init__(self, kv: torch.Tensor, block_size: int) -> None:
        if kv.dim() != 5 or kv.shape[1] != 2 or kv.shape[2] % block_size:
            raise ValueError(f"expected (layers, 2, slots, heads, dim), got {tuple(kv.shape)}")
        if not kv.is_contiguous():
            raise ValueError("the KV cache must be contiguous")
        layers, _, slots, heads, dim = kv.shape
        self.layout = KVLayout(layers, block_size, heads, dim, str(kv.dtype).removeprefix("torch."))
        # (layers, 2, num_blocks, block_size, kv_heads, head_dim)
        self.blocks = kv.view(layers, 2, slots // block_size, block_size, heads, dim)

    def runs(self, layers: slice, block_ids: list[int]) -> list[memoryview]:
        """The memory of blocks `block_ids` of `layers`, in frame payload order (layer, then
        keys / values, then block), as few contiguous byte views as their ids allow."""
        spans: list[tuple[int, int]] = []
        for b in block_ids:
            if spans and spans[-1][1] == b:
                spans[-1] = (spans[-1][0], b + 1)
            else:
                spans.append((b, b + 1))
        views = []
        for layer in self.blocks[layers]:
            for kv in layer:  # keys, values: (num_blocks, block_size, heads, dim)
                for a, b in spans:
                    views.append(byte_view(kv[a:b]))
        return views

    def read(self, layers: slice, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy (layer_count, 2, len(block_ids), block_size, heads, dim), in host
        memory."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.blocks.device)
        return self.blocks[layers].index_select(2, index).cpu()

    def write(
        self, layers: slice, block_ids: list[int], payload: bytes | bytearray | memoryview
    ) -> None:
        lay = self.layout
        count = len(range(*layers.indices(lay.num_layers)))
        with warnings.catch_warnings():  # a read-only buffer: it is only read from
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(payload, dtype=getattr(torch, lay.dtype))
        data = flat.view(count, 2, len(block_ids), lay.block_size, lay.num_kv_heads, lay.head_dim)
        dev = self.blocks.device
        index = torch.tensor(block_ids, dtype=torch.int64, device=dev)
        self.blocks[layers].index_copy_(2, index, data.to(dev))


class DeviceKVPages(KVPages):
    """A KV cache in GPU memory: blocks go through host memory (a pull cannot land in the cache
    itself), gathered and scattered by index on the device; reads and writes run off the event
    loop, like a split cache's."""

    direct = False

    def runs(self, layers: slice, block_ids: list[int]) -> list[memoryview]:
        return [byte_view(self.read(layers, block_ids))]


@dataclass(slots=True)
class PullRequest:
    """The decode side's first frame: which request's KV it wants, from which block on."""

    request_id: str  # the request, as the gateway named it
    token_ids: list[int]  # the tokens whose keys and values are wanted (the prompt minus its last)
    first_block: int  # blocks before this index the decode side holds already (prefix-cache hit)
    cache_id: str  # the decode side's prefix-cache identity (model revision, dtype, block size)
    # the cluster's shared secret: the puller's key for the PULL's HMAC, never sent ("" on the
    # prefill side, which has its own)
    secret: str
    traceparent: str | None = None  # W3C trace context of the puller's span (tracing on)


@dataclass(slots=True)
class ExportProgress:
    """The prefill side's state for a request, after one of its engine steps."""

    computed_tokens: int  # tokens of the request whose KV is in the cache now
    block_ids: list[int]  # the request's block table (physical ids)
    done: bool  # the prefill finished: the blocks are held until released
    cached_tokens: int = 0  # tokens the prefill side took from its own prefix cache
    arrival_time: float = 0.0  # time.monotonic(): the prefill entered the engine (telemetry)
    scheduled_time: float = 0.0  # time.monotonic(): its first engine step (0: not yet)


@dataclass(slots=True)
class ServedPull:
    """One pull the prefill side served, for its telemetry (times are time.monotonic())."""

    pull: PullRequest  # what was asked
    started: float  # the PULL arrived
    bytes: int  # DATA payload bytes sent
    ok: bool  # the puller acknowledged every block
    arrival_time: float = 0.0  # the export's prefill entered the engine (0: never)
    scheduled_time: float = 0.0  # its first engine step
    prefilled: float = 0.0  # its prefill finished


# P side: start the prefill of a pull and report its progress; release its blocks afterwards;
# hear about each pull once it ended (telemetry).
ExportFn = Callable[[PullRequest], AsyncIterator[ExportProgress]]
ReleaseFn = Callable[[str], Awaitable[None]]
ServedFn = Callable[[ServedPull], None]


def _frame(kind: int, tag: int, payload: bytes | memoryview = b"", *, layers: tuple[int, int] = (0, 0),
           blocks: tuple[int, int] = (0, 0)) -> bytes:  # fmt: skip
    """The header of a frame whose payload is one buffer."""
    return _header(kind, tag, len(payload), xxhash.xxh3_64_intdigest(payload), layers, blocks)


def _header(kind: int, tag: int, length: int, digest: int, layers: tuple[int, int] = (0, 0),
            blocks: tuple[int, int] = (0, 0)) -> bytes:  # fmt: skip
    return HEADER.pack(MAGIC, kind, layers[0], layers[1], blocks[0], blocks[1], tag, length, digest)


def _mac(secret: str, context: bytes, message: bytes | bytearray) -> bytes:
    """HMAC-SHA256 keyed by the shared secret over `context` and `message`."""
    key = secret.encode(errors="surrogateescape")
    return hmac.new(key, context + message, hashlib.sha256).digest()


def pull_frame(pull: PullRequest) -> tuple[bytes, bytes]:
    """The bytes of the PULL for `pull` (its header, its JSON body with a fresh nonce and
    without the secret, then the HMAC) and that nonce."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    fields = {k: v for k, v in asdict(pull).items() if k != "secret"}
    body = orjson.dumps({**fields, "nonce": nonce.hex()})
    tag = request_tag(pull.request_id)
    return _frame(PULL, tag, body) + body + _mac(pull.secret, PULL_MAC_CONTEXT, body), nonce


def accept_proof(secret: str, nonce: bytes, tag: int) -> str:
    """ACCEPT's `proof` that the prefill side knows the secret: over the puller's nonce."""
    return _mac(secret, ACCEPT_MAC_CONTEXT, nonce + tag.to_bytes(8, "little")).hex()


def _chunks(views: list[memoryview]) -> list[memoryview]:
    return [v[i : i + CHUNK_BYTES] for v in views for i in range(0, len(v), CHUNK_BYTES)]


@dataclass(slots=True)
class _Header:
    kind: int
    layer_start: int
    layer_count: int
    block_start: int
    block_count: int
    tag: int
    length: int
    digest: int


class FrameConn:
    """One transfer connection: a non-blocking TCP socket driven by the event loop, sending
    from and receiving into caller buffers (no stream buffer in between)."""

    def __init__(self, sock: socket.socket, send_timeout_s: float = PULL_IDLE_S) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        # a peer that stays connected but reads nothing (stopped, frozen, its host gone) would
        # hold a send, and what the sender holds (an export's KV blocks), until TCP gives up
        self.send_timeout_s = send_timeout_s
        # a receive that gets no byte for this long raises TimeoutError (None: no limit): an
        # idle limit, not a deadline for a frame, so a slow but steady link is not cut off
        self.recv_idle_s: float | None = None

    @classmethod
    async def connect(cls, host: str, port: int) -> FrameConn:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, addr)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    async def send(self, *views: bytes | memoryview) -> None:
        """Send each view whole; ConnectionError when one is not all taken within
        `send_timeout_s` (DATA goes in chunks of 512 KiB, a control frame in one view)."""
        for v in views:
            try:
                async with asyncio.timeout(self.send_timeout_s):
                    await self.loop.sock_sendall(self.sock, v)
            except TimeoutError:
                raise ConnectionError(
                    f"the peer read nothing for {self.send_timeout_s:g} s"
                ) from None

    async def recv_into(self, view: memoryview) -> None:
        """Fill `view` exactly; IncompleteReadError when the peer closes first, TimeoutError
        when it sends nothing for `recv_idle_s`."""
        want, got = len(view), 0
        while got < want:
            n = await self._recv_some(view[got:])
            if n == 0:
                raise asyncio.IncompleteReadError(bytes(view[:got]), want)
            got += n

    async def _recv_some(self, view: memoryview) -> int:
        idle = self.recv_idle_s
        if idle is None:
            return await self.loop.sock_recv_into(self.sock, view)
        try:  # bytes waiting already (the usual case mid-frame): no timer to arm
            return self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            pass
        try:
            async with asyncio.timeout(idle):
                return await self.loop.sock_recv_into(self.sock, view)
        except TimeoutError:
            raise TimeoutError(f"the peer sent nothing for {idle:g} s") from None

    async def recv(self, n: int) -> bytearray:
        """`n` bytes, in a buffer that grows as they arrive (a header's length is the peer's
        word: a peer that announces much and sends little makes this allocate little)."""
        if n <= RECV_STEP_BYTES:
            buf = bytearray(n)
            await self.recv_into(memoryview(buf))
            return buf
        buf = bytearray()
        while len(buf) < n:
            part = bytearray(min(n - len(buf), RECV_STEP_BYTES))
            try:
                await self.recv_into(memoryview(part))
            except asyncio.IncompleteReadError as e:
                raise asyncio.IncompleteReadError(bytes(buf) + e.partial, n) from None
            buf += part
        return buf

    async def discard(self, n: int) -> None:
        """Read `n` bytes and drop them (into one small buffer)."""
        buf = memoryview(bytearray(min(n, RECV_STEP_BYTES)))
        while n > 0:
            step = min(n, len(buf))
            await self.recv_into(buf[:step])
            n -= step

    async def send_control(self, kind: int, tag: int, obj: Any) -> None:
        body = orjson.dumps(obj)
        await self.send(_frame(kind, tag, body) + body)

    async def read_header(self) -> _Header:
        magic, *fields = HEADER.unpack(await self.recv(HEADER.size))
        if magic != MAGIC:
            raise KVTransferError(f"bad frame magic {magic!r}")
        h = _Header(*fields)
        if h.kind not in KIND_NAMES:
            raise KVTransferError(f"unknown frame kind {h.kind}")
        return h

    async def read_control(self, tag: int | None, h: _Header | None = None,
                           limit: int = MAX_CONTROL_BYTES) -> tuple[int, Any]:  # fmt: skip
        """A control frame (its header already read when `h` is given): (kind, JSON body), the
        body at most `limit` bytes."""
        h = h or await self.read_header()
        if h.kind == DATA:
            raise KVTransferError("a DATA frame where a control frame was expected")
        if h.length > limit:
            raise KVTransferError(f"{KIND_NAMES[h.kind]} frame of {h.length} bytes (limit {limit})")
        if tag is not None and h.tag != tag:
            raise KVTransferError("frame for another request")
        payload = await self.recv(h.length)
        if xxhash.xxh3_64_intdigest(payload) != h.digest:
            raise KVTransferError(f"{KIND_NAMES[h.kind]} frame failed its checksum")
        return h.kind, orjson.loads(payload)

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------- the prefill side
@dataclass(slots=True)
class _Repeats:
    """The repeats of one kind of warning since its last line."""

    since: float  # loop time: the last line
    count: int = 0  # repeats since, not logged
    last: str = ""  # the latest one's message
    timer: asyncio.TimerHandle | None = None  # logs the count `interval_s` after `since`


class _RepeatedWarnings:
    """Warnings that a peer can repeat at will, logged as serving systems log them: the first of
    a kind at once, with its detail; its repeats counted, and summed up in one line (with the
    latest one's detail) at most once per `interval_s`, so that a client that connects and sends
    garbage in a loop costs a line a minute rather than one per connection, while a new kind of
    failure still shows at once. Used on the event loop only."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._kinds: dict[str, _Repeats] = {}  # by kind (ours: a few fixed names, exception types)

    def warning(self, kind: str, message: str) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        r = self._kinds.get(kind)
        if r is None or (not r.count and now >= r.since + self.interval_s):
            log.warning("%s", message)
            self._kinds[kind] = _Repeats(now)
            return
        r.count += 1
        r.last = message
        if r.timer is None:
            r.timer = loop.call_at(r.since + self.interval_s, self._summarize, r)

    def _summarize(self, r: _Repeats) -> None:
        now = asyncio.get_running_loop().time()
        log.warning("%s (%d more like it in the last %.0f s; this is the latest)", r.last,
                    r.count, now - r.since)  # fmt: skip
        r.since, r.count, r.timer = now, 0, None

    def flush(self) -> None:
        """Log the repeats not summed up yet (the server closes)."""
        for r in self._kinds.values():
            if r.timer is not None:
                r.timer.cancel()
                self._summarize(r)


def _close(conn: FrameConn, _: asyncio.Task[None]) -> None:
    conn.close()


class KVTransferServer:
    """Serves pulls on a TCP port: runs each pull's prefill through `export` and streams the
    blocks as they complete. The blocks are held until the puller acknowledges them, the
    connection drops, or `hold_s` passes after the last frame; then `release` frees them. Only
    the connection that started an export releases it: a PULL refused (wrong secret, a request
    id being pulled already, ...) leaves every export alone."""

    def __init__(self, pages: KVPages, cache_id: str, secret: str, export: ExportFn,
                 release: ReleaseFn, hold_s: float = 30.0,
                 frame_bytes: int = DEFAULT_FRAME_BYTES,
                 on_served: ServedFn | None = None,
                 send_timeout_s: float = SEND_TIMEOUT_S,
                 stalled: Callable[[], bool] | None = None,
                 max_tokens: int | None = None) -> None:  # fmt: skip
        self.pages = pages
        self.cache_id = cache_id
        self.secret = secret
        self.export = export
        self.release = release
        self.hold_s = hold_s
        self.frame_bytes = frame_bytes
        self.on_served = on_served
        self.send_timeout_s = send_timeout_s  # a puller that reads nothing this long is dropped
        # whether the engine behind `export` is hung: no keepalives then, so that the puller's
        # idle limit tells it from a busy one
        self.stalled = stalled or (lambda: False)
        # the longest prompt a pull may ask for (the engine's max_model_len and cache capacity,
        # as export_server gives it; None: the protocol's own bound): what a PULL's body may
        # need, read only when its header is within that
        if max_tokens is None:
            self.max_pull_bytes = MAX_CONTROL_BYTES
        else:
            need = PULL_BASE_BYTES + PULL_TOKEN_BYTES * max_tokens
            self.max_pull_bytes = min(MAX_CONTROL_BYTES, need)
        # connections not authenticated yet (reading their PULL), oldest first
        self._unauthenticated: dict[asyncio.Task[None], None] = {}
        # what a peer can repeat at will (see FAILURE_SUMMARY_S): logged once, then summed up
        self._repeated = _RepeatedWarnings(FAILURE_SUMMARY_S)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._exporting: set[str] = set()  # request ids of the exports under way or held
        self.active = 0  # pulls being served now (from their authenticated PULL on)
        self.bytes_sent = 0  # DATA payload bytes, since start
        self.pulls_served = 0  # pulls acknowledged, since start
        self.pulls_failed = 0  # authenticated pulls that ended without an acknowledgement
        # connections dropped or refused before their PULL was authenticated (a wrong HMAC,
        # none within AUTH_READ_S, garbage, a health check, one dropped for a newer one)
        self.connections_refused = 0

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port (a free one when `port` is 0). An IPv6 address is listened
        on as such (create_server's default family refused it: a worker given `--host ::`
        failed to start), "::" on IPv4 too where the host can (the worker's advertised address
        may be either)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        dual = host == "::" and socket.has_dualstack_ipv6()
        self._listener = socket.create_server((host, port), family=family, backlog=128,
                                              reuse_port=False, dualstack_ipv6=dual)  # fmt: skip
        self._listener.setblocking(False)
        self._accepting = asyncio.ensure_future(self._accept(self._listener))
        return int(self._listener.getsockname()[1])

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(listener)
            except OSError as e:  # out of descriptors or buffers for a moment: accept again
                # later (as asyncio's servers do); ending here would leave pullers connecting
                # into the backlog, unanswered, for as long as the process lives
                self._repeated.warning(
                    "accept", f"kv transfer: accept failed ({e}); accepting again in 1 s"
                )
                await asyncio.sleep(1.0)
                continue
            host, port = addr[0], addr[1]  # (an IPv6 address: 4 fields)
            peer = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            conn = FrameConn(sock, self.send_timeout_s)
            task = asyncio.ensure_future(self._serve(conn, peer))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)
            self._unauthenticated[task] = None
            task.add_done_callback(self._forget)
            # (_serve closes it; this closes one whose task was dropped before it ran)
            task.add_done_callback(functools.partial(_close, conn))
            if len(self._unauthenticated) > MAX_UNAUTHENTICATED:
                # the one waiting longest for its PULL goes: a real puller sends its PULL as it
                # connects, so it is never the oldest for long
                oldest = next(iter(self._unauthenticated))
                del self._unauthenticated[oldest]
                oldest.cancel()
                self.connections_refused += 1
                self._repeated.warning("crowded", (
                    f"kv transfer: {MAX_UNAUTHENTICATED} connections have sent no valid PULL "
                    f"yet; dropped the oldest to read {peer}'s"))  # fmt: skip

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._unauthenticated.pop(task, None)

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # (ended by a bug)
                await self._accepting
        if self._listener is not None:
            self._listener.close()
        for task in list(self._serving):
            task.cancel()
        if self._serving:
            await asyncio.wait(self._serving, timeout=5)
        self._repeated.flush()

    async def _serve(self, conn: FrameConn, peer: str) -> None:
        pull: PullRequest | None = None
        authentic = False  # the PULL's HMAC is the shared secret's: a puller of the cluster's
        served: ServedPull | None = None
        exporting: str | None = None  # the request id this connection took: its export to release
        tag = 0
        answered = False  # its ERROR sent already
        try:
            # until its HMAC is checked: bounded in time, and in number (see _accept)
            try:
                async with asyncio.timeout(AUTH_READ_S):
                    h = await conn.read_header()
                    if h.kind != PULL:
                        raise KVTransferError(f"expected PULL, got {KIND_NAMES[h.kind]}")
                    tag = h.tag  # (its ERROR frame then reaches the puller as its own)
                    if h.length > self.max_pull_bytes:  # a prompt longer than this worker
                        # takes: a refusal, as one its engine refuses (not a failed worker),
                        # answered at once. Then its body (as long as a PULL can be) is read and
                        # dropped: a close with bytes unread resets the connection, and a
                        # puller still sending saw a failure
                        refused = KVTransferError(
                            f"PULL frame of {h.length} bytes: a prompt longer than this worker "
                            f"takes (limit {self.max_pull_bytes})",
                            False,
                        )
                        await conn.send_control(ERROR, tag, {"message": str(refused),
                                                             "source_failed": False})  # fmt: skip
                        answered = True
                        if h.length <= MAX_CONTROL_BYTES:
                            await conn.discard(h.length + MAC)
                        raise refused
                    payload = await conn.recv(h.length)
                    if xxhash.xxh3_64_intdigest(payload) != h.digest:
                        raise KVTransferError("PULL frame failed its checksum")
                    mac = await conn.recv(MAC)
            except TimeoutError:  # (asyncio's says nothing of which limit)
                raise KVTransferError(
                    f"no whole PULL within {AUTH_READ_S:g} s of connecting"
                ) from None
            authentic = hmac.compare_digest(mac, _mac(self.secret, PULL_MAC_CONTEXT, payload))
            if not authentic:
                self.connections_refused += 1
                await conn.send_control(ERROR, tag, {"message": "wrong shared secret"})
                return
            self._forget(asyncio.current_task())  # type: ignore[arg-type]
            # work in flight from here (a worker's drain waits for it, and it keeps the worker
            # from counting as idle): a connection that sent no PULL of the cluster's yet (a
            # probe, a scanner that holds it open) counted for its read limit, so that anyone
            # who could reach the port kept a role change or a drain waiting
            self.active += 1
            body = orjson.loads(payload)
            if not isinstance(body, dict):
                raise KVTransferError("malformed PULL frame: not a JSON object")
            nonce = body.pop("nonce", None)
            if not isinstance(nonce, str) or len(nonce) != 2 * NONCE_BYTES:
                raise KVTransferError(f"malformed PULL frame: nonce {nonce!r}")
            pull = PullRequest(**body, secret="")
            tag = request_tag(pull.request_id)
            proof = accept_proof(self.secret, bytes.fromhex(nonce), tag)
            if pull.cache_id != self.cache_id:
                await conn.send_control(ERROR, tag, {"message": (
                    f"KV layout differs: this worker's cache id is {self.cache_id!r}, "
                    f"the puller's {pull.cache_id!r}")})  # fmt: skip
                return
            bs = self.pages.layout.block_size
            total = -(-len(pull.token_ids) // bs)
            if not 0 <= pull.first_block < total:
                await conn.send_control(ERROR, tag, {"message": (
                    f"first_block {pull.first_block} outside [0, {total})")})  # fmt: skip
                return
            if pull.request_id in self._exporting:  # another connection's: left alone
                await conn.send_control(ERROR, tag, {"message": (
                    f"request {pull.request_id!r} is being pulled already")})  # fmt: skip
                return
            exporting = pull.request_id
            self._exporting.add(exporting)
            await conn.send_control(ACCEPT, tag, {"num_blocks": total - pull.first_block,
                                                  "layout": asdict(self.pages.layout),
                                                  "proof": proof})  # fmt: skip
            served = ServedPull(pull, time.monotonic(), 0, False)
            served.ok = await self._stream(pull, tag, conn, total, served)
            if served.ok:
                self.pulls_served += 1
            else:
                self.pulls_failed += 1
        except Exception as e:  # a bad pull, a refused prefill (bad tokens, queue full), a
            # dead connection: the puller gets an ERROR frame when it can still read one
            if authentic:  # one line a pull: a request of the cluster's
                self.pulls_failed += 1
                log.warning("kv pull %s failed: %s", pull.request_id if pull else "?", e)
            else:  # anyone who reaches the port can repeat this at will: summed up
                self.connections_refused += 1
                self._repeated.warning(type(e).__name__, (
                    f"kv transfer: a connection from {peer} failed before a valid PULL: "
                    f"{type(e).__name__}: {e}"))  # fmt: skip
            # `source_failed` false: a refusal (its KV cache full, its queue full), not a failure
            failed = e.source_failed if isinstance(e, KVTransferError) else True
            with contextlib.suppress(Exception):
                if not answered:
                    await conn.send_control(ERROR, tag, {"message": str(e),
                                                         "source_failed": failed})  # fmt: skip
        finally:
            if exporting is not None:
                try:
                    await self.release(exporting)
                except Exception as e:  # the engine is shutting down: its blocks go with it
                    log.warning("kv pull %s: release failed: %s", exporting, e)
                finally:
                    self._exporting.discard(exporting)
            if authentic:
                self.active -= 1
            conn.close()
            if served is not None and self.on_served is not None:
                try:
                    self.on_served(served)
                except Exception as e:  # telemetry never fails a transfer
                    log.warning("kv pull %s: on_served failed: %s", served.pull.request_id, e)

    async def _stream(self, pull: PullRequest, tag: int, conn: FrameConn, total: int,
                      served: ServedPull) -> bool:  # fmt: skip
        """Send blocks as the prefill completes them; then END, then wait for the ACK. What it
        did goes into `served` as it happens."""
        bs = self.pages.layout.block_size
        sent = pull.first_block  # blocks sent so far (by index in the request's table)
        frames = 0
        cached = 0
        # the puller hanging up aborts the prefill: watch the connection while streaming
        hangup = asyncio.ensure_future(conn.read_header())
        steps = self.export(pull)
        step: asyncio.Future[ExportProgress] | None = None  # the export's step awaited now
        try:
            while True:  # the next step of the prefill, unless the puller hangs up first
                step = asyncio.ensure_future(anext(steps))
                while not (step.done() or hangup.done()):
                    await asyncio.wait({step, hangup}, timeout=KEEPALIVE_S,
                                       return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                    if not (step.done() or hangup.done() or self.stalled()):
                        await conn.send_control(KEEPALIVE, tag, {})
                if not step.done():
                    step.cancel()  # stops the prefill (the export aborts its request)
                    with contextlib.suppress(BaseException):
                        await step
                    raise ConnectionError("the puller hung up")
                try:
                    progress = step.result()
                except StopAsyncIteration:
                    break
                cached = progress.cached_tokens
                served.arrival_time = progress.arrival_time
                served.scheduled_time = progress.scheduled_time
                if progress.done:
                    served.prefilled = time.monotonic()
                ready = total if progress.done else progress.computed_tokens // bs
                if ready > sent:
                    n, nbytes = await self._send_blocks(conn, tag, progress.block_ids, sent, ready)
                    frames += n
                    served.bytes += nbytes
                    sent = ready
            if sent < total:
                raise KVTransferError(f"the prefill ended with {sent} of {total} blocks computed")
            await conn.send_control(END, tag, {"frames": frames, "cached_tokens": cached})
            try:
                async with asyncio.timeout(self.hold_s):
                    h = await asyncio.shield(hangup)
                    kind, _ = await conn.read_control(tag, h)  # (its body within the limit too)
            except asyncio.IncompleteReadError:
                return False  # hung up without acknowledging
            return kind == ACK
        except TimeoutError:
            log.warning("kv pull %s: no acknowledgement in %.0f s; freeing its blocks",
                        pull.request_id, self.hold_s)  # fmt: skip
            return False
        finally:
            # A step still running (a keepalive's send failed, or this task was cancelled,
            # while the prefill computed) is cancelled, which aborts the prefill, and awaited,
            # which retrieves its end: left alone, it ran the export on unseen, its error
            # logged as "Task exception was never retrieved", and the aclose below failed on
            # a generator still running
            for task in (step, hangup):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
            with contextlib.suppress(BaseException):
                await steps.aclose()  # type: ignore[attr-defined]

    async def _send_blocks(self, conn: FrameConn, tag: int, table: list[int], start: int,
                           end: int) -> tuple[int, int]:  # fmt: skip
        """DATA frames for blocks [start, end) of the request, whole layers per frame, sent
        straight from the cache where the blocks are consecutive. Returns (frames, bytes)."""
        lay = self.pages.layout
        ids = table[start:end]
        per_layer = lay.bytes_per_layer_block() * len(ids)
        step = max(1, self.frame_bytes // per_layer)
        frames = nbytes = 0
        for l0 in range(0, lay.num_layers, step):
            l1 = min(lay.num_layers, l0 + step)
            if self.pages.direct:
                views = self.pages.runs(slice(l0, l1), ids)
            else:  # gathered from other processes, between engine steps: off the event loop
                views = await asyncio.to_thread(self.pages.runs, slice(l0, l1), ids)
            if self.pages.direct and (l1 - l0) * per_layer < MIN_RUN_BYTES * len(views):
                # scattered: gather once
                gathered = self.pages.read(slice(l0, l1), ids)
                views = [byte_view(gathered)]
            length = sum(len(v) for v in views)
            await conn.send(_header(DATA, tag, length, 0, (l0, l1 - l0), (start, len(ids))))
            digest = xxhash.xxh3_64()
            for chunk in _chunks(views):  # hashed right after the send read it: from cache
                await conn.send(chunk)
                digest.update(chunk)
            await conn.send(TRAILER.pack(digest.intdigest()))
            self.bytes_sent += length
            nbytes += length
            frames += 1
        return frames, nbytes


# ---------------------------------------------------------------------- the decode side
@dataclass(slots=True)
class PullResult:
    blocks: int  # blocks received
    bytes: int  # DATA payload bytes received
    frames: int  # DATA frames received
    cached_tokens: int  # tokens the prefill side took from its own prefix cache


async def pull_kv(addr: str, pull: PullRequest, pages: KVPages, dst_blocks: list[int],
                  connect_timeout_s: float = 2.0, idle_timeout_s: float = PULL_IDLE_S,
                  deadline_s: float = PULL_DEADLINE_S) -> PullResult:  # fmt: skip
    """Pull blocks [pull.first_block, ...) of the request's KV from `addr` ("host:port") into
    `dst_blocks` of `pages` (one destination per block pulled). Every frame is checked: the
    request tag, the layer and block ranges, the size, the checksum, the control bodies' fields;
    every (layer, block) must arrive exactly once. The peer may be silent for `idle_timeout_s`
    at most (a frame's bytes, keepalives, anything), the whole pull may take `deadline_s`.
    Raises KVTransferError, naming the peer, for whatever goes wrong with it (`source_failed`
    false where the peer refused the pull); the destination blocks then hold garbage and must be
    freed by the caller. Nothing writes to them once this returns or raises."""
    host, _, port = addr.rpartition(":")
    try:
        async with asyncio.timeout(connect_timeout_s):
            conn = await FrameConn.connect(host, int(port))
    except (OSError, TimeoutError, ValueError) as e:
        raise KVTransferError(f"cannot reach the prefill worker at {addr}: {e!r}") from e
    conn.recv_idle_s = idle_timeout_s
    deadline = asyncio.timeout(deadline_s)
    try:
        async with deadline:
            return await _pull(conn, pull, pages, dst_blocks)
    except KVTransferError as e:
        raise KVTransferError(f"pull from {addr}: {e}", e.source_failed) from e
    except asyncio.IncompleteReadError as e:
        raise KVTransferError(
            f"pull from {addr}: the prefill worker closed the connection mid-transfer "
            f"({len(e.partial)} bytes of {e.expected})"
        ) from e
    except TimeoutError as e:
        if deadline.expired():
            raise KVTransferError(f"pull from {addr} took longer than {deadline_s:g} s") from e
        raise KVTransferError(f"transfer from {addr} failed: {e!r}") from e
    except OSError as e:  # ConnectionError, and the others: EHOSTUNREACH, ENETUNREACH, ...
        raise KVTransferError(f"transfer from {addr} failed: {e!r}") from e
    except (KeyError, TypeError, ValueError) as e:  # (orjson.JSONDecodeError is a ValueError)
        raise KVTransferError(f"pull from {addr}: malformed control frame: {e!r}") from e
    finally:
        conn.close()


async def _pull(conn: FrameConn, pull: PullRequest, pages: KVPages,
                dst_blocks: list[int]) -> PullResult:  # fmt: skip
    """`pull_kv`'s exchange over its open connection."""
    tag = request_tag(pull.request_id)
    lay = pages.layout
    frame, nonce = pull_frame(pull)
    await conn.send(frame)
    kind, body = await conn.read_control(tag)
    if kind == ERROR:
        raise KVTransferError(f"the prefill worker refused: {_message(body)}",
                              _source_failed(body, False))  # fmt: skip
    if kind != ACCEPT:
        raise KVTransferError(f"expected ACCEPT, got {KIND_NAMES[kind]}")
    body = _object(kind, body)
    proof = body.get("proof")
    if not isinstance(proof, str) or not hmac.compare_digest(
        proof.encode(errors="surrogateescape"), accept_proof(pull.secret, nonce, tag).encode()
    ):  # a peer that is not the cluster's (or has another secret): nothing it sends is taken
        raise KVTransferError("the peer's ACCEPT does not prove it knows the shared secret")
    if body.get("layout") != asdict(lay):
        raise KVTransferError(f"KV layout mismatch: {body.get('layout')} vs {asdict(lay)}", False)
    if body.get("num_blocks") != len(dst_blocks):
        raise KVTransferError(
            f"the prefill worker offers {body.get('num_blocks')!r} blocks, {len(dst_blocks)} "
            "reserved"
        )
    first = pull.first_block
    received = torch.zeros(lay.num_layers, len(dst_blocks), dtype=torch.bool)
    nbytes = frames = 0
    while True:
        h = await conn.read_header()  # (the peer's silence limited by conn.recv_idle_s)
        if h.tag != tag:
            raise KVTransferError("frame for another request")
        if h.kind != DATA:
            kind, body = await conn.read_control(tag, h)
            if kind == KEEPALIVE:  # the prefill is still running
                continue
            if kind == ERROR:
                raise KVTransferError(f"the prefill worker failed: {_message(body)}",
                                      _source_failed(body, True))  # fmt: skip
            if kind != END:
                raise KVTransferError(f"unexpected {KIND_NAMES[kind]} frame")
            break
        b0, nb = h.block_start - first, h.block_count
        l0, nl = h.layer_start, h.layer_count
        if nb < 1 or nl < 1 or b0 < 0 or b0 + nb > len(dst_blocks) or l0 + nl > lay.num_layers:
            raise KVTransferError(
                f"DATA frame out of range: layers {l0}+{nl}, blocks {h.block_start}+{nb}"
            )
        expect = nl * nb * lay.bytes_per_layer_block()
        if h.length != expect:
            raise KVTransferError(f"DATA frame of {h.length} bytes, expected {expect}")
        if received[l0 : l0 + nl, b0 : b0 + nb].any():
            raise KVTransferError("a block arrived twice")
        layers, blocks = slice(l0, l0 + nl), dst_blocks[b0 : b0 + nb]
        await _land(conn, pages, layers, blocks, h)
        received[l0 : l0 + nl, b0 : b0 + nb] = True
        nbytes += h.length
        frames += 1
    if not bool(received.all()):
        missing = int((~received).sum())
        raise KVTransferError(f"the transfer ended with {missing} (layer, block) pairs missing")
    end = _object(END, body)
    if end.get("frames") != frames:
        raise KVTransferError(f"END says {end.get('frames')!r} frames, {frames} arrived")
    # tokens of the pull the prefill side found in its own prefix cache: at most all of them
    cached = end.get("cached_tokens", 0)
    if type(cached) is not int or not 0 <= cached <= len(pull.token_ids):
        raise KVTransferError(
            f"END says {cached!r} cached tokens, not a count in [0, {len(pull.token_ids)}]"
        )
    await conn.send_control(ACK, tag, {})
    return PullResult(len(dst_blocks), nbytes, frames, cached)


def _object(kind: int, body: Any) -> dict[str, Any]:
    """A control frame's body, which must be a JSON object."""
    if not isinstance(body, dict):
        raise KVTransferError(
            f"malformed {KIND_NAMES[kind]} frame: a JSON object expected, got {type(body).__name__}"
        )
    return body


def _message(body: Any) -> str:
    """An ERROR frame's message, whatever its body (shortened: it goes into ours)."""
    text = body.get("message") if isinstance(body, dict) else None
    if not isinstance(text, str):
        text = f"(malformed ERROR frame: {orjson.dumps(body).decode()})"
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


def _source_failed(body: Any, default: bool) -> bool:
    """An ERROR frame's word on whether the prefill side failed (True) or refused (False);
    a malformed ERROR frame is a failure, whatever it says."""
    if not isinstance(body, dict) or not isinstance(body.get("message"), str):
        return True
    said = body.get("source_failed")
    return said if isinstance(said, bool) else default


async def _land(conn: FrameConn, pages: KVPages, layers: slice, blocks: list[int],
                h: _Header) -> None:  # fmt: skip
    """Receive a DATA payload into its blocks (straight into the cache where they are
    consecutive, else through one buffer and a scatter) and check its checksum, hashing each
    chunk while the next one arrives. The peer's silence is limited by `conn.recv_idle_s` (no
    byte for that long: TimeoutError), not the frame's whole time, so a slow but steady link
    is not cut off. A write run in a thread (pages not `direct`) is awaited to its end, even if
    the caller is cancelled meanwhile (a thread cannot be stopped): once this returns or raises,
    nothing writes into `blocks`, which the caller may then free. The idle limit is the peer's,
    not the write's (a write waits for the engine's step): it does not cover the write."""
    staged = await _receive(conn, pages, layers, blocks, h)
    if staged is None:
        return
    if pages.direct:
        pages.write(layers, blocks, staged)
        return
    # scattered to other processes, between engine steps: off the event loop
    write = asyncio.ensure_future(asyncio.to_thread(pages.write, layers, blocks, staged))
    try:
        await asyncio.shield(write)
    except asyncio.CancelledError:
        while not write.done():  # cancelled again meanwhile: still wait
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({write})
        raise


async def _receive(conn: FrameConn, pages: KVPages, layers: slice, blocks: list[int],
                   h: _Header) -> bytearray | None:  # fmt: skip
    """A DATA payload received and checked: into the cache (None), or into a buffer that
    `pages.write` must scatter (returned)."""
    views = pages.runs(layers, blocks) if pages.direct else []
    staged = None
    if not pages.direct or h.length < MIN_RUN_BYTES * len(views):
        staged = bytearray(h.length)
        views = [memoryview(staged)]
    dtype = getattr(torch, pages.layout.dtype)
    check = dtype.is_floating_point
    digest = xxhash.xxh3_64()
    for chunk in _chunks(views):
        await conn.recv_into(chunk)
        digest.update(chunk)
        if check and not _finite(chunk, dtype):  # checked while the chunk is in the CPU's cache
            raise KVTransferError(
                f"DATA frame for layers {h.layer_start}+{h.layer_count}, blocks "
                f"{h.block_start}+{h.block_count} holds values that are not finite (NaN or inf)"
            )
    (expected,) = TRAILER.unpack(await conn.recv(TRAILER.size))
    if digest.intdigest() != expected:
        raise KVTransferError("DATA frame failed its checksum")
    return staged


def _finite(chunk: memoryview, dtype: torch.dtype) -> bool:
    """Whether every value in `chunk` (whole values of `dtype`: chunks split runs of whole
    blocks at CHUNK_BYTES) is finite."""
    # (the chunk was received into: writable memory, which torch.frombuffer takes silently)
    return bool(torch.isfinite(torch.frombuffer(chunk, dtype=dtype)).all())
