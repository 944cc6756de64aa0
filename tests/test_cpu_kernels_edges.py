"""The CPU extension kernels against float64 references on the edges the other tests leave:
head dims and GQA ratios off the fast paths, block sizes 1/16/32 with lengths at and one past a
block boundary, bfloat16 caches and weights, the few-row matmul's switch-over points with K and N
off the SIMD width, NaN rows (which must not leak into other rows), non-contiguous inputs, no
rows at all, and two threads calling at once (the kernels run without the GIL)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kernels import cpu_ext
from kernels.linear import MAX_ROWS_PACKED, Packed, pack, small_linear


def _built(ext: ModuleType | None, what: str) -> ModuleType:
    if ext is None:
        pytest.skip(f"the CPU {what} extension did not build here")
    return ext


@pytest.fixture(scope="module")
def attn() -> ModuleType:
    return _built(cpu_ext.load(), "attention")


@pytest.fixture(scope="module")
def gemm() -> ModuleType:
    return _built(cpu_ext.load_small_gemm(), "small-matmul")


def _decode_ref(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, blocks: torch.Tensor,
                lens: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """Decode attention in float64, request by request."""
    n, H, D = q.shape
    bs, Hkv = kb.shape[1], kb.shape[2]
    out = torch.empty(n, H, D, dtype=torch.float64)
    for i in range(n):
        L = int(lens[i])
        ids = blocks[i, : (L + bs - 1) // bs]
        k = kb[ids].reshape(-1, Hkv, D)[:L].double().repeat_interleave(H // Hkv, 1)
        v = vb[ids].reshape(-1, Hkv, D)[:L].double().repeat_interleave(H // Hkv, 1)
        p = (torch.einsum("hd,lhd->hl", q[i].double(), k) * scale).softmax(-1)
        out[i] = torch.einsum("hl,lhd->hd", p, v)
    return out


def _paged(n: int, lens: list[int], bs: int, Hkv: int, D: int, dtype: torch.dtype,
           g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Caches (blocks, bs, Hkv, D) and n block tables, blocks shuffled, one spare column."""
    nb = max((L + bs - 1) // bs for L in lens) + 1
    nblocks = n * nb + 2
    kb = torch.randn(nblocks, bs, Hkv, D, generator=g).to(dtype)
    vb = torch.randn(nblocks, bs, Hkv, D, generator=g).to(dtype)
    tables = torch.randperm(nblocks, generator=g)[: n * nb].view(n, nb).contiguous()
    return kb, vb, tables


@pytest.mark.parametrize("D", [64, 80, 96, 128, 72, 17])
@pytest.mark.parametrize("G", [1, 3, 8, 9])
@pytest.mark.parametrize("bs", [1, 16, 32])
def test_decode_matches_float64_off_the_fast_paths(attn, D: int, G: int, bs: int) -> None:  # type: ignore[no-untyped-def]
    """Lengths at and one past block boundaries, 9 requests (the all-heads task split) and 2;
    float32 and bfloat16 caches under float32 queries, and bfloat16 throughout."""
    g = torch.Generator().manual_seed(D * 100 + G * 10 + bs)
    Hkv = 2
    lens = [1, bs, bs + 1, 2 * bs, 2 * bs + 1, 33, 47, 3, 64]
    for qdt, kdt, tol in ((torch.float32, torch.float32, 1e-4),
                          (torch.float32, torch.bfloat16, 1e-4),
                          (torch.bfloat16, torch.bfloat16, 3e-2)):  # fmt: skip
        kb, vb, tables = _paged(len(lens), lens, bs, Hkv, D, kdt, g)
        q = (torch.randn(len(lens), Hkv * G, D, generator=g) * 2).to(qdt)
        lt = torch.tensor(lens)
        for n in (len(lens), 2):
            args = (q[:n].contiguous(), kb, vb, tables[:n].contiguous(), lt[:n].contiguous())
            got = attn.paged_decode_attention(*args, 1 / math.sqrt(D))
            want = _decode_ref(*args, 1 / math.sqrt(D))
            assert got.dtype == qdt
            assert (got.double() - want).abs().max().item() < tol, (qdt, kdt, n)


def test_decode_long_context_and_mixed_lengths(attn) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    lens = [8193, 1, 16, 17, 3000, 2]
    kb, vb, tables = _paged(len(lens), lens, 16, 2, 64, torch.bfloat16, g)
    q = torch.randn(len(lens), 6, 64, generator=g) * 3
    args = (q, kb, vb, tables, torch.tensor(lens))
    got = attn.paged_decode_attention(*args, 0.125)
    assert (got.double() - _decode_ref(*args, 0.125)).abs().max().item() < 1e-4


def test_decode_nan_query_stays_in_its_row(attn) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(2)
    lens = [25, 10] * 6
    kb, vb, tables = _paged(len(lens), lens, 16, 2, 64, torch.float32, g)
    q = torch.randn(len(lens), 4, 64, generator=g)
    q[1, 1, 5] = float("nan")
    for n in (2, 12):  # a task per kv head, then a task per request
        out = attn.paged_decode_attention(q[:n].contiguous(), kb, vb, tables[:n].contiguous(),
                                          torch.tensor(lens[:n]), 0.125)  # fmt: skip
        assert torch.isnan(out).any(-1).nonzero().tolist() == [[1, 1]]


def _prefill_ref(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, spans: torch.Tensor,
                 tables: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    bs, Hkv, D, H = kb.shape[1], kb.shape[2], q.shape[2], q.shape[1]
    out = out.double()
    for c in range(spans.shape[0]):
        r0, n, ctx = spans[c].tolist()
        L = ctx + n
        ids = tables[c, : (L + bs - 1) // bs]
        k = kb[ids].reshape(-1, Hkv, D)[:L].double().repeat_interleave(H // Hkv, 1)
        v = vb[ids].reshape(-1, Hkv, D)[:L].double().repeat_interleave(H // Hkv, 1)
        s = torch.einsum("nhd,lhd->hnl", q[r0 : r0 + n].double(), k) * scale
        later = torch.arange(L)[None] > torch.arange(ctx, ctx + n)[:, None]
        out[r0 : r0 + n] = torch.einsum("hnl,lhd->nhd", s.masked_fill(later, -math.inf).softmax(-1), v)
    return out


@pytest.mark.parametrize("D", [16, 64, 80, 128])
@pytest.mark.parametrize("G", [1, 3, 8])
@pytest.mark.parametrize("bs", [1, 16, 32])
def test_prefill_chunks_in_place_match_float64(attn, D: int, G: int, bs: int) -> None:  # type: ignore[no-untyped-def]
    """Several chunks of mixed lengths after 3 decode rows (left alone), cached tokens at and
    one past a block boundary, float32 and bfloat16 caches."""
    if not attn.prefill_supported(G, D):
        pytest.skip(f"no in-place prefill for G={G}, D={D} here")
    g = torch.Generator().manual_seed(D * 100 + G * 10 + bs)
    Hkv, H = 2, 2 * G
    shapes = [(1, 0), (bs + 1, 0), (17, bs), (33, bs + 1), (5, 2 * bs), (40, 7)]
    chunks, row = [], 3
    for n, ctx in shapes:
        chunks.append((row, n, ctx))
        row += n
    for kdt in (torch.float32, torch.bfloat16):
        kb, vb, tables = _paged(len(chunks), [n + c for n, c in shapes], bs, Hkv, D, kdt, g)
        spans = torch.tensor(chunks)
        q = torch.randn(row, H, D, generator=g)
        out = torch.full((row, H, D), 7.0)
        attn.paged_prefill_attention(q, kb, vb, spans, tables, 1 / math.sqrt(D), out)
        want = _prefill_ref(q, kb, vb, spans, tables, 1 / math.sqrt(D), out)
        assert (out[:3] == 7.0).all()
        assert (out.double() - want).abs().max().item() < 1e-4, kdt


def _spoiled(what: str, q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, table: torch.Tensor,
             row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """q, kb, vb with one value made NaN or infinite: in `row` of q (its last head), or in the
    cache at key 3 (kv head 0) of the request of block table `table`."""
    q, kb, vb = q.clone(), kb.clone(), vb.clone()
    bad = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[what.split()[-1]]
    bs = kb.shape[1]
    if what.startswith("query"):
        q[row, -1, q.shape[2] // 2] = bad
    else:
        (kb if what.startswith("key") else vb)[table[3 // bs], 3 % bs, 0, 1] = bad
    return q, kb, vb


SPOILS = ["query nan", "query inf", "query -inf", "key nan", "key inf", "value nan"]


@pytest.mark.parametrize("D, G", [(64, 3), (16, 1), (128, 8)])
@pytest.mark.parametrize("kdt", [torch.float32, torch.bfloat16])
def test_prefill_nan_or_inf_gives_the_references_nan_rows(attn, D: int, G: int,
                                                           kdt: torch.dtype) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """A NaN or an infinity in a query row (each row of the step in turn: the first of a chunk,
    with its one key, included), in a cached key or in a value: the rows the reference gives NaN
    are NaN, whole, and the others match it. They came out finite, or NaN in some elements only
    (the running max dropped a NaN score and exp16 made it finite), so a broken activation went
    on unseen."""
    if not attn.prefill_supported(G, D):
        pytest.skip(f"no in-place prefill for G={G}, D={D} here")
    g = torch.Generator().manual_seed(D + G)
    Hkv, shapes = 2, [(20, 0), (17, 5), (1, 40)]  # (rows, cached before)
    spans = torch.tensor([[0, 20, 0], [20, 17, 5], [37, 1, 40]])
    kb, vb, tables = _paged(3, [n + c for n, c in shapes], 16, Hkv, D, kdt, g)
    q0 = torch.randn(38, Hkv * G, D, generator=g)
    for what in SPOILS:
        for row in range(38) if what.startswith("query") else [0]:
            q, k, v = _spoiled(what, q0, kb, vb, tables[0], row)
            out = torch.zeros_like(q)
            attn.paged_prefill_attention(q, k, v, spans, tables, 1 / math.sqrt(D), out)
            want = _prefill_ref(q, k, v, spans, tables, 1 / math.sqrt(D), out)
            assert torch.equal(out.isnan(), want.isnan()), (what, row)
            assert want.isnan().any(), (what, row)
            ok = ~want.isnan()
            assert (out[ok].double() - want[ok]).abs().max().item() < 1e-4, (what, row)


@pytest.mark.parametrize("D, G", [(64, 3), (17, 9), (128, 8)])
def test_decode_nan_or_inf_gives_the_references_nan_rows(attn, D: int, G: int) -> None:  # type: ignore[no-untyped-def]
    """The decode kernel on the same cases (it gave the reference's NaN rows already)."""
    g = torch.Generator().manual_seed(D + G)
    lens = [1, 25, 10, 40] * 3
    kb, vb, tables = _paged(len(lens), lens, 16, 2, D, torch.float32, g)
    q0 = torch.randn(len(lens), 2 * G, D, generator=g)
    for what in SPOILS:
        for row in (0, 1):
            for n in (2, 12):  # a task per kv head, then a task per request
                q, k, v = _spoiled(what, q0, kb, vb, tables[1], row)
                args = (q[:n].contiguous(), k, v, tables[:n].contiguous(), torch.tensor(lens[:n]))
                got = attn.paged_decode_attention(*args, 0.125)
                want = _decode_ref(*args, 0.125)
                assert torch.equal(got.isnan(), want.isnan()), (what, row, n)
                ok = ~want.isnan()
                assert (got[ok].double() - want[ok]).abs().max().item() < 1e-4, (what, row, n)


# The few-row matmul's switch-over points: 1, 2-8 (registers), 9-15 (tiles), 16+ (GEMM).
ROWS = [1, 2, 7, 8, 9, 15, 16, 17, 25, 33, 64, 65, 129]


@pytest.mark.parametrize("K,N", [(1, 3), (17, 33), (100, 31), (576, 65)])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_small_linear_across_row_counts_and_ragged_shapes(gemm, K: int, N: int, wdtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(K * N)
    w = torch.randn(N, K, generator=g).to(wdtype)
    b = torch.randn(N, generator=g)
    for M in ROWS:
        base = torch.randn(M, K + 3, generator=g)
        x = base[:, 2 : K + 2]  # offset, strided rows: as a slice of a wider activation
        for bias in (None, b):
            got = gemm.small_linear(x, w, bias)
            want = x.double() @ w.double().T + (0 if bias is None else bias.double())
            assert (got.double() - want).abs().max().item() < 1e-4 * max(1.0, K**0.5), (M, bias is None)
        x = x.clone()
        x[M // 2, K // 2] = float("nan")
        rows = torch.isnan(gemm.small_linear(x, w, None)).any(1).nonzero().flatten().tolist()
        assert rows == [M // 2], M  # a NaN stays in its own row


def _q4_1(N: int, K: int, g: torch.Generator) -> torch.Tensor:
    """float32 weights that are exactly Q4_1 blocks (float16 d and m, q in 0..15)."""
    d = (torch.rand(N, K // 32, 1, generator=g) * 0.1 + 0.01).half().float()
    m = (torch.randn(N, K // 32, 1, generator=g) * 0.1).half().float()
    q = torch.randint(0, 16, (N, K // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    return (m + d * q).reshape(N, K)


def test_packed_across_row_counts_with_a_nan_row(gemm) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    w = _q4_1(33, 96, g)
    found = gemm.pack_blocks(w, 0)
    assert found is not None
    p = Packed(*found)
    b = torch.randn(33, generator=g)
    for M in [1, 2, 8, 9, 16, 17, 33, MAX_ROWS_PACKED, MAX_ROWS_PACKED + 1]:
        x = torch.randn(M, 97, generator=g)[:, 1:]
        got = gemm.packed_linear(x, p.qs, p.scales, b)
        assert (got.double() - (x.double() @ w.double().T + b.double())).abs().max() < 1e-3
        x = x.clone()
        x[M // 2, 7] = float("nan")
        rows = torch.isnan(gemm.packed_linear(x, p.qs, p.scales, None)).any(1).nonzero()
        assert rows.flatten().tolist() == [M // 2]


def test_small_linear_takes_no_rows(gemm) -> None:  # type: ignore[no-untyped-def]
    """No rows (an LM head over a step that samples nothing) give the reference's empty result
    through every path, not the kernels' refusal of M = 0."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 64, generator=g)
    b = torch.randn(40, generator=g)
    for x, weight, bias in ((torch.empty(0, 64), w, b),
                            (torch.empty(0, 64), w.bfloat16(), b),
                            (torch.empty(0, 64, dtype=torch.bfloat16), w.bfloat16(), None)):  # fmt: skip
        y = small_linear(x, weight, bias, gemm)
        assert y.shape == (0, 40) and y.dtype == x.dtype
    packed = pack(_q4_1(40, 64, g), gemm)
    if packed is not None:  # (AVX-512 hosts)
        assert small_linear(torch.empty(0, 64), w, None, gemm, packed).shape == (0, 40)


def test_two_threads_at_once_match_one_at_a_time(attn, gemm) -> None:  # type: ignore[no-untyped-def]
    """The kernels release the GIL: two threads on different tensors at once give what each gives
    alone (the GEMM's per-thread panels, the prefill's scratch, the decode's partition)."""

    def jobs(seed: int) -> list[Callable[[], torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        out: list[Callable[[], torch.Tensor]] = []
        w = torch.randn(200, 96, generator=g)
        for M in (1, 5, 9, 16, 40, 100):
            x = torch.randn(M, 96, generator=g)
            out.append(lambda x=x: gemm.small_linear(x, w, None))
            out.append(lambda x=x: gemm.small_linear(x, w.bfloat16(), None))
        lens = torch.randint(1, 65, (10,), generator=g)
        kb, vb, tables = _paged(10, [64], 16, 2, 64, torch.float32, g)
        q = torch.randn(10, 8, 64, generator=g)
        out.append(lambda: attn.paged_decode_attention(q, kb, vb, tables, lens, 0.125))
        if attn.prefill_supported(4, 64):
            qq = torch.randn(50, 8, 64, generator=g)
            spans = torch.tensor([[0, 30, 10], [30, 20, 0]])

            def prefill() -> torch.Tensor:
                o = torch.zeros(50, 8, 64)
                attn.paged_prefill_attention(qq, kb, vb, spans, tables[:2].contiguous(), 0.125, o)
                return o

            out.append(prefill)
        return out

    a, b = jobs(1), jobs(2)
    alone = [[j() for j in a], [j() for j in b]]
    wrong: list[int] = []

    def run(js: list[Callable[[], torch.Tensor]], want: list[torch.Tensor]) -> None:
        for _ in range(10):
            wrong.extend(i for i, (j, w) in enumerate(zip(js, want, strict=True))
                         if not torch.equal(j(), w))  # fmt: skip

    threads = [threading.Thread(target=run, args=(js, w)) for js, w in zip((a, b), alone, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


# Run in a fresh process (OMP_NUM_THREADS is read when libgomp loads): an engine set to
# num_threads=argv[2] serves a request on the main thread, then one on a fresh thread (as
# runtime.async_engine's step loop is); then each kernel is called on a fresh thread of its own.
# Prints how many threads each of those started (the OpenMP team beside the calling thread).
FRESH_THREADS = """
import json, os, sys, threading
import torch
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from kernels import cpu_ext

llm = LLM(sys.argv[1], kv_cache_bytes=1 << 22, num_threads=int(sys.argv[2]))
greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
prompt = [[1, *range(20, 120)]]  # 100 tokens: the prompt's rows are split over threads
llm.generate(prompt, greedy)

attn, gemm = cpu_ext.load(), cpu_ext.load_small_gemm()
norm, fused = cpu_ext.load_rms_norm(), cpu_ext.load_fused()
g = torch.Generator().manual_seed(0)
w = torch.randn(64, 256, generator=g)
d = (torch.rand(64, 8, 1, generator=g) * 0.1 + 0.01).half().float()  # Q4_1 blocks, as _q4_1
m = (torch.randn(64, 8, 1, generator=g) * 0.1).half().float()
q4 = torch.randint(0, 16, (64, 8, 32), generator=g).float()
q4[..., 0], q4[..., 1] = 0, 15
q4 = (m + d * q4).reshape(64, 256)
qs, scales = gemm.pack_blocks(q4, 1)
x = torch.randn(128, 256, generator=g)
kc, vc = torch.zeros(256, 2, 64), torch.zeros(256, 2, 64)
rope = (torch.randn(128, 4, 64), torch.randn(128, 2, 64), torch.randn(128, 2, 64),
        torch.randn(128, 64), torch.randn(128, 64), kc, vc, torch.arange(128))
kb, vb = kc.view(16, 16, 2, 64), vc.view(16, 16, 2, 64)
calls = {
    "engine step": lambda: llm.generate(prompt, greedy),
    "rms_norm": lambda: norm.rms_norm(x, x[0], 1e-5),
    "rotary_write_kv": lambda: fused.rotary_write_kv(*rope),
    "silu_and_mul": lambda: fused.silu_and_mul(x),
    "argmax_rows": lambda: fused.argmax_rows(torch.randn(64, 4096)),
    "small_linear": lambda: gemm.small_linear(x[:16], w),
    "pack_blocks": lambda: gemm.pack_blocks(q4, 0),
    "packed_linear": lambda: gemm.packed_linear(x[:16], qs, scales),
    "unpack_blocks": lambda: gemm.unpack_blocks(qs, scales),
    "paged_decode_attention": lambda: attn.paged_decode_attention(
        torch.randn(16, 4, 64), kb, vb, torch.arange(16).view(16, 1), torch.full((16,), 16), 0.125),
}
started = {}

def fresh(name):
    before = set(os.listdir("/proc/self/task"))
    calls[name]()
    started[name] = len(set(os.listdir("/proc/self/task")) - before)

for name in calls:
    t = threading.Thread(target=fresh, args=(name,))
    t.start()
    t.join()
print(json.dumps(started))
"""


@pytest.mark.parametrize("omp, threads", [(3, 1), (1, 2)])
def test_a_fresh_thread_runs_the_kernels_on_the_configured_threads(
        attn, gemm, stories_dir: Path, omp: int, threads: int) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """OpenMP keeps its thread count per calling thread, and torch sets it on a thread at that
    thread's first parallel op: the kernels' own regions, run before any on a fresh thread, forked
    libgomp's default (OMP_NUM_THREADS, or every core) instead of num_threads (--threads): with
    3 against 1, 2 more threads each; with 1 against 2, none. (The engine's step loop, a fresh
    thread, was spared only because the embedding lookup, a torch op, comes first in a step.)
    Every call on a fresh thread now runs on the configured team: the calling thread and
    num_threads - 1 more."""
    env = {**os.environ, "OMP_NUM_THREADS": str(omp), "PYTHONPATH": str(Path(__file__).parents[1])}
    run = subprocess.run([sys.executable, "-c", FRESH_THREADS, str(stories_dir), str(threads)],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    started = json.loads(run.stdout.strip().splitlines()[-1])
    assert started == dict.fromkeys(started, threads - 1)
