"""The KV transfer against peers that are not the cluster's or send KV that is not finite.

- Connections that never send a PULL cannot keep a real pull waiting (they held the prefill
  side's 16 admission places for 10 s each, the rest queued behind them without limit, and a
  real pull queued there got no keepalives: its puller gave up after 10 s and the gateway took
  a healthy prefill worker for failed), and are not counted as failed pulls.
- A DATA frame holding NaN or inf fails the pull: it reached the request (an empty answer) and
  the decode worker's prefix cache, which served it to every later prompt sharing those blocks.
- The shared secret never goes on the wire (the puller sent it in clear to whatever address the
  registry named), and a prefill side that cannot prove it knows it is refused by the puller.

Real servers and engines over loopback TCP; the hostile peers are scripted sockets.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
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
from runtime.disagg import KVImporter
from runtime.engine import LLMEngine
from runtime.sampling_params import SamplingParams

SECRET = "kv-hardening-secret-7f3a9c"
BS = 16


def _pages() -> KVPages:
    """A prefill side's cache: 2 layers, 16 blocks, 2 heads of 8, random finite values."""
    g = torch.Generator().manual_seed(3)
    return KVPages(torch.randn(2, 2, 16 * BS, 2, 8, generator=g), BS)


def _server(pages: KVPages, cache_id: str = "c") -> KVTransferServer:
    async def export(pull: PullRequest) -> AsyncIterator[ExportProgress]:
        n = len(pull.token_ids)
        yield ExportProgress(n, list(range(-(-n // BS))), True)

    async def release(request_id: str) -> None:
        return None

    return KVTransferServer(pages, cache_id, SECRET, export, release, hold_s=5.0)


# ---------------------------------------------------------------------- D2: unauthenticated
@pytest.mark.parametrize("idle", [48, 100])  # under and over the cap (the oldest dropped)
def test_idle_connections_do_not_keep_a_real_pull_waiting(idle: int) -> None:
    """`idle` connections that send nothing, then a real pull: served at once (48 made it wait
    30 s, and its puller gave up after 10 s of silence). The idle ones are dropped within
    AUTH_READ_S, counted as refused connections, not as failed pulls."""
    src, dst = _pages(), KVPages(torch.zeros(2, 2, 16 * BS, 2, 8), BS)
    blocks = list(range(4))

    async def main() -> None:
        server = _server(src)
        port = await server.start("127.0.0.1", 0)
        conns = [await FrameConn.connect("127.0.0.1", port) for _ in range(idle)]
        try:
            await asyncio.sleep(0.2)  # all accepted, none sends a byte
            t0 = time.monotonic()
            pull = PullRequest("real", list(range(4 * BS - 1)), 0, "c", SECRET)
            result = await pull_kv(f"127.0.0.1:{port}", pull, dst, blocks, idle_timeout_s=1.5)
            assert time.monotonic() - t0 < 1.0
            assert result.blocks == 4
            assert torch.equal(src.blocks[:, :, blocks], dst.blocks[:, :, blocks])
            # the idle ones: closed by the server (dropped for newer ones, or at their limit)
            async with asyncio.timeout(kv_transfer.AUTH_READ_S + 2):
                for conn in conns:
                    with pytest.raises(asyncio.IncompleteReadError):
                        while True:  # (an ERROR frame saying why, or nothing), then closed
                            await conn.recv(1)
            async with asyncio.timeout(2):
                while server.connections_refused < idle:
                    await asyncio.sleep(0.01)
            assert server.connections_refused == idle
            assert server.pulls_failed == 0 and server.pulls_served == 1
        finally:
            for conn in conns:
                conn.close()
            await server.close()

    asyncio.run(main())


# ---------------------------------------------------------------------- D3: non-finite KV
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("pages_type", [KVPages, DeviceKVPages])  # in place; staged
def test_a_data_frame_that_is_not_finite_fails_the_pull(value: float, pages_type: type) -> None:
    """One value of the last layer's last block not finite: the pull fails (the peer sent bad
    data: source_failed, retried elsewhere)."""
    src = _pages()
    src.blocks[-1, 1, 3, BS - 1, 1, 7] = value
    dst = pages_type(torch.zeros(2, 2, 16 * BS, 2, 8), BS)

    async def main() -> None:
        server = _server(src)
        port = await server.start("127.0.0.1", 0)
        try:
            pull = PullRequest("bad-kv", list(range(4 * BS - 1)), 0, "c", SECRET)
            with pytest.raises(KVTransferError, match="not finite") as err:
                await pull_kv(f"127.0.0.1:{port}", pull, dst, list(range(4)))
            assert err.value.source_failed
        finally:
            await server.close()

    asyncio.run(main())


def _llm(model: Path) -> AsyncLLM:
    cfg = EngineConfig(str(model), block_size=BS, kv_cache_bytes=4_000_000, num_threads=1)
    return AsyncLLM(LLMEngine(cfg))


def test_nan_kv_from_a_prefill_peer_is_never_committed_or_cached(stories_dir: Path) -> None:
    """A prefill peer that speaks the protocol but sends NaN KV (a faulty worker): the import
    fails, its blocks are freed and never cached, and a later request of the same prompt is
    computed by the decode worker, as it would be without the import (it answered '' from the
    poisoned prefix cache, with cached_tokens 32, until the blocks were evicted)."""
    decode, alone = _llm(stories_dir), _llm(stories_dir)
    prompt = [1, *range(300, 340)]  # 41 tokens: 2 whole blocks pulled, then 8 tokens
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def run(llm: AsyncLLM, request_id: str) -> tuple[list[int], int]:
        outs = [out async for out in llm.generate(prompt, params, request_id=request_id)]
        return list(outs[-1].outputs[0].token_ids), outs[-1].num_cached_tokens

    async def main() -> None:
        poisoned = KVPages(torch.full_like(decode.engine.runner.kv, math.nan), BS)
        server = _server(poisoned, decode.engine.cache_id)
        port = await server.start("127.0.0.1", 0)
        try:
            group = decode.engine.prepare_request("poisoned", prompt, params)
            with pytest.raises(KVTransferError, match="not finite") as err:
                await KVImporter(decode, SECRET).submit(group, f"127.0.0.1:{port}")
            assert err.value.source_failed  # kv_transfer_failed: prefilled elsewhere
        finally:
            await server.close()
        await decode.call(lambda e: None)  # its cancel_import ran
        blocks = decode.engine.blocks
        assert blocks.num_free_blocks == blocks.num_blocks
        assert blocks.cached_hashes() == [], "blocks of the failed import were cached"
        tokens, cached = await run(decode, "after")
        assert cached == 0
        assert tokens == (await run(alone, "reference"))[0]

    try:
        asyncio.run(main())
    finally:
        decode.shutdown()
        alone.shutdown()


# ---------------------------------------------------------------------- D3b: the secret
async def _peer(
    answer: bool, proof_secret: str | None, seen: bytearray
) -> tuple[asyncio.Server, str, asyncio.Event]:
    """A peer at a registry address that is not the cluster's prefill worker: it keeps every
    byte the puller sends in `seen`; `answer`: it then sends ACCEPT (its `proof` made with
    `proof_secret`, or none), a DATA frame of ones and END, else nothing. The event: the
    puller hung up, and the peer has seen all it sent."""
    ended = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await talk(reader, writer)
        except ConnectionError:  # (the puller hung up with our frames unread: a reset)
            pass
        finally:
            writer.close()
            ended.set()

    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = HEADER.unpack(await reader.readexactly(HEADER.size))
        seen.extend(HEADER.pack(*head))
        body = await reader.readexactly(head[7])
        seen.extend(body)
        pull = orjson.loads(body)
        tag = kv_transfer.request_tag(pull["request_id"])
        if answer:
            accept: dict[str, object] = {"num_blocks": 1, "layout": _layout()}
            if proof_secret is not None and "nonce" in pull:
                nonce = bytes.fromhex(pull["nonce"])
                accept["proof"] = kv_transfer.accept_proof(proof_secret, nonce, tag)
            b = orjson.dumps(accept)
            writer.write(kv_transfer._frame(kv_transfer.ACCEPT, tag, b) + b)
            payload = torch.ones(2, 2, 1, BS, 2, 8).numpy().tobytes()
            writer.write(kv_transfer._header(DATA, tag, len(payload), 0, (0, 2), (0, 1)))
            writer.write(payload + kv_transfer.TRAILER.pack(xxhash.xxh3_64_intdigest(payload)))
            end = orjson.dumps({"frames": 1, "cached_tokens": 0})
            writer.write(kv_transfer._frame(kv_transfer.END, tag, end) + end)
        while data := await reader.read(1 << 16):  # all the puller sends, to its close
            seen.extend(data)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}", ended


def _layout() -> dict[str, object]:
    lay = KVPages(torch.zeros(2, 2, BS, 2, 8), BS).layout
    return {"num_layers": lay.num_layers, "block_size": lay.block_size,
            "num_kv_heads": lay.num_kv_heads, "head_dim": lay.head_dim, "dtype": lay.dtype}  # fmt: skip


@pytest.mark.parametrize("answer", [False, True])
def test_the_secret_never_goes_on_the_wire(answer: bool) -> None:
    """Whatever a peer at a registry address does (nothing, or answers as a prefill worker
    would), nothing the puller sends holds the shared secret (it was in the PULL, in clear)."""
    seen = bytearray()

    async def main() -> None:
        server, addr, ended = await _peer(answer, None, seen)
        try:
            pull = PullRequest("steal", list(range(BS - 1)), 0, "c", SECRET)
            dst = KVPages(torch.zeros(2, 2, 4 * BS, 2, 8), BS)
            with pytest.raises(KVTransferError):
                await pull_kv(addr, pull, dst, [0], idle_timeout_s=0.5)
            async with asyncio.timeout(2):
                await ended.wait()
        finally:
            server.close()

    asyncio.run(main())
    assert len(seen) > HEADER.size  # it did get the PULL
    assert SECRET.encode() not in seen
    assert SECRET.encode().hex().encode() not in seen


@pytest.mark.parametrize("proof_secret", [None, "another-secret"])
def test_a_peer_that_does_not_know_the_secret_is_refused(proof_secret: str | None) -> None:
    """A peer whose ACCEPT has no proof, or one made with another secret: the pull fails before
    any of its DATA lands (it was taken, KV and all)."""
    seen = bytearray()

    async def main() -> None:
        server, addr, ended = await _peer(True, proof_secret, seen)
        dst = KVPages(torch.zeros(2, 2, 4 * BS, 2, 8), BS)
        try:
            pull = PullRequest("impostor", list(range(BS - 1)), 0, "c", SECRET)
            with pytest.raises(KVTransferError, match="secret") as err:
                await pull_kv(addr, pull, dst, [0], idle_timeout_s=1.0)
            assert err.value.source_failed
            assert not dst.blocks.any(), "the impostor's DATA landed"
            async with asyncio.timeout(2):
                await ended.wait()
        finally:
            server.close()

    asyncio.run(main())


def test_a_pull_of_the_cluster_s_passes_both_proofs() -> None:
    """The real server and puller, sharing the secret: served (and the server proved itself)."""
    src, dst = _pages(), KVPages(torch.zeros(2, 2, 16 * BS, 2, 8), BS)

    async def main() -> None:
        server = _server(src)
        port = await server.start("127.0.0.1", 0)
        try:
            pull = PullRequest("ok", list(range(2 * BS - 1)), 0, "c", SECRET)
            result = await pull_kv(f"127.0.0.1:{port}", pull, dst, [5, 6])
            assert result.blocks == 2
            assert torch.equal(src.blocks[:, :, [0, 1]], dst.blocks[:, :, [5, 6]])
            wrong = PullRequest("wrong", list(range(2 * BS - 1)), 0, "c", "not-the-secret")
            with pytest.raises(KVTransferError, match="wrong shared secret") as err:
                await pull_kv(f"127.0.0.1:{port}", wrong, dst, [5, 6])
            assert not err.value.source_failed
            assert server.pulls_served == 1 and server.pulls_failed == 0
        finally:
            await server.close()

    asyncio.run(main())
