"""Hot operations of the engine, each a PyTorch reference (the CPU path) beside a Triton kernel
(kernels/triton_*.py, the CUDA path).

Model code calls these functions only; the dispatch (kernels.dispatch) picks the implementation
for the tensor's device.
"""

from kernels.activation import silu_and_mul
from kernels.attention import (
    DecodeGroup,
    PagedAttentionMetadata,
    PrefillChunk,
    TritonAttention,
    paged_attention,
    write_kv_cache,
)
from kernels.norm import add_rms_norm, rms_norm
from kernels.rotary import apply_rotary, rotate_and_cache

__all__ = [
    "DecodeGroup",
    "PagedAttentionMetadata",
    "PrefillChunk",
    "TritonAttention",
    "add_rms_norm",
    "apply_rotary",
    "paged_attention",
    "rms_norm",
    "rotate_and_cache",
    "silu_and_mul",
    "write_kv_cache",
]
