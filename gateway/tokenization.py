"""The gateway's copy of each model's tokenizer, for cache-aware routing.

To ask the prefix index which worker holds the longest prefix of a prompt, the gateway needs the
prompt's exact token ids (then their block hashes, kvstore.block_hash). It has no model files:
workers publish their tokenizer files to Redis (kvstore.tokenizer_store) and the gateway builds
the same `runtime.tokenizer.Tokenizer` from them. It then forwards the ids themselves
(GenerateRequest.prompt as list[int]), so gateway and worker agree by construction, not by
hoping two tokenizations match.

`runtime.tokenizer` is torch-free (tokenizers; jinja2 once a chat template is compiled), and
`runtime/__init__` imports lazily, so importing it here keeps the gateway free of torch.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import redis.exceptions
from redis.asyncio import Redis

from gateway.errors import invalid
from kvstore.keys import check_id
from kvstore.tokenizer_store import bundle_id, fetch_tokenizer_files
from runtime.sampling_params import InvalidRequestError
from runtime.tokenizer import NoChatTemplateError, Tokenizer

log = logging.getLogger("edgeinfer.gateway")

RETRY_S = 5.0  # after a failed or empty fetch, wait this long before asking Redis again
INT32_LIMIT = 2**31  # block hashes pack ids as int32; every real vocabulary is far smaller

_Key = tuple[str, str]  # (model, bundle id): kvstore.tokenizer_store.bundle_id of a cache id


class GatewayTokenizers:
    """Tokenizers by (model, cache_id), fetched from Redis once and kept in memory.

    Cache ids that differ by their KV layout only (dtype, block size) name one bundle
    (kvstore.tokenizer_store.bundle_id): they share one fetch and one Tokenizer.

    Concurrent first requests for one key share a single fetch (one task per key, awaited through
    `asyncio.shield` so a cancelled request does not cancel it for the others). A missing bundle
    or a Redis failure gives None, logged once per key, and is retried no more often than every
    `retry_s`: routing then falls back to load, which is correct, only colder.

    Open one per gateway process (in the app's cleanup_ctx) and `aclose()` it on shutdown.
    """

    def __init__(
        self,
        redis: Redis,
        cache_dir: Path | None = None,
        *,
        retry_s: float = RETRY_S,
        clock: Callable[[], float] = time.monotonic,
        on_redis_error: Callable[[Exception], None] | None = None,
    ) -> None:
        if retry_s < 0:
            raise ValueError(f"retry_s must be >= 0, got {retry_s}")
        self.redis = redis  # the process's shared client (kvstore.client.connect)
        self.on_redis_error = on_redis_error  # told when a fetch failed for Redis's sake
        self.cache_dir = cache_dir  # where files are unpacked while loading; None = system temp
        self.retry_s = retry_s
        self._clock = clock
        self._ready: dict[_Key, Tokenizer] = {}
        self._by_digest: dict[bytes, Tokenizer] = {}  # sha256 of a bundle's files -> its Tokenizer
        self._loading: dict[_Key, asyncio.Task[Tokenizer | None]] = {}  # one fetch per key
        self._failed_at: dict[_Key, float] = {}  # clock time of the last failed fetch
        self._warned: set[_Key] = set()  # keys whose failure was logged at warning level
        self.fetches = 0  # fetches started (for tests and stats)

    async def get(self, model: str, cache_id: str) -> Tokenizer | None:
        """The tokenizer of `model` at revision `cache_id`, or None when it is not available."""
        try:
            key = (check_id(model, "model"), bundle_id(cache_id))
        except ValueError:
            return None  # an id no worker could have published under; nothing to remember
        tok = self._ready.get(key)
        if tok is not None:
            return tok
        task = self._loading.get(key)
        if task is None:
            failed = self._failed_at.get(key)
            if failed is not None and self._clock() - failed < self.retry_s:
                return None
            task = asyncio.create_task(self._load(key), name=f"tokenizer {model} {key[1]}")
            self._loading[key] = task
        return await asyncio.shield(task)

    async def aclose(self) -> None:
        """Cancel fetches still running (gateway shutdown)."""
        tasks = list(self._loading.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _load(self, key: _Key) -> Tokenizer | None:
        """Fetch and build one tokenizer; records the outcome and never raises (but cancels)."""
        model, bundle = key
        self.fetches += 1
        try:
            files = await fetch_tokenizer_files(self.redis, model, bundle)
            if files is None:
                self._failed(key, "no worker has published it yet")
                return None
            # Bundles with the same files (another revision, same tokenizer) share one
            # Tokenizer: built once, and the proxy tokenizes a prompt once for all of them.
            digest = hashlib.sha256(orjson.dumps(files, option=orjson.OPT_SORT_KEYS)).digest()
            tok = self._by_digest.get(digest)
            if tok is None:
                label = f"tokenizer of {model!r} ({bundle}) from Redis"
                # Parsing tokenizer.json takes tens of ms for big vocabularies: off the event loop.
                tok = await asyncio.to_thread(_build, files, self.cache_dir, label)
                self._by_digest[digest] = tok
        except (redis.exceptions.RedisError, OSError, ValueError) as e:
            # ValueError covers a malformed bundle and a tokenizer file that does not load.
            self._failed(key, f"{type(e).__name__}: {e}")
            if self.on_redis_error is not None and isinstance(e, redis.exceptions.RedisError):
                self.on_redis_error(e)
            return None
        finally:
            self._loading.pop(key, None)
        self._ready[key] = tok
        self._failed_at.pop(key, None)
        if key in self._warned:
            log.info("tokenizer of %r (%s) is available now", model, bundle)
            self._warned.discard(key)
        return tok

    def _failed(self, key: _Key, why: str) -> None:
        self._failed_at[key] = self._clock()
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        log.log(
            level,
            "tokenizer of %r (%s) unavailable, routing without prefix hits: %s",
            *key,
            why,
        )


def _build(files: dict[str, str], cache_dir: Path | None, label: str) -> Tokenizer:
    """A Tokenizer from bundle files, unpacked into a private folder deleted once it is built.

    Tokenizer.from_dir reads every file eagerly, so nothing needs the folder afterwards. Names
    were checked by fetch_tokenizer_files (known files and additional_chat_templates/*.jinja).
    Text is written back as the worker read it (bytes decoded as UTF-8), so Tokenizer.from_dir
    sees the same bytes on both sides.
    """
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="edgeinfer-tok-", dir=cache_dir) as folder:
        root = Path(folder)
        for name, text in files.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode("utf-8"))
        tok = Tokenizer.from_dir(root)
    tok.source = label  # for messages; the folder is gone
    tok.warm_chat_template()  # (on this thread, not the event loop: jinja2's import, a compile)
    return tok


def prompt_token_ids(
    tok: Tokenizer,
    prompt: str | list[int] | None,
    messages: list[dict[str, Any]] | None,
    *,
    model: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt token ids a worker computes for a GenerateRequest(prompt=, messages=).

    Mirrors runtime.worker.Worker.prompt_of and runtime.engine.LLMEngine.tokenize_prompt: chat
    messages are rendered with the chat template (add_generation_prompt=True) and encoded without
    special tokens (the template writes the bos itself); a text prompt is encoded with them; token
    ids pass unchanged. `tools` (chat) go to the template as the worker passes them. Errors are the worker's 400s (same param, same message). `model` names the
    model in the no-chat-template message. The one check left to the worker is the upper bound of
    an id (the model's vocabulary, which the gateway does not know); ids must be in int32 range.

    CPU work, kept synchronous (it blocks the event loop while it runs): a few ms for a prompt
    of ~10k characters (stories260K: 12k characters in ~4 ms on a dev CPU).
    """
    if messages is not None:
        if prompt is not None:
            raise invalid("messages", "messages: give either messages or prompt, not both")
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        except NoChatTemplateError as e:
            who = f"model {model!r}" if model is not None else "the model"
            raise invalid(
                "messages", f"messages: {who} has no chat template; use /v1/completions"
            ) from e
        except InvalidRequestError as e:  # the template's raise_exception(): said as it is
            raise invalid(e.param, str(e)) from e
        except (TypeError, ValueError) as e:
            raise invalid("messages", f"messages: the chat template rejected them: {e}") from e
        return _checked_ids(tok.encode(text, add_special_tokens=False))
    if prompt is None:
        raise invalid("prompt", "prompt: give a prompt or messages")
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "prompt: must not be empty")
        return tok.encode(prompt)
    return _checked_ids(prompt)


def _checked_ids(prompt: object) -> list[int]:
    """tokenize_prompt's checks on a list of ids, less the vocabulary bound (see above)."""
    if not isinstance(prompt, list) or not prompt:
        raise invalid("prompt", "prompt: must be a non-empty string or list of token ids")
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, int):
            raise invalid("prompt", f"prompt: token ids must be integers, got {t!r}")
        if not 0 <= t < INT32_LIMIT:
            raise invalid("prompt", f"prompt: token id {t} is outside [0, {INT32_LIMIT})")
    return list(prompt)
