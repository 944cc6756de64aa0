"""The Triton kernel of kernels/huffman_decode.py (`decode_triton`), apart so that the CPU
decoder's users never import Triton. Each lane decodes a run of values of a Huffman-coded
bfloat16 tensor through the 4096-entry multi-symbol table, in one of two ways:

- a lane per chunk (LANE == CHUNK): from the chunk's first byte, recording the bits it consumed
  (for the corruption check) and, with WRITE_MARKS, where in the chunk every SPAN-th value's code
  starts (the marks);
- a lane per mark (LANE == SPAN): from the bit the marks give, SPAN values each: CHUNK / SPAN
  times the lanes, for a tensor decoded again and again (weights kept compressed on a GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def huffman_decode_kernel(
    table_ptr,  # (TABLE_SIZE,) int64
    offsets_ptr,  # (n_chunks + 1,) int32: each chunk's first byte in bits_ptr
    marks_ptr,  # (n_chunks * CHUNK // SPAN,) int32: bit of every SPAN-th value in its chunk
    sm_ptr,  # (n,) uint8
    bits_ptr,  # (nbytes,) uint8
    out_ptr,  # (n,) int16
    used_ptr,  # (n_chunks,) int64: bits each chunk consumed (a lane per chunk only)
    n,
    nbytes,
    n_lanes,
    CHUNK: tl.constexpr,
    SPAN: tl.constexpr,
    LANE: tl.constexpr,
    WRITE_MARKS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = c < n_lanes
    start = c.to(tl.int64) * LANE
    length = tl.where(live, tl.minimum(n - start, LANE), 0)
    if LANE == CHUNK:
        base = tl.load(offsets_ptr + c, mask=live, other=0).to(tl.int64)
        pos = tl.zeros([BLOCK], dtype=tl.int64)  # bits consumed in the chunk
    else:
        base = tl.load(offsets_ptr + c // (CHUNK // SPAN), mask=live, other=0).to(tl.int64)
        pos = tl.load(marks_ptr + c, mask=live, other=0).to(tl.int64)
    done = tl.zeros([BLOCK], dtype=tl.int64)
    while tl.max(length - done, axis=0) > 0:
        active = done < length
        if WRITE_MARKS:  # a mark is reached exactly: entries never cross one (stop, below)
            at_mark = active & (done % SPAN == 0)
            tl.store(marks_ptr + c * (CHUNK // SPAN) + done // SPAN, pos.to(tl.int32), mask=at_mark)
            stop = tl.minimum(length, (done // SPAN + 1) * SPAN)
        else:
            stop = length
        byte = base + (pos >> 3)
        b0 = tl.load(bits_ptr + byte, mask=active & (byte < nbytes), other=0).to(tl.int32)
        b1 = tl.load(bits_ptr + byte + 1, mask=active & (byte + 1 < nbytes), other=0).to(tl.int32)
        b2 = tl.load(bits_ptr + byte + 2, mask=active & (byte + 2 < nbytes), other=0).to(tl.int32)
        shift = 12 - (pos & 7).to(tl.int32)
        window = ((((b0 << 16) | (b1 << 8) | b2) >> shift) & 4095).to(tl.int64)
        t = tl.load(table_ptr + window, mask=active, other=0)
        whole = ((t >> 32) & 0xFF) <= stop - done  # all of the entry's values are wanted
        take = tl.where(active, tl.where(whole, (t >> 32) & 0xFF, 1), 0)
        for j in tl.static_range(4):
            ok = j < take
            k = start + done + j
            e = ((t >> (8 * j)) & 0xFF).to(tl.int32)
            s = tl.load(sm_ptr + k, mask=ok, other=0).to(tl.int32)
            v = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
            tl.store(out_ptr + k, v.to(tl.int16), mask=ok)
        pos += tl.where(active, tl.where(whole, (t >> 40) & 0xFF, (t >> 48) & 0xFF), 0)
        done += take
    if LANE == CHUNK:
        tl.store(used_ptr + c, pos, mask=live)
