"""Model code: one decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3)."""

from runtime.model.llama import LlamaForCausalLM, StepContext

__all__ = ["LlamaForCausalLM", "StepContext"]
