"""Paged decode attention (kernels/triton_decode_attention.py): the Triton kernels, interpreted on
the CPU, and the PyTorch reference, each sequence against an unpaged float64 computation, the
kernels' error within a small multiple of the reference's own; every bad input refused before
launch with an error naming the argument; both kernels compiled for sm_90.

The paged batches are awkward on purpose: lengths 1, 15, 16, 17, 97 and 500 with a padding row
of length 0, blocks handed out shuffled (a sequence's blocks neither contiguous nor in order),
every slot that no sequence owns (the tails of last blocks included) set to NaN, and block-table
entries past a sequence's blocks set to an id far outside the cache: a kernel that reads any of
them gives NaN or faults.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels.triton_decode_attention import decode_attention, decode_attention_ref
from tests.triton_tools import compile_for_hopper, run_interpreted

LENS = (1, 15, 16, 17, 97, 500, 0)
_FLOOR = {torch.float32: 1e-6, torch.float16: 1e-5, torch.bfloat16: 1e-4}  # absolute, tiny
_NO_BLOCK = 1 << 20  # block-table padding: far outside every test cache


def _paged_batch(
    lens: tuple[int, ...],
    hkv: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    extra_blocks: int = 2,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sequence's keys and values unpaged ((n, hkv, head_dim) each), and the same written
    to a paged cache through shuffled block tables with `extra_blocks` columns past the
    longest sequence's blocks: (keys, values, k_cache, v_cache, block_tables)."""
    need = [-(-n // block_size) for n in lens]
    max_blocks = max(need) + extra_blocks
    num_blocks = sum(need) + 3  # a few blocks no one owns
    order = torch.randperm(num_blocks, generator=gen)
    k_cache = torch.full((num_blocks * block_size, hkv, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.full((len(lens), max_blocks), _NO_BLOCK, dtype=torch.int32)
    keys, values, used = [], [], 0
    for b, n in enumerate(lens):
        blocks = order[used : used + need[b]]
        used += need[b]
        tables[b, : need[b]] = blocks.to(torch.int32)
        k = torch.randn(n, hkv, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, hkv, head_dim, generator=gen).to(dtype)
        j = torch.arange(n)
        slots = blocks[j // block_size] * block_size + j % block_size
        k_cache[slots], v_cache[slots] = k, v
        keys.append(k)
        values.append(v)
    return keys, values, k_cache, v_cache, tables


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """(H, D) float64 attention of one query (H, D) over unpaged keys/values (n, Hkv, D)."""
    H, D = q.shape
    if k.shape[0] == 0:
        return torch.zeros(H, D, dtype=torch.float64)
    group = H // k.shape[1]
    kd = k.double().repeat_interleave(group, dim=1)  # (n, H, D)
    vd = v.double().repeat_interleave(group, dim=1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q.double(), kd) * scale, dim=-1)  # (H, n)
    return torch.einsum("hn,nhd->hd", p, vd)


def _query(b: int, h: int, hkv: int, d: int, dtype: torch.dtype, layout: str,
           gen: torch.Generator, gain: float) -> torch.Tensor:  # fmt: skip
    """(b, h, d) queries: contiguous, a slice of a fused qkv tensor, or head-major."""
    if layout == "qkv":  # row stride (h + 2 hkv) * d
        return (torch.randn(b, h + 2 * hkv, d, generator=gen) * gain).to(dtype)[:, :h]
    if layout == "heads_first":  # strides (d, b * d, 1)
        return (torch.randn(h, b, d, generator=gen) * gain).to(dtype).transpose(0, 1)
    return (torch.randn(b, h, d, generator=gen) * gain).to(dtype)


def _check_case(
    dtype: torch.dtype,
    block_size: int,
    heads: tuple[int, int],
    head_dim: int,
    splits: tuple[int | None, ...],
    lens: tuple[int, ...] = LENS,
    layout: str = "contiguous",
    gain: float = 1.0,
    seed: int = 0,
) -> None:
    """One paged batch; the kernel at each of `splits` and the reference, sequence by sequence
    against float64: kernel error <= 4 x reference error + a tiny floor; padding rows zero."""
    gen = torch.Generator().manual_seed(seed)
    H, hkv = heads
    keys, values, k_cache, v_cache, tables = _paged_batch(
        lens, hkv, head_dim, block_size, dtype, gen
    )
    q = _query(len(lens), H, hkv, head_dim, dtype, layout, gen, gain)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    ref = decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, scale, block_size)
    exact = [_exact(q[b], keys[b], values[b], scale) for b in range(len(lens))]
    for s in splits:
        out = decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, block_size, s)
        case = f"{dtype} block_size={block_size} heads={heads} D={head_dim} splits={s}"
        assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous(), case
        for b, n in enumerate(lens):
            if n == 0:
                assert torch.equal(out[b], torch.zeros_like(out[b])), (case, "padding row")
                continue
            ref_err = (ref[b].double() - exact[b]).abs().max().item()
            err = (out[b].double() - exact[b]).abs().max().item()
            assert err <= 4 * ref_err + _FLOOR[dtype], (case, n, err, ref_err)
        # and the reference's answer but for a last bit or two (scores `gain` times larger
        # carry rounding errors as many times larger into the exponentials)
        eps = torch.finfo(dtype).eps
        atol = 2 * eps * gain * ref.abs().max().item()
        torch.testing.assert_close(out, ref, rtol=2 * eps, atol=atol, msg=case)


# Lengths 1..500 in every batch; per case a block size, (H, Hkv), head_dim and the splits run.
# The key range is 9 tiles of 64 keys: splits 16 and 40 are lowered to 9, a tile each (most of
# them past a short sequence's keys); 7 splits of 2 tiles leave the last two past every key.
CASES: list[dict[str, Any]] = [
    dict(dtype=torch.float32, block_size=16, heads=(2, 2), head_dim=64, splits=(1, 3, 40)),
    dict(dtype=torch.float32, block_size=8, heads=(4, 1), head_dim=80, splits=(1, 16),
         layout="qkv"),
    dict(dtype=torch.float32, block_size=32, heads=(6, 2), head_dim=64, splits=(2, None),
         layout="heads_first"),
    dict(dtype=torch.bfloat16, block_size=16, heads=(4, 1), head_dim=64, splits=(1, 5)),
    dict(dtype=torch.bfloat16, block_size=32, heads=(2, 2), head_dim=80, splits=(1, 16),
         layout="qkv"),
    dict(dtype=torch.bfloat16, block_size=8, heads=(6, 2), head_dim=64, splits=(1, 3)),
    dict(dtype=torch.float16, block_size=16, heads=(4, 1), head_dim=80, splits=(1, 7)),
]  # fmt: skip

# stories260K's attention (8 heads over 4, head_dim 8) and the block-size extremes; peaked
# softmaxes (scores up to ~100) for the online max; head_dim 256.
EDGE_CASES: list[dict[str, Any]] = [
    dict(dtype=torch.float32, block_size=16, heads=(8, 4), head_dim=8, splits=(None, 1, 7),
         lens=(1, 17, 97, 0, 3)),
    dict(dtype=torch.bfloat16, block_size=16, heads=(8, 4), head_dim=8, splits=(None, 2),
         lens=(5, 0, 40)),
    dict(dtype=torch.float32, block_size=1, heads=(2, 1), head_dim=96, splits=(1, 4),
         lens=(1, 17, 0, 40)),
    dict(dtype=torch.float16, block_size=256, heads=(2, 2), head_dim=64, splits=(1, 3),
         lens=(1, 15, 300, 0)),
    dict(dtype=torch.float32, block_size=16, heads=(4, 2), head_dim=64, splits=(1, 4),
         lens=(17, 97, 200), gain=12.0),
    dict(dtype=torch.bfloat16, block_size=16, heads=(4, 2), head_dim=64, splits=(1, 4),
         lens=(17, 97, 200), gain=12.0),
    dict(dtype=torch.bfloat16, block_size=32, heads=(2, 1), head_dim=256, splits=(1, 2),
         lens=(1, 33, 70)),
]  # fmt: skip


def _interpreted(script: str) -> None:
    assert run_interpreted(script).strip() == "ok"


def test_kernel_matches_float64_as_closely_as_the_reference() -> None:
    _interpreted(
        "from tests.test_triton_decode_attention import CASES, _check_case\n"
        "from tests.triton_tools import fix_bf16_interpreter\n"
        "fix_bf16_interpreter()\n"
        "for case in CASES:\n"
        "    _check_case(**case)\n"
        "print('ok')\n"
    )


def test_kernel_edge_cases_head_dim_8_block_sizes_1_and_256_peaked_scores() -> None:
    _interpreted(
        """
import torch
from kernels.triton_decode_attention import decode_attention
from tests.test_triton_decode_attention import EDGE_CASES, _check_case
from tests.triton_tools import fix_bf16_interpreter

fix_bf16_interpreter()
for case in EDGE_CASES:
    _check_case(**case)

# a CUDA-graph batch of padding rows only (one split, two, the default), and a table with no
# columns: zeros, no NaN
q = torch.randn(3, 4, 16)
cache = torch.full((32, 2, 16), float("nan"))
for blocks, splits in ((8, 1), (8, 2), (8, None), (0, None)):
    out = decode_attention(q, cache, cache, torch.zeros(3, blocks, dtype=torch.int32),
                           torch.zeros(3, dtype=torch.int32), 0.25, 16, splits)
    assert torch.equal(out, torch.zeros_like(out)), (blocks, splits, out)
print('ok')
"""
    )


# ---------------------------------------------------------------------------------------------
# Bad input: refused before launch, so no interpreter needed


def _good() -> dict[str, Any]:
    return dict(
        q=torch.randn(2, 4, 16),
        k_cache=torch.randn(64, 2, 16),
        v_cache=torch.randn(64, 2, 16),
        block_tables=torch.zeros(2, 4, dtype=torch.int32),
        seq_lens=torch.ones(2, dtype=torch.int32),
        scale=0.25,
        block_size=16,
    )


def _bad(**change: Any) -> dict[str, Any]:
    return {**_good(), **change}


@pytest.mark.parametrize(
    "args, match",
    [
        (_bad(q=torch.randn(2, 64)), r"q must be 3-D .*\(2, 64\)"),
        (_bad(k_cache=torch.randn(4, 16, 2, 16)), r"k_cache must be 3-D"),
        (_bad(v_cache=torch.randn(64, 32)), r"v_cache must be 3-D"),
        (_bad(block_tables=torch.zeros(8, dtype=torch.int32)), r"block_tables must be 2-D"),
        (_bad(seq_lens=torch.ones(2, 1, dtype=torch.int32)), r"seq_lens must be 1-D"),
        (_bad(q=torch.randn(2, 4, 16).double()), r"q must be float32, float16 or bfloat16"),
        (_bad(k_cache=torch.randn(64, 2, 16).half()), r"k_cache must have q's dtype"),
        (_bad(v_cache=torch.randn(64, 2, 16).bfloat16()), r"v_cache must have q's dtype"),
        (_bad(block_tables=torch.zeros(2, 4, dtype=torch.int64)), r"block_tables must be int32"),
        (_bad(seq_lens=torch.ones(2, dtype=torch.int64)), r"seq_lens must be int32"),
        (_bad(v_cache=torch.randn(64, 1, 16)), r"v_cache must have k_cache's shape"),
        (_bad(q=torch.randn(2, 4, 32)), r"k_cache head_dim 16 must equal q's head_dim 32"),
        (_bad(q=torch.randn(2, 5, 16)), r"q's 5 heads must be a multiple of k_cache's 2"),
        (_bad(q=torch.randn(2, 4, 512), k_cache=torch.randn(64, 2, 512),
              v_cache=torch.randn(64, 2, 512)), r"q head_dim must be 1..256, got 512"),
        (_bad(block_tables=torch.zeros(3, 4, dtype=torch.int32)), r"block_tables must have 2 rows"),
        (_bad(seq_lens=torch.ones(3, dtype=torch.int32)), r"seq_lens must have 2 entries"),
        (_bad(block_size=12), r"block_size must be a power of two, got 12"),
        (_bad(block_size=48), r"block_size must be a power of two, got 48"),
        (_bad(block_size=0), r"block_size must be a power of two"),
        (_bad(k_cache=torch.randn(60, 2, 16), v_cache=torch.randn(60, 2, 16)),
         r"k_cache's 60 slots must be a multiple of block_size 16"),
        (_bad(q=torch.randn(2, 16, 4).transpose(1, 2)), r"q's last dim must be contiguous"),
        (_bad(k_cache=torch.randn(2, 64, 16).transpose(0, 1)), r"k_cache must be contiguous"),
        (_bad(block_tables=torch.zeros(4, 2, dtype=torch.int32).t()),
         r"block_tables must be contiguous"),
        (_bad(seq_lens=torch.ones(4, dtype=torch.int32)[::2]), r"seq_lens must be contiguous"),
        (_bad(block_tables=torch.zeros(2, 4, dtype=torch.int32, device="meta")),
         r"block_tables is on meta, q on cpu"),
        (_bad(v_cache=torch.randn(64, 2, 16, device="meta")), r"v_cache is on meta"),
        (_bad(seq_lens=torch.ones(2, dtype=torch.int32, device="meta")), r"seq_lens is on meta"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(args: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=r"^decode_attention: " + match):
        decode_attention(**args)
    with pytest.raises(ValueError, match=match):
        decode_attention_ref(**args)


@pytest.mark.parametrize("num_splits", [0, -1, 2.0, True])
def test_bad_num_splits(num_splits: Any) -> None:
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        decode_attention(**_good(), num_splits=num_splits)


# ---------------------------------------------------------------------------------------------
# Compiled for Hopper


@pytest.mark.parametrize(
    "dtype, head_dim, group, block_size, block_n, direct",
    [
        ("bf16", 128, 4, 16, 64, False),  # a GQA model in bfloat16
        ("fp16", 80, 1, 32, 64, True),  # one split: the output written directly
        ("fp32", 8, 2, 16, 16, False),  # stories260K (head_dim 8 padded to 16)
        ("bf16", 256, 8, 1, 32, True),  # head_dim 256, block size 1
    ],
)  # fmt: skip
def test_kernels_compile_for_hopper(
    dtype: str, head_dim: int, group: int, block_size: int, block_n: int, direct: bool
) -> None:
    """No GPU here: compile both kernels to cubins for sm_90 (H100/H200) with the constexprs the
    wrapper launches with (BLOCK_* as it derives them), which catches what the interpreter does
    not (types, dot shapes, the data-dependent loop)."""
    from kernels.triton_decode_attention import _decode_reduce_kernel, _decode_split_kernel

    part = f"*{dtype}" if direct else "*fp32"  # with one split the wrapper passes out
    sig = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "bt_ptr": "*i32",
           "lens_ptr": "*i32", "out_ptr": f"*{dtype}", "part_o_ptr": part, "part_m_ptr": part,
           "part_l_ptr": part, "qk_scale": "fp32", "stride_qb": "i32", "stride_qh": "i32",
           "max_blocks": "i32", "keys_per_split": "i32", "H": "i32", "Hkv": "i32",
           "head_dim": "i32", "num_splits": "i32", "GROUP": "constexpr",
           "BLOCK_SIZE": "constexpr", "BLOCK_H": "constexpr", "BLOCK_N": "constexpr",
           "BLOCK_D": "constexpr", "DIRECT": "constexpr"}  # fmt: skip
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    consts = {"GROUP": group, "BLOCK_SIZE": block_size, "BLOCK_H": max(16, group),
              "BLOCK_N": block_n, "BLOCK_D": block_d, "DIRECT": direct}  # fmt: skip
    kernel = compile_for_hopper(_decode_split_kernel, sig, consts, num_warps=4)
    if dtype != "fp32":
        assert "mma" in kernel.asm["ptx"]  # the dots on tensor cores
    if direct:
        return
    sig = {"part_o_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
           "out_ptr": f"*{dtype}", "H": "i32", "head_dim": "i32", "num_splits": "i32",
           "BLOCK_S": "constexpr", "BLOCK_D": "constexpr"}  # fmt: skip
    compile_for_hopper(_decode_reduce_kernel, sig, {"BLOCK_S": 8, "BLOCK_D": block_d},
                       num_warps=2)  # fmt: skip
