"""The C++ RMSNorm kernel against a float64 computation, beside the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ext
from kernels.norm import rms_norm


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
