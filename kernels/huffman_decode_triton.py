"""The Triton kernel of kernels/huffman_decode.py (`decode_triton`), apart so that the CPU
decoder's users never import Triton: one lane decodes one chunk of a Huffman-coded bfloat16
tensor through the 4096-entry multi-symbol table, and records the bits it consumed.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def huffman_decode_kernel(
    table_ptr,  # (TABLE_SIZE,) int64
    offsets_ptr,  # (n_chunks + 1,) int32
    sm_ptr,  # (n,) uint8
    bits_ptr,  # (nbytes,) uint8
    out_ptr,  # (n,) int16
    used_ptr,  # (n_chunks,) int64: bits each chunk consumed, for the corruption check
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
    pos = tl.zeros([BLOCK], dtype=tl.int64)
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
        whole = ((t >> 32) & 0xFF) <= length - done
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
