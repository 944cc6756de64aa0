"""edgeinfer's engine: model code, loader, paged KV cache, scheduler, sampler, detokenizer.

The public names are imported lazily, so that `import runtime.sampling_params` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
