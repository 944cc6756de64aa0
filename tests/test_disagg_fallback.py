"""Prefill workers that cannot or will not take a prompt do not cost the request: a real
redis-server, three prefill workers that refuse long prompts (`--max-model-len 64`, a KV cache of
96 tokens), a decode worker, a real gateway, the real `openai` client.

Checked: a prompt every prefill worker refuses (kv_source_refused: longer than their context) is
offered to MAX_PREFILL_TRIES of them, then computed whole on the decode worker, with the colocated
answer; a prompt no prefill worker's KV cache can hold (their published capacity) goes straight
to the decode worker, with no pull tried. Both were a 503 once the three refusals had spent the
gateway's three attempts, while the decode worker sat idle.
"""

from __future__ import annotations

import concurrent.futures
import re
from pathlib import Path

import openai
import pytest

from gateway.proxy import MAX_PREFILL_TRIES
from gateway.regions import DEFAULT_CATALOG, RegionCatalog
from gateway.routing import Router
from kvstore.protocol import WorkerInfo
from kvstore.redis_server import LocalRedis
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.stack import Proc, get_json, start_gateway, start_worker, wait_until, worker_stats
from tests.test_disagg import CATALOG, STORY

MAX_LEN = 64  # the prefill workers' --max-model-len
KV_BYTES = 130_000  # the prefill workers' KV cache: 6 blocks of 16 tokens (stories260K)
CAPACITY = 96


class Cluster:
    def __init__(self, root: Path, stories: Path) -> None:
        (root / "regions.yaml").write_text(CATALOG)
        self.redis = LocalRedis().start()
        self.workers: list[Proc] = []
        small = ["--role", "prefill", "--max-model-len", str(MAX_LEN),
                 "--kv-cache-bytes", str(KV_BYTES)]  # fmt: skip
        specs = [(f"prefill{i}", small) for i in range(3)] + [("decode", ["--role", "decode"])]
        with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
            futures = [pool.submit(start_worker, name, stories, self.redis.url, root, extra=extra)
                       for name, extra in specs]  # fmt: skip
            self.workers = [f.result() for f in futures]
        self.prefill, self.decode = self.workers[:3], self.workers[3]
        self.gateway = start_gateway("gw", self.redis.url, root / "regions.yaml", root,
                                     extra=["--disagg-min-tokens", "0"])  # fmt: skip
        wait_until(lambda: get_json(f"{self.gateway.url}/readyz")[1]["workers"] == 4, 30, "workers")
        self.client = openai.OpenAI(
            base_url=f"{self.gateway.url}/v1", api_key="unused", max_retries=0, timeout=60
        )

    def close(self) -> None:
        self.gateway.stop()
        for w in self.workers:
            w.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path):  # type: ignore[no-untyped-def]
    c = Cluster(tmp_path_factory.mktemp("fallback"), stories_dir)
    try:
        s = worker_stats(c.prefill[0])
        assert (s["capacity_tokens"], s["role"]) == (CAPACITY, "prefill"), s
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def reference(stories_dir: Path) -> LLM:
    """Colocated serving: the engine itself, in this process, on the same weights."""
    return LLM(stories_dir, kv_cache_bytes=4_000_000)


def _complete(c: Cluster, ids: list[int], stream: bool) -> tuple[str, dict[str, str]]:
    raw = c.client.completions.with_raw_response.create(
        model="stories", prompt=ids, max_tokens=16, temperature=0.0, stream=stream
    )
    resp = raw.parse()
    if stream:
        text = "".join(chunk.choices[0].text for chunk in resp if chunk.choices)
    else:
        text = resp.choices[0].text
    return text, dict(raw.headers)


def _refusals(c: Cluster, request_id: str) -> list[str]:
    """The workers that failed or refused this request's attempts, from the gateway's log."""
    pattern = re.compile(rf"request {re.escape(request_id)}: worker (\S+) failed: ")
    return [m.group(1) for m in pattern.finditer(c.gateway.log.read_text())]


def _settled(c: Cluster) -> None:
    def idle() -> bool:
        for w in c.workers:
            s = worker_stats(w)
            if s["free_kv_blocks"] != s["total_kv_blocks"] or s["kv_exports_held"]:
                return False
        return True

    wait_until(idle, 10, "every KV block free")


@pytest.mark.parametrize("stream", [False, True])
def test_every_prefill_worker_refusing_the_prompt_leaves_it_to_the_decode_worker(
    cluster: Cluster, reference: LLM, stream: bool
) -> None:
    """80 tokens: within the prefill workers' KV caches (so they are candidates), over their
    context (so each refuses the pull: kv_source_refused)."""
    ids = reference.tokenizer.encode(STORY * 4)[:80]
    assert MAX_LEN < len(ids) <= CAPACITY
    text, headers = _complete(cluster, ids, stream)
    want = reference.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))
    assert text == want[0].outputs[0].text
    assert headers["x-edgeinfer-worker"] == cluster.decode.meta["worker_id"]
    assert "x-edgeinfer-prefill-worker" not in headers
    # the case under test did happen: that many distinct prefill workers refused it first
    refusals = _refusals(cluster, headers["x-request-id"])
    assert len(set(refusals)) == len(refusals) == MAX_PREFILL_TRIES, refusals
    assert set(refusals) <= {w.meta["worker_id"] for w in cluster.prefill}, refusals
    _settled(cluster)


def test_a_prompt_no_prefill_worker_can_hold_goes_to_the_decode_worker_at_once(
    cluster: Cluster, reference: LLM
) -> None:
    """134 tokens: more than any prefill worker's KV cache holds (capacity_tokens, published in
    the registry): no prefill worker is asked at all."""
    ids = reference.tokenizer.encode(STORY * 4)[:134]
    assert len(ids) == 134
    pulls = [worker_stats(w)["kv_pulls_served"] for w in cluster.prefill]
    text, headers = _complete(cluster, ids, stream=False)
    want = reference.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))
    assert text == want[0].outputs[0].text
    assert headers["x-edgeinfer-worker"] == cluster.decode.meta["worker_id"]
    assert "x-edgeinfer-prefill-worker" not in headers
    assert _refusals(cluster, headers["x-request-id"]) == []
    assert [worker_stats(w)["kv_pulls_served"] for w in cluster.prefill] == pulls
    _settled(cluster)


def test_prefill_candidates_skip_workers_whose_kv_cache_cannot_hold_the_prompt() -> None:
    r = Router("eu-west", RegionCatalog.load(DEFAULT_CATALOG))

    def prefill(wid: str, capacity: int, load: int = 0) -> WorkerInfo:
        return WorkerInfo(worker_id=wid, region="eu-west", model="m", role="prefill",
                          url=f"http://{wid}", max_num_seqs=4, capacity_tokens=capacity,
                          kv_addr=f"{wid}:1", prefill_tokens=load)  # fmt: skip

    ws = [prefill("small", 96), prefill("big", 4096, load=3000)]

    def order(prompt_tokens: int) -> list[str]:
        return [w.worker_id for w in r.prefill_candidates("m", ws, prompt_tokens=prompt_tokens)]

    assert order(96) == ["small", "big"]  # a prompt of exactly its capacity fits
    assert order(97) == ["big"]
    ws = ws[:1]
    assert order(134) == []  # none can hold it: the decode worker computes it (pick_prefill)
    assert order(0) == ["small"]  # the prompt's length unknown (not tokenized): by load alone
