"""The Triton rotary embedding (kernels/triton_rotary.py) and KV-cache writes, alone and fused with
the rotation (kernels/triton_kv_write.py): interpreted on the CPU against their references and
a float64 computation, with q, k, v as column views of one fused qkv row and the model's own RoPE
tables (no scaling, linear, llama3); the caches written at the mapped slots and nowhere else;
their input checks; and their compilation for sm_90.

The interpreted cases live in this module's `_run_*` functions; each test runs one of them in a
fresh interpreter (TRITON_INTERPRET is read when a kernel is defined)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels.triton_kv_write import (
    _rotary_write_kv_kernel,
    _write_kv_kernel,
    rotary_write_kv,
    rotary_write_kv_ref,
    write_kv,
    write_kv_ref,
)
from kernels.triton_rotary import _rotary_kernel, launch_config, rotary, rotary_ref
from runtime.config import RopeConfig
from tests.triton_tools import compile_for_hopper, run_interpreted

MAX_POS = 4096  # positions are drawn below this
ROPES = {
    "none": RopeConfig(theta=10000.0),
    "linear": RopeConfig(theta=10000.0, scaling_type="linear", factor=4.0),
    "llama3": RopeConfig(
        theta=500000.0,
        scaling_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
}
# (head_dim, heads, kv_heads, pad): stories260K's 8 heads of 8 over 4 KV heads; 6 over 3 (a
# partial block of q heads: BLOCK_H is 4); 80-dim heads, MQA; `pad`: heads that many values
# further apart than head_dim (as from a wider tensor), else q, k, v are plain column views.
SHAPES = [(8, 8, 4, 0), (64, 6, 3, 0), (80, 2, 1, 0), (64, 4, 2, 16)]
SENTINEL = -77.0  # what the caches hold where nothing was written (exact in every dtype)


# ---------------------------------------------------------------------------------------------
# Inputs and checks, shared by the interpreted runs


def _tables(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (MAX_POS, head_dim) cos and sin tables built as LlamaForCausalLM._rope builds the
    model's: the rope settings' (scaled) inverse frequencies times the positions, twice over."""
    inv_freq = rope.inv_freq(head_dim)  # (head_dim // 2,)
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv_freq)  # (MAX_POS, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (MAX_POS, head_dim)
    return emb.cos(), emb.sin()


def _inputs(
    T: int, shape: tuple[int, int, int, int], rope: str, dtype: torch.dtype, g: torch.Generator
) -> dict[str, torch.Tensor]:
    """q, k, v as views of one fused (T, (H + 2 Hkv) * (D + pad)) row, and cos, sin gathered in
    their dtype for random positions below MAX_POS (the last token at MAX_POS - 1); or, for
    rope "random", random tables."""
    D, H, Hkv, pad = shape
    fused = torch.randn(T, (H + 2 * Hkv) * (D + pad), generator=g).to(dtype)
    heads = fused.view(T, H + 2 * Hkv, D + pad)[:, :, :D]  # (T, H + 2 Hkv, D)
    q, k, v = heads.split([H, Hkv, Hkv], dim=1)
    if rope == "random":
        cos, sin = (torch.randn(T, D, generator=g).to(dtype) for _ in range(2))
        return {"q": q, "k": k, "v": v, "cos": cos, "sin": sin}
    pos = torch.randint(0, MAX_POS, (T,), generator=g)
    pos[-1] = MAX_POS - 1
    cos, sin = _tables(ROPES[rope], D)
    return {"q": q, "k": k, "v": v, "cos": cos[pos].to(dtype), "sin": sin[pos].to(dtype)}


def _slots(T: int, num_slots: int, g: torch.Generator) -> torch.Tensor:
    """Distinct random slots; every third token skipped (-1 or -5), and with 7 or more tokens
    one slot past the cache (skipped too)."""
    slots = torch.randperm(num_slots, generator=g)[:T]
    slots[::3] = torch.tensor([-1, -5]).repeat(T)[: len(slots[::3])]
    if T >= 7:
        slots[4] = num_slots
    return slots


def _exact(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation in float64, written out half by half."""
    x, c, s = x.double(), cos.double()[:, None, :], sin.double()[:, None, :]
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * c[..., :h] - x2 * s[..., :h], x2 * c[..., h:] + x1 * s[..., h:]), -1)


def _check(got: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor, what: Any) -> None:
    """The kernel's error against float64 within 4x the reference's (plus a tiny floor), and the
    two within a few roundings of each other: the reference rounds each product and the sum to
    the dtype, the kernel only the result, so they may differ by ~2 eps of the products."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, what
    err = (got.double() - exact).abs().max().item()
    ref_err = (ref.double() - exact).abs().max().item()
    assert err <= 4 * ref_err + 1e-6, (what, err, ref_err)
    tol = 4 * torch.finfo(ref.dtype).eps * exact.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=0, atol=tol, msg=str(what))


def _cases() -> list[tuple[int, tuple[int, int, int, int], str, torch.dtype]]:
    """(T, shape, rope, dtype): every shape with every T and every rope (a Latin square), in
    float32 and bfloat16 (T = 33: one of them, in turn), float16 too at T = 7; and two cases of
    random tables, whose halves differ (the model's are equal): the kernel uses them whole."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    cases = []
    for i, shape in enumerate(SHAPES):
        for j, (T, dtypes) in enumerate([(1, (f32, bf16)), (7, (f32, bf16, f16)),
                                         (33, ((f32, bf16)[i % 2],))]):  # fmt: skip
            cases += [(T, shape, list(ROPES)[(i + j) % 3], dtype) for dtype in dtypes]
    return [*cases, (7, SHAPES[1], "random", f32), (7, SHAPES[0], "random", bf16)]


def _run_rotary_cases() -> None:
    g = torch.Generator().manual_seed(0)
    for case in _cases():
        T, shape, rope, dtype = case
        x = _inputs(T, shape, rope, dtype, g)
        before = {n: t.clone() for n, t in x.items()}
        q_rot, k_rot = rotary(x["q"], x["k"], x["cos"], x["sin"])
        q_ref, k_ref = rotary_ref(x["q"], x["k"], x["cos"], x["sin"])
        assert q_rot.is_contiguous() and k_rot.is_contiguous(), case
        _check(q_rot, q_ref, _exact(x["q"], x["cos"], x["sin"]), ("q", *case))
        _check(k_rot, k_ref, _exact(x["k"], x["cos"], x["sin"]), ("k", *case))
        assert all(torch.equal(x[n], before[n]) for n in x), case  # inputs untouched


def _caches(T: int, Hkv: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    num_slots = 16 * (T // 16 + 2)  # blocks of 16, some never written
    cache = torch.full((num_slots, Hkv, D), SENTINEL, dtype=dtype)
    return cache, cache.clone()


def _run_write_kv_cases() -> None:
    g = torch.Generator().manual_seed(1)
    for case in _cases():
        T, shape, rope, dtype = case
        x = _inputs(T, shape, rope, dtype, g)
        k_cache, v_cache = _caches(T, shape[2], shape[0], dtype)
        slots = _slots(T, k_cache.shape[0], g)
        k_want, v_want = k_cache.clone(), v_cache.clone()
        write_kv(x["k"], x["v"], k_cache, v_cache, slots)
        write_kv_ref(x["k"], x["v"], k_want, v_want, torch.where(slots < len(k_cache), slots, -1))
        assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want), case  # bit for bit
        live = slots[(slots >= 0) & (slots < len(k_cache))]
        assert (k_cache != SENTINEL).any(-1).any(-1).nonzero().flatten().sort()[0].tolist() == (
            live.sort()[0].tolist()
        ), case  # written at the live slots, nowhere else


def _run_fused_cases() -> None:
    g = torch.Generator().manual_seed(2)
    for case in _cases():
        T, shape, rope, dtype = case
        x = _inputs(T, shape, rope, dtype, g)
        k_cache, v_cache = _caches(T, shape[2], shape[0], dtype)
        slots = _slots(T, k_cache.shape[0], g)
        k_want, v_want = k_cache.clone(), v_cache.clone()
        args = (x["q"], x["k"], x["v"], x["cos"], x["sin"])
        q_rot = rotary_write_kv(*args, k_cache, v_cache, slots)
        in_range = torch.where(slots < len(k_cache), slots, -1)
        q_ref = rotary_write_kv_ref(*args, k_want, v_want, in_range)
        assert q_rot.is_contiguous(), case
        _check(q_rot, q_ref, _exact(x["q"], x["cos"], x["sin"]), ("q", *case))
        live = in_range >= 0
        rows = in_range[live]
        assert torch.equal(v_cache, v_want), case  # v copied bit for bit, nowhere else
        assert torch.equal(v_cache[rows], x["v"][live]), case
        others = torch.ones(len(k_cache), dtype=torch.bool)
        others[rows] = False
        assert (k_cache[others] == SENTINEL).all(), case  # k nowhere else
        if rows.numel():
            exact = _exact(x["k"], x["cos"], x["sin"])[live]
            _check(k_cache[rows], k_want[rows], exact, ("k", *case))


def _interpret(run: str) -> None:
    """`run` (one of this module's functions) in a fresh interpreter with TRITON_INTERPRET=1."""
    script = f"from tests.test_triton_rotary_kv import {run}\n{run}()\nprint('ok')\n"
    assert run_interpreted(script).strip() == "ok"


# ---------------------------------------------------------------------------------------------
# Interpreted


def test_rotary_matches_reference_and_float64() -> None:
    _interpret("_run_rotary_cases")


def test_write_kv_writes_the_mapped_slots_only() -> None:
    _interpret("_run_write_kv_cases")


def test_rotary_write_kv_matches_reference_and_float64() -> None:
    _interpret("_run_fused_cases")


# ---------------------------------------------------------------------------------------------
# Bad inputs: refused before launch, so no interpreter is needed


def _good(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    T, H, Hkv, D = 3, 4, 2, 8
    qkv = torch.randn(T, (H + 2 * Hkv) * D).to(dtype)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=1)
    return {
        "q": q.view(T, H, D),
        "k": k.view(T, Hkv, D),
        "v": v.view(T, Hkv, D),
        "cos": torch.ones(T, D, dtype=dtype),
        "sin": torch.zeros(T, D, dtype=dtype),
        "k_cache": torch.zeros(32, Hkv, D, dtype=dtype),
        "v_cache": torch.zeros(32, Hkv, D, dtype=dtype),
        "slot_mapping": torch.arange(T),
    }


def _odd_head_dim(a: dict[str, torch.Tensor]) -> None:
    for n in ("q", "k", "v", "k_cache", "v_cache", "cos", "sin"):
        a[n] = a[n][..., :7]


RF, WF, RWF = (
    "rotary rotary_write_kv",
    "write_kv rotary_write_kv",
    "rotary write_kv rotary_write_kv",
)
BAD: list[tuple[str, Any, str, str]] = [
    # (what, how the good inputs are spoiled, the message, the wrappers that take that argument)
    ("odd head_dim", _odd_head_dim, "head_dim must be even", RF),
    ("q 2-D", lambda a: a.update(q=a["q"].flatten(1)), r"q must be 3-D .* got shape \(3, 32\)", RF),
    ("cos rows", lambda a: a.update(cos=a["cos"][:2]), r"cos must be \(tokens, head_dim\)", RF),
    (
        "sin cols",
        lambda a: a.update(sin=torch.zeros(3, 16)),
        r"sin must be \(tokens, head_dim\)",
        RF,
    ),
    ("cos dtype", lambda a: a.update(cos=a["cos"].double()), "cos must be in q's dtype", RF),
    ("q int", lambda a: a.update(q=a["q"].int()), "q must be float32, float16 or bfloat16", RF),
    ("k head_dim", lambda a: a.update(k=torch.zeros(3, 2, 6)), r"k must be \(3, kv_heads, 8\)", RF),
    ("cos device", lambda a: a.update(cos=a["cos"].to("meta")), "cos is on meta", RF),
    ("cos strided", lambda a: a.update(cos=torch.ones(8, 3).t()), "cos must be contiguous", RF),
    (
        "q last dim",
        lambda a: a.update(q=torch.zeros(3, 8, 4).transpose(1, 2)),
        "q's last dim must be contiguous",
        RF,
    ),
    (
        "k last dim",
        lambda a: a.update(k=torch.zeros(3, 8, 2).transpose(1, 2)),
        "k's last dim must be contiguous",
        RWF,
    ),
    (
        "slots int32",
        lambda a: a.update(slot_mapping=a["slot_mapping"].int()),
        "slot_mapping must be int64",
        WF,
    ),
    (
        "slots length",
        lambda a: a.update(slot_mapping=torch.arange(4)),
        r"slot_mapping must be \(3,\)",
        WF,
    ),
    (
        "slots device",
        lambda a: a.update(slot_mapping=a["slot_mapping"].to("meta")),
        "slot_mapping is on meta",
        WF,
    ),
    ("cache dtype", lambda a: a.update(k_cache=a["k_cache"].half()), "k_cache must be in k's", WF),
    (
        "cache heads",
        lambda a: a.update(v_cache=torch.zeros(32, 4, 8)),
        r"v_cache must be \(num_slots, 2, 8\)",
        WF,
    ),
    (
        "cache slots",
        lambda a: a.update(v_cache=torch.zeros(16, 2, 8)),
        "v_cache must be shaped like k_cache",
        WF,
    ),
    ("cache device", lambda a: a.update(k_cache=a["k_cache"].to("meta")), "k_cache is on meta", WF),
    (
        "cache strided",
        lambda a: a.update(k_cache=torch.zeros(2, 32, 8).transpose(0, 1)),
        "k_cache must be contiguous",
        WF,
    ),
    ("v shape", lambda a: a.update(v=a["v"][:, :1]), "v must be shaped like k", WF),
    ("v dtype", lambda a: a.update(v=a["v"].half()), "v must be in k's dtype", WF),
]
WRAPPERS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "rotary": (rotary, ("q", "k", "cos", "sin")),
    "write_kv": (write_kv, ("k", "v", "k_cache", "v_cache", "slot_mapping")),
    "rotary_write_kv": (
        rotary_write_kv,
        ("q", "k", "v", "cos", "sin", "k_cache", "v_cache", "slot_mapping"),
    ),
}


@pytest.mark.parametrize("what, spoil, message, takers", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_are_refused_naming_the_argument(
    what: str, spoil: Any, message: str, takers: str
) -> None:
    """Each wrapper that takes the spoiled argument refuses it with a ValueError naming itself
    and the argument, before any launch (with no GPU and no interpreter here, a launch would
    fail otherwise)."""
    a = _good()
    spoil(a)
    for name in takers.split():
        fn, names = WRAPPERS[name]
        with pytest.raises(ValueError, match=message) as e:
            fn(*(a[n] for n in names))
        assert str(e.value).startswith(f"{name}: "), e.value


def test_empty_step_launches_nothing() -> None:
    """Zero tokens: empty results, caches untouched (no launch, so no GPU needed here)."""
    a = {n: t[:0] if n not in ("k_cache", "v_cache") else t for n, t in _good().items()}
    q_rot, k_rot = rotary(a["q"], a["k"], a["cos"], a["sin"])
    assert q_rot.shape == (0, 4, 8) and k_rot.shape == (0, 2, 8)
    write_kv(*(a[n] for n in WRAPPERS["write_kv"][1]))
    assert rotary_write_kv(*(a[n] for n in WRAPPERS["rotary_write_kv"][1])).shape == (0, 4, 8)
    assert not a["k_cache"].any() and not a["v_cache"].any()


# ---------------------------------------------------------------------------------------------
# Compiled for Hopper

# (H, Hkv, D, dtype): stories260K, Llama-3-8B, 80-dim MQA, 256-dim MHA
HOPPER = [(8, 4, 8, "fp32"), (32, 8, 128, "bf16"), (4, 1, 80, "fp16"), (16, 16, 256, "bf16")]


CONSTEXPRS = ("HEAD_DIM", "BLOCK_H", "BLOCK_HALF", "BLOCK_D")


def _signature(fn: Any, ty: str) -> dict[str, str]:
    """Pointers to `ty` (the slots: int64), int32 ints (num_slots: int64), the rest constexpr."""
    sig = {}
    for name in fn.arg_names:
        if name in CONSTEXPRS:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*i64" if name == "slot_ptr" else f"*{ty}"
        else:
            sig[name] = "i64" if name == "num_slots" else "i32"
    return sig


@pytest.mark.parametrize("H, Hkv, D, ty", HOPPER)
def test_kernels_compile_for_hopper(H: int, Hkv: int, D: int, ty: str) -> None:
    """No GPU here: compile each kernel to a cubin for sm_90 with the constexprs and num_warps
    its wrapper launches these shapes with, catching what the interpreter does not (types)."""
    import triton

    block_h, block_half, num_warps = launch_config(Hkv, D)
    block_d = triton.next_power_of_2(D)
    consts = {"HEAD_DIM": D, "BLOCK_H": block_h, "BLOCK_HALF": block_half, "BLOCK_D": block_d}
    for kernel in (_rotary_kernel, _write_kv_kernel, _rotary_write_kv_kernel):
        sig = _signature(kernel, ty)
        constexprs = {n: consts[n] for n in sig if n in consts}
        compile_for_hopper(kernel, sig, constexprs, num_warps=num_warps)
