"""The small-matmul kernel against float64, beside the PyTorch reference it replaces: float32
weights (1-256 rows of x) and bfloat16 weights (any rows), through each of its paths (1-8 rows,
9-15, the blocked GEMM from 16; partial weight panels and ragged K)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ext
from kernels.linear import MAX_ROWS, applies, small_linear


@pytest.fixture(scope="module")
def ext():  # type: ignore[no-untyped-def]
    mod = cpu_ext.load_small_gemm()
    if mod is None:
        pytest.skip("the CPU small-matmul extension did not build here")
    return mod


ROWS = [1, 2, 3, 5, 8, 9, 14, 16, 17, 33, 48, 49, 64, 100, 130]
# (k, n): (50, 40) leaves 18 columns past the 32-wide bfloat16 packing loop, for its 16-wide step
SHAPES = [(64, 5), (172, 131), (576, 960), (8, 4), (17, 3), (50, 40)]


@pytest.mark.parametrize("m", [*ROWS, 256])
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_float64_as_closely_as_torch(
    ext, m: int, k: int, n: int, bias: bool
) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    ref_err = (torch.nn.functional.linear(x, w, b).double() - exact).abs().max().item()
    got = ext.small_linear(x, w, b)  # the kernel itself: the wrapper sends M > MAX_ROWS to torch
    assert got.shape == (m, n) and got.dtype == torch.float32
    err = (got.double() - exact).abs().max().item()
    assert err <= 4 * ref_err + 1e-5 * (k**0.5), (err, ref_err)


def test_falls_back_where_the_kernel_does_not_apply(ext) -> None:  # type: ignore[no-untyped-def]
    w = torch.randn(7, 16)
    for x in (torch.randn(MAX_ROWS + 1, 16), torch.randn(2, 16).double(), torch.randn(3, 2, 16)):
        assert not applies(x, w.to(x.dtype))
        want = torch.nn.functional.linear(x, w.to(x.dtype))
        assert torch.equal(small_linear(x, w.to(x.dtype), None, ext), want)
    assert not applies(torch.randn(1, 16), torch.randn(16, 7).t())  # non-contiguous weights


def test_kernel_checks_its_inputs(ext) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="K differs"):
        ext.small_linear(torch.randn(1, 8), torch.randn(4, 9), None)
    with pytest.raises(RuntimeError, match="1 <= M <= 256"):
        ext.small_linear(torch.randn(257, 8), torch.randn(4, 8), None)
    with pytest.raises(RuntimeError, match="float32"):
        ext.small_linear(torch.randn(1, 8).double(), torch.randn(4, 8).double(), None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ext.small_linear(torch.randn(20, 8), torch.randn(4, 8).half(), None)
    with pytest.raises(RuntimeError, match="K differs"):
        ext.small_linear(torch.randn(20, 8), torch.randn(4, 9).bfloat16(), None)
    for w in (torch.randn(8, 4).t(), torch.randn(8, 4).bfloat16().t()):
        with pytest.raises(RuntimeError, match="w must be contiguous"):
            ext.small_linear(torch.randn(20, 8), w, None)
    with pytest.raises(RuntimeError, match=r"bias \(N,\) float32"):
        ext.small_linear(torch.randn(20, 8), torch.randn(4, 8).bfloat16(), torch.randn(5))


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_weights_match_float64_and_the_float32_kernel(
    ext, m: int, k: int, n: int, bias: bool
) -> None:  # type: ignore[no-untyped-def]
    """bfloat16 weights are widened exactly and multiplied in float32 (x is not rounded)."""
    g = torch.Generator().manual_seed(m * 1000 + k + n + 7)
    x = torch.randn(m, k, generator=g)
    w16 = torch.randn(n, k, generator=g).bfloat16()
    w = w16.float()  # the widened weights: exact
    b = torch.randn(n, generator=g) if bias else None
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    ref_err = (torch.nn.functional.linear(x, w, b).double() - exact).abs().max().item()
    got = ext.small_linear(x, w16, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    err = (got.double() - exact).abs().max().item()
    assert err <= 4 * ref_err + 1e-5 * (k**0.5), (err, ref_err)
    # the float32 kernel on the widened weights: the same sums, up to float32 rounding
    torch.testing.assert_close(got, ext.small_linear(x, w, b), rtol=1e-5, atol=1e-5 * k**0.5)


def test_bfloat16_weights_take_any_rows(ext) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 40, generator=g)
    w16 = torch.randn(70, 40, generator=g).bfloat16()
    exact = torch.nn.functional.linear(x.double(), w16.double())
    ref_err = (torch.nn.functional.linear(x, w16.float()).double() - exact).abs().max().item()
    err = (ext.small_linear(x, w16, None).double() - exact).abs().max().item()
    assert err <= 4 * ref_err + 1e-5 * 40**0.5, (err, ref_err)
