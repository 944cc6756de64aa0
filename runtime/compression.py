"""Lossless weight compression: bfloat16 exponents in a Huffman code, everything else as it is.

A bfloat16 weight is 1 sign, 8 exponent and 7 mantissa bits. Trained weights use few exponents
(~2.6 bits of entropy), so coding the exponent of each tensor with a Huffman code built from its
own histogram stores a model in ~66.5% of its bfloat16 size, bit for bit. `edgeinfer compress
MODEL_DIR OUT_DIR` writes such a copy; the loader reads it back through `load_compressed`.

    OUT_DIR/
        model-00001-of-00002.ei11        one per source shard (model.safetensors -> model.ei11)
        config.json, tokenizer.json ...  copied (torch_dtype set to bfloat16 after a cast)
        edgeinfer-compressed.json        written last: format, shards, a checksum per tensor

A shard (`.ei11`):

    0        b"EIHUF\\0\\0\\1"    magic and format version
    8        u64 LE h              length of the JSON header
    16       JSON header          {"tensors": [{"name", "dtype", "shape", "encoding",
                                  "data_offsets": [begin, end]}, ...]} in file order,
                                  space-padded so the data starts at a multiple of 4096
    data     one record per tensor, each at a multiple of 64 (offsets are from the data start)

A record of encoding "raw" is the tensor's bytes (non-float tensors, and bfloat16 tensors whose
exponents do not compress). A record of encoding "huffman" is (kernels/huffman_decode.py
describes the code and the decoders):

    0    b"EIH1", u32 chunk_elems, u64 n (values), u64 nbytes (the coded exponents)
    24   128 bytes: the 256 code lengths, two per byte (low nibble first)
    152  int32 offsets (n_chunks + 1): where each chunk starts in the coded exponents
    ..   n bytes: sign + mantissa of each value
    ..   nbytes: the coded exponents, chunk after chunk, each chunk starting on a byte

The manifest's per-tensor xxh3-64 covers the record, and its per-shard `header_xxh3_64` the
shard's first 16 + h bytes (magic, length, JSON header), so a truncated or corrupted file fails
with an error naming the tensor, or the header (whose shapes, dtypes and offsets no record
checksum covers). A manifest written before the header checksums were recorded (no
`header_xxh3_64`) still loads: its headers are checked as they always were (parsed, each
record's size against its shape and dtype), and `verify` also parses every coded record's own
header against the shape (verify_compressed).

Loading overlaps the reads, the checksums and the decoding: the shards are read in pieces of a
few MiB by a few threads (O_DIRECT, as runtime.weights reads), and as soon as a group of records
is in, the same threads check it and decode it (kernels/csrc/huffman_decode_cpu.cpp, a record in
one call, or a large one's chunks in several) in units of ~1 ms, no more of them at a time than
there are cores, while the others read on (see load_compressed).

`CompressedBlocks` keeps a model's blocks (its decoder layers) compressed in memory and decodes each
block's weights into one shared buffer just before the block runs (on a GPU: a model larger than
its free memory can run; the Triton decoder does the decoding there).
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import math
import os
import shutil
import struct
import threading
import time
import uuid
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from torch import nn

from kernels.cpu_ext import huffman_if_built, load_huffman
from kernels.dispatch import FORCE_TRITON
from kernels.huffman_decode import (
    CODE_BITS,
    TILE_LANES,
    TILE_SPAN,
    TILE_SPANS,
    CodedBF16,
    CorruptStreamError,
    TileGroup,
    canonical_codes,
    decode,
    decode_cpu,
    decode_table,
    decode_tiles,
)
from runtime.config import ModelLoadError
from runtime.manifest import COMPRESSED_MANIFEST_NAME, check_shard_files, is_compressed
from runtime.model_store import LOCK_NAME, checked_source, locked_folder, read_config_json
from runtime.shard_reader import (
    Arena,
    commit_ahead,
    open_for_read,
    preadv_all,
    release_pages,
    trim_heap,
)
from runtime.weights import ALIGN, ReadStats, Shard, TensorEntry, naturals, read_header

log = logging.getLogger(__name__)

FORMAT = "edgeinfer-huffman-bf16/1"
MANIFEST_NAME = COMPRESSED_MANIFEST_NAME
SUFFIX = ".ei11"
FILE_MAGIC = b"EIHUF\x00\x00\x01"
RECORD_MAGIC = b"EIH1"
CHUNK_ELEMS = 4096  # values per chunk: ~1.3 KiB of code; offsets cost 4 bytes per 8 KiB
MAX_CHUNK_ELEMS = 2**32 - 64  # the largest multiple of 64 a record's u32 chunk_elems holds
RECORD_ALIGN = 64  # every record starts at a multiple of this (raw tensors are views)
_RECORD_HEAD = struct.Struct("<4sIQQ")  # magic, chunk_elems, n, nbytes
_HEAD_BYTES = _RECORD_HEAD.size + 128  # + the code lengths, two per byte
_SEGMENT_CHUNKS = 256  # the encoder works on this many chunks at a time (bounded memory)
_NAMES = {  # safetensors' dtype names
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
_DTYPES = {name: dtype for dtype, name in _NAMES.items()}

Progress = Callable[[str], None]


class CompressError(ModelLoadError):
    """A model cannot be compressed as asked; the message says why and what to do instead."""


# ---------------------------------------------------------------------------------------------
# Encoding one tensor


def code_lengths(hist: np.ndarray, max_len: int = CODE_BITS) -> np.ndarray:
    """(256,) int64 optimal code lengths of at most `max_len` bits for symbol counts `hist`
    (package-merge). A single symbol gets a one-bit code beside an unused partner, so that every
    code is a complete prefix code (which the decoders require)."""
    syms = [int(s) for s in np.flatnonzero(hist)]
    lengths = np.zeros(256, dtype=np.int64)
    if len(syms) == 1:
        lengths[syms[0]] = lengths[syms[0] ^ 1] = 1
        return lengths
    leaves = sorted(((int(hist[s]), [s]) for s in syms), key=lambda item: item[0])
    items = leaves
    for _ in range(max_len - 1):
        pairs = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(items[::2], items[1::2], strict=False)]
        items = sorted(leaves + pairs, key=lambda item: item[0])
    for _, members in items[: 2 * len(syms) - 2]:
        for s in members:
            lengths[s] += 1
    return lengths


def split_bf16(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(exponents, sign+mantissa bytes) of a bfloat16 tensor, each (n,) uint8."""
    b = t.detach().contiguous().view(torch.int16).numpy().view(np.uint16).ravel()
    exps = (b >> 7).astype(np.uint8)  # the sign bit falls off the top
    sm = ((b >> 8) & 0x80 | (b & 0x7F)).astype(np.uint8)
    return exps, sm


def encode_bf16(
    t: torch.Tensor, chunk_elems: int = CHUNK_ELEMS, compile_ext: bool = True
) -> np.ndarray | None:
    """The "huffman" record of a bfloat16 tensor (see the module docstring), or None when it
    would not be smaller than the tensor itself (an empty tensor, exponents that do not
    compress, a stream too long for int32 offsets). The codes are packed by the C++ extension
    (compiled first if need be, unless `compile_ext` is false), else in numpy: the same bytes."""
    if t.dtype != torch.bfloat16:
        raise TypeError(f"encode_bf16: bfloat16 expected, got {t.dtype}")
    n = t.numel()
    if n == 0:
        return None
    exps, sm = split_bf16(t)
    hist = torch.from_numpy(exps).bincount(minlength=256).numpy()  # 6x numpy's on uint8
    lengths = code_lengths(hist).astype(np.int64)
    codes = canonical_codes(lengths)
    n_chunks = -(-n // chunk_elems)
    ext = load_huffman() if compile_ext else huffman_if_built()  # packs 7x faster than numpy
    if ext is not None:
        packed, offs = ext.pack_codes(torch.from_numpy(exps), torch.from_numpy(codes),
                                      torch.from_numpy(lengths), chunk_elems)  # fmt: skip
        offsets, pieces = offs.numpy(), [packed.numpy()]
    else:
        offsets, pieces = _pack_numpy(exps, lengths, codes.astype(np.uint64), chunk_elems)
    nbytes = int(offsets[-1])
    size = _HEAD_BYTES + 4 * (n_chunks + 1) + n + nbytes
    if size >= 2 * n or nbytes >= 2**31:
        return None
    record = np.empty(size, dtype=np.uint8)
    head = _RECORD_HEAD.pack(RECORD_MAGIC, chunk_elems, n, nbytes)
    record[: _RECORD_HEAD.size] = np.frombuffer(head, dtype=np.uint8)
    record[_RECORD_HEAD.size : _HEAD_BYTES] = (lengths[0::2] | (lengths[1::2] << 4)).astype(
        np.uint8
    )
    at = _HEAD_BYTES + 4 * (n_chunks + 1)
    record[_HEAD_BYTES:at] = offsets.astype("<i4").view(np.uint8)
    record[at : at + n] = sm
    record[at + n :] = np.concatenate(pieces) if pieces else np.zeros(0, np.uint8)
    return record


def _pack_numpy(
    exps: np.ndarray, lengths: np.ndarray, codes: np.ndarray, chunk_elems: int
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The C++ extension's pack_codes in numpy: ((n_chunks + 1,) offsets, the pieces of bytes),
    in segments of whole chunks (bounded memory)."""
    n_chunks = -(-exps.size // chunk_elems)
    offsets = np.zeros(n_chunks + 1, dtype=np.int64)
    pieces = []
    for c0 in range(0, n_chunks, _SEGMENT_CHUNKS):  # segments of whole chunks: byte-aligned
        c1 = min(n_chunks, c0 + _SEGMENT_CHUNKS)
        seg = exps[c0 * chunk_elems : c1 * chunk_elems]
        piece, sizes = _pack(seg, lengths[seg], codes[seg], chunk_elems)
        offsets[c0 + 1 : c1 + 1] = offsets[c0] + np.cumsum(sizes)
        pieces.append(piece)
    return offsets, pieces


def _pack(
    exps: np.ndarray, lens: np.ndarray, codes: np.ndarray, chunk_elems: int
) -> tuple[np.ndarray, np.ndarray]:
    """The codes of whole chunks packed most significant bit first, each chunk starting on a
    byte: (bytes, each chunk's size in bytes). Vectorized: each code goes into the 64-bit word
    its first bit falls in (codes that cross a word boundary spill the rest into the next),
    and the codes of one word are OR-ed together (they never overlap)."""
    lens = lens.astype(np.int64)
    starts = np.arange(0, exps.size, chunk_elems)
    sizes = (np.add.reduceat(lens, starts) + 7) >> 3  # bytes per chunk
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]]) * 8  # first bit of each chunk
    before = np.cumsum(lens) - lens  # bits before each code, counted from the segment start
    pos = before + np.repeat(first - before[starts], np.diff(np.append(starts, exps.size)))
    word, bit = pos >> 6, pos & 63
    room = 64 - bit - lens  # < 0: the code crosses into the next word
    hi = np.where(
        room >= 0,
        codes << np.maximum(room, 0).astype(np.uint64),
        codes >> np.maximum(-room, 0).astype(np.uint64),
    )
    total = int(sizes.sum())
    words = np.zeros(total // 8 + 2, dtype=np.uint64)
    group = np.flatnonzero(np.diff(word, prepend=-1))
    words[word[group]] = np.bitwise_or.reduceat(hi, group)
    cross = np.flatnonzero(room < 0)
    words[word[cross] + 1] |= codes[cross] << (64 + room[cross]).astype(np.uint64)
    return words.byteswap().view(np.uint8)[:total], sizes


def parse_record(record: torch.Tensor, numel: int) -> CodedBF16:
    """A "huffman" record (a (size,) uint8 tensor, 4-byte aligned) as views ready to decode;
    CorruptStreamError saying what is wrong with it."""
    size = record.numel()
    if size < _HEAD_BYTES:
        raise CorruptStreamError(f"record of {size} bytes is shorter than its header")
    head = record[:_HEAD_BYTES].numpy().tobytes()
    magic, chunk_elems, n, nbytes = _RECORD_HEAD.unpack_from(head)
    if magic != RECORD_MAGIC or chunk_elems <= 0:
        raise CorruptStreamError(f"bad record header (magic {magic!r}, chunk_elems {chunk_elems})")
    if n != numel:
        raise CorruptStreamError(f"record holds {n} values, the shape says {numel}")
    n_chunks = -(-n // chunk_elems)
    at = _HEAD_BYTES + 4 * (n_chunks + 1)
    if size != at + n + nbytes:
        raise CorruptStreamError(f"record of {size} bytes, its header implies {at + n + nbytes}")
    packed = np.frombuffer(head[_RECORD_HEAD.size :], dtype=np.uint8).astype(np.int64)
    lengths = np.stack([packed & 15, packed >> 4], axis=1).ravel()
    table = decode_table(lengths)  # rejects anything but a complete prefix code
    offsets = record[_HEAD_BYTES:at].view(torch.int32)
    if offsets[0] != 0 or offsets[-1] != nbytes or bool((offsets[1:] < offsets[:-1]).any()):
        raise CorruptStreamError("chunk offsets are not in order from 0 to the stream's end")
    return CodedBF16(table, offsets, record[at : at + n], record[at + n :], chunk_elems)


def decode_record(
    record: torch.Tensor, shape: Sequence[int], threads: int | None = None
) -> torch.Tensor:
    """The bfloat16 tensor of `shape` a "huffman" record holds (CorruptStreamError if bad)."""
    numel = int(np.prod(shape, dtype=np.int64))
    return decode(parse_record(record, numel), threads=threads).view(tuple(shape))


# ---------------------------------------------------------------------------------------------
# The manifest and the shard header


@dataclass(slots=True)
class RecordEntry:
    """One tensor of a shard, as its header lists it."""

    name: str
    dtype: torch.dtype  # of the tensor once decoded
    shape: tuple[int, ...]
    encoding: str  # "huffman" or "raw"
    begin: int  # byte offsets of its record in the file
    end: int

    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(slots=True)
class CompressedShard:
    path: Path
    size: int
    tensors: list[RecordEntry] = field(default_factory=list)


@dataclass(slots=True)
class CompressedManifest:
    """`edgeinfer-compressed.json`: what the folder holds and a checksum of every record."""

    source: str  # the folder it was compressed from
    shards: dict[str, int]  # file name -> bytes
    checksums: dict[str, str]  # tensor name -> xxh3-64 (hex) of its record
    bf16_bytes: int  # the same tensors stored plainly (after any cast): what it saves against
    cast_from: list[str] = field(default_factory=list)  # dtypes cast to bfloat16 (e.g. F32)
    created: str = ""
    # shard file name -> xxh3-64 (hex) of its header (bytes 0 .. 16 + h); a shard without one
    # (a manifest from before they were recorded) has its header checked by read_shard's parse
    headers: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "source": self.source,
            "created": self.created or datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "cast_from": self.cast_from,
            "bf16_bytes": self.bf16_bytes,
            "compressed_bytes": sum(self.shards.values()),
            "shards": [
                {"file": f, "bytes": n}
                | ({"header_xxh3_64": self.headers[f]} if f in self.headers else {})
                for f, n in self.shards.items()
            ],
            "tensors": {k: {"xxh3_64": v} for k, v in self.checksums.items()},
        }


def read_manifest(folder: str | os.PathLike[str]) -> CompressedManifest:
    path = Path(folder) / MANIFEST_NAME
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("format") != FORMAT:
            raise ValueError(f"format is {raw.get('format')!r}, this edgeinfer reads {FORMAT!r}")
        shards = {str(s["file"]): int(s["bytes"]) for s in raw["shards"]}
        for f in shards:
            if "/" in f or f.startswith(".") or not f.endswith(SUFFIX):
                raise ValueError(f"shard {f!r} is not a plain *{SUFFIX} file name")
        sums = {str(k): str(v["xxh3_64"]) for k, v in raw["tensors"].items()}
        headers = {str(s["file"]): str(s["header_xxh3_64"])
                   for s in raw["shards"] if "header_xxh3_64" in s}  # fmt: skip
        return CompressedManifest(
            str(raw.get("source", "")),
            shards,
            sums,
            int(raw["bf16_bytes"]),
            list(raw.get("cast_from", [])),
            str(raw.get("created", "")),
            headers,
        )
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from e
    except (AttributeError, KeyError, TypeError, ValueError, ArithmeticError, RecursionError) as e:
        # (ArithmeticError: "bytes": 1e400 is infinity, which int() refuses; RecursionError:
        # nesting too deep for the parser)
        raise ModelLoadError(f"{path}: corrupt manifest ({e})") from e


def manifest_fingerprint(folder: str | os.PathLike[str]) -> bytes:
    """What identifies a compressed folder's weights: the format, the shards and every tensor's
    checksum; not when or from where it was compressed (two compressions of one model, e.g. on
    two nodes, are the same weights: the same prefix-cache identity, KV they can exchange).
    Nor the header checksums: a header follows from the same tensors (a copy compressed before
    they were recorded is the same revision), and every load checks it against its checksum."""
    m = read_manifest(folder)
    keep = [FORMAT, m.shards, m.checksums, m.bf16_bytes, m.cast_from]
    return json.dumps(keep, sort_keys=True).encode()


def verify_compressed(
    folder: str | os.PathLike[str],
    manifest: CompressedManifest,
    progress: Callable[[int, str], None] | None = None,
) -> list[str]:
    """Re-read every record of a compressed folder and check it against its `manifest`'s
    checksum (read_manifest), every shard header against its own (where the manifest has one),
    and every coded record's own header against the shape the shard header gives it (what a
    load checks before decoding; for a manifest without header checksums, the check that the
    header's shapes were not altered): one line per problem (a missing, truncated or corrupt
    shard, naming the file and the tensor); [] = sound. `progress(bytes, file)` after each
    shard."""
    folder = Path(folder)
    problems = []
    listed: set[str] = set()
    for file, size in manifest.shards.items():
        try:
            shard = read_shard(folder / file, size, manifest.headers.get(file))
        except ModelLoadError as e:
            problems.append(str(e))
            continue
        try:
            with shard.path.open("rb") as f:
                for t in shard.tensors:
                    listed.add(t.name)
                    f.seek(t.begin)
                    data = bytearray(t.end - t.begin)  # (writable: a tensor's without a copy)
                    f.readinto(data)
                    got = xxhash.xxh3_64_hexdigest(data)
                    want = manifest.checksums.get(t.name)
                    if got != want:
                        problems.append(
                            f"{shard.path}: tensor {t.name!r} is corrupt (xxh3-64 {got}, the "
                            f"manifest says {want})"
                        )
                    elif t.encoding == "huffman":
                        try:
                            parse_record(torch.from_numpy(np.frombuffer(data, np.uint8)), t.numel())
                        except CorruptStreamError as e:
                            problems.append(f"{shard.path}: tensor {t.name!r}: {e}")
        except OSError as e:
            problems.append(f"{shard.path}: cannot read ({e})")
        if progress is not None:
            progress(size, file)
    missing = sorted(set(manifest.checksums) - listed)
    if missing and not problems:
        problems.append(f"{folder / MANIFEST_NAME}: tensors no shard holds: {missing[:3]}")
    return problems


def shard_headers(folder: str | os.PathLike[str]) -> list[Shard]:
    """Every shard's tensors as runtime.weights describes a safetensors shard's, so the loader
    can map and check them against the model before anything is read. A tensor's begin..end
    is its record's start and its size once decoded (not the record's size)."""
    folder = Path(folder)
    out = []
    manifest = read_manifest(folder)
    for file, size in manifest.shards.items():
        shard = read_shard(folder / file, size, manifest.headers.get(file))
        entries = [
            TensorEntry(t.name, t.dtype, t.shape, t.begin, t.begin + t.numel() * t.dtype.itemsize)
            for t in shard.tensors
        ]
        out.append(Shard(shard.path, size, 0, entries))
    return out


def read_shard(
    path: Path, expected_size: int | None = None, header_xxh3: str | None = None
) -> CompressedShard:
    """Parse and check a shard's header (and its size against the manifest's, and its bytes
    against the manifest's `header_xxh3` where it has one) before any record is read;
    ModelLoadError naming the file, and for a truncated one the first tensor that is cut off."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(16)
            if len(head) < 16 or head[:8] != FILE_MAGIC:
                raise ModelLoadError(f"{path}: not a compressed shard (bad magic)")
            n = int.from_bytes(head[8:], "little")
            if 16 + n > size or n > 100 << 20:
                raise ModelLoadError(f"{path}: corrupt header ({n} bytes in a file of {size})")
            text = f.read(n)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from e
    if header_xxh3 is not None and (got := xxhash.xxh3_64_hexdigest(head + text)) != header_xxh3:
        raise ModelLoadError(
            f"{path}: corrupt header (xxh3-64 {got}, the manifest says {header_xxh3}): the file "
            "is corrupt; compress the model again"
        )
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:  # (not JSON, not UTF-8, too deep, a huge number)
        raise ModelLoadError(f"{path}: corrupt header (not JSON: {e})") from e
    shard, data = CompressedShard(path, size), 16 + n
    try:
        for t in raw["tensors"]:
            begin, end = (data + x for x in naturals("data_offsets", t["data_offsets"], 2))
            entry = RecordEntry(
                str(t["name"]),
                _DTYPES[t["dtype"]],
                naturals("shape", t["shape"]),
                str(t["encoding"]),
                begin,
                end,
            )
            raw_bytes = entry.numel() * entry.dtype.itemsize
            if entry.encoding == "raw" and end - begin != raw_bytes:
                raise ValueError(f"{entry.name!r} needs {raw_bytes} bytes, has {end - begin}")
            if entry.encoding == "huffman" and entry.dtype != torch.bfloat16:
                raise ValueError(f"{entry.name!r}: huffman records are bfloat16")
            # a coded record keeps a byte of each value: a shape it cannot hold is a lie (which
            # sized the memory it is decoded into before the record's own header was read)
            if entry.encoding == "huffman" and end - begin < _HEAD_BYTES + entry.numel():
                raise ValueError(f"{entry.name!r}: a record of {end - begin} bytes cannot hold "
                                 f"{entry.numel()} values")  # fmt: skip
            if entry.encoding not in ("raw", "huffman") or begin % RECORD_ALIGN or end < begin:
                raise ValueError(f"{entry.name!r}: encoding {entry.encoding!r} at {begin}..{end}")
            shard.tensors.append(entry)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: corrupt header ({e!r})") from e
    want = max((t.end for t in shard.tensors), default=data)
    expected = want if expected_size is None else expected_size
    cut = next((t for t in shard.tensors if t.end > size), None)
    if size < expected:
        raise ModelLoadError(
            f"{path}: truncated: {size} bytes, the manifest says {expected}"
            + (f"; tensor {cut.name!r} is cut off" if cut else "")
        )
    if cut is not None:  # (the file is as long as it should be: the header is what is wrong)
        raise ModelLoadError(
            f"{path}: corrupt header: tensor {cut.name!r}'s record at bytes "
            f"{cut.begin}..{cut.end} ends past the end of the file ({size} bytes)"
        )
    if size != expected:
        raise ModelLoadError(f"{path}: wrong size: {size} bytes, the manifest says {expected}")
    return shard


# ---------------------------------------------------------------------------------------------
# Compressing a model folder


@dataclass(slots=True)
class CompressSummary:
    """What `compress_model` wrote."""

    out: Path
    bf16_bytes: int  # the tensors stored plainly in bfloat16 (after any cast)
    compressed_bytes: int  # the shard files
    entropy_floor_bytes: float  # sign+mantissa bytes + each float tensor's exponent entropy
    huffman_tensors: int
    raw_tensors: int

    @property
    def ratio(self) -> float:
        return self.compressed_bytes / self.bf16_bytes if self.bf16_bytes else 1.0


def compress_model(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    cast_bf16: bool = False,
    chunk_elems: int = CHUNK_ELEMS,
    threads: int = 2,
    progress: Progress | None = None,
) -> CompressSummary:
    """Write a compressed copy of Hugging Face folder `src` into `out` (which must not exist or
    be empty). `cast_bf16`: cast float16/float32 tensors to bfloat16 first (lossy); without it
    such a model is refused. Refuses a model that is already compressed, has no float tensors,
    or would not get smaller. Built in a temporary folder beside `out`, renamed at the end.
    A model of a store (with edgeinfer-manifest.json) is read checked against its checksums
    (model_store.checked_source): a corrupt one is an error naming the file, nothing written.
    `chunk_elems` (`--chunk-elems`): a multiple of 64 up to MAX_CHUNK_ELEMS (a record stores
    it in 32 bits)."""
    from runtime.loader import safetensors_files
    from runtime.weights import load_safetensors

    src, out, say = Path(src), Path(out), progress or (lambda _msg: None)
    if not 0 < chunk_elems <= MAX_CHUNK_ELEMS or chunk_elems % 64:
        raise CompressError(
            f"--chunk-elems must be a multiple of 64 from 64 to {MAX_CHUNK_ELEMS} (a record "
            f"stores it in 32 bits), got {chunk_elems}"
        )
    if is_compressed(src):
        raise CompressError(f"{src}: already compressed ({MANIFEST_NAME}); nothing to gain")
    source = checked_source(src)  # None: a plain folder, nothing to check against
    files = safetensors_files(src) if source is None else check_shard_files(src, source)
    entries = [t for f in files for t in read_header(f).tensors]
    floats = [t for t in entries if t.dtype.is_floating_point]
    if not floats:
        kinds = sorted({_NAMES[t.dtype] for t in entries}) or ["no tensors"]
        raise CompressError(
            f"{src}: no float tensors ({', '.join(kinds)}): only bfloat16 exponents are "
            "compressed, the copy would be no smaller"
        )
    other = sorted({_NAMES[t.dtype] for t in floats if t.dtype != torch.bfloat16})
    if other and not cast_bf16:
        raise CompressError(
            f"{src}: float tensors of dtype {', '.join(other)}, not bfloat16; add --cast-bf16 to "
            "cast them to bfloat16 first (rounding them: lossy for the original, lossless after)"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CompressError(f"{out}: exists and is not an empty folder")
    if cast_bf16 and (src / "config.json").is_file():  # (rewritten then: refused before
        read_config_json(src)  # anything is written, naming it, if it is not a JSON object)
    summary = CompressSummary(out, 0, 0, 0.0, 0, 0)
    manifest = CompressedManifest(str(src.resolve()), {}, {}, 0, other)
    # A folder locked while it is built (model_store.locked_folder): killed outright, the
    # compression leaves it, which the store's sweep deletes when `out` is in a model store.
    tmp = out.parent / f".{out.name}.compress-{uuid.uuid4().hex[:12]}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with locked_folder(tmp), ThreadPoolExecutor(max(1, threads)) as pool:
            for f in files:
                name = f.name.removesuffix(".safetensors") + SUFFIX
                tensors = [(n, t) for _, n, t in load_safetensors([f], manifest=source)]
                if cast_bf16:
                    tensors = [(n, _as_bf16(t)) for n, t in tensors]
                records = list(pool.map(lambda nt: _record(nt[1], chunk_elems), tensors))
                size = _write_shard(tmp / name, tensors, records, manifest, summary)
                manifest.shards[name] = size
                say(f"{f.name} -> {name}: {size / 1e6:.1f} MB")
            manifest.bf16_bytes = summary.bf16_bytes
            summary.compressed_bytes = sum(manifest.shards.values())
            if summary.compressed_bytes >= summary.bf16_bytes:
                raise CompressError(
                    f"{src}: does not compress ({summary.compressed_bytes} bytes against "
                    f"{summary.bf16_bytes}: exponents close to random, or tensors too small to "
                    "pay for the headers); nothing written"
                )
            _copy_extras(src, tmp, cast=bool(other))
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest.to_json(), indent=1) + "\n")
            (tmp / LOCK_NAME).unlink()  # not part of the model (the lock is held till the end)
            if out.exists():
                out.rmdir()
            tmp.rename(out)
    except OSError as e:  # a full disk, a read-only folder, a name too long: no traceback
        raise CompressError(f"compressing {src} into {out}: {e}; nothing written") from e
    return summary


def _as_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.is_floating_point() else t


def _record(t: torch.Tensor, chunk_elems: int) -> tuple[np.ndarray | None, float]:
    """(the huffman record or None for raw, the tensor's entropy floor in bytes)."""
    if t.dtype != torch.bfloat16:
        return None, float(t.numel() * t.element_size())
    return encode_bf16(t, chunk_elems), entropy_floor_bytes(t)


def entropy_floor_bytes(t: torch.Tensor) -> float:
    """Bytes of a bfloat16 tensor with its sign+mantissa stored raw and its exponents at their
    own (order-0) entropy: what no per-tensor exponent code can beat."""
    exps, _ = split_bf16(t)
    p = torch.from_numpy(exps).bincount(minlength=256).numpy() / max(1, exps.size)
    p = p[p > 0]
    return exps.size * (1 + float(-(p * np.log2(p)).sum()) / 8)


def _write_shard(
    path: Path,
    tensors: list[tuple[str, torch.Tensor]],
    records: list[tuple[np.ndarray | None, float]],
    manifest: CompressedManifest,
    summary: CompressSummary,
) -> int:
    """Write one shard (header, then the records in order, each 64-aligned); returns its size.
    Each record's checksum and the header's go into `manifest`."""
    header, blobs, offset = [], [], 0
    for (name, t), (rec, floor) in zip(tensors, records, strict=True):
        blob = rec if rec is not None else t.contiguous().reshape(-1).view(torch.uint8).numpy()
        offset = _aligned(offset)
        header.append(
            {
                "name": name,
                "dtype": _NAMES[t.dtype],
                "shape": list(t.shape),
                "encoding": "raw" if rec is None else "huffman",
                "data_offsets": [offset, offset + blob.size],
            }
        )
        blobs.append((offset, blob))
        offset += blob.size
        manifest.checksums[name] = xxhash.xxh3_64_hexdigest(blob.data)
        summary.bf16_bytes += t.numel() * t.element_size()
        summary.entropy_floor_bytes += floor
        summary.huffman_tensors += rec is not None
        summary.raw_tensors += rec is None
    raw = json.dumps({"tensors": header}, separators=(",", ":")).encode()
    raw += b" " * (-(16 + len(raw)) % ALIGN)
    head = FILE_MAGIC + len(raw).to_bytes(8, "little") + raw
    manifest.headers[path.name] = xxhash.xxh3_64_hexdigest(head)
    with path.open("wb") as f:
        f.write(head)
        at = 0
        for start, blob in blobs:
            f.write(b"\0" * (start - at))
            f.write(blob.data)
            at = start + blob.size
        f.flush()
        os.fsync(f.fileno())  # on the drive before the manifest says it is there
        return f.tell()


def _copy_extras(src: Path, out: Path, cast: bool) -> None:
    """The folder's other files (config, tokenizer, ...), not weights, indexes or manifests;
    after a cast config.json says bfloat16, so `--dtype auto` runs the model as stored."""
    from runtime.manifest import MANIFEST_NAME as STORE_MANIFEST

    skip = ("model.safetensors.index.json", STORE_MANIFEST)
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name.startswith(".") or f.name in skip:
            continue
        if f.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf", SUFFIX):
            continue
        if f.name == "config.json" and cast:
            cfg = json.loads(f.read_text())
            cfg["torch_dtype"] = "bfloat16"
            (out / f.name).write_text(json.dumps(cfg, indent=2) + "\n")
        else:
            shutil.copyfile(f, out / f.name)


# ---------------------------------------------------------------------------------------------
# Loading


# The records are read in pieces of at most PIECE_BYTES (O_DIRECT reads of a few MiB, several in
# flight) into one buffer per group of consecutive records (GROUP_BYTES or more: a larger record
# is a group alone). Once a group is in, its work is cut into units, which the load's threads
# take before further reads, at most `decoders` of them at a time: one unit checks the group's
# records against their checksums, the others decode them, UNIT_VALUES values or so each (chunk
# ranges of a large record, several small records together), side by side. At most READ_AHEAD
# bytes of groups are read ahead of those done, so that the read buffers are reused (_Buffers).
GROUP_BYTES = 1 << 20
PIECE_BYTES = 4 << 20
UNIT_VALUES = 1 << 21  # ~1 ms of one core's decoding
READ_AHEAD = 64 << 20


@dataclass(slots=True, eq=False)
class _Group:
    """Consecutive records of a shard read into one buffer (their span 4096-aligned, so that it
    can share a block with its neighbours), in pieces; checked and decoded in units; its buffer
    reused once they are done."""

    shard: int  # index of the shard
    begin: int  # file offsets, multiples of ALIGN
    end: int
    records: list[RecordEntry]
    reads: int = 0  # pieces still to read
    units: int = 0  # units still to run (once it is read)
    buffer: Arena | None = None
    done: threading.Event = field(default_factory=threading.Event)
    ok: int = -1  # once done: its first `ok` records are in place; `error` says why not the next
    error: BaseException | None = None
    failed: tuple[int, int] | None = None  # (record, 0: read or checksum, 1: decode) of `error`


def _groups(shard: int, entries: list[RecordEntry]) -> list[_Group]:
    out: list[_Group] = []
    for e in entries:
        g = out[-1] if out else None
        if g is None or g.end - g.begin >= GROUP_BYTES:
            out.append(_Group(shard, e.begin // ALIGN * ALIGN, 0, []))
            g = out[-1]
        g.records.append(e)
        g.end = -(-e.end // ALIGN) * ALIGN
    for g in out:  # (a group of empty records alone still gets a read, to be finished)
        g.end = max(g.end, g.begin + ALIGN)
        g.reads = -(-(g.end - g.begin) // PIECE_BYTES)
    return out


@dataclass(slots=True, eq=False)
class _Unit:
    """Work for one thread: check records `index` of group g against their checksums, or decode
    them (a coded record's chunks [first, last) alone: -1 is its end)."""

    g: _Group
    index: list[int]
    check: bool = False
    first: int = 0
    last: int = -1


class _Buffers:
    """Read buffers (sizes in powers of two), handed back once their records are decoded and
    reused: the pages of a reused buffer are already in memory, while every page of a fresh one
    costs a fault (~1-2 us on the development VMs). `take` hands out the smallest free buffer
    that is large enough."""

    def __init__(self) -> None:
        self._free: list[Arena] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Arena:
        with self._lock:
            fits = [a for a in self._free if a.nbytes >= nbytes]
            if fits:
                best = min(fits, key=lambda a: a.nbytes)
                self._free.remove(best)
                return best
        return Arena(max(ALIGN, 1 << (nbytes - 1).bit_length()))  # pages faulted in as read

    def give(self, arena: Arena) -> None:
        with self._lock:
            self._free.append(arena)

    def clear(self) -> None:
        with self._lock:
            self._free = []


class _Load:
    """One load_compressed's reads, checks and decodes, on `threads` threads of its own. Each
    takes a unit while fewer than `decoders` threads run one, else the next piece to read (once
    fewer than READ_AHEAD bytes are read ahead), else waits: the drive always has reads in
    flight, and no more threads decode than there are cores for (the C++ decoder and xxh3 run
    without the GIL). The loading thread waits for each group in file order."""

    def __init__(self, shards: list[CompressedShard], fds: list[int], groups: list[_Group],
                 manifest: CompressedManifest, dests: dict[str, torch.Tensor | None],
                 threads: int, decoders: int, stats: ReadStats) -> None:  # fmt: skip
        self.shards, self.fds, self.manifest, self.stats = shards, fds, manifest, stats
        self.dests = dests
        self.outs: dict[str, torch.Tensor] = {}  # set by the loading thread, then `ready`
        self.ready = threading.Event()
        self.groups = groups
        self.pieces = [(g, at) for g in groups for at in range(g.begin, g.end, PIECE_BYTES)]
        self.next_piece = 0
        self.units: collections.deque[_Unit] = collections.deque()
        self.decoders = max(1, decoders)
        self.decoding = self.reading = 0  # threads running a unit, reading a piece
        self.ahead = 0  # bytes of the groups being read or decoded
        self.cond = threading.Condition()
        self.stop = False  # the load ended: the threads stop at their next step
        self.buffers = _Buffers()
        self.ext = load_huffman()
        self.threads = [threading.Thread(target=self.run, name=f"weights-{i}", daemon=True)
                        for i in range(max(1, threads))]  # fmt: skip
        for t in self.threads:
            t.start()

    def close(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        me = threading.current_thread()  # (the generator finalized by a collection on one of
        for t in self.threads:  # them: that one is not reading now) none may still read or
            if t is not me:  # decode once the descriptors close
                t.join()

    def run(self) -> None:
        """A thread's loop (`_run`); anything unexpected that escapes it (memory for a read
        buffer refused, say) fails every group not done, so that no one waits for them."""
        try:
            self._run()
        except BaseException as e:
            with self.cond:
                self.stop = True
                for g in self.groups:
                    if not g.done.is_set():
                        path = self.shards[g.shard].path
                        self.fail(g, 0, 0, ModelLoadError(f"{path}: the load failed: {e!r}"))
                        g.ok = 0
                        g.done.set()
                self.cond.notify_all()

    def _run(self) -> None:
        while True:
            unit, piece = None, None
            with self.cond:
                while not self.stop:
                    if self.units and self.decoding < self.decoders:
                        unit = self.units.popleft()
                        self.decoding += 1
                        break
                    if self.next_piece < len(self.pieces):
                        g, at = self.pieces[self.next_piece]
                        size = g.end - g.begin
                        if g.buffer is None and self.ahead and self.ahead + size > READ_AHEAD:
                            self.cond.wait()
                            continue
                        if g.buffer is None:
                            self.ahead += size
                            g.buffer = self.buffers.take(size)
                        self.next_piece += 1
                        self.reading += 1
                        piece = g, at
                        break
                    if not (self.units or self.decoding or self.reading):
                        return  # nothing left to read or decode
                    self.cond.wait()
                else:
                    return
            if unit is not None:
                self.run_unit(unit)
            elif piece is not None:
                self.read(*piece)

    def read(self, g: _Group, at: int) -> None:
        """Bytes [at, at + PIECE_BYTES) of group g (file offsets) into its buffer; after the
        group's last piece, its units."""
        shard = self.shards[g.shard]
        assert g.buffer is not None
        first = 0  # the first record the failure touches (named; none of the group is yielded:
        try:  # its records are neither checked nor decoded once a read of it failed)
            end = min(g.end, at + PIECE_BYTES)
            first = next((i for i, r in enumerate(g.records) if r.end > at), 0)
            t0 = time.perf_counter()
            try:
                view = g.buffer.view[at - g.begin : end - g.begin]
                got = preadv_all(self.fds[g.shard], [view], at)
            except OSError as e:
                name = g.records[first].name
                raise ModelLoadError(f"{shard.path}: cannot read tensor {name!r} ({e})") from e
            t1 = time.perf_counter()
            if got < min(end, shard.size) - at:
                first = next((i for i, r in enumerate(g.records) if r.end > at + got), first)
                raise ModelLoadError(
                    f"{shard.path}: truncated while reading (at byte {at + got} of {shard.size}): "
                    f"tensor {g.records[first].name!r} is cut off"
                )
        except BaseException as e:
            with self.cond:
                self.fail(g, 0, 0, self.named(g, first, e))
        else:
            with self.cond:
                st = self.stats
                st.started = min(st.started, t0) if st.started else t0
                st.finished = max(st.finished, t1)
        with self.cond:
            g.reads -= 1
            last, failed = not g.reads, g.error is not None
            if not last or failed:
                self.reading -= 1
        if not last:
            return
        units: list[_Unit] = []
        if not failed:  # (still counted as reading: the other threads wait for its units)
            try:
                units = self.plan(g)
            except BaseException as e:  # (not expected: the loading thread must hear of it)
                with self.cond:
                    self.fail(g, 0, 0, e)
            with self.cond:
                self.reading -= 1
                g.units = len(units)
                self.units.extend(units)
                self.cond.notify_all()
        if not units:
            self.finish(g)

    def plan(self, g: _Group) -> list[_Unit]:
        """The units of group g, once it is read: its records' checksums, and their decoding.
        Both run side by side: the decoder reads a record's bytes and no others whatever they
        hold, and no tensor is given out before its record's checksum is checked."""
        assert g.buffer is not None
        units = [_Unit(g, list(range(len(g.records))), check=True)]
        small: list[int] = []  # records too small to be a unit alone, gathered
        values = 0
        for i, entry in enumerate(g.records):
            n = entry.numel()
            at = entry.begin - g.begin
            if (entry.encoding == "huffman" and n > UNIT_VALUES and self.ext is not None
                    and entry.end - entry.begin >= _HEAD_BYTES):  # fmt: skip
                # (a bad header is the decoder's to find and parse_record's to name)
                chunk = max(1, _RECORD_HEAD.unpack_from(g.buffer.view, at)[1])
                n_chunks = -(-n // chunk)
                step = max(1, UNIT_VALUES // chunk)
                units += [_Unit(g, [i], first=c, last=min(n_chunks, c + step))
                          for c in range(0, n_chunks, step)]  # fmt: skip
                continue
            small.append(i)
            values += n
            if values >= UNIT_VALUES:
                units.append(_Unit(g, small))
                small, values = [], 0
        if small:
            units.append(_Unit(g, small))
        return units

    def run_unit(self, unit: _Unit) -> None:
        g = unit.g
        try:
            if unit.check:
                self.check(unit)
            else:
                self.decode(unit)
        except BaseException as e:  # (not expected: the loading thread must hear of it)
            with self.cond:
                self.fail(g, unit.index[0], 0, self.named(g, unit.index[0], e))
        finally:
            with self.cond:
                self.decoding -= 1
                g.units -= 1
                last = not g.units
                self.cond.notify_all()
            if last:
                self.finish(g)

    def check(self, unit: _Unit) -> None:
        """Records `unit.index` of its group against the manifest's checksums."""
        g = unit.g
        assert g.buffer is not None
        shard, view = self.shards[g.shard], g.buffer.view
        for i in unit.index:
            if self.stop:
                return
            entry = g.records[i]
            got = xxhash.xxh3_64_hexdigest(view[entry.begin - g.begin : entry.end - g.begin])
            want = self.manifest.checksums[entry.name]
            if got != want:
                error = ModelLoadError(
                    f"{shard.path}: tensor {entry.name!r}: checksum mismatch (xxh3-64 {got}, the "
                    f"manifest says {want}): the file is corrupt; compress the model again"
                )
                with self.cond:
                    self.fail(g, i, 0, error)
                return

    def decode(self, unit: _Unit) -> None:
        """Records `unit.index` of its group into their places (a coded one's chunks
        [unit.first, unit.last) alone)."""
        while not self.ready.wait(0.1):  # (the places are made while the first reads run)
            if self.stop:
                return
        g = unit.g
        assert g.buffer is not None
        data = g.buffer.tensor()
        for i in unit.index:
            if self.stop:
                return
            entry = g.records[i]
            record = data[entry.begin - g.begin : entry.end - g.begin]
            out = self.outs[entry.name]
            try:
                if entry.encoding == "raw":
                    out.copy_(record.view(entry.dtype).view(entry.shape))
                elif self.ext is not None:
                    bad = self.ext.decode_record(out.view(-1), record, 1, unit.first, unit.last)
                    if bad >= 0:
                        raise CorruptStreamError(
                            f"chunk {bad}: its codes run past its bytes (corrupt stream)"
                        )
                    if bad == -2:  # the header is wrong: parse_record says how
                        parse_record(record, entry.numel())
                        raise CorruptStreamError("bad record header")
                else:  # the reference decoder (no C++ compiler here)
                    coded = parse_record(record, entry.numel())
                    decode_cpu(coded, out.view(-1), 0, coded.num_chunks)
            except CorruptStreamError as e:
                where = f"{self.shards[g.shard].path}: tensor {entry.name!r}"
                with self.cond:
                    self.fail(g, i, 1, ModelLoadError(f"{where}: {e}"))
                return
            except BaseException as e:
                with self.cond:
                    self.fail(g, i, 1, self.named(g, i, e))
                return

    def named(self, g: _Group, index: int, error: BaseException) -> BaseException:
        """`error` as a ModelLoadError naming the file and record `index`'s tensor (it is
        one already, or an interruption: as it is)."""
        if isinstance(error, ModelLoadError | KeyboardInterrupt | SystemExit):
            return error
        named = ModelLoadError(f"{self.shards[g.shard].path}: tensor "
                               f"{g.records[index].name!r}: {error!r}")  # fmt: skip
        named.__cause__ = error
        return named

    def fail(self, g: _Group, index: int, kind: int, error: BaseException) -> None:
        """(Under the lock.) Record `index` of group g failed with `error`, of `kind` 0 (its read
        or its checksum) or 1 (its decoding): the first record's error wins, and for one record
        its checksum's (a corrupt file may fail to decode too: it is called corrupt)."""
        if g.failed is None or (index, kind) < g.failed:
            g.failed, g.error = (index, kind), error

    def finish(self, g: _Group) -> None:
        """Group g is read and decoded, or failed: the tensors given destinations of another
        dtype are converted, its buffer goes back, and it is done."""
        ok = len(g.records) if g.failed is None else g.failed[0]
        try:
            for k, entry in enumerate(g.records[:ok]):
                if self.stop:
                    break
                dest, out = self.dests[entry.name], self.outs[entry.name]
                if dest is not None and out is not dest:
                    try:
                        with torch.no_grad():  # (grad mode is per thread: a parameter is fine)
                            dest.copy_(out)
                    except Exception as e:
                        with self.cond:
                            self.fail(g, k, 1, self.named(g, k, e))
                        ok = k
                        break
        finally:
            with self.cond:
                if g.buffer is not None:
                    self.buffers.give(g.buffer)
                    self.ahead -= g.end - g.begin
                    g.buffer = None
                g.ok = ok
                g.done.set()
                self.cond.notify_all()


def load_compressed(
    folder: str | os.PathLike[str],
    threads: int = 4,
    stats: ReadStats | None = None,
    direct: bool = True,
    decode_threads: int | None = None,
    into: Callable[[str], torch.Tensor | None] | None = None,
    commit: Sequence[Arena] = (),
) -> Generator[tuple[str, str, torch.Tensor]]:
    """(file, tensor name, tensor) for every tensor of a compressed folder, in file order, as
    runtime.weights.load_safetensors gives them for a plain one. The manifest and every shard
    header are checked first. Then `threads` threads read the records in file order, in pieces
    of PIECE_BYTES, into buffers that are reused, and as soon as a group of them is in, check
    them against their checksums and decode them (the C++ decoder, the GIL released; a large
    record in chunk ranges, on several threads), at most `decode_threads` of them at a time
    (default: torch's threads; at most `threads` - 1, so that one always reads). See _Load.

    Tensors are views of one new arena per shard (fresh memory, as a plain folder's are; a
    thread of its own commits its pages ahead of the decoding), unless `into(name)` says where tensor
    `name` goes (a tensor of its shape, e.g. a parameter's rows; None: the arena): it is decoded
    straight into it (or converted into it from the arena, if its dtype differs), and it is what
    is yielded; `commit`: the arenas those destinations are in, in the order they are decoded
    into, to commit ahead of the decoding as the new arenas are (shard_reader.commit_ahead;
    SmolLM2's load, 2026-11-25: 0.249 s without, 0.192 with). `stats`: the bytes of the files,
    the files read with O_DIRECT or buffered, and when the reads started and finished
    (`seconds` between the two, set at the end).
    ModelLoadError naming the file, and the tensor, for a missing, truncated or corrupt file."""
    stats = stats if stats is not None else ReadStats()
    folder = Path(folder)
    manifest = read_manifest(folder)
    shards = [read_shard(folder / f, size, manifest.headers.get(f))
              for f, size in manifest.shards.items()]  # fmt: skip
    names = {t.name for s in shards for t in s.tensors}
    if names != set(manifest.checksums):
        odd = sorted(names ^ set(manifest.checksums))[:3]
        raise ModelLoadError(
            f"{folder / MANIFEST_NAME}: lists other tensors than the shards hold (e.g. {odd})"
        )
    dests: dict[str, torch.Tensor | None] = {}
    for s in shards:
        for e in s.tensors:
            dest = dests[e.name] = into(e.name) if into is not None else None
            if dest is not None and tuple(dest.shape) != e.shape:
                raise ModelLoadError(
                    f"{s.path}: tensor {e.name!r} has shape {e.shape}, its destination "
                    f"{tuple(dest.shape)}"
                )
    fds: list[int] = []
    try:
        for s in shards:
            fd, is_direct = open_for_read(s.path, s.size, direct, skip_cached=False)
            fds.append(fd)
            stats.bytes += s.size
            stats.direct += is_direct
            stats.buffered += not is_direct
    except OSError as e:
        for fd in fds:
            os.close(fd)
        raise ModelLoadError(f"cannot read ({e})") from e
    groups = [g for k, s in enumerate(shards) for g in _groups(k, s.tensors)]
    threads = max(1, threads)
    decoders = min(max(1, decode_threads or torch.get_num_threads()), max(1, threads - 1))
    stop = threading.Event()  # the load ended: the committing thread stops
    load = None
    try:
        load = _Load(shards, fds, groups, manifest, dests, threads, decoders, stats)
        # where the tensors go: made while the first reads are on the drive (~1 ms a 100 views)
        load.outs, arenas = _outputs(shards, dests)
        load.ready.set()
        threading.Thread(target=commit_ahead, args=([*arenas, *commit], stop),
                         name="weights-commit", daemon=True).start()  # fmt: skip
        for g in groups:
            g.done.wait()
            path = str(shards[g.shard].path)
            for entry in g.records[: g.ok]:
                dest = dests[entry.name]
                yield path, entry.name, dest if dest is not None else load.outs[entry.name]
            if g.error is not None:
                raise g.error
        stats.seconds = stats.finished - stats.started
    finally:
        stop.set()
        if load is not None:
            load.close()
        for fd in fds:
            os.close(fd)
        if load is not None:  # unmapping the buffers takes a while: not on this thread
            threading.Thread(target=load.buffers.clear, name="weights-free", daemon=True).start()


def _outputs(shards: list[CompressedShard], dests: dict[str, torch.Tensor | None]
             ) -> tuple[dict[str, torch.Tensor], list[Arena]]:  # fmt: skip
    """Where each tensor is decoded: straight into its destination where it has one that can
    take it (a raw record is copied, and converted, into any; a coded one is decoded into
    contiguous bfloat16 only), else into one new arena per shard; and those arenas, in file
    order."""
    outs: dict[str, torch.Tensor] = {}
    arenas: list[Arena] = []
    for s in shards:
        placed: list[tuple[RecordEntry, int]] = []
        used = 0
        for e in s.tensors:
            dest = dests[e.name]
            if dest is not None and (
                e.encoding == "raw" or (dest.dtype == torch.bfloat16 and dest.is_contiguous())
            ):
                outs[e.name] = dest
            else:
                placed.append((e, used))
                used += _aligned(e.numel() * e.dtype.itemsize)
        if not placed:
            continue
        arena = Arena(used)
        arenas.append(arena)
        whole = arena.tensor()
        for e, at in placed:
            nbytes = e.numel() * e.dtype.itemsize
            outs[e.name] = whole[at : at + nbytes].view(e.dtype).view(e.shape)
    return outs, arenas


def _aligned(nbytes: int) -> int:
    return -(-nbytes // RECORD_ALIGN) * RECORD_ALIGN


# ---------------------------------------------------------------------------------------------
# Weights kept compressed in memory, decoded block by block


TABLE_BYTES = 8 * (1 << CODE_BITS)  # a decode table, held beside the tensors kept compressed
SLOT_ALIGN = 64  # values: a weight kept compressed is decoded to a 128-byte aligned view


def exponent_counts(t: torch.Tensor) -> np.ndarray:
    """(256,) int64: how often each exponent occurs in a bfloat16 tensor, counted where it lies."""
    exps = (t.detach().reshape(-1).view(torch.int16).to(torch.int32) >> 7) & 0xFF
    return torch.bincount(exps, minlength=256).cpu().numpy().astype(np.int64)


def tile_bytes(numel: int, coded_bits: int, span: int = TILE_SPAN) -> int:
    """The memory a tensor of `numel` values whose exponents take `coded_bits` takes in a
    TileGroup of `span` values a lane (the group's decode table aside)."""
    tiles = -(-numel // (TILE_LANES * span))
    return 4 * -(-coded_bits // 32) + numel + tiles * (24 + 2 * TILE_LANES)


def tile_group(tensors: Sequence[torch.Tensor], starts: Sequence[int],
               counts: np.ndarray | None = None, span: int = TILE_SPAN) -> TileGroup:  # fmt: skip
    """`tensors` (bfloat16, on one device: encoded there, in tensor ops) coded into a TileGroup
    (kernels/huffman_decode.py), tensor i's values to go to [starts[i], starts[i] + numel) of
    the buffer (ascending multiples of 4, each at or past the previous tensor's end), in one
    code made for their exponents' `counts` together (exponent_counts's, else counted here),
    `span` values a lane (a multiple of 4, at most 64).

    One code for a layer's tensors, not one each: SmolLM2's layers coded in 2.687 bits an
    exponent instead of 2.635, but a layer's seven 32 KiB tables were 3% of its compressed
    bytes, and with one table in each SM's L1 the tiles decoded 38% faster (a loop over its
    first four layers, 36 launches, on an H100, 2026-11-27)."""
    ends = [s + t.numel() for s, t in zip(starts, tensors, strict=True)]
    if (any(s % 4 or s < 0 for s in starts)
            or any(e > s for e, s in zip(ends, starts[1:], strict=False))):  # fmt: skip
        raise ValueError("starts must be ascending multiples of 4, past the previous end")
    if span not in TILE_SPANS:
        raise ValueError(f"span must be a multiple of 4 from 4 to 64, got {span}")
    if any(t.dtype != torch.bfloat16 for t in tensors) or len({t.device for t in tensors}) > 1:
        raise ValueError("a TileGroup's tensors must be bfloat16, on one device")
    dev = tensors[0].device if tensors else torch.device("cpu")
    numel = ends[-1] if ends else 0
    if counts is None:
        counts = sum((exponent_counts(t) for t in tensors), np.zeros(256, dtype=np.int64))
    coded = bool(counts.any())  # (else every tensor is empty)
    lengths = code_lengths(counts) if coded else np.zeros(256, dtype=np.int64)
    sm = torch.zeros(-(-numel // 4) * 4, dtype=torch.uint8, device=dev)
    streams, tiles, lanes, at_word = [], [], [], 0
    for t, s in zip(tensors, starts, strict=True):
        b = t.detach().reshape(-1).view(torch.int16).to(torch.int32) & 0xFFFF
        sm[s : s + b.numel()] = (((b >> 8) & 0x80) | (b & 0x7F)).to(torch.uint8)
        words, first, rel, m = _tile_streams((b >> 7) & 0xFF, lengths, span)
        streams.append(words)
        tiles.append(torch.stack([first + 32 * at_word,
                                  s + TILE_LANES * span * torch.arange(m.numel(), device=dev), m],
                                 dim=1))  # fmt: skip
        lanes.append(rel)
        at_word += words.numel()
    streams.append(torch.zeros(2, dtype=torch.int32, device=dev))  # a lane reads a word ahead
    return TileGroup(
        decode_table(lengths).to(dev) if coded else torch.zeros(0, dtype=torch.int64),
        torch.cat(tiles) if tiles else torch.zeros(0, 3, dtype=torch.int64, device=dev),
        torch.cat(lanes) if lanes else torch.zeros(0, dtype=torch.int16, device=dev),
        torch.cat(streams),
        sm,
        numel,
        span,
    )


TILE_SLICE = 1 << 19  # values tile_group codes at a time: its temporaries stay near 0.1 GB


def _tile_streams(exps: torch.Tensor, lengths: np.ndarray, span: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One tensor's exponents (int32, (n,)) in TileGroup's lanes: (its streams' 32-bit words,
    the first bit the most significant; each tile's first bit in them; each lane's first bit
    from its tile's, int16; each tile's values). Coded a slice of whole tiles at a time, each
    slice's streams from a new word."""
    dev, n = exps.device, exps.numel()
    values = TILE_LANES * span  # a tile's
    n_tiles = -(-n // values)
    size = torch.from_numpy(lengths).to(dev)
    code = torch.from_numpy(canonical_codes(lengths)).to(dev)
    per = max(1, TILE_SLICE // values) * values
    words, firsts, rels, at_word = [], [], [], 0
    for a in range(0, n, per):
        w, first, rel = _tile_slice(exps[a : a + per], size, code, span)
        words.append(w)
        firsts.append(first + 32 * at_word)
        rels.append(rel)
        at_word += w.numel()
    m = torch.full((n_tiles,), values, dtype=torch.int64, device=dev)
    if n_tiles:
        m[-1] = n - (n_tiles - 1) * values
    if not words:
        return (torch.zeros(0, dtype=torch.int32, device=dev),
                torch.zeros(0, dtype=torch.int64, device=dev),
                torch.zeros(0, dtype=torch.int16, device=dev), m)  # fmt: skip
    return torch.cat(words), torch.cat(firsts), torch.cat(rels), m


def _tile_slice(exps: torch.Tensor, size_of: torch.Tensor, code_of: torch.Tensor, span: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """_tile_streams's work on whole tiles (the last may be partial), bits from 0."""
    dev, n = exps.device, exps.numel()
    values = TILE_LANES * span
    n_tiles = -(-n // values)
    # the places in the order the lanes code them: tile, lane, then the lane's own order
    order = torch.arange(n_tiles * values, device=dev)
    order = order.view(n_tiles, span // 4, TILE_LANES, 4).transpose(1, 2).reshape(-1)
    order = order[order < n]
    sym = exps[order].long()
    size = size_of[sym]
    if bool((size == 0).any()):
        raise ValueError("a value's exponent has no code: the counts the code was made for "
                         "must include every value coded")  # fmt: skip
    code = code_of[sym]
    del sym
    pos = torch.cumsum(size, 0) - size  # each code's first bit
    total = int(pos[-1] + size[-1])
    lane = order // values * TILE_LANES + order // 4 % TILE_LANES
    del order
    counts = torch.bincount(lane, minlength=n_tiles * TILE_LANES)
    del lane
    first_value = torch.cumsum(counts, 0) - counts
    lane_bit = torch.cat([pos, torch.tensor([total], device=dev)])[first_value]
    lane_bit = lane_bit.view(n_tiles, TILE_LANES)
    rel = lane_bit - lane_bit[:, :1]
    assert int(rel.max()) < 2**15  # span * 31 * CODE_BITS at most
    # each code into the big-endian 32-bit word it starts in, and the next where it crosses
    word, off = pos >> 5, pos & 31
    del pos
    room = 32 - off - size  # < 0: the code crosses into the next word by -room bits
    hi = torch.where(room >= 0, code << room.clamp(min=0), code >> (-room).clamp(min=0))
    lo = torch.where(room >= 0, 0, (code << (32 + room).clamp(min=0)) & 0xFFFFFFFF)
    acc = torch.zeros(-(-total // 32) + 1, dtype=torch.int64, device=dev)
    acc.index_add_(0, word, hi)  # the codes' bits never overlap: adding is or-ing
    acc.index_add_(0, word + 1, lo)
    acc = acc[:-1]
    words = torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)
    return words, lane_bit[:, 0], rel.reshape(-1).to(torch.int16)


@dataclass(slots=True)
class _Slot:
    param: nn.Parameter
    shape: torch.Size  # its own (the parameter holds an empty tensor between uses)
    coded: CodedBF16 | None  # None on a GPU: its block's TileGroup holds it
    offset: int  # in the shared buffer, in values


@dataclass(slots=True)
class _Block:
    slots: list[_Slot]
    group: TileGroup | None  # on a GPU: every slot decoded in one launch


class CompressedBlocks:
    """The bfloat16 weights of `blocks` (e.g. a model's decoder layers, which run one after
    another) kept compressed on `device`; a forward pre-hook decodes a block's weights into one
    buffer shared by all blocks (the largest block's size) just before the block runs, and its
    parameters are views of that buffer until the block returns. Weights that do not compress
    stay as they are. `release()` restores dense weights and removes the hooks. On a GPU (or
    the CPU under EDGEINFER_KERNELS=triton) a block's weights are coded anew into one
    TileGroup (`tile_group`: a lane per `span` values, one code a block, encoded on the device
    in tensor ops, 0.3 s for SmolLM2 on an H100), decoded by one launch of the tiles kernel;
    the launches are captured in the engine's decode graphs like any other kernel (the
    buffers' addresses never change). Elsewhere each tensor is an encode_bf16 record, decoded
    by the C++ extension.

    On a GPU the next block is decoded while one runs (`overlap`, default on): two buffers, and
    a side stream that decodes block i+1 into one as soon as block i-1 (which read it last) is
    done, while block i's kernels run from the other (`ahead` blocks ahead, with as many more
    buffers; 2 or 3 were no faster). At batch 1 a layer's kernels are small and latency-bound,
    leaving much of the GPU to the decoder: SmolLM2's graphed step on an H100 took 1.15x the
    dense one (1.21x decoded in line; 2026-11-27, tiles of 32 values a lane; 1.26-1.79x at 64
    over five runs on three machines; 1.09-1.31x, median 1.18x, over six runs on 2026-11-27's
    later machines); the lanes before them (a lane per 64 consecutive values) made 1.44-1.50x,
    and 2.26x / 1.93x at 256 values a lane (2026-11-26). Tried on an H100, not kept: a higher
    priority for either stream (a graph's replay may not honour them); a smaller grid for the
    decode ahead, each program taking several tiles, to leave the block's kernels most of the
    GPU (the decoder's rate fell in proportion to the programs, ~0.37 GB/s each, and the step
    with it: 1.20x at 2112 programs, 5.1x at 132); a lane reading all its sign+mantissa words
    at the tile's start rather than one group at a time (TinyLlama-1.1B's layers decoded 9%
    faster, SmolLM2's 6% slower: neither is the limit).

    The weights are encoded here, from the loaded model (the model's parameters fuse q/k/v
    and gate/up, which the files' records do not), on the calling thread; on the CPU,
    SmolLM2's 106M layer weights in 0.8 s since the C++ extension packs the codes (157M
    values/s a 11.5M-value tensor, 2026-11-26; numpy packed 21-32M). A pool's threads kept tens of MB of the encoder's
    temporaries resident in their own heaps (the model alone, after load_model: 515 MB with
    dense weights; kept compressed, 452-465 MB encoded on this thread, 517-523 on a pool's;
    2-core Xeon, 2026-11-25). Each
    block's dense weights are given back as soon as it is encoded (see below), so the
    start-up needs the dense weights' memory once. `progress(done, total)` (values) after
    each block is encoded. A tensor stays dense unless its coded form saves more than
    `min_saving` bytes (default: the size of a decode table), and `compressed_bytes` counts
    the tables."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        device: torch.device | str | None = None,
        chunk_elems: int = CHUNK_ELEMS,
        progress: Callable[[int, int], None] | None = None,
        min_saving: int = TABLE_BYTES,
        overlap: bool = True,
        ahead: int = 1,
        span: int = TILE_SPAN,
    ) -> None:
        first = next((p for b in blocks for p in b.parameters()), None)
        self.device = (
            torch.device(device)
            if device is not None
            else (first.device if first is not None else torch.device("cpu"))
        )
        self.dense_bytes = 0  # what the compressed weights took before
        self.compressed_bytes = 0
        self._blocks: list[_Block] = []
        self._hooks: list[Any] = []
        self._empty = torch.empty(0, dtype=torch.bfloat16, device=self.device)
        self._span = span  # values a lane of the tiles
        params = [[p for p in b.parameters() if p.dtype == torch.bfloat16] for b in blocks]
        total = sum(p.numel() for ps in params for p in ps)
        # On a GPU (or the CPU under EDGEINFER_KERNELS=triton) a block is a TileGroup, encoded
        # where it is decoded, in tensor ops; else records decoded by the C++ extension
        tiled = self.device.type == "cuda" or FORCE_TRITON
        done, size = 0, 0
        if tiled:
            for block, ps in zip(blocks, params, strict=True):
                done += sum(p.numel() for p in ps)  # (before _add_tiles empties them)
                size = max(size, self._add_tiles(block, ps, min_saving))
                if progress is not None:
                    progress(done, total)
        else:
            size = self._encode_records(blocks, params, chunk_elems, min_saving, progress)
        self.buffer = torch.empty(size, dtype=torch.bfloat16, device=self.device)
        # on a GPU with every block one launch: the buffers decoded ahead into, the stream that
        # fills them, and an event a buffer that says its block is decoded
        self._side: torch.cuda.Stream | None = None
        self._buffers = [self.buffer]
        self._ready: list[torch.cuda.Event] = []
        self._launched = -1  # the last block whose decode was started ahead
        self._last: tuple[int, bool] = (-1, False)  # the block run last; in a graph's capture?
        self._pending = False  # decodes started ahead that no block has waited on yet
        if (
            overlap
            and self.device.type == "cuda"
            and len(self._blocks) > 1
            and all(b.group is not None for b in self._blocks)
        ):
            ahead = max(1, min(ahead, len(self._blocks) - 1))
            self._side = torch.cuda.Stream(self.device)
            self._buffers += [torch.empty_like(self.buffer) for _ in range(ahead)]
            self._ready = [torch.cuda.Event() for _ in self._buffers]

    @property
    def buffer_bytes(self) -> int:
        """The memory the decoded blocks take (one buffer, or two when decoding ahead)."""
        return sum(b.nbytes for b in self._buffers)

    def _encode_records(self, blocks: Sequence[nn.Module], params: list[list[nn.Parameter]],
                        chunk_elems: int, min_saving: int,
                        progress: Callable[[int, int], None] | None) -> int:  # fmt: skip
        """The CPU's blocks: each parameter's record (encode_bf16) in slots decoded by the C++
        extension. Returns the values the largest block uses of the buffer."""
        total = sum(p.numel() for ps in params for p in ps)
        done = 0
        # The records, made among the encoder's temporaries, would keep the heap from giving
        # those back (SmolLM2: ~110 MB more resident than the records themselves); each moves
        # into one store of their own, committed only as far as it is written (a record is
        # under 2 bytes a value, or the tensor stays dense).
        store = Arena(sum(_aligned(2 * p.numel()) for ps in params for p in ps)).tensor()
        at, size = 0, 0
        for block, ps in zip(blocks, params, strict=True):
            kept: list[torch.Tensor | None] = []
            for p in ps:
                rec = encode_bf16(p.data.cpu(), chunk_elems, compile_ext=True)
                # a tensor kept compressed also holds its decode table (TABLE_BYTES): one that
                # saves less (a norm's 576 values) stays dense
                if rec is None or 2 * p.numel() - rec.size <= min_saving:
                    kept.append(None)
                    continue
                view = store[at : at + rec.size]
                view.copy_(torch.from_numpy(rec))
                kept.append(view)
                at += _aligned(rec.size)
            # A block's dense weights go as soon as it is encoded, so the start-up needs the
            # dense weights' memory once, not that and the records': the loader put every
            # parameter in one arena, whose pages are given back block by block.
            shared = [(p.data_ptr(), p.nbytes) for p, r in zip(ps, kept, strict=True)
                      if r is not None and p.untyped_storage().nbytes() > p.nbytes]  # fmt: skip
            done += sum(p.numel() for p in ps)  # (before _add_block empties them)
            size = max(size, self._add_block(block, ps, kept))
            for addr, nbytes in shared:
                release_pages(addr, nbytes)
            if progress is not None:
                progress(done, total)
        return size

    def _add_block(self, block: nn.Module, ps: list[nn.Parameter],
                   recs: list[torch.Tensor | None]) -> int:  # fmt: skip
        """One block's encoded parameters (`recs`: encode_bf16's records, None for a parameter
        kept dense) into slots of the shared buffer (a tensor at a time by the C++ decoder,
        64-byte aligned), and its hooks. Returns the values it uses of the buffer."""
        slots, used = [], 0
        for p, rec in zip(ps, recs, strict=True):
            if rec is None:
                continue
            coded = parse_record(rec, p.numel()).to(self.device)
            slots.append(_Slot(p, p.shape, coded, used))
            self.dense_bytes += p.numel() * 2
            self.compressed_bytes += coded.nbytes() + coded.table.nbytes
            used += -(-p.numel() // 32) * 32
            p.data = self._empty  # the dense weight is freed (unless held elsewhere)
        self._hook(block, _Block(slots, None))
        return used

    def _add_tiles(self, block: nn.Module, ps: list[nn.Parameter], min_saving: int) -> int:
        """One block's parameters coded into one TileGroup where they are decoded (a tensor
        that would save no more than `min_saving` bytes stays dense), and its hooks. Returns
        the values it uses of the buffer."""
        # the block's tensors share one code: a tensor whose exponents are unlike the others'
        # gains less under it than under its own, so the code is made again without those
        # that no longer gain, until all that are left do
        cands = [(p, p.data.to(self.device)) for p in ps]
        hists = [exponent_counts(dense) for _, dense in cands]
        while True:
            counts = sum(hists, np.zeros(256, dtype=np.int64))
            lengths = code_lengths(counts) if counts.any() else counts
            gains = [2 * p.numel() - tile_bytes(p.numel(), int((h * lengths).sum()), self._span)
                     > min_saving for (p, _), h in zip(cands, hists, strict=True)]  # fmt: skip
            if all(gains):
                break
            cands = [c for c, gain in zip(cands, gains, strict=True) if gain]
            hists = [h for h, gain in zip(hists, gains, strict=True) if gain]
        slots, used = [], 0
        for p, _ in cands:
            slots.append(_Slot(p, p.shape, None, used))
            used += -(-p.numel() // SLOT_ALIGN) * SLOT_ALIGN
        kept = [dense for _, dense in cands]
        group = (tile_group(kept, [s.offset for s in slots], counts, self._span)
                 if kept else None)  # fmt: skip
        del kept, cands
        for s in slots:
            self.dense_bytes += s.shape.numel() * 2
            s.param.data = self._empty  # the dense weight is freed (unless held elsewhere)
        if group is not None:
            self.compressed_bytes += group.nbytes()
        self._hook(block, _Block(slots, group))
        return used

    def _hook(self, block: nn.Module, entry: _Block) -> None:
        self._blocks.append(entry)
        self._hooks.append(block.register_forward_pre_hook(self._pre_hook(len(self._blocks) - 1)))
        self._hooks.append(block.register_forward_hook(self._post_hook(entry)))

    def _pre_hook(self, index: int) -> Callable[..., None]:
        entry = self._blocks[index]

        def hook(_module: nn.Module, _args: Any) -> None:
            if self._side is None:
                self._decode(entry)
            else:
                self._decode_ahead(index)

        return hook

    def _decode_ahead(self, index: int) -> None:
        """Block `index`'s weights from the side stream (decoded ahead while the blocks before
        ran, or now when they were not: a forward's first block, or blocks run out of order),
        and the decodes of the blocks after it started, as many as there are other buffers.
        Captured in a CUDA graph, the side stream's kernels are a branch of it that joins
        before each block."""
        assert self._side is not None
        current = torch.cuda.current_stream(self.device)
        capturing = torch.cuda.is_current_stream_capturing()
        # Decoded ahead only when it follows the block run last, in the same mode: a forward
        # (each graph's capture) decodes from its first block, and a graph decodes all it reads
        if index == 0 or self._last != (index - 1, capturing):
            self._launched = index - 1
        self._last = (index, capturing)
        n = len(self._buffers)
        if self._launched < index:
            self._launch(index, current)
        current.wait_event(self._ready[index % n])
        self._bind(self._blocks[index], self._buffers[index % n])
        while self._launched < min(index + n - 1, len(self._blocks) - 1):
            self._launch(self._launched + 1, current)
        self._pending = self._launched > index

    def join(self) -> None:
        """Make the current stream wait for decodes started ahead that no block waited on: a
        forward that raised midway left them running. Eager forwards after it are safe (the
        side stream runs in order), but a CUDA graph's replay waits on no stream of ours, and
        its own decodes would write the buffers beside them. Call before each replay; a no-op
        after a whole forward."""
        if self._pending and self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._pending = False

    def _launch(self, index: int, current: torch.cuda.Stream) -> None:
        """Decode block `index` on the side stream once the work queued on `current` so far,
        which includes the last block that read its buffer, is done."""
        assert self._side is not None
        group = self._blocks[index].group
        assert group is not None
        n = len(self._buffers)
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side):
            decode_tiles(group, self._buffers[index % n])
        self._ready[index % n].record(self._side)
        self._launched = index

    def _post_hook(self, entry: _Block) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, _out: Any) -> None:
            for s in entry.slots:  # a stale view would silently read the next block's weights
                s.param.data = self._empty

        return hook

    def _decode(self, entry: _Block) -> None:
        """Decode `entry` in line, into the first buffer, and point its parameters there."""
        if entry.group is not None:
            decode_tiles(entry.group, self.buffer)
        for s in entry.slots:
            if s.coded is not None:
                decode(s.coded, out=self.buffer[s.offset : s.offset + s.shape.numel()],
                       check=False)  # fmt: skip
        self._bind(entry, self.buffer)

    @staticmethod
    def _bind(entry: _Block, buffer: torch.Tensor) -> None:
        for s in entry.slots:
            s.param.data = buffer[s.offset : s.offset + s.shape.numel()].view(s.shape)

    def summary(self) -> str:
        """E.g. "212 -> 141 MB (66.6%), decoded a layer at a time into a 7.1 MB buffer"."""
        share = self.compressed_bytes / self.dense_bytes if self.dense_bytes else 1.0
        n = len(self._buffers)
        into = (f"{n} {self.buffer.nbytes / 1e6:.1f} MB buffers, the next "
                f"{'layer' if n == 2 else f'{n - 1} layers'} while one runs"
                if self._side is not None else f"a {self.buffer.nbytes / 1e6:.1f} MB buffer")  # fmt: skip
        return (
            f"{self.dense_bytes / 1e6:.0f} -> {self.compressed_bytes / 1e6:.0f} MB "
            f"({share:.1%}), decoded a layer at a time into {into}"
        )

    def release(self) -> None:
        for h in self._hooks:
            h.remove()
        self.join()  # a decode ahead may still be writing a buffer
        for entry in self._blocks:
            self._decode(entry)
            for s in entry.slots:
                s.param.data = s.param.data.clone()
        self._blocks, self._hooks = [], []


REPORT_S = 2.0  # the least seconds between two progress lines of compress_layers


def compress_layers(
    model: nn.Module, device: torch.device | str | None = None
) -> CompressedBlocks | None:
    """`EngineConfig.keep_weights_compressed`: the decoder layers (`model.layers`) of a loaded
    model kept compressed on `device` (default: where they are), with a progress line every few
    seconds and one when done. A clear error for a model whose layers hold no bfloat16 weight."""
    layers = list(model.layers)  # type: ignore[arg-type]
    dtypes = {p.dtype for layer in layers for p in layer.parameters()}
    if torch.bfloat16 not in dtypes:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)) or "none"
        raise ValueError(
            "keep_weights_compressed (--keep-weights-compressed) needs bfloat16 weights "
            "(dtype='bfloat16' / --dtype bfloat16, or weight_dtype='bfloat16' / --weight-dtype "
            f"bfloat16 under float32 on the CPU); the layers' weights are {names}"
        )
    t0 = last = time.perf_counter()

    def progress(done: int, total: int) -> None:
        nonlocal last
        if (now := time.perf_counter()) - last >= REPORT_S:
            log.info("weights kept compressed: %d of %d M values encoded (%.0f s)",
                     done // 10**6, total // 10**6, now - t0)  # fmt: skip
            last = now

    blocks = CompressedBlocks(layers, device=device, progress=progress)
    if not blocks.dense_bytes:
        blocks.release()
        log.warning("weights kept compressed: no layer weight of this model is large enough to "
                    "gain (each must save more than a %d KiB decode table); the layers "
                    "stay dense", TABLE_BYTES >> 10)  # fmt: skip
        return None
    # The loader placed every parameter in one arena: while the embedding, the norms or the LM
    # head still view it, the layers' share stays allocated. They get memory of their own.
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.numel() and t.untyped_storage().nbytes() > t.nbytes:
            t.data = t.data.clone()
    trim_heap()  # the encoder's temporaries, freed on this thread's heap
    log.info("weights kept compressed: %s in %.1f s", blocks.summary(), time.perf_counter() - t0)
    return blocks
