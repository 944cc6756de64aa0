"""Building blocks shared by the decoder (llama.py) and the mixture-of-experts block (moe.py):
parameters left for the loader to fill, a linear layer and RMSNorm that can take the CPU
kernels, the gated SiLU MLP, and where a checkpoint tensor goes (`WeightTarget`)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist
from torch import nn

from kernels import add_rms_norm, rms_norm, silu_and_mul
from kernels.linear import Packed, small_linear
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
    src_col: int = 0  # first column read of each row (a row-parallel slice: o_proj, down_proj)
    cols: int | None = None  # columns read of each row; None: all of them


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This rank's slice of a tensor-parallel layer: 1 / size of its heads, rows or vocabulary."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # the ranks' group; None: the default one

    def split(self, n: int) -> tuple[int, int]:
        """(first, count) of this rank's share of n, which size divides."""
        return self.rank * (n // self.size), n // self.size


NO_TP = TensorParallel()


class Linear(nn.Module):
    """y = x W^T + b. Row-parallel (`reduce` with tp.size > 1): this rank holds a slice of the
    input features; the partial products are summed over the ranks (one all-reduce) and the bias,
    whole on every rank, added once after."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 reduce: TensorParallel = NO_TP):  # fmt: skip
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self.small_gemm: ModuleType | None = None  # the few-rows kernel, set by use_cpu_kernels
        self.packed: Packed | None = None  # the weight's exact blocks, set by pack_weights
        self.reduce = reduce if reduce.size > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce is None:
            return small_linear(x, self.weight, self.bias, self.small_gemm, self.packed)
        y = small_linear(x, self.weight, None, self.small_gemm, self.packed)
        dist.all_reduce(y, group=self.reduce.group)
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps
        self.fused: ModuleType | None = None  # the C++ kernel, set by use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.fused)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of x + residual, x + residual): one fused kernel on the Triton path."""
        return add_rms_norm(x, residual, self.weight, self.eps, self.fused)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one projection. With tensor
    parallelism, this rank's 1 / tp of the intermediate rows: gate/up column-parallel, down
    row-parallel (one all-reduce)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, intermediate_size: int | None = None,
                 tp: TensorParallel = NO_TP):  # fmt: skip
        super().__init__()
        self.full_inter = intermediate_size or cfg.intermediate_size
        self.first, self.inter = tp.split(self.full_inter)  # this rank's rows of each
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, cfg.mlp_bias, dtype)
        self.down_proj = Linear(self.inter, cfg.hidden_size, cfg.mlp_bias, dtype, reduce=tp)
        self.fused: ModuleType | None = None  # the C++ SiLU-and-mul, set by use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * intermediate)
        return self.down_proj(silu_and_mul(gate_up, self.fused))
