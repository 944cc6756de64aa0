"""The Triton kernels of kernels/huffman_decode.py, apart so that the CPU decoder's users never
import Triton. Both decode Huffman-coded bfloat16 exponents through the 4096-entry multi-symbol
decode table (kernels/huffman_decode.py says what an entry holds).

`huffman_decode_kernel`: a lane per chunk, from the chunk's first byte, as the files hold them;
it records the bits each chunk consumed (the corruption check) and, with WRITE_MARKS, the bit
where every SPAN-th value's code starts in its chunk (the marks). A one-off decode, and the pass
that finds the marks.

`huffman_decode_lanes_kernel`: a lane per SPAN values of one or several tensors (a group), each
lane from the bit its mark gives, for tensors decoded again and again (weights kept compressed
on a GPU). Its memory traffic is per word, not per byte: a lane keeps the next 33-64 bits of its
stream in a register, refilled a 32-bit word at a time, and gathers the exponents it decodes
until it holds four, then reads their four sign+mantissa bytes as one word and writes the four
bfloat16 values as one 8-byte store. (Byte loads and 2-byte stores from lanes 512 bytes apart
each cost the L1 a transaction per lane: that capped the first version near 100 GB/s on an
H200, 2026-11-26.)
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
    used_ptr,  # (n_chunks,) int64: bits each chunk consumed
    n,
    nbytes,
    n_chunks,
    CHUNK: tl.constexpr,
    SPAN: tl.constexpr,
    WRITE_MARKS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = c < n_chunks
    start = c.to(tl.int64) * CHUNK
    length = tl.where(live, tl.minimum(n - start, CHUNK), 0)
    base = tl.load(offsets_ptr + c, mask=live, other=0).to(tl.int64)
    pos = tl.zeros([BLOCK], dtype=tl.int64)  # bits consumed in the chunk
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
    tl.store(used_ptr + c, pos, mask=live)


@triton.jit
def _big_endian(x):
    """The int32 loaded from four stream bytes (little-endian) as the 32 stream bits in order,
    zero-extended to uint64."""
    u = x.to(tl.uint32, bitcast=True)
    u = ((u & 0xFF) << 24) | ((u & 0xFF00) << 8) | ((u >> 8) & 0xFF00) | (u >> 24)
    return u.to(tl.uint64)


@triton.jit
def _bf16(e, s):
    """bfloat16 bits (int32, low 16) of exponent byte `e` and sign+mantissa byte `s`."""
    return ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)


@triton.jit
def huffman_decode_lanes_kernel(
    tables_ptr,  # (n_tensors * TABLE_SIZE,) int64: each tensor's decode table
    lanes_ptr,  # (n_lanes,) int64: the bit in words_ptr where the lane's first code starts,
    #             its tensor's index above bit 48
    ends_ptr,  # (n_tensors + 1,) int64: where each tensor's values end in out_ptr (the last,
    #            0, is no tensor's: lanes in gaps between tensors point at it)
    words_ptr,  # int32: the coded exponents' bytes, 4 at a time, 8 bytes of padding after
    sm_ptr,  # uint8, by position in out_ptr, 4-byte aligned: sign and mantissa bytes
    out_ptr,  # int16, 8-byte aligned: lane c writes values [c * SPAN, its tensor's end)
    n_lanes,
    SPAN: tl.constexpr,  # a multiple of 4
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = c < n_lanes
    lane = tl.load(lanes_ptr + c, mask=live, other=0)
    tensor = lane >> 48
    bit = lane & 0xFFFFFFFFFFFF
    start = c.to(tl.int64) * SPAN
    end = tl.load(ends_ptr + tensor, mask=live, other=0)
    length = tl.where(live, tl.maximum(tl.minimum(end - start, SPAN), 0), 0).to(tl.int32)
    table = tables_ptr + tensor * 4096
    # the stream from `bit` on, left-aligned in a 64-bit register holding `nb` valid bits
    w = bit >> 5
    off = (bit & 31).to(tl.uint64)
    hi = _big_endian(tl.load(words_ptr + w, mask=live, other=0))
    lo = _big_endian(tl.load(words_ptr + w + 1, mask=live, other=0))
    buf = ((hi << 32) | lo) << off
    nb = 64 - (bit & 31).to(tl.int32)
    w += 2
    acc = tl.zeros([BLOCK], dtype=tl.uint64)  # exponents decoded, not yet written: a byte each
    fill = tl.zeros([BLOCK], dtype=tl.int32)  # how many
    done = tl.zeros([BLOCK], dtype=tl.int32)
    sm32 = sm_ptr.to(tl.pointer_type(tl.int32))
    out64 = out_ptr.to(tl.pointer_type(tl.int64))
    while tl.max(length - done, axis=0) > 0:
        active = done < length
        need = active & (nb <= 32)  # a code is at most 12 bits: one word per step keeps up
        x = _big_endian(tl.load(words_ptr + w, mask=need, other=0))
        buf = tl.where(need, buf | (x << (32 - nb).to(tl.uint64)), buf)
        nb = tl.where(need, nb + 32, nb)
        w = tl.where(need, w + 1, w)
        t = tl.load(table + (buf >> 52).to(tl.int64), mask=active, other=0)
        whole = ((t >> 32) & 0xFF).to(tl.int32) <= length - done
        take = tl.where(active, tl.where(whole, ((t >> 32) & 0xFF).to(tl.int32), 1), 0)
        used = tl.where(active, tl.where(whole, (t >> 40) & 0xFF, (t >> 48) & 0xFF), 0)
        buf = buf << used.to(tl.uint64)
        nb -= used.to(tl.int32)
        keep = (tl.full([BLOCK], 1, tl.uint64) << (8 * take).to(tl.uint64)) - 1
        acc = acc | (((t & 0xFFFFFFFF).to(tl.uint64) & keep) << (8 * fill).to(tl.uint64))
        fill += take
        done += take
        full = fill >= 4
        word = (start + done - fill) >> 2  # the first held value's place, a multiple of 4
        s4 = tl.load(sm32 + word, mask=full, other=0)
        e4 = acc.to(tl.int64)
        v0 = _bf16((e4 & 0xFF).to(tl.int32), s4 & 0xFF)
        v1 = _bf16(((e4 >> 8) & 0xFF).to(tl.int32), (s4 >> 8) & 0xFF)
        v2 = _bf16(((e4 >> 16) & 0xFF).to(tl.int32), (s4 >> 16) & 0xFF)
        v3 = _bf16(((e4 >> 24) & 0xFF).to(tl.int32), (s4 >> 24) & 0xFF)
        four = (v0 | (v1 << 16)).to(tl.int64) & 0xFFFFFFFF
        four = four | (((v2 | (v3 << 16)).to(tl.int64) & 0xFFFFFFFF) << 32)
        tl.store(out64 + word, four, mask=full)
        acc = tl.where(full, acc >> 32, acc)
        fill = tl.where(full, fill - 4, fill)
    # a tensor whose size is not a multiple of 4: its last lane holds 1-3 values still
    first = start + done - fill
    for j in tl.static_range(3):
        ok = live & (j < fill)
        s = tl.load(sm_ptr + first + j, mask=ok, other=0).to(tl.int32)
        v = _bf16(((acc >> (8 * j)) & 0xFF).to(tl.int32), s)
        tl.store(out_ptr + first + j, v.to(tl.int16), mask=ok)
