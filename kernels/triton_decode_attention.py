"""Paged decode attention: one query token per sequence over its keys in the paged KV cache.
The Triton kernels (split-K with a reduction pass) and the PyTorch reference beside them.

Cache layout (kernels/attention.py), per layer one key and one value tensor:

    cache[num_blocks * block_size, num_kv_heads, head_dim]      contiguous
          └─ slot = block_id * block_size + offset_in_block

Key j of sequence b is at slot `block_tables[b, j // block_size] * block_size + j % block_size`.

The work, for B sequences, H query heads over Hkv key/value heads (GQA group G = H // Hkv):

    pass 1  grid (B, Hkv, S)   one program per (sequence, KV head, split): the group's G query
                               heads (padded to BLOCK_H >= 16 rows for tl.dot) against the keys
                               of its split, BLOCK_N keys a tile, online softmax in float32.
                               Writes the split's running max, sum of exp and unnormalised
                               weighted values to scratch; a split wholly past the sequence's
                               length writes (-inf, 0, 0), the neutral partial.
    pass 2  grid (B, H)        merges the S partials of one head into the output.

The key range max_blocks * block_size (from shapes) is cut into S splits of whole tiles, so the
grid never depends on seq_lens values and the call can be captured in a CUDA graph. With S = 1,
pass 1 normalises and writes the output itself and pass 2 is skipped.

Scores are kept in log2 units (q.k * scale * log2(e)) so that the kernels use exp2.

First run on a GPU on 2026-11-26 (an H200, torch 2.11.0+cu130, Triton 3.6.0): the engine built on
the kernels gave `transformers`' greedy tokens (tests/test_gpu.py), and bench.kernels measured 2,553
GB/s, 60.8% of the copy bandwidth, at batch 32 and context 4096. Also tested under
TRITON_INTERPRET=1 against the reference and a float64 computation
(tests/test_triton_decode_attention.py) and compiled for sm_90.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.attention import TRITON_MAX_HEAD_DIM as _MAX_HEAD_DIM

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_DEFAULT_SPLITS = 64
_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# The PyTorch reference: per sequence, gather its keys and values by slot, plain softmax


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """decode_attention computed plainly: for each sequence, its seq_len keys and values
    gathered by slot, softmax(scale * q.k) in float32, the weighted sum of values in float32,
    cast to q's dtype. A sequence of length 0 gives zeros. Same arguments and checks as
    decode_attention (reads seq_lens on the host: a test and CPU tool, not for a CUDA graph)."""
    B, H, D = _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, block_size, None)
    Hkv = k_cache.shape[1]
    out = torch.zeros(B, H, D, dtype=torch.float32, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        if n <= 0:
            continue
        j = torch.arange(n, device=q.device)
        slots = block_tables[b, j // block_size].long() * block_size + j % block_size  # (n,)
        k = k_cache[slots].float().repeat_interleave(H // Hkv, dim=1)  # (n, H, D)
        v = v_cache[slots].float().repeat_interleave(H // Hkv, dim=1)  # (n, H, D)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale  # (H, n)
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)  # (H, D)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------------
# The Triton kernels


@triton.jit
def _decode_split_kernel(
    q_ptr,  # (B, H, D), last dim contiguous
    k_ptr,  # (num_slots, Hkv, D) contiguous
    v_ptr,  # (num_slots, Hkv, D) contiguous
    bt_ptr,  # (B, max_blocks) int32 contiguous
    lens_ptr,  # (B,) int32
    out_ptr,  # (B, H, D) in q's dtype: written when DIRECT
    part_o_ptr,  # (B, H, S, D) float32: unnormalised weighted values, when not DIRECT
    part_m_ptr,  # (B, H, S) float32: running max of the scores (log2 units)
    part_l_ptr,  # (B, H, S) float32: sum of exp2(score - max)
    qk_scale,  # scale * log2(e)
    stride_qb,
    stride_qh,
    max_blocks,  # block_tables' row length
    keys_per_split,  # a multiple of BLOCK_N
    H,
    Hkv,
    head_dim,
    num_splits,
    GROUP: tl.constexpr,  # H // Hkv
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= 16
    BLOCK_N: tl.constexpr,  # keys per tile, a power of two >= 16
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two >= 16
    DIRECT: tl.constexpr,  # one split: normalise and write the output here
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < GROUP
    d_ok = offs_d < head_dim
    heads = kvh * GROUP + offs_h  # (BLOCK_H,) query heads of this KV head

    q_mask = h_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0
    )  # (BLOCK_H, BLOCK_D)

    # A length past the table's keys is clamped (no read past the row); 0 or less: no keys.
    seq_len = tl.minimum(tl.load(lens_ptr + b), max_blocks * BLOCK_SIZE)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, seq_len)
    stride_slot = Hkv * head_dim
    bt_row = bt_ptr + b.to(tl.int64) * max_blocks

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):  # every tile holds at least one key < seq_len
        pos = start + offs_n  # (BLOCK_N,) key positions in the sequence
        n_ok = pos < hi
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_ok, other=0)  # table read only < len
        slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = slot[:, None] * stride_slot + kvh * head_dim + offs_d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # (BLOCK_H, BLOCK_N)
        qk = tl.where(n_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # finite: the tile's first key is real
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    rows = b * H + heads  # (BLOCK_H,) row of (B * H)
    if DIRECT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no keys: acc is 0, so 0
        tl.store(
            out_ptr + rows[:, None] * head_dim + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )
    else:
        part = rows * num_splits + split  # (BLOCK_H,) row of (B * H * S)
        tl.store(part_m_ptr + part, m_i, mask=h_ok)
        tl.store(part_l_ptr + part, l_i, mask=h_ok)
        tl.store(part_o_ptr + part[:, None] * head_dim + offs_d[None, :], acc, mask=q_mask)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr,  # (B, H, S, D) float32
    part_m_ptr,  # (B, H, S) float32
    part_l_ptr,  # (B, H, S) float32
    out_ptr,  # (B, H, D) in q's dtype
    H,
    head_dim,
    num_splits,
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of two
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two
):
    row = tl.program_id(0) * H + tl.program_id(1)  # b * H + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < head_dim
    part = row * num_splits + offs_s  # (BLOCK_S,)
    m = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_ref = tl.where(m_max > float("-inf"), m_max, 0.0)  # all splits empty: no -inf - -inf
    w = tl.where(m > float("-inf"), tl.exp2(m - m_ref), 0.0)  # (BLOCK_S,)
    total = tl.sum(w * l_s, axis=0)
    o = tl.load(
        part_o_ptr + part[:, None] * head_dim + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (BLOCK_S, BLOCK_D)
    acc = tl.sum(w[:, None] * o, axis=0)  # (BLOCK_D,)
    acc = acc / tl.where(total > 0, total, 1.0)  # no keys at all: acc is 0, so 0
    tl.store(out_ptr + row * head_dim + offs_d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


# ---------------------------------------------------------------------------------------------
# The wrapper


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_size: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its keys in the paged KV cache.

    q:            (B, H, D) float32, float16 or bfloat16; any row strides, last dim contiguous.
    k_cache,
    v_cache:      (num_slots, Hkv, D) contiguous, q's dtype; num_slots = num_blocks *
                  block_size, slot = block_id * block_size + offset (kernels/attention.py).
    block_tables: (B, max_blocks) int32 contiguous: sequence b's blocks in order; entries past
                  its ceil(seq_len / block_size) blocks are never read.
    seq_lens:     (B,) int32 contiguous: keys sequence b attends to (its new token included,
                  already in the cache), at most max_blocks * block_size (longer is clamped);
                  0 (a padding row) gives zeros.
    scale:        multiplies q.k before the softmax.
    block_size:   tokens per cache block, a power of two (any: EngineConfig takes any, and
                  only `pos // BLOCK_SIZE` depends on it, no tile shape).
    num_splits:   parts the key range max_blocks * block_size is cut into (split-K), each of
                  whole tiles of up to 64 keys (32 for head_dim > 128), so at most one per tile
                  (a larger value is lowered: the answer is the same). Default, from shapes only:
                  enough programs (B * Hkv * splits) for two per SM, at most 64 splits.

    H must be a multiple of Hkv (query head h reads KV head h // (H // Hkv)); D at most 256.
    Returns a new (B, H, D) contiguous tensor in q's dtype; accumulation is in float32.
    Inputs are checked before launch (ValueError naming the argument); no host-device sync,
    so the call can be captured in a CUDA graph.
    """
    B, H, D = _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, block_size, num_splits)
    Hkv = k_cache.shape[1]
    group = H // Hkv
    max_keys = block_tables.shape[1] * block_size
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    if max_keys == 0:  # no key can be attended to: every seq_len is 0
        return out.zero_()
    block_d = max(16, triton.next_power_of_2(D))
    block_n = min(64 if block_d <= 128 else 32, max(16, triton.next_power_of_2(max_keys)))
    num_tiles = triton.cdiv(max_keys, block_n)
    if num_splits is None:
        programs = B * Hkv
        num_splits = min(triton.cdiv(2 * _sm_count(q.device), programs), _MAX_DEFAULT_SPLITS)
    num_splits = min(num_splits, num_tiles)  # more would only be empty
    keys_per_split = triton.cdiv(num_tiles, num_splits) * block_n
    direct = num_splits == 1
    if direct:
        part_o = part_m = part_l = out  # unused
    else:
        part_o = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
        part_m = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(B, Hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_o,
        part_m,
        part_l,
        float(scale) * _LOG2E,
        q.stride(0),
        q.stride(1),
        block_tables.shape[1],
        keys_per_split,
        H,
        Hkv,
        D,
        num_splits,
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DIRECT=direct,
        num_warps=4,
    )
    if not direct:
        block_s = triton.next_power_of_2(num_splits)
        _decode_reduce_kernel[(B, H)](
            part_o,
            part_m,
            part_l,
            out,
            H,
            D,
            num_splits,
            BLOCK_S=block_s,
            BLOCK_D=block_d,
            num_warps=max(1, min(4, block_s * block_d // 512)),
        )
    return out


@functools.lru_cache(maxsize=16)
def _sm_count_cuda(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a host query, cached); an H100's 132 for a
    CPU tensor (the interpreter)."""
    if device.type != "cuda":
        return 132
    return _sm_count_cuda(device.index if device.index is not None else torch.cuda.current_device())


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    num_splits: int | None,
) -> tuple[int, int, int]:
    """(B, H, D) if the arguments are as decode_attention's docstring says; ValueError naming
    the first that is not. Reads shapes, dtypes, strides and devices only."""

    def bad(what: str) -> ValueError:
        return ValueError(f"decode_attention: {what}")

    if q.ndim != 3:
        raise bad(f"q must be 3-D (batch, heads, head_dim), got shape {tuple(q.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.ndim != 3:
            raise bad(
                f"{name} must be 3-D (num_slots, kv_heads, head_dim), got shape {tuple(c.shape)}"
            )
    if block_tables.ndim != 2:
        raise bad(
            f"block_tables must be 2-D (batch, max_blocks), got shape {tuple(block_tables.shape)}"
        )
    if seq_lens.ndim != 1:
        raise bad(f"seq_lens must be 1-D (batch,), got shape {tuple(seq_lens.shape)}")
    B, H, D = q.shape
    num_slots, Hkv, Dk = k_cache.shape
    if q.dtype not in _DTYPES:
        raise bad(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dtype != q.dtype:
            raise bad(f"{name} must have q's dtype {q.dtype}, got {c.dtype}")
    if block_tables.dtype != torch.int32:
        raise bad(f"block_tables must be int32, got {block_tables.dtype}")
    if seq_lens.dtype != torch.int32:
        raise bad(f"seq_lens must be int32, got {seq_lens.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens)):  # fmt: skip
        if t.device != q.device:
            raise bad(f"{name} is on {t.device}, q on {q.device}: all must be on one device")
    if v_cache.shape != k_cache.shape:
        raise bad(
            f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}"
        )
    if Dk != D:
        raise bad(f"k_cache head_dim {Dk} must equal q's head_dim {D}")
    if not 1 <= D <= _MAX_HEAD_DIM:
        raise bad(f"q head_dim must be 1..{_MAX_HEAD_DIM}, got {D}")
    if Hkv < 1 or H % Hkv:
        raise bad(f"q's {H} heads must be a multiple of k_cache's {Hkv} kv heads")
    if block_tables.shape[0] != B:
        raise bad(f"block_tables must have {B} rows (q's batch), got {block_tables.shape[0]}")
    if seq_lens.shape[0] != B:
        raise bad(f"seq_lens must have {B} entries (q's batch), got {seq_lens.shape[0]}")
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 1
        or block_size & (block_size - 1)
    ):
        raise bad(f"block_size must be a power of two, got {block_size!r}")
    if num_slots % block_size:
        raise bad(f"k_cache's {num_slots} slots must be a multiple of block_size {block_size}")
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1
    ):
        raise bad(f"num_splits must be a positive int or None, got {num_splits!r}")
    if q.stride(2) != 1:
        raise bad(f"q's last dim must be contiguous (stride 1), got strides {q.stride()}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens)):  # fmt: skip
        if not t.is_contiguous():
            raise bad(f"{name} must be contiguous, got strides {t.stride()}")
    return B, H, D
