"""A model's tokenizer files in Redis, so a gateway with no model files can tokenize like a worker.

Cache-aware routing hashes a prompt's token ids (kvstore.block_hash), so the gateway must compute
exactly the ids the worker would. Workers own the model files; the first worker of a model
revision publishes its tokenizer files once, and gateways fetch them and build the same
`runtime.tokenizer.Tokenizer` from them (gateway/tokenization.py).

    ei:tok:{<model>}:<cache_id>    string: orjson {relative file name: text}, no TTL

`cache_id` names the model revision (the worker chooses it; it changes when the files change), so
a new revision gets a new key and an old key is never rewritten: the write is SET NX, and every
worker of one revision holds the same files, so the first copy is as good as any. There is no
TTL: a bundle is a few MiB at most and a gateway may need it long after the last publish.
"""

from __future__ import annotations

import re
from pathlib import Path

import orjson
from redis.asyncio import Redis

from kvstore.keys import PREFIX, check_id

# Every file runtime.tokenizer.Tokenizer.from_dir reads, plus the two that transformers reads
# (chat_template.json, special_tokens_map.json), so a later Tokenizer that reads them finds them.
# config.json carries bos/eos ids; it is small (the weights are elsewhere).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "generation_config.json",
    "config.json",
)
# Named extra chat templates (Tokenizer reads additional_chat_templates/*.jinja).
EXTRA_TEMPLATES_DIR = "additional_chat_templates"
_EXTRA_TEMPLATE = re.compile(rf"^{EXTRA_TEMPLATES_DIR}/[A-Za-z0-9_.-]+\.jinja$")
MAX_BUNDLE_BYTES = 32 * 1024 * 1024  # largest bundle stored: big vocabularies are ~10-20 MiB


class TokenizerBundleError(ValueError):
    """A bundle cannot be stored (too large, unreadable file) or a stored one is malformed."""


def tokenizer_key(model: str, cache_id: str) -> str:
    """The string holding one model revision's tokenizer files; in the model's hash slot."""
    return f"{PREFIX}tok:{{{check_id(model, 'model')}}}:{check_id(cache_id, 'cache_id')}"


def is_bundle_file(name: str) -> bool:
    """Whether `name` may appear in a bundle: a known file, or an extra chat template. Nothing
    else is written to disk from a bundle, so a bad entry cannot escape the target folder."""
    return name in TOKENIZER_FILES or bool(_EXTRA_TEMPLATE.fullmatch(name))


def read_tokenizer_files(model_dir: Path) -> dict[str, str]:
    """{name: text} of the bundle files present in `model_dir`; tokenizer.json is required."""
    if not (model_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no tokenizer.json to publish")
    paths = [model_dir / name for name in TOKENIZER_FILES]
    extra_dir = model_dir / EXTRA_TEMPLATES_DIR
    if extra_dir.is_dir():
        paths += sorted(extra_dir.glob("*.jinja"))
    files: dict[str, str] = {}
    for path in paths:
        name = path.relative_to(model_dir).as_posix()
        if not path.is_file() or not is_bundle_file(name):
            continue
        try:
            files[name] = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerBundleError(f"{path}: cannot read ({e})") from e
    return files


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
