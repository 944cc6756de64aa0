"""The Triton kernels of kernels/huffman_decode.py, apart so that the CPU decoder's users never
import Triton. Both decode Huffman-coded bfloat16 exponents through the 4096-entry multi-symbol
decode table (kernels/huffman_decode.py says what an entry holds).

`huffman_decode_kernel`: a lane per chunk, from the chunk's first byte, as the files hold them;
it records the bits each chunk consumed (the corruption check). A one-off decode.

`huffman_decode_tiles_kernel`: a TileGroup (weights kept compressed on a GPU, decoded again and
again), a program per tile of 32 lanes x SPAN values, each lane decoding its own stream. Its
memory traffic is per word, not per byte: a lane keeps the next 33-64 bits of its stream in a
register, refilled a 32-bit word at a time, and gathers the exponents it decodes until it holds
four, then reads their four sign+mantissa bytes as one word and writes the four bfloat16 values
as one 8-byte store; and a tile's lanes hold interleaved groups of four values, so that at each
step they read and write neighbouring words. On an H100 (2026-11-27, SmolLM2's first four
layers, 64 values a lane, a table a tensor): 517 GB/s, where the lanes of its first version,
each decoding 64 consecutive values (a store per lane per 128-byte line), made 207; byte
loads and 2-byte stores had made ~100 (an H200, 2026-11-26).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def huffman_decode_kernel(
    table_ptr,  # (TABLE_SIZE,) int64
    offsets_ptr,  # (n_chunks + 1,) int32: each chunk's first byte in bits_ptr
    sm_ptr,  # (n,) uint8
    bits_ptr,  # (nbytes,) uint8
    out_ptr,  # (n,) int16
    used_ptr,  # (n_chunks,) int64: bits each chunk consumed
    n,
    nbytes,
    n_chunks,
    CHUNK: tl.constexpr,
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
        byte = base + (pos >> 3)
        b0 = tl.load(bits_ptr + byte, mask=active & (byte < nbytes), other=0).to(tl.int32)
        b1 = tl.load(bits_ptr + byte + 1, mask=active & (byte + 1 < nbytes), other=0).to(tl.int32)
        b2 = tl.load(bits_ptr + byte + 2, mask=active & (byte + 2 < nbytes), other=0).to(tl.int32)
        shift = 12 - (pos & 7).to(tl.int32)
        window = ((((b0 << 16) | (b1 << 8) | b2) >> shift) & 4095).to(tl.int64)
        t = tl.load(table_ptr + window, mask=active, other=0)
        whole = ((t >> 32) & 0xFF) <= length - done  # all of the entry's values are wanted
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
def _bf16(e, s):
    """bfloat16 bits (int32, low 16) of exponent byte `e` and sign+mantissa byte `s`."""
    return ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)


@triton.jit
def huffman_decode_tiles_kernel(
    table_ptr,  # (TABLE_SIZE,) int64: the group's decode table
    tiles_ptr,  # (n_tiles, 3) int64: the tile's first bit in words_ptr (its lane 0's), its
    #             first value's place in out_ptr (a multiple of 4), its values
    lanes_ptr,  # (n_tiles * LANES,) int16: each lane's first bit, from its tile's first bit
    words_ptr,  # int32: the streams, 32 bits at a time, first bit most significant; 2 spare
    sm_ptr,  # uint8, by place in out_ptr, 4-byte aligned: sign and mantissa bytes
    out_ptr,  # int16, 8-byte aligned
    LANES: tl.constexpr,  # lanes a tile (a program)
    SPAN: tl.constexpr,  # values a lane, a multiple of 4
):
    """One tile of LANES * SPAN values a program, lane i decoding the values at places
    at + 4 * (i + LANES * k) + j (k < SPAN / 4, j < 4) in that order."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, LANES)
    first = tl.load(tiles_ptr + 3 * t)
    at = tl.load(tiles_ptr + 3 * t + 1)
    m = tl.load(tiles_ptr + 3 * t + 2).to(tl.int32)  # the tile's values: a prefix of its places
    # lane i's values: its places below m, a prefix of its order
    r = m - 4 * i
    length = (r // (4 * LANES)) * 4 + tl.minimum(r % (4 * LANES), 4)
    length = tl.where(r > 0, tl.minimum(length, SPAN), 0)
    bit = first + tl.load(lanes_ptr + t * LANES + i).to(tl.int64)
    w = bit >> 5
    off = (bit & 31).to(tl.uint64)
    hi = tl.load(words_ptr + w).to(tl.uint32, bitcast=True).to(tl.uint64)
    lo = tl.load(words_ptr + w + 1).to(tl.uint32, bitcast=True).to(tl.uint64)
    buf = ((hi << 32) | lo) << off
    nb = 64 - (bit & 31).to(tl.int32)
    w += 2
    acc = tl.zeros([LANES], dtype=tl.uint64)  # exponents decoded, not yet written: a byte each
    fill = tl.zeros([LANES], dtype=tl.int32)  # how many
    done = tl.zeros([LANES], dtype=tl.int32)
    sm32 = sm_ptr.to(tl.pointer_type(tl.int32))
    out64 = out_ptr.to(tl.pointer_type(tl.int64))
    base = (at >> 2) + i  # lane i's k-th group of four values is word base + LANES * k
    while tl.max(length - done, axis=0) > 0:
        active = done < length
        need = active & (nb <= 32)  # a code is at most 12 bits: one word per step keeps up
        x = tl.load(words_ptr + w, mask=need, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        buf = tl.where(need, buf | (x << (32 - nb).to(tl.uint64)), buf)
        nb = tl.where(need, nb + 32, nb)
        w = tl.where(need, w + 1, w)
        e = tl.load(table_ptr + (buf >> 52).to(tl.int64), mask=active, other=0)
        whole = ((e >> 32) & 0xFF).to(tl.int32) <= length - done
        take = tl.where(active, tl.where(whole, ((e >> 32) & 0xFF).to(tl.int32), 1), 0)
        used = tl.where(active, tl.where(whole, (e >> 40) & 0xFF, (e >> 48) & 0xFF), 0)
        buf = buf << used.to(tl.uint64)
        nb -= used.to(tl.int32)
        # (an entry's bytes past its count are 0; near the lane's end only its first is taken)
        sym = tl.where(whole, e & 0xFFFFFFFF, e & 0xFF).to(tl.uint64)
        acc = acc | (sym << (8 * fill).to(tl.uint64))
        fill += take
        done += take
        full = fill >= 4
        word = base + LANES * ((done - fill) >> 2)
        s4 = tl.load(sm32 + word, mask=full, other=0).to(tl.uint32, bitcast=True)
        e4 = (acc & 0xFFFFFFFF).to(tl.uint32)
        # two values in each 32-bit half: bytes spread to 16-bit slots, then as _bf16
        e01 = (e4 & 0xFF) | ((e4 & 0xFF00) << 8)
        e23 = ((e4 >> 16) & 0xFF) | ((e4 >> 8) & 0xFF0000)
        s01 = (s4 & 0xFF) | ((s4 & 0xFF00) << 8)
        s23 = ((s4 >> 16) & 0xFF) | ((s4 >> 8) & 0xFF0000)
        v01 = ((s01 & 0x00800080) << 8) | (e01 << 7) | (s01 & 0x007F007F)
        v23 = ((s23 & 0x00800080) << 8) | (e23 << 7) | (s23 & 0x007F007F)
        four = v01.to(tl.uint64) | (v23.to(tl.uint64) << 32)
        tl.store(out64 + word, four.to(tl.int64, bitcast=True), mask=full)
        acc = tl.where(full, acc >> 32, acc)
        fill = tl.where(full, fill - 4, fill)
    # the tile's last 1-3 values when they do not make a group of four: in one lane
    place = 4 * (base + LANES * ((done - fill) >> 2))
    for j in tl.static_range(3):
        ok = j < fill
        s = tl.load(sm_ptr + place + j, mask=ok, other=0).to(tl.int32)
        v = _bf16(((acc >> (8 * j)) & 0xFF).to(tl.int32), s)
        tl.store(out_ptr + place + j, v.to(tl.int16), mask=ok)
