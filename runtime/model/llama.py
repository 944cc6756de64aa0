"""The Llama-family decoder over a flat batch of tokens and a paged KV cache.

Tokens of every request in a step are concatenated into one (T,) batch with no padding; the
paged-attention metadata says which tokens belong to which request and where their keys live.
Covers Llama (incl. llama3 / linear RoPE scaling), Mistral, Qwen2 (q/k/v bias) and Qwen3
(q/k RMSNorm), with grouped-query attention and tied or untied embeddings.

Weights are fused on load: q/k/v into one projection, gate/up into one, so that a layer runs
four matrix multiplies.
"""

from __future__ import annotations

from collections.abc import Iterable
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


# Hugging Face names of the projections we fuse: (our fused param, HF name, shard index).
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
        # RoPE table in float32, (max_model_len, head_dim), rows indexed by position.
        inv_freq = cfg.rope.inv_freq(cfg.head_dim)  # (head_dim // 2,)
        freqs = torch.outer(torch.arange(max_model_len, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_model_len, head_dim)
        self.rope_cos: torch.Tensor = emb.cos()
        self.rope_sin: torch.Tensor = emb.sin()

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
        ctx.cos = self.rope_cos[ctx.positions].to(self.dtype)  # (T, head_dim)
        ctx.sin = self.rope_sin[ctx.positions].to(self.dtype)  # (T, head_dim)
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

    def load_weights(self, weights: Iterable[tuple[str, str, torch.Tensor]]) -> None:
        """Copy (file, Hugging Face name, tensor) triples in; fuse q/k/v and gate/up.

        Raises ModelLoadError naming the file and tensor on a shape mismatch, an unexpected
        non-float tensor, or (at the end) any weight that never arrived.
        """
        from runtime.config import ModelLoadError

        params = dict(self.named_parameters())
        pending = {name: _shard_count(name) for name in params}
        for file, hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name.startswith("lm_head.") and self.lm_head is None:
                continue  # tied checkpoints sometimes store a copy of the embedding
            if name == "lm_head.weight":
                name = "lm_head"
            if name == "embed_tokens.weight":
                name = "embed_tokens"
            if "rotary_emb" in name:
                continue
            shard = None
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in _FUSED:
                fused, shard = _FUSED[parts[-2]]
                parts[-2] = fused
                name = ".".join(parts)
            if name not in params:
                raise ModelLoadError(
                    f"{file}: unexpected tensor {hf_name!r} for {self.cfg.architecture}"
                )
            if not tensor.is_floating_point():
                raise ModelLoadError(
                    f"{file}: tensor {hf_name!r} has dtype {tensor.dtype}; only float tensors "
                    "are supported (import quantized GGUF files with `edgeinfer import-gguf`)"
                )
            dest = params[name].data
            if shard is not None:
                dest = _shard_view(dest, shard, name, self.cfg)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"{file}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"config.json implies {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            pending[name] -= 1
        missing = [n for n, left in pending.items() if left > 0]
        if missing:
            raise ModelLoadError(
                f"weights missing from the checkpoint: {', '.join(sorted(missing)[:8])}"
            )


def _shard_count(param_name: str) -> int:
    if ".qkv_proj." in param_name:
        return 3
    if ".gate_up_proj." in param_name:
        return 2
    return 1


def _shard_view(dest: torch.Tensor, shard: int, name: str, cfg: ModelConfig) -> torch.Tensor:
    if ".qkv_proj." in name:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = [q, kv, kv]
    else:
        sizes = [cfg.intermediate_size, cfg.intermediate_size]
    start = sum(sizes[:shard])
    return dest.narrow(0, start, sizes[shard])
