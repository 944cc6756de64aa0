"""Rotary position embedding in the Hugging Face (non-interleaved, "rotate half") layout."""

from __future__ import annotations

import torch


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
