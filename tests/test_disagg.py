"""Prefill/decode disaggregation end to end: a real redis-server, a prefill worker and a decode
worker (real processes on stories260K), a real gateway, the real `openai` client.

Checked: the answer equals the engine's own (colocated) answer token for token, greedy and seeded,
single and concurrent, prompts of 1 to many blocks, with and without prefix hits on the decode
side; no worker keeps a block once requests end; a dead prefill worker costs a retry, not the
request; a dead decode worker's pulled blocks are freed on the prefill side; a role change drains
first, and a worker stopped during a role change stays stopped. Tests that break the cluster run
last, in file order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import orjson
import pytest
import redis

from kvstore import kv_transfer
from kvstore.keys import session_key, worker_key
from kvstore.kv_transfer import PullRequest
from kvstore.redis_server import LocalRedis
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.stack import (
    SECRET,
    Proc,
    generate,
    get_json,
    start_gateway,
    start_worker,
    wait_until,
    worker_stats,
)
from tests.test_kv_transfer import pull_without_ack

CATALOG = "regions:\n  - {name: local, latitude: 50.1, longitude: 8.7, settings: {}}\n"
STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big red ball under a tree and ran to get it. "
)
PROMPTS = ["Once", "Lily saw a big dog.", STORY, STORY * 4]  # 2 to ~190 tokens
HOLD_S = 2.0  # how long the prefill worker holds pulled blocks for an acknowledgement


class Split:
    def __init__(self, root: Path, stories: Path) -> None:
        self.root = root
        (root / "regions.yaml").write_text(CATALOG)
        self.redis = LocalRedis().start()
        self.model = stories
        hold = ["--kv-hold", str(HOLD_S)]
        self.prefill = start_worker("prefill", stories, self.redis.url, root,
                                    extra=["--role", "prefill", *hold])  # fmt: skip
        self.decode = start_worker("decode", stories, self.redis.url, root,
                                   extra=["--role", "decode", *hold])  # fmt: skip
        self.gateway = start_gateway("gw", self.redis.url, root / "regions.yaml", root,
                                     extra=["--disagg-min-tokens", "0"])  # fmt: skip
        wait_until(lambda: get_json(f"{self.gateway.url}/readyz")[1]["workers"] == 2, 30, "workers")
        self.client = openai.OpenAI(
            base_url=f"{self.gateway.url}/v1", api_key="unused", max_retries=0, timeout=60
        )

    def close(self) -> None:
        self.gateway.stop()
        for w in (self.prefill, self.decode):
            w.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path):  # type: ignore[no-untyped-def]
    s = Split(tmp_path_factory.mktemp("disagg"), stories_dir)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def reference(split: Split) -> LLM:
    """Colocated serving: the engine itself, in this process, on the same weights."""
    return LLM(split.model, kv_cache_bytes=4_000_000)


def _complete(split: Split, prompt: str, sampling: dict, stream: bool = False):  # type: ignore[no-untyped-def, type-arg]
    """(text, headers, usage) of one completion through the gateway."""
    raw = split.client.completions.with_raw_response.create(
        model="stories", prompt=prompt, max_tokens=24, stream=stream,
        stream_options={"include_usage": True} if stream else None, **sampling,
    )  # fmt: skip
    resp = raw.parse()
    if stream:
        text, usage = "", None
        for chunk in resp:
            text += chunk.choices[0].text if chunk.choices else ""
            usage = chunk.usage or usage
        return text, raw.headers, usage
    return resp.choices[0].text, raw.headers, resp.usage


def _expected(reference: LLM, prompt: str, sampling: dict) -> str:  # type: ignore[type-arg]
    params = SamplingParams(max_tokens=24, **sampling)
    return reference.generate([prompt], params)[0].outputs[0].text


def _settled(*workers: Proc) -> None:
    """Wait until no worker holds a KV block (cached blocks nobody uses count as free)."""

    def idle() -> bool:
        for w in workers:
            s = worker_stats(w)
            if s["free_kv_blocks"] != s["total_kv_blocks"] or s["kv_exports_held"]:
                return False
        return True

    wait_until(idle, HOLD_S + 5, "every KV block free")


# ---------------------------------------------------------------------- same answers
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 5}])
def test_disaggregated_equals_colocated(split: Split, reference: LLM, sampling: dict,  # type: ignore[type-arg]
                                        stream: bool) -> None:  # fmt: skip
    before = worker_stats(split.prefill)["kv_pulls_served"]
    for prompt in PROMPTS:
        text, headers, usage = _complete(split, prompt, sampling, stream)
        assert text == _expected(reference, prompt, sampling), prompt
        assert headers["x-edgeinfer-worker"] == split.decode.meta["worker_id"]
        assert headers.get("x-edgeinfer-prefill-worker") == split.prefill.meta["worker_id"]
        assert usage.completion_tokens > 0
    # every prompt of more than one token was pulled (or found whole in the decode cache)
    assert worker_stats(split.prefill)["kv_pulls_served"] > before
    _settled(split.prefill, split.decode)


def test_an_echo_with_logprobs_is_computed_whole_on_the_decode_worker(split: Split,
                                                                      reference: LLM) -> None:  # fmt: skip
    """Prompt logprobs need the prompt's logits, which a pulled KV lacks: the gateway sends such
    a request to the decode worker whole (no prefill worker counted, none named), which
    computes it; the echoed prompt and its logprobs are the reference's."""
    raw = split.client.completions.with_raw_response.create(
        model="stories", prompt=STORY, max_tokens=4, temperature=0, echo=True, logprobs=1,
    )  # fmt: skip
    resp = raw.parse()
    assert "x-edgeinfer-prefill-worker" not in raw.headers
    assert raw.headers["x-edgeinfer-worker"] == split.decode.meta["worker_id"]
    want = reference.generate([STORY], SamplingParams(max_tokens=4, temperature=0,
                                                      prompt_logprobs=1))[0]  # fmt: skip
    assert resp.choices[0].text == STORY + want.outputs[0].text
    lps = resp.choices[0].logprobs
    assert lps is not None and lps.token_logprobs is not None
    n = len(want.prompt_token_ids)
    assert lps.token_logprobs[0] is None
    assert want.prompt_logprobs is not None
    for got, entry in zip(lps.token_logprobs[1:n], want.prompt_logprobs[1:], strict=True):
        assert entry is not None and got == pytest.approx(entry.logprob, abs=1e-4)
    _settled(split.prefill, split.decode)


def test_concurrent_requests(split: Split, reference: LLM) -> None:
    jobs = [(STORY * k + f" Tom said {k}.", {"temperature": 0.0}) for k in range(1, 4)]
    jobs += [(STORY + f" The cat had {k} toys.", {"temperature": 0.8, "seed": k}) for k in range(4)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: _complete(split, j[0], j[1], True)[0], jobs))
    assert got == [_expected(reference, p, s) for p, s in jobs]
    _settled(split.prefill, split.decode)


def test_prefix_hit_on_the_decode_worker_skips_those_blocks(split: Split, reference: LLM) -> None:
    prompt = STORY * 3 + "Then they went home."
    greedy = {"temperature": 0.0}
    text, _, _ = _complete(split, prompt, greedy)
    assert text == _expected(reference, prompt, greedy)
    received = worker_stats(split.decode)["kv_bytes_received"]
    again, _, usage = _complete(split, prompt + " The end.", greedy)
    assert again == _expected(reference, prompt + " The end.", greedy)
    moved = worker_stats(split.decode)["kv_bytes_received"] - received
    bytes_per_block = 5 * 2 * 16 * 4 * 8 * 4  # layers x (k, v) x block x kv heads x dim x fp32
    assert usage.prompt_tokens_details.cached_tokens >= 96
    assert moved <= 2 * bytes_per_block  # only the blocks past the cached prefix moved
    _settled(split.prefill, split.decode)


def test_session_is_placed_on_the_decode_worker(split: Split) -> None:
    import redis

    for turn in range(3):
        raw = split.client.completions.with_raw_response.create(
            model="stories", prompt=STORY * (turn + 1), max_tokens=4, temperature=0,
            extra_headers={"x-session-affinity": "talk-1"},
        )  # fmt: skip
        assert raw.headers["x-edgeinfer-worker"] == split.decode.meta["worker_id"]
    r = redis.Redis.from_url(split.redis.url)
    placed = orjson.loads(r.get(session_key("talk-1")))  # type: ignore[arg-type]
    r.close()
    assert placed["worker_id"] == split.decode.meta["worker_id"]


def test_a_session_turn_mostly_cached_on_its_worker_is_not_disaggregated(split: Split) -> None:
    """--disagg-min-tokens counts the tokens the session's worker does not hold: the first turn
    is long and new (pulled from the prefill worker), the next adds a few tokens to it (the
    decode worker computes them itself, with no transfer)."""
    gateway = start_gateway("gw-min", split.redis.url, split.root / "regions.yaml", split.root,
                            extra=["--disagg-min-tokens", "32"])  # fmt: skip
    try:
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["workers"] == 2, 30, "workers")
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        session = {"x-session-affinity": "talk-min-tokens"}
        text = "Tom had a blue kite and a red boat. He went to the lake with Sam. " * 4  # unseen
        first = client.completions.with_raw_response.create(
            model="stories", prompt=text, max_tokens=4, temperature=0, extra_headers=session
        )
        assert first.headers["x-edgeinfer-prefill-worker"] == split.prefill.meta["worker_id"]
        received = worker_stats(split.decode)["kv_bytes_received"]
        time.sleep(0.5)  # the user reads the answer; the worker publishes its blocks meanwhile
        second = client.completions.with_raw_response.create(
            model="stories", prompt=text + "Sam smiled.", max_tokens=4, temperature=0,
            extra_headers=session,
        )  # fmt: skip
        assert second.headers["x-edgeinfer-worker"] == split.decode.meta["worker_id"]
        assert "x-edgeinfer-prefill-worker" not in second.headers
        assert worker_stats(split.decode)["kv_bytes_received"] == received
        assert second.parse().usage.prompt_tokens_details.cached_tokens >= 96
    finally:
        gateway.stop()
    _settled(split.prefill, split.decode)


# ---------------------------------------------------------------------- broken prefill peers
def _pull_from_peer(worker: Proc, request_id: str, error_body: object) -> list[dict]:  # type: ignore[type-arg]
    """POST /internal/generate to the decode `worker` with its KV source a peer that answers
    the PULL with an ERROR frame of `error_body`; the stream's events."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = kv_transfer.HEADER.unpack(await reader.readexactly(kv_transfer.HEADER.size))
        pull = orjson.loads(await reader.readexactly(head[7]))
        await reader.readexactly(kv_transfer.MAC)  # (the PULL's HMAC: refused before it counts)
        body = orjson.dumps(error_body)
        tag = kv_transfer.request_tag(pull["request_id"])
        writer.write(kv_transfer._frame(kv_transfer.ERROR, tag, body) + body)
        await reader.read()
        writer.close()

    def post(addr: str) -> bytes:
        body = {"request_id": request_id, "model": "stories", "prompt": STORY,
                "sampling": {"max_tokens": 4}, "kv_source": addr}  # fmt: skip
        req = urllib.request.Request(f"{worker.url}/internal/generate", data=orjson.dumps(body),
                                     headers={"x-edgeinfer-secret": SECRET}, method="POST")  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
            return resp.read()

    async def main() -> bytes:
        peer = await asyncio.start_server(serve, "127.0.0.1", 0)
        try:
            return await asyncio.to_thread(post, f"127.0.0.1:{peer.sockets[0].getsockname()[1]}")
        finally:
            peer.close()

    return [orjson.loads(line) for line in asyncio.run(main()).split(b"\n") if line.strip()]


def test_a_broken_or_refusing_prefill_peer_is_the_stream_s_one_event(split: Split) -> None:
    """A malformed ERROR frame from the prefill peer (a list, not an object) is a failed
    transfer, the stream's one event (502 kv_transfer_failed: the gateway prefills elsewhere);
    it raised AttributeError in the worker's handler, which cut the stream with no event, and
    the gateway blamed the decode worker. A peer refusing the pull as no failure of its own
    (its KV cache full) is 503 kv_source_refused: prefilled elsewhere, neither worker taken for
    failed. The decode worker keeps no block either way."""
    [event] = _pull_from_peer(split.decode, "broken-peer", ["boom"])
    assert event["type"] == "error" and event["code"] == "kv_transfer_failed", event
    assert event["status"] == 502 and "malformed ERROR" in event["message"], event
    refusal = {"message": "the prefill worker gave the prefill up (KV cache full)",
               "source_failed": False}  # fmt: skip
    [event] = _pull_from_peer(split.decode, "refusing-peer", refusal)
    assert event["type"] == "error" and event["code"] == "kv_source_refused", event
    assert event["status"] == 503 and event["retry_after"] == 1.0, event
    assert event["error"]["param"] == "kv_source", event
    _settled(split.decode)
    assert worker_stats(split.decode)["kv_imports_reserved"] == 0


def test_an_unexpected_error_of_a_pull_is_a_failed_transfer_not_a_cut_stream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whatever the pull raises (a bug, here or in what the peer sent) becomes the stream's
    one event, 502 kv_transfer_failed, and is logged with its traceback; it escaped the
    handler, which cut the stream, and the gateway blamed the decode worker."""
    from types import SimpleNamespace

    from runtime import worker as worker_module
    from runtime.telemetry import RequestTimes

    class Resp:
        async def prepare(self, request: object) -> None:
            return None

        async def write(self, data: bytes) -> None:
            return None

    async def submit(group: object, source: str, trace_ctx: object) -> None:
        raise AttributeError("'list' object has no attribute 'get'")

    worker = SimpleNamespace(importer=SimpleNamespace(submit=submit))
    quiet = SimpleNamespace(start=lambda: None)
    group = SimpleNamespace(request_id="oops")

    async def main() -> None:
        await worker_module._pull(None, Resp(), quiet, worker, group, "10.0.0.1:9000", None,  # type: ignore[arg-type]
                                  RequestTimes(time.monotonic()))  # fmt: skip

    with pytest.raises(worker_module._Refused) as err:
        asyncio.run(main())
    assert err.value.code == "kv_transfer_failed" and err.value.status == 502
    assert "10.0.0.1:9000" in str(err.value) and "AttributeError" in str(err.value)
    assert any(r.exc_info and "10.0.0.1:9000" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------- roles
def _post_role(worker: Proc, role: object) -> tuple[int, dict]:  # type: ignore[type-arg]
    req = urllib.request.Request(
        f"{worker.url}/internal/role", data=orjson.dumps({"role": role}), method="POST",
        headers={"x-edgeinfer-secret": SECRET},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, orjson.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, orjson.loads(e.read())


def test_role_change_drains_then_switches(split: Split, reference: LLM) -> None:
    assert _post_role(split.decode, "boss")[0] == 400
    # a long answer is streaming on the decode worker while its role changes
    chunks: list[str] = []

    def long_stream() -> None:
        for c in split.client.completions.create(model="stories", prompt=STORY, max_tokens=200,
                                                 temperature=0, stream=True):  # fmt: skip
            chunks.append(c.choices[0].text if c.choices else "")

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(long_stream)
        wait_until(lambda: len(chunks) > 2, 20, "the stream to start")
        status, body = _post_role(split.decode, "mixed")
        assert fut.done(), "the role changed before the old role's work drained"
        fut.result()
    assert status == 200 and body["previous"] == "decode" and body["drained_s"] > 0
    # prefill + mixed: nothing is disaggregated now, the mixed worker serves whole requests
    time.sleep(1.0)
    text, headers, _ = _complete(split, STORY, {"temperature": 0.0})
    assert "x-edgeinfer-prefill-worker" not in headers
    assert headers["x-edgeinfer-worker"] == split.decode.meta["worker_id"]
    assert text == _expected(reference, STORY, {"temperature": 0.0})
    # back, through the operator's command
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "set-role", split.decode.url, "decode"],
        env=os.environ | {"EDGEINFER_SECRET": SECRET}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and "role mixed -> decode" in done.stdout, done.stderr
    time.sleep(1.0)
    _, headers, _ = _complete(split, STORY * 2, {"temperature": 0.0})
    assert headers.get("x-edgeinfer-prefill-worker") == split.prefill.meta["worker_id"]


def test_a_role_change_ending_during_a_drain_leaves_the_worker_draining(
    stories_dir: Path, tmp_path: Path
) -> None:
    """SIGTERM while a role change drains: the role change gives up first (its drain timeout),
    and that must not end the worker's drain: it refuses work until it exits, and its heartbeat
    does not register it again once it has left."""
    with LocalRedis() as server:
        worker = start_worker("stopping", stories_dir, server.url, tmp_path,
                              extra=["--max-num-seqs", "1", "--drain-timeout", "2",
                                     "--worker-id", "w-stopping"])  # fmt: skip
        r = redis.Redis.from_url(server.url)
        try:
            with concurrent.futures.ThreadPoolExecutor(17) as pool:
                for i in range(16):  # seconds of work, one request at a time
                    pool.submit(generate, worker, f"busy-{i}", "Once", 480)
                time.sleep(0.3)
                role = pool.submit(_post_role, worker, "prefill")
                time.sleep(0.7)
                worker.signal(signal.SIGTERM)  # its drain ends 2 s later, the role change's first
                status, body = role.result()
                assert status == 503 and body["error"]["code"] == "drain_timeout", body
                assert get_json(f"{worker.url}/internal/health", SECRET)[1]["status"] == "draining"
                assert generate(worker, "late", "Once", 1) == 503
                assert r.hget(worker_key("w-stopping"), "draining") in (None, b"true")
                worker.popen.wait(30)
            assert not r.exists(worker_key("w-stopping"))
        finally:
            worker.stop()
            r.close()
    assert worker.popen.returncode == 0, worker.tail()
    assert "registry entry was gone" not in worker.log.read_text()


def test_rebalance_sets_the_prefill_decode_ratio(split: Split) -> None:
    def rebalance(n: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "runtime.cli", "rebalance", "--model", "stories",
             "--prefill", str(n), "--redis", split.redis.url],
            env=os.environ | {"EDGEINFER_SECRET": SECRET}, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip

    assert "nothing to do" in rebalance(1).stdout
    bad = rebalance(3)
    assert bad.returncode == 2 and "has 2 prefill/decode workers" in bad.stderr
    done = rebalance(0)  # the prefill worker becomes a decode worker
    assert done.returncode == 0 and "prefill -> decode" in done.stdout, done.stderr
    assert worker_stats(split.prefill)["role"] == "decode"
    time.sleep(1.0)  # the gateway's registry snapshot
    _, headers, _ = _complete(split, STORY, {"temperature": 0.0})
    assert "x-edgeinfer-prefill-worker" not in headers  # no prefill worker: whole requests
    wait_until(lambda: get_json(f"{split.gateway.url}/readyz")[1]["workers"] == 2, 10, "registry")
    done = rebalance(1)  # the decode worker with the fewest sequences becomes prefill again
    assert done.returncode == 0 and "decode -> prefill" in done.stdout, done.stderr
    roles = {worker_stats(w)["role"] for w in (split.prefill, split.decode)}
    assert roles == {"prefill", "decode"}
    if worker_stats(split.prefill)["role"] != "prefill":  # the other one was picked: swap names
        split.prefill, split.decode = split.decode, split.prefill
    time.sleep(1.0)


# ---------------------------------------------------------------------- faults (last)
def test_decode_side_gone_frees_the_prefill_blocks(split: Split) -> None:
    """A puller that reads every block and then dies (no ACK): the prefill worker frees them."""
    stats = worker_stats(split.prefill)
    pull = PullRequest("vanish", list(range(3, 300)), 0, stats["cache_id"], SECRET)

    async def pull_and_vanish() -> None:
        conn = await pull_without_ack(stats["kv_addr"], pull)
        s = worker_stats(split.prefill)
        assert s["kv_exports_held"] == 1 and s["free_kv_blocks"] < s["total_kv_blocks"]
        conn.close()  # dies without a word

    asyncio.run(pull_and_vanish())
    _settled(split.prefill)
    assert worker_stats(split.prefill)["kv_pulls_failed"] >= 1


def test_killed_decode_worker_mid_stream(split: Split) -> None:
    """The decode worker dies while streaming: the client gets an error, the prefill worker
    keeps no block. (Restarted afterwards for the next test.)"""
    got: list[str] = []
    with pytest.raises(openai.APIError) as err:
        for c in split.client.completions.create(model="stories", prompt=STORY * 2,
                                                 max_tokens=300, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}):  # fmt: skip
            got.append(c.choices[0].text if c.choices else "")
            if len(got) == 3:
                split.decode.kill()
    assert not split.decode.alive() and len(got) >= 3, err.value
    assert "(its connection broke)" in str(err.value), err.value  # (not "it stopped answering")
    _settled(split.prefill)
    split.decode = start_worker("decode2", split.model, split.redis.url, split.root,
                                extra=["--role", "decode", "--kv-hold", str(HOLD_S)])  # fmt: skip


def test_with_the_decode_worker_gone_the_prefill_worker_serves_the_retry(
    split: Split, reference: LLM
) -> None:
    """The only decode worker dies: the registry still lists it (until its TTL), so the request
    goes there first and fails; the retry finds the prefill side alone, which serves requests
    whole. (Restarted afterwards for the next test.)"""
    wait_until(lambda: get_json(f"{split.gateway.url}/readyz")[1]["workers"] >= 2, 30, "workers")
    split.decode.kill()
    text, headers, _ = _complete(split, STORY, {"temperature": 0.0})
    assert text == _expected(reference, STORY, {"temperature": 0.0})
    assert headers["x-edgeinfer-worker"] == split.prefill.meta["worker_id"]
    assert "x-edgeinfer-prefill-worker" not in headers
    _settled(split.prefill)
    split.decode = start_worker("decode3", split.model, split.redis.url, split.root,
                                extra=["--role", "decode", "--kv-hold", str(HOLD_S)])  # fmt: skip


def test_killed_prefill_worker_costs_a_retry_not_the_request(split: Split, reference: LLM) -> None:
    wait_until(lambda: get_json(f"{split.gateway.url}/readyz")[1]["workers"] >= 2, 30, "workers")
    split.prefill.kill()
    # the registry still lists it (its entry lives until the TTL): the pull fails, the gateway
    # sets it aside, and with no prefill worker left the decode worker computes the prompt
    prompt = STORY + "A bird sang."
    text, headers, _ = _complete(split, prompt, {"temperature": 0.0})
    assert text == _expected(reference, prompt, {"temperature": 0.0})
    assert "x-edgeinfer-prefill-worker" not in headers
    _settled(split.decode)
    assert "cannot reach the prefill worker" in split.gateway.tail(200)


def test_no_room_to_import_and_no_prefill_worker_left_the_decode_worker_computes_it(
    tmp_path: Path, stories_dir: Path, reference: LLM
) -> None:
    """The decode worker has no KV room for a prompt's import (long requests hold its blocks)
    and refuses it (kv_cache_full); the prefill worker, still listed, is dead. With no other
    worker left, the request goes to the decode worker whole, where it queues until blocks
    free, and is answered: not a 503 (found by a fault-injection review)."""
    (tmp_path / "regions.yaml").write_text(CATALOG)
    ids = reference.tokenizer.encode(STORY * 12)
    # prompts below and above --disagg-min-tokens, no two with a common first block (a prefix
    # cache hit would share blocks and leave room)
    split = ids[50:470]
    with LocalRedis() as redis:
        fast = ["--heartbeat", "0.3", "--ttl", "3"]
        prefill = start_worker("prefill", stories_dir, redis.url, tmp_path,
                               extra=["--role", "prefill", *fast])  # fmt: skip
        # ~80 blocks of 16 tokens: four 300-token prompts take 76 of them at once
        decode = start_worker("decode", stories_dir, redis.url, tmp_path,
                              extra=["--role", "decode", "--kv-cache-bytes", "1650000",
                                     "--kv-import-wait", "0.1", *fast])  # fmt: skip
        gateway = start_gateway("gw", redis.url, tmp_path / "regions.yaml", tmp_path,
                                extra=["--disagg-min-tokens", "400"])  # fmt: skip
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0,
                               timeout=60)  # fmt: skip
        try:
            wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["workers"] == 2, 30, "workers")
            assert worker_stats(decode)["total_kv_blocks"] < 90

            def hold(i: int) -> str:  # computed on the decode worker itself (short of 400)
                return client.completions.create(
                    model="stories", prompt=ids[i : i + 300], max_tokens=200, temperature=0,
                    extra_body={"ignore_eos": True},
                ).choices[0].text  # fmt: skip

            # twelve such requests: four fill the cache, and while any waits for blocks the
            # worker takes no import (first come, first served)
            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                holders = [pool.submit(hold, i) for i in range(12)]
                wait_until(lambda: worker_stats(decode)["waiting"] >= 4, 30,
                           "requests waiting for the decode worker's KV cache")  # fmt: skip
                prefill.kill()  # listed until its entry expires: the next prompt is split
                answer = client.completions.create(
                    model="stories", prompt=split, max_tokens=24, temperature=0
                )
                text = answer.choices[0].text
                assert all(f.result() for f in holders)
        finally:
            gateway.stop()
            decode.stop()
            prefill.stop()
    log = gateway.log.read_text()
    assert "no KV room" in log, log[-3000:]  # the case under test did happen
    want = reference.generate([split], SamplingParams(max_tokens=24, temperature=0.0))
    assert text == want[0].outputs[0].text


def test_a_hung_decode_worker_costs_a_retry_not_a_stall(tmp_path: Path, stories_dir: Path) -> None:
    """A decode worker that stops answering (SIGSTOP: its port still accepts) is failed after
    the gateway's idle timeout (3 s here), as a colocated one is, and the request, which had no
    token yet, goes to the other decode worker, disaggregated still. The decode worker answers
    at once and keeps its stream alive while it pulls the prompt's KV; the gateway used to wait
    up to 300 s for a disaggregated attempt, unable to tell a hung worker from a slow pull
    (found by a fault-injection review: its requests waited 40 s, until SIGCONT)."""
    (tmp_path / "regions.yaml").write_text(CATALOG)
    with LocalRedis() as redis:
        prefill = start_worker("prefill", stories_dir, redis.url, tmp_path,
                               extra=["--role", "prefill"])  # fmt: skip
        decodes = [start_worker(f"decode{i}", stories_dir, redis.url, tmp_path,
                                extra=["--role", "decode"]) for i in (1, 2)]  # fmt: skip
        gateway = start_gateway("gw", redis.url, tmp_path / "regions.yaml", tmp_path,
                                extra=["--disagg-min-tokens", "0", "--worker-idle-timeout", "3"])  # fmt: skip
        # (well past the idle timeout and its retry; well short of the 300 s it was)
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0,
                               timeout=20)  # fmt: skip
        try:
            wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["workers"] == 3, 30, "workers")
            p_id = prefill.meta["worker_id"]
            session = {"x-session-affinity": "hung"}
            raw = client.completions.with_raw_response.create(
                model="stories", prompt=STORY, max_tokens=2, extra_headers=session
            )
            first = raw.headers["x-edgeinfer-worker"]
            assert raw.headers["x-edgeinfer-prefill-worker"] == p_id
            hung = next(d for d in decodes if d.meta["worker_id"] == first)
            hung.signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                # a prompt the session's worker has not cached: split again
                raw = client.completions.with_raw_response.create(
                    model="stories", prompt="Lily saw a big dog.", max_tokens=2,
                    extra_headers=session,
                )  # fmt: skip
                took = time.monotonic() - t0
            finally:
                hung.signal(signal.SIGCONT)
            assert raw.headers["x-edgeinfer-worker"] not in (first, p_id)
            assert raw.headers["x-edgeinfer-prefill-worker"] == p_id
            assert raw.parse().choices[0].text
            assert 2.5 <= took < 15, took  # the idle timeout, then the other decode worker
            assert f"worker {first} failed (no answer in time)" in gateway.log.read_text()
        finally:
            gateway.stop()
            for d in decodes:
                d.stop()
            prefill.stop()
