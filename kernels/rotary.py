"""Rotary position embedding in the Hugging Face (non-interleaved, "rotate half") layout."""

from __future__ import annotations

from types import ModuleType

import torch

from kernels.attention import write_kv_cache
from kernels.dispatch import CPU_KERNEL_DTYPES, use_triton


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, head_dim); cos, sin: (T, head_dim), already in x's dtype. Returns x's shape."""
    if cos.shape != (x.shape[0], x.shape[-1]):
        raise ValueError(
            f"apply_rotary: cos is {tuple(cos.shape)}, expected {(x.shape[0], x.shape[-1])}"
        )
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)  # (T, heads, head_dim)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotate_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    qk: torch.Tensor | None = None,
    ext: ModuleType | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate q and k, and store the rotated k and v at `slot_mapping` in the caches. Returns the
    rotated q, contiguous (T, heads, head_dim), and the rotated k (T, kv_heads, head_dim) for the
    reference attention of a fresh prompt; None on the Triton path, whose attention reads every
    key from the cache. `qk`: q and k side by side as one view (T, heads + kv_heads, head_dim),
    where they are: the reference rotates both in one pass. The Triton kernel does it all in one
    launch (a negative slot skips its token). `ext`: the CPU extension
    (`kernels.cpu_ext.load_fused()`), which does the same in one call where q, k, v, cos and sin
    are all float32 or all bfloat16 and the caches both float32 or both bfloat16 (bfloat16:
    rounded where apply_rotary rounds, the same bits); the reference otherwise."""
    if use_triton(q):
        from kernels.triton_kv_write import rotary_write_kv

        return rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping), None
    if ext is not None and _kernel_takes(q, k, v, cos, sin, k_cache, v_cache):
        q_rot, k_rot = ext.rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        return q_rot, k_rot
    if qk is not None:
        q, k = apply_rotary(qk, cos, sin).split([q.shape[1], k.shape[1]], dim=1)
    else:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q.contiguous(), k


def _kernel_takes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> bool:
    """Whether the CPU extension takes these dtypes: q, k, v, cos and sin all of one of its
    dtypes, the two caches of one (it checks shapes and strides itself, saying what is wrong)."""
    act = q.dtype
    return (
        act in CPU_KERNEL_DTYPES
        and k.dtype == v.dtype == cos.dtype == sin.dtype == act
        and k_cache.dtype in CPU_KERNEL_DTYPES
        and v_cache.dtype == k_cache.dtype
    )
