"""The Triton RMSNorm (plain and fused with the residual add) and SiLU-and-multiply kernels:
interpreted on the CPU against their PyTorch references and a float64 computation, their input
checks, and their compilation for sm_90."""

from __future__ import annotations

import pytest
import torch

from kernels.triton_rms_norm import rms_norm
from kernels.triton_silu_mul import silu_and_mul
from tests.triton_tools import compile_for_hopper, run_interpreted

# Shared by the interpreted scripts: bfloat16 rounding as on the GPU, inputs, the error check.
_COMMON = """
import torch

from tests.triton_tools import fix_bf16_interpreter

fix_bf16_interpreter()  # bfloat16 rounded to nearest even, as on the GPU

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
g = torch.Generator().manual_seed(0)


def rows(T, n, dtype, sliced, scale=3.0):
    '''(T, n) with magnitudes varying by row; `sliced`: a column slice of a wider tensor (rows
    n + 24 apart, starting 8 values in).'''
    wide = torch.randn(T, n + 24, generator=g, dtype=torch.float64)
    wide *= scale * torch.logspace(-2, 2, T, dtype=torch.float64).unsqueeze(1)
    wide = wide.to(dtype)
    return wide[:, 8 : 8 + n] if sliced else wide[:, :n].contiguous()


def check(got, ref, exact, what):
    '''got: the kernel's; ref: the reference's; exact: float64.'''
    assert got.shape == ref.shape and got.dtype == ref.dtype and got.is_contiguous(), what
    err = (got.double() - exact).abs().max().item()
    ref_err = (ref.double() - exact).abs().max().item()
    floor = 1e-6 * exact.abs().max().item()
    assert err <= 4 * ref_err + floor, (what, err, ref_err)
    eps = torch.finfo(ref.dtype).eps  # a flipped last bit, from summing in another order
    torch.testing.assert_close(got, ref, rtol=2 * eps, atol=floor, msg=str(what))
    if ref.dtype != torch.float32:  # the reference's roundings: the same values, nearly all
        assert (got != ref).double().mean().item() <= 0.01, what
"""


def _interpret(script: str) -> None:
    assert run_interpreted(_COMMON + script).strip() == "ok"


# ---------------------------------------------------------------------------------------------
# Interpreted


def test_rms_norm_kernel_matches_reference_and_float64() -> None:
    _interpret("""
from kernels.triton_rms_norm import _rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref


def exact(s, w, eps):
    return w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)


def case(T, hidden, dtype, sliced, max_block=None, eps=1e-5):
    what = (T, hidden, dtype, sliced, max_block)
    x, r = rows(T, hidden, dtype, sliced), rows(T, hidden, dtype, not sliced, scale=1.0)
    w = (1 + 0.5 * torch.randn(hidden, generator=g)).to(dtype)
    x0, r0 = x.clone(), r.clone()
    run = rms_norm if max_block is None else lambda *a, **k: _rms_norm(*a, max_block=max_block, **k)
    got = run(x, w, eps, residual=None)
    check(got, rms_norm_ref(x, w, eps), exact(x.double(), w, eps), what)
    got, s = run(x, w, eps, residual=r)
    ref, ref_s = fused_add_rms_norm_ref(x, r, w, eps)
    assert torch.equal(s, ref_s) and s.is_contiguous(), what  # x + r, rounded as torch rounds
    check(got, ref, exact(x.double() + r.double(), w, eps), what)
    assert torch.equal(x, x0) and torch.equal(r, r0), what  # neither input written


for dtype in DTYPES:
    for T in (1, 5, 64):
        for hidden in (64, 576, 1000):
            case(T, hidden, dtype, sliced=(T + hidden) % 2 == 1)
    # rows longer than a tile: the two-pass loop (tiles of 256; 1000 ends in a partial tile)
    for T, hidden in ((1, 576), (5, 1000), (3, 64)):
        case(T, hidden, dtype, sliced=True, max_block=256)
    case(2, 16384, dtype, sliced=False)  # the longest hidden size asked for: 2 tiles of 8192
case(3, 8, torch.float32, sliced=True, eps=1e-6)  # stories260K's head_dim (q_norm, k_norm)
case(2, 1, torch.bfloat16, sliced=False)
assert rms_norm(torch.empty(0, 64), torch.ones(64), 1e-5).shape == (0, 64)
print("ok")
""")


def test_silu_and_mul_kernel_matches_reference_and_float64() -> None:
    _interpret("""
from torch.nn import functional as F

from kernels.triton_silu_mul import _silu_and_mul, silu_and_mul, silu_and_mul_ref


def case(T, inter, dtype, sliced, max_block=None):
    what = (T, inter, dtype, sliced, max_block)
    x = rows(T, 2 * inter, dtype, sliced, scale=1.0)
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0], dtype=dtype)  # exp(-gate) overflows in float32
    got = silu_and_mul(x) if max_block is None else _silu_and_mul(x, max_block)
    x64 = x.double()
    exact = F.silu(x64[:, :inter]) * x64[:, inter:]
    check(got, silu_and_mul_ref(x), exact, what)


for dtype in DTYPES:
    for T in (1, 5, 64):
        for inter in (64, 576, 1000):
            case(T, inter, dtype, sliced=(T + inter) % 2 == 1)
    case(5, 1000, dtype, sliced=True, max_block=128)  # 8 column tiles, the last partial
    case(2, 3000, dtype, sliced=False)  # 3 column tiles of 1024
case(3, 4, torch.float32, sliced=True)
assert silu_and_mul(torch.empty(0, 16)).shape == (0, 8)
print("ok")
""")


# ---------------------------------------------------------------------------------------------
# Input checks (before any launch: no interpreter needed)


def test_rms_norm_rejects_bad_inputs() -> None:
    x, w = torch.randn(4, 64), torch.randn(64)
    bad = [
        ((torch.randn(64), w), {}, r"x must be 2-D .* got shape \(64,\)"),
        ((torch.randn(2, 4, 64), w), {}, "x must be 2-D"),
        ((x.double(), w.double()), {}, "x must be float32, float16 or bfloat16"),
        ((torch.randn(64, 4).t(), w), {}, "x's last dim must be contiguous"),
        ((x, torch.randn(65)), {}, r"weight must be \(64,\) .* got shape \(65,\)"),
        ((x, torch.randn(1, 64)), {}, r"weight must be \(64,\)"),
        ((x, w.half()), {}, "weight must be x's dtype"),
        ((x, torch.randn(128)[::2]), {}, "weight must be contiguous"),
        ((x, torch.empty(64, device="meta")), {}, "weight is on meta, x on cpu"),
        ((x, w), {"residual": torch.randn(4, 63)}, r"residual must be x's shape \(4, 64\)"),
        ((x, w), {"residual": torch.randn(3, 64)}, "residual must be x's shape"),
        ((x, w), {"residual": torch.randn(4, 64).half()}, "residual must be x's dtype"),
        ((x, w), {"residual": torch.randn(64, 4).t()}, "residual's last dim must be contiguous"),
        ((x, w), {"residual": torch.empty(4, 64, device="meta")}, "residual is on meta"),
    ]
    for (xi, wi), kw, match in bad:
        with pytest.raises(ValueError, match="rms_norm: " + match):
            rms_norm(xi, wi, 1e-5, **kw)


def test_silu_and_mul_rejects_bad_inputs() -> None:
    bad = [
        (torch.randn(64), r"x must be 2-D \(T, 2 \* I\), got shape \(64,\)"),
        (torch.randn(2, 3, 64), "x must be 2-D"),
        (torch.randn(4, 64, dtype=torch.float64), "x must be float32, float16 or bfloat16"),
        (torch.randn(4, 63), r"x's last dim must be even \(gate \| up\), got shape \(4, 63\)"),
        (torch.randn(64, 4).t(), "x's last dim must be contiguous"),
    ]
    for x, match in bad:
        with pytest.raises(ValueError, match="silu_and_mul: " + match):
            silu_and_mul(x)


# ---------------------------------------------------------------------------------------------
# Compiled for sm_90 (no GPU here: Triton's own compiler and ptxas, not run)


def _compile_for_hopper(fn, sig: dict[str, str], constexprs: dict[str, object], warps: int):  # type: ignore[no-untyped-def]
    sig = {**sig, **{k: "constexpr" for k in constexprs}}
    compile_for_hopper(fn, sig, constexprs, num_warps=warps)


@pytest.mark.parametrize(
    ("dtype", "hidden", "residual"),
    [("bf16", 576, True), ("fp16", 64, False), ("fp32", 8, True), ("bf16", 16384, True)],
)
def test_rms_norm_kernel_compiles_for_hopper(dtype: str, hidden: int, residual: bool) -> None:
    """With the constexprs and warps the wrapper launches hidden with (16384: the tile loop)."""
    import triton

    from kernels.triton_rms_norm import MAX_BLOCK, _num_warps, _rms_norm_kernel

    block = min(triton.next_power_of_2(hidden), MAX_BLOCK)
    sig = {"x_ptr": f"*{dtype}", "res_ptr": f"*{dtype}", "w_ptr": f"*{dtype}",
           "out_ptr": f"*{dtype}", "sum_ptr": f"*{dtype}", "x_row_stride": "i32",
           "res_row_stride": "i32", "hidden": "i32", "eps": "fp32"}  # fmt: skip
    constexprs = {"HAS_RESIDUAL": residual, "BLOCK": block, "ONE_TILE": block >= hidden}
    _compile_for_hopper(_rms_norm_kernel, sig, constexprs, _num_warps(block))


@pytest.mark.parametrize(("dtype", "inter"), [("bf16", 1536), ("fp16", 64), ("fp32", 1000)])
def test_silu_and_mul_kernel_compiles_for_hopper(dtype: str, inter: int) -> None:
    import triton

    from kernels.triton_silu_mul import MAX_BLOCK, _num_warps, _silu_and_mul_kernel

    block = min(triton.next_power_of_2(inter), MAX_BLOCK)
    sig = {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "x_row_stride": "i64", "inter": "i32"}
    _compile_for_hopper(_silu_and_mul_kernel, sig, {"BLOCK": block}, _num_warps(block))
