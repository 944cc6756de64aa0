"""`y = x @ w.T + b`, with a CPU kernel for the few-row case that decoding is, and for weights
stored in bfloat16 under float32 activations.

At decode time a linear layer multiplies a few rows (one per running request) by a large weight
matrix: the work is reading the weights once from memory. On the 2-core development machine,
over SmolLM2's weight shapes, torch's CPU matmul takes 34 ms for one row (15 GB/s) and 62-66 ms
for 2-8 rows; the kernel in `csrc/small_gemm_cpu.cpp` streams each weight row once for all rows
of x: 17.5 ms for one row (31 GB/s, the machine's memory bandwidth), 1.9-2.8x torch up to 8
rows, 1.44x at 16, 1.12x at 32, 1.04x at 48 (measured 2026-11-22). Sums run in a different order
than torch's, so results differ by float32 rounding only. On the 2-core Xeon (2026-11-23, ms per
pass over the same shapes, kernel against torch): 16.4/15.7 at 1 row, 22.1/34.2 at 8, 30.3/38.2
at 16, 57.8/69.8 at 64, 114.8/112.3 at 128.

Weights stored in bfloat16 (`--weight-dtype bfloat16`) halve those bytes: the kernel widens them
to float32 in registers (exact), so the products and sums are float32's: 7.9 ms for one row,
12.7 at 8, 53.8 at 64, 234 at 256, 503 at 512 (torch's float32 GEMM: 15.7, 34.2, 69.8, 248, 483;
2026-11-23, 2-core Xeon). Where the kernel does not take the product (more than MAX_ROWS_BF16
rows, cpu_kernels="torch", no compiler) the reference widens the weight and calls torch: the
same values, a float32 copy of the weight per call.

Packed weights (`pack`): float32 weights that are exactly block-quantized values, as a model
imported from a GGUF file holds (llama.cpp's Q4_1, Q4_0, Q5_1, Q5_0 or Q8_0 blocks of 32, Q4_K's
and Q5_K's sub-blocks of 32 or Q6_K's of 16, dequantized by the importer), are found again as those blocks, checked to give
back every weight (equal as numbers: a zero may come back with the other sign, which no product or
sum can tell), and kept beside the float32 weight. Up to MAX_ROWS_PACKED rows of x the kernel reads
the blocks (5-10 bits a weight against 32) and widens them in registers to the same float32 values:
over SmolLM2's layers at one row, 5.1-5.9 ms a pass against 15.5-16.3 (memory-bound) for the float32
weights; 7.6-8.5 against 16.4-17.4 at 4 rows, 10.9-11.2 against 22.7-24.5 at 8, 53-59 against 56-60
at 64 (2-core Xeon, 2026-11-23, several runs). Above, the float32 weight goes through the matmuls
above (the widening, once a call, then costs more than the bytes it saves).

bfloat16 activations over bfloat16 weights (a `--dtype bfloat16` model): up to
MAX_ROWS_BF16_ACT rows the rows are widened to float32 (exact), go through the same kernel, and
the result is rounded to bfloat16 once, as torch's bfloat16 GEMM rounds its float32 sums (the
sums run in another order: results may differ by a bfloat16 rounding). torch's bfloat16 GEMM
(oneDNN) reads the weights at about half the memory's speed for a few rows; over SmolLM2's layers,
ms a pass (kernel / torch): 10.1 / 19.4 at one row, 11.8 / 19.0 at 4, 13.6 / 19.1 at 8, 23.0 /
19.6 at 16 (2-core Xeon with AMX, 2026-11-25). From 16 rows torch's AMX GEMM is faster.

Float32 CPU products that no kernel takes (past the kernels' rows: prompt chunks, up to 2048
rows a step; from 128 rows with cpu_kernels="torch" or no extension) go through oneDNN's matmul
on an AMD CPU (`torch.ops.mkldnn._linear_pointwise`, the weight as it lies, no copy) rather than
torch's float32 GEMM, which there runs MKL's generic code: over SmolLM2's fused shapes, 183
against 137 GFLOP/s at 256 rows and 191 against 174 at 2048 (2-vCPU AMD EPYC guest, 2026-11-27,
interleaved; float32 rounding only differs). Intel CPUs keep torch's GEMM (MKL is tuned for
them; not measured against oneDNN). `EDGEINFER_ONEDNN_LINEAR=1` or `0` overrides the choice
(`onednn_linear_on`). oneDNN is given only a multiple of ONEDNN_ROWS rows, the rows after it go
to the kernels (or torch's GEMM), and the two are joined: oneDNN keeps a primitive for every row
count it has seen (see ONEDNN_ROWS), and a step's row count is any number.

`small_linear(x, w, b, ext, packed)`: `ext` is the compiled module
(`kernels.cpu_ext.load_small_gemm()`) or None; `packed` what `pack` made of w, or None; the
reference (`torch.nn.functional.linear`, or oneDNN's as above) runs whenever no kernel applies.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from kernels import cpu_ext

log = logging.getLogger(__name__)

# The most rows of x the kernel takes: float32 weights up to 128 (from 16 rows a broadcast
# micro-kernel over per-thread float32 panels; about even with torch's GEMM from 128 to 256, so
# torch's above); bfloat16 up to 512 (at or above torch's float32 GEMM up to 256 rows, even at
# 512; at 1024 and 2048 rows, a long prefill step, the weight widened for torch's GEMM is 9-10%
# faster: 895 against 976 ms, 1763 against 1931, over 6 of SmolLM2's layers, 2026-11-23).
MAX_ROWS_BF16 = 512
# bfloat16 activations (and weights): the kernel up to 8 rows, torch's GEMM above.
MAX_ROWS_BF16_ACT = 8
# The most rows of x the packed kernel takes (from 128 rows about even with the float32 weights
# through the GEMM; the LM head's Q8_0 blocks slower from 64).
MAX_ROWS_PACKED = 64
# On AMD CPUs the float32 kernel stays ahead of the oneDNN GEMM that takes the rows above it there
# up to 192 rows (the 2-vCPU EPYC Zen 4 guest, 2026-11-27, ms a pass over one SmolLM2 layer's
# four products, 1 thread / 2 threads: 9.07 against 9.72 / 4.57 against 5.25 at 128, 13.21
# against 13.86 / 6.62 against 7.29 at 192; even at 256). The packed kernel keeps its 64 rows
# there: from 16 rows the two are within the host's noise (3% either way, run to run), and
# below 16 the packed one is 1.1-1.7x faster (the float32 kernel's broadcast micro-kernel
# starts at 16), the LM head's Q8_0 blocks too.
MAX_ROWS_AMD = 192


def _max_rows_f32() -> int:
    """MAX_ROWS for this CPU: the measured crossover above (AMD's), or the Xeon's that the
    default was measured on."""
    return MAX_ROWS_AMD if cpu_ext.cpu_vendor() == "AuthenticAMD" else 128


MAX_ROWS = _max_rows_f32()

# oneDNN (through ideep) builds a primitive for each row count it is given, and oneDNN's cache
# and ideep's keep about 1,024 each, 0.26-0.65 MB a row count in SmolLM2's shapes (the LM head's
# too). Under continuous batching a step's row count changes all the time: a worker's memory grew
# by ~55 KB a request without levelling off (307 -> 513 MB over ~3,900 chat requests on the AMD
# guest; ~1.6 GB after 2,000 row counts of one weight). So oneDNN only ever sees a multiple of
# ONEDNN_ROWS rows (16 row counts a weight up to 2048 rows) and the fewer than ONEDNN_ROWS after
# them go to small_linear's kernels or torch's GEMM, which keep nothing per row count. Rounding the
# rows up instead would waste the padding's compute (tried for bfloat16: bench/README.md,
# 2026-11-26). The split costs a copy of the output and the tail's kernel pass: over one SmolLM2
# layer's four products at 200-2048 rows, 4-5% (0-11% by rows; none at a multiple of 128) against
# oneDNN with every row count's primitive already built, 1-3% against oneDNN building them (120
# new row counts); the LM head (49,152 rows of weights, read again for the tail, and a large
# output to copy) 22-29% from 300 rows, which it takes only with prompt logprobs or more than
# 192 requests sampled in a step (AMD guest, one thread, CPU time, 2026-11-28).
ONEDNN_ROWS = 128


@dataclass(frozen=True, slots=True)
class Packed:
    """A weight's blocks (`csrc/small_gemm_cpu.cpp`, pack_blocks): qs uint8 (Q4_1: two 4-bit
    values a byte; Q5: one a byte) or int8 (Q8_0, Q6_K), and float32 scales (d and m a block of
    32, d a block of 32, or d for each 16 values)."""

    qs: torch.Tensor
    scales: torch.Tensor

    @property
    def format(self) -> str:
        """Q4_1 (also Q4_0's and Q4_K's blocks), Q5 (Q5_1's, Q5_0's, Q5_K's: a byte a value),
        Q8_0, or Q6_K (int8 with a scale each 16)."""
        if self.qs.dtype == torch.uint8:
            return "Q4_1" if self.scales.numel() * 8 == self.qs.numel() else "Q5"
        return "Q8_0" if self.scales.numel() * 32 == self.qs.numel() else "Q6_K"

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scales.nbytes


def pack(w: torch.Tensor, ext: ModuleType | None, threads: int = 0) -> Packed | None:
    """w's blocks, where every block of 32 along its rows is exactly GGUF block values (Q4_1, Q4_0,
    Q4_K, Q8_0, Q6_K, Q5_1, Q5_0, Q5_K) and the extension has its AVX-512 kernels here (elsewhere
    it would be slower than the float32 weight); None otherwise. `threads`: for the search (0: all); it runs without the GIL."""
    if ext is None or not ext.packed_fast() or w.dtype != torch.float32 or w.dim() != 2:
        return None
    if w.device.type != "cpu" or w.shape[1] % 32:
        return None
    found = ext.pack_blocks(w, threads)
    return None if found is None else Packed(*found)


def max_rows(w: torch.Tensor, x_dtype: torch.dtype = torch.float32) -> int:
    """The most rows of x (in x_dtype) the kernel takes against weights of w's dtype."""
    if x_dtype == torch.bfloat16:
        return MAX_ROWS_BF16_ACT
    return MAX_ROWS_BF16 if w.dtype == torch.bfloat16 else MAX_ROWS


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the small-matmul kernel takes this product: float32 x over float32 or bfloat16
    weights, or bfloat16 x over bfloat16 weights."""
    dtypes_ok = (x.dtype == torch.float32 and w.dtype in (torch.float32, torch.bfloat16)) or (
        x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
    )
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= max_rows(w, x.dtype)
        and dtypes_ok
        and x.device.type == "cpu"
        and w.is_contiguous()
    )


def small_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    ext: ModuleType | None = None,
    packed: Packed | None = None,
) -> torch.Tensor:
    """x: (M, K), w: (N, K), b: (N,) or None -> (M, N), in x's dtype.

    Give `ext` only for float32 or bfloat16, contiguous CPU weights (`applies` says which; the
    model checks once when it turns the kernel on), so the per-call test is the cheap one on x;
    `packed` only with `ext`. Weights in another dtype than x (bfloat16 under float32) are
    widened for the reference.
    """
    # (no rows, as a step that samples nothing asks of the LM head: the reference's empty
    # product; the kernels take 1 or more)
    rows = x.shape[0] if x.dim() == 2 else 0
    if packed is not None and 1 <= rows <= MAX_ROWS_PACKED:
        assert ext is not None
        return ext.packed_linear(x, packed.qs, packed.scales, b)
    if ext is not None and 1 <= rows <= max_rows(w, x.dtype):
        if x.dtype == torch.float32:
            return ext.small_linear(x, w, b)
        if x.dtype == torch.bfloat16:
            y = ext.small_linear(x.float(), w, None)
            if b is not None:
                y += b
            return y.to(torch.bfloat16)
    if (
        x.dtype == torch.float32
        and x.dim() == 2
        and x.device.type == "cpu"
        and rows >= ONEDNN_ROWS
        and onednn_linear_on()
        and not (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad))
    ):
        return _onednn_linear(x, w, b, ext, packed)
    return torch.nn.functional.linear(x, w.to(x.dtype), b)


def _onednn_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    ext: ModuleType | None,
    packed: Packed | None,
) -> torch.Tensor:
    """float32 x (M >= ONEDNN_ROWS, K) over w (N, K), float32 or bfloat16: the rows up to the
    last multiple of ONEDNN_ROWS through oneDNN, the fewer than ONEDNN_ROWS after them as
    small_linear takes them (the kernels; torch's GEMM without them), joined in one output (a
    copy; see ONEDNN_ROWS)."""
    rows = x.shape[0]
    head = rows // ONEDNN_ROWS * ONEDNN_ROWS
    x = x.contiguous()
    # (a strided bias is read as if it were contiguous: wrong sums, no error)
    bias = None if b is None else b.contiguous()
    wf = w.float()  # (w itself if float32)
    y = torch.ops.mkldnn._linear_pointwise(x[:head], wf, bias, "none", [], "")
    if head == rows:
        return y
    # the tail: a bfloat16 w as it is to the kernel, which reads it; widened once for torch's
    return torch.cat((y, small_linear(x[head:], w if ext is not None else wf, bias, ext, packed)))


ONEDNN_ENV = "EDGEINFER_ONEDNN_LINEAR"


@functools.cache
def onednn_linear_on() -> bool:
    """Whether float32 CPU products that no kernel takes go through oneDNN's matmul: on AMD
    CPUs by default (see the module's text), or as EDGEINFER_ONEDNN_LINEAR says (1 / 0); never
    where this torch has no oneDNN, or where a probe product does not match torch's. The model
    runner asks once at start-up, so a bad setting fails there, not at the first long prompt."""
    choice = os.environ.get(ONEDNN_ENV, "").strip()
    if choice not in ("", "0", "1"):
        raise ValueError(f"{ONEDNN_ENV}={choice!r}: use 1 (oneDNN) or 0 (torch's GEMM)")
    if choice == "0" or (choice == "" and cpu_ext.cpu_vendor() != "AuthenticAMD"):
        return False
    op = (
        getattr(torch.ops.mkldnn, "_linear_pointwise", None)
        if torch.backends.mkldnn.is_available()
        else None
    )
    if op is None:
        if choice == "1":
            log.warning("%s=1: this torch has no oneDNN linear; torch's GEMM is used", ONEDNN_ENV)
        return False
    g = torch.Generator().manual_seed(0)
    x, w, b = (  # (float32 whatever torch's default dtype)
        torch.randn(300, 72, generator=g, dtype=torch.float32),
        torch.randn(40, 72, generator=g, dtype=torch.float32),
        torch.randn(40, generator=g, dtype=torch.float32),
    )
    with torch.inference_mode():
        got, want = op(x, w, b, "none", [], ""), torch.nn.functional.linear(x, w, b)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        log.warning("oneDNN's linear disagreed with torch's on a probe; torch's GEMM is used")
        return False
    return True

