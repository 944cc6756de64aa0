"""Loading model folders: sharded checkpoints, and clear errors that name the file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runtime import LLM, ModelLoadError, SamplingParams
from runtime.config import ModelConfig
from runtime.loader import load_model

ROOT = Path(__file__).resolve().parents[1]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


def test_sharded_checkpoint_equals_single_file(stories_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories_dir / name, sharded / name)
    params = SamplingParams(temperature=0, max_tokens=24)
    a = LLM(stories_dir, kv_cache_bytes=1 << 20).generate("Once upon a time", params)
    b = LLM(sharded, kv_cache_bytes=1 << 20).generate("Once upon a time", params)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_missing_folder_and_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"not a folder"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match=r"config.json: missing"):
        load_model(tmp_path)


def test_corrupt_config(stories_dir: Path, tmp_path: Path) -> None:
    d = copy_model(stories_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        load_model(d)


def test_unsupported_architecture(stories_dir: Path, tmp_path: Path) -> None:
    d = copy_model(stories_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"GPT2LMHeadModel.*not supported"):
        load_model(d)


def test_unsupported_rope_scaling(stories_dir: Path) -> None:
    raw = json.loads((stories_dir / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ModelLoadError, match=r"yarn"):
        ModelConfig.from_dict(raw)


def test_missing_and_corrupt_weights(stories_dir: Path, tmp_path: Path) -> None:
    d = copy_model(stories_dir, tmp_path / "m")
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt"):
        load_model(d)
    weights.unlink()
    with pytest.raises(ModelLoadError, match=r"no model.safetensors"):
        load_model(d)


def test_missing_shard_named(stories_dir: Path, tmp_path: Path) -> None:
    d = copy_model(stories_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    index = {
        "metadata": {},
        "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"},
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002.safetensors: missing"):
        load_model(d)


def test_wrong_shape_and_dtype_named(stories_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    d = copy_model(stories_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model.norm.weight' has shape \(65,\)"):
        load_model(d)
    tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int8)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model.norm.weight' has dtype torch.int8"):
        load_model(d)
    del tensors["model.norm.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing from the checkpoint: norm.weight"):
        load_model(d)


def test_cli_generate(stories_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "generate", "--model", str(stories_dir),
         "--max-tokens", "12", "--kv-cache-bytes", str(1 << 20), "Once upon a time"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Once upon a time, there was a little girl named Lily")


def test_cli_clear_error(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "generate", "--model", str(tmp_path), "hi"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 2
    assert "config.json: missing" in out.stderr and "Traceback" not in out.stderr
