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


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit, NaN payloads aside (torch writes 0x7fc0 or 0xffff by its path)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def _qkv_bf16(T: int, H: int, KVH: int, D: int, seed: int):  # type: ignore[no-untyped-def]
    """As _qkv in bfloat16, as a bfloat16 model has them: cos and sin rounded too."""
    q, k, v, cos, sin = _qkv(T, H, KVH, D, seed)
    qkv = torch.cat([t.reshape(T, -1) for t in (q, k, v)], dim=1).mul(3).bfloat16()
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    return (q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D), qkv,
            cos.bfloat16(), sin.bfloat16())  # fmt: skip


# head_dim 64 and 128 (AVX-512 halves), 34 and 6 (scalar tails), 96 (a vector and a tail);
# T = 1 and T >= 16 (the OpenMP branch)
BF16_ROTARY = [(1, 9, 3, 64), (8, 9, 3, 64), (64, 9, 3, 64), (5, 8, 4, 6), (17, 2, 1, 128),
               (3, 2, 2, 34), (20, 3, 1, 96)]  # fmt: skip


@pytest.mark.parametrize(("T", "H", "KVH", "D"), BF16_ROTARY)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_rotary_write_kv_bfloat16_equals_the_reference(ext, T: int, H: int, KVH: int, D: int,
                                                       cache_dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    q, k, v, qkv, cos, sin = _qkv_bf16(T, H, KVH, D, seed=T * 100 + D)
    qk = qkv[:, : (H + KVH) * D].unflatten(1, (H + KVH, D))  # as the model passes it
    want_q, want_k = apply_rotary(qk, cos, sin).split([H, KVH], dim=1)
    slots = torch.randperm(3 * T)[:T]
    slots[T // 2] = -1  # a padded row: nothing written
    keep = slots >= 0
    want_kc = torch.full((3 * T, KVH, D), 7.0, dtype=cache_dtype)
    want_vc = want_kc.clone()
    want_kc[slots[keep]] = want_k[keep].to(cache_dtype)
    want_vc[slots[keep]] = v[keep].to(cache_dtype)
    kc, vc = torch.full_like(want_kc, 7.0), torch.full_like(want_vc, 7.0)
    got_q, got_k = rotate_and_cache(q, k, v, cos, sin, kc, vc, slots, qk, ext)
    assert got_q.is_contiguous() and got_q.dtype == torch.bfloat16
    _same_bits(got_q, want_q)
    _same_bits(got_k, want_k)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


def test_rotary_write_kv_bfloat16_nan_and_inf(ext) -> None:  # type: ignore[no-untyped-def]
    T, H, KVH, D = 3, 2, 1, 64
    q, k, v, _, cos, sin = _qkv_bf16(T, H, KVH, D, seed=5)
    q[0, 0, 3] = float("nan")
    q[1, 1, 40] = float("inf")
    k[2, 0, 0] = float("-inf")
    q[2, 0, 10] = 3e38  # products that round up to inf
    kc = torch.zeros(T, KVH, D, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    got_q, got_k = rotate_and_cache(q, k, v, cos, sin, kc, vc, torch.arange(T), None, ext)
    assert want_q.isnan().any() and want_q.isinf().any()
    _same_bits(got_q, want_q)
    _same_bits(got_k, want_k)


def test_rotary_write_kv_mixed_dtypes_take_the_reference(ext) -> None:  # type: ignore[no-untyped-def]
    # bfloat16 q with float32 cos and sin: the reference (float32 results), not the kernel
    q, k, v, _, cos, sin = _qkv_bf16(2, 4, 2, 8, seed=0)
    kc, vc = torch.zeros(4, 2, 8, dtype=torch.bfloat16), torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1])
    got_q, _ = rotate_and_cache(q, k, v, cos.float(), sin.float(), kc, vc, slots, None, ext)
    assert got_q.dtype == torch.float32
    with pytest.raises(RuntimeError, match="cos and sin"):
        ext.rotary_write_kv(q, k, v, cos.float(), sin.float(), kc, vc, slots)
    with pytest.raises(RuntimeError, match="as q"):
        ext.rotary_write_kv(q, k.float(), v, cos, sin, kc, vc, slots)


@pytest.mark.parametrize(("T", "inter"), [(1, 1536), (8, 1536), (64, 1536), (3, 17), (20, 64),
                                          (1, 5), (16, 33), (2, 1)])  # fmt: skip
def test_silu_and_mul_bfloat16_equals_the_reference(ext, T: int, inter: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(T + inter)
    for scale in (1.0, 4.0, 40.0):
        x = (torch.randn(T, 2 * inter, generator=g) * scale).bfloat16()
        _same_bits(silu_and_mul(x, ext), silu_and_mul(x))


def test_silu_and_mul_bfloat16_every_gate(ext) -> None:  # type: ignore[no-untyped-def]
    # silu(gate), rounded, depends on the gate alone: all 65536 bfloat16 gates (NaN, inf, those
    # below -88 where exp overflows, subnormals) in the vector loop (rows of 64) and the scalar
    # tail (rows of 15); the product with up is then one float32 product, rounded.
    gates = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for inter in (64, 15):
        n = gates.numel() // inter * inter
        gate = gates[:n].view(-1, inter)
        x = torch.cat([gate, torch.full_like(gate, 1.0)], dim=1)
        _same_bits(silu_and_mul(x, ext), silu_and_mul(x))
    x = torch.cat([gates.view(-1, 64), torch.randn(1024, 64).bfloat16() * 8], dim=1)
    _same_bits(silu_and_mul(x, ext), silu_and_mul(x))


@pytest.mark.parametrize("V", [1, 15, 16, 17, 100, 49152])
@pytest.mark.parametrize("B", [1, 3, 4, 64])
def test_argmax_rows_is_torch_argmax(ext, B: int, V: int) -> None:  # type: ignore[no-untyped-def]
    """Greedy sampling's argmax: the first of equal maxima, the first NaN of a row with one, 0 for
    a row of -inf, as torch.argmax."""
    g = torch.Generator().manual_seed(B * 100003 + V)
    x = torch.randn(B, V, generator=g)
    if V > 1:  # ties at the maximum: the first wins
        x[0, V // 2] = x[0, V - 1] = x[0].max() + 1
    if B > 1:
        x[1] = float("-inf")
    if B > 2:
        x[2, V - 1] = float("nan")
        x[2, V // 3] = float("nan")
        x[2, 0] = float("inf")
    if B > 3:
        x[3, V - 1] = float("inf")
        x[3] = x[3].round()  # many equal values
    assert torch.equal(ext.argmax_rows(x), x.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.argmax_rows(x.t() if B > 1 and V > 1 else x.double())


def test_the_sampler_takes_greedy_argmax_from_the_extension(ext) -> None:  # type: ignore[no-untyped-def]
    from runtime.sampler import Sampler, SamplingState
    from runtime.sampling_params import SamplingParams

    logits = torch.randn(8, 1000)
    logits[:, 7] = logits.max() + 1  # row maxima tied at index 7 and
    logits[:, 900] = logits[:, 7]  # at 900: 7 is the first
    states = [SamplingState(SamplingParams(temperature=0), None, [], []) for _ in range(8)]
    calls = []

    class Spy:
        def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape)
            return ext.argmax_rows(x)  # type: ignore[no-any-return]

    assert Sampler(Spy()).__call__(logits, states).token_ids == [7] * 8  # type: ignore[arg-type]
    assert calls == [(8, 1000)]
    assert Sampler()(logits, states).token_ids == [7] * 8


def test_silu_and_mul_far_below_exps_clamp_is_torchs(ext) -> None:  # type: ignore[no-untyped-def]
    """Gates past exp's clamp in the vector lanes of a float32 row: torch's -0 (and NaN at
    -inf), as in the scalar tail and in bfloat16 rows; the clamp gave -1e-36 and -inf."""
    x = torch.randn(2, 64)
    x[0, :5] = torch.tensor([-float("inf"), -1000.0, -100.0, -88.5, -87.0])
    x[1, 20:23] = torch.tensor([-1000.0, float("nan"), 1000.0])
    want = silu_and_mul(x)
    got = silu_and_mul(x, ext)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0, equal_nan=True)
    assert torch.equal(got.signbit(), want.signbit())
