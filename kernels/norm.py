"""RMSNorm, as Llama computes it: in float32, then cast back to the input dtype before the weight."""

from __future__ import annotations

from types import ModuleType

import torch

from kernels.dispatch import CPU_KERNEL_DTYPES, use_triton


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, ext: ModuleType | None = None
) -> torch.Tensor:
    """x: (..., hidden); weight: (hidden,). Returns the same shape and dtype as x.

    `ext`: the compiled kernel (`kernels.cpu_ext.load_rms_norm()`), used for contiguous x with x
    and weight both float32 or both bfloat16; at decode sizes it is one call of a few
    microseconds where torch runs ~8 ops. In bfloat16 it rounds where the lines below round and
    sums the squares in torch's order: the same bits.
    """
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x has {x.shape[-1]} features, weight has {weight.shape[0]}")
    if use_triton(x):
        from kernels import triton_rms_norm

        out = triton_rms_norm.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps)
        assert isinstance(out, torch.Tensor)
        return out.view(x.shape)
    kernel_dtype = x.dtype == weight.dtype and x.dtype in CPU_KERNEL_DTYPES
    if ext is not None and kernel_dtype and x.is_contiguous():
        return ext.rms_norm(x, weight, eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        var = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(var + eps))
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    ext: ModuleType | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm: s = x + residual; returns (rms_norm(s), s).
    x, residual: (T, hidden), one dtype. The Triton kernel does both in one pass over s; on the
    CPU the add is torch's (one op) and the norm `ext`'s, as in rms_norm."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            f"add_rms_norm: x is {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} "
            f"{residual.dtype}; they must match"
        )
    if use_triton(x):
        from kernels import triton_rms_norm

        return triton_rms_norm.rms_norm(x, weight, eps, residual=residual)  # type: ignore[return-value]
    s = x + residual
    return rms_norm(s, weight, eps, ext), s
