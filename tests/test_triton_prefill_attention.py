"""Prefill attention over packed variable-length chunks reading a paged KV cache
(kernels/triton_prefill_attention.py): the Triton kernel, interpreted on the CPU, against its
PyTorch reference and an unpaged float64 causal computation, request by request, with awkward
lengths, shuffled block tables, fresh prompts, chunked prefill and prefix hits; every bad input
refused before launch with an error naming the argument; the kernel compiled for sm_90.

The caches start as NaN, so a kernel reading a slot outside a sequence's keys (a padding entry
of a block table, a block's unused tail) turns its output into NaN and fails the comparison."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels.triton_prefill_attention import (
    _config,
    _prefill_attention_kernel,
    prefill_attention,
    prefill_attention_ref,
)
from tests.triton_tools import compile_for_hopper, run_interpreted

LENGTHS = (1, 15, 16, 17, 97)

# (q_len, context_len) per sequence, with the layout of the call
CASES: list[dict[str, Any]] = [
    # fresh prompts (context 0), GQA 4
    dict(seqs=[(n, 0) for n in LENGTHS], heads=4, kv_heads=1, head_dim=64, block_size=16),
    # chunked prefill: contexts not block-aligned, every q_len against each; GQA 1, head_dim 80
    dict(
        seqs=[(n, c) for n in LENGTHS for c in (15, 17, 97)],
        heads=2,
        kv_heads=2,
        head_dim=80,
        block_size=8,
    ),
    # prefix hits (context a multiple of block_size), caches as views of one (slots, 2, Hkv, D)
    dict(
        seqs=[(17, 32), (1, 64), (97, 96), (16, 32), (15, 0)],
        heads=4,
        kv_heads=1,
        head_dim=64,
        block_size=32,
        kv_interleaved=True,
    ),
    # stories260K's heads (8 over 4 kv heads of 8): an empty chunk, a grid past the longest chunk
    dict(
        seqs=[(15, 17), (0, 5), (97, 1), (16, 0), (1, 16)],
        heads=8,
        kv_heads=4,
        head_dim=8,
        block_size=16,
        extra_tiles=2,
    ),
    # long: a 500-token prompt, and a 203-token chunk after 297 cached tokens
    dict(seqs=[(500, 0)], heads=2, kv_heads=1, head_dim=64, block_size=16),
    dict(seqs=[(203, 297)], heads=1, kv_heads=1, head_dim=80, block_size=8),
]

FLOOR = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}  # absolute error floor


def _build(seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int,
           block_size: int, dtype: torch.dtype, seed: int = 0, kv_interleaved: bool = False,
           extra_tiles: int = 0) -> dict[str, Any]:  # fmt: skip
    """A call's arguments with each sequence's keys scattered into shuffled blocks of NaN caches,
    and the unpaged keys and values (sequence i: (ctx_i + q_len_i, Hkv, D)) to check against."""
    g = torch.Generator().manual_seed(seed)
    T = sum(n for n, _ in seqs)
    blocks_each = [-(-(n + c) // block_size) for n, c in seqs]
    max_blocks = max(blocks_each) + 1  # a padding entry past every sequence's keys
    num_blocks = sum(blocks_each) + 3
    D = head_dim
    buf = torch.randn(T, heads + 3, D, generator=g).to(dtype)
    q = buf[:, 1 : heads + 1]  # (T, H, D), a strided view as the model's fused qkv gives
    kv = torch.full((num_blocks * block_size, 2, kv_heads, D), float("nan"), dtype=dtype)
    if kv_interleaved:
        k_cache, v_cache = kv[:, 0], kv[:, 1]  # (slots, Hkv, D) views, token stride 2 * Hkv * D
    else:
        k_cache, v_cache = kv[:, 0].contiguous(), kv[:, 1].contiguous()
    order = torch.randperm(num_blocks, generator=g)
    spare = order[-1]  # never holds a key: padding entries point here
    tables = torch.full((len(seqs), max_blocks), int(spare), dtype=torch.int32)
    keys, values, used = [], [], 0
    for i, (n, c) in enumerate(seqs):
        mine = order[used : used + blocks_each[i]]
        used += blocks_each[i]
        tables[i, : len(mine)] = mine.int()
        k = torch.randn(n + c, kv_heads, D, generator=g).to(dtype)  # (L, Hkv, D)
        v = torch.randn(n + c, kv_heads, D, generator=g).to(dtype)
        pos = torch.arange(n + c)
        slots = mine[pos // block_size] * block_size + pos % block_size
        k_cache[slots] = k
        v_cache[slots] = v
        keys.append(k)
        values.append(v)
    starts = [0]
    for n, _ in seqs:
        starts.append(starts[-1] + n)
    max_q = max(n for n, _ in seqs) + extra_tiles * int(_config(D, dtype)["BLOCK_M"])
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                query_start_loc=torch.tensor(starts, dtype=torch.int32),
                context_lens=torch.tensor([c for _, c in seqs], dtype=torch.int32),
                scale=D**-0.5, block_size=block_size, max_query_len=max_q)  # fmt: skip
    return {"args": args, "keys": keys, "values": values, "seqs": seqs}


def _float64(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
             seqs: list[tuple[int, int]], scale: float) -> torch.Tensor:  # fmt: skip
    """Causal attention in float64 over each sequence's unpaged keys."""
    out = torch.empty(q.shape, dtype=torch.float64)
    s = 0
    for (n, c), k, v in zip(seqs, keys, values, strict=True):
        group = q.shape[1] // k.shape[1]
        qi = q[s : s + n].double().transpose(0, 1)  # (H, n, D)
        ki = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
        vi = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qi @ ki.transpose(1, 2) * scale  # (H, n, L)
        visible = torch.arange(n + c)[None, :] <= c + torch.arange(n)[:, None]  # (n, L)
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[s : s + n] = (p @ vi).transpose(0, 1)
        s += n
    return out


def _check_case(dtype: torch.dtype, case: dict[str, Any]) -> str:
    """Kernel and reference against float64; the kernel's error within 4x the reference's."""
    built = _build(dtype=dtype, **case)
    args = built["args"]
    got = prefill_attention(**args)
    ref = prefill_attention_ref(**args)
    exact = _float64(args["q"], built["keys"], built["values"], built["seqs"], args["scale"])
    assert got.dtype == dtype and got.shape == args["q"].shape and got.is_contiguous()
    err_kernel = (got.double() - exact).abs().max().item()
    err_ref = (ref.double() - exact).abs().max().item()
    where = f"{dtype} {case}: kernel error {err_kernel:.3g}, reference error {err_ref:.3g}"
    assert err_kernel <= 4 * err_ref + FLOOR[dtype], where
    assert err_ref <= 50 * FLOOR[dtype], where  # the reference itself is right
    return where


def _run_interpreted(script: str) -> str:
    out = run_interpreted(script)
    assert out.strip().endswith("ok"), out[-3000:]
    return out


# ---------------------------------------------------------------------------------------------
# The Triton kernel, interpreted


def test_kernel_float32_matches_float64_as_closely_as_the_reference() -> None:
    _run_interpreted("""
import torch
from tests.test_triton_prefill_attention import CASES, _check_case
for case in CASES:
    print(_check_case(torch.float32, case))
print("ok")
""")


def test_kernel_16_bit_matches_float64_as_closely_as_the_reference() -> None:
    _run_interpreted("""
import torch
from tests.test_triton_prefill_attention import CASES, _check_case
from tests.triton_tools import fix_bf16_interpreter
for case in CASES:
    print(_check_case(torch.float16, case))
fix_bf16_interpreter()
for case in (CASES[0], CASES[2], CASES[3]):
    print(_check_case(torch.bfloat16, case))
print("ok")
""")


# ---------------------------------------------------------------------------------------------
# Bad input, refused before launch (no interpreter needed)


def _valid() -> dict[str, Any]:
    return _build([(3, 5), (4, 0)], heads=4, kv_heads=2, head_dim=8, block_size=4,
                  dtype=torch.float32)["args"]  # fmt: skip


def _with(**changes: Callable[[dict[str, Any]], Any]) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        args = _valid()
        for name, change in changes.items():
            args[name] = change(args)
        return args

    return make


BAD: list[tuple[str, Callable[[], dict[str, Any]], str]] = [
    ("q 2-D", _with(q=lambda a: a["q"][:, 0]), "q must be 3-D"),
    ("q int", _with(q=lambda a: a["q"].int()), "q must be float32"),
    ("q head_dim 300", _with(q=lambda a: torch.zeros(7, 4, 300)), "head_dim must be 1..256"),
    ("k_cache 2-D", _with(k_cache=lambda a: a["k_cache"][:, 0]), "k_cache must be 3-D"),
    ("k_cache dtype", _with(k_cache=lambda a: a["k_cache"].half()), "k_cache must have q's"),
    ("v_cache dtype", _with(v_cache=lambda a: a["v_cache"].double()), "v_cache must have q's"),
    ("k_cache head_dim", _with(k_cache=lambda a: a["k_cache"][..., :4]), "k_cache's head_dim"),
    ("v_cache shape", _with(v_cache=lambda a: a["v_cache"][:-4]), "v_cache must have k_cache's"),
    (
        "H % Hkv",
        _with(
            k_cache=lambda a: torch.zeros(a["k_cache"].shape[0], 3, 8),
            v_cache=lambda a: torch.zeros(a["k_cache"].shape[0], 3, 8),
        ),
        "4 heads must be a multiple of k_cache's 3",
    ),
    ("block_size 12", _with(block_size=lambda a: 12), "block_size must be a power of two"),
    ("block_size 0", _with(block_size=lambda a: 0), "block_size must be a power of two"),
    ("slots not whole blocks", _with(block_size=lambda a: 64), "multiple of block_size"),
    ("max_query_len tensor", _with(max_query_len=lambda a: torch.tensor(4)), "max_query_len"),
    ("max_query_len < 0", _with(max_query_len=lambda a: -1), "max_query_len"),
    (
        "block_tables 1-D",
        _with(block_tables=lambda a: a["block_tables"][0]),
        "block_tables must be 2-D",
    ),
    (
        "block_tables int64",
        _with(block_tables=lambda a: a["block_tables"].long()),
        "block_tables must be int32",
    ),
    (
        "query_start_loc int64",
        _with(query_start_loc=lambda a: a["query_start_loc"].long()),
        "query_start_loc must be int32",
    ),
    (
        "context_lens int64",
        _with(context_lens=lambda a: a["context_lens"].long()),
        "context_lens must be int32",
    ),
    (
        "query_start_loc short",
        _with(query_start_loc=lambda a: a["query_start_loc"][:2]),
        "query_start_loc must be (3,)",
    ),
    (
        "context_lens long",
        _with(context_lens=lambda a: torch.zeros(3, dtype=torch.int32)),
        "context_lens must be (2,)",
    ),
    (
        "q last dim strided",
        _with(q=lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2)),
        "q's last dim must be contiguous",
    ),
    (
        "block_tables strided",
        _with(block_tables=lambda a: a["block_tables"].t().contiguous().t()),
        "block_tables's last dim must be contiguous",
    ),
    (
        "k_cache on meta",
        _with(k_cache=lambda a: a["k_cache"].to("meta")),
        "k_cache must be on q's device",
    ),
    (
        "context_lens on meta",
        _with(context_lens=lambda a: a["context_lens"].to("meta")),
        "context_lens must be on q's device",
    ),
]


@pytest.mark.parametrize(("make", "message"), [(m, s) for _, m, s in BAD],
                         ids=[name for name, _, _ in BAD])  # fmt: skip
def test_bad_input_is_refused_naming_the_argument(
    make: Callable[[], dict[str, Any]], message: str
) -> None:
    args = make()
    for fn in (prefill_attention, prefill_attention_ref):
        with pytest.raises(ValueError, match="prefill_attention: ") as e:
            fn(**args)
        assert message in str(e.value), str(e.value)


def test_no_sequences_or_no_tokens_return_without_launching() -> None:
    args = _valid()
    args.update(q=args["q"][:0], query_start_loc=torch.zeros(3, dtype=torch.int32))
    assert prefill_attention(**args).shape == (0, 4, 8)
    args.update(block_tables=args["block_tables"][:0], query_start_loc=args["query_start_loc"][:1],
                context_lens=args["context_lens"][:0])  # fmt: skip
    assert prefill_attention(**args).shape == (0, 4, 8)


# ---------------------------------------------------------------------------------------------
# Compiled for Hopper


@pytest.mark.parametrize(("head_dim", "dtype"), [(8, torch.float32), (64, torch.bfloat16),
                                                 (80, torch.float16), (128, torch.bfloat16),
                                                 (256, torch.bfloat16)])  # fmt: skip
def test_kernel_compiles_for_hopper(head_dim: int, dtype: torch.dtype) -> None:
    """No GPU here: compile to a cubin for sm_90 (H100/H200) with the constexprs and warps the
    wrapper launches with, which catches what the interpreter does not (types, tl.dot's shapes);
    and the tiles fit in an H100's shared memory (227 KiB a block)."""
    cfg = dict(_config(head_dim, dtype))
    options = {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}
    ptr = "*" + {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    strides = ["stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
               "stride_ot", "stride_oh", "stride_bt"]  # fmt: skip
    sig = {"q_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr, "out_ptr": ptr,
           "block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32", "context_lens_ptr": "*i32",
           "qk_scale": "fp32", **dict.fromkeys(strides, "i32"),
           **dict.fromkeys(["GROUP", "HEAD_DIM", "BLOCK_SIZE", *cfg], "constexpr")}  # fmt: skip
    constexprs = {"GROUP": 4, "HEAD_DIM": head_dim, "BLOCK_SIZE": 16, **cfg}
    kernel = compile_for_hopper(_prefill_attention_kernel, sig, constexprs, **options)
    assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared
