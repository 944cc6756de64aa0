"""The whole model through the Triton kernels, interpreted on the CPU (kernels.dispatch): the
same greedy tokens as the reference path on stories260K, through mixed prefill + decode steps,
a chunked prefill, a prefix-cache hit, and the decode graphs' padded static buffers (run eagerly:
no GPU here to capture them on)."""

from __future__ import annotations

from pathlib import Path

from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.triton_tools import run_interpreted

PROMPTS = [
    [1, 403, 407, 261, 378],
    [1, *range(20, 57)],  # 38 tokens: three blocks of 16, the last one partial
    [1, 99],
]

SCRIPT = """
import json, sys
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams

prompts, model = json.loads(sys.argv[1]), sys.argv[2]
greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# a 16-token step budget cuts the 38-token prompt into chunks, beside the others' decodes
llm = LLM(model, kv_cache_bytes=1 << 20, max_num_batched_tokens=16)
assert llm.engine.runner.triton
out = {"eager": [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]}
llm.engine.runner.capture_decode_graphs(4, 512, capture=False)  # 3 decodes pad to 4
again = llm.generate(prompts, greedy)
out["graphs"] = [list(o.outputs[0].token_ids) for o in again]
out["cached"] = again[1].num_cached_tokens
print(json.dumps(out))
"""


def test_model_through_interpreted_triton_kernels(stories_dir: Path) -> None:
    import json

    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(stories_dir, kv_cache_bytes=1 << 20, max_num_batched_tokens=16)
    assert not llm.engine.runner.triton
    expected = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)]
    out = run_interpreted(SCRIPT, json.dumps(PROMPTS), str(stories_dir), kernels=True, timeout=600)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["eager"] == expected
    assert got["graphs"] == expected
    assert got["cached"] == 32  # the second run found the 38-token prompt's two full blocks


def test_device_setting(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import pytest
    import torch

    from runtime.config import EngineConfig

    assert EngineConfig(model="m").device == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda"):
        EngineConfig(model="m", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            EngineConfig(model="m", device="cuda")
    with pytest.raises(ValueError, match="cuda_graph_max_batch must be an integer >= 1"):
        EngineConfig(model="m", cuda_graph_max_batch=0)
    # as on a GPU host: auto is CUDA in bfloat16 (the early weight load sees the same config),
    # but ranks stay on the CPU, where they are built; asked for on CUDA, they are refused
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu = EngineConfig(model="m")
    assert (on_gpu.device, on_gpu.dtype) == ("cuda", "bfloat16")
    assert EngineConfig(model="m", dtype="float32").dtype == "float32"
    assert EngineConfig(model="m", tp=2).device == "cpu"
    with pytest.raises(ValueError, match="not built yet"):
        EngineConfig(model="m", device="cuda", pp=2)


def test_graph_buckets() -> None:
    from runtime.cuda_graphs import buckets

    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert buckets(5) == [1, 2, 4, 5]
    assert buckets(1) == [1]
    assert buckets(12) == [1, 2, 4, 8, 12]
