"""The step's keys and values into the paged KV cache, alone (`write_kv`) or fused with the rotary
embedding of q and k (`rotary_write_kv`): Triton kernels (the CUDA path), their launch wrappers,
and their PyTorch references.

The cache layout is kernels/attention.py's, per layer one tensor for keys, one for values:

    cache[num_slots, num_kv_heads, head_dim], num_slots = num_blocks * block_size
          └─ slot = block_id * block_size + offset_in_block

Token t's heads go to row slot_mapping[t]. A negative slot skips the token: the padding rows of
a captured CUDA graph carry slot -1. A slot >= num_slots is skipped as well (the kernel cannot
raise; an out-of-range slot is a bug of the caller's, but it must not write past the cache).
Slots of one step are distinct (the block manager's blocks are); were two equal, which token's
values end up there would be unspecified.

The fused kernel has one grid over (tokens, head blocks): q's blocks of BLOCK_H heads first,
rotated into a new contiguous q, then the KV heads' blocks, each rotating its k heads straight
into the key cache and copying its v heads into the value cache. The rotated k is never
written anywhere else: the Triton attention kernels read keys from the cache only. The
rotation and the launch configuration are kernels/triton_rotary.py's.

First run on a GPU on 2026-11-26 (an H200, torch 2.11.0+cu130, Triton 3.6.0): the engine built on
the kernels gave `transformers`' greedy tokens (tests/test_gpu.py), and bench.kernels measured RoPE
+ KV write at 989 GB/s, 23.5% of the copy bandwidth. Also tested under TRITON_INTERPRET=1 against
the references and a float64 computation, and compiled for sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import write_kv_cache
from kernels.triton_rotary import (
    DTYPES,
    check_rotary_inputs,
    launch_config,
    load_cos_sin,
    rotary_ref,
    rotate_heads,
)

# ---------------------------------------------------------------------------------------------
# The PyTorch references


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """kernels/attention.py's write_kv_cache for the tokens whose slot is >= 0 (that one writes
    every token and refuses a negative slot)."""
    keep = slot_mapping >= 0
    write_kv_cache(k[keep], v[keep], k_cache, v_cache, slot_mapping[keep])


def rotary_write_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k (apply_rotary), write the rotated k and v (write_kv_ref); the rotated q."""
    q_rot, k_rot = rotary_ref(q, k, cos, sin)
    write_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot


# ---------------------------------------------------------------------------------------------
# The Triton kernels and their helpers


@triton.jit
def _cache_row(slot_ptr, t, slot_stride, num_slots, Hkv, HEAD_DIM: tl.constexpr):
    """Token t's row offset in a contiguous cache, and how many of its heads to write: Hkv, or
    0 if its slot is negative (or past the cache)."""
    slot = tl.load(slot_ptr + t * slot_stride).to(tl.int64)
    live = (slot >= 0) & (slot < num_slots)
    return tl.where(live, slot, 0) * Hkv * HEAD_DIM, tl.where(live, Hkv, 0)


@triton.jit
def _copy_heads(
    src_row,
    src_head_stride,
    dst_row,
    head0,
    n_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Copy heads [head0, head0 + BLOCK_H) of one token, those below n_heads (0: none), from
    src_row (heads src_head_stride apart, dims contiguous) to the contiguous dst_row."""
    h = head0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < n_heads)[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(src_row + h[:, None] * src_head_stride + d[None, :], mask=mask)
    tl.store(dst_row + h[:, None] * HEAD_DIM + d[None, :], x, mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr,  # (T, Hkv, HEAD_DIM): tokens k_stride_t apart, heads k_stride_h, dims contiguous
    v_ptr,  # (T, Hkv, HEAD_DIM): likewise
    slot_ptr,  # (T,) int64, slot_stride apart
    k_cache_ptr,  # (num_slots, Hkv, HEAD_DIM) contiguous
    v_cache_ptr,  # (num_slots, Hkv, HEAD_DIM) contiguous
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    slot_stride,
    Hkv,
    num_slots,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program, a power of two
    BLOCK_D: tl.constexpr,  # next_power_of_2(HEAD_DIM)
):
    t = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * BLOCK_H
    row, n_live = _cache_row(slot_ptr, t, slot_stride, num_slots, Hkv, HEAD_DIM)
    _copy_heads(
        k_ptr + t * k_stride_t,
        k_stride_h,
        k_cache_ptr + row,
        head0,
        n_live,
        HEAD_DIM,
        BLOCK_H,
        BLOCK_D,
    )
    _copy_heads(
        v_ptr + t * v_stride_t,
        v_stride_h,
        v_cache_ptr + row,
        head0,
        n_live,
        HEAD_DIM,
        BLOCK_H,
        BLOCK_D,
    )


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr,  # (T, H, HEAD_DIM): tokens q_stride_t apart, heads q_stride_h, dims contiguous
    k_ptr,  # (T, Hkv, HEAD_DIM): likewise
    v_ptr,  # (T, Hkv, HEAD_DIM): likewise
    cos_ptr,  # (T, HEAD_DIM) contiguous
    sin_ptr,  # (T, HEAD_DIM) contiguous
    slot_ptr,  # (T,) int64, slot_stride apart
    q_out_ptr,  # (T, H, HEAD_DIM) contiguous: the rotated q
    k_cache_ptr,  # (num_slots, Hkv, HEAD_DIM) contiguous
    v_cache_ptr,  # (num_slots, Hkv, HEAD_DIM) contiguous
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    slot_stride,
    H,
    Hkv,
    num_slots,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program, a power of two
    BLOCK_HALF: tl.constexpr,  # next_power_of_2(HEAD_DIM // 2)
    BLOCK_D: tl.constexpr,  # next_power_of_2(HEAD_DIM)
):
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    c1, c2, s1, s2 = load_cos_sin(
        cos_ptr + t * HEAD_DIM, sin_ptr + t * HEAD_DIM, HEAD_DIM, BLOCK_HALF
    )
    q_blocks = tl.cdiv(H, BLOCK_H)
    if blk < q_blocks:
        rotate_heads(
            q_ptr + t * q_stride_t,
            q_stride_h,
            q_out_ptr + t * H * HEAD_DIM,
            HEAD_DIM,
            blk * BLOCK_H,
            H,
            c1,
            c2,
            s1,
            s2,
            HEAD_DIM,
            BLOCK_H,
            BLOCK_HALF,
        )
    else:
        head0 = (blk - q_blocks) * BLOCK_H
        row, n_live = _cache_row(slot_ptr, t, slot_stride, num_slots, Hkv, HEAD_DIM)
        rotate_heads(
            k_ptr + t * k_stride_t,
            k_stride_h,
            k_cache_ptr + row,
            HEAD_DIM,
            head0,
            n_live,
            c1,
            c2,
            s1,
            s2,
            HEAD_DIM,
            BLOCK_H,
            BLOCK_HALF,
        )
        _copy_heads(
            v_ptr + t * v_stride_t,
            v_stride_h,
            v_cache_ptr + row,
            head0,
            n_live,
            HEAD_DIM,
            BLOCK_H,
            BLOCK_D,
        )


# ---------------------------------------------------------------------------------------------
# The wrappers


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's keys and values to row slot_mapping[t] of the caches (a negative slot,
    or one >= num_slots: the token is skipped), in one launch.

    k, v: (T, Hkv, D) float32, float16 or bfloat16, one dtype; tokens and heads any stride
    apart, the last dim contiguous. k_cache, v_cache: (num_slots, Hkv, D), contiguous, in k's
    dtype (no conversion: a cache in another dtype is refused). slot_mapping: (T,) int64, any
    stride. All on one device. No host-device synchronisation: safe to capture in a CUDA graph.
    """
    _check_kv_inputs("write_kv", k, v, k_cache, v_cache, slot_mapping)
    T, Hkv, D = k.shape
    if T == 0:
        return
    block_h, _, num_warps = launch_config(Hkv, D)
    _write_kv_kernel[(T, triton.cdiv(Hkv, block_h))](
        k,
        v,
        slot_mapping,
        k_cache,
        v_cache,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        slot_mapping.stride(0),
        Hkv,
        k_cache.shape[0],
        HEAD_DIM=D,
        BLOCK_H=block_h,
        BLOCK_D=triton.next_power_of_2(D),
        num_warps=num_warps,
    )


def rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k (kernels/triton_rotary.py's `rotary`), write the rotated k and v to row
    slot_mapping[t] of the caches (`write_kv`: negative slots skipped), all in one launch;
    returns the rotated q, a new contiguous (T, H, D) tensor in q's dtype.

    q: (T, H, D), k, v: (T, Hkv, D): float32, float16 or bfloat16, one dtype; tokens and heads
    any stride apart (column slices of a fused qkv projection are fine), the last dim
    contiguous; D even. cos, sin: (T, D) contiguous, q's dtype. k_cache, v_cache:
    (num_slots, Hkv, D) contiguous, q's dtype. slot_mapping: (T,) int64. All on one device.
    q, k, v are not written; the rotated k goes to the cache only. No host-device
    synchronisation: safe to capture in a CUDA graph.
    """
    check_rotary_inputs("rotary_write_kv", q, k, cos, sin)
    _check_kv_inputs("rotary_write_kv", k, v, k_cache, v_cache, slot_mapping)
    T, H, D = q.shape
    Hkv = k.shape[1]
    q_out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    block_h, block_half, num_warps = launch_config(Hkv, D)
    grid = (T, triton.cdiv(H, block_h) + triton.cdiv(Hkv, block_h))
    _rotary_write_kv_kernel[grid](
        q,
        k,
        v,
        cos,
        sin,
        slot_mapping,
        q_out,
        k_cache,
        v_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        slot_mapping.stride(0),
        H,
        Hkv,
        k_cache.shape[0],
        HEAD_DIM=D,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_D=triton.next_power_of_2(D),
        num_warps=num_warps,
    )
    return q_out


def _check_kv_inputs(
    fn: str,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """ValueError naming `fn`, the argument and what was expected, for inputs the KV writes
    cannot take."""
    for name, t in (("k", k), ("v", v)):
        if t.ndim != 3:
            raise ValueError(
                f"{fn}: {name} must be 3-D (tokens, kv_heads, head_dim), got {_shape(t)}"
            )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.ndim != 3:
            raise ValueError(
                f"{fn}: {name} must be 3-D (num_slots, kv_heads, head_dim), got {_shape(t)}"
            )
    if slot_mapping.ndim != 1:
        raise ValueError(f"{fn}: slot_mapping must be 1-D (tokens,), got {_shape(slot_mapping)}")
    if k.dtype not in DTYPES:
        raise ValueError(f"{fn}: k must be float32, float16 or bfloat16, got {k.dtype}")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != k.dtype:
            raise ValueError(
                f"{fn}: {name} must be in k's dtype {k.dtype} (no conversion), got {t.dtype}"
            )
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"{fn}: slot_mapping must be int64, got {slot_mapping.dtype}")
    for name, t in (
        ("v", v),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("slot_mapping", slot_mapping),
    ):
        if t.device != k.device:
            raise ValueError(f"{fn}: {name} is on {t.device}, k on {k.device}: one device")
    T, Hkv, D = k.shape
    if v.shape != k.shape:
        raise ValueError(f"{fn}: v must be shaped like k {tuple(k.shape)}, got {_shape(v)}")
    if slot_mapping.shape != (T,):
        raise ValueError(
            f"{fn}: slot_mapping must be ({T},), one slot per token, got {_shape(slot_mapping)}"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape[1:] != (Hkv, D):
            raise ValueError(
                f"{fn}: {name} must be (num_slots, {Hkv}, {D}) (k's kv_heads and "
                f"head_dim), got {_shape(t)}"
            )
        if not t.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous, got strides {t.stride()}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{fn}: v_cache must be shaped like k_cache {tuple(k_cache.shape)}, "
            f"got {_shape(v_cache)}"
        )
    for name, t in (("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(
                f"{fn}: {name}'s last dim must be contiguous, got strides {t.stride()}"
            )


def _shape(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}"
