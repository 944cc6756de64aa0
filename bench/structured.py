"""Structured output: what constrained decoding costs, and the two grammar engines side by side.

(1) Engine throughput on SmolLM2-135M-Instruct, greedy, output tokens/s of a batch of B requests
    (B = 1 and 32), unconstrained against constrained by a JSON schema (an array of at least 50
    person records: nested object, enum, integer range, bounded strings, so no request finishes
    before `--max-tokens` and both runs decode the same number of tokens). Constrained decoding
    fills each request's token mask on a helper thread while the forward pass runs and applies it
    in the sampler (runtime/structured_decoding.py). Target (issue 12): constrained costs <= 10%
    of unconstrained throughput at batch 32.
(2) Per-token mask time of llguidance (ours) and xgrammar (the peer) on SmolLM2's 49k-token
    vocabulary, along the token sequence of a document the schema accepts (the constrained run's
    own output), one mask per token as the engine computes it; compile time of the schema; and
    coverage: which JSON-schema keywords each engine enforces, refuses (an error: a 400 for the
    client) or silently ignores (output that violates the schema gets through).

    .venv/bin/python -m bench.structured [--max-tokens 64] [--reps 2] [--model DIR]

Each throughput figure is the best of `--reps` runs; model loading and a warm-up are excluded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.throughput import default_model, machine
from runtime import LLM, SamplingParams
from runtime.structured import JSON_OPTIONS, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "doctor", "teacher", "artist"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": PERSON, "minItems": 50}
PROMPT = [{"role": "user", "content": "List fifty people as JSON: name, age, role, address."}]
# JSON-schema keywords and a document each forbids (None: only the keyword's compile is tested)
FEATURES: list[tuple[str, dict[str, Any], str | None]] = [
    ("pattern", {"type": "string", "pattern": "^[a-z]{3}$"}, '"abcd"'),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, '"abcd"'),
    ("minimum/maximum", {"type": "integer", "minimum": 3, "maximum": 17}, "18"),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, "0"),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, "7"),
    ("minItems/maxItems", {"type": "array", "maxItems": 1}, "[1, 2]"),
    ("enum", {"enum": ["x", 1]}, '"y"'),
    ("const", {"const": "k"}, '"j"'),
    ("anyOf", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, "true"),
    ("oneOf", {"oneOf": [{"type": "string"}, {"type": "integer"}]}, "true"),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 2}]}, "1"),
    ("$ref/$defs", {"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p"}, '"a"'),
    (
        "recursive $ref",
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                }
            },
            "$ref": "#/$defs/n",
        },
        '{"c": [1]}',
    ),
    ("required", {"type": "object", "properties": {"a": {}}, "required": ["a"]}, "{}"),
    ("additionalProperties", {"type": "object", "additionalProperties": False}, '{"a": 1}'),
    ("format date-time", {"type": "string", "format": "date-time"}, '"noon"'),
    ("format email", {"type": "string", "format": "email"}, '"zzz"'),
    ("format uuid", {"type": "string", "format": "uuid"}, '"abc"'),
    (
        "patternProperties",
        {
            "type": "object",
            "patternProperties": {"^x": {"type": "integer"}},
            "additionalProperties": False,
        },
        '{"xa": "s"}',
    ),
    ("minProperties", {"type": "object", "minProperties": 1}, "{}"),
    (
        "prefixItems",
        {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
        '["a"]',
    ),
    ("uniqueItems", {"type": "array", "uniqueItems": True}, "[1, 1]"),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, '{"A": 1}'),
    ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ("not", {"not": {"type": "string"}}, '"a"'),
    ("if/then", {"if": {"type": "integer"}, "then": {"minimum": 0}}, "-5"),
]


def throughput(
    llm: LLM, prompt: list[int], batch: int, max_tokens: int, constrained: bool, reps: int
) -> tuple[float, list[int]]:
    """Best output tokens/s of `batch` identical greedy requests; the first request's tokens."""
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, structured_outputs=so
    )
    llm.generate(
        [prompt] * batch, SamplingParams(max_tokens=4, temperature=0, structured_outputs=so)
    )  # warm-up
    best, tokens = 0.0, []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = llm.generate([prompt] * batch, params)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        best, tokens = max(best, n / dt), outs[0].outputs[0].token_ids
    return best, tokens


def mask_times(model: Path, tokens: list[int], vocab: int) -> dict[str, dict[str, float]]:
    """Per-token mask fill time (microseconds) and compile time (ms) of each engine."""
    import llguidance
    import llguidance.numpy as llg_np
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from runtime.tokenizer import Tokenizer

    out: dict[str, dict[str, float]] = {}
    tok = Tokenizer.from_dir(model)
    lltok = llguidance.LLTokenizer(
        tok.to_json_str(), n_vocab=vocab, eos_token=sorted(tok.eos_token_ids)
    )
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    m = llguidance.LLMatcher(lltok, grammar)
    compile_ms = (time.perf_counter() - t0) * 1e3
    rows = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)

    def run_llg() -> list[float]:
        m.reset()
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            llg_np.fill_next_token_bitmask(m, rows, 0)
            times.append(time.perf_counter() - t0)
            assert m.consume_token(t), m.get_error()
        return times

    out["llguidance"] = _summary([run_llg() for _ in range(3)], compile_ms)

    hf = AutoTokenizer.from_pretrained(model)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": ")
    )
    compile_ms = (time.perf_counter() - t0) * 1e3
    xm = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def run_xgr() -> list[float]:
        xm.reset()
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            xm.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter() - t0)
            assert xm.accept_token(t)
        return times

    out["xgrammar"] = _summary([run_xgr() for _ in range(3)], compile_ms)
    return out


def _summary(runs: list[list[float]], compile_ms: float) -> dict[str, float]:
    best = np.array(min(runs, key=sum)) * 1e6  # the least disturbed pass
    return {
        "mean_us": float(best.mean()),
        "p50_us": float(np.median(best)),
        "p99_us": float(np.percentile(best, 99)),
        "compile_ms": compile_ms,
    }


def coverage(model: Path, vocab: int) -> list[tuple[str, str, str]]:
    """(keyword, llguidance, xgrammar): each "enforced", "refused" or "IGNORED"."""
    import llguidance
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    eos = sorted(tok.eos_token_ids)
    lltok = llguidance.LLTokenizer(tok.to_json_str(), n_vocab=vocab, eos_token=eos)
    hf = AutoTokenizer.from_pretrained(model)
    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab), max_threads=1
    )
    rows = []
    for name, schema, bad in FEATURES:
        ids = [*tok.encode(bad or "", add_special_tokens=False), eos[0]]
        m = llguidance.LLMatcher(
            lltok, llguidance.LLMatcher.grammar_from_json_schema(schema), log_level=0
        )
        llg = "refused" if m.is_error() else ("IGNORED" if m.consume_tokens(ids) else "enforced")
        try:
            xm = xgr.GrammarMatcher(
                compiler.compile_json_schema(json.dumps(schema), strict_mode=False)
            )
            x = "IGNORED" if all(xm.accept_token(t) for t in ids) else "enforced"
        except Exception:
            x = "refused"
        rows.append((name, llg, x))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="HF model folder (default: runtime.model_cache's SmolLM2)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    model = Path(args.model) if args.model else default_model()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"bench/structured.py {time.strftime('%Y-%m-%d %H:%M')}, {machine()}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; model {model.name}"
    )
    llm = LLM(model, kv_cache_bytes=1 << 30)
    vocab = llm.engine.model.cfg.vocab_size
    prompt = llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template(PROMPT), add_special_tokens=False
    )
    print(
        f"\n(1) greedy, {args.max_tokens} output tokens per request, schema: an array of >= 50 "
        "person records\n"
    )
    head = f"{'batch':>5} | {'unconstrained tok/s':>19} | {'constrained tok/s':>17} | ratio | cost"
    print(head + "\n" + "-" * len(head))
    tokens: list[int] = []
    for batch in (int(b) for b in args.batches.split(",")):
        print(f"  batch {batch} ...", file=sys.stderr, flush=True)
        free, _ = throughput(llm, prompt, batch, args.max_tokens, False, args.reps)
        bound, tokens = throughput(llm, prompt, batch, args.max_tokens, True, args.reps)
        print(
            f"{batch:>5} | {free:>19.1f} | {bound:>17.1f} | {bound / free:5.3f} | "
            f"{(1 - bound / free) * 100:+.1f}%"
        )
    text = llm.tokenizer.decode(tokens)
    print(f"\nconstrained output (request 0): {text[:100]!r}...")

    print(
        "\n(2) per-token mask time along that output, one request, SmolLM2's vocabulary "
        f"({vocab})\n"
    )
    times = mask_times(model, tokens, vocab)
    head = f"{'engine':>10} | {'mean us':>8} | {'p50 us':>7} | {'p99 us':>7} | {'compile ms':>10}"
    print(head + "\n" + "-" * len(head))
    for name, t in times.items():
        print(
            f"{name:>10} | {t['mean_us']:8.1f} | {t['p50_us']:7.1f} | {t['p99_us']:7.1f} | "
            f"{t['compile_ms']:10.1f}"
        )
    ratio = times["llguidance"]["mean_us"] / times["xgrammar"]["mean_us"]
    print(f"llguidance / xgrammar mean mask time: {ratio:.2f}x")

    print("\n(3) JSON-schema keyword coverage (a document the keyword forbids, fed to each)\n")
    rows = coverage(model, vocab)
    print(f"{'keyword':>22} | {'llguidance':>10} | {'xgrammar':>10}")
    for name, a, b in rows:
        print(f"{name:>22} | {a:>10} | {b:>10}")
    for engine, col in (("llguidance", 1), ("xgrammar", 2)):
        counts = {k: sum(r[col] == k for r in rows) for k in ("enforced", "refused", "IGNORED")}
        print(f"{engine}: {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
