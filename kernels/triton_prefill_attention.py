"""Causal attention of packed variable-length query chunks over a paged KV cache: a Triton kernel
(flash-attention style), its launch wrapper, and the PyTorch reference.

The step's prefill rows hold the queries of N sequences one after another:

    q[T, H, D]   rows query_start_loc[i] .. query_start_loc[i + 1] - 1 are sequence i's queries;
                 query j of sequence i sits at absolute position context_lens[i] + j

Every key a query attends to, the chunk's own included (already written by the KV write), is
read from the caches through the sequence's block table (kernels/attention.py draws the layout):

    k_cache[num_slots, Hkv, D]   key of sequence i's token p at slot
                                 block_tables[i, p // block_size] * block_size + p % block_size

The query at absolute position p attends keys 0..p. Query head h reads kv head h // (H // Hkv).

One program per (query tile of BLOCK_M rows, sequence, query head): it walks the key tiles of
BLOCK_N keys (a tile may span several cache blocks: each key finds its own block), keeping a
running max and sum (online softmax, in float32) and stops at the tile's causal limit. Key tiles
that every row of the query tile sees whole skip the causal mask; only the last few, along the
diagonal, are masked. Query tiles past a sequence's length exit at once, so the grid comes from
the host's `max_query_len` alone and the wrapper never reads a tensor's values (no sync: the
call can be captured in a CUDA graph).

First run on a GPU on 2026-11-26 (an H200, torch 2.11.0+cu130, Triton 3.6.0): the engine built on
the kernels gave `transformers`' greedy tokens (tests/test_gpu.py), and bench.kernels measured 94
TFLOP/s, 13.3% of the bfloat16 matmul rate, at 2048 causal tokens. Also tested under
TRITON_INTERPRET=1 against the reference and a float64 computation, and compiled for sm_90. The tile
sizes and warp counts in `_config` are untuned guesses.
"""

from __future__ import annotations

from typing import NoReturn

import torch
import triton
import triton.language as tl

from kernels.attention import TRITON_MAX_HEAD_DIM as MAX_HEAD_DIM

LOG2E = 1.4426950408889634  # the kernel works in base 2: exp(x) = exp2(x * log2(e))
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# The PyTorch reference


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_size: int,
    max_query_len: int,
) -> torch.Tensor:
    """prefill_attention in plain torch, sequence by sequence: gather the sequence's keys and
    values by slot, masked softmax in float32. Same arguments, checks and result; it reads the
    index tensors on the host (a sync), so it is for tests, not for the engine."""
    _check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                  block_size, max_query_len)  # fmt: skip
    T, H, D = q.shape
    group = H // k_cache.shape[1]
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        s, n = starts[i], starts[i + 1] - starts[i]
        if n == 0:
            continue
        pos = torch.arange(ctx + n, device=q.device)  # every key the chunk attends to
        slots = block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
        v = v_cache[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
        qi = q[s : s + n].float().transpose(0, 1)  # (H, n, D)
        scores = qi @ k.transpose(1, 2) * scale  # (H, n, L)
        visible = pos[None, :] <= ctx + torch.arange(n, device=q.device)[:, None]  # (n, L)
        scores = scores.masked_fill(~visible, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ v  # (H, n, D)
        out[s : s + n] = o.transpose(0, 1).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# The Triton kernel


@triton.jit
def _attend_key_tile(
    acc,
    m_i,
    l_i,
    q,  # (BLOCK_M, BLOCK_D) in the input dtype
    q_pos,  # (BLOCK_M,) absolute position of each query row
    start,  # first key of the tile
    kv_end,  # keys past this are never read (the query tile's causal limit)
    bt_row,  # the sequence's block table row
    k_head_ptr,  # k_cache at the kv head
    v_head_ptr,
    stride_kt,
    stride_vt,
    qk_scale,  # softmax scale * log2(e)
    offs_n,
    offs_d,
    d_ok,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,  # mask by position (the tiles along the diagonal)
    DOT_PRECISION: tl.constexpr,
):
    keys = start + offs_n  # (BLOCK_N,) key positions
    if CAUSAL:
        kv_ok = keys < kv_end
        block = tl.load(bt_row + keys // BLOCK_SIZE, mask=kv_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        k_mask = d_ok[:, None] & kv_ok[None, :]
        v_mask = kv_ok[:, None] & d_ok[None, :]
    else:
        block = tl.load(bt_row + keys // BLOCK_SIZE)
        slot = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        k_mask = d_ok[:, None]
        v_mask = d_ok[None, :]
    kt = tl.load(k_head_ptr + slot[None, :] * stride_kt + offs_d[:, None], mask=k_mask, other=0.0)
    s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N) float32
    if CAUSAL:
        visible = (keys[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
    # Every row has seen key 0 (visible to all) in the first tile, so m_new is finite from then on
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_head_ptr + slot[:, None] * stride_vt + offs_d[None, :], mask=v_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_attention_kernel(
    q_ptr,  # (T, H, D), last dim contiguous
    k_cache_ptr,  # (num_slots, Hkv, D), last dim contiguous
    v_cache_ptr,
    out_ptr,  # (T, H, D)
    block_tables_ptr,  # (N, max_blocks) int32, last dim contiguous
    query_start_loc_ptr,  # (N + 1,) int32
    context_lens_ptr,  # (N,) int32
    qk_scale,  # float32: softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block, a power of two
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per step
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16 (tl.dot's minimum)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32), "tf32" (ignored) for 16-bit
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    kv_head = head // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)  # fmt: skip
    q_pos = ctx + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head_ptr = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head_ptr = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    # Keys 0..ctx + m0 are visible to every row of the tile: whole key tiles below that need no
    # mask. The rest, up to the last row's position, lie along the diagonal.
    kv_whole = (ctx + m0 + 1) // BLOCK_N * BLOCK_N
    kv_end = ctx + tl.minimum(m0 + BLOCK_M, q_len)
    for start in range(0, kv_whole, BLOCK_N):
        acc, m_i, l_i = _attend_key_tile(
            acc, m_i, l_i, q, q_pos, start, kv_end, bt_row, k_head_ptr, v_head_ptr,
            stride_kt, stride_vt, qk_scale, offs_n, offs_d, d_ok,
            BLOCK_SIZE, False, DOT_PRECISION,
        )  # fmt: skip
    for start in range(kv_whole, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_key_tile(
            acc, m_i, l_i, q, q_pos, start, kv_end, bt_row, k_head_ptr, v_head_ptr,
            stride_kt, stride_vt, qk_scale, offs_n, offs_d, d_ok,
            BLOCK_SIZE, True, DOT_PRECISION,
        )  # fmt: skip

    o = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=q_mask)  # fmt: skip


def _config(head_dim: int, dtype: torch.dtype) -> dict[str, int | str]:
    """The launch's tile sizes (constexprs) and warps for a head size and dtype (untuned)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    wide = block_d > 128 or (dtype == torch.float32 and block_d > 64)
    return {
        "BLOCK_M": 64,
        "BLOCK_N": 32 if wide else 64,
        "BLOCK_D": block_d,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "num_warps": 8 if block_d > 64 else 4,
        "num_stages": 2 if wide else 3,
    }


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_size: int,
    max_query_len: int,
) -> torch.Tensor:
    """Causal attention of N packed query chunks over their paged keys; returns (T, H, D) in
    q's dtype, contiguous.

    q: (T, H, D) float32/float16/bfloat16, any token and head strides, last dim contiguous;
        sequence i's queries are rows query_start_loc[i] .. query_start_loc[i + 1] - 1, query j
        at absolute position context_lens[i] + j. D <= 256.
    k_cache, v_cache: (num_slots, Hkv, D) in q's dtype, last dim contiguous, num_slots a
        multiple of block_size; H % Hkv == 0 (query head h reads kv head h // (H // Hkv)).
        Sequence i's keys 0 .. context_lens[i] + q_len_i - 1, the chunk's own included, must
        already be in the caches.
    block_tables: (N, max_blocks) int32, last dim contiguous: sequence i's token p is at slot
        block_tables[i, p // block_size] * block_size + p % block_size.
    query_start_loc: (N + 1,) int32, contiguous, non-decreasing, [0] == 0, [N] == T.
    context_lens: (N,) int32, contiguous: tokens of sequence i cached before this chunk.
    scale: the softmax scale (usually D ** -0.5).
    block_size: tokens per cache block, a power of two.
    max_query_len: a host int >= every sequence's q_len (the grid's query-tile count).

    The query at absolute position p attends keys 0..p. All tensors on one device. The values
    of the index tensors are not checked (that would need a device sync): they are the caller's
    contract, as is max_blocks * block_size covering every sequence's keys.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                  block_size, max_query_len)  # fmt: skip
    T, H, D = q.shape
    N = block_tables.shape[0]
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if T == 0 or N == 0 or max_query_len == 0:
        return out
    cfg = _config(D, q.dtype)
    grid = (triton.cdiv(max_query_len, int(cfg["BLOCK_M"])), N, H)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, context_lens,
        float(scale) * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=H // k_cache.shape[1], HEAD_DIM=D, BLOCK_SIZE=block_size, **cfg,
    )  # fmt: skip
    return out


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    max_query_len: int,
) -> None:
    """ValueError naming the argument and what was expected; reads no tensor values."""

    def fail(msg: str) -> NoReturn:
        raise ValueError(f"prefill_attention: {msg}")

    if q.ndim != 3:
        fail(f"q must be 3-D (tokens, heads, head_dim), got shape {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        fail(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    _, H, D = q.shape
    if not 1 <= D <= MAX_HEAD_DIM:
        fail(f"q's head_dim must be 1..{MAX_HEAD_DIM}, got {D}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.ndim != 3:
            fail(f"{name} must be 3-D (slots, kv_heads, head_dim), got shape {tuple(c.shape)}")
        if c.dtype != q.dtype:
            fail(f"{name} must have q's dtype {q.dtype}, got {c.dtype}")
        if c.shape[2] != D:
            fail(f"{name}'s head_dim must be q's ({D}), got shape {tuple(c.shape)}")
    if v_cache.shape != k_cache.shape:
        fail(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got "
             f"{tuple(v_cache.shape)}")  # fmt: skip
    Hkv = k_cache.shape[1]
    if Hkv == 0 or H % Hkv:
        fail(f"q's {H} heads must be a multiple of k_cache's {Hkv} kv heads")
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 1
        or (block_size & (block_size - 1))
    ):
        fail(f"block_size must be a power of two, got {block_size!r}")
    if k_cache.shape[0] % block_size:
        fail(f"k_cache's {k_cache.shape[0]} slots must be a multiple of block_size {block_size}")
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0:
        fail(f"max_query_len must be a non-negative int, got {max_query_len!r}")
    if block_tables.ndim != 2:
        fail(f"block_tables must be 2-D (sequences, max_blocks), got shape "
             f"{tuple(block_tables.shape)}")  # fmt: skip
    N = block_tables.shape[0]
    if query_start_loc.shape != (N + 1,):
        fail(f"query_start_loc must be ({N + 1},) (one more than block_tables' {N} rows), got "
             f"shape {tuple(query_start_loc.shape)}")  # fmt: skip
    if context_lens.shape != (N,):
        fail(f"context_lens must be ({N},) (one per block_tables row), got shape "
             f"{tuple(context_lens.shape)}")  # fmt: skip
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("context_lens", context_lens)):  # fmt: skip
        if t.dtype != torch.int32:
            fail(f"{name} must be int32, got {t.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("context_lens", context_lens)):  # fmt: skip
        if t.device != q.device:
            fail(f"{name} must be on q's device {q.device}, got {t.device}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            fail(f"{name}'s last dim must be contiguous (stride 1), got strides {t.stride()}")
