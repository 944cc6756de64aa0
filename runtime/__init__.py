"""edgeinfer's engine: model code, loader, paged KV cache, scheduler, sampler, detokenizer.

The public names are imported lazily, so that `import runtime.sampling_params` stays light.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# OpenMP threads (torch's and our CPU kernels') spin this many iterations waiting for the next
# parallel region before they sleep. A decode step runs ~120 short matmuls with Python between
# them; left to libgomp's default, the threads sleep between them and each region pays a wake-up:
# SmolLM2-135M single-request decode on a 2-vCPU guest ran 7.9 tok/s with 2 threads, 20.1 with
# one, 34.7 with this (batch 16: 228 -> 266 tok/s), and an idle engine spins ~1% of a core.
# Read once, when libgomp loads (torch's import): set before that, and a value already in the
# environment wins. bench/README.md (throughput) has the measurements.
os.environ.setdefault("GOMP_SPINCOUNT", "1000000")


def _keep_freed_memory() -> None:
    """Let glibc's malloc keep freed memory instead of handing it back to the kernel.

    A forward pass allocates and frees tensors of megabytes each (a 2,048-token prefill step of
    SmolLM2: ~2 GB in all). Left to its defaults, glibc serves many of them with fresh mmaps and
    trims its heap back, so every step faults in and zeroes its pages again. Five such steps on a
    2-vCPU guest: 0.57-1.3M page faults left to the defaults, 0.36M with freed memory kept
    (allocations below 256 MiB from the heap, up to 1 GiB of free heap retained), and the steps
    0-9% faster across four paired runs. glibc only, and skipped
    when MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ is set (the environment decides) or
    EDGEINFER_MALLOC_TUNING=0.
    """
    if os.environ.get("EDGEINFER_MALLOC_TUNING", "1") == "0":
        return
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):  # glibc answers "glibc 2.36"; others raise
            return
    except (AttributeError, ValueError, OSError):
        return
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    libc.mallopt(m_mmap_threshold, 256 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


_keep_freed_memory()

if TYPE_CHECKING:
    from runtime.config import EngineConfig, ModelLoadError
    from runtime.llm import LLM
    from runtime.outputs import CompletionOutput, RequestOutput
    from runtime.sampling_params import InvalidRequestError, SamplingParams
    from runtime.structured import StructuredOutputsParams
    from runtime.tokenizer import ChatTemplateError, NoChatTemplateError

_EXPORTS = {
    "LLM": "runtime.llm",
    "CompletionOutput": "runtime.outputs",
    "EngineConfig": "runtime.config",
    "InvalidRequestError": "runtime.sampling_params",
    "ModelLoadError": "runtime.config",
    "NoChatTemplateError": "runtime.tokenizer",
    "ChatTemplateError": "runtime.tokenizer",
    "RequestOutput": "runtime.outputs",
    "SamplingParams": "runtime.sampling_params",
    "StructuredOutputsParams": "runtime.structured",
}

__all__ = [
    "LLM",
    "ChatTemplateError",
    "CompletionOutput",
    "EngineConfig",
    "InvalidRequestError",
    "ModelLoadError",
    "NoChatTemplateError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
