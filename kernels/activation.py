"""The gated MLP's activation: silu(gate) * up over the fused gate/up projection's output."""

from __future__ import annotations

from types import ModuleType

import torch
from torch.nn import functional as F

from kernels.dispatch import CPU_KERNEL_DTYPES, use_triton


def silu_and_mul(x: torch.Tensor, ext: ModuleType | None = None) -> torch.Tensor:
    """x: (T, 2 * I), gate then up -> (T, I) = silu(gate) * up, in x's dtype. `ext`: the CPU
    extension (`kernels.cpu_ext.load_fused()`), one call for float32 or bfloat16 contiguous x
    (bfloat16: rounded where the lines below round, the same bits)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last dim must be even (gate | up), got {x.shape[-1]}")
    if use_triton(x):
        from kernels.triton_silu_mul import silu_and_mul as kernel

        return kernel(x)
    if ext is not None and x.dtype in CPU_KERNEL_DTYPES and x.dim() == 2 and x.is_contiguous():
        return ext.silu_and_mul(x)
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up
