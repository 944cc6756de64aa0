"""The C++ RMSNorm kernel against a float64 computation, beside the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ext
from kernels.norm import add_rms_norm, rms_norm


@pytest.fixture(scope="module")
def ext():  # type: ignore[no-untyped-def]
    mod = cpu_ext.load_rms_norm()
    if mod is None:
        pytest.skip("the CPU RMSNorm extension did not build here")
    return mod


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 9, 16), (130, 172), (2, 1)])
def test_kernel_matches_float64_as_closely_as_torch(ext, shape: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    xd = x.double()
    exact = w.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5))
    ref_err = (rms_norm(x, w, 1e-5).double() - exact).abs().max().item()
    got = rms_norm(x, w, 1e-5, ext)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert (got.double() - exact).abs().max().item() <= 4 * ref_err + 1e-6


def test_reference_path_for_other_inputs(ext) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(4, 32).t()  # not contiguous
    w = torch.randn(4)
    assert torch.equal(rms_norm(x, w, 1e-6, ext), rms_norm(x, w, 1e-6))
    with pytest.raises(ValueError, match="features"):
        rms_norm(torch.randn(2, 8), torch.randn(9), 1e-6, ext)
    with pytest.raises(RuntimeError, match="float32"):
        ext.rms_norm(torch.randn(2, 8).double(), torch.randn(8).double(), 1e-6)


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit, NaN payloads aside (torch writes 0x7fc0 or 0xffff by its path)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


# Odd widths (not multiples of 8 or 16: torch's scalar tail and ours), rows below 8 (torch sums
# them as scalars), widths past 16 * 4 * 16 vectors (a second cascade level), T = 1, and T >= 64
# for the OpenMP branch.
BF16_SHAPES = [(1, 576), (64, 576), (130, 576), (1, 7), (5, 3), (3, 17), (70, 33), (2, 100),
               (1, 1000), (9, 1031), (1, 4096), (65, 4104), (3, 9, 64), (2, 1), (1, 8), (1, 15)]  # fmt: skip


@pytest.mark.parametrize("shape", BF16_SHAPES)
def test_bfloat16_kernel_equals_the_reference_bit_for_bit(ext, shape: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(sum(shape))
    for scale in (1e-3, 1.0, 40.0):
        x = (torch.randn(*shape, generator=g) * scale).bfloat16()
        w = torch.randn(shape[-1], generator=g).bfloat16()
        _same_bits(rms_norm(x, w, 1e-5, ext), rms_norm(x, w, 1e-5))


def test_bfloat16_kernel_on_nan_and_inf_rows(ext) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    for T in (4, 80):  # the serial branch and the OpenMP one
        x = torch.randn(T, 577, generator=g).bfloat16()
        x[0, 5] = float("nan")  # the whole row NaN
        x[1, 576] = float("inf")  # inf * 0 = NaN there, 0 elsewhere
        x[2, :] = 0  # rsqrt(eps): finite
        x[3, 9] = 3e38  # its square overflows: var inf, r = 0, the row all zeros
        w = torch.randn(577, generator=g).bfloat16()
        want = rms_norm(x, w, 1e-6)
        assert want[0].isnan().all() and want[1].isnan().sum() == 1 and not want[3].any()
        _same_bits(rms_norm(x, w, 1e-6, ext), want)


def test_bfloat16_add_rms_norm_equals_the_reference(ext) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(4)
    for T in (1, 8, 70):
        x, res = (torch.randn(T, 576, generator=g).bfloat16() for _ in range(2))
        w = torch.randn(576, generator=g).bfloat16()
        got, got_s = add_rms_norm(x, res, w, 1e-5, ext)
        want, want_s = add_rms_norm(x, res, w, 1e-5)
        assert torch.equal(got_s, want_s)
        _same_bits(got, want)


def test_mixed_dtypes_take_the_reference(ext) -> None:  # type: ignore[no-untyped-def]
    x, w = torch.randn(3, 64), torch.randn(64).bfloat16()
    assert torch.equal(rms_norm(x, w, 1e-6, ext), rms_norm(x, w, 1e-6))
    xb, wf = x.bfloat16(), w.float()
    assert torch.equal(rms_norm(xb, wf, 1e-6, ext), rms_norm(xb, wf, 1e-6))
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        ext.rms_norm(x, w, 1e-6)
