"""Configuration: the model's architecture (from Hugging Face `config.json`) and the engine's settings."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from runtime.speculative import SpeculativeConfig

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
# The longest context a config may claim (Llama 4 Scout's 10M fits): the model keeps a RoPE
# table row per position, so 10**12 (a config that cannot be meant) failed at the first request
MAX_POSITIONS = 1 << 24

# config.json fields that only a mixture-of-experts model has: an architecture we do not support
# that has one is named as an MoE variant, and a supported one that has one of the routing knobs
# below is a variant whose routing we would get wrong.
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
_UNSUPPORTED_ROUTING = {  # field: (what it means, the values that mean plain top-k routing)
    "n_group": ("grouped top-k routing", (None, 1)),
    "topk_group": ("grouped top-k routing", (None, 1)),
    "topk_method": ("a top-k method other than plain top-k", (None, "greedy")),
    "scoring_func": ("a router scoring function other than softmax", (None, "softmax")),
    "routed_scaling_factor": ("scaled routing weights", (None, 1, 1.0)),
    "n_shared_experts": ("DeepSeek-style shared experts", (None, 0)),
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
    source: str = field(default="config.json", kw_only=True, compare=False, repr=False)  # errors

    def __post_init__(self) -> None:
        if self.scaling_type not in ("default", "linear", "llama3"):
            raise ModelLoadError(
                f"{self.source}: rope_scaling type {self.scaling_type!r} is not supported "
                "(supported: linear, llama3)"
            )
        # (NaN compares false: a NaN factor or theta made every rotary angle NaN, silently)
        if not math.isfinite(self.theta) or self.theta <= 0:
            raise ModelLoadError(f"{self.source}: rope_theta must be > 0, got {self.theta}")
        if not math.isfinite(self.factor) or self.factor <= 0:
            raise ModelLoadError(
                f"{self.source}: rope_scaling factor must be > 0, got {self.factor}"
            )
        if self.scaling_type == "llama3":  # (a zero divides by zero at the first forward)
            for key in ("low_freq_factor", "high_freq_factor"):
                value = getattr(self, key)
                if not math.isfinite(value) or value <= 0:
                    raise ModelLoadError(
                        f"{self.source}: rope_scaling {key} must be > 0, got {value}"
                    )

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
class MoeConfig:
    """Mixture of experts: in the sparse layers, each token goes to `top_k` of `num_experts`
    gated SiLU MLPs, chosen by a linear router, and their outputs are summed with its weights."""

    num_experts: int  # routed experts per sparse layer
    top_k: int  # experts each token goes to
    intermediate_size: int  # of each routed expert
    norm_topk_prob: bool  # the top-k probabilities renormalised to sum to 1 (Mixtral: always)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense MLP every token also goes
    # through, scaled by sigmoid(shared_expert_gate(x)); 0: none
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (a dense MLP then)
    source: str = field(default="config.json", kw_only=True, compare=False, repr=False)  # errors

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ModelLoadError(
                f"{self.source}: the number of experts must be >= 1, got {self.num_experts}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ModelLoadError(
                f"{self.source}: num_experts_per_tok must be in [1, {self.num_experts}] (the number "
                f"of experts), got {self.top_k}"
            )
        if self.intermediate_size < 1:
            raise ModelLoadError(
                f"{self.source}: the experts' intermediate size must be >= 1, got "
                f"{self.intermediate_size}"
            )
        if self.shared_expert_intermediate_size < 0:
            raise ModelLoadError(
                f"{self.source}: shared_expert_intermediate_size must be >= 0, got "
                f"{self.shared_expert_intermediate_size}"
            )
        if self.decoder_sparse_step < 1:
            raise ModelLoadError(
                f"{self.source}: decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) has experts rather than a dense MLP."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(slots=True)
class ModelConfig:
    """The architecture of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3; with experts:
    Mixtral, Qwen2-MoE, Qwen3-MoE)."""

    architecture: str  # e.g. "LlamaForCausalLM"
    family: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "mixtral" | "qwen2_moe" | "qwen3_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the dense MLPs (Mixtral: of its experts)
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
    moe: MoeConfig | None = None  # the experts, for the MoE families; None: dense
    source: str = field(default="config.json", kw_only=True, compare=False, repr=False)  # errors

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"{self.source}: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if (self.moe is not None) != (self.family in MOE_FAMILIES):
            raise ModelLoadError(
                f"{self.source}: {self.architecture} "
                + ("needs its experts described" if self.moe is None else "has no experts")
            )

    @property
    def max_model_len(self) -> int:
        """Longest sequence served. A sliding window bounds it: within it, full attention is exact."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def max_model_len_refusal(
        self, model_dir: str | Path, asked: int | None, option: str
    ) -> str | None:
        """Why a max_model_len of `asked` (None or 0: the model's own) cannot be served, as
        `option` (the setting's name: the API's max_model_len, the CLI's --max-model-len) and
        the model's limit and what in `model_dir`'s config.json sets it; None when it can."""
        limit = self.max_model_len
        if not asked or asked <= limit:
            return None
        why = "its sliding_window" if self.sliding_window == limit else "max_position_embeddings"
        return (
            f"{option} {asked} is greater than the model's context length, {limit} ({why} in "
            f"{Path(model_dir) / 'config.json'}); give at most {limit}, or leave {option} out "
            f"for {limit}"
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing (is {model_dir} a Hugging Face model folder?)")
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: not a JSON object")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ModelLoadError(
                f'{source}: architectures must be a list of names (e.g. ["LlamaForCausalLM"]), '
                f"got {archs!r}"
            )
        for flag in ("tie_word_embeddings", "attention_bias", "mlp_bias", "qkv_bias",
                     "use_sliding_window"):  # fmt: skip
            # (bool("false") is True: a string here served an untied model tied, silently)
            if raw.get(flag) is not None and not isinstance(raw[flag], bool):
                raise ModelLoadError(f"{source}: {flag} must be true or false, got {raw[flag]!r}")
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and any(raw.get(k) for k in _MOE_FIELDS):
            routing = sorted(
                {why for k, (why, plain) in _UNSUPPORTED_ROUTING.items() if raw.get(k) not in plain}
            )
            raise ModelLoadError(
                f"{source}: architecture {archs or raw.get('model_type')!r} is a "
                "mixture-of-experts model that is not supported"
                + (f" ({', '.join(routing)})" if routing else "")
                + f"; supported mixture-of-experts architectures: {', '.join(_moe_archs())}"
            )
        if arch is None:
            raise ModelLoadError(
                f"{source}: architecture {archs or raw.get('model_type')!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        family = SUPPORTED_ARCHITECTURES[arch]

        def integer(key: str, default: int | None = None) -> int:
            return _integer(source, key, raw[key] if default is None else raw.get(key, default))

        try:
            num_heads = integer("num_attention_heads")
            hidden = integer("hidden_size")
            _positive(source, "num_attention_heads", num_heads)
            # (null or 0: hidden_size / num_attention_heads, as transformers reads it)
            head_dim = (
                raw.get("head_dim") is not None and integer("head_dim")
            ) or hidden // num_heads
            kv_heads = raw.get("num_key_value_heads") is not None and integer("num_key_value_heads")
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            sliding = raw.get("sliding_window")
            qwen = family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
            if qwen and not raw.get("use_sliding_window", False):
                sliding = None
            # Qwen2 has q/k/v biases always, Qwen2-MoE unless its config says otherwise.
            qkv_bias = family == "qwen2" or bool(
                raw.get("qkv_bias", True) if family == "qwen2_moe" else raw.get("attention_bias")
            )
            cfg = cls(
                architecture=arch,
                family=family,
                vocab_size=integer("vocab_size"),
                hidden_size=hidden,
                intermediate_size=integer("intermediate_size"),
                num_layers=integer("num_hidden_layers"),
                num_heads=num_heads,
                num_kv_heads=kv_heads or num_heads,
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=integer("max_position_embeddings", 2048),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=qkv_bias,
                o_bias=family not in ("qwen2", "qwen2_moe")
                and bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                qk_norm=family in ("qwen3", "qwen3_moe"),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                rope=_rope_from_dict(raw, source),
                sliding_window=_integer(source, "sliding_window", sliding) if sliding else None,
                bos_token_id=(None if raw.get("bos_token_id") is None else integer("bos_token_id")),
                eos_token_ids=tuple(_integer(source, "eos_token_id", e) for e in eos_ids),
                moe=_moe_from_dict(raw, arch, family, source) if family in MOE_FAMILIES else None,
                source=source,
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: required field {e.args[0]!r} is missing") from e
        except (TypeError, ValueError, ArithmeticError) as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"{source}: bad value ({e})") from e
        for name, field_name in (
            ("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
            ("intermediate_size", "intermediate_size"), ("num_layers", "num_hidden_layers"),
            ("num_kv_heads", "num_key_value_heads"), ("head_dim", "head_dim"),
            ("max_position_embeddings", "max_position_embeddings"),
        ):  # fmt: skip
            _positive(source, field_name, getattr(cfg, name))
        if cfg.max_position_embeddings > MAX_POSITIONS:  # (the RoPE table has a row for each)
            raise ModelLoadError(
                f"{source}: max_position_embeddings must be at most {MAX_POSITIONS}, got "
                f"{cfg.max_position_embeddings}"
            )
        if cfg.sliding_window is not None:
            _positive(source, "sliding_window", cfg.sliding_window)
        if cfg.head_dim % 2:  # (the RoPE kernels failed every request, after the model loaded)
            raise ModelLoadError(
                f"{source}: head_dim must be even (rotary embeddings turn pairs of its "
                f"dimensions), got {cfg.head_dim}"
                + ("" if raw.get("head_dim") else " (hidden_size / num_attention_heads)")
            )
        if not cfg.rms_norm_eps >= 0 or not math.isfinite(cfg.rms_norm_eps):  # (NaN: NaN outputs)
            raise ModelLoadError(f"{source}: rms_norm_eps must be >= 0, got {cfg.rms_norm_eps}")
        # an eos id outside the vocabulary can never be sampled; one past it failed the engine's
        # start (IndexError building the grammars' eos mask), a negative one marked the last token
        bad_eos = [e for e in cfg.eos_token_ids if not 0 <= e < cfg.vocab_size]
        if bad_eos:
            raise ModelLoadError(
                f"{source}: eos_token_id {bad_eos[0]} is not a token id (vocab_size is "
                f"{cfg.vocab_size})"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported")
        return cfg

    def param_count(self, include_embedding: bool = True) -> int:
        """Number of weights in the linear layers (and embeddings) touched per token."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        total = 0
        for layer in range(self.num_layers):
            moe = self.moe
            if moe is not None and moe.is_sparse(layer):  # the router, k experts, the shared one
                shared = moe.shared_expert_intermediate_size
                mlp = h * moe.num_experts + 3 * h * moe.top_k * moe.intermediate_size
                mlp += 3 * h * shared + (h if shared else 0)
            else:
                mlp = 3 * h * i
            total += attn + mlp
        if include_embedding:
            total += self.vocab_size * h
        return total


def _moe_archs() -> list[str]:
    return [a for a, f in SUPPORTED_ARCHITECTURES.items() if f in MOE_FAMILIES]


def _moe_from_dict(raw: dict[str, Any], arch: str, family: str, source: str) -> MoeConfig:
    """The experts of Mixtral (num_local_experts, its top-k always renormalised) and of
    Qwen2-MoE / Qwen3-MoE (num_experts, moe_intermediate_size, norm_topk_prob; Qwen2-MoE's
    shared expert; dense layers by decoder_sparse_step and mlp_only_layers)."""
    for key, (why, plain) in _UNSUPPORTED_ROUTING.items():
        if raw.get(key) not in plain:
            raise ModelLoadError(
                f"{source}: {arch} with {key}={raw[key]!r} ({why}) is not supported"
            )
    if family == "mixtral":
        return MoeConfig(
            num_experts=_integer(source, "num_local_experts", raw["num_local_experts"]),
            top_k=_integer(source, "num_experts_per_tok", raw["num_experts_per_tok"]),
            intermediate_size=_integer(source, "intermediate_size", raw["intermediate_size"]),
            norm_topk_prob=True,
            source=source,
        )
    # Hub configs say num_experts; transformers 5 saves Qwen3-MoE's as num_local_experts.
    key = "num_experts" if "num_experts" in raw else "num_local_experts"
    experts = raw.get(key)
    if experts is None:
        raise ModelLoadError(f"{source}: required field 'num_experts' is missing")
    shared = "shared_expert_intermediate_size"
    step = raw.get("decoder_sparse_step")
    return MoeConfig(
        num_experts=_integer(source, key, experts),
        top_k=_integer(source, "num_experts_per_tok", raw["num_experts_per_tok"]),
        intermediate_size=_integer(source, "moe_intermediate_size", raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=(
            _integer(source, shared, raw[shared]) if family == "qwen2_moe" else 0
        ),
        decoder_sparse_step=(step is not None and _integer(source, "decoder_sparse_step", step))
        or 1,
        mlp_only_layers=tuple(
            _integer(source, "mlp_only_layers", i) for i in raw.get("mlp_only_layers") or ()
        ),
        source=source,
    )


def _rope_from_dict(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers >= 5 folds rope_theta into `rope_parameters`; older configs use `rope_scaling`.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    merged = {**params, **scaling}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type == "default":
        return RopeConfig(theta=theta, source=source)
    if "factor" not in merged:
        raise ModelLoadError(f"{source}: rope_scaling of type {rope_type!r} needs 'factor'")
    return RopeConfig(
        theta=theta,
        scaling_type=rope_type,
        factor=float(merged["factor"]),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=_integer(
            source,
            "rope_scaling original_max_position_embeddings",
            merged.get(
                "original_max_position_embeddings", raw.get("max_position_embeddings", 8192)
            ),
        ),
        source=source,
    )


@dataclass(slots=True)
class EngineConfig:
    """How the engine runs a model. Checked here; the CLI and the Python API build it."""

    model: str  # path to a Hugging Face model folder
    dtype: str = "auto"  # "auto" (the checkpoint's dtype), "float32", "bfloat16", "float16"
    # how the linear layers' weights, the embedding and the LM head are stored: "auto" (in
    # `dtype`), or "bfloat16" under float32 on the CPU (half the bytes a decode step reads; the
    # products and sums stay float32; a checkpoint in float32 is rounded to bfloat16 on load)
    weight_dtype: str = "auto"
    block_size: int = 16  # tokens per KV-cache block
    # the KV cache's element type: "auto" (the model's dtype: exact), or "bfloat16" under float32
    # activations on the CPU: half the bytes a cached token takes (twice the tokens in the same
    # memory) and a decode step's attention reads; keys and values rounded to bfloat16 when
    # written (outputs then differ from float32's by that rounding), widened exactly when read
    kv_cache_dtype: str = "auto"
    # keep the decoder layers' bfloat16 weights Huffman-compressed in memory (about two thirds
    # of their bytes; runtime.compression.CompressedBlocks) and decode each layer's weights into
    # one shared buffer just before it runs: more memory left for the KV cache, and on a GPU a
    # model whose dense weights would not fit in its memory.
    # Lossless (the same outputs); each step pays the decoding of every layer (on the CPU
    # ~4 GB/s: several times slower than reading dense weights; on an H200 ~220 GB/s, inside
    # the CUDA graphs: SmolLM2's step 2.6x the dense one at batch 1). The start-up still reads the
    # dense weights once (given back layer by layer as each is encoded). Needs bfloat16
    # weights (dtype or weight_dtype bfloat16) and tp = pp = ep = 1; a speculative draft
    # model stays dense
    keep_weights_compressed: bool = False
    kv_cache_bytes: int | None = None  # bytes for the KV cache; None: kv_cache_fraction of free RAM
    kv_cache_fraction: float = (
        0.25  # of the machine's available memory, when kv_cache_bytes is None
    )
    # on the CPU, when the KV cache's memory is committed: "lazy" (a page when a block first
    # uses it: a fast start, memory taken as it is used) or "eager" (all of it at start-up, with
    # progress lines: no first-touch page faults in the requests' path; a fresh process ran the
    # throughput workload 12% slower lazy, on a Firecracker guest; see bench/README). The GPU's
    # is always allocated whole
    kv_cache_commit: str = "lazy"
    max_num_seqs: int = 128  # most requests in one step (with pp > 1: per lane, pp lanes in flight)
    max_num_batched_tokens: int = 2048  # token budget of one engine step
    max_waiting: int = 4096  # bound on queued requests; more are refused
    max_model_len: int | None = None  # defaults to the model's context length
    num_threads: int | None = None  # torch threads on the CPU; None: torch's default
    attention: str = (
        "auto"  # CPU attention: "auto", "cpu_ext" (in place, C++: decode rows, and float32
        # prompt chunks where the kernel takes the heads), "torch" (reference)
    )
    cpu_kernels: str = "auto"  # few-row matmuls, RMSNorm: "auto"/"cpu_ext" (C++), "torch"
    # on the CPU with float32 weights: where a weight's blocks of 32 are exactly Q4_1, Q4_0, Q4_K,
    # Q8_0 or Q6_K values (a model imported from such a GGUF), few-row matmuls (decode) read those
    # blocks, widened to the same float32 values in registers: a fifth of the bytes (kernels.linear)
    packed_weights: bool = True
    enable_prefix_caching: bool = True  # reuse the KV blocks of cached prompt prefixes
    model_revision: str | None = None  # cache identity; None: a fingerprint of the folder
    speculative: SpeculativeConfig | None = None  # speculative decoding (a dict of its fields
    # is accepted); None: off
    tp: int = 1  # tensor-parallel ranks (runtime.parallel); the worker starts them itself
    pp: int = 1  # pipeline-parallel stages
    ep: int = 1  # expert-parallel ranks (a mixture-of-experts model's experts spread)
    dist_port: int | None = None  # 127.0.0.1 port where the ranks meet; None: a free one
    device: str = "auto"  # "auto" (CUDA when torch sees a GPU and tp = pp = ep = 1, else the
    # CPU), "cpu", "cuda"
    cuda_graphs: bool = True  # on CUDA: decode steps replayed from graphs captured at start-up
    cuda_graph_max_batch: int = 64  # the largest decode batch captured (larger ones run eagerly)

    def __post_init__(self) -> None:
        from runtime.parallel import ParallelConfig  # it imports this module

        # counts given from Python as other types ("4", 4.0, True) or out of range failed later,
        # as a TypeError deep in the engine or torch's "set_num_threads expects a positive integer"
        for name, least in (("block_size", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1),
                            ("max_waiting", 1), ("num_threads", 1), ("tp", 1), ("pp", 1),
                            ("ep", 1), ("kv_cache_bytes", 0), ("dist_port", 0),
                            ("max_model_len", 0), ("cuda_graph_max_batch", 1)):  # fmt: skip
            value = getattr(self, name)
            if value is None and name in ("num_threads", "kv_cache_bytes", "dist_port",
                                          "max_model_len"):  # fmt: skip
                continue
            # (numpy's integers are integers; a bool is not a count)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
            if value < least and name != "max_model_len":  # (its own message, below)
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
            setattr(self, name, int(value))
        # switches given as other types were taken for their truth: enable_prefix_caching="no"
        # turned the prefix cache on (every bool field: True or False only)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be True or False, got {value!r}")
        if self.dist_port is not None and self.dist_port > 65535:  # (0: a free one)
            raise ValueError(f"dist_port must be a port (1-65535, or 0), got {self.dist_port}")
        ParallelConfig(self.tp, self.pp, self.ep)  # each >= 1, ep and tp compatible
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "auto":  # ranks (tp/pp/ep) run on the CPU only, so far
            single = max(self.tp, self.pp, self.ep) == 1
            # bfloat16 weights under float32 activations are a CPU mode: asking for them picks it
            cpu_mode = self.weight_dtype == "bfloat16" and self.dtype in ("auto", "float32")
            gpu = torch.cuda.is_available() and single and not cpu_mode
            self.device = "cuda" if gpu else "cpu"
        elif self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device='cuda' asked for, but torch {torch.__version__} sees no CUDA GPU"
            )
        if self.device == "cuda":
            if self.dtype == "auto":  # the CUDA path's kernels are written for bfloat16
                self.dtype = "bfloat16"
            if max(self.tp, self.pp, self.ep) > 1:
                raise ValueError(
                    "tp, pp and ep above 1 run on the CPU (gloo ranks); on CUDA (NCCL) they are "
                    "not built yet: use device='cpu' or tp=pp=ep=1"
                )
        if self.max_model_len is not None and self.max_model_len < 0:
            raise ValueError(
                f"max_model_len must be >= 1 (0: the model's), got {self.max_model_len}"
            )
        if self.cuda_graph_max_batch < 1:
            raise ValueError(f"cuda_graph_max_batch must be >= 1, got {self.cuda_graph_max_batch}")
        if isinstance(self.speculative, dict):
            try:
                self.speculative = SpeculativeConfig(**self.speculative)
            except TypeError as e:  # a field it does not have (TypeError names it)
                raise ValueError(f"speculative: {e}") from e
        elif self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError("speculative must be a SpeculativeConfig or a dict of its fields, "
                             f"got {self.speculative!r}")  # fmt: skip
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.weight_dtype not in ("auto", "bfloat16"):
            raise ValueError(f"weight_dtype must be auto or bfloat16, got {self.weight_dtype!r}")
        if self.weight_dtype == "bfloat16" and self.dtype == "bfloat16":
            self.weight_dtype = "auto"  # the weights are in the model's dtype already
        elif self.weight_dtype == "bfloat16" and self.dtype == "auto":
            self.dtype = "float32"  # bfloat16 weights under float32 activations
        if self.weight_dtype == "bfloat16" and (self.dtype != "float32" or self.device != "cpu"):
            raise ValueError(
                "weight_dtype='bfloat16' runs under dtype='float32' on the CPU (bfloat16 weights, "
                f"float32 activations); got dtype={self.dtype!r}, device={self.device!r}"
            )
        if self.keep_weights_compressed and (
            self.dtype == "float16" or (self.dtype == "float32" and self.weight_dtype == "auto")
        ):  # ("auto": the checkpoint's dtype, checked once the model is read)
            raise ValueError(
                "keep_weights_compressed (--keep-weights-compressed) needs bfloat16 weights: "
                "dtype='bfloat16' (--dtype bfloat16), or weight_dtype='bfloat16' (--weight-dtype "
                f"bfloat16) under float32 on the CPU; got dtype={self.dtype!r}"
            )
        if self.keep_weights_compressed and max(self.tp, self.pp, self.ep) > 1:
            raise ValueError(
                "keep_weights_compressed with tp, pp or ep above 1 is not built yet (each rank "
                "holds its own layers); use tp=pp=ep=1"
            )
        if self.kv_cache_dtype not in ("auto", "bfloat16"):
            raise ValueError(
                f"kv_cache_dtype must be auto or bfloat16, got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype == "bfloat16" and (self.dtype == "float16" or (
                self.device == "cuda" and self.dtype == "float32")):  # fmt: skip
            raise ValueError(
                "kv_cache_dtype='bfloat16' takes a bfloat16 model, or a float32 one on the CPU; "
                f"got dtype={self.dtype!r}, device={self.device!r}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_commit not in ("lazy", "eager"):
            raise ValueError(f"kv_cache_commit must be lazy or eager, got {self.kv_cache_commit!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if isinstance(self.kv_cache_fraction, bool) or not isinstance(
            self.kv_cache_fraction, numbers.Real
        ):  # ("0.5" was a TypeError from the comparison below)
            raise ValueError(f"kv_cache_fraction must be a number, got {self.kv_cache_fraction!r}")
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


def _positive(source: str, name: str, value: int) -> None:
    if value < 1:
        raise ModelLoadError(f"{source}: {name} must be a positive integer, got {value}")


def _integer(source: str, name: str, value: Any) -> int:
    """config.json's integer `name`: an int, or a float with no fraction (512.0, as some
    converters write them); not a fraction, a string or a bool (int() took 512.9 as 512, "512"
    as 512 and true as 1, silently)."""
    if isinstance(value, bool) or not (
        isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    ):
        raise ModelLoadError(f"{source}: {name} must be an integer, got {value!r}")
    return int(value)
