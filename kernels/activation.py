"""The gated MLP's activation: silu(gate) * up over the fused gate/up projection's output."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kernels.dispatch import use_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: (T, 2 * I), gate then up -> (T, I) = silu(gate) * up, in x's dtype."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last dim must be even (gate | up), got {x.shape[-1]}")
    if use_triton(x):
        from kernels.triton_silu_mul import silu_and_mul as kernel

        return kernel(x)
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up
