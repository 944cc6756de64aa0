"""The Llama-family decoder over a flat batch of tokens and a paged KV cache.

Tokens of every request in a step are concatenated into one (T,) batch with no padding; the
paged-attention metadata says which tokens belong to which request and where their keys live.
Covers Llama (incl. llama3 / linear RoPE scaling), Mistral, Qwen2 (q/k/v bias) and Qwen3
(q/k RMSNorm), with grouped-query attention and tied or untied embeddings; and their
mixture-of-experts forms, Mixtral, Qwen2-MoE and Qwen3-MoE, whose sparse layers take the MoE
block of moe.py in place of the MLP (on this rank's experts, with expert parallelism).

Weights are fused on load: q/k/v into one projection, gate/up into one, so that a layer runs
four matrix multiplies; experts' weights are stacked (moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import ModuleType

import torch
from torch import nn

from kernels import PagedAttentionMetadata, apply_rotary, paged_attention, write_kv_cache
from kernels.linear import applies, small_linear
from runtime.config import ModelConfig
from runtime.model.layers import MLP, Linear, RMSNorm, WeightTarget, _param
from runtime.model.moe import SINGLE, ExpertParallel, MoE


@dataclass(slots=True)
class StepContext:
    """Per-step inputs shared by every layer, built once by the model runner."""

    positions: torch.Tensor  # (T,) int64: position of each token in its request
    attn: PagedAttentionMetadata  # where keys/values are read and written
    cos: torch.Tensor | None = None  # (T, head_dim), filled by the model from its RoPE table
    sin: torch.Tensor | None = None  # (T, head_dim)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_bias, dtype)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5

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
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            q = apply_rotary(q, ctx.cos, ctx.sin)
            k = apply_rotary(k, ctx.cos, ctx.sin)
        else:  # rotate q and k in one pass: they sit side by side in qkv
            qk = qkv[:, : self.q_size + self.kv_size].unflatten(
                1, (self.n_heads + self.n_kv_heads, self.head_dim)
            )  # (T, n_heads + n_kv_heads, head_dim)
            qk = apply_rotary(qk, ctx.cos, ctx.sin)
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
            q = q.contiguous()  # (T, n_heads, head_dim)
        write_kv_cache(k, v, k_cache, v_cache, ctx.attn.slot_mapping)
        o = paged_attention(
            q, k, v, k_cache, v_cache, ctx.attn, self.scale
        )  # (T, n_heads, head_dim)
        return self.o_proj(o.reshape(T, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int, ep: ExpertParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        sparse = cfg.moe is not None and cfg.moe.is_sparse(index)
        self.mlp: MLP | MoE = MoE(cfg, dtype, ep) if sparse else MLP(cfg, dtype)

    def forward(
        self, x: torch.Tensor, ctx: StepContext, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), ctx, k_cache, v_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


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
    ):
        """`ep`: this rank's share of the experts (every rank runs the model on the same tokens
        and holds all of it but the other ranks' experts); a ValueError if it cannot be had."""
        super().__init__()
        ep.check(cfg)
        self.cfg, self.dtype, self.ep = cfg, dtype, ep
        self.small_gemm: ModuleType | None = None  # for logits; see use_cpu_kernels
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, i, ep) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        )
        self.max_model_len = max_model_len
        # RoPE tables, built on first use: a loader builds the model before it starts reading
        # the weights, and this need not keep the drive waiting.
        self._rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def _rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, float32 (max_model_len, head_dim), rows indexed by position."""
        if self._rope_tables is None:
            inv_freq = self.cfg.rope.inv_freq(self.cfg.head_dim)  # (head_dim // 2,)
            positions = torch.arange(self.max_model_len, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)  # (max_model_len, head_dim // 2)
            emb = torch.cat((freqs, freqs), dim=-1)  # (max_model_len, head_dim)
            self._rope_tables = emb.cos(), emb.sin()
        return self._rope_tables

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: StepContext,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids: (T,) -> final hidden states (T, hidden), after the last norm."""
        cos, sin = self._rope()
        ctx.cos = cos[ctx.positions].to(self.dtype)  # (T, head_dim)
        ctx.sin = sin[ctx.positions].to(self.dtype)  # (T, head_dim)
        x = nn.functional.embedding(input_ids, self.embed_tokens)  # (T, hidden)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, ctx, k_cache, v_cache)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden) -> float32 logits (N, vocab)."""
        return small_linear(hidden, self.output_weight, None, self.small_gemm).float()

    def use_cpu_kernels(self, gemm: ModuleType | None, norm: ModuleType | None) -> None:
        """Route few-row matmuls (decode) and RMSNorm through the C++ kernels, or the references
        (None)."""
        probe = torch.empty(1, 1, dtype=self.dtype)
        self.small_gemm = gemm if gemm is not None and applies(probe, self.output_weight) else None
        for module in self.modules():
            if isinstance(module, Linear):
                usable = gemm is not None and applies(probe, module.weight)
                module.small_gemm = gemm if usable else None
            elif isinstance(module, RMSNorm):
                module.fused = norm if module.weight.dtype == torch.float32 else None

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
        parts = name.split(".")
        if parts[2:3] == ["block_sparse_moe"]:  # Mixtral's name for its MoE block
            parts[2] = "mlp"
        moe = self._moe(parts)
        if moe is not None and parts[3:4] == ["experts"]:
            target = moe.experts.weight_target(parts[4:])
            prefix = ".".join(parts[:4])
            return None if target is None else replace(target, param=f"{prefix}.{target.param}")
        if len(parts) >= 2 and parts[-2] in _FUSED:
            parts[-2], piece = _FUSED[parts[-2]]
            sizes = self._fused_rows(".".join(parts[:-2]), parts[-2])
            if sizes is not None:
                return WeightTarget(".".join(parts), sum(sizes[:piece]), sizes[piece])
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
        if len(parts) < 4 or parts[0] != "layers" or parts[2] != "mlp" or not parts[1].isdigit():
            return None
        i = int(parts[1])
        mlp = self.layers[i].mlp if i < len(self.layers) else None
        return mlp if isinstance(mlp, MoE) else None

    def _fused_rows(self, module: str, fused: str) -> list[int] | None:
        """The pieces' rows of a fused projection of `module`; None if there is no such one."""
        try:
            owner = self.get_submodule(module)
        except AttributeError:
            return None
        cfg = self.cfg
        if fused == "qkv_proj" and isinstance(owner, Attention):
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return [q, kv, kv]
        if fused == "gate_up_proj" and isinstance(owner, MLP):
            return [owner.inter, owner.inter]
        return None
