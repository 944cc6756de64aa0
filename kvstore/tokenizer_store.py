"""A model's tokenizer files in Redis, so a gateway with no model files can tokenize like a worker.

Cache-aware routing hashes a prompt's token ids (kvstore.block_hash), so the gateway must compute
exactly the ids the worker would. Workers own the model files; the first worker of a model
revision publishes its tokenizer files once, and gateways fetch them and build the same
`runtime.tokenizer.Tokenizer` from them (gateway/tokenization.py).

    ei:tok:{<model>}:<cache_id>    string: orjson {relative file name: text}, no TTL

`cache_id` names the model revision and its tokenizer (the worker chooses it: it changes when
the weights or the tokenizer files change, a chat template included), so
a new revision gets a new key and an old key is never rewritten: the write is SET NX, and every
worker of one revision holds the same files, so the first copy is as good as any. There is no
TTL: a bundle is a few MiB at most and a gateway may need it long after the last publish.
"""

from __future__ import annotations

from pathlib import Path

import orjson
from redis.asyncio import Redis

from kvstore.keys import PREFIX, check_id
from kvstore.tokenizer_files import (
    TokenizerBundleError,
    is_bundle_file,
    read_tokenizer_files,
)

MAX_BUNDLE_BYTES = 32 * 1024 * 1024  # largest bundle stored: big vocabularies are ~10-20 MiB


def tokenizer_key(model: str, cache_id: str) -> str:
    """The string holding one model revision's tokenizer files; in the model's hash slot."""
    return f"{PREFIX}tok:{{{check_id(model, 'model')}}}:{check_id(cache_id, 'cache_id')}"


async def publish_tokenizer(redis: Redis, model: str, cache_id: str, model_dir: Path) -> bool:
    """Store `model_dir`'s tokenizer files under (model, cache_id) unless a copy is there.

    Returns True when this call stored the bundle, False when one already existed (the first
    worker's copy stays). Checks for the key first, so a restarting worker does not read and send
    megabytes for nothing. A bundle over MAX_BUNDLE_BYTES raises TokenizerBundleError. The client's
    socket timeout must allow sending the bundle (a few MiB).
    """
    key = tokenizer_key(model, cache_id)
    if await redis.exists(key):
        return False
    blob = orjson.dumps(read_tokenizer_files(model_dir))
    if len(blob) > MAX_BUNDLE_BYTES:
        raise TokenizerBundleError(
            f"{model_dir}: tokenizer files are {len(blob)} bytes as a bundle; the limit is "
            f"{MAX_BUNDLE_BYTES} bytes (32 MiB)"
        )
    return bool(await redis.set(key, blob, nx=True))


async def fetch_tokenizer_files(redis: Redis, model: str, cache_id: str) -> dict[str, str] | None:
    """The stored {name: text} for (model, cache_id), or None if no worker published it yet.

    A malformed bundle (not an object of strings, an unexpected file name) raises
    TokenizerBundleError; Redis failures propagate as redis exceptions.
    """
    blob = await redis.get(tokenizer_key(model, cache_id))
    if blob is None:
        return None
    try:
        files = orjson.loads(blob)
    except orjson.JSONDecodeError as e:
        raise TokenizerBundleError(f"tokenizer bundle of {model!r} ({cache_id}): {e}") from e
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        raise TokenizerBundleError(
            f"tokenizer bundle of {model!r} ({cache_id}) is not an object of strings"
        )
    bad = sorted(k for k in files if not is_bundle_file(k))
    if bad or "tokenizer.json" not in files:
        raise TokenizerBundleError(
            f"tokenizer bundle of {model!r} ({cache_id}): unexpected files {bad} "
            f"or no tokenizer.json"
        )
    return files
