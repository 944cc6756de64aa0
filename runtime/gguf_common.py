"""What the GGUF importer's modules share: its errors, typed metadata access, JSON writing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np


class GGUFImportError(ValueError):
    """The file cannot be turned into a model folder. `path` names the GGUF file."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


class UnsupportedGGUFError(GGUFImportError):
    """A valid GGUF that uses something we do not convert: architecture, tensor type, tokenizer."""


class Metadata:
    """Typed access to the file's key/value metadata."""

    def __init__(self, reader: gguf.GGUFReader, path: Path) -> None:
        self._fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        try:
            value = field.contents()
        except UnicodeDecodeError as e:
            raise GGUFImportError(self.path, f"metadata {key!r} is not valid UTF-8 ({e})") from e
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))  # shortest spelling: 1e-05, not 9.99999974e-06
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFImportError(self.path, f"metadata {key!r} is missing")
        return value

    def per_layer(self, key: str, default: Any = None) -> Any:
        """A value llama.cpp may store once or once per layer; we need it the same for all."""
        value = self.get(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise UnsupportedGGUFError(self.path, f"{key} differs between layers: {value}")
            value = value[0]
        return value

    def count(self, key: str, default: int | None = None, least: int = 1) -> int:
        """An integer of at least `least` (a size, a count), stored once or once per layer;
        required unless `default` is given. GGUFImportError naming the key otherwise."""
        value = self.per_layer(key, default)
        if value is None:
            raise GGUFImportError(self.path, f"metadata {key!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
            raise GGUFImportError(
                self.path, f"metadata {key!r} must be an integer >= {least}, got {value!r}"
            )
        return int(value)

    def number(self, key: str, default: float | None = None) -> float:
        """A finite real number; required unless `default` is given."""
        value = self.get(key, default)
        if value is None:
            raise GGUFImportError(self.path, f"metadata {key!r} is missing")
        if (isinstance(value, bool) or not isinstance(value, int | float | np.number)
                or not math.isfinite(value)):  # fmt: skip
            raise GGUFImportError(self.path, f"metadata {key!r} must be a number, got {value!r}")
        return float(value)


def token_ids(meta: Metadata) -> dict[str, int]:
    keys = {
        "bos_token_id": "bos_token_id",
        "eos_token_id": "eos_token_id",
        "unk_token_id": "unknown_token_id",
        "pad_token_id": "padding_token_id",
        "eot_token_id": "eot_token_id",
        "eom_token_id": "eom_token_id",
    }
    # An id that is no token of the vocabulary is left out, as llama.cpp does ("bad special
    # token"): an eos one past it failed the engine's start (its eos mask), a bos or pad one the
    # import (an IndexError looking its text up)
    count = len(meta.get("tokenizer.ggml.tokens") or [])
    out = {}
    for name, key in keys.items():
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and 0 <= int(value) < count:
            out[name] = int(value)
    return out


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
