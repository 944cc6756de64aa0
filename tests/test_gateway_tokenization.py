"""The gateway tokenizes like the worker: tokenizer files through Redis, same ids, same errors.

Real redis-server, real stories260K tokenizer. The reference is the worker's own code
(Worker.prompt_of, LLMEngine.tokenize_prompt) called on a Tokenizer loaded from the model folder,
so a change on the worker side that the gateway does not mirror fails here.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
import redis
from redis.asyncio import Redis

from gateway.errors import APIError
from gateway.tokenization import GatewayTokenizers, prompt_token_ids
from kvstore import tokenizer_store
from kvstore.client import connect
from kvstore.redis_server import LocalRedis, find_free_port
from kvstore.tokenizer_store import (
    BUNDLE_TTL_S,
    TokenizerBundleError,
    bundle_id,
    fetch_tokenizer_files,
    publish_tokenizer,
    tokenizer_key,
)
from runtime.sampling_params import InvalidRequestError
from runtime.tokenizer import Tokenizer
from tests.stack import chat_model, start_worker, wait_until

ROOT = Path(__file__).resolve().parent.parent
MODEL = "stories"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PICKY_TEMPLATE = (
    "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must come "
    "from the user') }}{% endif %}" + CHAT_TEMPLATE
)


@pytest.fixture
async def r(redis_server: LocalRedis) -> AsyncIterator[Redis]:
    """A client on the session's Redis, emptied before each test."""
    client = connect(redis_server.url)
    await client.flushdb()
    yield client
    await client.aclose()


def model_copy(src: Path, dst: Path, template: str | None) -> Path:
    """The stories260K tokenizer files (not the weights), with `template` as chat_template.jinja."""
    dst.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, dst / name)
    if template is not None:
        (dst / "chat_template.jinja").write_text(template)
    return dst


@pytest.fixture
def chat_dir(stories_dir: Path, tmp_path: Path) -> Path:
    return model_copy(stories_dir, tmp_path / "chat", CHAT_TEMPLATE)


def worker_ids(folder: Path, prompt: Any, messages: Any, model: str = MODEL) -> list[int]:
    """What a worker serving `folder` computes: Worker.prompt_of, then tokenize_prompt."""
    from runtime.engine import LLMEngine
    from runtime.worker import Worker

    tok = Tokenizer.from_dir(folder)
    worker = SimpleNamespace(tokenizer=tok, config=SimpleNamespace(model_name=model))
    req = SimpleNamespace(prompt=prompt, messages=messages, tools=None)
    raw = Worker.prompt_of(worker, req)  # type: ignore[arg-type]
    engine = SimpleNamespace(
        tokenizer=tok, model=SimpleNamespace(cfg=SimpleNamespace(vocab_size=tok.vocab_size))
    )
    ids: list[int] = LLMEngine.tokenize_prompt(engine, raw)  # type: ignore[arg-type]
    return ids


PROMPTS: list[tuple[Any, Any]] = [
    ("Once upon a time, there was a little cat.", None),
    ([1, 403, 407, 261, 378], None),
    (None, [{"role": "user", "content": "Hello"}]),
    (None, [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi there"}]),
]


@pytest.mark.parametrize(("prompt", "messages"), PROMPTS, ids=["text", "ids", "chat", "chat2"])
async def test_ids_match_the_worker(r: Redis, chat_dir: Path, prompt: Any, messages: Any) -> None:
    assert await publish_tokenizer(r, MODEL, "rev1", chat_dir)
    toks = GatewayTokenizers(r)
    tok = await toks.get(MODEL, "rev1")
    assert tok is not None
    ids = prompt_token_ids(tok, prompt, messages, model=MODEL)
    assert ids == worker_ids(chat_dir, prompt, messages)
    assert ids and all(isinstance(t, int) for t in ids)


BAD: list[tuple[str, Any, Any]] = [
    ("chat", "hi", [{"role": "user", "content": "x"}]),  # both given
    ("chat", None, None),  # neither
    ("chat", "", None),  # empty text
    ("chat", [], None),  # empty ids
    ("chat", [1, "2"], None),  # a non-integer id
    ("chat", [1, True], None),  # a bool is not an id
    ("chat", [-1], None),  # negative id
    ("plain", None, [{"role": "user", "content": "x"}]),  # no chat template
    ("picky", None, [{"role": "assistant", "content": "x"}]),  # raise_exception
    ("chat", None, [{"role": "user"}]),  # the template reads a missing key: renders "" (no error)
]


@pytest.mark.parametrize(("variant", "prompt", "messages"), BAD)
async def test_errors_match_the_worker(
    r: Redis, stories_dir: Path, tmp_path: Path, variant: str, prompt: Any, messages: Any
) -> None:
    template = {"chat": CHAT_TEMPLATE, "plain": None, "picky": PICKY_TEMPLATE}[variant]
    folder = model_copy(stories_dir, tmp_path / variant, template)
    await publish_tokenizer(r, MODEL, variant, folder)
    tok = await GatewayTokenizers(r).get(MODEL, variant)
    assert tok is not None
    try:
        expected: list[int] | InvalidRequestError = worker_ids(folder, prompt, messages)
    except InvalidRequestError as e:
        expected = e
    if isinstance(expected, list):
        assert prompt_token_ids(tok, prompt, messages, model=MODEL) == expected
        return
    with pytest.raises(APIError) as info:
        prompt_token_ids(tok, prompt, messages, model=MODEL)
    err = info.value
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", expected.param)
    if prompt == [-1]:  # the gateway does not know the vocabulary: its bound is int32's
        assert err.message.startswith("prompt: token id -1 is outside [0, ")
    else:
        assert err.message == str(expected)
    if variant == "picky":  # the template's own words, once (not "messages: ... messages: ...")
        assert err.message == "messages: the first message must come from the user"


async def test_bundle_round_trip(r: Redis, chat_dir: Path) -> None:
    extra = chat_dir / "additional_chat_templates"
    extra.mkdir()
    (extra / "tool_use.jinja").write_text("{{ tools }}")
    (chat_dir / "model.safetensors").write_bytes(b"\0" * 16)  # not a tokenizer file
    assert await publish_tokenizer(r, MODEL, "rev1", chat_dir)
    files = await fetch_tokenizer_files(r, MODEL, "rev1")
    assert files is not None
    assert set(files) == {
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
        "chat_template.jinja",
        "additional_chat_templates/tool_use.jinja",
    }
    for name, text in files.items():
        assert text == (chat_dir / name).read_text()
    tok = await GatewayTokenizers(r).get(MODEL, "rev1")
    assert tok is not None
    ref = Tokenizer.from_dir(chat_dir)
    assert tok.chat_templates == ref.chat_templates
    assert (tok.bos_token_id, tok.eos_token_ids) == (ref.bos_token_id, ref.eos_token_ids)
    assert tok.special_tokens == ref.special_tokens
    assert tok.vocab_size == ref.vocab_size


async def test_first_copy_stays(r: Redis, stories_dir: Path, tmp_path: Path) -> None:
    first = model_copy(stories_dir, tmp_path / "a", CHAT_TEMPLATE)
    second = model_copy(stories_dir, tmp_path / "b", PICKY_TEMPLATE)
    assert await publish_tokenizer(r, MODEL, "rev1", first) is True
    assert await publish_tokenizer(r, MODEL, "rev1", second) is False
    files = await fetch_tokenizer_files(r, MODEL, "rev1")
    assert files is not None and files["chat_template.jinja"] == CHAT_TEMPLATE
    # Another revision is another key.
    assert await publish_tokenizer(r, MODEL, "rev2", second) is True


async def test_a_bundle_expires_unless_a_worker_or_a_gateway_renews_it(
    r: Redis, chat_dir: Path
) -> None:
    """A bundle is a few MiB: one of a model nobody serves any more must not stay forever. Each
    publish (a worker's heartbeat) and each gateway fetch push its expiry a week ahead."""
    week_ms = BUNDLE_TTL_S * 1000
    key = tokenizer_key(MODEL, "rev1")
    assert await publish_tokenizer(r, MODEL, "rev1", chat_dir) is True
    assert week_ms - 60_000 < await r.pttl(key) <= week_ms
    await r.pexpire(key, 1000)
    assert await publish_tokenizer(r, MODEL, "rev1", chat_dir) is False  # renewed, not rewritten
    assert week_ms - 60_000 < await r.pttl(key) <= week_ms
    await r.pexpire(key, 1000)
    assert await GatewayTokenizers(r).get(MODEL, "rev1") is not None
    assert week_ms - 60_000 < await r.pttl(key) <= week_ms
    # one nobody renews goes
    assert await publish_tokenizer(r, MODEL, "rev2", chat_dir, ttl_s=0.1) is True
    await asyncio.sleep(0.2)
    assert await fetch_tokenizer_files(r, MODEL, "rev2") is None


async def test_one_bundle_serves_every_kv_layout_of_a_tokenizer(
    r: Redis, stories_dir: Path
) -> None:
    """A KV dtype or a block size changes the cache id, not the tokenizer: workers of every
    layout share one bundle (each stored its own multi-MiB copy), and the gateway finds it from
    any of their cache ids, with one fetch."""
    from runtime.llm import LLM

    layouts: list[dict[str, Any]] = [{}, {"block_size": 8}, {"kv_cache_dtype": "bfloat16"}]
    engines = [LLM(str(stories_dir), kv_cache_bytes=1_000_000, **kw).engine for kw in layouts]
    cache_ids = [e.cache_id for e in engines]
    assert len(set(cache_ids)) == 3, cache_ids
    published = [await publish_tokenizer(r, MODEL, c, stories_dir) for c in cache_ids]
    assert published == [True, False, False]
    assert await r.keys("ei:tok:*") == [tokenizer_key(MODEL, cache_ids[0]).encode()]
    revision = engines[0].model_revision
    assert bundle_id(cache_ids[0]).startswith(f"{revision}-t")
    toks = GatewayTokenizers(r)
    got = [await toks.get(MODEL, c) for c in cache_ids]
    assert got[0] is not None and all(t is got[0] for t in got)
    assert toks.fetches == 1


async def test_concurrent_gets_fetch_once(r: Redis, chat_dir: Path) -> None:
    await publish_tokenizer(r, MODEL, "rev1", chat_dir)
    toks = GatewayTokenizers(r)
    got = await asyncio.gather(*(toks.get(MODEL, "rev1") for _ in range(20)))
    assert toks.fetches == 1
    assert got[0] is not None and all(t is got[0] for t in got)
    assert await toks.get(MODEL, "rev1") is got[0]
    assert toks.fetches == 1


async def test_a_cancelled_waiter_does_not_cancel_the_fetch(r: Redis, chat_dir: Path) -> None:
    await publish_tokenizer(r, MODEL, "rev1", chat_dir)
    toks = GatewayTokenizers(r)
    first = asyncio.create_task(toks.get(MODEL, "rev1"))
    second = asyncio.create_task(toks.get(MODEL, "rev1"))
    await asyncio.sleep(0)
    first.cancel()
    assert await second is not None
    assert toks.fetches == 1


async def test_missing_bundle_gives_none_and_retries_later(r: Redis, chat_dir: Path) -> None:
    now = [100.0]
    toks = GatewayTokenizers(r, retry_s=5.0, clock=lambda: now[0])
    assert await toks.get(MODEL, "rev1") is None
    assert await toks.get(MODEL, "rev1") is None  # within retry_s: no second fetch
    assert toks.fetches == 1
    await publish_tokenizer(r, MODEL, "rev1", chat_dir)
    now[0] += 4.0
    assert await toks.get(MODEL, "rev1") is None
    assert toks.fetches == 1
    now[0] += 1.5
    assert await toks.get(MODEL, "rev1") is not None
    assert toks.fetches == 2


async def test_redis_down_gives_none_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dead = connect(f"redis://127.0.0.1:{find_free_port()}/0", timeout_s=0.2)
    try:
        toks = GatewayTokenizers(dead, cache_dir=tmp_path / "cache", retry_s=0.0)
        with caplog.at_level(logging.DEBUG, logger="edgeinfer.gateway"):
            assert await toks.get(MODEL, "rev1") is None
            assert await toks.get(MODEL, "rev1") is None
        assert toks.fetches == 2  # retry_s=0: every get asks again
        warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
        assert len(warnings) == 1 and "rev1" in warnings[0].getMessage()
    finally:
        await dead.aclose()


async def test_cache_dir_is_left_empty(r: Redis, chat_dir: Path, tmp_path: Path) -> None:
    await publish_tokenizer(r, MODEL, "rev1", chat_dir)
    cache = tmp_path / "cache"
    tok = await GatewayTokenizers(r, cache_dir=cache).get(MODEL, "rev1")
    assert tok is not None and "from Redis" in tok.source
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize(
    "blob",
    [
        b"not json",
        orjson.dumps(["tokenizer.json"]),
        orjson.dumps({"tokenizer.json": 3}),
        orjson.dumps({"tokenizer.json": "{}", "../escape.json": "{}"}),
        orjson.dumps({"tokenizer_config.json": "{}"}),  # no tokenizer.json
    ],
)
async def test_malformed_bundle(r: Redis, blob: bytes) -> None:
    await r.set(tokenizer_key(MODEL, "bad"), blob)
    with pytest.raises(TokenizerBundleError):
        await fetch_tokenizer_files(r, MODEL, "bad")
    assert await GatewayTokenizers(r).get(MODEL, "bad") is None


async def test_unloadable_tokenizer_gives_none(r: Redis) -> None:
    await r.set(tokenizer_key(MODEL, "bad"), orjson.dumps({"tokenizer.json": "{}"}))
    assert await GatewayTokenizers(r).get(MODEL, "bad") is None


async def test_oversized_bundle_is_refused(
    r: Redis, chat_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer_store, "MAX_BUNDLE_BYTES", 1000)
    with pytest.raises(TokenizerBundleError, match="limit is 1000 bytes"):
        await publish_tokenizer(r, MODEL, "rev1", chat_dir)
    assert await r.exists(tokenizer_key(MODEL, "rev1")) == 0


async def test_publish_needs_tokenizer_json(r: Redis, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        await publish_tokenizer(r, MODEL, "rev1", tmp_path)


async def test_key_and_bad_ids(r: Redis) -> None:
    assert tokenizer_key("org/M-1", "abc") == "ei:tok:{org/M-1}:abc"
    # a cache id as the engine builds it: the KV layout is not part of the key
    for cache_id, bundle in [
        ("0123456789abcdef-t89abcdef-float32-b16", "0123456789abcdef-t89abcdef"),
        ("r-t00000000-x-t89abcdef-bfloat16-wfloat16-kvfloat8_e4m3fn-b256",
         "r-t00000000-x-t89abcdef"),  # (a revision of one's own, with "-t" in it)
        ("rev-tnothex00-float32-b16", "rev-tnothex00-float32-b16"),  # another shape: whole
    ]:  # fmt: skip
        assert bundle_id(cache_id) == bundle and bundle_id(bundle) == bundle
        assert tokenizer_key("m", cache_id) == f"ei:tok:{{m}}:{bundle}"
    for model, cache_id in [("a{b", "x"), ("m", "x}"), ("", "x"), ("m", "")]:
        with pytest.raises(ValueError):
            tokenizer_key(model, cache_id)
        assert await GatewayTokenizers(r).get(model, cache_id) is None


def test_gateway_tokenization_imports_no_torch() -> None:
    code = "import gateway.tokenization, sys; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_a_worker_registers_whatever_becomes_of_its_bundle(
    stories_dir: Path, tmp_path: Path
) -> None:
    """Real workers: the bundle is optional (a gateway without it routes by load), so it never
    holds up the registration. One too large to store is reported once, then left alone; a Redis
    error (an ACL denying the bundle's key) is retried at each heartbeat until it goes through."""
    big = chat_model(stories_dir, tmp_path / "big")
    (big / "additional_chat_templates").mkdir()
    (big / "additional_chat_templates" / "pad.jinja").write_text(
        "x" * tokenizer_store.MAX_BUNDLE_BYTES
    )
    acl = ["ACL SETUSER", "w", "on", "nopass", "+@all", "~ei:w:*", "~ei:m:*", "~ei:models",
           "~ei:p:*"]  # fmt: skip
    with LocalRedis() as server:
        admin = redis.Redis.from_url(server.url)
        admin.execute_command(*acl)
        denied_url = f"redis://w:x@127.0.0.1:{server.port}/0"
        workers = [start_worker("big", big, server.url, tmp_path, served="big")]
        try:
            workers.append(start_worker("denied", stories_dir, denied_url, tmp_path,
                                        served="denied"))  # fmt: skip
            wait_until(lambda: admin.exists("ei:m:{big}:workers", "ei:m:{denied}:workers") == 2,
                       10, "both registrations")  # fmt: skip
            time.sleep(1.0)  # heartbeats every 0.3 s
            assert admin.keys("ei:tok:*") == []
            admin.execute_command(*acl, "~ei:tok:*")
            wait_until(lambda: admin.keys("ei:tok:{denied}:*"), 10, "the bundle, once allowed")
            (key,) = admin.keys("ei:tok:{denied}:*")
            assert 0 < admin.pttl(key) <= BUNDLE_TTL_S * 1000
            assert key.decode().rsplit("-", 1)[1].startswith("t")  # no KV layout in the key
            admin.pexpire(key, 500)
            time.sleep(1.0)
            assert admin.keys("ei:tok:{big}:*") == []
            assert admin.pttl(key) > 3600_000  # the worker's heartbeats renew it
        finally:
            for w in workers:
                w.stop()
            admin.close()
    big_log, denied_log = (w.log.read_text() for w in workers)
    assert big_log.count("tokenizer bundle not published") == 1, big_log
    assert "the limit is 33554432 bytes" in big_log
    assert denied_log.count("tokenizer bundle not published yet") == 1, denied_log
    assert denied_log.count("tokenizer bundle published") == 1, denied_log
    assert "redis unreachable" not in big_log + denied_log


# ---------------------------------------------------------------------- mixed fleets
async def test_prefix_lookup_scores_every_cache_layout_of_a_model(
    r: Redis, redis_server: LocalRedis, chat_dir: Path, tmp_path: Path
) -> None:
    """Workers of one model with different cache ids (a KV dtype, a block size, a revision with
    another tokenizer) are each scored with their own seed, block size and tokenizer; the ids
    go to the worker only when one tokenizer serves them all."""
    from gateway.cluster import ClusterView
    from gateway.config import GatewayConfig
    from gateway.proxy import Call, Proxy
    from gateway.regions import DEFAULT_CATALOG, RegionCatalog
    from gateway.telemetry import GatewayTelemetry
    from kvstore.block_hash import block_hashes, cache_seed
    from kvstore.protocol import GenerateRequest, WorkerInfo
    from kvstore.telemetry import Telemetry, TelemetryConfig

    other = model_copy(chat_dir, tmp_path / "other", "{% for m in messages %}[{{ m['content'] }}]"
                       "{% endfor %}{% if add_generation_prompt %}>{% endif %}")  # fmt: skip
    layouts = {"revA-float32-b16": (chat_dir, 16), "revA-float32-kvbfloat16-b16": (chat_dir, 16),
               "revB-float32-b8": (other, 8)}  # fmt: skip
    for cache_id, (folder, _) in layouts.items():
        assert await publish_tokenizer(r, MODEL, cache_id, folder)
    messages = [{"role": "user", "content": "Once upon a time there was a little cat who " * 4}]
    held = {
        "w1": ("revA-float32-b16", 2),
        "w2": ("revA-float32-kvbfloat16-b16", 1),
        "w3": ("revB-float32-b8", 3),
    }  # fmt: skip   worker -> (its cache id, blocks it holds)
    catalog = RegionCatalog.load(DEFAULT_CATALOG)
    region = next(iter(catalog.regions))
    view = ClusterView(GatewayConfig(region, redis_server.url, "s"), r, catalog)
    view.redis_ok = True
    for wid, (cache_id, blocks) in held.items():
        folder, bs = layouts[cache_id]
        ids = worker_ids(folder, None, messages)
        assert len(ids) > 3 * bs
        hashes = block_hashes(cache_seed(cache_id), ids[: blocks * bs], bs)
        await view.prefix.publish(MODEL, wid, hashes, [])
        view.workers.append(WorkerInfo(
            worker_id=wid, region=region, model=MODEL, role="mixed", url="u", max_num_seqs=4,
            capacity_tokens=1000, started_at=0.0, last_active_at=0.0, cache_id=cache_id,
            block_size=bs,
        ))  # fmt: skip
    tel = Telemetry(TelemetryConfig("test-gateway", region=region))
    proxy = Proxy(view, None, GatewayTelemetry(tel, region))  # type: ignore[arg-type]

    def call() -> Call:
        gen = GenerateRequest("r1", MODEL, messages=[dict(m) for m in messages], operation="chat")
        return Call("r1", None, 0.0, gen=gen)

    try:
        c = call()
        await proxy.prefix_lookup(c)
        assert c.cached == {"w1": 32, "w2": 16, "w3": 24}
        assert c.gen is not None and c.gen.messages is not None  # two tokenizers: each worker's own
        # the two revA layouts share one tokenizer (same files): ids go to the worker
        tokenizers = view.tokenizers._ready
        assert (
            tokenizers[(MODEL, "revA-float32-b16")]
            is tokenizers[(MODEL, "revA-float32-kvbfloat16-b16")]
        )
        view.workers = [w for w in view.workers if w.worker_id != "w3"]
        c = call()
        await proxy.prefix_lookup(c)
        assert c.cached == {"w1": 32, "w2": 16}
        assert c.gen is not None and c.gen.messages is None
        assert c.gen.prompt == worker_ids(chat_dir, None, messages)
        # Redis restarted and w3 has not registered again: the index is partial, not asked
        view._carried = {"w3": (view.workers[0], time.monotonic() + 10)}
        assert view.recovering
        c = call()
        await proxy.prefix_lookup(c)
        assert c.cached == {} and c.gen is not None and c.gen.messages is not None
    finally:
        tel.shutdown()
        await view.tokenizers.aclose()


def test_a_chat_template_is_part_of_the_cache_id(stories_dir: Path, tmp_path: Path) -> None:
    """Two folders of one model's weights with other chat templates render one chat request as
    other ids: they are two cache ids (so two tokenizer bundles, two prefix caches, and no KV
    transfer between them). They shared one, so the gateway tokenized every worker's requests
    with the first bundle published, and sent those ids: the other template was never applied."""
    from runtime.llm import LLM

    a = chat_model(stories_dir, tmp_path / "a")
    b = chat_model(stories_dir, tmp_path / "b")
    (b / "chat_template.jinja").write_text(
        (a / "chat_template.jinja").read_text().replace(": ", " says: ")
    )
    same = chat_model(stories_dir, tmp_path / "same")
    engines = [LLM(str(d), kv_cache_bytes=1_000_000).engine for d in (a, b, same)]
    assert len({e.model_revision for e in engines}) == 1  # the same weights
    ids = [e.cache_id for e in engines]
    assert ids[0] != ids[1] and ids[0] == ids[2], ids
    messages = [{"role": "user", "content": "Hi"}]
    ta, tb = (Tokenizer.from_dir(d) for d in (a, b))
    assert prompt_token_ids(ta, None, messages) != prompt_token_ids(tb, None, messages)


async def test_a_long_prompt_is_tokenized_off_the_event_loop(
    r: Redis, redis_server: LocalRedis, chat_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache-aware lookup tokenizes the prompt: a long one on a thread (a MB of text held
    every stream and probe of the gateway for ~0.5 s on the loop), a short one in line (a
    thread hop would cost each request more than its tokenizing)."""
    import threading

    from gateway import proxy as proxy_module
    from gateway.cluster import ClusterView
    from gateway.config import GatewayConfig
    from gateway.proxy import Call, Proxy
    from gateway.regions import DEFAULT_CATALOG, RegionCatalog
    from gateway.telemetry import GatewayTelemetry
    from kvstore.protocol import GenerateRequest, WorkerInfo
    from kvstore.telemetry import Telemetry, TelemetryConfig
    from runtime.tokenizer import LONG_TEXT_CHARS

    cache_id = "revA-float32-b16"
    assert await publish_tokenizer(r, MODEL, cache_id, chat_dir)
    catalog = RegionCatalog.load(DEFAULT_CATALOG)
    region = next(iter(catalog.regions))
    view = ClusterView(GatewayConfig(region, redis_server.url, "s"), r, catalog)
    view.redis_ok = True
    view.workers = [
        WorkerInfo(
            worker_id=wid, region=region, model=MODEL, role="mixed", url="u", max_num_seqs=4,
            capacity_tokens=1000, started_at=0.0, last_active_at=0.0, cache_id=cache_id,
            block_size=16,
        )
        for wid in ("w1", "w2")
    ]
    tel = Telemetry(TelemetryConfig("test-gateway", region=region))
    proxy = Proxy(view, None, GatewayTelemetry(tel, region))  # type: ignore[arg-type]
    threads: list[int] = []
    real = proxy_module.prompt_token_ids

    def recording(*args: Any, **kwargs: Any) -> list[int]:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(proxy_module, "prompt_token_ids", recording)
    try:
        for text in ("Once upon a time", "Once upon a time " * (LONG_TEXT_CHARS // 10)):
            messages = [{"role": "user", "content": text}]
            c = Call("r1", None, 0.0, gen=GenerateRequest("r1", MODEL, messages=messages,
                                                          operation="chat"))  # fmt: skip
            await proxy.prefix_lookup(c)
            assert c.gen is not None and c.gen.prompt == worker_ids(chat_dir, None, messages)
        loop_thread = threading.get_ident()
        assert threads[0] == loop_thread and threads[1] != loop_thread
    finally:
        tel.shutdown()
        await view.tokenizers.aclose()
