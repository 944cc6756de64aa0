"""What the Triton kernel tests share: running a script under the interpreter, making the
interpreter compute bfloat16 as a GPU does, and compiling a kernel for sm_90 without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, *args: str, kernels: bool = False, timeout: int = 300) -> str:
    """Run `script` (python -c, with `args`) in a fresh interpreter with TRITON_INTERPRET=1, which
    is read when a kernel is defined and so cannot be set in this process. `kernels`: also
    EDGEINFER_KERNELS=triton (the model's operations through the kernels); otherwise unset, so
    that the references stay PyTorch. Asserts it exits 0; returns its standard output."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    if kernels:
        env["EDGEINFER_KERNELS"] = "triton"
    else:
        env.pop("EDGEINFER_KERNELS", None)
    run = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


def fix_bf16_interpreter() -> None:
    """Make Triton 3.9's interpreter compute bfloat16 as the GPU does (call it inside an
    interpreted script). It keeps bfloat16 as raw uint16 bits (numpy has none), and (1) tl.dot
    multiplies those bits as integers (triton-lang/triton#11584): the operands are widened to
    float32 first, which is what the GPU's bfloat16 MMA with a float32 accumulator computes;
    (2) a float32 -> bfloat16 cast truncates where the GPU's cvt.rn (and torch) round to
    nearest even."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl

    def widen(x: Any) -> Any:  # bfloat16 bits -> float32, exact
        if x.dtype.scalar != tl.bfloat16:
            return x
        return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32),
                                        tl.float32)  # fmt: skip

    def create_dot(self: Any, a: Any, b: Any, *rest: Any) -> Any:
        return dot(self, widen(a), widen(b), *rest)

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(src.data.astype(np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(bits.view(torch.int16).numpy().view(np.uint16),
                                            dst_type.scalar)  # fmt: skip
        return cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl  # type: ignore[method-assign]


def compile_for_hopper(fn: Any, signature: dict[str, str], constexprs: dict[str, Any],
                       **options: Any) -> Any:  # fmt: skip
    """Compile a kernel to a cubin for sm_90 (H100/H200; warp size 32) with Triton's own
    compiler and ptxas, which catches what the interpreter does not (types, tl.dot's shapes).
    Skips only where the Triton build has no CUDA backend or no ptxas; a compile error fails
    the test (the lowering bugs it is here to catch surface as RuntimeError). Returns the
    compiled kernel."""
    import triton
    import triton.backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton build has no CUDA backend")
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(90)
    except (ImportError, RuntimeError, FileNotFoundError) as e:
        pytest.skip(f"no ptxas for sm_90 here: {e}")
    src = ASTSource(fn, signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.asm["cubin"] and ".target sm_90" in kernel.asm["ptx"]
    return kernel
