"""Lossless compression on a CUDA GPU: the Triton decoder's rate and a decode step with the
weights kept compressed (issue 7's GPU figures), in one run.

1. Decoder GB/s (bfloat16 bytes out per second, the coded records already on the GPU, outputs
   written to preallocated buffers): every tensor of a set decoded once per timed call, the set
   copied until it outgrows the L2 cache, beside the device's copy bandwidth (a 1 GiB
   device-to-device copy, bytes read + written) from the same run. Two sets: real trained
   weights (`--weights`: a safetensors file, or a model folder's first `--layers` layers, cast
   to bfloat16) and random ones (std 0.02) in TinyLlama-1.1B's layer shapes. Two ways: a lane per
   chunk of the files' records (what a one-off decode at load uses), and the whole set as one
   TileGroup in one launch (`runtime.compression.tile_group`, a lane per `--span` values, one code:
   what weights kept compressed are, a layer a group). Every output is checked bit for bit
   against the original first.
2. Decode step, replayed from the engine's CUDA graphs, of a random-weight bfloat16 model with
   its decoder layers kept compressed (`runtime.compression.CompressedBlocks`: each layer's
   weights decoded on a side stream while the layer before runs, inside the graph) beside the
   same model dense, at batch 1 and 64: SmolLM2-135M's shape and TinyLlama-1.1B's; and, for
   comparison, with each layer decoded in line just before it runs (`overlap=False`).

    python -m bench.compress_gpu [--weights FILE_OR_DIR] [--layers 4] [--reps 30] [--skip-1b]
                                 [--span 64]
    python -m bench.compress_gpu --save-layers FILE   # the real weights, for a GPU machine

bench/gpu_check.sh runs it, the GPU tests and bench.kernels as one prepared run.

Targets (issue 7): the Triton decoder >= 200 GB/s on an H100/H200; a decode step with weights
kept compressed <= 1.3x the dense one at batch 1. Needs a CUDA GPU (exits 2 without one).
"""

from __future__ import annotations  # noqa: I001  # runtime before torch, below

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import runtime  # noqa: F401  # before torch: its OpenMP settings
import torch

from bench.kernels import device_limits, graphed_steps, random_llama, timed, weight_bytes
from kernels.huffman_decode import TILE_SPAN
from bench.parallel import SHAPE as TINYLLAMA

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152}  # fmt: skip
L2_OUTGROWN = 256 << 20  # bytes out per timed call at least: well past an H100/H200's L2


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def random_layers(shape: dict[str, int], layers: int) -> dict[str, torch.Tensor]:
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    gen = torch.Generator().manual_seed(0)
    shapes = {"q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h), "gate": (inter, h),
              "up": (inter, h), "down": (h, inter)}  # fmt: skip
    return {f"{i}.{name}": (torch.randn(*s, generator=gen) * 0.02).to(torch.bfloat16)
            for i in range(layers) for name, s in shapes.items()}  # fmt: skip


def real_weights(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The 2-D float tensors of `--weights` (a safetensors file, or a model folder: those of its
    first `--layers` decoder layers), in bfloat16."""
    from safetensors.torch import load_file

    from runtime.loader import safetensors_files

    path = Path(args.weights)
    files = safetensors_files(path) if path.is_dir() else [path]
    layers = tuple(f"layers.{i}." for i in range(args.layers))
    return {name: t.to(torch.bfloat16) for f in files for name, t in load_file(str(f)).items()
            if t.is_floating_point() and t.dim() == 2
            and (not path.is_dir() or any(x in name for x in layers))}  # fmt: skip


def decoder_rates(tensors: dict[str, torch.Tensor], reps: int, span: int
                  ) -> list[tuple[str, float]]:  # fmt: skip
    """(way, bfloat16 bytes out per second) of the Triton decoders over `tensors`: a launch a
    tensor, a lane per chunk of the files' records (a one-off decode at load); and every tensor
    in one TileGroup, one launch (weights kept compressed)."""
    from kernels.huffman_decode import decode_triton
    from runtime.compression import encode_bf16, parse_record

    coded, originals, kept = [], [], []
    for t in tensors.values():
        rec = encode_bf16(t)
        if rec is not None:  # (the tensors both ways decode: those that compress)
            coded.append(parse_record(torch.from_numpy(rec), t.numel()).to("cuda"))
            originals.append(t.reshape(-1).view(torch.int16))
            kept.append(t)
    values = sum(c.numel for c in coded)
    copies = max(1, -(-L2_OUTGROWN // (2 * values)))
    log(f"  {len(coded)} tensors, {values / 1e6:.1f} M values, x{copies} copies")
    outs = [torch.empty(values + 4 * len(coded), dtype=torch.bfloat16, device="cuda")
            for _ in range(copies)]  # fmt: skip
    starts = [0, *itertools.accumulate(c.numel for c in coded)][:-1]
    for c, s, want in zip(coded, starts, originals, strict=True):
        view = outs[0][s : s + c.numel].fill_(float("nan"))
        decode_triton(c, out=view)
        assert torch.equal(view.view(torch.int16).cpu(), want), "a lane per chunk"
    sets = [coded] + [[_clone(c) for c in coded] for _ in range(copies - 1)]

    def per_chunk(sets: list = sets) -> None:  # type: ignore[type-arg]
        for cs, out in zip(sets, outs, strict=True):
            for c, s in zip(cs, starts, strict=True):
                decode_triton(c, out=out[s : s + c.numel], check=False)

    return [
        ("a launch a tensor, a lane per chunk", 2 * values * copies / timed(per_chunk, reps)),
        (f"one launch, tiles of 32 lanes x {span} values",
         tile_rate(kept, copies, outs, reps, span)),
    ]  # fmt: skip


def tile_rate(tensors: list[torch.Tensor], copies: int, outs: list[torch.Tensor], reps: int,
              span: int) -> float:  # fmt: skip
    """bfloat16 bytes out per second of the tiles kernel (weights kept compressed) decoding
    `tensors`, `copies` groups of them a timed call, each checked bit for bit first."""
    from kernels.huffman_decode import TileGroup, decode_tiles
    from runtime.compression import tile_group

    dense = [t.reshape(-1).cuda() for t in tensors]
    starts = [0, *itertools.accumulate(-(-t.numel() // 4) * 4 for t in dense)][:-1]
    t0 = time.perf_counter()
    group = tile_group(dense, starts, span=span)
    torch.cuda.synchronize()
    values = sum(t.numel() for t in dense)
    log(f"  tiles: encoded on the GPU in {time.perf_counter() - t0:.2f} s; the group takes "
        f"{group.nbytes() / (2 * values):.2%} of the bfloat16 bytes, "
        f"{group.words.nbytes * 8 / values:.3f} bits an exponent")  # fmt: skip
    outs[0].fill_(float("nan"))
    decode_tiles(group, outs[0])
    for s, t in zip(starts, dense, strict=True):
        assert torch.equal(outs[0][s : s + t.numel()].view(torch.int16), t.view(torch.int16))
    groups = [group] + [TileGroup(*(getattr(group, f).clone() for f in group.__slots__[:-2]),
                                  group.numel, span) for _ in range(copies - 1)]  # fmt: skip

    def tiled() -> None:
        for g, out in zip(groups, outs, strict=True):
            decode_tiles(g, out)

    return 2 * values * copies / timed(tiled, reps)


def _clone(c):  # type: ignore[no-untyped-def]
    from kernels.huffman_decode import CodedBF16

    return CodedBF16(c.table.clone(), c.offsets.clone(), c.sm.clone(), c.bits.clone(),
                     c.chunk_elems)  # fmt: skip


def step_slowdown(shape: dict[str, int], tied: bool, reps: int, span: int) -> tuple[int, dict, dict, dict, str]:  # type: ignore[type-arg]
    """(weight bytes, {batch: dense seconds}, {batch: kept-compressed seconds}, the same decoded
    in line, summary)."""
    from runtime.compression import CompressedBlocks

    model = random_llama(shape, tied)
    nbytes = weight_bytes(model)
    dense = graphed_steps(model, (1, 64), reps)
    steps, summary = [], ""
    for overlap in (True, False):
        t0 = time.perf_counter()
        blocks = CompressedBlocks(list(model.layers), device="cuda", overlap=overlap, span=span)
        log(f"  encoded in {time.perf_counter() - t0:.1f} s: {blocks.summary()}")
        summary = summary or blocks.summary()
        steps.append(graphed_steps(model, (1, 64), reps))
        blocks.release()
    return nbytes, dense, steps[0], steps[1], summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--weights", help="real weights: a safetensors file, or a model folder")
    p.add_argument("--layers", type=int, default=4, help="of a model folder's (default 4)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--skip-1b", action="store_true", help="no TinyLlama-shape decode step")
    p.add_argument("--span", type=int, default=TILE_SPAN,
                   help=f"values a lane of the tiles (default {TILE_SPAN}, the engine's)")  # fmt: skip
    p.add_argument("--save-layers", metavar="FILE", help="no GPU needed: write the real weights "
                   "(--weights, default the demo model's folder) to FILE and stop")  # fmt: skip
    args = p.parse_args()
    if args.save_layers:
        from safetensors.torch import save_file

        from runtime.model_cache import default_model_dir

        args.weights = args.weights or str(default_model_dir())
        tensors = real_weights(args)
        save_file({k: v.contiguous() for k, v in tensors.items()}, args.save_layers)
        values = sum(t.numel() for t in tensors.values())
        print(f"{args.save_layers}: {len(tensors)} tensors, {values / 1e6:.1f} M values")
        return
    if not torch.cuda.is_available():
        print(f"bench.compress_gpu needs a CUDA GPU; torch {torch.__version__} sees none",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    copy, _ = device_limits(args.reps)
    print(f"device copy bandwidth {copy / 1e9:8.1f} GB/s (read + write)")
    sets = {"random, TinyLlama-1.1B layer shapes (2 layers)": random_layers(TINYLLAMA, 2)}
    if args.weights:
        sets = {f"real, {os.path.basename(args.weights)}": real_weights(args), **sets}
    print("Triton decoder, bfloat16 GB/s out (target >= 200):")
    for label, tensors in sets.items():
        log(label)
        for way, rate in decoder_rates(tensors, args.reps, args.span):
            print(f"  {label[:30]:30s} {way:58s} {rate / 1e9:8.1f} GB/s = {rate / copy:6.1%} "
                  "of the copy bandwidth")  # fmt: skip
    print(
        "Decode step, graph replay, weights kept compressed vs dense (target <= 1.3x at batch 1):"
    )
    models = [("SmolLM2-135M shape", SMOLLM2, True)]
    if not args.skip_1b:
        models.append(("TinyLlama-1.1B shape", TINYLLAMA, False))
    for label, shape, tied in models:
        log(label)
        nbytes, dense, kept, inline, summary = step_slowdown(shape, tied, args.reps, args.span)
        print(f"  {label} ({nbytes / 1e9:.2f} GB read per dense step; {summary}):")
        for b in dense:
            print(f"    batch {b:3d}: dense {dense[b] * 1e3:7.3f} ms, kept compressed "
                  f"{kept[b] * 1e3:7.3f} ms = {kept[b] / dense[b]:5.2f}x (decoded in line "
                  f"{inline[b] * 1e3:7.3f} ms = {inline[b] / dense[b]:5.2f}x)")  # fmt: skip
        torch.cuda.empty_cache()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')} {os.uname().nodename}")


if __name__ == "__main__":
    main()
