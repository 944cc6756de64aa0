"""Model code: one decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3) and its
mixture-of-experts forms (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

from runtime.model.llama import LlamaForCausalLM, StepContext
from runtime.model.moe import ExpertParallel

__all__ = ["ExpertParallel", "LlamaForCausalLM", "StepContext"]
