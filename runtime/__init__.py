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

if TYPE_CHECKING:
    from runtime.config import EngineConfig, ModelLoadError
    from runtime.llm import LLM
    from runtime.outputs import CompletionOutput, RequestOutput
    from runtime.sampling_params import InvalidRequestError, SamplingParams

_EXPORTS = {
    "LLM": "runtime.llm",
    "CompletionOutput": "runtime.outputs",
    "EngineConfig": "runtime.config",
    "InvalidRequestError": "runtime.sampling_params",
    "ModelLoadError": "runtime.config",
    "RequestOutput": "runtime.outputs",
    "SamplingParams": "runtime.sampling_params",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "InvalidRequestError",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
