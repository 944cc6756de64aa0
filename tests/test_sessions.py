"""Prefix caching across the cluster: real redis-server, two workers, a gateway, the openai client.

w1 is a normal worker; w2 runs one request at a time, so it is easy to fill up.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import openai
import orjson
import pytest
import redis

from kvstore.redis_server import LocalRedis
from tests.stack import SECRET, chat_model, get_json, start_gateway, start_worker, wait_until

CATALOG = "regions:\n  - {name: eu, latitude: 50.1, longitude: 8.7}\n"
SYSTEM = (
    "You are a storyteller for small children. Every story has a little girl named Lily, a "
    "friendly dog, a big red ball, and a happy ending in the park."
)


class Pair:
    def __init__(self, root: Path, stories: Path) -> None:
        self.model = chat_model(stories, root / "stories-chat")
        (root / "regions.yaml").write_text(CATALOG)
        self.redis = LocalRedis().start()
        self.w1 = start_worker("w1", self.model, self.redis.url, root, "eu")
        self.w2 = start_worker("w2", self.model, self.redis.url, root, "eu",
                               ["--max-num-seqs", "1", "--max-waiting", "16"])  # fmt: skip
        self.gateway = start_gateway("gw", self.redis.url, root / "regions.yaml", root, "eu")
        wait_until(lambda: get_json(f"{self.gateway.url}/readyz")[1]["workers"] == 2, 30, "workers")
        self.client = openai.OpenAI(base_url=f"{self.gateway.url}/v1", api_key="x", max_retries=0)
        self.names = {self.w1.meta["worker_id"]: "w1", self.w2.meta["worker_id"]: "w2"}

    def close(self) -> None:
        self.gateway.stop()
        self.w1.stop()
        self.w2.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path):  # type: ignore[no-untyped-def]
    p = Pair(tmp_path_factory.mktemp("pair"), stories_dir)
    try:
        yield p
    finally:
        p.close()


def _chat(pair: Pair, messages: list[dict], session: str | None, max_tokens: int = 12):  # type: ignore[no-untyped-def, type-arg]
    raw = pair.client.chat.completions.with_raw_response.create(
        model="stories",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_headers={"x-session-affinity": session} if session else {},
    )
    return raw.parse(), pair.names[raw.headers["x-edgeinfer-worker"]], raw.headers


def test_conversation_with_the_header_reuses_each_turn(pair: Pair) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    seen, prev_prompt = set(), 0
    for turn in range(10):
        messages.append({"role": "user", "content": f"Tell me part {turn + 1} of the story."})
        resp, worker, _ = _chat(pair, messages, "conv-1")
        seen.add(worker)
        usage = resp.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        if turn > 0:
            assert usage.prompt_tokens_details.cached_tokens >= prev_prompt - 16, (turn, usage)
        prev_prompt = usage.prompt_tokens
        messages.append({"role": "assistant", "content": resp.choices[0].message.content or ""})
    assert len(seen) == 1, seen
    stats = get_json(f"{(pair.w1 if seen == {'w1'} else pair.w2).url}/internal/stats", SECRET)[1]
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["prefix_cache_query_tokens"] >= stats["prefix_cache_hit_tokens"]


def test_without_the_header_a_shared_prefix_goes_where_it_is_cached(pair: Pair) -> None:
    firsts = {}
    for i in range(4):  # four long, distinct prompts: load-based routing spreads them
        system = f"Story {i}. {SYSTEM} {SYSTEM}"
        _, worker, _ = _chat(pair, [{"role": "system", "content": system}], None, max_tokens=2)
        firsts[i] = (system, worker)
    assert set(w for _, w in firsts.values()) == {"w1", "w2"}
    time.sleep(0.3)  # the workers publish cache events every 50 ms
    for i, (system, worker) in firsts.items():
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "More!"}]
        resp, again, headers = _chat(pair, messages, None, max_tokens=2)
        assert again == worker, (i, headers.get("x-edgeinfer-route"))
        assert headers["x-edgeinfer-route"] == "prefix"
        assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
        assert resp.usage.prompt_tokens_details.cached_tokens >= 48


def _occupy(worker_url: str, n: int) -> list[threading.Thread]:
    """Long requests straight to a worker, so it has one running and the rest waiting."""

    def one(i: int) -> None:
        body = {"request_id": f"occupy-{i}-{time.monotonic()}", "model": "stories",
                "prompt": "Once upon a time",
                "sampling": {"max_tokens": 480, "ignore_eos": True, "temperature": 0}}  # fmt: skip
        req = urllib.request.Request(
            f"{worker_url}/internal/generate", data=orjson.dumps(body),
            headers={"x-edgeinfer-secret": SECRET}, method="POST",
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_a_full_worker_sheds_its_session(pair: Pair) -> None:
    session, messages = None, []
    for i in range(6):  # find a session that lands on w2
        # distinct from their first tokens: no cached prefix pulls them all to one worker, so
        # new sessions rotate over the two idle workers
        messages = [{"role": "user", "content": f"Shed {i}: hello there, storyteller!"}]
        _, worker, _ = _chat(pair, messages, f"shed-{i}", max_tokens=2)
        if worker == "w2":
            session = f"shed-{i}"
            break
    assert session is not None
    r = redis.Redis.from_url(pair.redis.url)
    key = f"ei:w:{{{pair.w2.meta['worker_id']}}}"
    threads = _occupy(pair.w2.url, 12)  # full for seconds (each takes ~0.2-0.5 s alone)
    wait_until(
        lambda: int(r.hget(key, "running") or 0) >= 1 and int(r.hget(key, "waiting") or 0) >= 1,
        10,
        "w2 to report itself full",
    )
    # the gateway's registry snapshot (re-read every 0.5 s) catches up; under a loaded machine
    # its refresh can run late, and the occupying requests keep w2 full for seconds anyway
    time.sleep(1.2)
    resp, worker, headers = _chat(pair, messages, session, max_tokens=2)
    assert worker == "w1" and headers["x-edgeinfer-route"] != "session"
    assert resp.choices[0].message.content is not None
    wait_until(
        lambda: (
            orjson.loads(r.get(f"ei:s:{{{session}}}") or b"{}").get("worker_id")
            == pair.w1.meta["worker_id"]
        ),
        5,
        "the session's placement to move",
    )
    r.close()
    for t in threads:
        t.join(60)


def test_the_prefix_index_forgets_a_worker_that_leaves(pair: Pair) -> None:
    r = redis.Redis.from_url(pair.redis.url)
    wid = pair.w2.meta["worker_id"].encode()

    def holders() -> int:
        return sum(r.sismember(k, wid) for k in r.scan_iter("ei:p:{stories}:*") if b":w:" not in k)

    wait_until(lambda: holders() > 0, 5, "w2's cached blocks in the prefix index")
    pair.w2.stop()  # SIGTERM: drain, leave the registry and the index
    assert pair.w2.popen.returncode == 0, pair.w2.tail()
    assert holders() == 0
    # the gateway keeps serving from the worker that is left
    resp, worker, _ = _chat(pair, [{"role": "user", "content": "Still there?"}], None, 2)
    assert worker == "w1" and resp.choices[0].message.content is not None
    r.close()


def test_chat_model_keeps_a_models_own_template_and_never_writes_into_it(
    stories_dir: Path, tmp_path: Path
) -> None:
    # stories260K has no template: its served copy gets one, the source stays as it was
    plain = chat_model(stories_dir, tmp_path / "stories-chat")
    assert not (stories_dir / "chat_template.jinja").exists()
    assert not (plain / "chat_template.jinja").is_symlink()
    # a model with its own template (SmolLM2's) keeps it, also when linked a second time (a
    # bench once wrote the test template through the link, into the user's model cache)
    own = tmp_path / "own"
    own.mkdir()
    for f in stories_dir.iterdir():
        (own / f.name).symlink_to(f)
    (own / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    for _ in range(2):
        served = chat_model(own, tmp_path / "own-chat")
        assert (served / "chat_template.jinja").read_text() == "{{ messages[0]['content'] }}"
    assert (own / "chat_template.jinja").read_text() == "{{ messages[0]['content'] }}"
