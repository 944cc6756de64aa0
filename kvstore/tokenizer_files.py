"""The files a model's tokenizer is made of (what a worker publishes to Redis for gateways,
kvstore.tokenizer_store) and their digest: the standard library only, so that the engine can
name its tokenizer in its cache id without importing a Redis client."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

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


class TokenizerBundleError(ValueError):
    """A bundle cannot be stored (too large, unreadable file) or a stored one is malformed."""


def is_bundle_file(name: str) -> bool:
    """Whether `name` may appear in a bundle: a known file, or an extra chat template. Nothing
    else is written to disk from a bundle, so a bad entry cannot escape the target folder."""
    return name in TOKENIZER_FILES or bool(_EXTRA_TEMPLATE.fullmatch(name))


def bundle_paths(model_dir: Path) -> list[tuple[str, Path]]:
    """(name, path) of the bundle files present in `model_dir`; tokenizer.json is required."""
    if not (model_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no tokenizer.json to publish")
    paths = [model_dir / name for name in TOKENIZER_FILES]
    extra_dir = model_dir / EXTRA_TEMPLATES_DIR
    if extra_dir.is_dir():
        paths += sorted(extra_dir.glob("*.jinja"))
    named = ((path.relative_to(model_dir).as_posix(), path) for path in paths)
    return [(name, path) for name, path in named if path.is_file() and is_bundle_file(name)]


def read_tokenizer_files(model_dir: Path) -> dict[str, str]:
    """{name: text} of the bundle files present in `model_dir`; tokenizer.json is required."""
    files: dict[str, str] = {}
    for name, path in bundle_paths(model_dir):
        try:
            files[name] = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerBundleError(f"{path}: cannot read ({e})") from e
    return files


def tokenizer_digest(model_dir: Path) -> str:
    """16 hex digits of sha256 over `model_dir`'s tokenizer files (names and bytes): two folders
    of one model whose chat templates or special tokens differ render one request as other ids,
    so they must not share a cache id (the gateway tokenizes for a cache id's workers, and a
    prefill side's KV is only of use to a decode side that renders alike)."""
    h = hashlib.sha256()
    for name, path in bundle_paths(model_dir):  # (the bytes as they are: no decoding)
        data = path.read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]
