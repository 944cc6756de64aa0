"""The model store's manifest: which shards a model has, their sizes, their checksums.

    <store>/<model>/edgeinfer-manifest.json     written last by `edgeinfer pull`
    {
      "format": "edgeinfer-store/1",
      "name": "SmolLM2-135M-Instruct",          the served model name
      "source": "/path/it/was/pulled/from",
      "created": "2026-11-22T10:00:00Z",
      "chunk_bytes": 16777216,                   checksum granularity (= the loader's read size)
      "shards": [{"file": "model-00001-of-00004.safetensors", "bytes": 134221824,
                  "xxh3_64": ["5f1c...", ...]}],  one digest per chunk_bytes piece from offset 0
      "tensors": {"model.norm.weight": {"shard": "model-00004-of-00004.safetensors",
                                        "dtype": "BF16", "shape": [576]}},
      "files": {"config.json": "9a0e...", ...}  xxh3-64 of each other file (config, tokenizer,
    }                                            chat template, index, ...); absent in a
                                                 manifest written before it was added

Checksums are per chunk, not per file, so the loader verifies each piece right after its read
(on the reading thread, while the piece is still in cache) instead of in a second pass, and a
mismatch names the shard and the byte range. xxh3-64 hashes at well over drive speed. The other
files get one checksum each, checked by `edgeinfer verify` (a manifest without "files" still
reads: `files` is None, and verify says those files are not covered).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import xxhash

from runtime.config import ModelLoadError

MANIFEST_NAME = "edgeinfer-manifest.json"
COMPRESSED_MANIFEST_NAME = "edgeinfer-compressed.json"  # a folder of Huffman-coded weights
# (runtime/compression.py); here so the loader can tell without importing the decoders
FORMAT = "edgeinfer-store/1"
CHUNK_BYTES = 16 << 20  # one checksum per 16 MiB piece (runtime.weights reads the same pieces)
MAX_CHUNK_BYTES = 1 << 30  # a reading thread holds a chunk-sized scratch buffer


@dataclass(frozen=True, slots=True)
class ShardEntry:
    file: str  # file name inside the model folder
    bytes: int  # its size
    xxh3_64: tuple[str, ...]  # hex digest of each chunk_bytes piece, the last one short


@dataclass(frozen=True, slots=True)
class TensorInfo:
    shard: str  # file name of the shard that holds it
    dtype: str  # safetensors dtype name (BF16, F32, ...)
    shape: tuple[int, ...]


@dataclass(slots=True)
class Manifest:
    name: str
    source: str
    chunk_bytes: int = CHUNK_BYTES
    shards: list[ShardEntry] = field(default_factory=list)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    created: str = ""
    # every other file of the folder (not the shards, not the manifest) -> xxh3-64 (hex) of the
    # whole file; None: a manifest from before these were recorded (the files are not covered)
    files: dict[str, str] | None = None

    def shard(self, file: str) -> ShardEntry | None:
        return next((s for s in self.shards if s.file == file), None)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def fingerprint(self) -> bytes:
        """What identifies the weights (runtime.loader.model_revision): the format, the chunk
        size, every shard's name, size and chunk checksums (which cover its header too), and
        the tensors; not the served name, when or from where it was pulled (two pulls of one
        model, e.g. on two nodes, are the same weights: KV they can exchange). Nor the other
        files' checksums: config.json, the one that shapes the KV, is in the revision already
        (model_revision hashes it); the tokenizer, templates and generation settings do not
        change the KV of a token sequence; and a pull from before they were recorded stays the
        same revision as a pull of the same weights made since."""
        shards = [[s.file, s.bytes, list(s.xxh3_64)] for s in self.shards]
        tensors = {k: [t.shard, t.dtype, list(t.shape)] for k, t in self.tensors.items()}
        keep = [FORMAT, self.chunk_bytes, shards, tensors]
        return json.dumps(keep, sort_keys=True).encode()

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "name": self.name,
            "source": self.source,
            "created": self.created or datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "chunk_bytes": self.chunk_bytes,
            "shards": [
                {"file": s.file, "bytes": s.bytes, "xxh3_64": list(s.xxh3_64)} for s in self.shards
            ],
            "tensors": {
                k: {"shard": t.shard, "dtype": t.dtype, "shape": list(t.shape)}
                for k, t in self.tensors.items()
            },
        } | ({} if self.files is None else {"files": dict(self.files)})

    @classmethod
    def from_json(cls, raw: Any, where: Path) -> Manifest:
        """Parse and check a manifest; ModelLoadError naming `where` for anything malformed."""
        try:
            if raw.get("format") != FORMAT:
                raise ValueError(f"format is {raw.get('format')!r}, expected {FORMAT!r}")
            chunk = int(raw["chunk_bytes"])
            if not 0 < chunk <= MAX_CHUNK_BYTES or chunk % 4096:
                raise ValueError(
                    f"chunk_bytes {chunk} is not a multiple of 4096 in (0, {MAX_CHUNK_BYTES}]"
                )
            shards = []
            for s in raw["shards"]:
                entry = ShardEntry(str(s["file"]), int(s["bytes"]), tuple(map(str, s["xxh3_64"])))
                if "/" in entry.file or "\0" in entry.file or entry.file.startswith("."):
                    raise ValueError(f"shard file {entry.file!r} is not a plain file name")
                if len(entry.xxh3_64) != max(1, -(-entry.bytes // chunk)):
                    raise ValueError(
                        f"shard {entry.file}: {len(entry.xxh3_64)} checksums for "
                        f"{entry.bytes} bytes in chunks of {chunk}"
                    )
                shards.append(entry)
            files = {s.file for s in shards}
            tensors = {}
            for name, t in raw["tensors"].items():
                info = TensorInfo(
                    str(t["shard"]), str(t["dtype"]), tuple(int(d) for d in t["shape"])
                )
                if info.shard not in files:
                    raise ValueError(f"tensor {name!r} is in {info.shard!r}, not a listed shard")
                tensors[str(name)] = info
            others = None
            if "files" in raw:
                others = {str(k): str(v) for k, v in raw["files"].items()}
                # (a NUL in a name: open() raised a bare ValueError, a traceback from verify)
                bad = [k for k in others
                       if "/" in k or "\0" in k or k in ("", ".", "..") or k in files]  # fmt: skip
                if bad:
                    raise ValueError(f"files: {bad[0]!r} is not a plain name beside the shards")
            return cls(str(raw["name"]), str(raw.get("source", "")), chunk, shards, tensors,
                       str(raw.get("created", "")), others)  # fmt: skip
        except (AttributeError, KeyError, TypeError, ValueError, ArithmeticError) as e:
            raise ModelLoadError(f"{where}: corrupt manifest ({e})") from e


def chunk_digest(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


class ChunkHasher:
    """Per-chunk digests of a byte stream fed in pieces of any size, e.g. a shard as it is
    written (so a writer needs no second read); the same digests as `file_digests` of the file
    the stream ends up in."""

    __slots__ = ("_digests", "_filled", "_hash", "chunk_bytes")

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._hash = xxhash.xxh3_64()
        self._filled = 0  # bytes of the current chunk hashed so far
        self._digests: list[str] = []

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), self.chunk_bytes - self._filled)
            self._hash.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_bytes:
                self._digests.append(self._hash.hexdigest())
                self._hash.reset()
                self._filled = 0

    def digests(self) -> tuple[str, ...]:
        """Every chunk's digest, the last one short (an empty stream has one, of no bytes)."""
        tail = [self._hash.hexdigest()] if self._filled or not self._digests else []
        return (*self._digests, *tail)


def file_digests(path: Path, chunk_bytes: int = CHUNK_BYTES) -> tuple[str, ...]:
    """The per-chunk digests of a file, read sequentially (for `verify`)."""
    hasher = ChunkHasher(chunk_bytes)
    with path.open("rb", buffering=0) as f:
        while piece := f.read(chunk_bytes):
            hasher.update(piece)
    return hasher.digests()


def file_digest(path: Path) -> str:
    """The xxh3-64 (hex) of a whole file (the manifest's `files`), read in CHUNK_BYTES pieces."""
    h = xxhash.xxh3_64()
    with path.open("rb", buffering=0) as f:
        while piece := f.read(CHUNK_BYTES):
            h.update(piece)
    return h.hexdigest()


def is_compressed(folder: str | os.PathLike[str]) -> bool:
    """Whether a model folder holds compressed weights (runtime/compression.py's manifest)."""
    return (Path(folder) / COMPRESSED_MANIFEST_NAME).is_file()


def read_manifest(folder: Path) -> Manifest | None:
    """The folder's manifest, or None when it has none (a plain Hugging Face folder)."""
    path = Path(folder) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from e
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path}: corrupt manifest (not UTF-8: {e})") from e
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:  # (a 5,000-digit number, nesting too deep)
        raise ModelLoadError(f"{path}: corrupt manifest (not JSON: {e})") from e
    return Manifest.from_json(raw, path)


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    """Write atomically (a temporary file renamed into place): a reader sees all or nothing."""
    path = Path(folder) / MANIFEST_NAME
    tmp = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def check_shard_files(folder: Path, manifest: Manifest) -> list[Path]:
    """The shard paths in manifest order, after checking each exists with the listed size
    (a missing or truncated shard is an error naming it, before anything is read)."""
    out = []
    for s in manifest.shards:
        path = Path(folder) / s.file
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise ModelLoadError(
                f"{path}: missing (the manifest lists it with {s.bytes} bytes)"
            ) from None
        if size != s.bytes:
            raise ModelLoadError(
                f"{path}: {'truncated' if size < s.bytes else 'wrong size'}: the manifest says "
                f"{s.bytes} bytes, the file has {size}"
            )
        out.append(path)
    return out


def verify_chunk(manifest: Manifest, path: Path, index: int, data: bytes | memoryview) -> None:
    """Raise ModelLoadError naming the shard and byte range if chunk `index` of `path` does not
    match the manifest (a shard the manifest does not list is not checked)."""
    entry = manifest.shard(path.name)
    if entry is None:
        return
    got = chunk_digest(data)
    if got != entry.xxh3_64[index]:
        start = index * manifest.chunk_bytes
        raise ModelLoadError(
            f"{path}: checksum mismatch in bytes {start}..{start + len(data)}"
            f"{tensors_in(path, [(start, start + len(data))])} (xxh3-64 {got}, the manifest says "
            f"{entry.xxh3_64[index]}): the shard is corrupt; pull the model again"
        )


def tensors_in(path: Path, ranges: list[tuple[int, int]], most: int = 4) -> str:
    """What file byte `ranges` of safetensors shard `path` hold, for an error about them:
    " (header; tensors 'a', 'b' and 3 more)"; when the header cannot be read, "" (the byte
    range alone then says where), or " (header, which does not parse)" when that is so and the
    first range holds its start. Only on the error path: it reads the header again."""
    from runtime.weights import read_header  # (weights imports this module)

    try:
        shard = read_header(path)
    except (ModelLoadError, OSError):
        return " (header, which does not parse)" if any(b == 0 for b, _ in ranges) else ""
    hit = [t.name for t in shard.tensors if any(t.begin < e and b < t.end for b, e in ranges)]
    parts = ["header"] if any(b < shard.data_start for b, _ in ranges) else []
    if hit:
        names = ", ".join(repr(n[:200]) for n in hit[:most])
        more = f" and {len(hit) - most} more" if len(hit) > most else ""
        parts.append(f"tensor{'s' if len(hit) > 1 else ''} {names}{more}")
    return f" ({'; '.join(parts)})" if parts else ""
