"""A model's tokenizer files in Redis, so a gateway with no model files can tokenize like a worker.

Cache-aware routing hashes a prompt's token ids (kvstore.block_hash), so the gateway must compute
exactly the ids the worker would. Workers own the model files; the first worker of a model
revision publishes its tokenizer files once, and gateways fetch them and build the same
`runtime.tokenizer.Tokenizer` from them (gateway/tokenization.py).

    ei:tok:{<model>}:<bundle id>   string: orjson {relative file name: text}; TTL BUNDLE_TTL_S

The bundle id is the part of a worker's cache id (runtime/engine.py:
`{revision}-t{tokenizer digest}-{dtypes}-b{block size}`) that names its tokenizer:
`{revision}-t{tokenizer digest}` (`bundle_id`). The KV layout (dtypes, block size) changes the
cache id but not the files, so workers of one revision with another --kv-cache-dtype or block
size share one copy, where each layout stored another identical one. The gateway reads a worker's
cache id in its registry entry and derives the same key. A new revision or tokenizer gets a new
key and an old key is never rewritten: the write is SET NX, and every worker of one revision
holds the same files, so the first copy is as good as any.

A bundle is a few MiB: one of a model nobody serves any more must not stay forever. Each
publish (every heartbeat of every worker using it: PEXPIRE, the files read and sent only when
the key is missing) and each gateway fetch pushes its expiry BUNDLE_TTL_S (a week) ahead, so it
expires a week after the last worker and gateway that used it.
"""

from __future__ import annotations

import re
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
BUNDLE_TTL_S = 7 * 24 * 3600  # a bundle nobody publishes or fetches for this long expires
# A cache id as runtime/engine.py builds it: revision, "-t" and 8 hex digits of the tokenizer's
# digest, then the KV layout (dtypes, "-b" block size). The revision may hold "-": the greedy
# group ends at the last "-t<8 hex>-" (no dtype name starts with "t").
_CACHE_ID = re.compile(r"(.+-t[0-9a-f]{8})-.+-b[0-9]+")


def bundle_id(cache_id: str) -> str:
    """The part of a worker's cache id that names its tokenizer files (see the module
    docstring); a cache id of another shape (an older worker's, a test's) names them whole."""
    found = _CACHE_ID.fullmatch(check_id(cache_id, "cache_id"))
    return found.group(1) if found else cache_id


def tokenizer_key(model: str, cache_id: str) -> str:
    """The string holding the tokenizer files of the workers of `model` with that cache id (and
    of every cache id with the same bundle id); in the model's hash slot."""
    return f"{PREFIX}tok:{{{check_id(model, 'model')}}}:{bundle_id(cache_id)}"


async def publish_tokenizer(
    redis: Redis, model: str, cache_id: str, model_dir: Path, ttl_s: float = BUNDLE_TTL_S
) -> bool:
    """Store `model_dir`'s tokenizer files under (model, cache_id) unless a copy is there, and
    push the copy's expiry `ttl_s` ahead either way.

    Returns True when this call stored the bundle, False when one already existed (the first
    worker's copy stays). Renews the key first (PEXPIRE answers whether it is there), so that a
    worker calling this at each heartbeat does not read and send megabytes for nothing. A bundle
    over MAX_BUNDLE_BYTES raises TokenizerBundleError. The client's socket timeout must allow
    sending the bundle (a few MiB).
    """
    key, ttl_ms = tokenizer_key(model, cache_id), max(1, round(ttl_s * 1000))
    if await redis.pexpire(key, ttl_ms):
        return False
    blob = orjson.dumps(read_tokenizer_files(model_dir))
    if len(blob) > MAX_BUNDLE_BYTES:
        raise TokenizerBundleError(
            f"{model_dir}: tokenizer files are {len(blob)} bytes as a bundle; the limit is "
            f"{MAX_BUNDLE_BYTES} bytes (32 MiB)"
        )
    return bool(await redis.set(key, blob, nx=True, px=ttl_ms))


async def fetch_tokenizer_files(
    redis: Redis, model: str, cache_id: str, ttl_s: float = BUNDLE_TTL_S
) -> dict[str, str] | None:
    """The stored {name: text} for (model, cache_id), or None if no worker published it yet;
    a found copy's expiry is pushed `ttl_s` ahead (a gateway still uses it).

    A malformed bundle (not an object of strings, an unexpected file name) raises
    TokenizerBundleError; Redis failures propagate as redis exceptions.
    """
    key = tokenizer_key(model, cache_id)
    pipe = redis.pipeline(transaction=False)  # (one key: one slot, one round trip)
    pipe.get(key)
    pipe.pexpire(key, max(1, round(ttl_s * 1000)))
    blob, _ = await pipe.execute()
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
