"""The Llama-family decoder over a flat batch of tokens and a paged KV cache.

Tokens of every request in a step are concatenated into one (T,) batch with no padding; the
paged-attention metadata says which tokens belong to which request and where their keys live.
Covers Llama (incl. llama3 / linear RoPE scaling), Mistral, Qwen2 (q/k/v bias) and Qwen3
(q/k RMSNorm), with grouped-query attention and tied or untied embeddings; and their
mixture-of-experts forms, Mixtral, Qwen2-MoE and Qwen3-MoE, whose sparse layers take the MoE
block of moe.py in place of the MLP (on this rank's experts, with expert parallelism).

Weights are fused on load: q/k/v into one projection, gate/up into one, so that a layer runs
four matrix multiplies; experts' weights are stacked (moe.py).

Split over ranks (runtime.parallel.RankPlace): a rank builds only its pipeline stage's layers
(the others are `MissingLayer`s, so that checkpoint names keep their indices), the embedding and
LM head only on stage 0 and the final norm only on the last; with tensor parallelism, its slice
of the heads, the MLP rows and the vocabulary, and `weight_target` says which rows or columns of
each checkpoint tensor it reads. `forward` runs this rank's part; runtime.ranks moves the hidden
states between stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType

import torch
import torch.distributed as dist
from torch import nn

from kernels import PagedAttentionMetadata, paged_attention, rotate_and_cache
from kernels.dispatch import CPU_KERNEL_DTYPES
from kernels.linear import Packed, applies, pack, small_linear
from runtime.config import ModelConfig
from runtime.model.layers import (
    MLP,
    NO_TP,
    Linear,
    RMSNorm,
    TensorParallel,
    WeightTarget,
    _param,
)
from runtime.model.moe import SINGLE, ExpertParallel, Experts, MoE
from runtime.parallel import SINGLE_RANK, ParallelConfig, RankPlace


@dataclass(slots=True)
class StepContext:
    """Per-step inputs shared by every layer, built once by the model runner."""

    positions: torch.Tensor  # (T,) int64: position of each token in its request
    attn: PagedAttentionMetadata  # where keys/values are read and written
    cos: torch.Tensor | None = None  # (T, head_dim), filled by the model from its RoPE table
    sin: torch.Tensor | None = None  # (T, head_dim)


class Attention(nn.Module):
    """Self-attention over this rank's query heads and the KV heads they read: all of them, or
    with tensor parallelism heads [rank * n / tp, (rank + 1) * n / tp) and their KV heads (one
    KV head, replicated, where there are fewer KV heads than ranks); o_proj row-parallel."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel = NO_TP):
        super().__init__()
        self.head_dim = cfg.head_dim
        first_head, self.n_heads = tp.split(cfg.num_heads)
        if cfg.num_kv_heads >= tp.size:
            first_kv, self.n_kv_heads = tp.split(cfg.num_kv_heads)
        else:  # each KV head on tp / num_kv_heads ranks
            first_kv, self.n_kv_heads = tp.rank * cfg.num_kv_heads // tp.size, 1
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv_heads * self.head_dim
        # rows of the checkpoint's q, k and v read into this rank's, and their full sizes
        self.q_first, self.kv_first = first_head * self.head_dim, first_kv * self.head_dim
        self.full_q, self.full_kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_bias, dtype, reduce=tp)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.fused: ModuleType | None = None  # the C++ RoPE + KV write, set by use_cpu_kernels

    def forward(
        self, x: torch.Tensor, ctx: StepContext, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, q_size + 2 * kv_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.n_heads, self.head_dim)  # (T, n_heads, head_dim)
        k = k.view(T, self.n_kv_heads, self.head_dim)  # (T, n_kv_heads, head_dim)
        v = v.view(T, self.n_kv_heads, self.head_dim)  # (T, n_kv_heads, head_dim)
        assert ctx.cos is not None and ctx.sin is not None
        qk = None
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        else:  # q and k side by side in qkv: the reference rotates them in one pass
            qk = qkv[:, : self.q_size + self.kv_size].unflatten(
                1, (self.n_heads + self.n_kv_heads, self.head_dim)
            )  # (T, n_heads + n_kv_heads, head_dim)
        slots = ctx.attn.slot_mapping
        q, k_rot = rotate_and_cache(q, k, v, ctx.cos, ctx.sin, k_cache, v_cache, slots, qk,
                                    self.fused)  # fmt: skip
        o = paged_attention(q, k_rot, v, k_cache, v_cache, ctx.attn, self.scale)  # (T, heads, dim)
        return self.o_proj(o.reshape(T, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int, ep: ExpertParallel,
                 tp: TensorParallel = NO_TP):  # fmt: skip
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        sparse = cfg.moe is not None and cfg.moe.is_sparse(index)
        self.mlp: MLP | MoE = MoE(cfg, dtype, ep) if sparse else MLP(cfg, dtype, tp=tp)

    def forward(
        self, x: torch.Tensor, ctx: StepContext, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), ctx, k_cache, v_cache)
        normed, h = self.post_attention_layernorm.add_forward(a, x)  # h = x + a
        return h + self.mlp(normed)


class MissingLayer(nn.Module):
    """A layer another pipeline stage holds: no weights, never run."""

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("this layer lives on another pipeline stage")


# Hugging Face names of the projections we fuse: (our fused param, the piece's index in it).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        max_model_len: int,
        ep: ExpertParallel = SINGLE,
        place: RankPlace | None = None,
        weight_dtype: torch.dtype | None = None,
    ):
        """`place`: this rank's part of the model (runtime.parallel; its stages filled in here);
        without one, the whole model, or with `ep` this rank's share of the experts (every rank
        runs the model on the same tokens). A ValueError if the model cannot be split so.
        `weight_dtype`: how the linear layers' weights, the embedding and the LM head are stored
        when not in `dtype` (bfloat16 under float32: half the bytes a decode step reads; the
        products and sums stay float32, see kernels.linear); norms, biases and a mixture of
        experts' stacked experts stay in `dtype`."""
        super().__init__()
        if place is None:
            place = SINGLE_RANK if ep.size == 1 else _ep_only(ep)
        place = place.with_model(cfg)
        ep = place.ep
        tp = TensorParallel(place.tp_rank, place.tp, place.group)
        self.cfg, self.dtype, self.ep, self.place, self.tp = cfg, dtype, ep, place, tp
        self.small_gemm: ModuleType | None = None  # for logits; see use_cpu_kernels
        self.output_packed: Packed | None = None  # the LM head's exact blocks: pack_weights
        self.local_layers = place.layers(cfg.num_layers)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, dtype, i, ep, tp) if i in self.local_layers else MissingLayer()
            for i in range(cfg.num_layers)
        )
        # this rank's rows of the vocabulary: [vocab_first, vocab_first + vocab_rows); every rank
        # but the last holds vocab_per_rank of them
        self.vocab_per_rank = -(-cfg.vocab_size // tp.size)
        self.vocab_first = tp.rank * self.vocab_per_rank
        self.vocab_rows = min(cfg.vocab_size - self.vocab_first, self.vocab_per_rank)
        if self.vocab_rows < 1:
            raise ValueError(f"tp={tp.size} is more than the vocabulary of {cfg.vocab_size} tokens")
        rows, hidden = self.vocab_rows, cfg.hidden_size
        self.embed_tokens = _param(rows, hidden, dtype=dtype) if place.first else None
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps, dtype) if place.last else None
        self.lm_head = (
            None
            if cfg.tie_word_embeddings or not place.first
            else _param(rows, hidden, dtype=dtype)
        )
        self.weight_dtype = weight_dtype or dtype
        if self.weight_dtype != dtype:
            self._store_weights_as(self.weight_dtype)
        self.max_model_len = max_model_len
        # RoPE tables, built on first use: a loader builds the model before it starts reading
        # the weights, and this need not keep the drive waiting. Only for the positions that
        # can occur (rope_rows): max_position_embeddings may be in the millions, and a table
        # for all of them took seconds and gigabytes at the first request.
        self._rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self.rope_positions = max_model_len  # positions that can occur: 0 .. this - 1
        self.layers_run = 0  # decoder layers run, ever: the engine's progress (AsyncLLM)

    def _store_weights_as(self, dtype: torch.dtype) -> None:
        """The (still empty) linear weights, embedding and LM head, remade in `dtype`."""
        if (self.dtype, dtype) != (torch.float32, torch.bfloat16):
            raise ValueError(
                f"weights stored as {dtype} under {self.dtype} activations: only bfloat16 weights "
                "under float32 are built"
            )
        for module in self.modules():
            if isinstance(module, Linear):
                module.weight = _param(*module.weight.shape, dtype=dtype)
        if self.embed_tokens is not None:
            self.embed_tokens = _param(*self.embed_tokens.shape, dtype=dtype)
        if self.lm_head is not None:
            self.lm_head = _param(*self.lm_head.shape, dtype=dtype)

    def rope_rows(self, positions: int) -> None:
        """Only positions 0 .. `positions` - 1 occur (at most max_model_len): their RoPE tables,
        built now. The engine, at its start, for its max_model_len and what its KV cache can
        hold (a sequence's positions are below its token count): not at the first request."""
        self.rope_positions = min(self.max_model_len, positions)
        self._rope(self.rope_positions)

    def _rope(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, float32 (at least `rows`, head_dim) on the model's device, row p for
        position p; built (again) when they have fewer rows. Row p does not depend on how many
        rows there are."""
        if self._rope_tables is None or self._rope_tables[0].shape[0] < rows:
            inv_freq = self.cfg.rope.inv_freq(self.cfg.head_dim)  # (head_dim // 2,)
            positions = torch.arange(rows, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)  # (rows, head_dim // 2)
            emb = torch.cat((freqs, freqs), dim=-1)  # (rows, head_dim)
            self._rope_tables = emb.cos().to(self.device), emb.sin().to(self.device)
        return self._rope_tables

    @property
    def device(self) -> torch.device:
        """Where the weights are (and the KV cache and each step's inputs go)."""
        return next(self.parameters()).device

    @property
    def kv_head_range(self) -> range:
        """The KV heads this rank caches (all of them without tensor parallelism)."""
        layer = self.layers[self.local_layers.start]
        assert isinstance(layer, DecoderLayer)
        first = layer.self_attn.kv_first // self.cfg.head_dim
        return range(first, first + layer.self_attn.n_kv_heads)

    @property
    def output_weight(self) -> torch.Tensor:
        """This rank's rows of the LM head (stage 0 only)."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        assert weight is not None, "the LM head lives on pipeline stage 0"
        return weight

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: StepContext,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's layers, with `kv_caches` theirs. Stage 0 starts from input_ids (T,), a
        later stage from the previous stage's `hidden` (T, hidden); returns (T, hidden), after
        the final norm on the last stage."""
        # the positions that can occur: below rope_positions, and below the KV cache's slots
        slots = kv_caches[0][0].shape[0] if kv_caches else self.rope_positions
        cos, sin = self._rope(min(self.rope_positions, slots))
        ctx.cos = cos[ctx.positions].to(self.dtype)  # (T, head_dim)
        ctx.sin = sin[ctx.positions].to(self.dtype)  # (T, head_dim)
        x = self.embed(input_ids) if hidden is None else hidden  # (T, hidden)
        layers = [self.layers[i] for i in self.local_layers]
        for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
            x = layer(x, ctx, k_cache, v_cache)
            self.layers_run += 1  # progress, for AsyncLLM.stalled_s (a hung step moves none)
        return x if self.norm is None else self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) token ids -> (T, hidden); with tensor parallelism each rank looks up the ids in
        its rows of the vocabulary, zeros for the others, and an all-reduce sums them."""
        assert self.embed_tokens is not None, "the embedding lives on pipeline stage 0"
        if self.tp.size == 1:
            return nn.functional.embedding(input_ids, self.embed_tokens).to(self.dtype)
        local = input_ids - self.vocab_first
        outside = (local < 0) | (local >= self.vocab_rows)
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        x = x.to(self.dtype).masked_fill_(outside[:, None], 0)
        dist.all_reduce(x, group=self.tp.group)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden) -> float32 logits (N, vocab). With tensor parallelism every rank
        of stage 0 computes its vocabulary rows' and gathers them on rank 0; the other ranks get
        back only their own (N, vocab rows)."""
        local = small_linear(hidden, self.output_weight, None, self.small_gemm,
                             self.output_packed).float()  # fmt: skip
        if self.tp.size == 1:
            return local
        part = local.new_zeros(local.shape[0], self.vocab_per_rank)  # equal sizes to gather
        part[:, : self.vocab_rows] = local
        parts = (
            [torch.empty_like(part) for _ in range(self.tp.size)] if self.place.rank == 0 else None
        )
        dist.gather(part, parts, dst=0, group=self.tp.group)
        if parts is None:
            return local
        return torch.cat(parts, dim=1)[:, : self.cfg.vocab_size]

    def use_cpu_kernels(
        self, gemm: ModuleType | None, norm: ModuleType | None, fused: ModuleType | None = None
    ) -> None:
        """Route few-row matmuls (decode), RMSNorm, RoPE with the KV write and SiLU-and-mul
        through the C++ kernels, or the references (None). The caller gives norm and fused only
        for a float32 or bfloat16 model on the CPU. Drops the blocks of `pack_weights`."""
        probe = torch.empty(1, 1, dtype=self.dtype)
        head = self.output_weight if self.place.first else None
        self.small_gemm = (
            gemm if gemm is not None and head is not None and applies(probe, head) else None
        )
        self.output_packed = None
        for module in self.modules():
            if isinstance(module, Linear):
                usable = gemm is not None and applies(probe, module.weight)
                module.small_gemm = gemm if usable else None
                module.packed = None
            elif isinstance(module, Experts):  # each expert's weights: a contiguous slice
                usable = gemm is not None and applies(probe, module.down_proj[0])
                module.small_gemm = gemm if usable else None
            elif isinstance(module, RMSNorm):
                module.fused = norm if module.weight.dtype in CPU_KERNEL_DTYPES else None
            elif isinstance(module, (Attention, MLP)):
                module.fused = fused

    def pack_weights(self, threads: int = 0, stop: Callable[[], bool] | None = None) -> None:
        """Beside each float32 weight whose blocks are exactly GGUF block values (Q4_1, Q4_0, Q4_K,
        Q8_0, Q6_K), keep those blocks, which the few-row matmul kernel then reads
        (kernels.linear.pack; a weight that is not so, or whose matmul does not go through the
        kernel, stays as it is). Call once the weights are all loaded, after use_cpu_kernels. Each
        weight's blocks are used from the moment they are set (a forward pass reads `packed` once a
        call), so this may run in a thread while the model serves. `threads`: OpenMP threads for the
        search (0: all); `stop`: asked before each weight, the search ends when it says so."""
        if self.place.first:
            self.output_packed = pack(self.output_weight, self.small_gemm, threads)
        for module in self.modules():
            if stop is not None and stop():
                return
            if isinstance(module, Linear):
                module.packed = pack(module.weight, module.small_gemm, threads)

    def packable_bytes(self) -> int:
        """The most bytes pack_weights can add: Q6_K's 10/32 of each float32 weight it could
        pack (Q8_0's are 9/32, Q4_1's 6/32)."""
        weights: list[torch.Tensor] = [m.weight for m in self.modules() if isinstance(m, Linear)]
        if self.place.first:
            weights.append(self.output_weight)
        fits = [w for w in weights if w.dtype == torch.float32 and w.shape[-1] % 32 == 0]
        return sum(w.nbytes for w in fits) * 10 // 32

    def packed_weights(self) -> tuple[int, int, int]:
        """(weights packed, weights that are not, bytes of the blocks)."""
        found, packs = self._packs()
        return len(found), len(packs) - len(found), sum(p.nbytes for p in found)

    def packed_formats(self) -> dict[str, int]:
        """Weights packed, by layout (kernels.linear.Packed.format: Q4_1, Q5, Q6_K, Q8_0)."""
        counts: dict[str, int] = {}
        for p in self._packs()[0]:
            counts[p.format] = counts.get(p.format, 0) + 1
        return dict(sorted(counts.items()))

    def _packs(self) -> tuple[list[Packed], list[Packed | None]]:
        packs = [m.packed for m in self.modules() if isinstance(m, Linear)]
        if self.place.first:
            packs.append(self.output_packed)
        return [p for p in packs if p is not None], packs

    def weight_target(self, hf_name: str) -> WeightTarget | None:
        """Where a checkpoint tensor goes: q/k/v and gate/up fill row ranges of one fused
        parameter, an expert's tensors its rows of the layer's stacked experts (moe.py); other
        tensors a whole parameter. None for a tensor we do not use (RoPE buffers; a tied
        checkpoint's copy of the embedding; another rank's experts). The name may be one the
        model lacks: the loader says so, naming the file."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (name.startswith("lm_head.") and self.lm_head is None):
            return None
        if name in ("lm_head.weight", "embed_tokens.weight"):
            name = name.removesuffix(".weight")
            if not self.place.first:
                return None  # stage 0's
            cfg = self.cfg
            return WeightTarget(name, rows=self.vocab_rows, src_row=self.vocab_first,
                                shape=(cfg.vocab_size, cfg.hidden_size))  # fmt: skip
        if name.startswith("norm."):
            return WeightTarget(name) if self.place.last else None
        parts = name.split(".")
        layer = (
            int(parts[1])
            if parts[0] == "layers" and parts[1:2] and is_layer_index(parts[1])
            else -1
        )
        if layer >= 0 and layer not in self.local_layers and layer < self.cfg.num_layers:
            return None  # another stage's
        if parts[2:3] == ["block_sparse_moe"]:  # Mixtral's name for its MoE block
            parts[2] = "mlp"
        moe = self._moe(parts)
        if moe is not None and parts[3:4] == ["experts"]:
            target = moe.experts.weight_target(parts[4:])
            prefix = ".".join(parts[:4])
            return None if target is None else replace(target, param=f"{prefix}.{target.param}")
        if len(parts) >= 2 and parts[-2] in _FUSED:
            proj = parts[-2]
            parts[-2], piece = _FUSED[proj]
            sizes = self._fused_rows(".".join(parts[:-2]), parts[-2])
            if sizes is not None:
                src_row, full = self._source_rows(".".join(parts[:-2]), proj)
                shape = (full,) if parts[-1] == "bias" else (full, self.cfg.hidden_size)
                return WeightTarget(".".join(parts), sum(sizes[:piece]), sizes[piece],
                                    src_row=src_row, shape=shape)  # fmt: skip
        if self.tp.size > 1 and len(parts) >= 2 and parts[-2:] in (["o_proj", "weight"],
                                                                   ["down_proj", "weight"]):  # fmt: skip
            cols = self._row_parallel_cols(".".join(parts[:-2]))
            if cols is not None:
                first, count, full = cols
                return WeightTarget(".".join(parts), src_col=first, cols=count,
                                    shape=(self.cfg.hidden_size, full))  # fmt: skip
        return WeightTarget(".".join(parts))

    def checkpoint_name(self, param: str, row: int) -> str | None:
        """The checkpoint tensor that fills row `row` of an expert stack (for the loader's
        message when one is missing); None for other parameters."""
        parts = param.split(".")
        moe = self._moe(parts)
        if moe is None or parts[3:4] != ["experts"]:
            return None
        block = "block_sparse_moe" if self.cfg.family == "mixtral" else "mlp"
        return f"model.layers.{parts[1]}.{block}.{moe.experts.checkpoint_name(parts[4], row)}"

    def _moe(self, parts: list[str]) -> MoE | None:
        """The MoE block that `layers.<i>.mlp.*` names, if layer i is sparse."""
        if (
            len(parts) < 4
            or parts[0] != "layers"
            or parts[2] != "mlp"
            or not is_layer_index(parts[1])
        ):
            return None
        i = int(parts[1])
        mlp = self.layers[i].mlp if i < len(self.layers) else None
        return mlp if isinstance(mlp, MoE) else None

    def _source_rows(self, module: str, proj: str) -> tuple[int, int]:
        """(first row read, the checkpoint tensor's rows) of this rank's slice of q/k/v or gate/up
        of `module` (a fused one, `_fused_rows` found)."""
        owner = self.get_submodule(module)
        if isinstance(owner, Attention):
            if proj == "q_proj":
                return owner.q_first, owner.full_q
            return owner.kv_first, owner.full_kv
        assert isinstance(owner, MLP)
        return owner.first, owner.full_inter

    def _row_parallel_cols(self, module: str) -> tuple[int, int, int] | None:
        """(first column, columns, the checkpoint's columns) of a row-parallel o_proj or
        down_proj of `module`; None if there is no such one (the loader says so)."""
        try:
            owner = self.get_submodule(module)
        except AttributeError:
            return None
        if isinstance(owner, Attention):
            return owner.q_first, owner.q_size, owner.full_q
        if isinstance(owner, MLP):
            return owner.first, owner.inter, owner.full_inter
        return None

    def _fused_rows(self, module: str, fused: str) -> list[int] | None:
        """The pieces' rows of a fused projection of `module`; None if there is no such one."""
        try:
            owner = self.get_submodule(module)
        except AttributeError:
            return None
        if fused == "qkv_proj" and isinstance(owner, Attention):
            return [owner.q_size, owner.kv_size, owner.kv_size]
        if fused == "gate_up_proj" and isinstance(owner, MLP):
            return [owner.inter, owner.inter]
        return None


def _ep_only(ep: ExpertParallel) -> RankPlace:
    """The place of an expert-parallel rank of one stage with no tensor parallelism."""
    return RankPlace(ParallelConfig(ep=ep.size), ep.rank, group=ep.group)


def is_layer_index(part: str) -> bool:
    """Whether a checkpoint name's part is a layer's index: ASCII digits ('²'.isdigit() is True,
    and int() refuses it)."""
    return part.isascii() and part.isdigit()
