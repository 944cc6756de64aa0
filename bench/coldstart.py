"""Cold start: how fast weights come off the drive, and how soon a fresh process answers.

In one run, on the same files, each read with the files' pages dropped from the page cache first
(`posix_fadvise(DONTNEED)`, so every reader goes to the drive):
1. `dd iflag=direct bs=8M` of every shard: the drive's sequential rate (the peer);
2. the edgeinfer reader (`runtime.weights.load_safetensors`: O_DIRECT, 4 threads, every 16 MiB
   chunk checked against the manifest's xxh3-64);
3. for the model, the edgeinfer loader (`runtime.loader.load_model`: the same reads, straight
   into the model's fused parameters, plus building the model);
4. `safetensors.torch.load_file` of every shard (each tensor touched, so it is really read);
5. `transformers` `AutoModelForCausalLM.from_pretrained` (the model checkpoint only).
Checkpoints: SmolLM2-135M-Instruct pulled into a temporary model store in 4 shards (the layout
and manifest `edgeinfer pull` writes), and a synthetic 2 GB one (float32 and bfloat16 tensors
of odd sizes, 8 shards, with a manifest). Then, for the model, from a fresh process each:
- `edgeinfer worker` (no Redis): process start to the first token of a 1-token request on its
  internal API, the request sent as soon as its port accepts (the issue's measure);
- `edgeinfer generate --max-tokens 1`: process start to the token printed (and to exit);
- a script that loads it with `from_pretrained`, generates 1 token and prints it: the same;
against the raw read time + 2 s, and edgeinfer against `from_pretrained`.

    python -m bench.coldstart [--model DIR] [--synthetic-gb 2] [--reps 5] [--json out.json]
    python -m bench.coldstart --device cuda [--synthetic-gb 4]   # onto a GPU: the readers only

With --device cuda, the synthetic checkpoint only (no model or processes), read onto the GPU:
dd as above; the edgeinfer reader straight onto the GPU (pinned staging buffers, asynchronous
copies on a copy stream, overlapping the reads); the same reader into host memory, then
`.to("cuda")` (what a GPU worker did before); `safetensors.torch.load_file(device="cuda")`.

Every figure is the median of --reps runs, the readers and the processes interleaved (a slow
stretch of the shared host then hits all of them, not one).

Targets (issue text): the reader >= 90% of the dd rate; start to first token <= raw read + 2 s
and >= 3x faster than `from_pretrained` to a first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from runtime.zygote import ZygoteClient

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def evict(files: list[Path]) -> None:
    from runtime.weights import drop_page_cache

    for f in files:
        drop_page_cache(f)


def pull(model: Path, store: Path, shards: int) -> list[Path]:
    """The model pulled into a model store at `store`, in `shards` shards (+ manifest)."""
    from runtime.loader import safetensors_files
    from runtime.model_store import ModelStore

    total = sum(f.stat().st_size for f in safetensors_files(model))
    folder = ModelStore(store).pull(model, "model", shard_bytes=total // shards + 1)
    return safetensors_files(folder)


def synthetic(out: Path, gb: float, shards: int) -> list[Path]:
    from safetensors.torch import save_file

    from runtime.manifest import Manifest, ShardEntry, file_digests, write_manifest

    out.mkdir(parents=True, exist_ok=True)
    per = int(gb * 1e9 / shards)
    files = []
    g = torch.Generator().manual_seed(0)
    for i in range(shards):
        tensors, size, k = {}, 0, 0
        while size < per:
            rows = 1000 + 37 * k
            t = torch.randn(rows, 1531, generator=g)
            if k % 2:
                t = t.to(torch.bfloat16)
            tensors[f"s{i}.t{k}"] = t
            size += t.numel() * t.element_size()
            k += 1
        f = out / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(f))
        files.append(f)
    shards_ = [ShardEntry(f.name, f.stat().st_size, file_digests(f)) for f in files]
    write_manifest(out, Manifest("synthetic", "bench", shards=shards_))
    return files


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    """Seconds `fn` takes to load; what it loaded is freed after the clock stops (unmapping a few
    GB takes a few tenths of a second, which is no part of a load)."""
    t0 = time.perf_counter()
    loaded = fn()
    seconds = time.perf_counter() - t0
    del loaded
    return seconds


def dd(files: list[Path]) -> None:
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=8M", "iflag=direct", "status=none"],
                       check=True)  # fmt: skip


def ours(files: list[Path]) -> list[torch.Tensor]:
    from runtime.manifest import read_manifest
    from runtime.weights import load_safetensors

    manifest = read_manifest(files[0].parent)
    assert manifest is not None
    return [t for _, _, t in load_safetensors(files, threads=4, direct=True, manifest=manifest)]


def loader(model: Path) -> torch.nn.Module:
    from runtime.loader import load_model

    return load_model(model)


def st_load(files: list[Path]) -> list[dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    out = []
    for f in files:
        out.append(load_file(str(f)))
        for t in out[-1].values():
            t.view(-1)[:: max(1, 4096 // t.element_size())].sum()  # touch every page
    return out


def ours_onto(files: list[Path], device: str) -> list[torch.Tensor]:
    from runtime.manifest import read_manifest
    from runtime.weights import load_safetensors

    manifest = read_manifest(files[0].parent)
    out = [t for _, _, t in load_safetensors(files, threads=4, direct=True, manifest=manifest,
                                             device=device)]  # fmt: skip
    torch.cuda.synchronize()
    return out


def ours_then_to(files: list[Path], device: str) -> list[torch.Tensor]:
    out = [t.to(device) for t in ours(files)]
    torch.cuda.synchronize()
    return out


def st_onto(files: list[Path], device: str) -> list[dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    out = [load_file(str(f), device=device) for f in files]
    torch.cuda.synchronize()
    return out


def gpu_readers(args: argparse.Namespace) -> int:
    """--device cuda: the synthetic checkpoint read onto the GPU by each reader (see above)."""
    if not torch.cuda.is_available():
        print("bench.coldstart --device cuda: torch sees no CUDA GPU", file=sys.stderr)
        return 2
    device = args.device
    cache = Path.home() / ".cache"  # as on the CPU: on the drive a model store would be on
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ei-coldstart-", dir=cache) as tmp:
        log(f"writing the synthetic {args.synthetic_gb:g} GB checkpoint")
        files = synthetic(Path(tmp) / "syn", args.synthetic_gb, 8)
        size = sum(f.stat().st_size for f in files)
        readers: list[tuple[str, Callable[[], object]]] = [
            ("dd iflag=direct bs=8M", partial(dd, files)),
            ("edgeinfer reader onto the GPU", partial(ours_onto, files, device)),
            ("edgeinfer reader, then .to(cuda)", partial(ours_then_to, files, device)),
            ("safetensors load_file(device=cuda)", partial(st_onto, files, device)),
        ]
        times: dict[str, list[float]] = {name: [] for name, _ in readers}
        for rep in range(args.reps):  # interleaved, as on the CPU
            for name, fn in readers:
                evict(files)
                times[name].append(timed(fn))
                torch.cuda.empty_cache()
            log(f"  run {rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()))
    row = {name: statistics.median(t) for name, t in times.items()}
    print(f"bench/coldstart.py --device {device} {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs, page cache dropped before "
          f"every read (medians of {args.reps})")  # fmt: skip
    print(f"\nsynthetic {args.synthetic_gb:g} GB (8 shards): {size / 1e9:.2f} GB")
    for name, sec in row.items():
        print(f"  {name:36s} {sec:7.2f}s  {size / sec / 1e9:6.2f} GB/s")
    dd_s = row["dd iflag=direct bs=8M"]
    ratio = dd_s / row["edgeinfer reader onto the GPU"]
    print(f"  edgeinfer reader onto the GPU / dd rate: {ratio:.2f}x (target >= 0.90x: "
          f"{'met' if ratio >= 0.9 else 'NOT met'}); against host read + .to(cuda): "
          f"{row['edgeinfer reader, then .to(cuda)'] / row['edgeinfer reader onto the GPU']:.2f}x; "
          f"against safetensors: "
          f"{row['safetensors load_file(device=cuda)'] / row['edgeinfer reader onto the GPU']:.2f}x")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"bytes": size, **row}, indent=1))
    return 0


def hf(model: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)


def first_token(cmd: list[str], files: list[Path], echo: bytes = b"") -> tuple[float, float]:
    """Seconds from spawning `cmd` (files evicted first) to the first byte it prints after
    `echo` (its first token), and to its exit."""
    evict(files)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    out = b""
    while len(out) <= len(echo):
        piece = os.read(proc.stdout.fileno(), 4096)
        if not piece:
            raise RuntimeError(f"{cmd[:4]} printed no token ({out!r})")
        out += piece
    token = time.perf_counter() - t0
    proc.stdout.read()
    if proc.wait() != 0:
        raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode})")
    return token, time.perf_counter() - t0


def _worker_argv(model: Path) -> tuple[list[str], int, str]:
    """`edgeinfer worker` arguments for the first-token measures, its port, and a 1-token request
    for its internal API."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    body = json.dumps({"request_id": "bench", "model": model.name, "prompt": "Once upon a time",
                       "sampling": {"max_tokens": 1, "temperature": 0}})  # fmt: skip
    argv = ["worker", "--model", str(model), "--no-redis", "--secret", "bench", "--port",
            str(port), "--threads", "1", "--kv-cache-bytes", "50000000"]  # fmt: skip
    return argv, port, body


def worker_first_token(model: Path, files: list[Path]) -> tuple[float, str]:
    """Seconds from spawning `edgeinfer worker` to the first token of a 1-token request on its
    internal API, sent as soon as its port accepts (files evicted first); and the worker's own
    start-up timeline."""
    import http.client

    argv, port, body = _worker_argv(model)
    evict(files)
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli", *argv],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            while True:
                if proc.poll() is not None:
                    out.seek(0)
                    said = out.read().decode(errors="replace").strip().splitlines()[-5:]
                    raise RuntimeError(f"the worker exited ({proc.returncode}) before serving: "
                                       + " | ".join(said))  # fmt: skip
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                try:
                    conn.connect()
                    break
                except ConnectionRefusedError:
                    time.sleep(0.005)
            conn.request("POST", "/internal/generate", body,
                         {"x-edgeinfer-secret": "bench", "Content-Type": "application/json"})  # fmt: skip
            resp = conn.getresponse()
            while b'"delta"' not in (line := resp.readline()):
                if not line:
                    raise RuntimeError("the worker's answer ended without a token")
            seconds = time.perf_counter() - t0
            conn.close()
        finally:
            proc.terminate()
            proc.wait(60)
        out.seek(0)
        lines = out.read().decode(errors="replace").splitlines()
    return seconds, next((x for x in lines if x.startswith("start-up:")), "(no timeline)")


async def forked_first_token(zygote, model: Path, files: list[Path]) -> tuple[float, str]:  # type: ignore[no-untyped-def]
    """As worker_first_token, for a worker forked from a pool's warm template (`zygote`, a
    runtime.zygote.ZygoteClient, started beforehand as a pool starts it): seconds from asking
    the template for the process to its first token."""
    import aiohttp

    argv, port, body = _worker_argv(model)
    url = f"http://127.0.0.1:{port}/internal/generate"
    evict(files)
    t0 = time.perf_counter()
    proc = await zygote.spawn(argv)
    output = asyncio.ensure_future(proc.stdout.read())
    try:
        async with aiohttp.ClientSession() as s:
            while True:
                if proc.returncode is not None:
                    raise RuntimeError(f"the forked worker exited ({proc.returncode})")
                try:
                    resp = await s.post(url, data=body, headers={"x-edgeinfer-secret": "bench"})
                    break
                except aiohttp.ClientConnectorError:
                    await asyncio.sleep(0.005)
            async with resp:
                async for line in resp.content:
                    if b'"delta"' in line:
                        break
                else:
                    raise RuntimeError("the forked worker's answer ended without a token")
            seconds = time.perf_counter() - t0
    finally:
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 60)
    lines = (await output).decode(errors="replace").splitlines()
    return seconds, next((x for x in lines if x.startswith("start-up:")), "(no timeline)")


HF_FIRST = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
PROMPT = "Once upon a time"
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(sys.argv[1])
out = m.generate(**tok(PROMPT, return_tensors="pt"), max_new_tokens=1, do_sample=False)
print(tok.decode(out[0, -1:]), flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=None, help="default: the SmolLM2 demo model")
    ap.add_argument("--synthetic-gb", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=5, help="runs of each (the median counts)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the synthetic checkpoint read onto the GPU (readers only)")  # fmt: skip
    args = ap.parse_args()
    if args.device != "cpu":
        return gpu_readers(args)
    if args.model is None:
        from runtime.model_cache import default_model_dir

        args.model = Path(default_model_dir())
    if not (args.model / "config.json").is_file():
        print(f"bench.coldstart: {args.model} is not a model folder", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    # the project's modules as an installed package has them (`pip install .` compiles them;
    # `make run` does this too): compiled once, not by every process at its start
    import compileall

    for package in ("runtime", "gateway", "kvstore", "kernels"):
        compileall.compile_dir(ROOT / package, quiet=1)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="ei-coldstart-", dir=Path.home() / ".cache") as tmp:
        log("pulling the model into a store in 4 shards; writing the synthetic checkpoint")
        smol = pull(args.model, Path(tmp) / "store", 4)
        model_dir = smol[0].parent
        sets = {
            "SmolLM2 (4 shards)": smol,
            f"synthetic {args.synthetic_gb:g} GB (8 shards)": synthetic(
                Path(tmp) / "syn", args.synthetic_gb, 8
            ),
        }
        for label, files in sets.items():
            size = sum(f.stat().st_size for f in files)
            row: dict[str, float] = {"bytes": size}
            readers: list[tuple[str, Callable[[], object]]] = [("dd iflag=direct bs=8M", partial(dd, files)),
                       ("edgeinfer reader", partial(ours, files))]  # fmt: skip
            if label.startswith("SmolLM2"):
                readers.append(("edgeinfer loader (model)", partial(loader, model_dir)))
            readers.append(("safetensors load_file", partial(st_load, files)))
            if label.startswith("SmolLM2"):
                readers.append(("transformers from_pretrained", partial(hf, model_dir)))
            times: dict[str, list[float]] = {name: [] for name, _ in readers}
            for _ in range(args.reps):  # interleaved: a slow minute of the host hits every reader
                for name, fn in readers:
                    evict(files)
                    times[name].append(timed(fn))
            row.update({name: statistics.median(t) for name, t in times.items()})
            for name, _ in readers:
                log(f"  {label}: {name} {row[name]:.2f}s ({size / row[name] / 1e9:.2f} GB/s)")
            results[label] = row
        generate = [sys.executable, "-m", "runtime.cli", "generate", "--model", str(model_dir),
                    "--max-tokens", "1", "--threads", "1", "--kv-cache-bytes", "50000000",
                    "Once upon a time"]  # fmt: skip
        runs: dict[str, list[float]] = {k: [] for k in ("worker", "forked worker", "generate",
                                                         "generate exit", "transformers",
                                                         "transformers exit")}  # fmt: skip
        timelines, forked_timelines = [], []
        hf_cmd = [sys.executable, "-c", HF_FIRST, str(model_dir)]
        loop = asyncio.new_event_loop()
        log("starting a pool's warm template process (runtime.zygote)")
        zygote = loop.run_until_complete(ZygoteClient.start())
        for _ in range(args.reps):
            seconds, timeline = worker_first_token(model_dir, smol)
            runs["worker"].append(seconds)
            timelines.append(timeline)
            seconds, timeline = loop.run_until_complete(forked_first_token(zygote, model_dir, smol))
            runs["forked worker"].append(seconds)
            forked_timelines.append(timeline)
            for name, cmd, echo in (("generate", generate, b"Once upon a time"),
                                    ("transformers", hf_cmd, b"")):  # fmt: skip
                token, exit_s = first_token(cmd, smol, echo)
                runs[name].append(token)
                runs[f"{name} exit"].append(exit_s)
            log("  first token: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in runs.items()))
        loop.run_until_complete(zygote.close())
        loop.close()
        results["first token"] = {k: statistics.median(v) for k, v in runs.items()}

    print(f"bench/coldstart.py {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, files on "
          f"{ROOT.anchor}, page cache dropped before every read (medians of {args.reps})")  # fmt: skip
    for label, row in results.items():
        if label == "first token":
            continue
        nbytes = row["bytes"]
        print(f"\n{label}: {nbytes / 1e9:.2f} GB")
        for name, s in row.items():
            if name != "bytes":
                print(f"  {name:30s} {s:7.2f}s  {nbytes / s / 1e9:6.2f} GB/s")
        ratio = row["dd iflag=direct bs=8M"] / row["edgeinfer reader"]
        print(f"  edgeinfer reader / dd rate: {ratio:.2f}x (target >= 0.90x: "
              f"{'met' if ratio >= 0.9 else 'NOT met'})")  # fmt: skip
    raw = results["SmolLM2 (4 shards)"]["dd iflag=direct bs=8M"]
    ft = results["first token"]
    print(
        "\nprocess start to first token, SmolLM2 (runs: "
        + "; ".join(f"{k} {', '.join(f'{x:.2f}' for x in v)}" for k, v in runs.items())
        + ")"
    )
    hft = ft["transformers"]
    print(
        f"  transformers from_pretrained + generate: first token printed {hft:.2f}s "
        f"(exit {ft['transformers exit']:.2f}s)"
    )
    for name, what in (
        ("worker", "`edgeinfer worker`, a 1-token request as soon as it listens"),
        ("forked worker", "the same worker forked from a pool's warm template (edgeinfer pool)"),
        ("generate", "`edgeinfer generate --max-tokens 1`, first token printed"),
    ):
        t = ft[name]
        # the template imported torch and the serving stack before the clock started; the
        # peer's process imports torch and transformers on it: not the like-for-like
        verdict = ("not comparable: imports done before the clock" if name == "forked worker"
                   else f"target >= 3x: {'met' if hft >= 3 * t else 'NOT met'}")  # fmt: skip
        print(
            f"  {what}: {t:.2f}s; raw read {raw:.2f}s + 2 s = {raw + 2:.2f}s "
            f"({'met' if t <= raw + 2 else 'NOT met'}); {hft / t:.2f}x faster than "
            f"transformers ({verdict})"
        )
    print(
        f"  to exit (interpreter teardown included): generate {ft['generate exit']:.2f}s, "
        f"transformers {ft['transformers exit']:.2f}s"
    )
    for name, lines in (("worker", timelines), ("forked worker", forked_timelines)):
        w = runs[name]
        median_run = min(range(len(w)), key=lambda i: abs(w[i] - ft[name]))
        print(f"  the {name}'s own timeline, its median run:", lines[median_run])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
