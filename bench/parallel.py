"""Tensor parallelism on the CPU: a 1B-class Llama at tp=1 and tp=2, beside the all-reduce alone.

The model: TinyLlama-1.1B's shape (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV
heads, vocabulary 32000), random float32 weights written once to `--model-dir` (4.4 GB;
nothing is downloaded). Each configuration runs the same engine code:
  tp=1  one process, one torch thread
  tp=2  two ranks (gloo), one torch thread each: the same two cores' worth of work split
        (the `--threads2` line: tp=1 with two threads, the other way to use two cores)
Per configuration: prefill time of a `--prompt-len`-token prompt, and decode time per step and
tokens/s at each batch size (greedy, `ignore_eos`, `--decode-steps` steps; the prefill of the
batch timed apart and taken out). Then the all-reduce alone: two gloo processes summing a
(batch, 2048) float32 tensor, the size each layer reduces twice per decode step; with the 45
reductions of a step (2 per layer + the embedding's) that is the communication floor of one
tp=2 step, printed as a share of the measured step. Last, the machine's limit: the GB/s of
weights one and two single-thread processes stream through the decode matmul kernel together,
and the decode step it allows (every weight read once per step) beside the measured one. (On
the 2-vCPU VM this was written on, two processes stream no more than one: tp=2 cannot beat
tp=1 at decode there, and the table shows by how much it falls short of that bound.)
`--pp2` adds pp=2 (two stages of one thread): the batch runs as two lanes with one step of
each in flight, so at batch b each stage works on b / 2 requests while the other works on the
rest; at batch 1 there is nothing to overlap.

    .venv/bin/python -m bench.parallel [--batches 1,8] [--decode-steps 16] [--reps 2]
                                       [--threads2] [--pp2]
"""

from __future__ import annotations  # noqa: I001  # runtime before torch, below

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import runtime  # noqa: F401  # before torch: its OpenMP settings hold for every rank
import torch

from bench.throughput import machine

SHAPE = {  # TinyLlama-1.1B
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
}
DEFAULT_DIR = Path.home() / ".cache" / "edgeinfer" / "bench" / "llama-1.1b-random"


def make_model(out: Path, stories: Path) -> Path:
    """Random weights in TinyLlama's shape, one safetensors shard per 4 layers (made once)."""
    if (out / "model.safetensors.index.json").is_file():
        return out
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    h, inter, layers = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_hidden_layers"]
    heads, kv, vocab = (
        SHAPE["num_attention_heads"],
        SHAPE["num_key_value_heads"],
        SHAPE["vocab_size"],
    )
    d = h // heads
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * (shape[-1] ** -0.5)

    weight_map: dict[str, str] = {}
    shards: list[dict[str, torch.Tensor]] = [
        {
            "model.embed_tokens.weight": rand(vocab, h),
            "lm_head.weight": rand(vocab, h),
            "model.norm.weight": torch.ones(h),
        }
    ]
    for i in range(layers):
        if i % 4 == 0:
            shards.append({})
        p = f"model.layers.{i}."
        shards[-1].update({
            p + "self_attn.q_proj.weight": rand(heads * d, h),
            p + "self_attn.k_proj.weight": rand(kv * d, h),
            p + "self_attn.v_proj.weight": rand(kv * d, h),
            p + "self_attn.o_proj.weight": rand(h, heads * d),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        })  # fmt: skip
    for n, shard in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
        print(f"  wrote {name}", file=sys.stderr, flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPE,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):  # ids < 512 only: enough to run
        (out / f).write_bytes((stories / f).read_bytes())
    return out


def _timed(llm, prompts: list[list[int]], max_tokens: int) -> float:  # type: ignore[no-untyped-def]
    from runtime import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - t0


def run_config(model: Path, tp: int, pp: int, threads: int,
               args: argparse.Namespace) -> dict[str, float]:  # fmt: skip
    from runtime import LLM

    llm = LLM(model, tp=tp, pp=pp, num_threads=threads, kv_cache_bytes=1 << 30,
              max_model_len=1024, enable_prefix_caching=False)  # fmt: skip
    try:
        result: dict[str, float] = {}
        prompt = [1 + (i * 7) % 500 for i in range(args.prompt_len)]
        _timed(llm, [prompt[:16]], 2)  # warm-up
        result["prefill_s"] = min(_timed(llm, [prompt], 1) for _ in range(args.reps))
        for b in args.batches:
            prompts = [[1, 10 + j, 20 + j, 30 + j] for j in range(b)]
            best = float("inf")
            for _ in range(args.reps):
                first = _timed(llm, prompts, 1)  # the batch's prefill and first token
                total = _timed(llm, prompts, args.decode_steps + 1)
                best = min(best, (total - first) / args.decode_steps)
            result[f"step_s_b{b}"] = best
            result[f"tok_s_b{b}"] = b / best
        return result
    finally:
        if llm.engine.runner.ranks is not None:
            llm.engine.runner.ranks.close()


def _allreduce_rank(rank: int, port: int, sizes: list[int], iters: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))  # fmt: skip
    times = {}
    for rows in sizes:
        x = torch.randn(rows, SHAPE["hidden_size"])
        for _ in range(5):
            dist.all_reduce(x)
        samples = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            samples.append(time.perf_counter() - t0)
        times[rows] = statistics.median(samples)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def allreduce_alone(sizes: list[int], iters: int = 200) -> dict[int, float]:
    import tempfile

    import torch.multiprocessing as mp

    from kvstore.redis_server import find_free_port

    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "ar.json")
        mp.spawn(_allreduce_rank, args=(find_free_port(), sizes, iters, out), nprocs=2, join=True)
        return {int(k): v for k, v in json.loads(Path(out).read_text()).items()}


def _gemv_rank(rank: int, nbytes: int, iters: int, out: str) -> None:
    from kernels import cpu_ext
    from kernels.linear import small_linear

    torch.set_num_threads(1)
    gemm = cpu_ext.load_small_gemm()
    h = SHAPE["hidden_size"]
    weights = [torch.randn(h, h) for _ in range(max(1, nbytes // (h * h * 4)))]
    x = torch.randn(1, h)
    for w in weights:
        small_linear(x, w, None, gemm)
    t0 = time.perf_counter()
    for _ in range(iters):
        for w in weights:
            small_linear(x, w, None, gemm)
    seconds = time.perf_counter() - t0
    Path(f"{out}.{rank}").write_text(str(len(weights) * h * h * 4 * iters / seconds))


def gemv_bandwidth(procs: int, nbytes: int = 1 << 30, iters: int = 3) -> float:
    """Bytes/s of weights that `procs` processes of one thread stream through the decode matmul
    kernel together (each its own 1 GiB of 2048 x 2048 matrices, one input row): the memory
    roofline of a decode step, which reads every weight once."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "bw")
        mp.spawn(_gemv_rank, args=(nbytes, iters, out), nprocs=procs, join=True)
        return sum(float(Path(f"{out}.{r}").read_text()) for r in range(procs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads2", action="store_true", help="also tp=1 with two torch threads")
    p.add_argument("--pp2", action="store_true",
                   help="also pp=2 (two stages, one thread each; the batch in 2 lanes, one step of each in flight)")  # fmt: skip
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    stories = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
    print(f"machine: {machine()}; model: random TinyLlama-1.1B shape, float32, {args.model_dir}")
    model = make_model(args.model_dir, stories)
    configs = [("tp=1, 1 thread", 1, 1, 1), ("tp=2, 2 ranks x 1 thread", 2, 1, 1)]
    if args.pp2:
        configs.append(("pp=2, 2 stages x 1 thread", 1, 2, 1))
    if args.threads2:
        configs.append(("tp=1, 2 threads", 1, 1, 2))
    results = {}
    for label, tp, pp, threads in configs:
        print(f"running {label} ...", file=sys.stderr, flush=True)
        results[label] = run_config(model, tp, pp, threads, args)
    ar = allreduce_alone([*args.batches, args.prompt_len])
    bw = {n: gemv_bandwidth(n) for n in (1, 2)}
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    one, two = results[configs[0][0]], results[configs[1][0]]
    reductions = 2 * SHAPE["num_hidden_layers"] + 1
    print(f"\n{'':28s}{'prefill ' + str(args.prompt_len) + ' tok':>18s}"
          + "".join(f"{'decode b=' + str(b):>26s}" for b in args.batches))  # fmt: skip
    for label, r in results.items():
        cells = "".join(f"{r[f'step_s_b{b}'] * 1e3:9.1f} ms {r[f'tok_s_b{b}']:7.2f} tok/s"
                        for b in args.batches)  # fmt: skip
        print(f"{label:28s}{r['prefill_s']:15.2f} s {cells}")
    for label, _, _, threads in configs[1:]:
        r = results[label]
        ratios = "".join(f"{one[f'step_s_b{b}'] / r[f'step_s_b{b}']:25.2f}x" for b in args.batches)
        name = f"speed-up {label.split(',')[0]}{' 2 thr' if threads == 2 else ''} / tp=1"
        print(f"{name:28s}{one['prefill_s'] / r['prefill_s']:16.2f}x {ratios}")
    print(f"\nall-reduce alone (2 gloo processes, float32 rows x {SHAPE['hidden_size']}), "
          f"x{reductions} per step:")  # fmt: skip
    for b in args.batches:
        comm = ar[b] * reductions
        step = two[f"step_s_b{b}"]
        print(f"  decode b={b}: {ar[b] * 1e6:8.1f} us each, {comm * 1e3:7.2f} ms per step = "
              f"{comm / step:5.1%} of the tp=2 step ({step * 1e3:.1f} ms)")  # fmt: skip
    comm = ar[args.prompt_len] * reductions
    print(
        f"  prefill {args.prompt_len}: {ar[args.prompt_len] * 1e6:8.1f} us each, "
        f"{comm * 1e3:7.2f} ms per step = {comm / two['prefill_s']:5.1%} of the tp=2 prefill"
    )
    print(f"\nmemory roofline: the decode step reads all {weights / 1e9:.2f} GB of weights once")
    for n, label in ((1, "tp=1, 1 thread"), (2, "tp=2, 2 ranks x 1 thread")):
        floor = weights / bw[n]
        got = results[label][f"step_s_b{args.batches[0]}"]
        print(f"  {label:26s} {n} process(es) stream {bw[n] / 1e9:5.1f} GB/s: step >= "
              f"{floor * 1e3:6.1f} ms; measured {got * 1e3:6.1f} ms at b={args.batches[0]} "
              f"({floor / got:5.1%} of the roofline)")  # fmt: skip
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')} {os.uname().nodename}")


if __name__ == "__main__":
    main()
