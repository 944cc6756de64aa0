"""Offline throughput: edgeinfer against `transformers` and the machine's matmul roofline.

The workload (issue text): SmolLM2-135M-Instruct, 64 requests all arriving at once, prompt
lengths uniform in [32, 512] and output lengths uniform in [64, 256] (fixed seed). Every
request decodes greedily with `ignore_eos` and generates exactly its output length, so every
engine does the same work. Prompts are real text: a public-domain passage, tokenized with the
model's tokenizer and repeated, each request starting at a different offset (so no two prompts
share a prefix and a prefix cache gains nothing); `--prompt-source random` draws ids instead.

Figures, measured in one process on the same torch threads and dtype:

- edgeinfer: output tokens/s of `LLM.generate` over the whole workload.
- transformers: output tokens/s of `generate` at its best batch size. Requests are sorted by
  output length, cut into batches, left-padded; each batch generates to its longest output
  (`min_new_tokens = max_new_tokens`) and only the tokens each request asked for count.
- roofline: FLOP/s of a bare matmul loop over the model's own weight shapes (q, k, v, o,
  gate, up, down per layer, and lm_head) at M rows, the best of `F.linear`, oneDNN's matmul on
  weights in its own layout and edgeinfer's few-row kernel (`MatmulLoop`; each is printed: on
  an AMD CPU the other two beat `F.linear` by up to 1.5x). Decode roofline tokens/s = FLOP/s at
  M = 64 (the decode batch) / (2 x parameters touched per output token). The workload ceiling
  is the best output tokens/s any engine could reach on this workload: its total FLOPs (prompt
  and output tokens, linear layers and attention) at the best matmul rate measured.
- single-request decode: prompt of 32 tokens, 128 output tokens, batch 1. Decode-only rate:
  (128 - 1) tokens / (time to generate 128 - time to generate 1), medians of a few runs.

A 1 s run of the matmul loop before and after each timed phase flags phases during which the
machine ran at another speed (a shared or throttled host); their figures need a rerun.

Run from the repository root: `python -m bench.throughput [--quick] [--json out.json]`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):  # run as `python bench/throughput.py`: make `runtime` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# runtime first: the OpenMP settings it makes (runtime/__init__.py) hold for torch in this
# process, so edgeinfer and transformers run on the same threads as the CLI would give them
import runtime  # noqa: F401, I001
import torch
import torch.nn.functional as F

from bench.texts import ALICE as PROMPT_TEXT

PARTS = ("roofline", "transformers", "edgeinfer")
ROOFLINE_ROUNDS = 3  # interleaved rounds of each matmul backend; each backend's median counts
TARGET_VS_TRANSFORMERS = 3.0  # edgeinfer / transformers at its best batch size
TARGET_VS_ROOFLINE = 0.5  # edgeinfer / decode roofline
TARGET_SINGLE_DECODE = 2.0  # edgeinfer / transformers, batch 1 decode

# Generate token ids for prompts; each prompt generates exactly its output length.
GenerateFn = Callable[[list[list[int]], list[int]], list[list[int]]]
T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    num_requests: int  # all arrive at once
    prompt_len: tuple[int, int]  # inclusive range of prompt lengths
    output_len: tuple[int, int]  # inclusive range of output lengths
    single_prompt_len: int  # single-request decode: prompt length
    single_output_len: int  # single-request decode: tokens generated


FULL = WorkloadSpec(64, (32, 512), (64, 256), 32, 128)
QUICK = WorkloadSpec(16, (32, 128), (16, 64), 32, 32)


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]  # prompt token ids, one list per request
    output_lens: list[int]  # tokens each request generates (greedy, ignore_eos)
    single_prompt: list[int]  # prompt of the single-request decode figure
    single_output_len: int  # tokens the single request generates
    note: str  # where prompt ids came from, and any clamping to the context


@dataclass(slots=True, frozen=True)
class ModelShapes:
    """The dimensions of a Llama-style model that decide its FLOPs, read from config.json."""

    layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ModelShapes:
        cfg = json.loads((model_dir / "config.json").read_text())
        n_heads = int(cfg["num_attention_heads"])
        return cls(
            layers=int(cfg["num_hidden_layers"]),
            hidden=int(cfg["hidden_size"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads),
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            max_positions=int(cfg.get("max_position_embeddings") or 2048),
        )

    def layer_linears(self) -> list[tuple[int, int]]:
        """(out_features, in_features) of q, k, v, o, gate, up, down."""
        h, f = self.hidden, self.intermediate
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return [(q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)]

    @property
    def layer_params(self) -> int:
        """Linear weights of all decoder layers (norms and embeddings aside)."""
        return self.layers * sum(o * i for o, i in self.layer_linears())

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params_per_output_token(self) -> int:
        return self.layer_params + self.lm_head_params

    def request_flops(self, prompt_len: int, output_len: int) -> tuple[float, float]:
        """(prompt-phase, decode-phase) FLOPs of one request, linear layers plus attention.

        The prompt phase runs all prompt tokens through the layers and lm_head once (the first
        output token); the decode phase feeds back the other output_len - 1 tokens. A token at
        position t attends to t + 1 keys: 4 (t + 1) n_heads head_dim FLOPs per layer.
        """
        attn = 4 * self.layers * self.n_heads * self.head_dim
        fed = prompt_len + output_len - 1  # tokens through the layers
        prompt = 2 * (prompt_len * self.layer_params + self.lm_head_params)
        prompt += attn * prompt_len * (prompt_len + 1) // 2
        decode = 2 * (output_len - 1) * self.params_per_output_token
        decode += attn * (fed * (fed + 1) - prompt_len * (prompt_len + 1)) // 2
        return float(prompt), float(decode)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- workload


def text_token_ids(model_dir: Path) -> list[int] | None:
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(path)).encode(PROMPT_TEXT, add_special_tokens=False).ids)


def special_ids(model_dir: Path) -> set[int]:
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return set()
    added = json.loads(path.read_text()).get("added_tokens", [])
    return {int(t["id"]) for t in added if t.get("special")}


def make_workload(
    spec: WorkloadSpec, shapes: ModelShapes, model_dir: Path, seed: int, source: str
) -> Workload:
    rng = random.Random(seed)
    (p_lo, p_hi), (o_lo, o_hi) = spec.prompt_len, spec.output_len
    notes: list[str] = []
    if p_hi + o_hi > shapes.max_positions:  # a small test model: scale both ranges to fit
        scale = shapes.max_positions / (p_hi + o_hi)
        p_lo, p_hi = max(1, int(p_lo * scale)), int(p_hi * scale)
        o_lo, o_hi = max(1, int(o_lo * scale)), int(o_hi * scale)
        notes.append(
            f"lengths scaled by {scale:.3f} to fit the model's context of {shapes.max_positions}"
        )
    prompt_lens = [rng.randint(p_lo, p_hi) for _ in range(spec.num_requests)]
    output_lens = [rng.randint(o_lo, o_hi) for _ in range(spec.num_requests)]
    text = text_token_ids(model_dir) if source == "text" else None
    n_prompts = spec.num_requests + 1  # the last one is the single-request prompt
    if text is not None and len(text) >= n_prompts:
        notes.append(f"prompts: a {len(text)}-token text repeated, from distinct offsets")
        offsets = rng.sample(range(len(text)), n_prompts)

        def prompt(i: int, n: int) -> list[int]:
            return [text[(offsets[i] + j) % len(text)] for j in range(n)]

    else:
        if source == "text":
            notes.append("no usable tokenizer.json, so")
        notes.append("prompts: ids uniform over the vocabulary less special ids")
        pool = sorted(set(range(shapes.vocab)) - special_ids(model_dir))
        ids = [[rng.choice(pool) for _ in range(p_hi)] for _ in range(n_prompts)]

        def prompt(i: int, n: int) -> list[int]:
            return ids[i][:n]

    single_out = min(spec.single_output_len, shapes.max_positions - spec.single_prompt_len)
    return Workload(
        prompts=[prompt(i, n) for i, n in enumerate(prompt_lens)],
        output_lens=output_lens,
        single_prompt=prompt(spec.num_requests, spec.single_prompt_len),
        single_output_len=single_out,
        note="; ".join(notes),
    )


# ---------------------------------------------------------------- roofline


class MatmulLoop:
    """A matmul over every weight shape of the model: the roofline's bare compute.

    Every layer has its own weights, as in the model, so weights stream from memory as they do
    in a forward pass rather than sitting in cache. Backends (`BACKENDS`): `torch`
    (`F.linear`), `onednn` (oneDNN's matmul on weights reordered once into its own layout, the
    fastest it offers) and `kernel` (edgeinfer's few-row C++ kernel, up to its rows). The
    roofline is the best of them: on a CPU where one beats `F.linear`, `F.linear` alone is not
    the machine's limit.
    """

    BACKENDS = ("torch", "onednn", "kernel")

    def __init__(self, shapes: ModelShapes, dtype: torch.dtype) -> None:
        per_model = shapes.layer_linears() * shapes.layers + [(shapes.vocab, shapes.hidden)]
        self.dtype = dtype
        self.weights = [torch.randn(o, i, dtype=dtype) * 0.02 for o, i in per_model]

    def product(
        self, backend: str, rows: int
    ) -> Callable[[torch.Tensor, int], torch.Tensor] | None:
        """f(x, i): x times weight i through `backend` at `rows` rows; None where it does not
        run here (no oneDNN; no kernel built, or more rows than it takes)."""
        if backend == "torch":
            return lambda x, i: F.linear(x, self.weights[i])
        if backend == "onednn":
            if not torch.backends.mkldnn.is_available() or (
                self.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
            ):  # (its bfloat16 reorder needs AVX-512 or AVX-NE-CONVERT)
                return None
            ops = torch.ops.mkldnn
            packed = [ops._reorder_linear_weight(w, rows) for w in self.weights]
            return lambda x, i: ops._linear_pointwise(x, packed[i], None, "none", [], "")
        from kernels import cpu_ext
        from kernels.linear import max_rows

        ext = cpu_ext.load_small_gemm()
        if ext is None or rows > max_rows(self.weights[0], self.dtype):
            return None
        if self.dtype == torch.bfloat16:
            return lambda x, i: ext.small_linear(x.float(), self.weights[i], None)
        return lambda x, i: ext.small_linear(x, self.weights[i], None)

    def flops_per_s(self, rows: int, seconds: float, backend: str = "torch") -> float | None:
        """FLOP/s over passes through all weights, each with `rows` input rows, for `seconds`;
        None where `backend` does not run at `rows` rows here."""
        product = self.product(backend, rows)
        if product is None:
            return None
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=self.dtype) for w in self.weights}
        xs = [inputs[w.shape[1]] for w in self.weights]
        flops_per_pass = 2 * rows * sum(w.numel() for w in self.weights)
        with torch.inference_mode():
            for i, x in enumerate(xs):  # warm-up pass
                product(x, i)
            passes, start = 0, time.perf_counter()
            while passes < 2 or time.perf_counter() - start < seconds:
                for i, x in enumerate(xs):
                    product(x, i)
                passes += 1
            elapsed = time.perf_counter() - start
        return flops_per_pass * passes / elapsed


class SpeedWatch:
    """Times a short matmul loop before and after each phase, against the one at the start.

    A shared or throttled machine can slow down for minutes at a time; a phase whose checks
    moved by more than `tolerance` ran on a different machine than the others.
    """

    tolerance = 0.15
    seconds = 1.0

    def __init__(self, loop: MatmulLoop, rows: int, reference: float | None = None) -> None:
        self.loop, self.rows = loop, rows
        self.reference = reference or self._rate()
        self.checks: dict[str, tuple[float, float]] = {}  # phase -> (before, after) vs reference

    def _rate(self) -> float:
        rate = self.loop.flops_per_s(self.rows, self.seconds)  # F.linear: runs everywhere
        assert rate is not None
        return rate

    def around(self, phase: str, fn: Callable[[], T]) -> T:
        before = self._rate() / self.reference - 1
        result = fn()
        after = self._rate() / self.reference - 1
        self.checks[phase] = (before, after)
        if max(abs(before), abs(after)) > self.tolerance:
            log(f"warning: machine speed {before:+.0%} / {after:+.0%} around {phase}")
        return result


# ---------------------------------------------------------------- engines


def hf_generate_fn(model: Any, batch_size: int, pad_id: int) -> GenerateFn:
    """`transformers` generate over left-padded batches of requests sorted by output length."""

    def generate(prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        order = sorted(range(len(prompts)), key=lambda i: (output_lens[i], len(prompts[i])))
        results: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            width = max(len(prompts[i]) for i in batch)
            new = max(output_lens[i] for i in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # (B, T)
            mask = torch.zeros((len(batch), width), dtype=torch.long)  # (B, T)
            for row, i in enumerate(batch):
                ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]) :] = 1
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=pad_id,
                    use_cache=True,
                )  # (B, T + new)
            for row, i in enumerate(batch):
                results[i] = out[row, width : width + output_lens[i]].tolist()
            if len(prompts) > batch_size:  # not for warm-up and single requests
                log(f"  transformers batch {batch_size}: {start + len(batch)}/{len(order)} done")
        return results

    return generate


def edgeinfer_generate_fn(
    model_dir: Path, dtype: str, engine_args: dict[str, Any]
) -> tuple[GenerateFn, float, tuple[int, int, int]]:
    """edgeinfer's offline API, greedy with ignore_eos. Returns the function, its load time and
    (weight matrices packed, not packed, bytes of the packed blocks)."""
    from runtime import LLM, SamplingParams

    start = time.perf_counter()
    # Prefix caching off: no two workload prompts share a block by design, and a warm-up call or
    # a repeated single-request run must not hand edgeinfer cached prompt blocks.
    llm = LLM(model_dir, dtype=dtype, enable_prefix_caching=False, **engine_args)
    load_s = time.perf_counter() - start

    def generate(prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in output_lens]
        outs = llm.generate(prompts, params, progress=len(prompts) > 1)
        return [list(o.outputs[0].token_ids) for o in outs]

    llm.engine.runner.wait_packed()  # the background search: before the warm-up and timing
    return generate, load_s, llm.engine.model.packed_weights()


# ---------------------------------------------------------------- measurements


@dataclass(slots=True)
class Run:
    seconds: float  # wall time of the whole generate call(s)
    output_tokens: int  # tokens asked for (and produced)
    token_ids: list[list[int]]  # what each request generated, in workload order

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def timed_run(generate: GenerateFn, workload: Workload, engine: str) -> Run:
    start = time.perf_counter()
    token_ids = generate(workload.prompts, workload.output_lens)
    seconds = time.perf_counter() - start
    short = [
        i
        for i, (t, m) in enumerate(zip(token_ids, workload.output_lens, strict=True))
        if len(t) != m
    ]
    if short:  # the comparison is only fair if every engine did the same work
        raise RuntimeError(f"{engine}: {len(short)} requests did not generate exactly max_tokens")
    return Run(seconds, sum(workload.output_lens), token_ids)


def single_decode_rate(generate: GenerateFn, workload: Workload, reps: int) -> float:
    """Decode-only tokens/s of one request: (n - 1) / (t(n tokens) - t(1 token)), medians."""

    def median_time(n: int) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            generate([workload.single_prompt], [n])
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    n = workload.single_output_len
    first = median_time(1)
    return (n - 1) / (median_time(n) - first)


def warm_up(generate: GenerateFn, workload: Workload) -> None:
    generate([workload.prompts[0][:16], workload.prompts[1][:24]], [4, 6])


def common_prefix_fraction(a: Sequence[int], b: Sequence[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return n / max(len(a), 1)


# ---------------------------------------------------------------- the run


def machine() -> str:
    """CPU model and count, e.g. 'AMD EPYC, 2 CPUs' (Linux; the architecture elsewhere)."""
    name = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} CPUs"


def default_model() -> Path:
    try:
        from runtime.model_cache import default_model_dir
    except ImportError as e:
        raise SystemExit(f"no --model given and runtime.model_cache is unavailable ({e})") from e
    return Path(default_model_dir())


def measure_roofline(
    loop: MatmulLoop, shapes: ModelShapes, workload: Workload, args: argparse.Namespace
) -> dict[str, Any]:
    # Each backend's median over ROOFLINE_ROUNDS rounds, the backends interleaved (a slow
    # stretch of a shared host hits them all), then the best median: the max of single noisy
    # samples would lift the roofline by the noise.
    rates: dict[int, float] = {}
    by_backend: dict[str, dict[str, float]] = {}
    for rows in sorted({args.roofline_rows, args.prefill_rows}):
        log(f"roofline: {', '.join(MatmulLoop.BACKENDS)} matmuls over the model's weights, "
            f"M={rows} rows, {args.dtype}, {ROOFLINE_ROUNDS} rounds")  # fmt: skip
        samples: dict[str, list[float]] = {}
        for _ in range(ROOFLINE_ROUNDS):
            for backend in MatmulLoop.BACKENDS:
                rate = loop.flops_per_s(rows, args.roofline_seconds / ROOFLINE_ROUNDS, backend)
                gc.collect()  # oneDNN's reordered copy of the weights
                if rate is not None:
                    samples.setdefault(backend, []).append(rate)
        for backend, rs in samples.items():
            by_backend.setdefault(backend, {})[str(rows)] = statistics.median(rs)
        rates[rows] = max(by_backend[b][str(rows)] for b in samples)
    flops = [
        shapes.request_flops(len(p), m)
        for p, m in zip(workload.prompts, workload.output_lens, strict=True)
    ]
    total = sum(a + b for a, b in flops)
    return {
        "flops_per_s": {str(m): r for m, r in rates.items()},  # the best backend's
        "flops_per_s_by_backend": by_backend,
        "params_per_output_token": shapes.params_per_output_token,
        "decode_rows": args.roofline_rows,
        "decode_tokens_per_s": rates[args.roofline_rows] / (2 * shapes.params_per_output_token),
        "workload_flops": {"prompt": sum(a for a, _ in flops), "decode": sum(b for _, b in flops)},
        "workload_ceiling_tokens_per_s": sum(workload.output_lens) / (total / max(rates.values())),
    }


def measure_transformers(
    model_dir: Path, workload: Workload, args: argparse.Namespace, watch: SpeedWatch
) -> tuple[dict[str, Any], list[list[int]]]:
    """transformers' figures, and the tokens of its best run (to compare greedy outputs)."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    log(f"transformers {transformers.__version__}: loading")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    model.eval()
    if args.weight_dtype == "bfloat16":  # the weights edgeinfer stores, computed in args.dtype
        log("transformers: weights rounded to bfloat16 (as edgeinfer's --weight-dtype stores them)")
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:  # linear weights, embedding, LM head; norms stay
                    p.copy_(p.to(torch.bfloat16).to(p.dtype))
    eos = model.generation_config.eos_token_id
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    runs: dict[int, Run] = {}
    for bs in args.hf_batch_sizes:
        generate = hf_generate_fn(model, bs, pad_id)
        warm_up(generate, workload)
        log(f"transformers: workload at batch size {bs}")
        runs[bs] = watch.around(
            f"transformers batch {bs}",
            lambda: timed_run(generate, workload, f"transformers batch {bs}"),  # noqa: B023
        )
        log(f"transformers batch {bs}: {runs[bs].tokens_per_s:.1f} output tok/s")
    best = max(runs, key=lambda b: runs[b].tokens_per_s)
    log("transformers: single-request decode")
    single = watch.around(
        "transformers single request",
        lambda: single_decode_rate(hf_generate_fn(model, 1, pad_id), workload, args.single_reps),
    )
    return {
        "version": transformers.__version__,
        "tokens_per_s_by_batch_size": {str(b): r.tokens_per_s for b, r in runs.items()},
        "seconds_by_batch_size": {str(b): r.seconds for b, r in runs.items()},
        "best_batch_size": best,
        "tokens_per_s": runs[best].tokens_per_s,
        "single_decode_tokens_per_s": single,
    }, runs[best].token_ids


def measure_edgeinfer(
    model_dir: Path,
    workload: Workload,
    args: argparse.Namespace,
    watch: SpeedWatch,
    hf_tokens: list[list[int]] | None,
) -> dict[str, Any] | None:
    """edgeinfer's figures; None when the engine cannot be imported yet."""
    engine_args = {
        k: v
        for k, v in (
            ("max_num_seqs", args.max_num_seqs),
            ("max_num_batched_tokens", args.max_num_batched_tokens),
            ("kv_cache_bytes", args.kv_cache_bytes),
            ("weight_dtype", None if args.weight_dtype == "auto" else args.weight_dtype),
            ("kv_cache_commit", args.kv_cache_commit),
            ("packed_weights", False if args.no_packed_weights else None),
            ("kv_cache_dtype", None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype),
        )
        if v is not None
    }
    try:
        log(f"edgeinfer: loading ({engine_args or 'engine defaults'})")
        generate, load_s, packed = edgeinfer_generate_fn(model_dir, args.dtype, engine_args)
    except ImportError as e:
        log(f"edgeinfer: unavailable ({e}); its rows stay empty")
        return None
    warm_up(generate, workload)
    log("edgeinfer: workload")
    run = watch.around("edgeinfer", lambda: timed_run(generate, workload, "edgeinfer"))
    log(f"edgeinfer: {run.tokens_per_s:.1f} output tok/s; single-request decode")
    single = watch.around(
        "edgeinfer single request",
        lambda: single_decode_rate(generate, workload, args.single_reps),
    )
    res: dict[str, Any] = {
        "engine_args": engine_args,
        "load_seconds": load_s,
        "packed_weights": {"packed": packed[0], "dense": packed[1], "bytes": packed[2]},
        "seconds": run.seconds,
        "tokens_per_s": run.tokens_per_s,
        "single_decode_tokens_per_s": single,
    }
    if hf_tokens is not None:  # greedy on the same weights: should mostly agree
        fr = [common_prefix_fraction(a, b) for a, b in zip(run.token_ids, hf_tokens, strict=True)]
        res["greedy_agreement"] = {
            "identical_requests": sum(f == 1.0 for f in fr),
            "mean_common_prefix_fraction": statistics.fmean(fr),
        }
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = set(args.parts.split(","))
    if unknown := parts - set(PARTS):
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; choose from {', '.join(PARTS)}")
    model_dir = Path(args.model) if args.model else default_model()
    shapes = ModelShapes.from_model_dir(model_dir)
    spec = QUICK if args.quick else FULL
    workload = make_workload(spec, shapes, model_dir, args.seed, args.prompt_source)
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "weight_dtype": args.weight_dtype,
        "model": str(model_dir),
        "shapes": asdict(shapes),
        "workload": {
            "spec": asdict(spec),
            "seed": args.seed,
            "note": workload.note,
            "prompt_tokens": sum(map(len, workload.prompts)),
            "output_tokens": sum(workload.output_lens),
        },
    }
    log(f"model {model_dir}; {torch.get_num_threads()} threads; {args.dtype}; {workload.note}")

    loop = MatmulLoop(shapes, getattr(torch, args.dtype))
    reference = None
    if "roofline" in parts:
        res["roofline"] = measure_roofline(loop, shapes, workload, args)
        reference = res["roofline"]["flops_per_s_by_backend"]["torch"][str(args.roofline_rows)]
    watch = SpeedWatch(loop, args.roofline_rows, reference)
    hf_tokens = None
    if "transformers" in parts:
        res["transformers"], hf_tokens = measure_transformers(model_dir, workload, args, watch)
        gc.collect()
    if "edgeinfer" in parts and (
        ei := measure_edgeinfer(model_dir, workload, args, watch, hf_tokens)
    ):
        res["edgeinfer"] = ei
    res["speed_checks"] = watch.checks
    res["speed_reference_flops_per_s"] = watch.reference
    return res


# ---------------------------------------------------------------- the report


def ratio_row(
    name: str, value: float | None, peer: str, peer_value: float | None, target: float | None
) -> list[str]:
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f}"

    ratio = None if value is None or not peer_value else value / peer_value
    if target is None:
        verdict = "info"
    elif ratio is None:
        verdict = "to be measured"
    else:
        verdict = "PASS" if ratio >= target else "FAIL"
    return [
        name,
        fmt(value),
        peer,
        fmt(peer_value),
        "-" if ratio is None else f"{ratio:.2f}x",
        "-" if target is None else f">= {target:g}x",
        verdict,
    ]


def report(res: dict[str, Any]) -> str:
    ei, hf, rl = res.get("edgeinfer", {}), res.get("transformers", {}), res.get("roofline", {})
    wl = res["workload"]
    lines = [
        f"edgeinfer throughput bench, {res['date']}, {res['machine']}, torch {res['torch']}, "
        f"{res['threads']} threads, {res['dtype']}",
        f"model {res['model']}",
        *(
            [f"weights rounded to {res['weight_dtype']} for both engines: edgeinfer stores them so "
             f"(--weight-dtype), transformers computes {res['dtype']} on the same values"]
            if res.get("weight_dtype", "auto") != "auto"
            else []
        ),
        f"workload: {wl['spec']['num_requests']} requests, {wl['prompt_tokens']} prompt tokens, "
        f"{wl['output_tokens']} output tokens, seed {wl['seed']}; {wl['note']}",
        "",
    ]
    if hf:
        lines.append(f"transformers {hf['version']} output tok/s by batch size:")
        for b, r in hf["tokens_per_s_by_batch_size"].items():
            lines.append(f"  batch {b:>3}: {r:8.1f} tok/s ({hf['seconds_by_batch_size'][b]:.1f} s)")
    if rl:
        lines.append("matmul loop over the model's linear shapes, GFLOP/s (the roofline: the best):")
        for m, r in rl["flops_per_s"].items():
            each = ", ".join(
                f"{b} {by[m] / 1e9:.1f}" for b, by in rl.get("flops_per_s_by_backend", {}).items()
                if m in by
            )  # fmt: skip
            lines.append(f"  M={m:>4} rows: {r / 1e9:8.2f} ({each})")
        w = rl["workload_flops"]
        lines.append(
            f"  decode roofline (M={rl['decode_rows']}, 2 x {rl['params_per_output_token'] / 1e6:.1f}M"
            f" params per token): {rl['decode_tokens_per_s']:.1f} tok/s"
        )
        lines.append(
            f"  workload ceiling ({(w['prompt'] + w['decode']) / 1e12:.2f} TFLOP incl. prompts and "
            f"attention, at the best rate): {rl['workload_ceiling_tokens_per_s']:.1f} output tok/s"
        )
    if checks := res.get("speed_checks"):
        lines.append("machine speed before / after each phase (short matmul loop vs the start):")
        for phase, (before, after) in checks.items():
            off = max(abs(before), abs(after)) > SpeedWatch.tolerance
            warn = "  WARNING: the machine's speed changed; rerun" if off else ""
            ref = res["speed_reference_flops_per_s"] / 1e9  # absolute, to spot a slow start
            gflops = f"{ref * (1 + before):.0f} / {ref * (1 + after):.0f} GFLOP/s"
            lines.append(f"  {phase:<28} {before:+4.0%} / {after:+4.0%} ({gflops}){warn}")
    if ei.get("load_seconds") is not None:
        commit = ei.get("engine_args", {}).get("kv_cache_commit", "lazy")
        lines.append(
            f"edgeinfer start-up (not timed in its figures): {ei['load_seconds']:.1f} s, its KV "
            f"cache committed {'at start-up' if commit == 'eager' else 'as blocks are first used'}"
            f" (--kv-cache-commit {commit})"
        )
    if ei.get("packed_weights"):
        pw = ei["packed_weights"]
        lines.append(
            f"edgeinfer weights: {pw['packed']} of {pw['packed'] + pw['dense']} matrices read by "
            f"few-row matmuls as their exact GGUF (Q4 / Q5 / Q6_K / Q8_0) blocks ({pw['bytes'] / 1e6:.0f} "
            "MB; --no-packed-weights: the float32 weights as they are)"
            if pw["packed"]
            else "edgeinfer weights: read as they are (no exact GGUF (Q4 / Q5 / Q6_K / Q8_0) blocks found, "
            "or packing off or not applicable: bfloat16, CUDA, no AVX-512)"
        )
    if ei.get("greedy_agreement"):
        g = ei["greedy_agreement"]
        lines.append(
            f"greedy agreement with transformers: {g['identical_requests']} requests identical, "
            f"mean common prefix {g['mean_common_prefix_fraction']:.0%}"
        )
    best = f"transformers (batch {hf['best_batch_size']})" if hf else "transformers"
    rows = [
        ["figure (output tok/s)", "edgeinfer", "peer", "peer tok/s", "ratio", "target", "result"],
        ratio_row("workload throughput", ei.get("tokens_per_s"), best, hf.get("tokens_per_s"),
                  TARGET_VS_TRANSFORMERS),
        ratio_row("workload throughput", ei.get("tokens_per_s"), "decode roofline",
                  rl.get("decode_tokens_per_s"), TARGET_VS_ROOFLINE),
        ratio_row("workload throughput", ei.get("tokens_per_s"), "workload ceiling",
                  rl.get("workload_ceiling_tokens_per_s"), None),
        ratio_row("single-request decode", ei.get("single_decode_tokens_per_s"),
                  "transformers (batch 1)", hf.get("single_decode_tokens_per_s"),
                  TARGET_SINGLE_DECODE),
    ]  # fmt: skip
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines.append("")
    for k, r in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="HF model folder (default: runtime.model_cache's SmolLM2)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--weight-dtype",
        choices=("auto", "bfloat16"),
        default="auto",
        help="bfloat16: edgeinfer stores its weights in bfloat16 (--weight-dtype) and\n"
        "transformers runs --dtype on the same weights, rounded to bfloat16",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="16 small requests: a smoke run")
    p.add_argument("--prompt-source", choices=("text", "random"), default="text")
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of " + ", ".join(PARTS))
    p.add_argument(
        "--hf-batch-sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        help="transformers batch sizes to try (default 8,16,32,64; --quick: 4,16)",
    )
    p.add_argument("--roofline-rows", type=int, default=64, help="M of the decode roofline")
    p.add_argument("--prefill-rows", type=int, default=512, help="M of a prefill chunk")
    p.add_argument("--roofline-seconds", type=float, default=0.0, help="per M, split over the backends and rounds (default 5; quick 2)")
    p.add_argument("--single-reps", type=int, default=3, help="repeats of each single-request run")
    p.add_argument("--max-num-seqs", type=int, help="edgeinfer engine argument")
    p.add_argument("--max-num-batched-tokens", type=int, help="edgeinfer engine argument")
    p.add_argument("--kv-cache-bytes", type=int, help="edgeinfer engine argument")
    p.add_argument(
        "--kv-cache-commit", choices=["lazy", "eager"], default="eager",
        help="edgeinfer engine argument (default eager: the KV cache committed at start-up, as a "
        "worker's is once it has served a while; lazy: a fresh process's first pass, paying the "
        "first touch of each page)",
    )  # fmt: skip
    p.add_argument(
        "--no-packed-weights", action="store_true",
        help="edgeinfer engine argument: read the float32 weights as they are, not the exact "
        "Q4_1 / Q8_0 blocks found in the GGUF-imported model's weights (the default reads them)",
    )  # fmt: skip
    p.add_argument(
        "--kv-cache-dtype", choices=["auto", "bfloat16"], default="auto",
        help="edgeinfer engine argument: bfloat16 keeps the KV cache in bfloat16 under the float32 "
        "model (half the bytes decode attention reads; outputs then differ from transformers' by "
        "that rounding: see the greedy agreement line)",
    )  # fmt: skip
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.hf_batch_sizes is None:
        args.hf_batch_sizes = [4, 16] if args.quick else [8, 16, 32, 64]
    if not args.roofline_seconds:
        args.roofline_seconds = 2.0 if args.quick else 5.0
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    res = run(args)
    res["bench_seconds"] = time.perf_counter() - start
    print(report(res))
    print(f"\nbench took {res['bench_seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
