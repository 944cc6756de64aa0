"""SiLU-and-multiply, the gated MLP's activation: a Triton kernel (the CUDA path), its launch
wrapper, and the PyTorch reference.

x is the fused gate/up projection's output, (T, 2 * I): gate = x[:, :I], up = x[:, I:]; the
result is (T, I) = silu(gate) * up. silu is computed in float32 and rounded to x's dtype before
the product, which is computed in float32 and rounded again: the two roundings of torch's
F.silu(gate) * up (a no-op for float32), so the CUDA path gives the CPU path's values.

A program per (row, tile of BLOCK columns): elementwise, each value read and written once.

First run on a GPU on 2026-11-26 (an H200, torch 2.11.0+cu130, Triton 3.6.0): the engine built on
the kernels gave `transformers`' greedy tokens (tests/test_gpu.py), and bench.kernels measured 1,839
GB/s, 43.8% of the copy bandwidth. Also tested under TRITON_INTERPRET=1 against the reference and a
float64 computation, and compiled for sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

MAX_BLOCK = 1024  # columns per program
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: (..., 2 * I) -> (..., I) = silu(gate) * up, in x's dtype. kernels.activation's PyTorch
    path, without its dispatch (which sends CPU tensors to this very kernel under
    EDGEINFER_KERNELS=triton), so that it stays a reference."""
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # (T, 2 * inter), rows x_row_stride apart, the last dim contiguous
    out_ptr,  # (T, inter) contiguous
    x_row_stride,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    x_row = x_ptr + row * x_row_stride
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # exp overflow: -0.0, right
    tl.store(out_ptr + row * inter + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: (T, 2 * I) float32, float16 or bfloat16, gate then up; rows may be any stride apart
    (a column slice of a wider tensor is fine), the last dim must be contiguous. Returns a new
    contiguous (T, I) tensor in x's dtype: silu(gate) * up.

    No host-device synchronisation: safe to capture in a CUDA graph.
    """
    return _silu_and_mul(x, MAX_BLOCK)


def _silu_and_mul(x: torch.Tensor, max_block: int) -> torch.Tensor:
    """silu_and_mul with at most `max_block` (a power of two) columns per program (tests set it
    low to run several column tiles on short rows)."""
    if x.ndim != 2:
        raise ValueError(f"silu_and_mul: x must be 2-D (T, 2 * I), got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"silu_and_mul: x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.shape[1] % 2:
        raise ValueError(
            f"silu_and_mul: x's last dim must be even (gate | up), got shape {tuple(x.shape)}"
        )
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(
            f"silu_and_mul: x's last dim must be contiguous (stride 1), got strides {x.stride()}"
        )
    T, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    if T == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), max_block)
    grid = (T, triton.cdiv(inter, block))  # rows on axis 0: up to 2^31 - 1 programs there
    if grid[1] > 65535:
        raise ValueError(f"silu_and_mul: I = {inter} is over {65535 * block} columns")
    _silu_and_mul_kernel[grid](x, out, x.stride(0), inter, BLOCK=block, num_warps=_num_warps(block))
    return out


def _num_warps(block: int) -> int:
    """Warps for a tile of `block` columns: 8 values a thread (16 bytes of bfloat16), 1-4."""
    return max(1, min(4, block // 256))
