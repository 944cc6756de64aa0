"""The few-row matmul kernel against float64, beside the PyTorch reference it replaces."""

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


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 14, 48])
@pytest.mark.parametrize(("k", "n"), [(64, 5), (172, 131), (576, 960), (8, 4), (17, 3)])
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
    got = small_linear(x, w, b, ext)
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
    with pytest.raises(RuntimeError, match="1 <= M <= 48"):
        ext.small_linear(torch.randn(49, 8), torch.randn(4, 8), None)
    with pytest.raises(RuntimeError, match="float32"):
        ext.small_linear(torch.randn(1, 8).double(), torch.randn(4, 8).double(), None)
