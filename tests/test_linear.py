"""The small-matmul kernel against float64, beside the PyTorch reference it replaces: float32
weights (1-256 rows of x) and bfloat16 weights (any rows), through each of its paths (1-8 rows,
9-15, the blocked GEMM from 16; partial weight panels and ragged K), and packed weights (exact
Q4_1 / Q8_0 blocks of float32 weights, as a GGUF import makes them)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels import cpu_ext
from kernels.linear import (
    MAX_ROWS,
    MAX_ROWS_BF16_ACT,
    MAX_ROWS_PACKED,
    ONEDNN_ENV,
    ONEDNN_ROWS,
    Packed,
    applies,
    onednn_linear_on,
    pack,
    small_linear,
)


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


@pytest.fixture
def onednn(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Sets EDGEINFER_ONEDNN_LINEAR for one test: onednn("1") / onednn("0"); the choice is
    asked again after."""

    def set_to(value: str) -> bool:
        monkeypatch.setenv(ONEDNN_ENV, value)
        onednn_linear_on.cache_clear()
        return onednn_linear_on()

    yield set_to
    onednn_linear_on.cache_clear()


def onednn_product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def test_falls_back_where_the_kernel_does_not_apply(ext, onednn) -> None:  # type: ignore[no-untyped-def]
    onednn("0")
    w = torch.randn(7, 16)
    for x in (torch.randn(MAX_ROWS + 1, 16), torch.randn(2, 16).double(), torch.randn(3, 2, 16)):
        assert not applies(x, w.to(x.dtype))
        want = torch.nn.functional.linear(x, w.to(x.dtype))
        assert torch.equal(small_linear(x, w.to(x.dtype), None, ext), want)
    assert not applies(torch.randn(1, 16), torch.randn(16, 7).t())  # non-contiguous weights


@pytest.mark.parametrize("bias", [False, True])
def test_rows_past_the_kernel_take_onednn_when_it_is_on(ext, onednn, bias: bool) -> None:  # type: ignore[no-untyped-def]
    """Float32 rows past the kernel's (a prompt chunk) go through oneDNN's matmul where it is on,
    up to the last multiple of ONEDNN_ROWS, and the rest through the kernel: each one's result bit
    for bit, within float32 rounding of the float64 product as torch's GEMM is; off, torch's GEMM
    bit for bit. Other dtypes and shapes take torch's either way."""
    if not onednn("1"):
        pytest.skip("this torch has no oneDNN linear")
    g = torch.Generator().manual_seed(9)
    x = torch.randn(300, 576, generator=g)
    w = torch.randn(960, 576, generator=g)
    b = torch.randn(960, generator=g) if bias else None
    got = small_linear(x, w, b, ext)
    head = 300 // ONEDNN_ROWS * ONEDNN_ROWS
    assert torch.equal(got[:head], onednn_product(x[:head], w, b))
    assert torch.equal(got[head:], ext.small_linear(x[head:], w, b))
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    ref_err = (torch.nn.functional.linear(x, w, b).double() - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 4 * ref_err + 1e-5 * 576**0.5
    assert torch.equal(small_linear(x[:head], w, b, ext), onednn_product(x[:head], w, b))
    strided = x[:, :288]  # a view whose rows are not contiguous
    assert torch.equal(small_linear(strided, w[:, :288].contiguous(), b, ext),
                       small_linear(strided.contiguous(), w[:, :288].contiguous(), b, ext))  # fmt: skip
    strided_bias = torch.randn(1920, generator=g)[::2]  # oneDNN reads it as if contiguous
    assert torch.equal(small_linear(x, w, strided_bias, ext),
                       small_linear(x, w, strided_bias.contiguous(), ext))  # fmt: skip
    for other in (x.double(), x[None]):  # float64, and three dimensions: torch's, as they were
        assert torch.equal(small_linear(other, w.to(other.dtype), None, ext),
                           torch.nn.functional.linear(other, w.to(other.dtype)))  # fmt: skip
    # without the kernel: fewer than ONEDNN_ROWS rows take torch's GEMM, the rest as above
    assert torch.equal(small_linear(x[:100], w, b), torch.nn.functional.linear(x[:100], w, b))
    got = small_linear(x, w, b)
    assert torch.equal(got[:head], onednn_product(x[:head], w, b))
    assert torch.equal(got[head:], torch.nn.functional.linear(x[head:], w, b))
    assert not onednn("0")
    assert torch.equal(small_linear(x, w, b, ext), torch.nn.functional.linear(x, w, b))


def test_onednn_sees_a_few_row_counts_whatever_the_steps_rows(onednn, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """oneDNN keeps a primitive (0.26-0.65 MB) for each row count it is given: under continuous
    batching, with a step's rows any number, a worker's memory grew without end. Over row counts
    129-2048, with the kernel and without, float32 and bfloat16 weights, oneDNN is given
    multiples of ONEDNN_ROWS only, and every product is within float32 rounding of float64's,
    as torch's GEMM is."""
    if not onednn("1"):
        pytest.skip("this torch has no oneDNN linear")
    op = torch.ops.mkldnn._linear_pointwise
    seen: set[int] = set()

    def recording(x: torch.Tensor, *args):  # type: ignore[no-untyped-def]
        seen.add(x.shape[0])
        return op(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", recording)
    ext = cpu_ext.load_small_gemm()  # (None where it does not build: torch's GEMM only)
    g = torch.Generator().manual_seed(13)
    k = 64
    w = torch.randn(40, k, generator=g)
    b = torch.randn(40, generator=g)
    for m in [*range(129, 2049, 37), 255, 256, 257, 2047, 2048]:
        x = torch.randn(m, k, generator=g)
        for weight in (w, w.bfloat16()):
            exact = torch.nn.functional.linear(x.double(), weight.double(), b.double())
            ref = torch.nn.functional.linear(x, weight.float(), b)
            ref_err = (ref.double() - exact).abs().max().item()
            for kernel in (None,) if ext is None else (ext, None):
                got = small_linear(x, weight, b, kernel)
                assert got.shape == (m, 40) and got.dtype == torch.float32
                err = (got.double() - exact).abs().max().item()
                assert err <= 4 * ref_err + 1e-5 * k**0.5, (m, weight.dtype, kernel, err)
    assert sorted(seen) == [ONEDNN_ROWS * i for i in range(1, 2048 // ONEDNN_ROWS + 1)]


def test_onednn_setting_refuses_other_values(onednn) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="EDGEINFER_ONEDNN_LINEAR='yes'"):
        onednn("yes")


def test_onednn_probe_is_float32_whatever_the_default_dtype(onednn) -> None:  # type: ignore[no-untyped-def]
    """The probe's tensors are float32 under another default dtype (float64 ones made oneDNN
    raise, and every float32 product after it)."""
    if not onednn("1"):
        pytest.skip("this torch has no oneDNN linear")
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert onednn("1")
    finally:
        torch.set_default_dtype(before)


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


@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_activations_round_once_as_torch_does(
    ext, m: int, k: int, n: int, bias: bool
) -> None:  # type: ignore[no-untyped-def]
    """A bfloat16 model's few-row products: bfloat16 x and weights (and bias) through the kernel
    in float32, rounded to bfloat16 once: within a bfloat16 rounding of the float64 product, as
    torch's bfloat16 GEMM is."""
    g = torch.Generator().manual_seed(m * 1000 + k + n + 11)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    assert applies(x, w)
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    got = small_linear(x, w, b, ext)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    ref = torch.nn.functional.linear(x, w, b)
    ulp = exact.abs() * 2.0**-8 + 1e-5 * k**0.5  # a bfloat16 rounding, plus float32 sums
    assert ((got.double() - exact).abs() <= ulp).all()
    assert ((ref.double() - exact).abs() <= ulp).all()  # the same bound holds for torch's


def test_bfloat16_activations_take_torch_above_the_kernel_rows(ext) -> None:  # type: ignore[no-untyped-def]
    """More rows than MAX_ROWS_BF16_ACT, or bfloat16 x over float32 weights, go to torch: the same
    result as torch's own, bit for bit."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 64, generator=g).bfloat16()
    x = torch.randn(MAX_ROWS_BF16_ACT + 1, 64, generator=g).bfloat16()
    assert not applies(x, w) and not applies(x[:1], w.float())
    assert torch.equal(small_linear(x, w, None, ext), torch.nn.functional.linear(x, w))


# ---- packed weights: float32 weights that are exact Q4_1 / Q8_0 values (kernels.linear.pack)

Q = gguf.GGMLQuantizationType


def gguf_weights(n: int, k: int, qtype: Q, seed: int = 0) -> torch.Tensor:
    """A float32 weight as runtime.gguf_import makes it: llama.cpp's blocks through the `gguf`
    package's quantize and dequantize."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[0, :32] = 0.25  # a block of equal values (d = 0)
    w[1, :32] = 0.0  # of zeros (Q4_0 gives them back as -0.0: its d is 0 / -8)
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).copy())


# Q4_0 blocks, d * (q - 8), are kept in Q4_1's layout with m = -8 d; Q5_0's, d * (q - 16), fit
# Q6_K's int8 layout (a d each 16, the same d twice) before the Q5 one, at the same 10 bits
@pytest.mark.parametrize(("qtype", "fmt"), [(Q.Q4_1, "Q4_1"), (Q.Q4_0, "Q4_1"), (Q.Q8_0, "Q8_0"),
                                            (Q.Q5_1, "Q5"), (Q.Q5_0, "Q6_K")])  # fmt: skip
def test_pack_finds_the_blocks_and_gives_every_weight_back(ext, qtype: Q, fmt: str) -> None:  # type: ignore[no-untyped-def]
    w = gguf_weights(70, 96, qtype)
    qs, scales = ext.pack_blocks(w)
    assert qs.dtype == (torch.uint8 if fmt in ("Q4_1", "Q5") else torch.int8)
    assert qs.nbytes + scales.nbytes < w.nbytes / 3
    one = ext.pack_blocks(w, 1)  # one thread (the background search): the same blocks
    assert torch.equal(one[0], qs) and torch.equal(one[1], scales)
    back = ext.unpack_blocks(qs, scales)
    assert torch.equal(back, w)  # every weight, as a number (Q4_0's -0.0 may come back +0.0)
    nonzero = w != 0
    assert torch.equal(back.view(torch.int32)[nonzero], w.view(torch.int32)[nonzero])
    if ext.packed_fast():
        packed = pack(w, ext)
        assert packed is not None and packed.format == fmt


def k_quant_weights(
    n: int, k: int, seed: int = 0, q_range: tuple[int, int] | None = None, qtype: Q = Q.Q4_K
) -> torch.Tensor:
    """A float32 weight as runtime.gguf_import makes it from llama.cpp's k-quant blocks (Q4_K,
    Q5_K, Q6_K; random but valid: gguf dequantizes k-quants, it does not quantize them);
    `q_range` (Q4_K): every 4-bit q in it (a sub-block whose q do not reach 0 or 15)."""
    from tests.test_gguf_import import random_k_blocks

    rng = np.random.default_rng(seed)
    data = random_k_blocks(n, k, qtype, rng)
    if q_range is not None:
        assert qtype == Q.Q4_K
        data = data.reshape(n, k // 256, 144)
        q = rng.integers(q_range[0], q_range[1] + 1, size=(n, k // 256, 256)).astype(np.uint8)
        data[:, :, 16:] = q[:, :, :128] | (q[:, :, 128:] << 4)  # (d, dmin, scales, then qs)
    w = gguf.quants.dequantize(data.reshape(n, -1), qtype)
    return torch.from_numpy(np.array(w, dtype=np.float32))


def reads_like_float32(ext, w: torch.Tensor, fmt: str) -> None:  # type: ignore[no-untyped-def]
    """Where the packed kernels run: w packs in layout `fmt`, and small_linear over the blocks
    matches float64 as closely as the float32 weights do, at 1, 8 and MAX_ROWS_PACKED rows."""
    if not ext.packed_fast():
        return
    packed = pack(w, ext)
    assert packed is not None and packed.format == fmt
    k = w.shape[1]
    for m in (1, 8, MAX_ROWS_PACKED):
        # seeded: the bound is statistical (max error over the outputs), and an x drawn from the
        # global generator, whose state depends on the tests run before, failed it in a full run
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = small_linear(x, w, None, ext, packed)
        want = torch.nn.functional.linear(x.double(), w.double())
        ref_err = (torch.nn.functional.linear(x, w).double() - want).abs().max().item()
        assert (got.double() - want).abs().max().item() <= 4 * ref_err + 5e-7 * k**0.5


@pytest.mark.parametrize("q_range", [None, (0, 15), (0, 9), (3, 15), (5, 11), (7, 7)])
def test_pack_finds_q4_k_sub_blocks_in_q4_1_layout(ext, q_range: tuple[int, int] | None) -> None:  # type: ignore[no-untyped-def]
    """Q4_K (the usual 4-bit GGUF type) sub-blocks are (d sc) q - dmin m: float32 scale and
    offset of up to 17 bits, which the Q4_1 layout holds (fma(s, q, -o) rounds as the importer
    did), found again even where a sub-block's q do not span 0..15."""
    w = k_quant_weights(40, 512, seed=3, q_range=q_range)
    found = ext.pack_blocks(w)
    assert found is not None
    qs, scales = found
    assert qs.dtype == torch.uint8 and qs.nbytes + scales.nbytes < w.nbytes / 3
    back = ext.unpack_blocks(qs, scales)
    nonzero = w != 0
    assert torch.equal(back, w)
    assert torch.equal(back.view(torch.int32)[nonzero], w.view(torch.int32)[nonzero])
    reads_like_float32(ext, w, "Q4_1")


def test_pack_finds_q5_k_sub_blocks(ext) -> None:  # type: ignore[no-untyped-def]
    """Q5_K sub-blocks, (d sc) q - dmin m with q in 0..31: the Q5 layout (a byte a q, float32
    scale and offset a block of 32), found as Q4_K's are."""
    w = k_quant_weights(40, 512, seed=5, qtype=Q.Q5_K)
    found = ext.pack_blocks(w)
    assert found is not None
    qs, scales = found
    assert qs.dtype == torch.uint8 and qs.shape == (40, 512) and scales.shape == (40, 16, 2)
    assert torch.equal(ext.unpack_blocks(qs, scales), w)
    reads_like_float32(ext, w, "Q5")
    w[9, 77] = torch.nextafter(w[9, 77], torch.tensor(-1.0))
    assert ext.pack_blocks(w) is None


def test_pack_finds_q6_k_sub_blocks(ext) -> None:  # type: ignore[no-untyped-def]
    """Q6_K (the 6-bit type a Q4_K_M file gives its most sensitive tensors) is (d sc) (q - 32)
    with a scale each 16 values: kept as int8 with a float32 scale each 16 (10 bits a weight)."""
    w = k_quant_weights(40, 512, seed=4, qtype=Q.Q6_K)
    w[3, 16:32] = 0.0  # a sub-block of zeros (its scale 0)
    found = ext.pack_blocks(w)
    assert found is not None
    qs, scales = found
    assert qs.dtype == torch.int8 and scales.shape == (40, 512 // 16)
    assert qs.nbytes + scales.nbytes < w.nbytes / 3
    assert torch.equal(ext.unpack_blocks(qs, scales), w)
    reads_like_float32(ext, w, "Q6_K")
    w[7, 300] = torch.nextafter(w[7, 300], torch.tensor(1.0))
    assert ext.pack_blocks(w) is None


def test_pack_refuses_weights_that_are_not_blocks(ext) -> None:  # type: ignore[no-untyped-def]
    assert ext.pack_blocks(torch.randn(8, 64)) is None  # plain float32
    w = gguf_weights(8, 64, Q.Q4_1)
    w[3, 40] = torch.nextafter(w[3, 40], torch.tensor(1.0))  # one weight off by one ulp
    assert ext.pack_blocks(w) is None
    w = k_quant_weights(8, 256)
    w[2, 100] = torch.nextafter(w[2, 100], torch.tensor(1.0))
    assert ext.pack_blocks(w) is None
    w = gguf_weights(8, 64, Q.Q8_0)
    w[5, 7] = float("nan")
    assert ext.pack_blocks(w) is None
    assert ext.pack_blocks(gguf_weights(8, 64, Q.Q8_0)[:, :48].contiguous()) is None  # K % 32
    assert pack(torch.randn(8, 64), ext) is None
    assert pack(gguf_weights(8, 64, Q.Q8_0).to(torch.bfloat16), ext) is None


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0, Q.Q8_0, Q.Q5_1], ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64])
@pytest.mark.parametrize(("k", "n"), [(64, 5), (96, 70), (576, 131)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_kernel_matches_float64_as_closely_as_the_float32_weights(
    ext, qtype: Q, m: int, k: int, n: int, bias: bool  # type: ignore[no-untyped-def]
) -> None:
    w = gguf_weights(n, k, qtype, seed=m)
    g = torch.Generator().manual_seed(1000 + m)  # (seeded: see reads_like_float32)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    qs, scales = ext.pack_blocks(w)
    got = ext.packed_linear(x, qs, scales, b)
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    ref_err = (torch.nn.functional.linear(x, w, b).double() - want).abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= 4 * ref_err + 5e-7 * k**0.5, (err, ref_err)  # as test_kernel_... at w's scale


def test_small_linear_reads_the_blocks_up_to_max_rows_packed(ext) -> None:  # type: ignore[no-untyped-def]
    if not ext.packed_fast():
        pytest.skip("packing is used where the extension has its AVX-512 kernels")
    w = gguf_weights(48, 64, Q.Q4_1)
    packed = pack(w, ext)
    assert packed is not None
    # blocks that disagree with w: the result tells which weights were read
    other = Packed(packed.qs, packed.scales * 2)
    x = torch.randn(MAX_ROWS_PACKED, 64)
    got = small_linear(x, w, None, ext, other)
    torch.testing.assert_close(got, 2 * (x @ w.T), rtol=1e-4, atol=1e-4)
    x = torch.randn(MAX_ROWS_PACKED + 1, 64)
    got = small_linear(x, w, None, ext, other)
    torch.testing.assert_close(got, x @ w.T, rtol=1e-4, atol=1e-4)
