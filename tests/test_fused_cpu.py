"""The fused CPU steps (`kernels/csrc/fused_cpu.cpp`) against the PyTorch references they
replace: RoPE with the KV-cache write, and SiLU-and-mul."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ext
from kernels.activation import silu_and_mul
from kernels.rotary import apply_rotary, rotate_and_cache


@pytest.fixture(scope="module")
def ext():  # type: ignore[no-untyped-def]
    mod = cpu_ext.load_fused()
    if mod is None:
        pytest.skip("the CPU fused-ops extension did not build here")
    return mod


def _qkv(T: int, H: int, KVH: int, D: int, seed: int):  # type: ignore[no-untyped-def]
    """q, k, v as the model has them: views into one (T, (H + 2 KVH) D) projection output."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    angles = torch.rand(T, D // 2, generator=g) * 6.3
    emb = torch.cat((angles, angles), dim=-1)
    return q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D), emb.cos(), emb.sin()


@pytest.mark.parametrize(("T", "H", "KVH", "D"), [(1, 9, 3, 64), (5, 8, 4, 8), (40, 4, 4, 6), (17, 2, 1, 128)])
def test_rotary_write_kv_matches_the_reference(ext, T: int, H: int, KVH: int, D: int) -> None:  # type: ignore[no-untyped-def]
    q, k, v, cos, sin = _qkv(T, H, KVH, D, seed=T * 100 + D)
    slots = torch.randperm(3 * T)[:T]
    slots[T // 2] = -1  # a padded row: nothing written
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    keep = slots >= 0
    want_kc, want_vc = torch.full((3 * T, KVH, D), 7.0), torch.full((3 * T, KVH, D), 7.0)
    want_kc[slots[keep]] = want_k[keep]
    want_vc[slots[keep]] = v[keep]
    kc, vc = torch.full((3 * T, KVH, D), 7.0), torch.full((3 * T, KVH, D), 7.0)
    got_q, got_k = rotate_and_cache(q, k, v, cos, sin, kc, vc, slots, None, ext)
    assert got_q.is_contiguous() and got_q.shape == (T, H, D) and got_k.shape == (T, KVH, D)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kc, want_kc, rtol=1e-6, atol=1e-6)
    assert torch.equal(vc, want_vc)  # values copied as they are; unwritten slots untouched


def test_rotary_write_kv_rounds_into_a_bfloat16_cache(ext) -> None:  # type: ignore[no-untyped-def]
    # kv_cache_dtype='bfloat16': the cache gets what torch's .to(bfloat16) gives (nearest even)
    T, H, KVH, D = 20, 9, 3, 64
    q, k, v, cos, sin = _qkv(T, H, KVH, D, seed=11)
    slots = torch.randperm(2 * T)[:T]
    kc = torch.zeros(2 * T, KVH, D, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    want_kc, want_vc = kc.clone(), vc.clone()
    rotate_and_cache(q, k, v, cos, sin, want_kc, want_vc, slots)  # the reference's write
    got_q, got_k = rotate_and_cache(q, k, v, cos, sin, kc, vc, slots, None, ext)
    assert got_q.dtype == got_k.dtype == torch.float32  # what attention gets stays float32
    torch.testing.assert_close(got_k, apply_rotary(k, cos, sin), rtol=1e-6, atol=1e-6)
    assert torch.equal(vc, want_vc)  # v is not rotated: bit for bit
    # k: the rotation's float32 rounding may differ by an ulp, moving a bfloat16 rounding by one
    assert (kc.float() - want_kc.float()).abs().max() <= 2**-7 * want_kc.float().abs().max()
    mixed = torch.zeros(2 * T, KVH, D)
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        ext.rotary_write_kv(q, k, v, cos, sin, kc, mixed, slots)


def test_rotary_write_kv_checks_its_inputs(ext) -> None:  # type: ignore[no-untyped-def]
    q, k, v, cos, sin = _qkv(2, 4, 2, 8, seed=0)
    kc, vc = torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)
    with pytest.raises(RuntimeError, match="past the cache"):
        ext.rotary_write_kv(q, k, v, cos, sin, kc, vc, torch.tensor([0, 4]))
    with pytest.raises(RuntimeError, match="caches"):
        ext.rotary_write_kv(q, k, v, cos, sin, kc[:, :1], vc, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="float32"):
        ext.rotary_write_kv(q.double(), k, v, cos, sin, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="cos and sin"):
        ext.rotary_write_kv(q, k, v, cos[:1], sin, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="unit stride"):
        ext.rotary_write_kv(q.transpose(1, 2), k, v, cos, sin, kc, vc, torch.tensor([0, 1]))


@pytest.mark.parametrize(("T", "inter"), [(1, 1536), (3, 17), (20, 64), (1, 5)])
def test_silu_and_mul_matches_torch(ext, T: int, inter: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(T + inter)
    x = torch.randn(T, 2 * inter, generator=g) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, -90.0, 0.0])  # exp's clamps, either side
    want = silu_and_mul(x)
    got = silu_and_mul(x, ext)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="even"):
        ext.silu_and_mul(torch.randn(2, 7))
