"""Speculative decoding's settings, as a user of the Python API gives them.

A setting of the wrong type is refused at start, naming it (a float count passed the config and
failed the engine's first step with drafts, every request in that step lost); a draft model's
folder that cannot be read is named as the draft model's (the error named a file, and beside the
target's folder read as the target's).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from runtime import LLM, SamplingParams
from runtime.config import ModelLoadError
from runtime.speculative import SpeculativeConfig

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big red ball under a tree and ran to get it. "
)


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("num_tokens", 2.5, "num_tokens must be an integer, got 2.5"),
        ("num_tokens", 4.0, "num_tokens must be an integer, got 4.0"),
        ("num_tokens", "4", "num_tokens must be an integer, got '4'"),
        ("num_tokens", True, "num_tokens must be an integer, got True"),
        ("ngram_min", 1.5, "ngram_min must be an integer"),
        ("ngram_max", 4.0, "ngram_max must be an integer"),
        ("max_batch_tokens", 40.5, "max_batch_tokens must be an integer"),
        ("ema", "0.5", r"ema must be an int or float in \(0, 1\], got '0.5', a str"),
    ],
)
def test_a_setting_of_another_type_is_refused_at_start(
    stories_dir: Path, name: str, value: object, why: str
) -> None:
    with pytest.raises(ValueError, match=f"speculative {why}"):
        LLM(
            str(stories_dir), kv_cache_bytes=4_000_000, speculative={"method": "ngram", name: value}
        )


def test_draft_settings_of_another_type_are_refused_at_start(stories_dir: Path) -> None:
    draft = {"method": "draft", "draft_model": str(stories_dir)}
    with pytest.raises(
        ValueError, match=r"draft_kv_cache_bytes must be an integer, got 1000000\.0"
    ):
        LLM(str(stories_dir), kv_cache_bytes=4_000_000,
            speculative={**draft, "draft_kv_cache_bytes": 1e6})  # fmt: skip
    with pytest.raises(ValueError, match=r"num_tokens must be an integer, got 3\.0"):
        LLM(str(stories_dir), kv_cache_bytes=4_000_000, speculative={**draft, "num_tokens": 3.0})
    with pytest.raises(ValueError, match="draft_model must be a folder's path, got 5"):
        SpeculativeConfig(method="draft", draft_model=5)  # type: ignore[arg-type]


def test_integers_of_other_kinds_and_paths_are_taken(stories_dir: Path) -> None:
    """numpy's integers are integers, a Path a folder: taken as int and str."""
    cfg = SpeculativeConfig(method="draft", draft_model=stories_dir,  # type: ignore[arg-type]
                            num_tokens=np.int64(3), max_batch_tokens=np.int32(16))  # fmt: skip
    assert (cfg.num_tokens, cfg.max_batch_tokens, cfg.draft_model) == (3, 16, str(stories_dir))
    assert type(cfg.num_tokens) is int and type(cfg.max_batch_tokens) is int
    llm = LLM(str(stories_dir), kv_cache_bytes=4_000_000, speculative=cfg)
    out = llm.generate([STORY * 2], SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert len(out.outputs[0].token_ids) > 0
    assert llm.engine.spec is not None and llm.engine.spec.proposed > 0


def test_an_unreadable_draft_folder_is_named_as_the_draft_model(
    stories_dir: Path, tmp_path: Path
) -> None:
    # a model store's name, as --model takes, is not a folder --draft-model takes
    with pytest.raises(ModelLoadError, match=r"^speculative draft_model \(--draft-model\): "
                       r"SmolLM2-135M-Instruct/config\.json: missing"):  # fmt: skip
        LLM(str(stories_dir), kv_cache_bytes=4_000_000,
            speculative={"method": "draft", "draft_model": "SmolLM2-135M-Instruct"})  # fmt: skip
    # its config and tokenizer, no weights
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(stories_dir / name, bare / name)
    with pytest.raises(ModelLoadError, match=r"^speculative draft_model \(--draft-model\): "
                       f"{bare}: no model.safetensors"):  # fmt: skip
        LLM(str(stories_dir), kv_cache_bytes=4_000_000,
            speculative={"method": "draft", "draft_model": str(bare)})  # fmt: skip


@pytest.mark.parametrize("bad", ["ngram", ["ngram"], {"method": "ngram", "num_tokenz": 3}])
def test_a_speculative_setting_that_is_no_config_is_named(bad: object) -> None:
    """EngineConfig(speculative=...) that is neither a SpeculativeConfig nor a dict of its
    fields, or a dict with a field it lacks: a ValueError naming `speculative` (a list was an
    AttributeError deep in the engine, an unknown key a bare TypeError)."""
    from runtime.config import EngineConfig

    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(model="unused", speculative=bad)  # type: ignore[arg-type]
