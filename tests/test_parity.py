"""Our engine against `transformers` on the same weights: logits and greedy continuations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import cpu_ext
from kernels.attention import PagedAttentionMetadata, PrefillChunk
from runtime import LLM, SamplingParams
from runtime.loader import load_model
from runtime.model import StepContext
from runtime.model.layers import MLP, RMSNorm
from runtime.model.llama import Attention
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
    return _prefill_logits(ModelRunner(model, num_blocks=8, block_size=16), prompt)


def _prefill_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """The runner's model on a fresh prompt: the logits of every position (T, vocab)."""
    model = runner.model
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


def test_prompt_chunks_after_cached_tokens_match_transformers(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Qwen3's tiny model (head_dim 16, four query heads per kv head: the CPU extension's in-place
    prefill attention where it builds) with prompts cut into 7-token chunks, and a prompt that
    starts with another's cached blocks: each chunk attends over tokens already in the cache."""
    model_dir = tiny_model_dir("qwen3")
    hf = _hf(model_dir)
    llm = LLM(model_dir, kv_cache_bytes=1 << 22, max_num_batched_tokens=7)
    ext = cpu_ext.load()
    assert llm.engine.runner.prefill_in_place == (ext is not None and ext.prefill_supported(4, 16))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate(PROMPTS, params)
    shared = [*PROMPTS[2], 7, 8, 9]  # PROMPTS[2]'s first two blocks are cached by now
    again = llm.generate([shared], params)[0]
    assert again.num_cached_tokens >= 32
    for p, out in zip([*PROMPTS, shared], [*first, again], strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, p, 12), p


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


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bfloat16_model_takes_the_cpu_kernels_bit_for_bit(family: str, tiny_model_dir,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """A bfloat16 model on the CPU runs RMSNorm, RoPE with the KV write and SiLU-and-mul through
    the C++ kernels (none with cpu_kernels="torch"), which round where the references round: its
    logits are the references' bit for bit (the same matmuls either way)."""
    gemm, norm, fused = cpu_ext.load_small_gemm(), cpu_ext.load_rms_norm(), cpu_ext.load_fused()
    if gemm is None or norm is None or fused is None:
        pytest.skip("the CPU extensions did not build here")
    model = load_model(tiny_model_dir(family, "bfloat16"), "bfloat16")
    runner = ModelRunner(model, num_blocks=8, block_size=16)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    steps = [m for m in model.modules() if isinstance(m, (Attention, MLP))]
    assert all(m.fused is norm for m in norms) and all(m.fused is fused for m in steps)
    prompts = [[1, *range(20, 90)], [1]]  # 71 tokens (every kernel's OpenMP branch), and 1
    ours = [_prefill_logits(runner, p) for p in prompts]
    model.use_cpu_kernels(gemm, None, None)
    for p, got in zip(prompts, ours, strict=True):
        assert torch.equal(got, _prefill_logits(runner, p))
    ModelRunner(model, num_blocks=8, block_size=16)  # "auto": the kernels again
    assert all(m.fused is not None for m in [*norms, *steps])
    ModelRunner(model, num_blocks=8, block_size=16, cpu_kernels="torch")
    assert all(m.fused is None for m in [*norms, *steps])
    monkeypatch.setattr(cpu_ext, "load_fused", lambda: None)  # as if it had not built
    with pytest.raises(RuntimeError, match="did not build"):
        ModelRunner(model, num_blocks=8, block_size=16, cpu_kernels="cpu_ext")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bfloat16_engine_follows_transformers(family: str, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """A bfloat16 model served whole: prompts in 7-token chunks (torch's SDPA, chunks after
    cached tokens), decode through the CPU kernels (few-row matmuls, paged decode attention). Greedy bfloat16 may part from transformers' at a
    near tie, so each token we pick must be, by transformers' float32 logits on our own sequence,
    within twice transformers' own bfloat16 error of the best."""
    model_dir = tiny_model_dir(family, "bfloat16")
    llm = LLM(model_dir, kv_cache_bytes=1 << 22, max_num_batched_tokens=7)
    runner = llm.engine.runner
    assert runner.model.dtype == torch.bfloat16
    assert not runner.prefill_in_place  # torch's bfloat16 SDPA is the faster there
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [*PROMPTS, [*PROMPTS[2], 7, 8, 9]]  # the last starts with cached blocks
    outs = [*llm.generate(PROMPTS, params), *llm.generate(prompts[-1:], params)]
    assert outs[-1].num_cached_tokens >= 32
    hf32, hf16 = _hf(model_dir, torch.float32), _hf(model_dir, torch.bfloat16)
    for p, out in zip(prompts, outs, strict=True):
        ours = out.outputs[0].token_ids
        seq = torch.tensor([[*p, *ours]])
        with torch.no_grad():
            exact = hf32(seq).logits[0]
            ref_err = (hf16(seq).logits[0].float() - exact).abs().max().item()
        rows = exact[len(p) - 1 : -1]  # the logits each of our tokens was picked from
        picked = rows.gather(1, torch.tensor(ours)[:, None])[:, 0]
        gap = (rows.max(dim=1).values - picked).max().item()
        assert gap <= 2 * ref_err + 1e-3, (family, p, gap, ref_err)


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


def _hf_rounded_to_bfloat16(model_dir: Path):  # type: ignore[no-untyped-def]
    """transformers in float32 on the model's weights rounded to bfloat16: the values that
    weight_dtype='bfloat16' stores, run in float32 arithmetic as edgeinfer runs them."""
    hf = _hf(model_dir)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:  # the linear weights, the embedding and an untied LM head
                p.copy_(p.bfloat16().float())
            else:
                assert "norm" in name or "bias" in name, name  # these stay float32
    return hf


@pytest.mark.parametrize("family", ["stories", "qwen2", "qwen3"])
@pytest.mark.parametrize("cpu_kernels", ["auto", "torch"])
def test_bfloat16_weights_match_transformers_on_the_same_weights(
    family: str, cpu_kernels: str, stories_dir: Path, tiny_model_dir, caplog
) -> None:  # type: ignore[no-untyped-def]
    """bfloat16 weights under float32 activations (the C++ kernel, or the reference that widens
    each weight for torch) give transformers' float32 logits and greedy tokens on the rounded
    weights: stories260K (tied embedding) and Qwen2 (q/k/v biases) / Qwen3 (untied head)."""
    model_dir = stories_dir if family == "stories" else tiny_model_dir(family)
    hf = _hf_rounded_to_bfloat16(model_dir)
    with caplog.at_level("WARNING", logger="runtime.model_runner"):
        llm = LLM(model_dir, dtype="float32", weight_dtype="bfloat16", kv_cache_bytes=1 << 22,
                  cpu_kernels=cpu_kernels)  # fmt: skip
    # the reference path is slower than float32 weights: it says so (the kernel's path does not)
    assert ("without the CPU matmul kernel" in caplog.text) == (cpu_kernels == "torch")
    model = llm.engine.runner.model
    assert model.weight_dtype == torch.bfloat16 and model.dtype == torch.float32
    kinds = {n: p.dtype for n, p in model.named_parameters()}
    assert kinds["embed_tokens"] == torch.bfloat16
    assert all(d == torch.bfloat16 for n, d in kinds.items() if n.endswith("proj.weight"))
    assert all(d == torch.float32 for n, d in kinds.items() if "norm" in n or "bias" in n)

    prompt = PROMPTS[2]
    ours = _prefill_logits(llm.engine.runner, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, p, 32), (family, p)


def test_bfloat16_checkpoint_loads_its_weights_as_stored(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """A bfloat16 checkpoint under weight_dtype='bfloat16' (dtype auto: float32 activations):
    the weights are the file's bits, no conversion; the norms are widened to float32."""
    from safetensors.torch import load_file

    model_dir = tiny_model_dir("llama", "bfloat16")
    disk = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        disk.update(load_file(f))
    llm = LLM(model_dir, weight_dtype="bfloat16", kv_cache_bytes=1 << 22)
    assert llm.engine.config.dtype == "float32"
    model = llm.engine.runner.model
    assert torch.equal(model.embed_tokens, disk["model.embed_tokens.weight"])
    layer = model.layers[0]
    q = disk["model.layers.0.self_attn.q_proj.weight"]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert torch.equal(layer.self_attn.qkv_proj.weight[: q.shape[0]], q)
    norm = disk["model.layers.0.input_layernorm.weight"]
    assert layer.input_layernorm.weight.dtype == torch.float32
    assert torch.equal(layer.input_layernorm.weight, norm.float())
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


def test_weight_dtype_setting(stories_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What weight_dtype takes, and that its KV is not shared with float32 weights' (another
    prefix-cache identity: the same tokens give other KV)."""
    from runtime.config import EngineConfig

    m = str(stories_dir)
    assert EngineConfig(model=m, weight_dtype="bfloat16", device="cpu").dtype == "float32"
    with monkeypatch.context() as mp:  # on a GPU host, device auto keeps the CPU mode asked for
        mp.setattr(torch.cuda, "is_available", lambda: True)
        auto = EngineConfig(model=m, weight_dtype="bfloat16")
        assert (auto.device, auto.dtype, auto.weight_dtype) == ("cpu", "float32", "bfloat16")
        assert EngineConfig(model=m).device == "cuda"  # and takes the GPU otherwise
    same = EngineConfig(model=m, dtype="bfloat16", weight_dtype="bfloat16", device="cpu")
    assert same.weight_dtype == "auto"  # the weights are bfloat16 already
    with pytest.raises(ValueError, match="weight_dtype must be auto or bfloat16"):
        EngineConfig(model=m, weight_dtype="float16")
    with pytest.raises(ValueError, match="under dtype='float32' on the CPU"):
        EngineConfig(model=m, dtype="float16", weight_dtype="bfloat16", device="cpu")
    plain = LLM(stories_dir, kv_cache_bytes=1 << 20)
    half = LLM(stories_dir, weight_dtype="bfloat16", kv_cache_bytes=1 << 20)
    assert plain.engine.cache_id.endswith("-float32-b16")
    assert half.engine.cache_id.endswith("-float32-wbfloat16-b16")
