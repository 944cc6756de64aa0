"""Load a Hugging Face model folder: config, weights (single or sharded safetensors), into our model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from runtime.config import DTYPES, ModelConfig, ModelLoadError
from runtime.model import LlamaForCausalLM
from runtime.weights import ReadStats, load_safetensors


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a folder: the shards named by the index, or the single file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: missing (listed in {index.name})")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(
        f"{model_dir}: no model.safetensors or model.safetensors.index.json "
        "(for a GGUF file, run `edgeinfer import-gguf FILE OUT_DIR` first)"
    )


def model_revision(model_dir: str | Path) -> str:
    """A short fingerprint of a model folder: its config.json and the safetensors headers
    (tensor names, dtypes, shapes, offsets) of every weight file, without reading the weights.
    Two folders with the same fingerprint lay out the same KV cache for the same tokens."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in safetensors_files(model_dir):
        with f.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(size, 64 << 20)))
    return h.hexdigest()[:16]


def resolve_dtype(requested: str, cfg: ModelConfig) -> torch.dtype:
    """The dtype to run in: the requested one, or the checkpoint's for "auto"."""
    if requested != "auto":
        return DTYPES[requested]
    name = cfg.torch_dtype.removeprefix("torch.")
    if name not in DTYPES:
        raise ModelLoadError(f"config.json: torch_dtype {cfg.torch_dtype!r} is not supported")
    return DTYPES[name]


def load_model(
    model_dir: str | Path,
    dtype: str = "auto",
    max_model_len: int | None = None,
    stats: ReadStats | None = None,
) -> LlamaForCausalLM:
    """Build the model from a folder and load its weights; raises ModelLoadError naming the file.

    The weights are read by `runtime.weights.load_safetensors` (headers first, large aligned
    reads, O_DIRECT where it helps); `stats` receives what that read did."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a folder")
    cfg = ModelConfig.from_dir(path)
    torch_dtype = resolve_dtype(dtype, cfg)
    model = LlamaForCausalLM(cfg, torch_dtype, max_model_len or cfg.max_model_len)
    model.load_weights(load_safetensors(safetensors_files(path), stats=stats))
    return model.eval()
