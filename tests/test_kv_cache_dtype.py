"""A KV cache kept in bfloat16 under a float32 model (`EngineConfig.kv_cache_dtype`): twice the
blocks in the same bytes, keys and values rounded when written and widened exactly when read.
Outputs are then float32 attention over rounded keys and values: close to transformers, not
equal to it, and the default (the model's dtype) stays exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from tests.test_parity import PROMPTS, _hf, _hf_greedy, _prefill_logits

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]


def test_twice_the_blocks_in_the_same_bytes(stories_dir: Path) -> None:
    exact = LLM(stories_dir, kv_cache_bytes=1 << 22)
    half = LLM(stories_dir, kv_cache_bytes=1 << 22, kv_cache_dtype="bfloat16")
    assert exact.engine.runner.kv.dtype == torch.float32
    assert half.engine.runner.kv.dtype == torch.bfloat16
    assert half.engine.runner.kv.nbytes <= 1 << 22
    assert half.engine.blocks.num_blocks in (2 * exact.engine.blocks.num_blocks,
                                             2 * exact.engine.blocks.num_blocks + 1)  # fmt: skip
    # another KV for the same tokens: another prefix-cache identity (disaggregated workers of
    # the two kinds refuse each other's blocks by it)
    assert half.engine.cache_id != exact.engine.cache_id
    assert half.engine.cache_id.endswith("-kvbfloat16-b16")
    # a worker's start-up line says what its KV cache holds
    t0 = min(start for start, _ in half.engine.startup.phases.values())
    line = half.engine.startup.timeline(t0, t0, "drive")
    assert f"bfloat16, {half.engine.blocks.num_blocks} blocks of 16 tokens" in line
    assert f"({half.engine.runner.kv.nbytes / 1e9:.2f} GB bfloat16" in line  # one rank: all


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_logits_close_to_transformers_and_greedy_kept(family: str, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Prefill logits within a small multiple of what rounding the keys and values costs in
    transformers' own float32 computation; greedy continuations as transformers' (these tiny
    models' top tokens are far apart). Qwen3 (head_dim 16, four query heads per kv head) takes
    the CPU extension's in-place prompt attention over the bfloat16 cache where it builds."""
    model_dir = tiny_model_dir(family)
    hf = _hf(model_dir)
    llm = LLM(model_dir, kv_cache_bytes=1 << 22, kv_cache_dtype="bfloat16")
    prompt = PROMPTS[2]
    ours = _prefill_logits(llm.engine.runner, prompt)
    with torch.no_grad():
        exact = hf(torch.tensor([prompt])).logits[0]
    err = (ours - exact).abs().max().item()
    scale = exact.abs().max().item()
    assert 0 < err <= 2e-2 * scale, (err, scale)  # rounded (not 0), by bfloat16's 2^-9 at most
    for p, got in zip(PROMPTS, _tokens(llm, PROMPTS), strict=True):
        assert got == _hf_greedy(hf, p, 24), (family, p)


def test_batched_chunked_and_reference_agree(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """With a bfloat16 cache: a batch equals its requests one at a time, prompts in 7-token
    chunks equal whole prompts (every chunk attends over the keys as the cache holds them), and
    the C++ kernels equal the PyTorch reference."""
    model_dir = tiny_model_dir("qwen3")
    batch = LLM(model_dir, kv_cache_bytes=1 << 22, kv_cache_dtype="bfloat16")
    want = _tokens(batch, PROMPTS)
    assert [_tokens(batch, [p])[0] for p in PROMPTS] == want
    chunked = LLM(model_dir, kv_cache_bytes=1 << 22, kv_cache_dtype="bfloat16",
                  max_num_batched_tokens=7)  # fmt: skip
    assert _tokens(chunked, PROMPTS) == want
    reference = LLM(model_dir, kv_cache_bytes=1 << 22, kv_cache_dtype="bfloat16",
                    attention="torch", cpu_kernels="torch")  # fmt: skip
    assert _tokens(reference, PROMPTS) == want


def test_bad_settings_are_refused(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or bfloat16"):
        EngineConfig(model="m", kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' takes"):
        EngineConfig(model="m", dtype="float16", kv_cache_dtype="bfloat16")
    # a float16 model (its checkpoint's dtype under dtype="auto") is refused once it is known
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' takes"):
        LLM(tiny_model_dir("llama", "float16"), kv_cache_bytes=1 << 22, kv_cache_dtype="bfloat16")
    # the Triton kernels (EDGEINFER_KERNELS=triton on the CPU, as on CUDA) take no such cache:
    # refused at start-up, not at the first step
    import runtime.engine

    with monkeypatch.context() as m:
        m.setattr(runtime.engine, "FORCE_TRITON", True)  # what engine.py asks
        with pytest.raises(ValueError, match="on the Triton kernels"):
            LLM(tiny_model_dir("llama"), kv_cache_bytes=1 << 22, kv_cache_dtype="bfloat16")
    # a bfloat16 model's cache is bfloat16 already: the setting changes nothing
    same = LLM(tiny_model_dir("llama", "bfloat16"), kv_cache_bytes=1 << 22,
               kv_cache_dtype="bfloat16")  # fmt: skip
    assert same.engine.runner.kv.dtype == torch.bfloat16
    assert "-kv" not in same.engine.cache_id


def test_a_draft_model_keeps_its_kv_in_the_same_kind_of_cache(stories_dir: Path) -> None:
    # speculative decoding with a draft model: its own cache follows kv_cache_dtype too
    from runtime.config import SpeculativeConfig

    spec = SpeculativeConfig(method="draft", draft_model=str(stories_dir), num_tokens=3)
    llm = LLM(stories_dir, kv_cache_bytes=1 << 22, kv_cache_dtype="bfloat16", speculative=spec)
    assert llm.engine.spec is not None and llm.engine.spec.proposer is not None
    assert llm.engine.spec.proposer.runner.kv.dtype == torch.bfloat16
    plain = LLM(stories_dir, kv_cache_bytes=1 << 22, kv_cache_dtype="bfloat16")
    assert _tokens(llm, PROMPTS) == _tokens(plain, PROMPTS)  # greedy drafts change nothing
