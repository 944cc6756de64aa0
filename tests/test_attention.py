"""Paged attention, request by request, against an unpaged float64 computation.

Awkward lengths (1, 17, 97, block size +- 1) and several block sizes; the decode path is checked
for both implementations (the PyTorch reference and the in-place CPU extension), and chunked
prefill over cached context for the reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import cpu_ext
from kernels.attention import (
    DecodeGroup,
    PagedAttentionMetadata,
    PrefillChunk,
    paged_attention,
    write_kv_cache,
)

H, HKV, D = 8, 2, 16


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int) -> torch.Tensor:
    """float64 causal attention of queries at positions ctx.. over keys 0..ctx+n-1 (heads and
    head_dim from the shapes)."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)  # (L, H, D)
    v = v.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])  # (H, n, L)
    n, L = q.shape[0], k.shape[0]
    allowed = torch.arange(L)[None, :] <= (ctx + torch.arange(n))[:, None]  # (n, L)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # (n, H, D)


def scattered_tables(lens: list[int], bs: int, num_blocks: int, seed: int) -> list[list[int]]:
    """Block tables that use blocks out of order, as a long-running cache does."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for n in lens:
        need = -(-n // bs)
        tables.append(perm[used : used + need])
        used += need
    return tables


def padded_block_ids(tables: list[list[int]]) -> torch.Tensor:
    """The block tables as one (requests, widest) tensor, shorter ones padded with block 0, as
    the model runner pads a decode group's."""
    block_ids = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int64)
    for i, t in enumerate(tables):
        block_ids[i, : len(t)] = torch.tensor(t)
    return block_ids


def decode_mask(lens: list[int], block_ids: torch.Tensor, bs: int) -> torch.Tensor:
    """DecodeGroup's mask: (requests, 1, 1, keys) True for each request's own keys."""
    keys = torch.arange(block_ids.shape[1] * bs)
    return (keys[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]


def nan_cache_with(lens: list[int], hkv: int, d: int, bs: int, seed: int,
                   dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]  # fmt: skip
    """A (blocks, bs, hkv, d) key and value cache of `dtype` filled with NaN, then random keys and
    values of requests of `lens` tokens written through scattered block tables. Returns (k_cache,
    v_cache, tables, keys, values), keys and values per request as (n, hkv, d), float32, as the
    cache holds them (rounded, where it is bfloat16)."""
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    k_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = scattered_tables(lens, bs, num_blocks, seed=seed)
    keys = [torch.randn(n, hkv, d).to(dtype).float() for n in lens]
    vals = [torch.randn(n, hkv, d).to(dtype).float() for n in lens]
    for t, kk, vv in zip(tables, keys, vals, strict=True):
        pos = torch.arange(kk.shape[0])
        slots = torch.tensor(t)[pos // bs] * bs + pos % bs
        write_kv_cache(kk, vv, k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d), slots)
    return k_cache, v_cache, tables, keys, vals


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("impl", ["torch", "cpu_ext"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_dense(bs: int, impl: str, dtype: torch.dtype) -> None:
    if impl == "cpu_ext" and cpu_ext.load() is None:
        pytest.skip("the CPU extension did not build here (no compiler?)")
    torch.manual_seed(0)
    lens = [1, 17, 97, bs - 1 if bs > 1 else 2, bs + 1, 64]
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    k_cache = torch.zeros(num_blocks * bs, HKV, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    tables = scattered_tables(lens, bs, num_blocks, seed=bs)
    keys = [torch.randn(n, HKV, D).to(dtype) for n in lens]
    vals = [torch.randn(n, HKV, D).to(dtype) for n in lens]
    for t, kk, vv in zip(tables, keys, vals, strict=True):
        pos = torch.arange(kk.shape[0])
        slots = torch.tensor(t)[pos // bs] * bs + pos % bs
        write_kv_cache(kk, vv, k_cache, v_cache, slots)
    q = torch.randn(len(lens), H, D).to(dtype)
    block_ids = padded_block_ids(tables)
    mask = decode_mask(lens, block_ids, bs)
    group = DecodeGroup(0, len(lens), block_ids, torch.tensor(lens), mask)
    meta = PagedAttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.int64),
        block_size=bs,
        decode_impl=impl,
        decodes=[group],
    )
    # k, v of the step are only used by prefills; decodes read the cache.
    out = paged_attention(q, q[:, :HKV], q[:, :HKV], k_cache, v_cache, meta, D**-0.5)
    for i, n in enumerate(lens):
        ref64 = dense_attention(q[i : i + 1], keys[i], vals[i], ctx=n - 1)
        # The kernel's error is bounded by a small multiple of a plain same-dtype computation's.
        plain = dense_attention(q[i : i + 1].float(), keys[i].float(), vals[i].float(), n - 1)
        plain = plain.to(dtype).double()
        tol = 4 * (plain - ref64).abs().max().item() + 1e-5
        err = (out[i : i + 1].double() - ref64).abs().max().item()
        assert err <= tol, (impl, bs, n, err, tol)


@pytest.mark.parametrize(
    ("h", "hkv", "d", "bs"),
    [
        (9, 3, 64, 16),  # SmolLM2: the AVX-512 loops, three query heads per kv head
        (32, 8, 128, 16),  # Llama-3-8B-like: eight vectors per row
        (16, 2, 64, 32),  # eight query heads per kv head; a block split into two 16-row pieces
        (8, 8, 32, 8),  # no GQA; blocks shorter than 16 rows
        (12, 1, 32, 16),  # twelve query heads per kv head: past the AVX-512 loops' eight
        (4, 2, 48, 4),  # two query heads per kv head, a head_dim of 3 vectors (a partial group)
        (6, 2, 16, 1),  # three query heads per kv head, one vector, one-row blocks
        (10, 2, 64, 16),  # five query heads per kv head
        (8, 8, 72, 16),  # head_dim a multiple of 8, not 16: the AVX2 loops
        (8, 4, 20, 4),  # head_dim not a multiple of 8: the generic loops
    ],
)
@pytest.mark.parametrize(
    ("q_dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
     (torch.bfloat16, torch.bfloat16)],
    ids=["f32", "bf16-cache", "bf16"],
)  # fmt: skip
def test_cpu_decode_kernel_shapes(
    h: int, hkv: int, d: int, bs: int, q_dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """The CPU extension at real models' shapes, with enough requests (>= 8) that each task takes
    all kv heads of a request, against float64. The cache starts as NaN, so a kernel that let a
    stale row past a request's length into its result fails. A bfloat16 cache under float32
    queries (`kv_cache_dtype`) is widened as read: float32's accuracy over the values it holds.
    bfloat16 queries (a bfloat16 model; head_dim a multiple of 32: the scores by bfloat16 dot
    products where the CPU has them) are float32 sums over the same values, rounded once."""
    ext = cpu_ext.load()
    if ext is None:
        pytest.skip("the CPU extension did not build here (no compiler?)")
    torch.manual_seed(2)
    lens = [1, 15, 16, 17, 33, 200, 64, 5, 130]
    k_cache, v_cache, tables, keys, vals = nan_cache_with(lens, hkv, d, bs, seed=3,
                                                          dtype=cache_dtype)  # fmt: skip
    block_ids = padded_block_ids(tables)
    q = torch.randn(len(lens), h, d).to(q_dtype)
    out = ext.paged_decode_attention(q, k_cache, v_cache, block_ids, torch.tensor(lens), d**-0.5)
    assert out.dtype == q_dtype
    for i, n in enumerate(lens):
        ref = dense_attention(q[i : i + 1], keys[i], vals[i], ctx=n - 1)
        if q_dtype == torch.float32:
            torch.testing.assert_close(out[i : i + 1].double(), ref, atol=2e-5, rtol=1e-4)
        else:  # one bfloat16 rounding of a float32 result
            err = (out[i : i + 1].double() - ref).abs()
            assert (err <= ref.abs() * 2.0**-8 + 2e-5).all(), (i, err.max().item())


@pytest.mark.parametrize("impl", ["torch", "cpu_ext"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_decode_ignores_what_masked_slots_hold(impl: str, value: float) -> None:
    """Rows a request does not own (past its length in its last block, and the block-0 padding
    of a shorter block table: another request's rows) may hold anything, NaN or inf from a
    request whose activations overflowed included: no path lets them into the output (the
    reference's masked SDPA did, through NaN + -inf and 0 * inf)."""
    if impl == "cpu_ext" and cpu_ext.load() is None:
        pytest.skip("the CPU extension did not build here (no compiler?)")
    torch.manual_seed(1)
    bs, lens = 16, [21, 3, 40]
    k_cache, v_cache, tables, keys, vals = nan_cache_with(lens, HKV, D, bs, seed=7)
    k_cache[k_cache.isnan()] = value
    v_cache[v_cache.isnan()] = value
    block_ids = padded_block_ids(tables)
    mask = decode_mask(lens, block_ids, bs)
    meta = PagedAttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.int64), block_size=bs, decode_impl=impl,
        decodes=[DecodeGroup(0, len(lens), block_ids, torch.tensor(lens), mask)],
    )
    q = torch.randn(len(lens), H, D)
    flat_k, flat_v = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
    out = paged_attention(q, q[:, :HKV], q[:, :HKV], flat_k, flat_v, meta, D**-0.5)
    for i, n in enumerate(lens):
        ref = dense_attention(q[i : i + 1], keys[i], vals[i], ctx=n - 1)
        torch.testing.assert_close(out[i : i + 1].double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n", [1, 3, 7])
@pytest.mark.parametrize(("h", "hkv", "d"), [(9, 3, 64), (32, 8, 128), (4, 4, 32)])
def test_cpu_decode_few_bfloat16_requests(n: int, h: int, hkv: int, d: int) -> None:
    """Under 8 requests a task takes one kv head of one request (a bfloat16 model's decode
    with a few requests; the scores by bfloat16 dot products where the CPU has them)."""
    ext = cpu_ext.load()
    if ext is None:
        pytest.skip("the CPU extension did not build here (no compiler?)")
    torch.manual_seed(n)
    lens = [1, 33, 17, 200, 16, 5, 64][:n]
    k_cache, v_cache, tables, keys, vals = nan_cache_with(lens, hkv, d, 16, seed=n,
                                                          dtype=torch.bfloat16)  # fmt: skip
    block_ids = padded_block_ids(tables)
    q = torch.randn(n, h, d).bfloat16()
    out = ext.paged_decode_attention(q, k_cache, v_cache, block_ids, torch.tensor(lens), d**-0.5)
    for i, L in enumerate(lens):
        ref = dense_attention(q[i : i + 1], keys[i], vals[i], ctx=L - 1)
        err = (out[i : i + 1].double() - ref).abs()
        assert (err <= ref.abs() * 2.0**-8 + 2e-5).all(), (i, err.max().item())


@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize(("ctx", "n"), [(0, 17), (16, 1 + 15), (15, 33), (97, 5)])
def test_prefill_chunk_over_cached_context(bs: int, ctx: int, n: int) -> None:
    torch.manual_seed(1)
    total = ctx + n
    num_blocks = -(-total // bs) + 2
    k_cache = torch.zeros(num_blocks * bs, HKV, D)
    v_cache = torch.zeros_like(k_cache)
    table = scattered_tables([total], bs, num_blocks, seed=7)[0]
    k_all, v_all = torch.randn(total, HKV, D), torch.randn(total, HKV, D)
    pos = torch.arange(total)
    slots = torch.tensor(table)[pos // bs] * bs + pos % bs
    write_kv_cache(k_all[:ctx], v_all[:ctx], k_cache, v_cache, slots[:ctx])
    write_kv_cache(k_all[ctx:], v_all[ctx:], k_cache, v_cache, slots[ctx:])
    chunk = PrefillChunk(query_start=0, query_len=n, context_len=ctx)
    if ctx:
        chunk.kv_slots = slots
        chunk.mask = torch.arange(total)[None, :] <= (ctx + torch.arange(n))[:, None]
    meta = PagedAttentionMetadata(slot_mapping=slots[ctx:], block_size=bs, prefills=[chunk])
    q = torch.randn(n, H, D)
    out = paged_attention(q, k_all[ctx:], v_all[ctx:], k_cache, v_cache, meta, D**-0.5)
    torch.testing.assert_close(
        out.double(), dense_attention(q, k_all, v_all, ctx), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize(
    ("h", "hkv", "d", "bs"),
    [
        (9, 3, 64, 16),  # SmolLM2: 48 rows per task (three query heads x 16 queries)
        (32, 8, 128, 16),  # Llama-3-8B-like
        (16, 2, 64, 32),  # eight query heads per kv head: 128 rows per task; 32-token blocks
        (8, 8, 32, 8),  # no GQA (16 rows per task); blocks shorter than a 16-key tile
        (10, 2, 16, 4),  # five query heads per kv head (80 rows), one vector, 4-token blocks
        (6, 2, 16, 1),  # three per kv head, one-token blocks
    ],
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16-cache"])
def test_cpu_prefill_kernel_shapes(h: int, hkv: int, d: int, bs: int, cache_dtype: torch.dtype) -> None:
    """Prompt chunks through the CPU extension, in place, against float64: fresh prompts and
    chunks after cached tokens, of lengths that end mid-tile and mid-block, with decode rows
    around them left alone. The cache starts as NaN, so a kernel that read a key past a chunk's
    last one (or a block it was not given) fails."""
    ext = cpu_ext.load()
    if ext is None:
        pytest.skip("the CPU extension did not build here (no compiler?)")
    if not ext.prefill_supported(h // hkv, d):
        pytest.skip("no AVX-512 here: prompt chunks go to torch's SDPA")
    torch.manual_seed(4)
    chunks = [(0, 1), (0, 17), (5, 3), (16, 16), (37, 50), (0, 130), (200, 9)]  # (ctx, n)
    lens = [c + n for c, n in chunks]
    k_cache, v_cache, tables, keys, vals = nan_cache_with(lens, hkv, d, bs, seed=5,
                                                          dtype=cache_dtype)  # fmt: skip
    decodes = 3  # rows before the chunks, as in a mixed step: untouched
    T = decodes + sum(n for _, n in chunks)
    q = torch.randn(T, h, d)
    out = torch.full_like(q, 7.0)
    spans, row = [], decodes
    for ctx, n in chunks:
        spans.append([row, n, ctx])
        row += n
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    ext.paged_prefill_attention(q, k_cache, v_cache, torch.tensor(spans), table_t, d**-0.5, out)
    assert (out[:decodes] == 7.0).all()
    for (row, n, ctx), kk, vv in zip(spans, keys, vals, strict=True):
        ref = dense_attention(q[row : row + n], kk, vv, ctx)
        torch.testing.assert_close(out[row : row + n].double(), ref, atol=2e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="keys, its block table"):
        bad = torch.tensor([[decodes, 5, width * bs]])
        ext.paged_prefill_attention(q, k_cache, v_cache, bad, table_t[:1], d**-0.5, out)
    with pytest.raises(RuntimeError, match="outside the step"):
        bad = torch.tensor([[T - 2, 5, 0]])
        ext.paged_prefill_attention(q, k_cache, v_cache, bad, table_t[:1], d**-0.5, out)


@pytest.mark.parametrize("impl", ["torch", "cpu_ext"])
@pytest.mark.parametrize("bs", [4, 16])
def test_bfloat16_cache_under_float32_queries(impl: str, bs: int) -> None:
    """kv_cache_dtype='bfloat16': float32 queries over a bfloat16 cache, decode rows through both
    implementations and prompt chunks through the reference (fresh and after cached tokens), are
    float32 attention over the rounded keys and values; a fresh chunk uses its keys as the cache
    holds them, so a prompt computed whole equals one computed in chunks."""
    if impl == "cpu_ext" and cpu_ext.load() is None:
        pytest.skip("the CPU extension did not build here (no compiler?)")
    torch.manual_seed(9)
    lens = [1, 17, 40, bs + 1]
    k_cache, v_cache, tables, keys, vals = nan_cache_with(lens, HKV, D, bs, seed=bs,
                                                          dtype=torch.bfloat16)  # fmt: skip
    if impl == "torch":  # the reference copies whole blocks and masks: zeros, as the engine's
        k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    block_ids = padded_block_ids(tables)
    mask = decode_mask(lens, block_ids, bs)
    meta = PagedAttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.int64), block_size=bs, decode_impl=impl,
        decodes=[DecodeGroup(0, len(lens), block_ids, torch.tensor(lens), mask)],
    )  # fmt: skip
    q = torch.randn(len(lens), H, D)
    flat_k, flat_v = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
    out = paged_attention(q, None, q[:, :HKV], flat_k, flat_v, meta, D**-0.5)
    assert out.dtype == torch.float32
    for i, n in enumerate(lens):
        ref = dense_attention(q[i : i + 1], keys[i], vals[i], ctx=n - 1)
        torch.testing.assert_close(out[i : i + 1].double(), ref, atol=2e-5, rtol=1e-4)
    # prompt chunks, reference path: the last request's 40 tokens whole, then as 23 + 17
    r, n = 2, lens[2]
    pos = torch.arange(n)
    slots = torch.tensor(tables[r])[pos // bs] * bs + pos % bs
    fresh_k = keys[r] + 1e-3 * torch.randn(n, HKV, D)  # not bfloat16 values: rounded on write
    fresh_v = vals[r] + 1e-3 * torch.randn(n, HKV, D)
    write_kv_cache(fresh_k, fresh_v, flat_k, flat_v, slots)
    qp = torch.randn(n, H, D)
    whole = PagedAttentionMetadata(slot_mapping=slots, block_size=bs,
                                   prefills=[PrefillChunk(query_start=0, query_len=n, context_len=0)])  # fmt: skip
    got = paged_attention(qp, fresh_k, fresh_v, flat_k, flat_v, whole, D**-0.5)
    rk, rv = fresh_k.to(torch.bfloat16).float(), fresh_v.to(torch.bfloat16).float()
    torch.testing.assert_close(got.double(), dense_attention(qp, rk, rv, 0), atol=1e-5, rtol=1e-5)
    tail = PrefillChunk(query_start=0, query_len=17, context_len=23)
    tail.kv_slots = slots
    tail.mask = torch.arange(n)[None, :] <= (23 + torch.arange(17))[:, None]
    meta2 = PagedAttentionMetadata(slot_mapping=slots[23:], block_size=bs, prefills=[tail])
    got2 = paged_attention(qp[23:], fresh_k[23:], fresh_v[23:], flat_k, flat_v, meta2, D**-0.5)
    torch.testing.assert_close(got2, got[23:], atol=1e-6, rtol=1e-5)


def test_write_kv_cache_checks_shapes() -> None:
    cache = torch.zeros(8, HKV, D)
    with pytest.raises(ValueError, match="write_kv_cache"):
        write_kv_cache(
            torch.zeros(2, HKV, D), torch.zeros(2, HKV, D), cache, cache, torch.arange(3)
        )


def test_cpu_kernels_refuse_block_ids_outside_the_cache() -> None:
    """A block id past the cache (or negative) in a decode row's table is an error, as the
    reference's indexing raises: the decode kernel read garbage at num_blocks and crashed the
    process further out. The prefill kernel's bounds are written so that no sum wraps around."""
    ext = cpu_ext.load()
    if ext is None:
        pytest.skip("the CPU extension did not build here (no compiler?)")
    k_cache = torch.randn(8, 16, 2, 64)
    v_cache = torch.randn(8, 16, 2, 64)
    q = torch.randn(2, 4, 64)
    lens = torch.tensor([20, 20])
    for bad in (8, 10**9, -1):
        blocks = torch.tensor([[0, 1], [2, bad]])
        with pytest.raises(RuntimeError, match=f"block {bad} of query 1 outside the cache's 8"):
            ext.paged_decode_attention(q, k_cache, v_cache, blocks, lens, 0.125)
    ok = ext.paged_decode_attention(q, k_cache, v_cache, torch.tensor([[0, 1], [2, 3]]), lens,
                                    0.125)  # fmt: skip
    assert ok.isfinite().all()
    if ext.prefill_supported(2, 64):
        out = torch.zeros(20, 4, 64)
        table = torch.tensor([[0, 1]])
        for spans in ([[2**63 - 10, 20, 0]], [[0, 20, 2**63 - 5]]):
            with pytest.raises(RuntimeError, match=r"outside the step|keys, its block table"):
                ext.paged_prefill_attention(torch.randn(20, 4, 64), k_cache, v_cache,
                                            torch.tensor(spans), table, 0.125, out)  # fmt: skip
