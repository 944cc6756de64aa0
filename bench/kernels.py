"""The Triton kernels on a CUDA GPU, beside the device's own limits measured in the same run.

Per kernel: achieved GB/s (memory-bound kernels: bytes each must move at least once, over the
time) or TFLOP/s (prefill attention), beside the device's copy bandwidth (a large
device-to-device copy) and its bfloat16 matmul rate (torch.mm, 8192^3). Then the engine's
decode step on a random-weight 1B-class Llama (TinyLlama-1.1B's shape, bfloat16, built on the
GPU: nothing read from disk) at batch 1 and 64, replayed from its CUDA graph, beside the time to
read its weights once at the copy bandwidth (the roofline of a decode step).

Targets (issue 8): decode attention >= 70% of copy bandwidth at long contexts; the batch-1
decode step within 1.5x of the weight-read roofline.

    .venv/bin/python -m bench.kernels [--context 4096] [--batch 32] [--reps 50]

Needs a CUDA GPU (exits 2 without one). First run on an H200 on 2026-11-26 (bench/README.md,
`kernels.py`); bench/gpu_check.sh runs it with the other GPU checks.
"""

from __future__ import annotations  # noqa: I001  # runtime before torch, below

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import runtime  # noqa: F401  # before torch: its OpenMP settings
import torch

from bench.parallel import SHAPE

if TYPE_CHECKING:
    from runtime.model import LlamaForCausalLM


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of `fn` on the GPU (events around each call, after 3 warm-ups)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def device_limits(reps: int) -> tuple[float, float]:
    """(copy bytes/s: read + write of a 1 GiB device-to-device copy, bfloat16 matmul FLOP/s)."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 2 / timed(lambda: dst.copy_(src), reps)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm = 2 * 8192**3 / timed(lambda: a @ a, reps)
    return copy, mm


def kernel_figures(args: argparse.Namespace) -> list[tuple[str, float, str]]:
    """(kernel, achieved rate, unit) per kernel."""
    from kernels.triton_decode_attention import decode_attention
    from kernels.triton_kv_write import rotary_write_kv
    from kernels.triton_prefill_attention import prefill_attention
    from kernels.triton_rms_norm import rms_norm
    from kernels.triton_silu_mul import silu_and_mul

    dev, bf = "cuda", torch.bfloat16
    heads, kv_heads, dim, bs = 32, 8, 128, 16
    b, ctx = args.batch, args.context
    blocks = b * ctx // bs
    k_cache = torch.randn(blocks * bs, kv_heads, dim, dtype=bf, device=dev)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks, device=dev).to(torch.int32).view(b, ctx // bs)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(b, heads, dim, dtype=bf, device=dev)
    scale = dim**-0.5
    out: list[tuple[str, float, str]] = []
    t = timed(lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale, bs), args.reps)
    out.append((f"decode attention (b={b}, context {ctx})", 2 * k_cache.nbytes / t, "GB/s"))
    n = min(2048, ctx)  # one prompt of up to 2048 tokens, keys from the cache (its table: ctx)
    pq = torch.randn(n, heads, dim, dtype=bf, device=dev)
    starts = torch.tensor([0, n], dtype=torch.int32, device=dev)
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    t = timed(lambda: prefill_attention(pq, k_cache, v_cache, tables[:1], starts, zero, scale,
                                        bs, n), args.reps)  # fmt: skip
    flops = 4 * n * n * heads * dim / 2  # causal: half of QK^T and PV
    out.append((f"prefill attention ({n} tokens, causal)", flops / t, "TFLOP/s"))
    rows, hidden = 4096, SHAPE["hidden_size"]
    x = torch.randn(rows, hidden, dtype=bf, device=dev)
    res, w = torch.randn_like(x), torch.ones(hidden, dtype=bf, device=dev)
    t = timed(lambda: rms_norm(x, w, 1e-5, residual=res), args.reps)
    out.append((f"add + RMSNorm ({rows} x {hidden})", 4 * x.nbytes / t, "GB/s"))
    gu = torch.randn(rows, 2 * SHAPE["intermediate_size"], dtype=bf, device=dev)
    t = timed(lambda: silu_and_mul(gu), args.reps)
    out.append((f"SiLU and multiply ({rows} x {gu.shape[1]})", 1.5 * gu.nbytes / t, "GB/s"))
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, dtype=bf, device=dev)
    qq, kk, vv = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    qq, kk, vv = (y.unflatten(1, (-1, dim)) for y in (qq, kk, vv))
    cos, sin = torch.randn(rows, dim, dtype=bf, device=dev), torch.randn(rows, dim, dtype=bf,
                                                                         device=dev)  # fmt: skip
    slots = torch.randperm(k_cache.shape[0], device=dev)[:rows]
    t = timed(lambda: rotary_write_kv(qq, kk, vv, cos, sin, k_cache, v_cache, slots), args.reps)
    moved = 2 * qq.nbytes + 2 * (kk.nbytes + vv.nbytes) + 2 * cos.nbytes
    out.append((f"RoPE + KV write ({rows} tokens)", moved / t, "GB/s"))
    return out


def random_llama(shape: dict[str, int], tied: bool = False) -> LlamaForCausalLM:
    """A bfloat16 Llama of `shape` (bench.parallel.SHAPE's keys) with random weights (std 0.02),
    built on the GPU: nothing read from disk."""
    from runtime.config import ModelConfig
    from runtime.model import LlamaForCausalLM

    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": tied, "torch_dtype": "bfloat16"}  # fmt: skip
    model = LlamaForCausalLM(ModelConfig.from_dict(raw), torch.bfloat16, 2048).to("cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def weight_bytes(model: LlamaForCausalLM) -> int:
    """What a decode step reads: every weight but the embedding table (of which it reads a row
    per sequence), the LM head's included (tied: the table itself, read whole)."""
    tied = model.cfg.tie_word_embeddings
    return sum(p.nbytes for name, p in model.named_parameters()
               if "embed_tokens" not in name or tied)  # fmt: skip


def graphed_steps(model: LlamaForCausalLM, batches: tuple[int, ...], reps: int) -> dict[int, float]:
    """{batch: median seconds of one decode step} replayed from the engine's CUDA graphs, every
    sequence at position 511 of its own KV blocks."""
    from runtime.cuda_graphs import DecodeGraphs

    cfg = model.cfg
    bs, ctx = 16, 512
    shape = (cfg.num_layers, 2, max(batches) * ctx, cfg.num_kv_heads, cfg.head_dim)
    kv = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    caches = [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_layers)]
    graphs = DecodeGraphs(model, caches, bs, max(batches), 2048)
    steps = {}
    for b in batches:
        tables = [list(range(i * ctx // bs, (i + 1) * ctx // bs)) for i in range(b)]
        slots = [t[-1] * bs + bs - 1 for t in tables]

        def step(b: int = b, tables: list[list[int]] = tables, slots: list[int] = slots) -> None:
            graphs.run([1] * b, [ctx - 1] * b, slots, tables, [ctx] * b)

        steps[b] = timed(step, reps)
    return steps


def decode_steps(args: argparse.Namespace) -> tuple[int, dict[int, float]]:
    """(weight bytes, {batch: seconds per decode step}) of the engine's graphed decode on a
    random-weight 1.1B Llama (TinyLlama's shape)."""
    model = random_llama(SHAPE)
    return weight_bytes(model), graphed_steps(model, (1, 64), args.reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(f"bench.kernels needs a CUDA GPU; torch {torch.__version__} sees none",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    name = torch.cuda.get_device_name()
    print(f"device: {name}; torch {torch.__version__}")
    copy, mm = device_limits(args.reps)
    print(f"device copy bandwidth {copy / 1e9:8.1f} GB/s; bfloat16 matmul {mm / 1e12:6.1f} TFLOP/s")
    for label, rate, unit in kernel_figures(args):
        limit = copy if unit == "GB/s" else mm
        scaled = rate / (1e9 if unit == "GB/s" else 1e12)
        print(f"  {label:44s} {scaled:8.1f} {unit:8s} = {rate / limit:6.1%} of the device's")
    weights, steps = decode_steps(args)
    floor = weights / copy
    print(f"decode step, 1.1B Llama bfloat16 ({weights / 1e9:.2f} GB of weights read per step, "
          "the embedding table aside), graph replay:")
    for b, t in steps.items():
        print(f"  batch {b:3d}: {t * 1e3:7.3f} ms; weight-read roofline {floor * 1e3:6.3f} ms "
              f"({t / floor:5.2f}x of it)")  # fmt: skip
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')} {os.uname().nodename}")


if __name__ == "__main__":
    main()
