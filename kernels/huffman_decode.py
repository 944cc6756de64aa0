"""Huffman-coded bfloat16 exponents back to bfloat16: a Triton kernel, its PyTorch reference, and
the dispatch (Triton on CUDA, the C++ decoder `csrc/huffman_decode_cpu.cpp` on the CPU).

A bfloat16 value is a sign bit, 8 exponent bits and 7 mantissa bits. In trained weights the
exponent takes few values (entropy ~2.6 bits), the rest is close to random. So a tensor of n
values is kept as (`runtime/compression.py` writes it to disk):

    sm       (n,) uint8          sign and mantissa of each value: (b >> 8) & 0x80 | b & 0x7F
    bits     (nbytes,) uint8     the exponents (b >> 7) & 0xFF in a canonical Huffman code of at
                                 most CODE_BITS bits, most significant bit first, in chunks of
                                 chunk_elems values, each chunk starting on a byte
    offsets  (n_chunks + 1,) int32   where each chunk starts in `bits`; the last is nbytes
    lengths  (256,)              each exponent's code length (0: it does not occur)

Chunks decode independently: the C++ decoder runs four chunks in step per thread, the Triton
kernel one chunk per lane, the PyTorch reference all chunks at once in tensor ops. All of them
read the next CODE_BITS bits of the stream and look them up in a table of 2^CODE_BITS int64
entries (`decode_table`), each holding up to four exponents whose codes fit in those bits:

    bits  0-31   the exponents, first in the low byte
    bits 32-39   how many (1-4)
    bits 40-47   the bits they take together
    bits 48-55   the bits the first takes alone (used near a chunk's end, where fewer are wanted)

`decode_table` accepts only a complete prefix code (Kraft sum exactly 1, lengths 1..CODE_BITS),
so every entry decodes and no stream, however corrupt, can make a decoder read out of bounds;
a decoder that finds a chunk's codes running past the chunk's bytes reports it as corrupt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch

CODE_BITS = 12  # longest code: the decode table has 4096 entries (32 KiB, in L1)
TABLE_SIZE = 1 << CODE_BITS


class CorruptStreamError(ValueError):
    """A chunk's codes run past its bytes, or a code table is not a valid prefix code."""


@dataclass(slots=True)
class CodedBF16:
    """One tensor's coded form, ready to decode (views of its record, on any device)."""

    table: torch.Tensor  # (TABLE_SIZE,) int64, from decode_table
    offsets: torch.Tensor  # (n_chunks + 1,) int32: byte offset of each chunk in `bits`
    sm: torch.Tensor  # (n,) uint8: sign and mantissa bits
    bits: torch.Tensor  # (nbytes,) uint8: the coded exponents
    chunk_elems: int  # values per chunk (the last chunk may hold fewer)

    @property
    def numel(self) -> int:
        return self.sm.numel()

    @property
    def num_chunks(self) -> int:
        return self.offsets.numel() - 1

    def to(self, device: torch.device | str) -> CodedBF16:
        return CodedBF16(
            self.table.to(device),
            self.offsets.to(device),
            self.sm.to(device),
            self.bits.to(device),
            self.chunk_elems,
        )

    def nbytes(self) -> int:
        """Memory it takes (the table aside, which is per tensor and small)."""
        return self.offsets.numel() * 4 + self.sm.numel() + self.bits.numel()


# ---------------------------------------------------------------------------------------------
# The code


def check_lengths(lengths: np.ndarray) -> np.ndarray:
    """`lengths` as (256,) int64 if it describes a complete prefix code of at most CODE_BITS
    bits; CorruptStreamError saying what is wrong otherwise."""
    lengths = np.asarray(lengths).astype(np.int64).ravel()
    if lengths.shape != (256,):
        raise CorruptStreamError(f"code table has {lengths.size} lengths, expected 256")
    if lengths.min() < 0 or lengths.max() > CODE_BITS:
        raise CorruptStreamError(
            f"code lengths must be 0..{CODE_BITS}, got {lengths.min()}..{lengths.max()}"
        )
    used = lengths[lengths > 0]
    kraft = int((1 << (CODE_BITS - used)).sum())
    if kraft != TABLE_SIZE:
        raise CorruptStreamError(
            f"code lengths do not describe a complete prefix code (Kraft sum {kraft}/"
            f"{TABLE_SIZE}, {'over-subscribed' if kraft > TABLE_SIZE else 'incomplete'})"
        )
    return lengths


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """(256,) int64 codes of the canonical Huffman code with these lengths: codes ordered by
    (length, symbol), each the previous plus one, shifted left as the length grows. Put another
    way: in that order, each code's CODE_BITS-bit windows follow the previous code's, so a
    code is where its windows start, shifted right by its unused bits."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = _canonical_order(lengths)
    span = 1 << (CODE_BITS - lengths[order])  # windows each code covers
    codes = np.zeros(256, dtype=np.int64)
    codes[order] = (np.cumsum(span) - span) >> (CODE_BITS - lengths[order])
    return codes


def _canonical_order(lengths: np.ndarray) -> np.ndarray:
    order = np.lexsort((np.arange(256), lengths))
    return order[lengths[order] > 0]


def decode_table(lengths: np.ndarray) -> torch.Tensor:
    """The (TABLE_SIZE,) int64 multi-symbol decode table of a code (see the module docstring):
    by the C++ extension where it is built (0.02 ms), in numpy otherwise (0.1 ms; a GPU worker
    never compiles the CPU decoder for its tables); CorruptStreamError if `lengths` is not a
    complete prefix code."""
    from kernels.cpu_ext import huffman_if_built

    lengths = check_lengths(lengths)
    ext = huffman_if_built()
    return (
        decode_table_reference(lengths)
        if ext is None
        else ext.build_table(torch.from_numpy(lengths))
    )


def decode_table_reference(lengths: np.ndarray) -> torch.Tensor:
    """decode_table in numpy."""
    lengths = check_lengths(lengths)
    order = _canonical_order(lengths)
    span = 1 << (CODE_BITS - lengths[order])
    sym = np.repeat(order, span)  # the one symbol each window starts with (windows in order)
    size = np.repeat(lengths[order], span)
    window = np.arange(TABLE_SIZE, dtype=np.int64)
    entry, count, used = sym.copy(), np.ones_like(sym), size.copy()
    fits = np.ones(TABLE_SIZE, dtype=bool)
    for k in range(1, 4):  # the next codes, while they end inside the 12 known bits
        rest = (window << used) & (TABLE_SIZE - 1)
        fits &= used + size[rest] <= CODE_BITS
        entry |= np.where(fits, sym[rest] << (8 * k), 0)
        count += fits
        used += np.where(fits, size[rest], 0)
    return torch.from_numpy(entry | (count << 32) | (used << 40) | (size << 48))


# ---------------------------------------------------------------------------------------------
# The PyTorch reference: every chunk at once, one table lookup per step


def decode_reference(coded: CodedBF16, first: int = 0, last: int | None = None) -> torch.Tensor:
    """Chunks [first, last) (default: all) as bfloat16 values, on `coded`'s device. The same
    steps as the Triton kernel, in torch ops over all those chunks at once; CorruptStreamError
    naming the first chunk whose codes run past its bytes."""
    dev = coded.sm.device
    n, chunk = coded.numel, coded.chunk_elems
    last = coded.num_chunks if last is None else last
    c = torch.arange(first, last, device=dev, dtype=torch.int64)
    lo, hi = first * chunk, min(n, last * chunk)
    start = c * chunk - lo  # where each chunk's values go in the result
    length = torch.clamp(n - c * chunk, max=chunk)
    base = coded.offsets[first:last].long()
    bits = torch.cat([coded.bits, torch.zeros(3, dtype=torch.uint8, device=dev)]).long()
    table = coded.table
    exps = torch.zeros(max(0, hi - lo), dtype=torch.int64, device=dev)
    pos = torch.zeros_like(c)  # bits consumed in each chunk
    done = torch.zeros_like(c)  # exponents decoded in each chunk
    while True:
        live = torch.nonzero(done < length).squeeze(1)
        if live.numel() == 0:
            break
        p, d = pos[live], done[live]
        byte = torch.clamp(base[live] + (p >> 3), max=bits.numel() - 3)
        w = (bits[byte] << 16) | (bits[byte + 1] << 8) | bits[byte + 2]
        t = table[(w >> (12 - (p & 7))) & (TABLE_SIZE - 1)]
        whole = ((t >> 32) & 0xFF) <= length[live] - d  # all of the entry is wanted
        take = torch.where(whole, (t >> 32) & 0xFF, 1)
        for j in range(4):
            ok = j < take
            exps[start[live][ok] + d[ok] + j] = (t[ok] >> (8 * j)) & 0xFF
        done[live] = d + take
        pos[live] = p + torch.where(whole, (t >> 40) & 0xFF, (t >> 48) & 0xFF)
    _check_consumed(pos, coded.offsets[first : last + 1], first)
    return _merge(coded.sm[lo:hi], exps)


def _merge(sm: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    s = sm.to(torch.int32)
    v = ((s & 0x80) << 8) | (exps.to(torch.int32) << 7) | (s & 0x7F)  # 0..65535
    return (v - ((v >> 15) << 16)).to(torch.int16).view(torch.bfloat16)  # as signed 16-bit


def _check_consumed(pos: torch.Tensor, offsets: torch.Tensor, first: int = 0) -> None:
    over = torch.nonzero(pos > (offsets[1:] - offsets[:-1]).long() * 8)
    if over.numel():
        _corrupt(first + int(over[0]))


def _corrupt(chunk: int) -> NoReturn:
    raise CorruptStreamError(f"chunk {chunk}: its codes run past its bytes (corrupt stream)")


# ---------------------------------------------------------------------------------------------
# The Triton kernels (kernels/huffman_decode_triton.py)
#
# A lane per chunk (the default 4096 values) is too few lanes to fill a GPU: a 4096 x 4096
# matrix is 4096 lanes, each making ~1200 dependent table lookups (H200, 2026-11-26: 7 GB/s).
# That does for a one-off decode. Tensors decoded again and again (weights kept compressed on a
# GPU) are coded anew where they are kept, a lane per TILE_SPAN values (a TileGroup, below).


def decode_triton(
    coded: CodedBF16, out: torch.Tensor | None = None, check: bool = True, block: int = 64
) -> torch.Tensor:
    """(n,) bfloat16 decoded by the Triton kernel, a lane per chunk, into `out` if given ((n,)
    bfloat16, contiguous, on the same device). `check`: raise CorruptStreamError if a chunk's
    codes ran past its bytes (a device sync; a caller decoding weights it checked at load skips
    it)."""
    _check_inputs(coded, out)
    n = coded.numel
    out = torch.empty(n, dtype=torch.bfloat16, device=coded.sm.device) if out is None else out
    if n == 0:
        return out
    used = torch.empty(coded.num_chunks, dtype=torch.int64, device=coded.sm.device)
    _launch_chunks(coded, out, used, block)
    if check:
        _check_consumed(used, coded.offsets)
    return out


def _launch_chunks(coded: CodedBF16, out: torch.Tensor, used: torch.Tensor, block: int) -> None:
    # Triton only here: the CPU path (every load on a machine without a GPU) never imports it
    from kernels.huffman_decode_triton import huffman_decode_kernel

    huffman_decode_kernel[(-(-coded.num_chunks // block),)](
        coded.table,
        coded.offsets,
        coded.sm,
        coded.bits,
        out.view(torch.int16),
        used,
        coded.numel,
        coded.bits.numel(),
        coded.num_chunks,
        CHUNK=coded.chunk_elems,
        BLOCK=block,
        num_warps=max(1, block // 32),  # a lane per chunk, no lane doing another's work
    )


TILE_LANES = 32  # lanes a tile: one warp, so the loop's test that every lane is done stays in it
# values a lane, by default. A layer is one launch: the fewer values a lane, the more lanes to
# hide each lane's chain of dependent lookups, the more memory their offsets take. SmolLM2's
# graphed step at batch 1 with its layers kept compressed, an H100, one call (2026-11-27):
# 1.40x dense at 64 (68.8% of the bfloat16 bytes kept), 1.15x at 32 (71.0%), 1.13x at 16 (75.3%)
TILE_SPAN = 32
TILE_SPANS = range(4, 65, 4)  # a lane's first bit is an int16 from its tile's: 31 * 64 * 12 fit


@dataclass(slots=True)
class TileGroup:
    """Tensors coded for the tiles kernel (weights kept compressed on a GPU), decoded together
    into one buffer by one launch (`decode_tiles`). Each tensor is cut into tiles of
    TILE_LANES * span values; lane i of a tile codes, in its own stream, the values at places
    4 * (i + TILE_LANES * k) + j of the tile (k < span / 4, j < 4), so that at each step
    a tile's lanes read and write neighbouring words. runtime.compression.tile_group encodes
    it, on the device (a tile's streams follow each other: lane 0's, lane 1's, ...)."""

    table: torch.Tensor  # (TABLE_SIZE,) int64: the decode table of the group's one code
    tiles: torch.Tensor  # (n_tiles, 3) int64: first bit in `words`, first place in the
    #                      buffer, values
    lanes: torch.Tensor  # (n_tiles * TILE_LANES,) int16: a lane's first bit from its tile's
    words: torch.Tensor  # int32: the streams, 32 bits a word, first bit the most significant;
    #                      2 words of padding after
    sm: torch.Tensor  # (numel rounded up to 4,) uint8: sign+mantissa bytes, by buffer place
    numel: int  # the buffer's values: the last tensor's end
    span: int  # values a lane

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.table, self.tiles, self.lanes, self.words, self.sm))


def decode_tiles(group: TileGroup, out: torch.Tensor) -> torch.Tensor:
    """Every tensor of `group` decoded into its place in `out` ((>= group.numel,) bfloat16,
    contiguous, 8-byte aligned, on the group's device; the gaps between tensors untouched) in
    one launch, a program (one warp) a tile. Returns `out`."""
    n_tiles = group.tiles.shape[0]
    if n_tiles == 0:
        return out
    if (out.dtype != torch.bfloat16 or out.numel() < group.numel or not out.is_contiguous()
            or out.data_ptr() % 8 or out.device != group.sm.device):  # fmt: skip
        raise ValueError(
            f"out must be a contiguous, 8-byte aligned bfloat16 tensor of at least "
            f"{group.numel} values on {group.sm.device}, got {tuple(out.shape)} {out.dtype} on "
            f"{out.device}"
        )
    from kernels.huffman_decode_triton import huffman_decode_tiles_kernel

    huffman_decode_tiles_kernel[(n_tiles,)](
        group.table,
        group.tiles,
        group.lanes,
        group.words,
        group.sm,
        out.view(torch.int16),
        LANES=TILE_LANES,
        SPAN=group.span,
        num_warps=1,
    )
    return out


def _check_inputs(coded: CodedBF16, out: torch.Tensor | None) -> None:
    n = coded.numel
    if coded.table.dtype != torch.int64 or coded.table.shape != (TABLE_SIZE,):
        raise ValueError(
            f"table must be ({TABLE_SIZE},) int64, got {tuple(coded.table.shape)} "
            f"{coded.table.dtype}"
        )
    if (
        coded.offsets.dtype != torch.int32
        or coded.offsets.numel() != -(-n // coded.chunk_elems) + 1
    ):
        raise ValueError(
            f"offsets must be int32 with one entry per chunk of {coded.chunk_elems} plus one "
            f"({-(-n // coded.chunk_elems) + 1}), got {coded.offsets.numel()} {coded.offsets.dtype}"
        )
    if coded.sm.dtype != torch.uint8 or coded.bits.dtype != torch.uint8:
        raise ValueError(f"sm and bits must be uint8, got {coded.sm.dtype} and {coded.bits.dtype}")
    if out is not None and (
        out.dtype != torch.bfloat16
        or out.numel() != n
        or not out.is_contiguous()
        or out.device != coded.sm.device
    ):
        raise ValueError(
            f"out must be a contiguous ({n},) bfloat16 tensor on {coded.sm.device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )


# ---------------------------------------------------------------------------------------------
# Dispatch


def decode(
    coded: CodedBF16,
    out: torch.Tensor | None = None,
    threads: int | None = None,
    check: bool = True,
) -> torch.Tensor:
    """(n,) bfloat16 (into `out` if given): the Triton kernel on CUDA (`check` as there), the
    C++ decoder on the CPU on up to `threads` threads (default: torch's). CorruptStreamError
    naming the chunk if the stream is corrupt."""
    if coded.sm.is_cuda:
        return decode_triton(coded, out, check)
    _check_inputs(coded, out)
    out = torch.empty(coded.numel, dtype=torch.bfloat16) if out is None else out
    # a thread per million values at most: an OpenMP team costs more than a small tensor's decode
    threads = min(threads or torch.get_num_threads(), 1 + coded.numel // (1 << 20))
    return decode_cpu(coded, out, 0, coded.num_chunks, threads)


def decode_cpu(
    coded: CodedBF16, out: torch.Tensor, first: int, last: int, threads: int = 1
) -> torch.Tensor:
    """Decode chunks [first, last) of a CPU tensor into their places in `out` ((n,) bfloat16)
    with the C++ decoder (the GIL released; `threads` 1: on this thread alone; more: with helper
    threads of the decoder's own pool, which sleep between calls rather than spin), or the
    reference where the decoder cannot be built. Returns `out`."""
    from kernels.cpu_ext import load_huffman

    ext = load_huffman()
    if ext is None:
        lo, hi = first * coded.chunk_elems, min(coded.numel, last * coded.chunk_elems)
        out[lo:hi] = decode_reference(coded, first, last)
        return out
    bad = ext.decode_bf16(
        out,
        coded.table,
        coded.offsets,
        coded.sm,
        coded.bits,
        coded.chunk_elems,
        first,
        last,
        threads,
    )
    if bad >= 0:
        _corrupt(bad)
    return out
