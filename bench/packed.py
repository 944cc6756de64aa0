"""Decode matmuls over a GGUF import's packed blocks, against the same float32 weights.

A model imported from a quantized GGUF holds float32 weights that are exactly llama.cpp's block
values; the engine finds the blocks again and its few-row matmuls read them (kernels.linear:
`pack`, `small_linear`). This times one 1B-class Llama layer's matmuls (TinyLlama-1.1B's shapes:
q and o 2048x2048, k and v 256x2048, gate and up 5632x2048, down 2048x5632; `--layers` distinct
copies, so the weights come from memory, not a cache) at a decode step's few rows, per format:

- edgeinfer packed: `small_linear` reading the blocks;
- edgeinfer float32: `small_linear` on the float32 weights (the few-row kernel, no blocks);
- torch: `torch.nn.functional.linear` on the float32 weights (the peer);
- and the machine's limit for the packed bytes: their size over the rate of a 2-thread
  `torch.sum` over as many bytes of memory (the read rate).

Formats: Q4_K, Q5_K and Q6_K (random valid blocks, as `gguf` dequantizes them: it does not quantize
k-quants), Q4_1 and Q8_0 (`gguf`'s quantize of random weights).

    .venv/bin/python -m bench.packed [--rows 1,4,8,32] [--layers 4] [--formats Q4_K,Q6_K,...]
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# runtime first: the OpenMP settings it makes hold for torch in this process
import runtime  # noqa: F401, I001
import gguf
import numpy as np
import torch

from kernels import cpu_ext
from kernels.linear import Packed, pack, small_linear

SHAPES = [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (5632, 2048), (5632, 2048),
          (2048, 5632)]  # fmt: skip
Q = gguf.GGMLQuantizationType


def weight(n: int, k: int, fmt: str, rng: np.random.Generator) -> torch.Tensor:
    """A float32 weight as runtime.gguf_import makes it from blocks of `fmt`."""
    if fmt in ("Q4_K", "Q5_K", "Q6_K"):
        from tests.test_gguf_import import random_k_blocks

        qtype = Q.__members__[fmt]
        w = gguf.quants.dequantize(random_k_blocks(n, k, qtype, rng), qtype)
    else:
        raw = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        qtype = Q.__members__[fmt]
        w = gguf.quants.dequantize(gguf.quants.quantize(raw, qtype), qtype)
    return torch.from_numpy(np.array(w, dtype=np.float32))


def best_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1000


def read_rate() -> float:
    """GB/s of a torch.sum over 1 GiB (the threads torch uses here)."""
    big = torch.ones(256 << 20, dtype=torch.float32)
    return big.nbytes / best_ms(lambda: big.sum(), 5) * 1e-6


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", default="1,4,8,32")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--formats", default="Q4_K,Q5_K,Q6_K,Q4_1,Q8_0")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    ext = cpu_ext.load_small_gemm()
    if ext is None or not ext.packed_fast():
        print("bench.packed: the packed kernels need the C++ extension with AVX-512 here",
              file=sys.stderr)  # fmt: skip
        return 2
    print(f"bench/packed.py {time.strftime('%Y-%m-%d %H:%M')} UTC on {platform.node()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")  # fmt: skip
    sum_gbs = read_rate()
    print(f"memory read rate (torch.sum over 1 GiB): {sum_gbs:.1f} GB/s")
    rows = [int(r) for r in args.rows.split(",")]
    for fmt in args.formats.split(","):
        rng = np.random.default_rng(0)
        ws = [[weight(n, k, fmt, rng) for n, k in SHAPES] for _ in range(args.layers)]
        ps: list[list[Packed]] = []
        for layer in ws:
            found = [pack(w, ext) for w in layer]
            if any(f is None for f in found):
                print(f"{fmt}: blocks not found (a bug: they are exact {fmt} values)")
                return 1
            ps.append([f for f in found if f is not None])
        dense_mb = sum(w.nbytes for w in ws[0]) / 1e6
        packed_mb = sum(q.nbytes for q in ps[0]) / 1e6
        print(f"\n{fmt}: one layer {dense_mb:.1f} MB as float32, {packed_mb:.1f} MB packed; "
              f"ms a layer (best of {args.reps}, {args.layers} layers a pass)")  # fmt: skip
        print(f"  {'rows':>4}  {'packed':>7}  {'float32':>7}  {'torch':>7}  {'read limit':>10}"
              f"  {'vs float32':>10}  {'vs torch':>8}  {'vs limit':>8}")  # fmt: skip
        for m in rows:
            xs = [torch.randn(m, k) for _, k in SHAPES]

            def run(mode: str, xs: list[torch.Tensor] = xs, ws: list[list[torch.Tensor]] = ws,
                    ps: list[list[Packed]] = ps) -> None:  # fmt: skip
                for layer, packs in zip(ws, ps, strict=True):
                    for j, w in enumerate(layer):
                        if mode == "torch":
                            torch.nn.functional.linear(xs[j], w)
                        else:
                            small_linear(
                                xs[j], w, None, ext, packs[j] if mode == "packed" else None
                            )

            got = {mode: best_ms(functools.partial(run, mode), args.reps) / args.layers
                   for mode in ("packed", "float32", "torch")}  # fmt: skip
            limit = packed_mb / sum_gbs  # ms
            print(f"  {m:>4}  {got['packed']:7.2f}  {got['float32']:7.2f}  {got['torch']:7.2f}  "
                  f"{limit:10.2f}  {got['float32'] / got['packed']:9.2f}x  "
                  f"{got['torch'] / got['packed']:7.2f}x  {limit / got['packed']:7.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
