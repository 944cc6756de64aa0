"""Our engine against `transformers` on the same weights: logits and greedy continuations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.attention import PagedAttentionMetadata, PrefillChunk
from runtime import LLM, SamplingParams
from runtime.loader import load_model
from runtime.model import StepContext
from runtime.model_runner import ModelRunner
from tests.conftest import TINY_FAMILIES

PROMPTS = [
    [1, 403, 407, 261, 378],  # "Once upon a time"
    [1, 300, 301, 302],
    [1, *range(20, 57)],  # 38 tokens: spans several 16-token blocks
    [1, 99],
]


def _hf(model_dir: Path, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    # No eos, so transformers generates exactly n tokens without masking eos (as ignore_eos does).
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _our_prefill_logits(model_dir: Path, prompt: list[int], dtype: str = "float32") -> torch.Tensor:
    model = load_model(model_dir, dtype)
    runner = ModelRunner(model, num_blocks=8, block_size=16)
    T = len(prompt)
    meta = PagedAttentionMetadata(
        slot_mapping=torch.arange(T),
        block_size=16,
        prefills=[PrefillChunk(query_start=0, query_len=T, context_len=0)],
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), StepContext(torch.arange(T), meta), runner.kv_caches)
        return model.logits(hidden)  # (T, vocab)


def test_stories_prefill_logits(stories_dir: Path) -> None:
    prompt = PROMPTS[2]
    ours = _our_prefill_logits(stories_dir, prompt)
    with torch.no_grad():
        ref = _hf(stories_dir)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_stories_greedy_text(stories_dir: Path) -> None:
    llm = LLM(stories_dir, kv_cache_bytes=1 << 22)
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=30))[0]
    assert out.prompt_token_ids == [1, 403, 407, 261, 378]
    expected = ", there was a little girl named Lily. She loved to play outside in the park."
    assert out.outputs[0].text.startswith(expected)


def test_stories_greedy_batch_matches_transformers(stories_dir: Path) -> None:
    hf = _hf(stories_dir)
    llm = LLM(stories_dir, kv_cache_bytes=1 << 22)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 40), prompt


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_family_logits_and_greedy(family: str, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_model_dir(family)
    hf = _hf(model_dir)
    prompt = PROMPTS[2]
    ours = _our_prefill_logits(model_dir, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)

    llm = LLM(model_dir, kv_cache_bytes=1 << 22)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, p, 32), (family, p)


def test_bfloat16_logits_close(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_model_dir("llama", "bfloat16")
    prompt = PROMPTS[2]
    ours = _our_prefill_logits(model_dir, prompt, "bfloat16")
    with torch.no_grad():
        ref = _hf(model_dir, torch.bfloat16)(torch.tensor([prompt])).logits[0].float()
        exact = _hf(model_dir, torch.float32)(torch.tensor([prompt])).logits[0]
    # Our bfloat16 error against float32 is within a small multiple of transformers' own.
    ours_err = (ours - exact).abs().max().item()
    ref_err = (ref - exact).abs().max().item()
    assert ours_err <= 2 * ref_err + 1e-3, (ours_err, ref_err)


@pytest.mark.slow
def test_smollm2_engine_matches_transformers(smol_dir: Path) -> None:
    """The default model, imported from its GGUF: our greedy chat answer equals transformers'."""
    hf = _hf(smol_dir)
    llm = LLM(smol_dir, kv_cache_bytes=64 << 20)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True),
        add_special_tokens=False,
    )
    prompts = [prompt, prompt[:9], list(range(100, 140))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, p, 24)
    assert "Paris" in outs[0].outputs[0].text
