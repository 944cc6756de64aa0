"""KV transfer between two real engines in one process, over real TCP on loopback.

The prefill side (an AsyncLLM behind a KVTransferServer) computes the prompt's KV and streams it;
the decode side reserves blocks, pulls, and decodes. Checked: every layer's keys and values
arrive bit-exact, the decode gives the same tokens as one engine alone, no block leaks on either
side whatever fails (bad checksum, truncated stream, hang-up, no acknowledgement), and a prompt
that does not fit is refused before any byte moves.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from pathlib import Path

import orjson
import pytest
import torch
import xxhash

from kvstore import kv_transfer
from kvstore.kv_transfer import (
    DATA,
    HEADER,
    DeviceKVPages,
    ExportProgress,
    FrameConn,
    KVPages,
    KVTransferError,
    KVTransferServer,
    PullRequest,
    pull_kv,
)
from runtime.async_engine import AsyncLLM
from runtime.config import EngineConfig
from runtime.disagg import KVCacheFullError, KVImporter, export_server
from runtime.engine import LLMEngine
from runtime.sampling_params import SamplingParams
from runtime.scheduler import QueueFullError

SECRET = "s3cret"
BS = 16


def _llm(model: Path, kv_bytes: int = 4_000_000, **kw) -> AsyncLLM:  # type: ignore[no-untyped-def]
    cfg = EngineConfig(str(model), block_size=BS, kv_cache_bytes=kv_bytes, num_threads=1, **kw)
    return AsyncLLM(LLMEngine(cfg))


@pytest.fixture(scope="module")
def engines(stories_dir: Path):  # type: ignore[no-untyped-def]
    prefill, decode, alone = _llm(stories_dir), _llm(stories_dir), _llm(stories_dir)
    yield prefill, decode, alone
    for llm in (prefill, decode, alone):
        llm.shutdown()


STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big red ball under a tree and ran to get it. Tom, her friend, "
    "wanted the ball too. They were sad, then they shared it and played all day. "
)
_TOKENS: list[int] = []


def _prompt(n: int, offset: int = 0) -> list[int]:
    """n tokens of real text (random tokens make near-ties the greedy choice trips over)."""
    if not _TOKENS:
        from runtime.tokenizer import Tokenizer
        from tests.conftest import STORIES

        tok = Tokenizer.from_dir(STORIES)
        _TOKENS.extend(tok.encode(STORY * 12))
    return [1, *_TOKENS[1 + offset : n + offset]]


async def _collect(stream) -> list[int]:  # type: ignore[no-untyped-def]
    tokens: list[int] = []
    async for out in stream:
        tokens = out.outputs[0].token_ids
    return tokens


async def _with_server(prefill: AsyncLLM, body: Callable[[str, KVTransferServer], Awaitable[None]],
                       hold_s: float = 5.0) -> None:  # fmt: skip
    server = export_server(prefill, SECRET, hold_s)
    port = await server.start("127.0.0.1", 0)
    try:
        await body(f"127.0.0.1:{port}", server)
    finally:
        await server.close()


async def _settled(*llms: AsyncLLM) -> None:
    """Wait until each engine has run its queued calls (stats are refreshed after each)."""
    for llm in llms:
        await llm.call(lambda e: None)


def _allocated(llm: AsyncLLM) -> int:
    return llm.engine.blocks.num_blocks - llm.engine.blocks.num_free_blocks


async def _read_pull(reader: asyncio.StreamReader) -> tuple[PullRequest, str]:
    """A scripted prefill peer's read of a PULL (its body, then its HMAC): the request, and the
    `proof` its ACCEPT must carry (a peer that knows the secret)."""
    head = HEADER.unpack(await reader.readexactly(HEADER.size))
    body = orjson.loads(await reader.readexactly(head[7]))
    await reader.readexactly(kv_transfer.MAC)
    nonce = bytes.fromhex(body.pop("nonce"))
    pull = PullRequest(**body, secret="")
    tag = kv_transfer.request_tag(pull.request_id)
    _PROOFS[tag] = kv_transfer.accept_proof(SECRET, nonce, tag)
    return pull, _PROOFS[tag]


_PROOFS: dict[int, str] = {}  # by request tag: the proof of the latest PULL a scripted peer read


@pytest.mark.parametrize("n_prompt", [2, 17, 33, 97, 300])
@pytest.mark.parametrize("seed", [None, 7])
def test_disaggregated_decode_equals_one_engine(engines, n_prompt: int, seed: int | None) -> None:  # type: ignore[no-untyped-def]
    prefill, decode, alone = engines
    params = dict(max_tokens=24, temperature=0.0 if seed is None else 0.9, seed=seed)

    async def main() -> None:
        rid = f"r{n_prompt}-{seed}"
        expected = await _collect(alone.submit(_prompt(n_prompt), SamplingParams(**params), rid))

        async def body(addr: str, server: KVTransferServer) -> None:
            group = decode.engine.prepare_request(rid, _prompt(n_prompt), SamplingParams(**params))
            stream, result = await KVImporter(decode, SECRET).submit(group, addr)
            assert await _collect(stream) == expected
            # None: every block was in the decode side's prefix cache (an earlier case's prompt)
            assert result is None or 1 <= result.blocks <= -(-(n_prompt - 1) // BS)

        await _with_server(prefill, body)
        await _settled(prefill, decode)
        assert _allocated(prefill) == 0 and _allocated(decode) == 0

    asyncio.run(main())


def test_every_layer_arrives_bit_exact(engines) -> None:  # type: ignore[no-untyped-def]
    prefill, decode, _ = engines
    prompt = _prompt(150, offset=5)

    async def main() -> None:
        async def body(addr: str, server: KVTransferServer) -> None:
            # pull by hand (no decode afterwards) so both caches can be compared
            reserved = await decode.call(lambda e: e.reserve_import(
                e.prepare_request("exact", prompt, SamplingParams(max_tokens=1))))  # fmt: skip
            assert reserved is not None
            cached, dst = reserved
            assert cached == 0 and len(dst) == -(-149 // BS)
            pages = KVPages(decode.engine.runner.kv, BS)
            pull = PullRequest("exact", prompt[:-1], 0, decode.engine.cache_id, SECRET)
            result = await pull_kv(addr, pull, pages, dst)
            assert result.blocks == len(dst) and result.frames >= 1
            assert result.bytes == len(dst) * pages.layout.bytes_per_layer_block() * 5
            # the prefill side's copy: the same prompt again is a full prefix-cache hit there
            src = prefill.engine.blocks
            table = src.block_table("probe")
            assert table == []
            got = src.match_prefix("probe", prompt)
            table = src.block_table("probe")
            assert got == 144  # 9 full blocks cached; the 10th (5 tokens) was freed with the export
            p_kv = KVPages(prefill.engine.runner.kv, BS).blocks
            d_kv = pages.blocks
            for i in range(9):
                assert torch.equal(p_kv[:, :, table[i]], d_kv[:, :, dst[i]]), f"block {i}"
            src.free("probe")
            await decode.call(lambda e: e.cancel_import(e._imports["exact"]))

        # the prefill side must not evict the blocks before the comparison: ample cache, and the
        # comparison reads its prefix cache right after the pull
        await _with_server(prefill, body)

    asyncio.run(main())


def test_prefix_hit_on_the_decode_side_skips_those_blocks(engines) -> None:  # type: ignore[no-untyped-def]
    prefill, decode, alone = engines
    shared = _prompt(200)
    first, second = shared[:120], shared[:120] + _prompt(60, offset=37)[1:]
    params = SamplingParams(max_tokens=8, temperature=0)

    async def main() -> None:
        expected = await _collect(alone.submit(second, params, "hit-ref"))

        async def body(addr: str, server: KVTransferServer) -> None:
            importer = KVImporter(decode, SECRET)
            g1 = decode.engine.prepare_request("hit-1", first, params)
            await _collect((await importer.submit(g1, addr))[0])
            sent_before = server.bytes_sent
            g2 = decode.engine.prepare_request("hit-2", second, params)
            stream, result = await importer.submit(g2, addr)
            assert await _collect(stream) == expected
            assert result is not None
            per_block = importer.pages.layout.bytes_per_layer_block() * 5
            skipped = 112 // BS  # the 7 full blocks of `first` (119 tokens were pulled)
            assert result.blocks == -(-(len(second) - 1) // BS) - skipped
            assert server.bytes_sent - sent_before == result.blocks * per_block

        await _with_server(prefill, body)
        await _settled(prefill, decode)
        assert _allocated(prefill) == 0 and _allocated(decode) == 0

    asyncio.run(main())


def _on_small_engine(stories_dir: Path, prefill: AsyncLLM,
                     body: Callable[[AsyncLLM, str, KVTransferServer], Awaitable[None]],
                     **kw) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """Run `body(small, addr, server)` against a decode engine of 20 blocks (320 tokens) and
    `prefill`'s export server; afterwards the small engine holds no block."""
    small = _llm(stories_dir, kv_bytes=20 * 5 * 2 * BS * 4 * 8 * 4, **kw)

    async def main() -> None:
        await _with_server(prefill, lambda addr, server: body(small, addr, server))
        await _settled(small)
        assert _allocated(small) == 0

    try:
        asyncio.run(main())
    finally:
        small.shutdown()


def test_no_room_is_refused_before_any_byte_moves(stories_dir: Path, engines) -> None:  # type: ignore[no-untyped-def]
    async def body(small: AsyncLLM, addr: str, server: KVTransferServer) -> None:
        # 400 tokens do not fit in 20 blocks: engine validation refuses max_tokens first
        g = small.engine.prepare_request("big", _prompt(300), SamplingParams(max_tokens=8))
        hog = small.engine.prepare_request("hog", _prompt(250), SamplingParams(max_tokens=8))
        assert await small.call(lambda e: e.reserve_import(hog)) is not None
        t0 = time.monotonic()
        with pytest.raises(KVCacheFullError, match=r"within 0\.3 s"):
            await KVImporter(small, SECRET, wait_s=0.3).submit(g, addr)
        assert time.monotonic() - t0 >= 0.3  # it waited for room first
        assert server.bytes_sent == 0 and server.pulls_served == 0
        await small.call(lambda e: e.cancel_import(hog))

    _on_small_engine(stories_dir, engines[0], body)


def test_an_import_waits_for_room_in_arrival_order(stories_dir: Path, engines) -> None:  # type: ignore[no-untyped-def]
    """With the cache full, imports wait (as a colocated request waits in the queue) and go
    in the order they came once blocks are freed; past the queue's bound they are refused."""
    prefill, _, alone = engines
    params = SamplingParams(max_tokens=8, temperature=0.0)

    async def reference() -> list[int]:
        return await _collect(alone.submit(_prompt(200), params, "wait-ref"))

    expected = asyncio.run(reference())

    async def body(small: AsyncLLM, addr: str, server: KVTransferServer) -> None:
        hog = small.engine.prepare_request("hog", _prompt(250), params)
        assert await small.call(lambda e: e.reserve_import(hog)) is not None
        importer = KVImporter(small, SECRET, wait_s=30)
        order: list[str] = []

        async def run(rid: str, n: int, offset: int = 0) -> list[int]:
            group = small.engine.prepare_request(rid, _prompt(n, offset), params)
            stream, _ = await importer.submit(group, addr)
            order.append(rid)
            return await _collect(stream)

        first = asyncio.create_task(run("first", 200))
        await asyncio.sleep(0.05)
        # fits sooner, but comes second; its own text (from `first`'s, its first block would be
        # in the cache once `first` is in, and it might then need no pull at all)
        second = asyncio.create_task(run("second", 17, offset=300))
        await asyncio.sleep(0.2)
        assert importer.waiting == 2 and server.pulls_served == 0
        third = small.engine.prepare_request("third", _prompt(17), params)
        with pytest.raises(QueueFullError, match="2 imports already wait"):
            await importer.submit(third, addr)
        await small.call(lambda e: e.cancel_import(hog))  # the running request ends
        assert await first == expected
        await second
        assert order == ["first", "second"] and server.pulls_served == 2

    _on_small_engine(stories_dir, prefill, body, max_waiting=2)


def test_waits_for_room_count_from_each_import_s_arrival(stories_dir: Path, engines) -> None:  # type: ignore[no-untyped-def]
    """Three imports behind a full cache, wait_s 0.5: each is refused about 0.5 s after it
    came, not 0.5 s after the one before it gave up."""
    params = SamplingParams(max_tokens=8, temperature=0.0)

    async def body(small: AsyncLLM, addr: str, server: KVTransferServer) -> None:
        hog = small.engine.prepare_request("hog", _prompt(250), params)
        assert await small.call(lambda e: e.reserve_import(hog)) is not None
        importer = KVImporter(small, SECRET, wait_s=0.5)

        async def one(rid: str) -> float:
            group = small.engine.prepare_request(rid, _prompt(200), params)
            with pytest.raises(KVCacheFullError):
                await importer.submit(group, addr)
            return time.monotonic() - t0

        t0 = time.monotonic()
        waited = await asyncio.gather(*(one(f"late-{k}") for k in range(3)))
        assert all(0.45 <= w < 1.0 for w in waited), waited
        await small.call(lambda e: e.cancel_import(hog))

    _on_small_engine(stories_dir, engines[0], body)


def test_a_client_leaving_while_its_blocks_are_reserved_leaks_none(engines) -> None:  # type: ignore[no-untyped-def]
    """The reservation runs on the engine thread whether or not its caller still waits: one
    cancelled while queued there is undone behind it."""
    prefill, decode, _ = engines
    params = SamplingParams(max_tokens=8, temperature=0.0)

    async def main() -> None:
        async def body(addr: str, server: KVTransferServer) -> None:
            for k in range(5):
                busy = decode.call(lambda e: time.sleep(0.05))  # the engine thread is busy
                group = decode.engine.prepare_request(f"gone-{k}", _prompt(100), params)
                task = asyncio.create_task(KVImporter(decode, SECRET).submit(group, addr))
                await asyncio.sleep(0.01 * k)  # while queued, or while reserving, or later
                task.cancel()
                try:
                    stream, _ = await task
                    stream.close()  # it got through first: the client leaves now
                except asyncio.CancelledError:
                    pass
                await busy
                await _settled(decode)
                assert _allocated(decode) == 0 and not decode.engine._imports

        await _with_server(prefill, body)
        await _settled(prefill, decode)
        assert _allocated(prefill) == 0

    asyncio.run(main())


def test_an_import_takes_no_blocks_ahead_of_a_waiting_request_or_a_full_house(
    stories_dir: Path,
) -> None:
    """As the scheduler admits a new request: not while a request waits for blocks ahead of it,
    not beyond max_num_seqs, and not the last blocks the running requests grow into."""
    params = SamplingParams(max_tokens=8)
    engine = LLMEngine(EngineConfig(str(stories_dir), block_size=BS, num_threads=1,
                                    kv_cache_bytes=20 * 5 * 2 * BS * 4 * 8 * 4, max_num_seqs=2))
    hog = engine.prepare_request("hog", _prompt(250), params)
    assert engine.reserve_import(hog) is not None  # 16 of 20 blocks
    engine.add_request("new", _prompt(120), params)  # waits: 8 blocks needed
    engine.step()
    small = engine.prepare_request("small", _prompt(17), params)
    assert engine.reserve_import(small) is None  # "new" came first
    engine.cancel_import(hog)
    engine.step()  # "new" runs now, in 8 blocks: 12 are free
    fill = engine.prepare_request("fill", _prompt(193, offset=300), params)  # 12 blocks
    assert engine.reserve_import(fill) is None  # none would be left for "new" to grow into
    assert engine.reserve_import(small) is not None  # 2 seats: "new" and "small"
    third = engine.prepare_request("third", _prompt(17), params)
    assert engine.reserve_import(third) is None  # no seat left
    engine.cancel_import(small)
    engine.abort("new")
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_request_id_whose_blocks_are_still_held_is_refused(stories_dir: Path) -> None:
    """A reserved import's id, or a finished export's held until released, is in use: a new
    request under it would take those blocks for its own (the scheduler reads a block table as
    an import's), and the import's cancel or the export's release would free them under it."""
    from runtime.sampling_params import InvalidRequestError

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = LLMEngine(EngineConfig(str(stories_dir), block_size=BS, num_threads=1,
                                    kv_cache_bytes=20 * 5 * 2 * BS * 4 * 8 * 4))  # fmt: skip
    imported = engine.prepare_request("r", _prompt(50), params)
    assert engine.reserve_import(imported) is not None
    for use in (lambda: engine.add_request("r", _prompt(10), params),
                lambda: engine.reserve_import(engine.prepare_request("r", _prompt(20), params))):  # fmt: skip
        with pytest.raises(InvalidRequestError, match="already in use"):
            use()
    engine.enqueue(engine.prepare_request("e", _prompt(40), SamplingParams(max_tokens=1),
                                          hold_kv=True))  # fmt: skip
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(InvalidRequestError, match="already in use"):  # held: not released yet
        engine.add_request("e", _prompt(10), params)
    engine.release_kv("e")
    engine.add_request("e", _prompt(10), params)  # released: the id is free again
    engine.cancel_import(imported)
    engine.add_request("r", _prompt(10), params)
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_the_engine_thread_outlives_a_caller_s_closed_loop(engines) -> None:  # type: ignore[no-untyped-def]
    """A request left unread when its event loop closed (a handler or a test gone) is aborted
    when its next output finds the loop closed; the engine keeps serving the next caller."""
    _, decode, _ = engines

    async def leave() -> None:
        decode.submit(_prompt(50), SamplingParams(max_tokens=64), "left-behind")

    asyncio.run(leave())  # the loop closes with the request running

    async def after() -> bool:
        await asyncio.sleep(0.3)  # its outputs came, found the loop closed: aborted
        return await decode.call(lambda e: "left-behind" in e._groups)

    assert asyncio.run(after()) is False
    assert decode._thread.is_alive()
    asyncio.run(_settled(decode))
    assert _allocated(decode) == 0


def test_an_engine_blocked_on_imports_does_not_spin(stories_dir: Path) -> None:
    """A request that cannot start until an import's blocks are freed: the engine thread waits
    instead of running empty steps."""
    small = _llm(stories_dir, kv_bytes=20 * 5 * 2 * BS * 4 * 8 * 4)
    params = SamplingParams(max_tokens=8)

    async def main() -> None:
        hog = small.engine.prepare_request("hog", _prompt(250), params)
        assert await small.call(lambda e: e.reserve_import(hog)) is not None
        stream = small.submit(_prompt(120), params, "blocked")
        await asyncio.sleep(0.1)
        tid = small._thread.native_id
        ticks = os.sysconf("SC_CLK_TCK")

        def cpu() -> float:
            f = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / ticks

        before = cpu()
        await asyncio.sleep(1.0)
        assert cpu() - before < 0.3  # spinning, it took the whole second
        await small.call(lambda e: e.cancel_import(hog))
        assert await _collect(stream)

    try:
        asyncio.run(main())
    finally:
        small.shutdown()


async def _evil_server(mutate: Callable[[bytes], bytes | None]) -> tuple[asyncio.Server, str]:
    """A peer that answers a pull like the real one would, but passes its DATA frames through
    `mutate` (None: hang up there)."""

    def control(kind: int, tag: int, obj: object) -> bytes:
        body = orjson.dumps(obj)
        return kv_transfer._frame(kind, tag, body) + body

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pull, proof = await _read_pull(reader)
        tag = kv_transfer.request_tag(pull.request_id)
        layout = {"num_layers": 5, "block_size": BS, "num_kv_heads": 4, "head_dim": 8,
                  "dtype": "float32"}  # fmt: skip
        writer.write(control(kv_transfer.ACCEPT, tag,
                             {"num_blocks": 1, "layout": layout, "proof": proof}))  # fmt: skip
        payload = torch.ones(5, 2, 1, BS, 4, 8).numpy().tobytes()
        head = kv_transfer._header(DATA, tag, len(payload), 0, (0, 5), (0, 1))
        trailer = kv_transfer.TRAILER.pack(xxhash.xxh3_64_intdigest(payload))
        frame = head + payload + trailer
        out = mutate(frame)
        if out is None:
            writer.write(frame[: len(frame) // 2])
            await writer.drain()
            writer.close()
            return
        writer.write(out + control(kv_transfer.END, tag, {"frames": 1}))
        await reader.read(1)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _flip_payload_byte(frame: bytes) -> bytes:
    b = bytearray(frame)
    b[-20] ^= 0x40  # inside the payload, before the 8-byte checksum trailer
    return bytes(b)


def _lie_about_size(frame: bytes) -> bytes:
    head = list(HEADER.unpack(frame[: HEADER.size]))
    head[4] = 2  # claims two blocks
    return HEADER.pack(*head) + frame[HEADER.size :]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (_flip_payload_byte, "checksum"),
        (_lie_about_size, "out of range"),
        (lambda f: None, "closed the connection mid-transfer"),
        (lambda f: b"XXXX" + f[4:], "magic"),
    ],
)
def test_corrupt_or_truncated_frames_are_rejected(engines, mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    _, decode, _ = engines

    async def main() -> None:
        server, addr = await _evil_server(mutate)
        try:
            group = decode.engine.prepare_request("evil", _prompt(10), SamplingParams(max_tokens=4))
            with pytest.raises(KVTransferError, match=message) as err:
                await KVImporter(decode, SECRET).submit(group, addr)
            assert err.value.source_failed
        finally:
            server.close()
        await _settled(decode)
        assert _allocated(decode) == 0

    asyncio.run(main())


def test_unreachable_source_and_wrong_secret(engines) -> None:  # type: ignore[no-untyped-def]
    prefill, decode, _ = engines

    async def main() -> None:
        importer = KVImporter(decode, SECRET)
        group = decode.engine.prepare_request("gone", _prompt(40), SamplingParams(max_tokens=4))
        with pytest.raises(KVTransferError, match="cannot reach"):
            await importer.submit(group, "127.0.0.1:1")

        async def body(addr: str, server: KVTransferServer) -> None:
            wrong = KVImporter(decode, "not-the-secret")
            g = decode.engine.prepare_request("wrong", _prompt(40), SamplingParams(max_tokens=4))
            with pytest.raises(KVTransferError, match="secret") as err:
                await wrong.submit(g, addr)
            assert not err.value.source_failed

        await _with_server(prefill, body)
        await _settled(prefill, decode)
        assert _allocated(prefill) == 0 and _allocated(decode) == 0

    asyncio.run(main())


async def pull_without_ack(addr: str, pull: PullRequest) -> FrameConn:
    """A puller that reads every frame up to END and then says nothing (a decode worker that
    died, or hangs); returns its open connection."""
    host, port = addr.rsplit(":", 1)
    conn = await FrameConn.connect(host, int(port))
    await conn.send(kv_transfer.pull_frame(pull)[0])
    while True:
        h = await conn.read_header()
        await conn.recv(h.length + (kv_transfer.TRAILER.size if h.kind == DATA else 0))
        if h.kind == kv_transfer.END:
            return conn


def test_puller_that_never_acknowledges_is_released_at_the_deadline(engines) -> None:  # type: ignore[no-untyped-def]
    prefill, _, _ = engines
    prompt = _prompt(80)

    async def main() -> None:
        async def body(addr: str, server: KVTransferServer) -> None:
            pull = PullRequest("silent", prompt, 0, prefill.engine.cache_id, SECRET)
            conn = await pull_without_ack(addr, pull)
            await _settled(prefill)
            assert _allocated(prefill) == 5  # held for the puller
            await asyncio.sleep(1.5)  # past hold_s
            await _settled(prefill)
            assert _allocated(prefill) == 0
            assert server.pulls_failed == 1
            conn.close()

        await _with_server(prefill, body, hold_s=1.0)

    asyncio.run(main())


def test_a_retried_request_pulls_while_its_first_pull_is_still_held(engines) -> None:  # type: ignore[no-untyped-def]
    """A decode worker died after its pull's END, before its ACK: the prefill side still holds
    that export. The gateway retries the request (the same request id) through another decode
    worker, which pulls from the same prefill worker, and is served. (Each pull now has an id of
    its own; a retry that reached a prefill worker whose first export of the request was still
    running was refused as "already in use", which set a healthy prefill worker aside. That
    race is not reproduced here: a held export does not refuse a second one.)"""
    prefill, decode, _ = engines
    prompt = _prompt(80)

    async def main() -> None:
        async def body(addr: str, server: KVTransferServer) -> None:
            group = decode.engine.prepare_request("retried", prompt, SamplingParams(max_tokens=2))
            # the earlier pull of the same request (as an id without a nonce would name it)
            first = PullRequest("retried", prompt[:-1], 0, prefill.engine.cache_id, SECRET)
            conn = await pull_without_ack(addr, first)  # held for a puller that is gone
            stream, _ = await KVImporter(decode, SECRET).submit(group, addr)
            assert len(await _collect(stream)) == 2  # the retry's pull was served
            conn.close()

        await _with_server(prefill, body, hold_s=30.0)

    asyncio.run(main())


def test_frame_header_layout() -> None:
    assert HEADER.size == 38
    raw = kv_transfer._frame(DATA, 5, b"abc", layers=(2, 3), blocks=(4, 1))
    magic, kind, l0, nl, b0, nb, tag, length, _digest = struct.unpack("<4sBxHHIIQIQ", raw)
    assert (magic, kind, l0, nl, b0, nb, tag, length) == (b"EIKV", DATA, 2, 3, 4, 1, 5, 3)


def test_blocks_stream_while_a_chunked_prefill_computes(stories_dir: Path, engines) -> None:  # type: ignore[no-untyped-def]
    """With a 64-token step budget a 300-token prompt is prefilled in 5 chunks: the blocks each
    chunk completes leave before the next chunk is computed (one batch of frames per chunk)."""
    _, decode, alone = engines
    chunked = _llm(stories_dir, max_num_batched_tokens=64)
    prompt = _prompt(300, offset=11)
    params = SamplingParams(max_tokens=8, temperature=0)

    async def main() -> None:
        expected = await _collect(alone.submit(prompt, params, "chunk-ref"))

        async def body(addr: str, server: KVTransferServer) -> None:
            group = decode.engine.prepare_request("chunked", prompt, params)
            stream, result = await KVImporter(decode, SECRET).submit(group, addr)
            assert await _collect(stream) == expected
            assert result is not None and result.frames >= 5  # one frame per chunk at least

        await _with_server(chunked, body)
        await _settled(chunked, decode)
        assert _allocated(chunked) == 0 and _allocated(decode) == 0

    try:
        asyncio.run(main())
    finally:
        chunked.shutdown()


@pytest.mark.parametrize(
    "src, dst",
    [
        (list(range(10, 40)), list(range(50, 80))),  # consecutive: sent and received in place
        (list(range(10, 40)), list(range(99, 39, -2))),  # scattered destination: one scatter
        (list(range(70, 10, -2)), list(range(50, 80))),  # scattered source: one gather
    ],
)
@pytest.mark.parametrize("pages", [KVPages, DeviceKVPages], ids=["in-cache", "staged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_and_scattered_paths_are_bit_exact(src: list[int], dst: list[int],
                                                    pages: type[KVPages],
                                                    dtype: torch.dtype) -> None:  # fmt: skip
    """A cache of realistic block size (16 KB per layer's keys): blocks consecutive in the cache
    move without a copy, scattered ones through one buffer; both arrive bit-exact, in frames
    of several layers, and a pull of part of them (first_block) moves only that part. Staged
    (`DeviceKVPages`, a GPU worker's: every block through host memory, by index) the same; in
    float32 and in bfloat16 (a GPU worker's default), which numpy cannot view."""
    layers, heads, dim = 6, 4, 64
    g = torch.Generator().manual_seed(0)
    src_kv = torch.randn(layers, 2, 128 * BS, heads, dim, generator=g).to(dtype)
    dst_kv = torch.zeros_like(src_kv)
    src_pages, dst_pages = pages(src_kv, BS), pages(dst_kv, BS)
    tokens = list(range(len(src) * BS - 3))  # the last block partly filled

    async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
        yield ExportProgress(len(pull.token_ids) // 2, src, False)  # half, then the rest
        yield ExportProgress(len(pull.token_ids), src, True)

    async def release(request_id: str) -> None:
        return None

    async def main() -> None:
        server = KVTransferServer(src_pages, "c", SECRET, export, release, frame_bytes=1 << 20)
        port = await server.start("127.0.0.1", 0)
        try:
            result = await pull_kv(f"127.0.0.1:{port}", PullRequest("x", tokens, 0, "c", SECRET),
                                   dst_pages, dst)  # fmt: skip
            assert result.blocks == len(src) and result.frames >= 4
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(src_pages.blocks[:, :, s], dst_pages.blocks[:, :, d])
            dst_kv.zero_()
            part = await pull_kv(f"127.0.0.1:{port}", PullRequest("y", tokens, 20, "c", SECRET),
                                 dst_pages, dst[20:])  # fmt: skip
            assert part.blocks == len(src) - 20
            assert not dst_pages.blocks[:, :, dst[:20]].any()
            for s, d in zip(src[20:], dst[20:], strict=True):
                assert torch.equal(src_pages.blocks[:, :, s], dst_pages.blocks[:, :, d])
        finally:
            await server.close()

    asyncio.run(main())


def test_cancelled_pull_frees_both_sides(engines) -> None:  # type: ignore[no-untyped-def]
    """The client leaves mid-transfer (the decode worker's handler is cancelled): the decode
    side frees its reserved blocks and hangs up, and the prefill side releases its own."""
    _, decode, _ = engines
    lay = KVPages(decode.engine.runner.kv, BS).layout
    src = KVPages(torch.randn(lay.num_layers, 2, 64 * BS, lay.num_kv_heads, lay.head_dim), BS)
    never = asyncio.Event()
    released: list[str] = []

    async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
        yield ExportProgress(3 * BS, list(range(40)), False)  # 3 blocks ready, then a long wait
        await never.wait()

    async def release(request_id: str) -> None:
        released.append(request_id)

    async def main() -> None:
        server = KVTransferServer(src, decode.engine.cache_id, SECRET, export, release)
        port = await server.start("127.0.0.1", 0)
        try:
            group = decode.engine.prepare_request("leaver", _prompt(300, offset=23),
                                                  SamplingParams(max_tokens=4))  # fmt: skip
            task = asyncio.ensure_future(
                KVImporter(decode, SECRET).submit(group, f"127.0.0.1:{port}")
            )
            for _ in range(200):
                if server.bytes_sent:
                    break
                await asyncio.sleep(0.01)
            assert server.bytes_sent > 0 and _allocated(decode) > 0
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _settled(decode)
            assert _allocated(decode) == 0
            for _ in range(200):
                if released:
                    break
                await asyncio.sleep(0.01)
            # (each pull has an id of its own: the request's, then a nonce)
            assert [r.split(".")[0] for r in released] == ["leaver"] and server.active == 0
        finally:
            await server.close()

    asyncio.run(main())


def test_a_slow_prefill_keeps_the_pull_alive_and_a_hung_one_fails_it() -> None:
    """The prefill side sends KEEPALIVE frames while its prefill is queued or computing: a
    prefill slower than the puller's idle limit still arrives whole. A prefill worker that stops
    answering (a hung process sends nothing, keepalives included) fails the pull after the idle
    limit, so its decode worker gives up on it (502 kv_transfer_failed: prefilled elsewhere)."""
    layers, heads, dim = 2, 2, 8
    src_kv = torch.randn(layers, 2, 16 * BS, heads, dim, generator=torch.Generator().manual_seed(1))
    src_pages, dst_pages = KVPages(src_kv, BS), KVPages(torch.zeros_like(src_kv), BS)
    blocks = list(range(4))
    tokens = list(range(4 * BS - 1))
    stall = {"s": 2.5}  # seconds the prefill takes before its blocks are ready

    async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
        await asyncio.sleep(stall["s"])
        yield ExportProgress(len(pull.token_ids), blocks, True)

    async def release(request_id: str) -> None:
        return None

    async def main() -> None:
        server = KVTransferServer(src_pages, "c", SECRET, export, release)
        port = await server.start("127.0.0.1", 0)
        try:
            result = await pull_kv(f"127.0.0.1:{port}", PullRequest("slow", tokens, 0, "c", SECRET),
                                   dst_pages, blocks, idle_timeout_s=1.8)  # fmt: skip
            assert result.blocks == 4
            assert torch.equal(src_pages.blocks[:, :, blocks], dst_pages.blocks[:, :, blocks])
        finally:
            await server.close()

        # hung after its ACCEPT (a process stopped mid-prefill): silence, no keepalive
        async def hung(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            pull, proof = await _read_pull(reader)
            body = orjson.dumps({"num_blocks": 4, "layout": asdict(dst_pages.layout),
                                 "proof": proof})  # fmt: skip
            tag = kv_transfer.request_tag(pull.request_id)
            writer.write(kv_transfer._frame(kv_transfer.ACCEPT, tag, body) + body)
            await reader.read()  # until the puller hangs up

        peer = await asyncio.start_server(hung, "127.0.0.1", 0)
        addr = f"127.0.0.1:{peer.sockets[0].getsockname()[1]}"
        try:
            t0 = time.monotonic()
            with pytest.raises(KVTransferError, match="TimeoutError"):
                await pull_kv(addr, PullRequest("hung", tokens, 0, "c", SECRET), dst_pages,
                              blocks, idle_timeout_s=1.0)  # fmt: skip
            assert time.monotonic() - t0 < 5
        finally:
            peer.close()

    asyncio.run(main())


def test_an_import_under_way_counts_as_work_in_flight(engines) -> None:  # type: ignore[no-untyped-def]
    """While a decode worker pulls a prompt's KV there is no request stream yet; the importer
    counts the import (a worker's drain and role change wait for it: `set-role` reported a
    decode worker drained with two pulls under way, which then decoded on a prefill worker)."""
    prefill, decode, _ = engines
    go = asyncio.Event()

    async def main() -> None:
        inner = export_server(prefill, SECRET, 5.0)

        async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
            await go.wait()  # the prefill worker is slow to start this one
            async for progress in inner.export(pull):
                yield progress

        server = KVTransferServer(inner.pages, prefill.engine.cache_id, SECRET, export,
                                  inner.release)  # fmt: skip
        port = await server.start("127.0.0.1", 0)
        try:
            importer = KVImporter(decode, SECRET)
            group = decode.engine.prepare_request("busy", _prompt(40), SamplingParams(max_tokens=2))
            task = asyncio.ensure_future(importer.submit(group, f"127.0.0.1:{port}"))
            await asyncio.sleep(0.3)
            assert importer.active == 1 and not task.done()
            go.set()
            stream, _ = await task
            assert importer.active == 0
            assert len(await _collect(stream)) == 2
        finally:
            await server.close()

    asyncio.run(main())


def _slow_write(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event,
                                                          threading.Event]:  # fmt: skip
    """DeviceKVPages.write (a frame landing through a thread, as in a split or GPU cache) held
    until the test lets it go: (it started, let it go, it ended)."""
    started, go, ended = threading.Event(), threading.Event(), threading.Event()
    write = DeviceKVPages.write

    def held(self: DeviceKVPages, layers: slice, block_ids: list[int], payload: bytes) -> None:
        started.set()
        go.wait(30)
        write(self, layers, block_ids, payload)
        ended.set()

    monkeypatch.setattr(DeviceKVPages, "write", held)
    return started, go, ended


def test_a_cancelled_import_frees_its_blocks_only_after_its_last_write(
    engines, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A frame landing through a thread goes on when the import is cancelled (a thread cannot
    be stopped): the client leaving (twice here: a server shutting down cancels again) while it
    runs must not free the import's blocks until it has ended, or it lands in blocks another
    request was given meanwhile (a split decode worker's greedy answers changed so)."""
    _, decode, _ = engines
    lay = KVPages(decode.engine.runner.kv, BS).layout
    src = KVPages(torch.randn(lay.num_layers, 2, 64 * BS, lay.num_kv_heads, lay.head_dim), BS)
    never = asyncio.Event()
    started, go, ended = _slow_write(monkeypatch)
    freed: list[bool] = []  # per cancel_import: had the write ended
    cancel_import = decode.engine.cancel_import

    def recorded(group) -> None:  # type: ignore[no-untyped-def]
        freed.append(ended.is_set())
        cancel_import(group)

    monkeypatch.setattr(decode.engine, "cancel_import", recorded)

    async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
        yield ExportProgress(3 * BS, list(range(40)), False)  # 3 blocks ready, then a long wait
        await never.wait()

    async def release(request_id: str) -> None:
        return None

    async def main() -> None:
        server = KVTransferServer(src, decode.engine.cache_id, SECRET, export, release)
        port = await server.start("127.0.0.1", 0)
        try:
            importer = KVImporter(decode, SECRET)
            importer.pages = DeviceKVPages(decode.engine.runner.kv, BS)  # lands through a thread
            group = decode.engine.prepare_request("overtaken", _prompt(300, offset=23),
                                                  SamplingParams(max_tokens=4))  # fmt: skip
            task = asyncio.ensure_future(importer.submit(group, f"127.0.0.1:{port}"))
            assert await asyncio.to_thread(started.wait, 30)
            task.cancel()
            await asyncio.sleep(0)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=0.5)
            assert not done, "the import ended while a write into its blocks still ran"
            go.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _settled(decode)
            assert freed == [True] and _allocated(decode) == 0
        finally:
            go.set()
            await server.close()

    asyncio.run(main())


def test_a_write_outlasting_the_idle_limit_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame's write waits for the engine's step, which may take longer than the pull's idle
    limit. That limit is for the peer's silence: it neither fails the pull nor leaves the write
    running into blocks the caller frees once the pull has failed."""
    layers, heads, dim = 2, 2, 8
    src_kv = torch.randn(layers, 2, 16 * BS, heads, dim, generator=torch.Generator().manual_seed(2))
    src_pages, dst_pages = KVPages(src_kv, BS), DeviceKVPages(torch.zeros_like(src_kv), BS)
    blocks = list(range(4))
    tokens = list(range(4 * BS - 1))
    started, go, ended = _slow_write(monkeypatch)

    async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
        yield ExportProgress(len(pull.token_ids), blocks, True)

    async def release(request_id: str) -> None:
        return None

    async def main() -> None:
        server = KVTransferServer(src_pages, "c", SECRET, export, release)
        port = await server.start("127.0.0.1", 0)
        try:
            pull = PullRequest("slow-write", tokens, 0, "c", SECRET)
            addr = f"127.0.0.1:{port}"
            task = asyncio.ensure_future(pull_kv(addr, pull, dst_pages, blocks, idle_timeout_s=0.5))
            assert await asyncio.to_thread(started.wait, 30)
            done, _ = await asyncio.wait({task}, timeout=1.0)  # twice the idle limit
            assert not done, "the pull ended while a write into its blocks still ran"
            go.set()
            assert (await task).blocks == 4 and ended.is_set()
            assert torch.equal(src_pages.blocks[:, :, blocks], dst_pages.blocks[:, :, blocks])
        finally:
            go.set()
            await server.close()

    asyncio.run(main())


def test_a_refused_pull_leaves_another_pull_s_export_alone() -> None:
    """A PULL naming a request whose export is held for its puller (not yet acknowledged) is
    refused and touches nothing, whatever it gets wrong: without the secret (anyone who can
    reach the port), or a second PULL of it. Each released the held export, whose blocks the
    prefill worker then gave to other requests."""
    layers, heads, dim = 2, 2, 8
    src = KVPages(torch.randn(layers, 2, 16 * BS, heads, dim), BS)
    tokens = list(range(4 * BS - 1))  # 4 blocks
    released: list[str] = []

    async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
        yield ExportProgress(len(pull.token_ids), list(range(4)), True)

    async def release(request_id: str) -> None:
        released.append(request_id)

    async def main() -> None:
        server = KVTransferServer(src, "c", SECRET, export, release, hold_s=30.0)
        port = await server.start("127.0.0.1", 0)
        tag = kv_transfer.request_tag("held")
        try:
            held = await pull_without_ack(f"127.0.0.1:{port}",
                                          PullRequest("held", tokens, 0, "c", SECRET))  # fmt: skip
            for bad, why in [
                (PullRequest("held", [1, 2], 0, "x", "WRONG"), "secret"),
                (PullRequest("held", tokens, 0, "other-cache", SECRET), "layout"),
                (PullRequest("held", tokens, 9, "c", SECRET), "first_block"),
                (PullRequest("held", tokens, 0, "c", SECRET), "pulled already"),
            ]:
                conn = await FrameConn.connect("127.0.0.1", port)
                await conn.send(kv_transfer.pull_frame(bad)[0])
                kind, body = await conn.read_control(tag)
                assert kind == kv_transfer.ERROR and why in body["message"]
                with pytest.raises(asyncio.IncompleteReadError):  # the server is done with it
                    await conn.recv(1)
                conn.close()
                assert released == [], f"a PULL refused ({why}) released the held export"
            # its own puller acknowledges: released once, by its own connection
            await held.send_control(kv_transfer.ACK, tag, {})
            with pytest.raises(asyncio.IncompleteReadError):
                await held.recv(1)
            held.close()
            assert released == ["held"] and server.pulls_served == 1
        finally:
            await server.close()

    asyncio.run(main())


def test_a_pull_cancelled_as_a_frame_lands_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client leaves (its handler is cancelled) in the very loop turn a frame arrives: the
    pull ends with CancelledError. Python 3.11's asyncio.wait_for returned the frame and dropped
    the cancellation, so the pull read the prefill's keepalives for ever (a CI run hung on it)."""
    layers, heads, dim = 2, 2, 8
    src = torch.randn(layers, 2, 8 * BS, heads, dim, generator=torch.Generator().manual_seed(2))
    src_pages, dst_pages = KVPages(src, BS), KVPages(torch.zeros_like(src), BS)
    monkeypatch.setattr(kv_transfer, "KEEPALIVE_S", 0.05)
    never = asyncio.Event()

    async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
        await never.wait()  # a prefill that takes long: keepalives meanwhile
        yield ExportProgress(len(pull.token_ids), [0], True)

    async def release(request_id: str) -> None:
        return None

    real = kv_transfer.FrameConn.read_header
    puller: list[asyncio.Task[object]] = []

    async def read_header(self: kv_transfer.FrameConn) -> kv_transfer._Header:
        h = await real(self)
        if h.kind == kv_transfer.KEEPALIVE and puller:  # only the puller is sent keepalives
            puller[0].cancel()  # the client leaves as this frame lands
        return h

    monkeypatch.setattr(kv_transfer.FrameConn, "read_header", read_header)

    async def main() -> None:
        server = KVTransferServer(src_pages, "c", SECRET, export, release)
        port = await server.start("127.0.0.1", 0)
        try:
            task = asyncio.ensure_future(pull_kv(
                f"127.0.0.1:{port}", PullRequest("leaves", list(range(BS - 1)), 0, "c", SECRET),
                dst_pages, [0]))  # fmt: skip
            puller.append(task)
            done, _ = await asyncio.wait({task}, timeout=5)
            assert done, "the cancelled pull is still reading keepalives"
            assert task.cancelled()
        finally:
            never.set()
            await server.close()

    asyncio.run(main())


def test_a_puller_that_stops_reading_is_dropped_and_its_export_released() -> None:
    """A puller that stays connected but reads nothing (a frozen decode process) no longer
    holds the prefill side's send, and the export's KV blocks with it, until TCP gives up:
    after `send_timeout_s` without progress the pull fails and `release` frees them."""
    import socket

    kv = torch.zeros(8, 2, 1024 * BS, 8, 128)  # 64 KiB of KV a token: MBs for a 512-token pull
    pages = KVPages(kv, BS)
    released: list[str] = []

    async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
        n = len(pull.token_ids)
        yield ExportProgress(n, list(range(-(-n // BS))), True)

    async def release(request_id: str) -> None:
        released.append(request_id)

    async def main() -> None:
        server = KVTransferServer(pages, "c", SECRET, export, release, hold_s=30,
                                  send_timeout_s=1.0)  # fmt: skip
        port = await server.start("127.0.0.1", 0)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        try:
            sock.connect(("127.0.0.1", port))
            conn = kv_transfer.FrameConn(sock)
            pull = PullRequest("frozen", list(range(512)), 0, "c", SECRET)
            await conn.send(kv_transfer.pull_frame(pull)[0])
            kind, _ = await conn.read_control(None)
            assert kind == kv_transfer.ACCEPT
            for _ in range(100):  # then reads nothing more
                if released:
                    break
                await asyncio.sleep(0.05)
            assert released == ["frozen"] and server.active == 0 and server.pulls_failed == 1
        finally:
            sock.close()
            await server.close()

    asyncio.run(main())


def test_a_failed_accept_does_not_stop_the_server(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """accept() failing for a moment (out of descriptors) is logged and retried: later pulls
    are served, and close() still closes (the accept loop used to end with the error, leaving
    pullers to connect into the backlog unanswered, and close() re-raised it). Its repeats are
    summed up, not logged a line a second."""
    src = torch.randn(2, 2, 8 * BS, 2, 8, generator=torch.Generator().manual_seed(3))
    src_pages, dst_pages = KVPages(src, BS), KVPages(torch.zeros_like(src), BS)

    async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
        n = len(pull.token_ids)
        yield ExportProgress(n, list(range(-(-n // BS))), True)

    async def release(request_id: str) -> None:
        return None

    async def main() -> None:
        loop = asyncio.get_running_loop()
        real = loop.sock_accept
        failures = [OSError(24, "Too many open files")] * 2

        async def sock_accept(sock):  # type: ignore[no-untyped-def]
            if failures:
                raise failures.pop()
            return await real(sock)

        monkeypatch.setattr(loop, "sock_accept", sock_accept)
        server = KVTransferServer(src_pages, "c", SECRET, export, release)
        port = await server.start("127.0.0.1", 0)
        try:
            result = await pull_kv(f"127.0.0.1:{port}", PullRequest("after", list(range(40)), 0,
                                   "c", SECRET), dst_pages, [0, 1, 2], idle_timeout_s=5)  # fmt: skip
            assert result.blocks == 3 and not failures
            assert torch.equal(src_pages.blocks[:, :, :3], dst_pages.blocks[:, :, :3])
        finally:
            await server.close()
        assert server._listener is not None and server._listener.fileno() == -1

    with caplog.at_level(logging.WARNING, logger="edgeinfer.kv_transfer"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "accept failed" in r.getMessage()]
    assert len(lines) == 2 and "Too many open files" in lines[0], lines
    assert "(1 more like it" in lines[1], lines  # (at close)


def test_a_stalled_prefill_engine_sends_no_keepalives() -> None:
    """Keepalives say "the prefill is running": while the engine behind the export is hung
    (AsyncLLM.is_stalled), none is sent, so the puller's idle limit fails the pull instead of
    waiting for ever with its blocks reserved."""
    src = torch.randn(2, 2, 8 * BS, 2, 8, generator=torch.Generator().manual_seed(4))
    src_pages, dst_pages = KVPages(src, BS), KVPages(torch.zeros_like(src), BS)
    never = asyncio.Event()

    async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
        await never.wait()
        yield ExportProgress(len(pull.token_ids), [0], True)

    async def release(request_id: str) -> None:
        return None

    async def main() -> None:
        server = KVTransferServer(src_pages, "c", SECRET, export, release, stalled=lambda: True)
        port = await server.start("127.0.0.1", 0)
        try:
            t0 = time.monotonic()
            with pytest.raises(KVTransferError, match="TimeoutError"):
                await pull_kv(f"127.0.0.1:{port}", PullRequest("wedged", list(range(BS - 1)), 0,
                              "c", SECRET), dst_pages, [0], idle_timeout_s=2.5)  # fmt: skip
            assert time.monotonic() - t0 < 6
        finally:
            never.set()
            await server.close()

    asyncio.run(main())


def test_the_send_limit_outlasts_a_healthy_puller_s_pause() -> None:
    """A healthy puller reads nothing while its landing write waits for its engine's step,
    which may run up to ENGINE_STALL_S before its worker is taken for hung: the prefill side's
    send limit must outlast that, or it cuts healthy pulls (it was PULL_IDLE_S, 10 s)."""
    from runtime.async_engine import ENGINE_STALL_S

    assert kv_transfer.SEND_TIMEOUT_S >= ENGINE_STALL_S + kv_transfer.PULL_IDLE_S
    server = KVTransferServer(KVPages(torch.zeros(1, 2, BS, 1, 8), BS), "c", SECRET,
                              None, None)  # type: ignore[arg-type]  # fmt: skip
    assert server.send_timeout_s == kv_transfer.SEND_TIMEOUT_S


# ---------------------------------------------------------------------- hostile or broken peers
def _control(kind: int, tag: int, obj: object) -> bytes:
    """A control frame; an ACCEPT object without a `proof` gets the one for its request (a
    peer that knows the secret)."""
    if kind == kv_transfer.ACCEPT and isinstance(obj, dict) and tag in _PROOFS:
        obj = {"proof": _PROOFS[tag], **obj}
    body = orjson.dumps(obj)
    return kv_transfer._frame(kind, tag, body) + body


Script = Callable[[PullRequest, int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _scripted_peer(script: Script) -> tuple[asyncio.Server, str]:
    """A prefill peer that reads a PULL and then does what `script(pull, tag, reader, writer)`
    says."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pull, _ = await _read_pull(reader)
        try:
            await script(pull, kv_transfer.request_tag(pull.request_id), reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _data_frame(tag: int, payload: bytes, layers: int, blocks: tuple[int, int]) -> bytes:
    head = kv_transfer._header(DATA, tag, len(payload), 0, (0, layers), blocks)
    return head + payload + kv_transfer.TRAILER.pack(xxhash.xxh3_64_intdigest(payload))


def test_a_peer_stalling_inside_a_control_frame_fails_the_pull_at_the_idle_limit() -> None:
    """A KEEPALIVE (or END, ERROR) header whose body never comes: the idle limit covers the
    body too. Only the header was under it, and the pull (its reserved blocks, the decode
    worker's keepalives to the gateway, a drain) waited for ever."""
    pages = KVPages(torch.zeros(2, 2, 8 * BS, 2, 8), BS)

    async def script(pull: PullRequest, tag: int, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:  # fmt: skip
        writer.write(_control(kv_transfer.ACCEPT, tag,
                              {"num_blocks": 1, "layout": asdict(pages.layout)}))  # fmt: skip
        writer.write(kv_transfer._header(kv_transfer.KEEPALIVE, tag, 100, 0))  # no body follows
        await reader.read()

    async def main() -> None:
        server, addr = await _scripted_peer(script)
        try:
            pull = PullRequest("stall", list(range(BS - 1)), 0, "c", SECRET)
            task = asyncio.ensure_future(pull_kv(addr, pull, pages, [0], idle_timeout_s=0.5))
            done, _ = await asyncio.wait({task}, timeout=5)
            task.cancel()
            assert done, "the pull still waits for a control frame's body"
            with pytest.raises(KVTransferError, match="TimeoutError") as err:
                task.result()
            assert addr in str(err.value) and err.value.source_failed
        finally:
            server.close()

    asyncio.run(main())


def test_a_slow_but_steady_link_is_not_cut_off_and_a_silent_one_is() -> None:
    """The idle limit is for silence, not a deadline for a frame: a DATA frame that takes three
    times the limit to arrive, its bytes coming all along, lands (with a whole-frame limit of
    10 s, a link under ~0.8 MB/s failed every 8 MiB frame). A frame that stops halfway fails at
    the limit."""
    src = torch.randn(2, 2, 8 * BS, 2, 8, generator=torch.Generator().manual_seed(5))
    src_pages, dst_pages = KVPages(src, BS), KVPages(torch.zeros_like(src), BS)
    blocks = [0, 1, 2, 3]
    payload = b"".join(bytes(v) for v in src_pages.runs(slice(0, 2), blocks))
    stop_halfway = {"on": False}

    async def script(pull: PullRequest, tag: int, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:  # fmt: skip
        writer.write(_control(kv_transfer.ACCEPT, tag,
                              {"num_blocks": 4, "layout": asdict(src_pages.layout)}))  # fmt: skip
        frame = _data_frame(tag, payload, 2, (0, 4))
        if stop_halfway["on"]:
            writer.write(frame[: len(frame) // 2])
            await reader.read()
            return
        step = -(-len(frame) // 8)
        for i in range(0, len(frame), step):  # 8 pieces, 0.15 s apart: 1.2 s for the frame
            writer.write(frame[i : i + step])
            await writer.drain()
            await asyncio.sleep(0.15)
        writer.write(_control(kv_transfer.END, tag, {"frames": 1, "cached_tokens": 0}))
        await reader.read()

    async def main() -> None:
        server, addr = await _scripted_peer(script)
        tokens = list(range(4 * BS - 1))
        try:
            result = await pull_kv(addr, PullRequest("slow-link", tokens, 0, "c", SECRET),
                                   dst_pages, blocks, idle_timeout_s=0.4)  # fmt: skip
            assert result.blocks == 4
            assert torch.equal(src_pages.blocks[:, :, blocks], dst_pages.blocks[:, :, blocks])
            stop_halfway["on"] = True
            t0 = time.monotonic()
            with pytest.raises(KVTransferError, match="TimeoutError"):
                await pull_kv(addr, PullRequest("stops", tokens, 0, "c", SECRET), dst_pages,
                              blocks, idle_timeout_s=0.4)  # fmt: skip
            assert time.monotonic() - t0 < 3
        finally:
            server.close()

    asyncio.run(main())


def test_keepalives_do_not_stretch_a_pull_past_its_deadline() -> None:
    """A prefill peer that sends keepalives and nothing else (a stuck export) keeps the pull
    within its idle limit; the pull's deadline ends it, and the caller frees its blocks."""
    from runtime.async_engine import ENGINE_STALL_S

    # a healthy prefill's wait and compute, and a hung engine's silence, end well within it
    assert kv_transfer.PULL_DEADLINE_S >= 5 * (ENGINE_STALL_S + kv_transfer.PULL_IDLE_S)
    pages = KVPages(torch.zeros(2, 2, 8 * BS, 2, 8), BS)

    async def script(pull: PullRequest, tag: int, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:  # fmt: skip
        writer.write(_control(kv_transfer.ACCEPT, tag,
                              {"num_blocks": 1, "layout": asdict(pages.layout)}))  # fmt: skip
        for _ in range(100):
            writer.write(_control(kv_transfer.KEEPALIVE, tag, {}))
            await writer.drain()
            await asyncio.sleep(0.1)

    async def main() -> None:
        server, addr = await _scripted_peer(script)
        try:
            pull = PullRequest("forever", list(range(BS - 1)), 0, "c", SECRET)
            t0 = time.monotonic()
            with pytest.raises(KVTransferError, match="longer than 1 s") as err:
                await pull_kv(addr, pull, pages, [0], idle_timeout_s=0.5, deadline_s=1.0)
            assert 1.0 <= time.monotonic() - t0 < 3 and err.value.source_failed
        finally:
            server.close()

    asyncio.run(main())


# what a broken peer sends: (ACCEPT's body, or None for the real one; then ERROR's body, or
# None for a DATA frame and END's body)
MALFORMED = {
    "accept_not_an_object": ([1], None, None),
    "error_not_an_object": (None, ["boom"], None),
    "end_not_an_object": (None, None, [1]),
    "end_frames_not_a_number": (None, None, {"frames": "1", "cached_tokens": 0}),
    "cached_tokens_not_a_number": (None, None, {"frames": 1, "cached_tokens": "x"}),
    "cached_tokens_beyond_the_prompt": (None, None, {"frames": 1, "cached_tokens": 10**9}),
    "cached_tokens_negative": (None, None, {"frames": 1, "cached_tokens": -1}),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_control_bodies_fail_the_transfer(engines, case: str) -> None:  # type: ignore[no-untyped-def]
    """A control body that is not what the protocol says (not an object, a count that is not
    one, more cached tokens than the prompt has) is a failed transfer (KVTransferError, naming
    the peer): it raised AttributeError or ValueError, which cut the decode worker's stream
    with no event (and the gateway blamed the decode worker), or was believed (usage reported
    1e9 cached tokens for a 40-token prompt). The import's blocks are freed."""
    _, decode, _ = engines
    layout = KVPages(decode.engine.runner.kv, BS).layout
    accept, error, end = MALFORMED[case]

    async def script(pull: PullRequest, tag: int, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:  # fmt: skip
        n = -(-len(pull.token_ids) // BS) - pull.first_block
        real = {"num_blocks": n, "layout": asdict(layout)}
        writer.write(_control(kv_transfer.ACCEPT, tag, real if accept is None else accept))
        if error is not None:
            writer.write(_control(kv_transfer.ERROR, tag, error))
        else:
            payload = bytes(layout.num_layers * n * layout.bytes_per_layer_block())
            writer.write(_data_frame(tag, payload, layout.num_layers, (pull.first_block, n)))
            writer.write(_control(kv_transfer.END, tag, end))
        await reader.read()

    async def main() -> None:
        server, addr = await _scripted_peer(script)
        try:
            group = decode.engine.prepare_request(f"bad-{case}", _prompt(40),
                                                  SamplingParams(max_tokens=2))  # fmt: skip
            with pytest.raises(KVTransferError) as err:
                await KVImporter(decode, SECRET).submit(group, addr)
            assert addr in str(err.value) and err.value.source_failed, err.value
        finally:
            server.close()
        await _settled(decode)
        assert _allocated(decode) == 0

    asyncio.run(main())


def test_cached_tokens_may_count_every_token_pulled(engines) -> None:  # type: ignore[no-untyped-def]
    """The END's count is believed up to the tokens pulled (the prompt but its last)."""
    _, decode, _ = engines
    layout = KVPages(decode.engine.runner.kv, BS).layout

    async def script(pull: PullRequest, tag: int, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:  # fmt: skip
        n = -(-len(pull.token_ids) // BS) - pull.first_block
        writer.write(_control(kv_transfer.ACCEPT, tag, {"num_blocks": n, "layout": asdict(layout)}))
        payload = bytes(layout.num_layers * n * layout.bytes_per_layer_block())
        writer.write(_data_frame(tag, payload, layout.num_layers, (pull.first_block, n)))
        end = {"frames": 1, "cached_tokens": len(pull.token_ids)}
        writer.write(_control(kv_transfer.END, tag, end))
        await reader.read()

    async def main() -> None:
        server, addr = await _scripted_peer(script)
        try:
            group = decode.engine.prepare_request("all-cached", _prompt(40, offset=7),
                                                  SamplingParams(max_tokens=2))  # fmt: skip
            stream, result = await KVImporter(decode, SECRET).submit(group, addr)
            assert result is not None and result.cached_tokens == 39
            async for out in stream:
                assert out.num_cached_tokens <= 39
        finally:
            server.close()
        await _settled(decode)

    asyncio.run(main())


def test_a_network_error_that_is_no_connection_error_fails_the_transfer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EHOSTUNREACH or ENETUNREACH mid-pull is an OSError but no ConnectionError: it escaped
    as OSError (a crashed handler in the worker) instead of a failed transfer."""
    import errno

    pages = KVPages(torch.zeros(2, 2, 8 * BS, 2, 8), BS)

    async def script(pull: PullRequest, tag: int, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:  # fmt: skip
        writer.write(_control(kv_transfer.ACCEPT, tag,
                              {"num_blocks": 1, "layout": asdict(pages.layout)}))  # fmt: skip
        await reader.read()

    real = FrameConn.read_header
    calls = [0]

    async def read_header(self: FrameConn) -> kv_transfer._Header:
        calls[0] += 1
        if calls[0] == 2:  # after the ACCEPT
            raise OSError(errno.EHOSTUNREACH, os.strerror(errno.EHOSTUNREACH))
        return await real(self)

    monkeypatch.setattr(FrameConn, "read_header", read_header)

    async def main() -> None:
        server, addr = await _scripted_peer(script)
        try:
            pull = PullRequest("unreachable", list(range(BS - 1)), 0, "c", SECRET)
            with pytest.raises(KVTransferError, match=os.strerror(errno.EHOSTUNREACH)) as err:
                await pull_kv(addr, pull, pages, [0], idle_timeout_s=2)
            assert addr in str(err.value) and err.value.source_failed
        finally:
            server.close()

    asyncio.run(main())


async def _release_nothing(request_id: str) -> None:
    return None


async def _export_nothing(pull: PullRequest) -> AsyncIterator[ExportProgress]:
    yield ExportProgress(len(pull.token_ids), [0], True)


def test_a_pull_s_body_is_capped_by_what_a_real_one_needs() -> None:
    """A PULL's header says how long its body is, before anything is checked: one longer than
    the longest prompt's PULL could be is refused at once, unread (it allocated and zeroed up
    to 16 MiB for any connection)."""
    pages = KVPages(torch.zeros(2, 2, 64 * BS, 2, 8), BS)

    async def main() -> None:
        server = KVTransferServer(pages, "c", SECRET, _export_nothing, _release_nothing,
                                  max_tokens=300)  # fmt: skip
        # the longest real PULL fits: 300 token ids of the largest int32, long text fields
        longest = PullRequest("r" * 256, [2**31 - 1] * 300, 0, "c" * 128, "s" * 128, "0" * 55)
        frame, _ = kv_transfer.pull_frame(longest)  # (its body: the frame but header and HMAC)
        assert len(frame) - HEADER.size - kv_transfer.MAC <= server.max_pull_bytes < 128 << 10
        port = await server.start("127.0.0.1", 0)
        try:
            conn = await FrameConn.connect("127.0.0.1", port)
            await conn.send(kv_transfer._header(kv_transfer.PULL, 0, server.max_pull_bytes + 1, 0))
            async with asyncio.timeout(2):  # answered without waiting for the body
                kind, body = await conn.read_control(None)
            assert kind == kv_transfer.ERROR and "limit" in body["message"], body
            conn.close()
        finally:
            await server.close()

    asyncio.run(main())


def test_unauthenticated_peers_cannot_make_the_prefill_side_allocate_much() -> None:
    """A PULL's body is read as it arrives, not allocated whole from its header's word: a peer
    that announces 16 MiB and sends a few bytes costs a few bytes (12 such connections took a
    prefill worker from 221 to 413 MiB). And at most MAX_UNAUTHENTICATED connections are read a
    PULL from at once (test_kv_transfer_hardening: one more drops the oldest)."""
    import tracemalloc

    pages = KVPages(torch.zeros(1, 2, 1 << 21, 1, 1), BS)  # room for a 16 MiB PULL

    async def main() -> None:
        server = KVTransferServer(pages, "c", SECRET, _export_nothing, _release_nothing)
        port = await server.start("127.0.0.1", 0)
        stalled: list[FrameConn] = []
        try:
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(3):
                conn = await FrameConn.connect("127.0.0.1", port)
                await conn.send(kv_transfer._header(kv_transfer.PULL, 0, (16 << 20) - 1, 0),
                                b"{" * 1000)  # fmt: skip
                stalled.append(conn)
            await asyncio.sleep(0.3)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak - base < 4 << 20, f"{(peak - base) >> 20} MiB for 3 KB received"
        finally:
            tracemalloc.stop()
            for conn in stalled:
                conn.close()
            await server.close()

    asyncio.run(main())


def test_past_max_unauthenticated_connections_the_oldest_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At most MAX_UNAUTHENTICATED connections are read a PULL from at once: one more drops the
    one that has waited longest, and is read at once (it waited its turn, for ever)."""
    monkeypatch.setattr(kv_transfer, "MAX_UNAUTHENTICATED", 2)
    pages = KVPages(torch.zeros(2, 2, 8 * BS, 2, 8), BS)

    async def main() -> None:
        server = KVTransferServer(pages, "c", SECRET, _export_nothing, _release_nothing)
        port = await server.start("127.0.0.1", 0)
        stalled: list[FrameConn] = []
        try:
            for _ in range(2):  # a header, then nothing
                conn = await FrameConn.connect("127.0.0.1", port)
                await conn.send(kv_transfer._header(kv_transfer.PULL, 0, 100, 0))
                stalled.append(conn)
                await asyncio.sleep(0.05)
            late = await FrameConn.connect("127.0.0.1", port)
            await late.send(kv_transfer.pull_frame(PullRequest("late", [1, 2], 0, "c", "WRONG"))[0])
            async with asyncio.timeout(1):
                kind, body = await late.read_control(None)
                assert kind == kv_transfer.ERROR and "secret" in body["message"]
                with pytest.raises(asyncio.IncompleteReadError):  # the oldest was dropped
                    await stalled[0].recv(1)
            assert server.connections_refused == 2 and server.pulls_failed == 0
            late.close()
        finally:
            for conn in stalled:
                conn.close()
            await server.close()

    asyncio.run(main())


def test_a_prefill_worker_that_cannot_take_the_prefill_refuses_it(stories_dir: Path,
                                                                  engines) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """A prefill worker without KV room for the prompt (or its queue full) refuses the pull:
    `source_failed` false over the wire, so that its decode worker says kv_source_refused and
    the gateway prefills elsewhere without taking it for failed (it said kv_transfer_failed, and
    the gateway set the prefill worker aside as failed)."""
    _, decode, _ = engines
    small = _llm(stories_dir, kv_bytes=10 * 5 * 2 * BS * 4 * 8 * 4)  # 10 blocks: 160 tokens

    async def main() -> None:
        async def body(addr: str, server: KVTransferServer) -> None:
            group = decode.engine.prepare_request("too-long", _prompt(300),
                                                  SamplingParams(max_tokens=2))  # fmt: skip
            with pytest.raises(KVTransferError, match="prefill") as err:
                await KVImporter(decode, SECRET).submit(group, addr)
            assert not err.value.source_failed, err.value

        await _with_server(small, body)
        await _settled(small, decode)
        assert _allocated(small) == 0 and _allocated(decode) == 0

    try:
        asyncio.run(main())
    finally:
        small.shutdown()


def test_an_import_of_a_one_token_prompt_runs_beside_other_requests(stories_dir: Path) -> None:
    """A one-token prompt has no KV to pull: its reservation holds no block, and the scheduler
    still admits it as an import (not as a new request, whose prefix match found it holding a
    table and failed every step after, ending every request on the worker)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = LLMEngine(EngineConfig(str(stories_dir), block_size=BS, num_threads=1,
                                    kv_cache_bytes=1 << 20))  # fmt: skip
    engine.add_request("other", _prompt(40), params)
    engine.step()
    one = engine.prepare_request("one", [1], params)
    assert engine.reserve_import(one) == (0, [])
    engine.commit_import(one, 0)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert sorted(done) == ["one", "other"] and all(len(t) == 4 for t in done.values())
    local = LLMEngine(EngineConfig(str(stories_dir), block_size=BS, num_threads=1,
                                   kv_cache_bytes=1 << 20))  # fmt: skip
    local.add_request("one", [1], params)
    while local.has_unfinished():
        for out in local.step():
            if out.finished:
                assert out.outputs[0].token_ids == done["one"]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_connections_that_fail_before_a_pull_are_logged_once_then_summed_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that connects and sends garbage, or a health check that connects and hangs up,
    again and again: a warning line each time flooded the prefill worker's log. The first of
    each kind is logged with its detail, at once; its repeats are counted, and summed up once
    per FAILURE_SUMMARY_S and at close: every failure counted once, in few lines."""
    pages = KVPages(torch.zeros(2, 2, 8 * BS, 2, 8), BS)
    garbage = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".ljust(HEADER.size, b"\n")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "edgeinfer.kv_transfer"]

    def counted() -> int:  # failures the lines account for: one each, or the summary's count
        found = (re.search(r"\((\d+) more like it", line) for line in lines())
        return sum(int(m.group(1)) if m else 1 for m in found)

    async def flood(interval_s: float, seconds: float) -> None:
        monkeypatch.setattr(kv_transfer, "FAILURE_SUMMARY_S", interval_s)
        server = KVTransferServer(pages, "c", SECRET, _export_nothing, _release_nothing)
        port = await server.start("127.0.0.1", 0)

        async def failed(n: int) -> None:
            async with asyncio.timeout(5):
                while server.connections_refused < n:
                    await asyncio.sleep(0.001)

        try:
            for i in range(20):  # garbage: answered with an ERROR frame, then closed
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(garbage)
                await reader.read()
                writer.close()
                await failed(i + 1)
            if seconds == 0:
                assert len(lines()) == 1 and "bad frame magic" in lines()[0], lines()
                assert "a connection from 127.0.0.1:" in lines()[0]
            end = time.monotonic() + seconds
            n = 20
            while n < 40 or time.monotonic() < end:  # another kind: its first logged at once
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                n += 1
                await failed(n)
            if seconds == 0:
                assert len(lines()) == 2 and "IncompleteReadError" in lines()[1], lines()
            else:  # summed up as the flood goes on, not only at close
                assert any("more like it" in line for line in lines()), lines()
        finally:
            await server.close()
        assert counted() == n, lines()
        assert len(lines()) <= 4 + 2 * seconds / interval_s, lines()

    with caplog.at_level(logging.WARNING, logger="edgeinfer.kv_transfer"):
        asyncio.run(flood(60.0, 0))
        assert len(lines()) == 4, lines()  # the first of each kind, and each kind's summary
        assert "19 more" in lines()[2] and "19 more" in lines()[3], lines()
        caplog.clear()
        asyncio.run(flood(0.2, 1.0))


def test_a_failed_keepalive_cancels_the_prefill_step_and_retrieves_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A keepalive whose send fails (the puller's connection reset while the prefill computes)
    ends the pull. The export's step then running was left alone: the prefill ran on for no
    one, and its error, when it came, went to asyncio's exception handler ("Task exception was
    never retrieved"). Now the step is cancelled with the pull (the export sees it) and its
    end retrieved."""
    import gc

    src = torch.randn(2, 2, 8 * BS, 2, 8, generator=torch.Generator().manual_seed(5))
    src_pages, dst_pages = KVPages(src, BS), KVPages(torch.zeros_like(src), BS)
    monkeypatch.setattr(kv_transfer, "KEEPALIVE_S", 0.02)
    gate = asyncio.Event()
    ended: list[str] = []

    async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
        try:
            await gate.wait()  # a long prefill: keepalives meanwhile
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise
        ended.append("failed")
        raise RuntimeError("the engine shut down under the prefill")
        yield ExportProgress(len(pull.token_ids), [0], True)  # (an async generator)

    async def release(request_id: str) -> None:
        return None

    real = kv_transfer.FrameConn.send_control

    async def send_control(self: FrameConn, kind: int, tag: int, obj: object) -> None:
        if kind == kv_transfer.KEEPALIVE:
            raise ConnectionResetError("connection reset by peer")
        await real(self, kind, tag, obj)

    monkeypatch.setattr(kv_transfer.FrameConn, "send_control", send_control)
    # (pytest's log capture would keep the pull's warning, and through its error's traceback
    # the step's task, alive past the test's collection)
    monkeypatch.setattr(kv_transfer.log, "propagate", False)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        unhandled: list[dict[str, object]] = []
        loop.set_exception_handler(lambda _, context: unhandled.append(context))
        server = KVTransferServer(src_pages, "c", SECRET, export, release)
        port = await server.start("127.0.0.1", 0)
        try:
            with pytest.raises(KVTransferError, match="connection reset"):
                await pull_kv(f"127.0.0.1:{port}", PullRequest("reset", list(range(BS - 1)), 0,
                              "c", SECRET), dst_pages, [0])  # fmt: skip
            async with asyncio.timeout(5):
                while server.active:  # the pull's end on the prefill side
                    await asyncio.sleep(0.01)
            gate.set()  # an export still running fails now
            for _ in range(5):
                await asyncio.sleep(0)
            gc.collect()  # a task whose exception nobody retrieved reports it when collected
            assert ended == ["cancelled"]
            assert unhandled == []
        finally:
            gate.set()
            await server.close()

    asyncio.run(main())
