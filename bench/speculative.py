"""Speculative decoding: tokens/s with and without each proposer (n-gram, draft model), in one run.

Workloads on SmolLM2-135M-Instruct (its chat template), greedy, `ignore_eos` off:
  (a) copy-heavy: rewrite a given paragraph with small edits, and continue a piece of code
      that repeats its input (what agents and editors do: long spans copied from the prompt)
  (b) free-form: write a short story from a one-line premise (little to copy)
Each workload is decoded single-stream (one request at a time) and as a batch of 8, by the same
engine code with speculation off, with n-gram speculation, and with a draft model (default: the
target's first `--draft-layers` layers, a self-speculative draft that needs no second model;
`--draft-model DIR` for another), each with up to `--num-speculative-tokens` (default 4) drafts. Printed per
case: output tokens/s off and on, their ratio, the acceptance rate (drafts accepted / drafts
verified) and the mean accepted drafts per verification; and whether the greedy outputs were
identical (they must be). Targets (issue text): >= 1.8x single-stream on (a); never below 0.95x
on (b).

    .venv/bin/python -m bench.speculative [--max-tokens 192] [--reps 2] [--model DIR]

Each figure is the best of `--reps` runs (a shared machine is noisy); model loading and a
warm-up request are excluded.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.throughput import default_model, machine
from runtime import LLM, SamplingParams

PARAGRAPH = (
    "The harbour town of Merrow wakes before dawn. Fishing boats slip out past the breakwater "
    "while the bakery on Quay Street fires its ovens, and by six the market square is full of "
    "stalls selling mackerel, crab and samphire. Visitors come for the cliffs, the lighthouse "
    "and the long beach at Polmear, but most of them stay for the harbour itself: the slow "
    "rhythm of tides, nets and gulls that has not changed in two hundred years."
)
CODE = '''def area_of_square(side: float) -> float:
    """The area of a square with the given side."""
    if side < 0:
        raise ValueError(f"side must be >= 0, got {side}")
    return side * side


def area_of_rectangle(width: float, height: float) -> float:
    """The area of a rectangle with the given width and height."""
    if width < 0:
        raise ValueError(f"width must be >= 0, got {width}")
    if height < 0:
        raise ValueError(f"height must be >= 0, got {height}")
    return width * height


def perimeter_of_square(side: float) -> float:
    """The perimeter of a square with the given side."""
'''
COPY_PROMPTS = [
    [{"role": "user", "content": "Rewrite this paragraph exactly, but replace the town's name "
      f"Merrow with Kellan:\n\n{PARAGRAPH}"}],
    [{"role": "user", "content": "Repeat this paragraph word for word, changing 'harbour' to "
      f"'port':\n\n{PARAGRAPH}"}],
    [{"role": "user", "content": "Continue this Python module with perimeter_of_rectangle and "
      f"the rest of perimeter_of_square, in the same style:\n\n{CODE}"}],
]  # fmt: skip
STORY_PROMPTS = [
    [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a "
      "message in a bottle."}],
    [{"role": "user", "content": "Tell me a story about a dragon who is afraid of the dark."}],
    [{"role": "user", "content": "Write a story about two friends lost in a forest at night."}],
]  # fmt: skip


@dataclass
class Case:
    tokens_per_s: float  # output tokens / wall seconds (best of reps)
    outputs: list[list[int]]  # greedy token ids, per prompt
    proposed: int  # drafts verified
    accepted: int  # of those, accepted
    verifications: int  # request-steps with drafts


def run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int, reps: int) -> Case:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    spec = llm.engine.spec
    best = 0.0
    outputs: list[list[int]] = []
    p0 = a0 = v0 = 0
    for rep in range(reps):
        if spec is not None and rep == reps - 1:
            p0, a0, v0 = spec.proposed, spec.accepted, spec.steps
        t0 = time.perf_counter()
        outs = []
        for i in range(0, len(prompts), batch):
            outs += llm.generate(prompts[i : i + batch], params)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        best = max(best, n / dt)
        outputs = [o.outputs[0].token_ids for o in outs]
    if spec is None:
        return Case(best, outputs, 0, 0, 0)
    return Case(best, outputs, spec.proposed - p0, spec.accepted - a0, spec.steps - v0)


def truncated_draft(model: Path, layers: int, out: Path) -> Path:
    """A draft made of the target's first `layers` decoder layers (its embeddings, final norm and
    head too): the same tokenizer by construction, ~layers/L of the target's cost per token."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise SystemExit(f"--draft-layers must be in [1, {config['num_hidden_layers']})")
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in model.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja",
                                                         "generation_config.json"):  # fmt: skip
            shutil.copy(f, out / f.name)
    tensors = {}
    for shard in sorted(model.glob("*.safetensors")):
        for name, t in load_file(shard).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                continue
            tensors[name] = t
    save_file(tensors, out / "model.safetensors")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--draft-model", type=Path, default=None,
                    help="the draft proposer's model (default: the target's first "
                    "--draft-layers layers)")  # fmt: skip
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    model = args.model or default_model()
    if args.threads:
        torch.set_num_threads(args.threads)
    kw = {"kv_cache_bytes": 512 << 20, "enable_prefix_caching": False}
    print(f"bench/speculative.py {time.strftime('%Y-%m-%d %H:%M')}, {machine()}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; model {model}",
          flush=True)  # fmt: skip
    base = LLM(str(model), **kw)  # type: ignore[arg-type]
    k = args.num_speculative_tokens
    tmp = tempfile.TemporaryDirectory()
    draft = args.draft_model or truncated_draft(model, args.draft_layers, Path(tmp.name))
    engines = {
        "ngram": LLM(str(model), speculative={"method": "ngram", "num_tokens": k}, **kw),  # type: ignore[arg-type]
        "draft": LLM(str(model), **kw,  # type: ignore[arg-type]
                     speculative={"method": "draft", "num_tokens": k, "draft_model": str(draft)}),
    }  # fmt: skip
    tok = base.engine.tokenizer

    def encode(msgs: list[dict[str, str]]) -> list[int]:
        text = tok.apply_chat_template(msgs, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    workloads = {
        "(a) copy-heavy": [encode(m) for m in COPY_PROMPTS],
        "(b) free-form stories": [encode(m) for m in STORY_PROMPTS],
    }
    warm = SamplingParams(max_tokens=8, temperature=0.0)
    for llm in (base, *engines.values()):
        llm.generate([workloads["(a) copy-heavy"][0]], warm)

    rows = []
    for name, prompts in workloads.items():
        for label, batch, copies in (("single-stream", 1, 1), ("batch 8", 8, 3)):
            # batch 8: the workload's prompts repeated to fill 8 seats (and then some)
            ps = (prompts * 8 * copies)[: 8 * copies] if batch > 1 else prompts
            print(f"  {name}, {label}: {len(ps)} requests ...", file=sys.stderr, flush=True)
            off = run(base, ps, batch, args.max_tokens, args.reps)
            for method, llm in engines.items():
                on = run(llm, ps, batch, args.max_tokens, args.reps)
                rows.append((name, label, method, off, on, off.outputs == on.outputs))
    tmp.cleanup()

    how = "" if args.draft_model else f" (the target's first {args.draft_layers} layers)"
    print(f"\ngreedy, max_tokens {args.max_tokens}, up to {k} drafts; draft model {draft}{how}; "
          f"best of {args.reps} runs\n")  # fmt: skip
    head = (f"{'workload':24} {'mode':14} {'proposer':8} {'off tok/s':>9} {'on tok/s':>9} "
            f"{'ratio':>6} {'accepted':>9} {'mean acc':>8} {'same out':>8}  target")  # fmt: skip
    print(head)
    print("-" * len(head))
    for name, label, method, off, on, same in rows:
        ratio = on.tokens_per_s / off.tokens_per_s
        rate = on.accepted / on.proposed if on.proposed else 0.0
        mean = on.accepted / on.verifications if on.verifications else 0.0
        target = ""
        if method == "ngram" and name.startswith("(a)") and label == "single-stream":
            target = f">= 1.8x {'PASS' if ratio >= 1.8 else 'FAIL'}"
        elif name.startswith("(b)"):
            target = f">= 0.95x {'PASS' if ratio >= 0.95 else 'FAIL'}"
        print(f"{name:24} {label:14} {method:8} {off.tokens_per_s:9.1f} {on.tokens_per_s:9.1f} "
              f"{ratio:5.2f}x {rate:8.0%} {mean:8.2f} {'yes' if same else 'NO':>8}  {target}")  # fmt: skip
    return 0 if all(r[5] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
