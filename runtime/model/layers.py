"""Building blocks shared by the decoder (llama.py) and the mixture-of-experts block (moe.py):
parameters left for the loader to fill, a linear layer and RMSNorm that can take the CPU
kernels, the gated SiLU MLP, and where a checkpoint tensor goes (`WeightTarget`)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from kernels import rms_norm
from kernels.linear import small_linear
from runtime.config import ModelConfig


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialized: every weight is overwritten by the loader (which checks none is missing).
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


@dataclass(frozen=True, slots=True)
class WeightTarget:
    """Where one checkpoint tensor goes. Rows are counted along the first dimension of the
    parameter (and of the checkpoint tensor) seen as 2-D, (-1, last dim); of a 1-D one, they are
    its elements. So a (E, 2 * inter, hidden) stack of experts has E * 2 * inter rows, and one
    expert's (inter, hidden) gate projection fills `inter` of them."""

    param: str  # our parameter's name; may be one the model lacks (the loader says so)
    row: int = 0  # first row of the parameter it fills
    rows: int | None = None  # rows it fills; None: the whole parameter, from the whole tensor
    src_row: int = 0  # first row of the checkpoint tensor that is read
    shape: tuple[int, ...] | None = None  # the tensor's expected shape, when only part is read


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self.small_gemm: ModuleType | None = None  # the few-rows kernel, set by use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_linear(x, self.weight, self.bias, self.small_gemm)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps
        self.fused: ModuleType | None = None  # the C++ kernel, set by use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.fused)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one projection."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, intermediate_size: int | None = None):
        super().__init__()
        self.inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, cfg.mlp_bias, dtype)
        self.down_proj = Linear(self.inter, cfg.hidden_size, cfg.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * intermediate)
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)
