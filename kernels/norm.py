"""RMSNorm, as Llama computes it: in float32, then cast back to the input dtype before the weight."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (..., hidden); weight: (hidden,). Returns the same shape and dtype as x."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x has {x.shape[-1]} features, weight has {weight.shape[0]}")
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # torch's fused kernel: the same formula in one pass (float32 rounding differences only)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)
