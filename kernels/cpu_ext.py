"""The CPU extensions (`csrc/paged_decode_cpu.cpp`, `csrc/small_gemm_cpu.cpp`), compiled on
first use and cached.

Building needs a C++ compiler and ninja (a dependency of this package); it takes about a minute
once per machine and Python/torch version, and is reused from the cache afterwards. Where it
cannot be built, the loaders return None, say why once on the log, and the callers use the
PyTorch reference (same results, slower decode).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
_GEMM_SOURCE = Path(__file__).parent / "csrc" / "small_gemm_cpu.cpp"
_NORM_SOURCE = Path(__file__).parent / "csrc" / "rms_norm_cpu.cpp"
_HUFFMAN_SOURCE = Path(__file__).parent / "csrc" / "huffman_decode_cpu.cpp"
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def build_dir() -> Path:
    """Where the compiled extension is cached (TORCH_EXTENSIONS_DIR, as torch names it)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "edgeinfer" / "torch_extensions"
    import torch

    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    return base / tag.replace("+", "_")


def load() -> ModuleType | None:
    """The paged decode attention module, building it on first call; None where it cannot be built."""
    return _build("edgeinfer_paged_decode_cpu", _SOURCE, "CPU attention extension")


def load_small_gemm() -> ModuleType | None:
    """The small-batch matmul module (`csrc/small_gemm_cpu.cpp`); None where it cannot be built."""
    return _build("edgeinfer_small_gemm_cpu", _GEMM_SOURCE, "CPU small-matmul extension")


def load_rms_norm() -> ModuleType | None:
    """The fused RMSNorm module (`csrc/rms_norm_cpu.cpp`); None where it cannot be built."""
    return _build("edgeinfer_rms_norm_cpu", _NORM_SOURCE, "CPU RMSNorm extension")


def load_huffman() -> ModuleType | None:
    """The Huffman bfloat16 decoder (`csrc/huffman_decode_cpu.cpp`); None where it cannot be built."""
    return _build("edgeinfer_huffman_cpu", _HUFFMAN_SOURCE, "CPU Huffman decoder")


def _build(name: str, source: Path, what: str) -> ModuleType | None:
    with _lock:
        if name in _state:
            return _state[name]
        try:
            from torch.utils import cpp_extension

            path = build_dir() / name
            path.mkdir(parents=True, exist_ok=True)
            log.info("building the %s in %s (once per machine)", what, path)
            mod = cpp_extension.load(
                name=name,
                sources=[str(source)],
                # Reassociation lets the compiler vectorize the dot products; no finite-math (-inf is used).
                extra_cflags=[
                    "-O3",
                    "-march=native",
                    "-fopenmp",
                    "-fno-math-errno",
                    "-fassociative-math",
                    "-fno-signed-zeros",
                    "-fno-trapping-math",
                ],
                extra_ldflags=["-fopenmp"],
                build_directory=str(path),
                verbose=False,
            )
        except Exception as e:  # no compiler, no ninja, a read-only home: use the reference
            log.warning("%s unavailable (%s); using the PyTorch reference", what, e)
            mod = None
        _state[name] = mod
        return mod
