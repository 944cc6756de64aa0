"""Configuration: the model's architecture (from Hugging Face `config.json`) and the engine's settings."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A model folder that cannot be served: the message names the file and what is wrong."""


@dataclass(slots=True)
class RopeConfig:
    """Rotary embedding: base, and an optional scaling of its frequencies."""

    theta: float = 10000.0
    scaling_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0  # linear and llama3: how much the context was stretched
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.scaling_type not in ("default", "linear", "llama3"):
            raise ModelLoadError(
                f"config.json: rope_scaling type {self.scaling_type!r} is not supported "
                "(supported: linear, llama3)"
            )
        if self.factor <= 0:
            raise ModelLoadError(f"config.json: rope_scaling factor must be > 0, got {self.factor}")

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Inverse frequencies, float32, shape (head_dim // 2,)."""
        exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (self.theta**exps)
        if self.scaling_type == "linear":
            return inv_freq / self.factor
        if self.scaling_type == "llama3":
            old_len = self.original_max_position_embeddings
            low_wavelen = old_len / self.low_freq_factor
            high_wavelen = old_len / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (old_len / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv_freq


@dataclass(slots=True)
class ModelConfig:
    """The architecture of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3)."""

    architecture: str  # e.g. "LlamaForCausalLM"
    family: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2, or Llama with attention_bias
    o_bias: bool  # Llama with attention_bias
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k before RoPE
    torch_dtype: str  # the dtype the weights were saved in
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_window: int | None = None  # Mistral: attention window, when set
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def max_model_len(self) -> int:
        """Longest sequence served. A sliding window bounds it: within it, full attention is exact."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing (is {model_dir} a Hugging Face model folder?)")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: architecture {archs or raw.get('model_type')!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            head_dim = raw.get("head_dim") or hidden // num_heads
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            sliding = raw.get("sliding_window")
            if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
                sliding = None
            cfg = cls(
                architecture=arch,
                family=family,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
                o_bias=family != "qwen2" and bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                qk_norm=family == "qwen3",
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                rope=_rope_from_dict(raw, source),
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: required field {e.args[0]!r} is missing") from e
        except (TypeError, ValueError) as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"{source}: bad value ({e})") from e
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported")
        return cfg

    def param_count(self, include_embedding: bool = True) -> int:
        """Number of weights in the linear layers (and embeddings) touched per token."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        per_layer = attn + 3 * h * i
        total = self.num_layers * per_layer
        if include_embedding:
            total += self.vocab_size * h
        return total


def _rope_from_dict(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers >= 5 folds rope_theta into `rope_parameters`; older configs use `rope_scaling`.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    merged = {**params, **scaling}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in merged:
        raise ModelLoadError(f"{source}: rope_scaling of type {rope_type!r} needs 'factor'")
    return RopeConfig(
        theta=theta,
        scaling_type=rope_type,
        factor=float(merged["factor"]),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


@dataclass(slots=True)
class EngineConfig:
    """How the engine runs a model. Checked here; the CLI and the Python API build it."""

    model: str  # path to a Hugging Face model folder
    dtype: str = "auto"  # "auto" (the checkpoint's dtype), "float32", "bfloat16", "float16"
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_bytes: int | None = None  # bytes for the KV cache; None: kv_cache_fraction of free RAM
    kv_cache_fraction: float = (
        0.25  # of the machine's available memory, when kv_cache_bytes is None
    )
    max_num_seqs: int = 128  # most requests running at once
    max_num_batched_tokens: int = 2048  # token budget of one engine step
    max_waiting: int = 4096  # bound on queued requests; more are refused
    max_model_len: int | None = None  # defaults to the model's context length
    num_threads: int | None = None  # torch threads on the CPU; None: torch's default
    attention: str = (
        "auto"  # decode attention: "auto", "cpu_ext" (in place, C++), "torch" (reference)
    )
    cpu_kernels: str = "auto"  # few-row matmuls, RMSNorm: "auto"/"cpu_ext" (C++), "torch"
    enable_prefix_caching: bool = True  # reuse the KV blocks of cached prompt prefixes
    model_revision: str | None = None  # cache identity; None: a fingerprint of the folder

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if not 0 < self.kv_cache_fraction <= 0.95:
            raise ValueError(
                f"kv_cache_fraction must be in (0, 0.95], got {self.kv_cache_fraction}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.attention not in ("auto", "cpu_ext", "torch"):
            raise ValueError(f"attention must be auto, cpu_ext or torch, got {self.attention!r}")
        if self.cpu_kernels not in ("auto", "cpu_ext", "torch"):
            raise ValueError(
                f"cpu_kernels must be auto, cpu_ext or torch, got {self.cpu_kernels!r}"
            )
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
