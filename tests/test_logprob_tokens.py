"""Logprob tokens that hold part of a character, through the service with the real `openai`
client: each token's `bytes` are its own raw bytes (byte-level BPE on SmolLM2-135M, byte
fallback "<0xF0>" on stories260K), so a completion's bytes add up to its text's UTF-8; such a
token's text is its bytes escaped ("bytes:\\xf0\\x9f"), as OpenAI writes it, so that alternatives
stay apart (before, all were U+FFFD and /v1/completions' `top_logprobs` dict lost some)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from kvstore.redis_server import LocalRedis
from tests.stack import chat_model, get_json, start_gateway, start_worker, wait_until

CATALOG = "regions:\n  - {name: local, latitude: 0, longitude: 0, settings: {}}\n"
TEXT = "Emoji: 😀 é 🤣 ok"  # 4-byte, 2-byte and 1-byte characters
EMOJI = "Emoji list: 😀 😃 😄 😁 😆 😅 🤣 😂 🙂 🙃 😉 😊 😇"  # SmolLM2 goes on with emoji


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path, smol_dir: Path):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("logprobs")
    (root / "regions.yaml").write_text(CATALOG)
    redis = LocalRedis().start()
    procs = []
    try:
        procs.append(start_worker("stories", chat_model(stories_dir, root / "stories"),
                                  redis.url, root))  # fmt: skip
        procs.append(start_worker("smol", smol_dir, redis.url, root, served="smol",
                                  extra=["--kv-cache-bytes", "60000000"]))  # fmt: skip
        gateway = start_gateway("gw", redis.url, root / "regions.yaml", root)
        procs.append(gateway)
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["workers"] == 2, 30, "workers")
        yield openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0,
                            timeout=60)  # fmt: skip
    finally:
        for p in reversed(procs):
            p.stop()
        redis.stop()


@pytest.mark.parametrize("model", ["stories", "smol"])
def test_token_bytes_add_up_to_the_text(client: openai.OpenAI, model: str) -> None:
    """The output is forced (guided_choice) to hold characters of 4, 2 and 1 bytes."""
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say it"}],
        max_tokens=60,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"guided_choice": [TEXT]},
    )
    choice = r.choices[0]
    assert choice.message.content == TEXT and choice.logprobs and choice.logprobs.content
    tokens = choice.logprobs.content
    assert b"".join(bytes(t.bytes or []) for t in tokens) == TEXT.encode()
    assert any(_partial(t.bytes) for t in tokens)  # the emoji are split, in both tokenizers
    for lp in [*tokens, *(a for t in tokens for a in t.top_logprobs)]:
        assert lp.token == _shown(lp.bytes or []), lp


def test_partial_tokens_stay_apart_in_completions_top_logprobs(client: openai.OpenAI) -> None:
    """SmolLM2 goes on with emoji, whose likely first tokens are all partial (' \\xf0\\x9f\\x98',
    ' \\xf0\\x9f'): each of the 3 alternatives keeps its own key."""
    r = client.completions.create(model="smol", prompt=EMOJI, max_tokens=8, temperature=0,
                                  logprobs=3)  # fmt: skip
    lp = r.choices[0].logprobs
    assert lp is not None and lp.top_logprobs and lp.tokens
    assert [len(top) for top in lp.top_logprobs] == [3] * 8, lp.top_logprobs
    assert any(t.startswith("bytes:") for top in lp.top_logprobs for t in top), lp.top_logprobs
    assert any(t.startswith("bytes:") for t in lp.tokens), lp.tokens


def _partial(raw: list[int] | None) -> bool:
    try:
        bytes(raw or []).decode()
    except UnicodeDecodeError:
        return True
    return False


def _shown(raw: list[int]) -> str:
    """A token's text as OpenAI shows it: its text, or its bytes escaped when they are not
    UTF-8 by themselves."""
    if _partial(raw):
        return "bytes:" + bytes(raw).decode(errors="backslashreplace")
    return bytes(raw).decode()
