"""The Llama-family decoder over a flat batch of tokens and a paged KV cache.

Tokens of every request in a step are concatenated into one (T,) batch with no padding; the
paged-attention metadata says which tokens belong to which request and where their keys live.
Covers Llama (incl. llama3 / linear RoPE scaling), Mistral, Qwen2 (q/k/v bias) and Qwen3
(q/k RMSNorm), with grouped-query attention and tied or untied embeddings.

Weights are fused on load: q/k/v into one projection, gate/up into one, so that a layer runs
four matrix multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from kernels import PagedAttentionMetadata, apply_rotary, paged_attention, rms_norm, write_kv_cache
from kernels.linear import applies, small_linear
from runtime.config import ModelConfig


@dataclass(slots=True)
class StepContext:
    """Per-step inputs shared by every layer, built once by the model runner."""

    positions: torch.Tensor  # (T,) int64: position of each token in its request
    attn: PagedAttentionMetadata  # where keys/values are read and written
    cos: torch.Tensor | None = None  # (T, head_dim), filled by the model from its RoPE table
    sin: torch.Tensor | None = None  # (T, head_dim)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialized: every weight is overwritten by the loader (which checks none is missing).
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self.small_gemm: ModuleType | None = None  # the few-rows kernel, set by use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_linear(x, self.weight, self.bias, self.small_gemm)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps
        self.fused: ModuleType | None = None  # the C++ kernel, set by use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.fused)


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


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, cfg.mlp_bias, dtype)
        self.down_proj = Linear(self.inter, cfg.hidden_size, cfg.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * intermediate)
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype)

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
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_model_len: int):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.small_gemm: ModuleType | None = None  # for logits; see use_cpu_kernels
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
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

    def weight_target(self, hf_name: str) -> tuple[str, int, int | None] | None:
        """Where a checkpoint tensor goes: (our parameter's name, first row, rows) for q/k/v and
        gate/up, which fill row ranges of one fused parameter; (name, 0, None) for a whole
        parameter; None for a tensor we do not use (RoPE buffers; a tied checkpoint's copy of
        the embedding). The name may be one the model lacks: the loader says so, naming the
        file."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (name.startswith("lm_head.") and self.lm_head is None):
            return None
        if name in ("lm_head.weight", "embed_tokens.weight"):
            name = name.removesuffix(".weight")
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED:
            parts[-2], piece = _FUSED[parts[-2]]
            sizes = self._fused_rows(parts[-2])
            return ".".join(parts), sum(sizes[:piece]), sizes[piece]
        return name, 0, None

    def _fused_rows(self, fused: str) -> list[int]:
        cfg = self.cfg
        if fused == "qkv_proj":
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return [q, kv, kv]
        return [cfg.intermediate_size, cfg.intermediate_size]
