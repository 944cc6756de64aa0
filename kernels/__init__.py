"""Hot operations of the engine, each a PyTorch reference (the CPU path) beside, later, a Triton kernel.

Model code calls these functions only; the dispatch picks the implementation for the tensor's device.
"""

from kernels.attention import (
    DecodeGroup,
    PagedAttentionMetadata,
    PrefillChunk,
    paged_attention,
    write_kv_cache,
)
from kernels.norm import rms_norm
from kernels.rotary import apply_rotary

__all__ = [
    "DecodeGroup",
    "PagedAttentionMetadata",
    "PrefillChunk",
    "apply_rotary",
    "paged_attention",
    "rms_norm",
    "write_kv_cache",
]
