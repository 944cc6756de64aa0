"""RMSNorm, optionally fused with the residual add before it: a Triton kernel (the CUDA path),
its launch wrapper, and the PyTorch reference.

Numerics are Llama's, as `kernels/norm.py` computes them: the mean of squares and the scaling in
float32, the scaled row cast back to x's dtype BEFORE it is multiplied by the weight (a no-op for
float32), the product rounded to x's dtype. In the fused form the sum s = x + residual is rounded
to x's dtype first, exactly as the model's separate add would round it, and normalised from there.

One program per row. A row of up to MAX_BLOCK values is one tile, held in registers: x (and the
residual) are read once, the output (and s) written once. Longer rows loop over tiles twice:
once for the sum of squares (writing s), once to scale (recomputing s from x and the residual
rather than reading back what the pass before wrote, so no ordering between the two is assumed).

First run on a GPU on 2026-11-26 (an H200, torch 2.11.0+cu130, Triton 3.6.0): the engine built on
the kernels gave `transformers`' greedy tokens (tests/test_gpu.py), and bench.kernels measured add +
RMSNorm at 935 GB/s, 22.2% of the copy bandwidth. Also tested under TRITON_INTERPRET=1 against the
reference and a float64 computation, and compiled for sm_90.
"""

from __future__ import annotations

from typing import overload

import torch
import triton
import triton.language as tl

MAX_BLOCK = 8192  # the longest row kept in registers as one tile (Llama-70B's hidden size)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# The PyTorch reference


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (..., hidden); weight: (hidden,), x's dtype. kernels.norm.rms_norm's PyTorch path,
    without its dispatch (which sends CPU tensors to this very kernel under
    EDGEINFER_KERNELS=triton), so that it stays a reference."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(var + eps)).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (in their dtype); returns (rms_norm_ref(s), s)."""
    s = x + residual
    return rms_norm_ref(s, weight, eps), s


# ---------------------------------------------------------------------------------------------
# The Triton kernel


@triton.jit
def _row_tile(x_row, res_row, sum_row, cols, mask, HAS_RESIDUAL: tl.constexpr,
              STORE_SUM: tl.constexpr):  # fmt: skip
    """One tile of the row to normalise, in float32: x, or x + residual rounded to x's dtype
    (written to sum_row if STORE_SUM)."""
    v = tl.load(x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        s = (v.to(tl.float32) + tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)).to(
            v.dtype
        )
        if STORE_SUM:
            tl.store(sum_row + cols, s, mask=mask)
        v = s
    return v.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (T, hidden), rows x_row_stride apart, the last dim contiguous
    res_ptr,  # (T, hidden), rows res_row_stride apart (unused without HAS_RESIDUAL)
    w_ptr,  # (hidden,) contiguous
    out_ptr,  # (T, hidden) contiguous: the normalised rows
    sum_ptr,  # (T, hidden) contiguous: x + residual (unused without HAS_RESIDUAL)
    x_row_stride,
    res_row_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # a power of two; the whole row if ONE_TILE
    ONE_TILE: tl.constexpr,  # BLOCK >= hidden
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    res_row = res_ptr + row * res_row_stride
    out_row = out_ptr + row * hidden
    sum_row = sum_ptr + row * hidden
    cols = tl.arange(0, BLOCK)
    dtype = out_ptr.dtype.element_ty
    if ONE_TILE:
        mask = cols < hidden
        v = _row_tile(x_row, res_row, sum_row, cols, mask, HAS_RESIDUAL, True)
        rstd = tl.rsqrt(tl.sum(v * v, axis=0) / hidden + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (v * rstd).to(dtype).to(tl.float32) * w
        tl.store(out_row + cols, y.to(dtype), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            mask = start + cols < hidden
            v = _row_tile(x_row + start, res_row + start, sum_row + start, cols, mask,
                          HAS_RESIDUAL, True)  # fmt: skip
            acc += v * v
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / hidden + eps)
        for start in range(0, hidden, BLOCK):
            mask = start + cols < hidden
            v = _row_tile(x_row + start, res_row + start, sum_row + start, cols, mask,
                          HAS_RESIDUAL, False)  # fmt: skip
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = (v * rstd).to(dtype).to(tl.float32) * w
            tl.store(out_row + start + cols, y.to(dtype), mask=mask)


# ---------------------------------------------------------------------------------------------
# The wrapper


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None
) -> torch.Tensor: ...
@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row of x, or of x + residual.

    x: (T, hidden) float32, float16 or bfloat16; rows may be any stride apart (a column slice
    of a wider tensor is fine), the last dim must be contiguous. weight: (hidden,), x's dtype,
    contiguous. residual: None, or (T, hidden) in x's dtype, laid out like x (any row stride,
    last dim contiguous). All on one device.

    residual None: returns rms_norm(x), a new contiguous (T, hidden) tensor in x's dtype.
    residual given: s = x + residual (rounded to x's dtype); returns (rms_norm(s), s), both new
    contiguous (T, hidden) tensors. Neither x nor residual is written: the caller may still
    hold them (the decoder layer passes its own input as the residual). Writing s into
    `residual` would save an allocation, not memory traffic: s is written once either way.

    No host-device synchronisation: safe to capture in a CUDA graph.
    """
    return _rms_norm(x, weight, eps, residual, MAX_BLOCK)


def _rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    max_block: int,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm with rows longer than `max_block` (a power of two) looped over in tiles of that
    size (tests set it low to run the loop on short rows)."""
    _check_inputs(x, weight, residual)
    T, hidden = x.shape
    out = torch.empty((T, hidden), dtype=x.dtype, device=x.device)
    s = None if residual is None else torch.empty_like(out)
    if T == 0 or hidden == 0:
        return out if s is None else (out, s)
    block = min(triton.next_power_of_2(hidden), max_block)
    _rms_norm_kernel[(T,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        out if s is None else s,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        hidden,
        float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        ONE_TILE=block >= hidden,
        num_warps=_num_warps(block),
    )
    return out if s is None else (out, s)


def _num_warps(block: int) -> int:
    """Warps for a row tile of `block` values: 8 values a thread (16 bytes of bfloat16), 1-16."""
    return max(1, min(16, block // 256))


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.ndim != 2:
        raise ValueError(f"rms_norm: x must be 2-D (T, hidden), got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"rms_norm: x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(
            f"rms_norm: x's last dim must be contiguous (stride 1), got strides {x.stride()}"
        )
    hidden = x.shape[1]
    if weight.ndim != 1 or weight.shape[0] != hidden:
        raise ValueError(
            f"rms_norm: weight must be ({hidden},) to match x's hidden size, got shape "
            f"{tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: weight must be x's dtype {x.dtype}, got {weight.dtype}")
    if hidden > 1 and weight.stride(0) != 1:
        raise ValueError(f"rms_norm: weight must be contiguous, got stride {weight.stride(0)}")
    if weight.device != x.device:
        raise ValueError(f"rms_norm: weight is on {weight.device}, x on {x.device}")
    if residual is None:
        return
    if residual.shape != x.shape:
        raise ValueError(
            f"rms_norm: residual must be x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
        )
    if residual.dtype != x.dtype:
        raise ValueError(f"rms_norm: residual must be x's dtype {x.dtype}, got {residual.dtype}")
    if hidden > 1 and residual.stride(1) != 1:
        raise ValueError(
            f"rms_norm: residual's last dim must be contiguous (stride 1), got strides "
            f"{residual.stride()}"
        )
    if residual.device != x.device:
        raise ValueError(f"rms_norm: residual is on {residual.device}, x on {x.device}")
