"""Faults of disaggregated serving, each reproduced with real engines and a real KV transfer over
loopback TCP (the helpers of tests/test_kv_transfer.py): what the decode side is told, and that
no KV block stays allocated on either side afterwards.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvstore.kv_transfer import (
    FrameConn,
    KVTransferError,
    KVTransferServer,
    PullRequest,
    pull_kv,
)
from runtime.async_engine import AsyncLLM
from runtime.disagg import KVImporter, kv_pages
from runtime.sampling_params import SamplingParams
from tests.test_kv_transfer import (
    SECRET,
    _allocated,
    _collect,
    _llm,
    _prompt,
    _settled,
    _with_server,
)


@pytest.fixture(scope="module")
def decode(stories_dir: Path):  # type: ignore[no-untyped-def]
    llm = _llm(stories_dir)
    yield llm
    llm.shutdown()


def test_a_queue_filled_before_the_export_is_queued_is_a_refusal(stories_dir: Path,
                                                                 decode: AsyncLLM) -> None:  # fmt: skip
    """The prefill worker's waiting queue had room when the export was submitted and none by the
    time its engine thread queued it (a KV import committed, or a request preempted, in between):
    the engine refuses it on its thread, through the export's stream. That is a refusal, as the
    same QueueFullError at submit is (`source_failed` false: kv_source_refused, the prefill worker
    passed over); it was a failure (kv_transfer_failed), and the gateway set a healthy prefill
    worker aside."""
    prefill = _llm(stories_dir, max_waiting=1)

    async def main() -> None:
        async def body(addr: str, server: KVTransferServer) -> None:
            # a KV import on the prefill worker (a mixed one), committed in the engine's next pass
            imported = prefill.engine.prepare_request("import", [1], SamplingParams(max_tokens=2))
            assert await prefill.call(lambda e: e.reserve_import(imported)) == (0, [])
            busy, gate = threading.Event(), threading.Event()

            def hold(e: object) -> None:  # the engine thread busy (in a step) until the export came
                busy.set()
                gate.wait(10)

            prefill.call(hold)
            assert await asyncio.to_thread(busy.wait, 10)
            stream = prefill.submit_import(imported, 0)
            group = decode.engine.prepare_request("exp", _prompt(40), SamplingParams(max_tokens=2))
            pull = asyncio.ensure_future(KVImporter(decode, SECRET).submit(group, addr))
            for _ in range(500):  # the export submitted (room at submit: the import's not queued)
                if len(prefill._inbox) >= 2 or pull.done():
                    break
                await asyncio.sleep(0.01)
            gate.set()
            with pytest.raises(KVTransferError, match="queue is full") as err:
                await pull
            assert not err.value.source_failed, err.value
            assert len(await _collect(stream)) == 2

        await _with_server(prefill, body)
        await _settled(prefill, decode)
        assert _allocated(prefill) == 0 and _allocated(decode) == 0

    try:
        asyncio.run(main())
    finally:
        prefill.shutdown()


@pytest.mark.parametrize("tokens", [20_000, 60_000])
def test_a_prompt_longer_than_the_prefill_worker_takes_is_a_refusal(
    stories_dir: Path, decode: AsyncLLM, tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode worker of a longer context (or a larger KV cache) than the prefill worker's pulls
    a prompt whose PULL is over what the prefill worker reads (the longest prompt it takes): the
    refusal reaches the puller as an ERROR of its own request, a refusal (kv_source_refused, as
    the engine's own refusal of a prompt too long), not a failure. It came with the request tag
    0, which the puller read as "frame for another request", a failure (kv_transfer_failed), and
    the gateway set a healthy prefill worker aside. A PULL larger than the sockets' buffers (a
    LAN's: 240 KB here) was refused unread: the close reset the connection under the puller
    still sending, a failure again."""
    prefill = _llm(stories_dir, kv_bytes=10 * 5 * 2 * 16 * 4 * 8 * 4)  # 10 blocks: 160 tokens
    framed = FrameConn.__init__

    def small_buffers(self: FrameConn, sock: socket.socket, *args: Any, **kw: Any) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 128 << 10)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        framed(self, sock, *args, **kw)

    monkeypatch.setattr(FrameConn, "__init__", small_buffers)

    async def main() -> None:
        async def body(addr: str, server: KVTransferServer) -> None:
            # (stories260K's context is shorter: the PULL itself)
            pull = PullRequest("long", [500] * tokens, 0, prefill.engine.cache_id, SECRET)
            assert len(orjson.dumps(asdict(pull))) > server.max_pull_bytes
            with pytest.raises(KVTransferError, match="longer than this worker takes") as err:
                await pull_kv(addr, pull, kv_pages(decode), [0])  # (refused before any block)
            assert not err.value.source_failed, err.value
            assert server.active == 0

        await _with_server(prefill, body)
        await _settled(prefill)
        assert _allocated(prefill) == 0

    try:
        asyncio.run(main())
    finally:
        prefill.shutdown()


def test_an_import_pulled_whole_is_queued_though_the_queue_filled_meanwhile(
    stories_dir: Path,
) -> None:
    """A KV import is admitted when its blocks are reserved (a seat under max_num_seqs); a
    colocated request that took the waiting queue's last place while the KV was pulled must not
    make the import's commit fail: its whole transfer was thrown away (queue_full, from a
    helper's reproduction)."""
    decode = _llm(stories_dir, max_waiting=1)

    async def main() -> None:
        group = decode.engine.prepare_request("imp", _prompt(60), SamplingParams(max_tokens=4))
        assert await decode.call(lambda e: e.reserve_import(group)) is not None
        busy, gate = threading.Event(), threading.Event()

        def hold(e: object) -> None:  # the engine thread in a step while both arrive
            busy.set()
            gate.wait(10)

        decode.call(hold)
        assert await asyncio.to_thread(busy.wait, 10)
        other = decode.submit(_prompt(30, 50), SamplingParams(max_tokens=4), "colocated")
        stream = decode.submit_import(group, 0)
        gate.set()
        assert len(await _collect(stream)) == 4  # (the old code: QueueFullError here)
        assert len(await _collect(other)) == 4
        await _settled(decode)
        assert _allocated(decode) == 0

    try:
        asyncio.run(main())
    finally:
        decode.shutdown()
