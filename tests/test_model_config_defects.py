"""Model folders that cannot be served are refused at load, naming the file and what was
expected (an odd head_dim, a non-integer count, an untied model without lm_head.weight, an
unsupported rope_scaling), and a huge max_position_embeddings does not build a RoPE table for
millions of positions nobody can reach."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.config import ModelLoadError
from runtime.loader import load_model
from runtime.manifest import Manifest, write_manifest
from tests.conftest import ROOT


def _copy(stories_dir: Path, tmp_path: Path, **edit: Any) -> Path:
    """A copy of stories260K with `edit` applied to its config.json (the original untouched)."""
    model = tmp_path / "model"
    shutil.copytree(stories_dir, model)
    path = model / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | edit))
    return model


def _refused(model: Path) -> str:
    with pytest.raises(ModelLoadError) as e:
        load_model(model)
    return str(e.value)


def test_an_odd_head_dim_is_refused_at_load_by_the_cli(stories_dir: Path, tmp_path: Path) -> None:
    """head_dim 1 (the checkpoint's shapes still match) loaded, then every request failed in the
    RoPE kernel with a traceback (a worker answered each one engine_dead)."""
    model = _copy(stories_dir, tmp_path, num_attention_heads=64, num_key_value_heads=32, head_dim=1)
    run = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "generate", "--max-tokens", "2",
         "--kv-cache-bytes", "1000000", "--model", str(model), "Once upon"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr and "loaded" not in run.stdout + run.stderr, run.stderr
    assert f"{model / 'config.json'}: head_dim must be even" in run.stderr, run.stderr
    assert "got 1" in run.stderr


def test_an_odd_implied_head_dim_is_refused(stories_dir: Path, tmp_path: Path) -> None:
    # hidden_size 64 / 64 heads: 1, no head_dim field
    model = _copy(stories_dir, tmp_path, num_attention_heads=64, num_key_value_heads=32)
    message = _refused(model)
    assert f"{model / 'config.json'}: head_dim must be even" in message, message
    assert "hidden_size / num_attention_heads" in message, message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("vocab_size", 512.9),  # was loaded as 512
        ("vocab_size", "512"),  # was accepted
        ("num_hidden_layers", True),  # was 1 layer
        ("intermediate_size", "172"),
        ("max_position_embeddings", 512.5),
        ("num_key_value_heads", 4.5),
        ("head_dim", "8"),
        ("eos_token_id", 2.5),
        ("bos_token_id", "1"),
    ],
)
def test_a_config_count_that_is_not_an_integer_is_refused(
    stories_dir: Path, tmp_path: Path, field: str, value: object
) -> None:
    model = _copy(stories_dir, tmp_path, **{field: value})
    message = _refused(model)
    assert message == f"{model / 'config.json'}: {field} must be an integer, got {value!r}"


def test_an_integral_float_count_is_taken(stories_dir: Path, tmp_path: Path) -> None:
    """512.0 is an integer, as some converters write them: the same model as 512."""
    model = load_model(_copy(stories_dir, tmp_path, vocab_size=512.0, num_hidden_layers=5.0))
    assert model.cfg.vocab_size == 512 and type(model.cfg.vocab_size) is int
    assert model.cfg.num_layers == 5 and type(model.cfg.num_layers) is int


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        ({"rope_scaling": {"type": "yarn", "factor": 4}}, "rope_scaling type 'yarn'"),
        ({"rope_theta": float("inf")}, "rope_theta must be > 0"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 2, "low_freq_factor": 0}},
         "rope_scaling low_freq_factor must be > 0"),
    ],
)  # fmt: skip
def test_rope_errors_name_the_config_path(
    stories_dir: Path, tmp_path: Path, edit: dict[str, Any], expected: str
) -> None:
    """They said plain "config.json: ..." where every other config error names the file."""
    model = _copy(stories_dir, tmp_path, **edit)
    message = _refused(model)
    assert message.startswith(f"{model / 'config.json'}: {expected}"), message


def test_moe_errors_name_the_config_path(tmp_path: Path) -> None:
    from runtime.config import ModelConfig

    source = str(tmp_path / "config.json")
    raw = {"architectures": ["MixtralForCausalLM"], "vocab_size": 512, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 9}  # fmt: skip
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_dict(raw, source=source)
    assert str(e.value).startswith(f"{source}: num_experts_per_tok must be in [1, 4]"), e.value
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_dict(raw | {"num_experts_per_tok": 2.5}, source=source)
    assert str(e.value) == f"{source}: num_experts_per_tok must be an integer, got 2.5"


def test_an_untied_model_without_lm_head_names_the_folder_and_why(
    stories_dir: Path, tmp_path: Path
) -> None:
    """'weights missing from the checkpoint: lm_head' named no folder and gave no hint."""
    model = _copy(stories_dir, tmp_path, tie_word_embeddings=False)
    message = _refused(model)
    assert message.startswith(f"{model}: weights missing from the checkpoint: lm_head"), message
    assert f"tie_word_embeddings is false (or not set) in {model / 'config.json'}" in message
    assert "lm_head.weight" in message


def test_an_empty_index_or_manifest_names_the_folder(stories_dir: Path, tmp_path: Path) -> None:
    model = _copy(stories_dir, tmp_path)
    (model / "model.safetensors").rename(model / "model-00001.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    message = _refused(model)
    assert message.startswith(f"{model}: weights missing from the checkpoint:"), message
    assert "none of the model's" in message and "weight_map" in message, message

    other = tmp_path / "manifested"
    shutil.copytree(stories_dir, other)
    write_manifest(other, Manifest("x", "y", 16 << 20, [], {}))
    message = _refused(other)
    assert message.startswith(f"{other}: weights missing from the checkpoint:"), message


def _rope_reference(model_dir: Path, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE table as it was built before (for every position up to `rows`)."""
    cfg = load_model(model_dir).cfg
    inv_freq = cfg.rope.inv_freq(cfg.head_dim)
    freqs = torch.outer(torch.arange(rows, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def test_a_huge_context_builds_the_rope_table_only_for_what_the_kv_cache_holds(
    stories_dir: Path, tmp_path: Path
) -> None:
    """max_position_embeddings 16,777,216 (allowed) built a cos/sin table for every position at
    the first request: 38 s and a 15.7 GB peak for a 2-token answer (an OOM kill on a small
    host, after the worker was serving). Now it is built at the engine's start, for the
    positions the KV cache can hold."""
    model = _copy(stories_dir, tmp_path, max_position_embeddings=1 << 24)
    llm = LLM(str(model), kv_cache_bytes=1_000_000, num_threads=1)
    engine = llm.engine
    slots = engine.runner.num_blocks * engine.config.block_size
    assert engine.max_model_len == 1 << 24
    tables = engine.model._rope_tables
    assert tables is not None, "the RoPE table is left to the first request"
    assert tables[0].shape[0] == slots < 4096, tables[0].shape
    cos, sin = _rope_reference(stories_dir, slots)  # the same values, row for row
    assert torch.equal(tables[0], cos) and torch.equal(tables[1], sin)
    t0 = time.perf_counter()
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = llm.generate([[1, 403, 407, 261, 378]], greedy)[0].outputs[0].token_ids
    assert time.perf_counter() - t0 < 5
    assert engine.model._rope_tables[0].shape[0] == slots  # not rebuilt
    # the same tokens as the model with its own 512 positions
    plain = LLM(str(stories_dir), kv_cache_bytes=1_000_000, num_threads=1)
    assert plain.generate([[1, 403, 407, 261, 378]], greedy)[0].outputs[0].token_ids == out
    # a sequence to the end of the KV cache: its last positions are in the table
    long = [1, *([403, 407, 261] * ((slots - 40) // 3))]
    done = llm.generate([long], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert len(done[0].outputs[0].token_ids) == 30 and len(long) + 30 <= slots


def test_stories_rope_table_and_greedy_outputs_are_unchanged(stories_dir: Path) -> None:
    """A normal model: the table still has a row for each of its 512 positions, with the same
    values, and greedy outputs match transformers'."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(stories_dir), kv_cache_bytes=1 << 22, num_threads=1)
    tables = llm.engine.model._rope_tables
    assert tables is not None and tables[0].shape[0] == 512
    cos, sin = _rope_reference(stories_dir, 512)
    assert torch.equal(tables[0], cos) and torch.equal(tables[1], sin)
    hf = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompts = [[1, 403, 407, 261, 378], [1, *range(20, 57)]]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
        assert out.outputs[0].token_ids == ref
