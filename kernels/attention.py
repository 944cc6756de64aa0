"""Attention over a paged KV cache: the PyTorch reference (the CPU path).

Cache layout, per layer (one tensor for keys, one for values):

    cache[num_blocks * block_size, num_kv_heads, head_dim]
          └─ slot = block_id * block_size + offset_in_block

A request's tokens live in the blocks of its block table, in order; token j of the request is at
slot `block_table[j // block_size] * block_size + j % block_size`. The model runner turns block
tables into slot indices once per step (`PagedAttentionMetadata`); every layer reuses them.

Tokens of one step are laid out decode rows first (one query each), then prefill chunks (many
queries each, possibly after tokens already cached: chunked prefill, resumed requests).

On the CPU the extension (`kernels/csrc/paged_decode_cpu.cpp`, `cpu_ext.load()`) takes both
where it builds: decode rows in place (`decode_impl="cpu_ext"`), and, for float32 models whose
heads it supports (`prefill_supported`: AVX-512, up to 8 query heads per kv head, head_dim a
multiple of 16), every prompt chunk of the step in one call (`prefill_spans`/`prefill_tables`).
Otherwise decode rows copy their blocks for SDPA, and chunks go to torch's fused SDPA.

On CUDA tensors (kernels.dispatch) the step runs two Triton kernels instead: paged decode
attention over the decode rows (kernels/triton_decode_attention.py) and prefill attention over
the packed chunks (kernels/triton_prefill_attention.py), both reading every key through the
block tables of `TritonAttention`, which the runner builds instead of the CPU's groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import cpu_ext
from kernels.dispatch import use_triton

# The largest head_dim the Triton attention kernels take (each keeps a query head and its output
# as one tile, head_dim padded to a power of two); their wrappers check it again per call.
TRITON_MAX_HEAD_DIM = 256


def check_triton_head_dim(head_dim: int) -> None:
    """ValueError, naming head_dim and the limit, where the Triton attention kernels cannot take
    a model's heads: the model runner asks when the engine is built on the Triton path, so that
    such a model is refused before it serves, not at its first attention call."""
    if not 1 <= head_dim <= TRITON_MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim {head_dim}: the Triton attention kernels (CUDA) take head_dim "
            f"1..{TRITON_MAX_HEAD_DIM}; this model's heads can be served on the CPU (device='cpu')"
        )


@dataclass(slots=True)
class PrefillChunk:
    """One request computing several tokens this step."""

    query_start: int  # index of the chunk's first token among the step's tokens
    query_len: int  # tokens computed this step
    context_len: int  # tokens of the request already in the cache before this chunk
    kv_slots: torch.Tensor | None = None  # (context_len + query_len,) int64, when context_len > 0
    mask: torch.Tensor | None = (
        None  # (query_len, context_len + query_len) bool, when context_len > 0
    )


@dataclass(slots=True)
class DecodeGroup:
    """Consecutive single-token decodes of similar context length, attended in one batched call.

    Grouping by length bounds the padding each call computes over.
    """

    start: int  # index of the group's first token among the step's tokens
    size: int  # number of decode tokens (requests) in the group
    block_ids: torch.Tensor  # (size, nb) int64: each request's block table, padded with block 0
    lens: torch.Tensor  # (size,) int64: keys each request attends to (its new token included)
    mask: (
        torch.Tensor | None
    )  # (size, 1, 1, nb * block_size) bool, True for real keys; None if all are (or, for the
    # CPU extension, which reads `lens`, not built)


@dataclass(slots=True)
class TritonAttention:
    """The step as the Triton kernels read it: int32 tensors on the cache's device (fixed shapes
    for a captured decode graph: padding rows have seq_len 0 and slot -1)."""

    num_decodes: int  # decode rows, first in the step
    decode_block_tables: torch.Tensor  # (num_decodes, max_blocks): each row's request's blocks
    decode_seq_lens: torch.Tensor  # (num_decodes,): keys each row attends to, itself included
    prefill_block_tables: torch.Tensor  # (N, max_blocks) of the N prefill chunks
    query_start_loc: torch.Tensor  # (N + 1,): chunk i's rows, counted from the first prefill row
    context_lens: torch.Tensor  # (N,): tokens of chunk i's request cached before it
    max_query_len: int  # the longest chunk (a host int: the kernel's grid)


@dataclass(slots=True)
class PagedAttentionMetadata:
    """Where each token of a step reads and writes the cache; built once per step."""

    slot_mapping: torch.Tensor  # (T,) int64: cache slot each new token's key/value is written to
    block_size: int  # tokens per cache block
    decode_impl: str = "torch"  # "torch" (reference: copy blocks, then SDPA) | "cpu_ext" (in place)
    decodes: list[DecodeGroup] = field(default_factory=list)  # single-token rows, first in the step
    prefills: list[PrefillChunk] = field(default_factory=list)  # multi-token rows, after decodes
    # The prefill chunks as the CPU extension reads them (set when it takes them; the chunks then
    # carry no kv_slots or mask): (C, 3) int64 [first row, rows, tokens cached before] per chunk,
    # and (C, nb) int64 block tables
    prefill_spans: torch.Tensor | None = None
    prefill_tables: torch.Tensor | None = None
    triton: TritonAttention | None = None  # instead of decodes / prefills on the Triton path


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the step's keys and values. k, v: (T, n_kv_heads, head_dim); caches: (slots, n_kv_heads, head_dim)."""
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[1:]:
        raise ValueError(
            f"write_kv_cache: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"write_kv_cache: {k.shape[0]} tokens, {slot_mapping.shape} slots")
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of the step's queries over each request's cached and new keys.

    q: (T, n_heads, head_dim); k, v: (T, n_kv_heads, head_dim), already written to the caches
    (k may be None on the Triton path, which reads every key from the cache).
    Returns (T, n_heads, head_dim).
    """
    H = q.shape[1]
    Hkv = k_cache.shape[1]
    if H % Hkv:
        raise ValueError(f"paged_attention: {H} query heads, {Hkv} kv heads")
    if use_triton(q):
        return _triton_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    bs, D = meta.block_size, q.shape[2]
    k_blocks = k_cache.view(-1, bs, Hkv, D)  # (num_blocks, block_size, Hkv, D)
    v_blocks = v_cache.view(-1, bs, Hkv, D)
    ext = cpu_ext.load() if meta.decode_impl == "cpu_ext" and meta.decodes else None
    for g in meta.decodes:
        s, n = g.start, g.size
        if ext is not None:
            out[s : s + n] = ext.paged_decode_attention(
                q[s : s + n].contiguous(), k_blocks, v_blocks, g.block_ids, g.lens, scale
            )
            continue
        # Whole blocks are copied (a few large copies, not one per token), then masked.
        flat = g.block_ids.reshape(-1)
        keys = k_blocks.index_select(0, flat).view(n, -1, Hkv, D).transpose(1, 2)  # (n, Hkv, L, D)
        values = v_blocks.index_select(0, flat).view(n, -1, Hkv, D).transpose(1, 2)
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # a bfloat16 cache: widened, exact
        if g.mask is not None:
            # the masked rows (stale rows of a freed block, another request's block 0 as padding)
            # zeroed: a NaN or inf there would still reach the output through the mask's sum
            # (NaN + -inf) and the weights' product (0 * inf)
            keep = g.mask.view(n, 1, -1, 1)
            keys.masked_fill_(~keep, 0)  # (copies already: index_select's)
            values.masked_fill_(~keep, 0)
        qd = q[s : s + n].unsqueeze(2)  # (n, H, 1, D)
        o = F.scaled_dot_product_attention(
            qd, keys, values, attn_mask=g.mask, scale=scale, enable_gqa=Hkv != H
        )  # (n, H, 1, D)
        out[s : s + n] = o.squeeze(2)
    if meta.prefill_spans is not None:  # every chunk in place, in one call
        ext = cpu_ext.load()
        assert ext is not None and meta.prefill_tables is not None
        ext.paged_prefill_attention(
            q.contiguous(), k_blocks, v_blocks, meta.prefill_spans, meta.prefill_tables, scale, out
        )
        return out
    if meta.prefills and k is None:
        raise ValueError("paged_attention: the reference needs the step's keys (k)")
    for chunk in meta.prefills:
        assert k is not None
        s, n = chunk.query_start, chunk.query_len
        qc = q[s : s + n].transpose(0, 1)  # (H, n, D)
        if chunk.context_len == 0:
            # the keys and values as the cache holds them (rounded, where it is bfloat16), so a
            # prompt computed whole equals one computed in chunks
            kc = _as_cached(k[s : s + n], k_cache).transpose(0, 1)  # (Hkv, n, D)
            vc = _as_cached(v[s : s + n], v_cache).transpose(0, 1)
            o = _prefill_sdpa(qc, kc, vc, scale, causal=True)
        else:
            assert chunk.kv_slots is not None and chunk.mask is not None
            kc = k_cache[chunk.kv_slots].to(q.dtype).transpose(0, 1)  # (Hkv, ctx + n, D)
            vc = v_cache[chunk.kv_slots].to(q.dtype).transpose(0, 1)
            o = _prefill_sdpa(qc, kc, vc, scale, mask=chunk.mask)  # (H, n, D)
        out[s : s + n] = o.transpose(0, 1)
    return out


def _as_cached(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x as the cache stores it, back in x's dtype: rounded through a bfloat16 cache under float32
    activations (`EngineConfig.kv_cache_dtype`), itself otherwise."""
    return x if cache.dtype == x.dtype else x.to(cache.dtype).to(x.dtype)


def _prefill_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:  # fmt: skip
    """One prompt chunk's attention: q (H, n, D) over k, v (Hkv, L, D) -> (H, n, D). The KV heads
    are repeated to the query heads: torch's fused CPU kernel takes no GQA, and with enable_gqa
    it falls back to the unfused math path, 3-4x slower at prompt lengths (SmolLM2's 9 / 3 heads,
    300-token prompt: 5.8 ms against 2.0; 512 new tokens over 768 cached: 34 against 8)."""
    H, Hkv = q.shape[0], k.shape[0]
    if Hkv != H:
        k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                       is_causal=causal, scale=scale)  # fmt: skip
    return o[0]


def _triton_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:  # fmt: skip
    from kernels.triton_decode_attention import decode_attention
    from kernels.triton_prefill_attention import prefill_attention

    t = meta.triton
    if t is None:
        raise ValueError("paged_attention: the Triton path needs the step's TritonAttention")
    nd = t.num_decodes
    if nd == q.shape[0]:
        return decode_attention(q, k_cache, v_cache, t.decode_block_tables, t.decode_seq_lens,
                                scale, meta.block_size)  # fmt: skip
    out = torch.empty_like(q)
    if nd:
        out[:nd] = decode_attention(q[:nd], k_cache, v_cache, t.decode_block_tables,
                                    t.decode_seq_lens, scale, meta.block_size)  # fmt: skip
    out[nd:] = prefill_attention(q[nd:], k_cache, v_cache, t.prefill_block_tables,
                                 t.query_start_loc, t.context_lens, scale, meta.block_size,
                                 t.max_query_len)  # fmt: skip
    return out
