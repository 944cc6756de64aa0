"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against `transformers`, and expert
parallelism: ep=2 (two gloo ranks) gives what ep=1 gives, each rank holding half the experts."""

from __future__ import annotations

import json
import shutil
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import cpu_ext
from kernels.attention import PagedAttentionMetadata, PrefillChunk
from runtime import LLM, SamplingParams
from runtime.config import ModelConfig, ModelLoadError
from runtime.loader import load_model, start_load
from runtime.model import ExpertParallel, LlamaForCausalLM, StepContext
from runtime.model.moe import Experts, MoE
from runtime.model_runner import ModelRunner

PROMPTS = [
    [1, 403, 407, 261, 378],  # "Once upon a time"
    [1, 300, 301, 302],
    [1, *range(20, 57)],  # 38 tokens: spans several 16-token blocks
    [1, 99],
]
NEW_TOKENS = 16
NUM_EXPERTS = 8
# (family, save_pretrained's original per-expert layout, or transformers 5's stacked one)
MODELS = ["mixtral", "qwen2_moe", "qwen3_moe", "mixtral-stacked", "qwen2_moe-stacked"]


def _config(family: str):  # type: ignore[no-untyped-def]
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    if family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=64, num_local_experts=NUM_EXPERTS)
    if family == "qwen2_moe":  # a shared expert, and a dense middle layer
        common["num_hidden_layers"] = 3
        return tf.Qwen2MoeConfig(
            **common,
            intermediate_size=96,
            num_experts=NUM_EXPERTS,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common,
            head_dim=16,
            intermediate_size=96,
            num_experts=NUM_EXPERTS,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        )
    raise ValueError(family)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path):  # type: ignore[no-untyped-def]
    """Factory: a random-weight MoE model saved as a Hugging Face folder (made once)."""
    import transformers as tf

    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            family, _, layout = name.partition("-")
            torch.manual_seed(4321)
            model = tf.AutoModelForCausalLM.from_config(_config(family)).float()
            # Random init gives tiny logit (and router) gaps; widen them so that greedy choices
            # and expert choices are not near-ties.
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() >= 2:
                        p.mul_(3.0)
            out = tmp_path_factory.mktemp(name)
            model.save_pretrained(out, save_original_format=layout != "stacked")
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(stories_dir / f, out / f)
            made[name] = out
        return made[name]

    return make


def _hf(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    hf.generation_config.eos_token_id = None  # exactly n tokens, as ignore_eos does
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _prefill_logits(model: LlamaForCausalLM, prompt: list[int]) -> torch.Tensor:
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


def _greedy(model_dir: Path, ep: ExpertParallel | None = None) -> list[list[int]]:
    """Greedy tokens through the real engine (with this rank's share of the experts)."""
    weights = start_load(model_dir, ep=ep) if ep is not None else None
    llm = LLM(model_dir, weights=weights, kv_cache_bytes=1 << 22)
    if cpu_ext.load_small_gemm() is not None:  # the experts' few rows go through the kernel
        experts = [m for m in llm.engine.model.modules() if isinstance(m, Experts)]
        assert experts and all(m.small_gemm is not None for m in experts)
    outs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    )
    return [o.outputs[0].token_ids for o in outs]


def _experts(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if ".experts." in n}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_matches_transformers(family: str, moe_dir) -> None:  # type: ignore[no-untyped-def]
    model_dir = moe_dir(family)
    hf = _hf(model_dir)
    prompt = PROMPTS[2]
    model = load_model(model_dir)
    ours = _prefill_logits(model, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    if family == "qwen2_moe":  # layer 1 is dense (mlp_only_layers), the others sparse
        assert [isinstance(layer.mlp, MoE) for layer in model.layers] == [True, False, True]
        assert model.layers[0].mlp.shared_expert is not None
    # the stacked experts hold what transformers holds, expert by expert
    hf_layer = hf.model.layers[0].mlp
    ours_layer = model.layers[0].mlp.experts
    assert torch.equal(ours_layer.gate_up_proj, hf_layer.experts.gate_up_proj)
    assert torch.equal(ours_layer.down_proj, hf_layer.experts.down_proj)

    for prompt, tokens in zip(PROMPTS, _greedy(model_dir), strict=True):
        assert tokens == _hf_greedy(hf, prompt, NEW_TOKENS), (family, prompt)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_stacked_checkpoint_layout(family: str, moe_dir) -> None:  # type: ignore[no-untyped-def]
    """transformers 5 writes per-expert tensors by default (save_original_format=True), its
    stacked (E, 2*inter, hidden) / (E, hidden, inter) ones otherwise: both load the same."""
    stacked = moe_dir(f"{family}-stacked")
    names = load_file(stacked / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    per_expert = dict(load_model(moe_dir(family)).named_parameters())
    for name, p in load_model(stacked).named_parameters():
        assert torch.equal(p, per_expert[name]), name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ep_rank(rank: int, size: int, port: int, dirs: list[str], out: str) -> None:
    """One ep rank (a spawned process): every model's prefill logits, greedy tokens through the
    engine, and the experts it holds, saved for the test to compare."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=120),
    )
    try:
        ep = ExpertParallel(rank, size)
        results = {}
        for d in dirs:
            model = load_model(d, ep=ep)
            results[d] = {
                "logits": _prefill_logits(model, PROMPTS[2]),
                "decode_logits": _prefill_logits(model, PROMPTS[3][:1]),  # one token: rank 1 idle
                "greedy": _greedy(Path(d), ep),
                "experts": {n: p.clone() for n, p in _experts(model).items()},
                "param_bytes": sum(p.nbytes for p in model.parameters()),
            }
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ep2(moe_dir, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    """Every model run on two expert-parallel ranks (gloo, one spawn for all): per rank, per
    model folder, what `_ep_rank` saved."""
    import torch.multiprocessing as mp

    dirs = [str(moe_dir(name)) for name in ("mixtral", "qwen2_moe", "qwen3_moe", "mixtral-stacked")]
    out = tmp_path_factory.mktemp("ep2")
    mp.spawn(_ep_rank, args=(2, _free_port(), dirs, str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "mixtral-stacked"])
def test_ep2_matches_ep1(name: str, moe_dir, ep2) -> None:  # type: ignore[no-untyped-def]
    model_dir = moe_dir(name)
    full = load_model(model_dir)
    expected_logits = _prefill_logits(full, PROMPTS[2])
    expected_decode = _prefill_logits(full, PROMPTS[3][:1])
    expected_greedy = _greedy(model_dir)
    full_experts = _experts(full)
    for rank, results in enumerate(ep2):
        got = results[str(model_dir)]
        torch.testing.assert_close(got["logits"], expected_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["decode_logits"], expected_decode, rtol=1e-5, atol=1e-5)
        assert got["greedy"] == expected_greedy, (name, rank)
        # each rank holds only its half of every layer's experts: experts [4r, 4r + 4)
        assert got["experts"].keys() == full_experts.keys()
        for n, p in got["experts"].items():
            assert p.shape[0] == NUM_EXPERTS // 2, n
            assert torch.equal(p, full_experts[n][rank * 4 : rank * 4 + 4]), n
        expert_bytes = sum(p.nbytes for p in full_experts.values())
        assert got["param_bytes"] == sum(p.nbytes for p in full.parameters()) - expert_bytes // 2


def test_ep_must_divide_the_experts(moe_dir) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(
        ValueError, match=r"ep=3 does not divide the 8 experts of MixtralForCausalLM"
    ):
        load_model(moe_dir("mixtral"), ep=ExpertParallel(0, 3))
    dense = ModelConfig.from_dict(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
         "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"ep=2 needs a mixture-of-experts model"):
        ExpertParallel(0, 2).check(dense)
    with pytest.raises(ValueError, match=r"ep rank must be in \[0, 2\), got 2"):
        ExpertParallel(2, 2)


def _rewrite(model_dir: Path, dest: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(model_dir, dest)
    tensors = load_file(dest / "model.safetensors")
    edit(tensors)
    save_file(tensors, dest / "model.safetensors")
    return dest


def test_expert_tensor_errors_name_the_tensor(moe_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = moe_dir("mixtral")
    w3 = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    d = _rewrite(src, tmp_path / "missing", lambda t: t.pop(w3))
    with pytest.raises(ModelLoadError, match=r"missing from the checkpoint: layers\.1\.mlp\.experts"
                       r"\.gate_up_proj \(model\.layers\.1\.block_sparse_moe\.experts\.5\.w3\.weight\)"):  # fmt: skip
        load_model(d)
    # ep rank 0 holds experts 0-3: it does not need expert 5
    assert load_model(d, ep=ExpertParallel(0, 2)).layers[1].mlp.experts.n == 4

    d = _rewrite(src, tmp_path / "misshaped", lambda t: t.update({w3: t[w3][:-1]}))
    with pytest.raises(ModelLoadError, match=r"misshaped/model\.safetensors: tensor "
                       r"'model\.layers\.1\.block_sparse_moe\.experts\.5\.w3\.weight' has shape "
                       r"\(63, 64\), config\.json implies \(64, 64\)"):  # fmt: skip
        load_model(d)

    extra = "model.layers.0.block_sparse_moe.experts.8.w1.weight"  # only experts 0-7
    d = _rewrite(src, tmp_path / "extra", lambda t: t.update({extra: t[w3].clone()}))
    with pytest.raises(ModelLoadError, match=rf"extra/model\.safetensors: unexpected tensor "
                       rf"'{extra}' for MixtralForCausalLM"):  # fmt: skip
        load_model(d)

    qwen = moe_dir("qwen2_moe-stacked")  # stacked: (E, hidden, inter) down projections
    down = "model.layers.0.mlp.experts.down_proj"
    d = _rewrite(qwen, tmp_path / "stacked", lambda t: t.update({down: t[down][:7]}))
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.layers\.0\.mlp\.experts\.down_proj' "
                       r"has shape \(7, 64, 32\), config\.json implies \(8, 64, 32\)"):  # fmt: skip
        load_model(d)
    d = _rewrite(qwen, tmp_path / "stacked-missing", lambda t: t.pop(down))
    with pytest.raises(ModelLoadError, match=r"missing from the checkpoint: layers\.0\.mlp\.experts"
                       r"\.down_proj \(model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight\)"):  # fmt: skip
        load_model(d)


def _config_dict(moe_dir, name: str) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    return dict(json.loads((moe_dir(name) / "config.json").read_text()))


def test_moe_config(moe_dir) -> None:  # type: ignore[no-untyped-def]
    mixtral = ModelConfig.from_dict(_config_dict(moe_dir, "mixtral"))
    assert mixtral.moe is not None and mixtral.moe.norm_topk_prob  # Mixtral: always
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.intermediate_size) == (8, 2, 64)
    qwen2 = ModelConfig.from_dict(_config_dict(moe_dir, "qwen2_moe"))
    assert qwen2.moe is not None and qwen2.qkv_bias and not qwen2.moe.norm_topk_prob
    assert qwen2.moe.shared_expert_intermediate_size == 48
    assert [qwen2.moe.is_sparse(i) for i in range(3)] == [True, False, True]
    raw = _config_dict(moe_dir, "qwen3_moe")
    hub_style = {k: v for k, v in raw.items() if k != "num_local_experts"} | {"num_experts": 8}
    for r in (raw, hub_style):  # transformers 5 saves num_local_experts, the hub num_experts
        qwen3 = ModelConfig.from_dict(r)
        assert qwen3.moe is not None and qwen3.moe.num_experts == 8 and qwen3.qk_norm

    with pytest.raises(ModelLoadError, match=r"num_experts_per_tok must be in \[1, 8\]"):
        ModelConfig.from_dict(raw | {"num_experts_per_tok": 9})
    with pytest.raises(ModelLoadError, match=r"Qwen3MoeForCausalLM with n_group=4 \(grouped top-k"):
        ModelConfig.from_dict(raw | {"n_group": 4, "topk_group": 2})
    deepseek = raw | {"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 8,
                      "n_group": 4, "topk_group": 2}  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"architecture \['DeepseekV3ForCausalLM'\] is a "
                       r"mixture-of-experts model that is not supported \(grouped top-k routing\); "
                       r"supported mixture-of-experts architectures: MixtralForCausalLM"):  # fmt: skip
        ModelConfig.from_dict(deepseek)
