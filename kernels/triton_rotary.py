"""Rotary position embedding of q and k, Hugging Face's "rotate half" layout: a Triton kernel
(the CUDA path), its launch wrapper, and the reference (kernels/rotary.py's apply_rotary).

For a head x of head_dim D, with x1 = x[:D/2], x2 = x[D/2:] and the token's cos, sin rows:

    out[:D/2] = x1 * cos[:D/2] - x2 * sin[:D/2]
    out[D/2:] = x2 * cos[D/2:] + x1 * sin[D/2:]

computed in float32 and rounded once to x's dtype (the reference rounds each product and the
sum in x's dtype: the kernel is as close or closer to the exact result). The tables are used
whole, as the reference uses them, though the model's halves are equal.

The grid is (tokens, head blocks): q's blocks of BLOCK_H heads first, then k's, so q and k are
rotated in one launch. A program loads its token's cos and sin once and rotates a
[BLOCK_H, D/2] tile of first halves with the matching tile of second halves. The helpers
(`load_cos_sin`, `rotate_heads`) are shared with the fused rotary + KV-cache write of
kernels/triton_kv_write.py.

First run on a GPU on 2026-11-26 (an H200, torch 2.11.0+cu130, Triton 3.6.0): the engine built on
the kernels gave `transformers`' greedy tokens (tests/test_gpu.py), and bench.kernels measured it
(through kernels/triton_kv_write.py) at 989 GB/s, 23.5% of the copy bandwidth. Also tested under
TRITON_INTERPRET=1 against the reference and a float64 computation, and compiled for sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rotary import apply_rotary

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE = 1024  # the most elements of a [BLOCK_H, BLOCK_HALF] tile (one half of BLOCK_H heads)


# ---------------------------------------------------------------------------------------------
# The PyTorch reference


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary on q and on k (no dispatch: it stays a reference), as new contiguous
    tensors, as `rotary` returns them."""
    return apply_rotary(q, cos, sin).contiguous(), apply_rotary(k, cos, sin).contiguous()


# ---------------------------------------------------------------------------------------------
# The Triton kernel and its helpers


@triton.jit
def load_cos_sin(cos_row, sin_row, HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One token's tables as float32 [BLOCK_HALF] halves: (cos1, cos2, sin1, sin2)."""
    d = tl.arange(0, BLOCK_HALF)
    half = HEAD_DIM // 2
    m = d < half
    c1 = tl.load(cos_row + d, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + half + d, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + d, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + half + d, mask=m, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def rotate_heads(
    src_row,
    src_head_stride,
    dst_row,
    dst_head_stride,
    head0,
    n_heads,
    c1,
    c2,
    s1,
    s2,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate heads [head0, head0 + BLOCK_H) of one token, those below n_heads (0: none), from
    src_row (the token's first element; heads src_head_stride apart, dims contiguous) to
    dst_row (likewise), in dst's dtype."""
    h = head0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    half = HEAD_DIM // 2
    mask = (h < n_heads)[:, None] & (d < half)[None, :]
    src = src_row + h[:, None] * src_head_stride + d[None, :]  # [BLOCK_H, BLOCK_HALF]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * c1[None, :] - x2 * s1[None, :]
    out2 = x2 * c2[None, :] + x1 * s2[None, :]
    dst = dst_row + h[:, None] * dst_head_stride + d[None, :]
    ty = dst_row.dtype.element_ty
    tl.store(dst, out1.to(ty), mask=mask)
    tl.store(dst + half, out2.to(ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # (T, H, HEAD_DIM): tokens q_stride_t apart, heads q_stride_h, dims contiguous
    k_ptr,  # (T, Hkv, HEAD_DIM): likewise
    cos_ptr,  # (T, HEAD_DIM) contiguous
    sin_ptr,  # (T, HEAD_DIM) contiguous
    q_out_ptr,  # (T, H, HEAD_DIM) contiguous
    k_out_ptr,  # (T, Hkv, HEAD_DIM) contiguous
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    H,
    Hkv,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program, a power of two
    BLOCK_HALF: tl.constexpr,  # next_power_of_2(HEAD_DIM // 2)
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
        rotate_heads(
            k_ptr + t * k_stride_t,
            k_stride_h,
            k_out_ptr + t * Hkv * HEAD_DIM,
            HEAD_DIM,
            (blk - q_blocks) * BLOCK_H,
            Hkv,
            c1,
            c2,
            s1,
            s2,
            HEAD_DIM,
            BLOCK_H,
            BLOCK_HALF,
        )


# ---------------------------------------------------------------------------------------------
# The wrapper


def launch_config(num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_HALF, num_warps) for these shapes, used by every launch here and in
    kernels/triton_kv_write.py: BLOCK_H covers the KV heads (so a GQA model's k and v take one
    block a token, and its q a few), capped so that a tile holds at most TILE elements."""
    block_half = triton.next_power_of_2(max(1, head_dim // 2))
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, TILE // block_half))
    num_warps = max(1, min(4, block_h * block_half // 256))
    return block_h, block_half, num_warps


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by the token's cos and sin (rotate-half layout), both in one launch.

    q: (T, H, D), k: (T, Hkv, D): float32, float16 or bfloat16, one dtype; tokens and heads may
    be any stride apart (column slices of a fused qkv projection are fine), the last dim must be
    contiguous; D even. cos, sin: (T, D), contiguous, in q's dtype, rows already gathered for
    the tokens' positions. All on one device.

    Returns new contiguous (T, H, D) and (T, Hkv, D) tensors in q's dtype; q and k are not
    written. No host-device synchronisation: safe to capture in a CUDA graph.
    """
    check_rotary_inputs("rotary", q, k, cos, sin)
    T, H, D = q.shape
    Hkv = k.shape[1]
    q_out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    k_out = torch.empty((T, Hkv, D), dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    block_h, block_half, num_warps = launch_config(Hkv, D)
    grid = (T, triton.cdiv(H, block_h) + triton.cdiv(Hkv, block_h))
    _rotary_kernel[grid](
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        H,
        Hkv,
        HEAD_DIM=D,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=num_warps,
    )
    return q_out, k_out


def check_rotary_inputs(
    fn: str, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """ValueError naming `fn`, the argument and what was expected, for inputs `rotary` (and the
    fused rotary_write_kv) cannot take."""
    if q.ndim != 3:
        raise ValueError(f"{fn}: q must be 3-D (tokens, heads, head_dim), got {_shape(q)}")
    if k.ndim != 3:
        raise ValueError(f"{fn}: k must be 3-D (tokens, kv_heads, head_dim), got {_shape(k)}")
    if q.dtype not in DTYPES:
        raise ValueError(f"{fn}: q must be float32, float16 or bfloat16, got {q.dtype}")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.dtype != q.dtype:
            raise ValueError(f"{fn}: {name} must be in q's dtype {q.dtype}, got {t.dtype}")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{fn}: {name} is on {t.device}, q on {q.device}: one device")
    T, _, D = q.shape
    if D % 2:
        raise ValueError(f"{fn}: head_dim must be even (rotate-half), got q {_shape(q)}")
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(
            f"{fn}: k must be ({T}, kv_heads, {D}) like q {_shape(q)}, got {_shape(k)}"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (T, D):
            raise ValueError(
                f"{fn}: {name} must be (tokens, head_dim) = ({T}, {D}), got {_shape(t)}"
            )
        if not t.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous, got strides {t.stride()}")
    for name, t in (("q", q), ("k", k)):
        if t.stride(2) != 1:
            raise ValueError(
                f"{fn}: {name}'s last dim must be contiguous, got strides {t.stride()}"
            )


def _shape(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}"
