"""`y = x @ w.T + b`, with a CPU kernel for the few-row case that decoding is.

At decode time a linear layer multiplies a few rows (one per running request) by a large weight
matrix: the work is reading the weights once from memory. On the 2-core development machine,
over SmolLM2's weight shapes, torch's CPU matmul takes 34 ms for one row (15 GB/s) and 62-66 ms
for 2-8 rows; the kernel in `csrc/small_gemm_cpu.cpp` streams each weight row once for all rows
of x: 17.5 ms for one row (31 GB/s, the machine's memory bandwidth), 1.9-2.8x torch up to 8
rows, 1.44x at 16, 1.12x at 32, 1.04x at 48 (measured 2026-11-22). Sums run in a different order
than torch's, so results differ by float32 rounding only.

`small_linear(x, w, b, ext)`: `ext` is the compiled module (`kernels.cpu_ext.load_small_gemm()`)
or None; the reference (`torch.nn.functional.linear`) runs whenever the kernel does not apply.
"""

from __future__ import annotations

from types import ModuleType

import torch

MAX_ROWS = 48  # the kernel's limit; above it torch's blocked GEMM is as fast


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the small-matmul kernel takes this product."""
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and x.device.type == "cpu"
        and w.is_contiguous()
    )


def small_linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, ext: ModuleType | None = None
) -> torch.Tensor:
    """x: (M, K), w: (N, K), b: (N,) or None -> (M, N).

    Give `ext` only for float32, contiguous CPU weights (`applies` says which; the model checks
    once when it turns the kernel on), so the per-call test is the cheap one on x.
    """
    if ext is not None and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == torch.float32:
        return ext.small_linear(x, w, b)
    return torch.nn.functional.linear(x, w, b)
