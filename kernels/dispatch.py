"""Which implementation runs a hot operation: the Triton kernel (kernels/triton_*.py) for CUDA
tensors, the PyTorch reference (with the C++ CPU kernels where they apply) for CPU tensors.

The model calls only the operations in `kernels` (rms_norm, add_rms_norm, silu_and_mul,
rotate_and_cache, paged_attention); each asks `use_triton` of its input.

`EDGEINFER_KERNELS=triton` in the environment, read at import, sends CPU tensors to the Triton
kernels too: under `TRITON_INTERPRET=1` (also read when a kernel is defined, so both must be set
before `kernels` is imported) that runs the whole model through the kernels on the CPU, which is
how they are tested without a GPU (tests/test_triton_model.py). It is slow, never a way to serve.
"""

from __future__ import annotations

import os

import torch

FORCE_TRITON = os.environ.get("EDGEINFER_KERNELS", "") == "triton"
# the dtypes the C++ CPU kernels take (RMSNorm, RoPE + KV write and its cache, SiLU-and-mul, the
# few-row matmul): float32, and bfloat16 rounded where the references round
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def use_triton(x: torch.Tensor) -> bool:
    """Whether the operation on `x` runs the Triton kernel."""
    return x.is_cuda or FORCE_TRITON
