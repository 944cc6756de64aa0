"""The draft-model proposer's prefill, padded vocabularies, and speculative settings' wording.

A draft model caught up on a new prompt in one forward pass (a long prompt stalled every other
request's step); it now computes at most `max_num_batched_tokens` a step, as the target's
prefill is chunked, and drafts for a request once caught up. A draft whose vocabulary is padded
past the target's (the same tokenizer) was refused; it is taken, and never drafts a padding id.
A speculative setting given as a Decimal was refused as not "a number in (0, 1]".
"""

from __future__ import annotations

import json
import shutil
from decimal import Decimal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import LLM, SamplingParams
from runtime.draft import DraftProposer
from runtime.scheduler import ScheduledRequest
from runtime.speculative import SpeculativeConfig
from tests.test_speculative import swap_two_token_ids

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big red ball under a tree and ran to get it. "
)
BUDGET = 64  # max_num_batched_tokens of the engines here


def _draft(model_dir: Path) -> dict[str, object]:
    return {"method": "draft", "draft_model": str(model_dir), "num_tokens": 4,
            "max_batch_tokens": 64}  # fmt: skip


def _proposer(llm: LLM) -> DraftProposer:
    spec = llm.engine.spec
    assert spec is not None and isinstance(spec.proposer, DraftProposer)
    return spec.proposer


@pytest.fixture(scope="module")
def base(stories_dir: Path) -> LLM:
    return LLM(str(stories_dir), kv_cache_bytes=4_000_000, block_size=16,
               max_num_batched_tokens=BUDGET)  # fmt: skip


# ---------------------------------------------------------------------- chunked draft prefill
def test_a_long_prompt_s_draft_prefill_is_chunked(
    base: LLM, stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 400-token prompt beside a short one: no draft forward pass computes more than the
    step's budget (it was one pass of the whole prompt); the long request drafts once its draft
    KV has caught up, the short one meanwhile; greedy output is the target's alone."""
    llm = LLM(str(stories_dir), kv_cache_bytes=4_000_000, block_size=16,
              max_num_batched_tokens=BUDGET, speculative=_draft(stories_dir))  # fmt: skip
    proposer = _proposer(llm)
    passes: list[int] = []  # tokens of each draft forward pass
    forward = proposer.runner.forward

    def counted(scheduled: list[ScheduledRequest], tables: dict[str, list[int]]) -> torch.Tensor:
        passes.append(sum(s.num_new_tokens for s in scheduled))
        return forward(scheduled, tables)

    monkeypatch.setattr(proposer.runner, "forward", counted)
    prompts = [STORY * 7, "Once upon a time"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want, got = base.generate(prompts, params), llm.generate(prompts, params)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert len(got[0].prompt_token_ids) > 5 * BUDGET
    assert max(passes) <= BUDGET, passes
    assert got[0].spec_proposed > 0 and got[1].spec_proposed > 0  # both drafted, in time
    assert got[0].spec_accepted >= 0.95 * got[0].spec_proposed  # the draft is the target
    blocks = proposer.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def test_a_request_behind_drafts_nothing_until_caught_up(stories_dir: Path) -> None:
    """Step by step: while the draft's KV of a request is short of its tokens after a step's
    proposal, the request was given no drafts (plain decode), and it catches up by at most the
    budget a step."""
    llm = LLM(str(stories_dir), kv_cache_bytes=4_000_000, block_size=16,
              max_num_batched_tokens=BUDGET, speculative=_draft(stories_dir))  # fmt: skip
    engine, proposer = llm.engine, _proposer(llm)
    engine.add_request("long", STORY * 7, SamplingParams(max_tokens=30, temperature=0.0))
    behind_steps, drafted, last = 0, False, 0
    while engine.has_unfinished():
        engine.step()
        running = [r for r in engine.scheduler.running if r.request_id.startswith("long")]
        shadow = proposer._shadows.get(running[0].request_id) if running else None
        if shadow is None:
            continue  # (the target's own prefill, or finished)
        r = running[0]
        assert shadow.num_computed_tokens - last <= BUDGET + 4  # a chunk, or a catch-up + drafts
        last = shadow.num_computed_tokens
        if shadow.num_computed_tokens < len(r.prompt_token_ids):
            behind_steps += 1
            assert r.spec_token_ids == []
        drafted |= bool(r.spec_token_ids)
    assert behind_steps >= 4 and drafted


def test_a_prompt_larger_than_the_draft_cache_computes_no_draft_tokens(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt the draft's KV cache cannot hold (12 blocks, 192 tokens, against ~400) is never
    drafted for, and costs no draft pass: its catch-up is reserved whole. Reserved a chunk at a
    time, it was computed chunk after chunk until the cache ran out, forgotten and begun again:
    2,816 draft tokens computed for 60 output tokens, nothing proposed."""
    probe = _proposer(LLM(str(stories_dir), kv_cache_bytes=4_000_000, block_size=16,
                          max_num_batched_tokens=BUDGET, speculative=_draft(stories_dir)))  # fmt: skip
    per_block = SpeculativeConfig().draft_kv_cache_bytes // probe.blocks.num_blocks
    small = {**_draft(stories_dir), "draft_kv_cache_bytes": per_block * 12 + per_block // 2}
    llm = LLM(str(stories_dir), kv_cache_bytes=4_000_000, block_size=16,
              max_num_batched_tokens=BUDGET, speculative=small)  # fmt: skip
    proposer = _proposer(llm)
    assert proposer.blocks.num_blocks == 12
    passes: list[int] = []
    forward = proposer.runner.forward

    def counted(scheduled: list[ScheduledRequest], tables: dict[str, list[int]]) -> torch.Tensor:
        passes.append(sum(s.num_new_tokens for s in scheduled))
        return forward(scheduled, tables)

    monkeypatch.setattr(proposer.runner, "forward", counted)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    (long,), (short,) = llm.generate([STORY * 7], params), llm.generate(["Once upon a"], params)
    assert len(long.prompt_token_ids) > 12 * 16
    assert long.spec_proposed == 0
    assert short.spec_proposed > 0  # (the cache still drafts for what it can hold)
    assert sum(passes) < 12 * 16 + 60 * 5, passes  # the short request's alone
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


# ---------------------------------------------------------------------- padded vocabulary
PADDED = 576  # the target's 512 rounded up as a padded embedding would be


def _padded_copy(stories_dir: Path, out: Path, extra_tokens: bool) -> Path:
    """stories260K with its (tied) embedding padded to PADDED rows. The padding rows are made to
    win every argmax (+-50x real rows): a draft taken from them would be a padding id."""
    shutil.copytree(stories_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]  # (512, hidden)
    half = (PADDED - embed.shape[0]) // 2
    pad = torch.cat([50 * embed[:half], -50 * embed[:half]])  # (PADDED - 512, hidden)
    weights["model.embed_tokens.weight"] = torch.cat([embed, pad]).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "vocab_size": PADDED}))
    if extra_tokens:  # the padding named in the tokenizer, past the target's ids
        tok = json.loads((out / "tokenizer.json").read_text())
        unk = tok["added_tokens"][0]  # (a special token's flags)
        tok["added_tokens"] += [
            {**unk, "id": 512 + i, "content": f"<pad_{i}>"} for i in range(PADDED - 512)
        ]
        (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


@pytest.mark.parametrize("extra_tokens", [False, True])
def test_a_padded_draft_vocabulary_is_taken(
    base: LLM, stories_dir: Path, tmp_path: Path, extra_tokens: bool
) -> None:
    """The target drafting for itself through a padded copy: taken (it was refused as another
    vocabulary), greedy output the target's, and nearly every draft accepted, greedy and sampled
    (drafts from the padding rows would all be rejected, and a sampled draft's q as wide as the
    padded vocabulary failed verification)."""
    padded = _padded_copy(stories_dir, tmp_path / "padded", extra_tokens)
    llm = LLM(str(stories_dir), kv_cache_bytes=4_000_000, block_size=16,
              max_num_batched_tokens=BUDGET, speculative=_draft(padded))  # fmt: skip
    spec = llm.engine.spec
    assert spec is not None
    params = SamplingParams(max_tokens=40, temperature=0.0)
    want, got = base.generate([STORY * 2], params), llm.generate([STORY * 2], params)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert spec.proposed > 20 and spec.accepted >= 0.95 * spec.proposed
    before = (spec.proposed, spec.accepted)
    sampled = llm.generate([STORY * 2] * 4, SamplingParams(max_tokens=20, temperature=1.0))
    assert all(t < 512 for r in sampled for t in r.outputs[0].token_ids)
    proposed, accepted = spec.proposed - before[0], spec.accepted - before[1]
    assert proposed > 20 and accepted >= 0.9 * proposed  # q is p, up to rounding


def test_a_padded_draft_with_another_tokenizer_is_named_so(
    stories_dir: Path, tmp_path: Path
) -> None:
    """A padded draft whose tokenizer differs (two ids swapped) is refused for its tokenizer,
    not for its size."""
    padded = _padded_copy(stories_dir, tmp_path / "padded", extra_tokens=False)
    swap_two_token_ids(padded)
    with pytest.raises(ValueError, match=r"another vocabulary \(its tokenizer differs"):
        LLM(str(stories_dir), kv_cache_bytes=4_000_000, speculative=_draft(padded))


# ---------------------------------------------------------------------- settings' wording
def test_a_decimal_setting_is_named_with_the_type_expected(stories_dir: Path) -> None:
    """Decimal('0.5') was refused as not "a number in (0, 1]": the message names the type
    expected and the one given; an int past float's range is a ValueError naming ema (it was
    an OverflowError naming nothing)."""
    with pytest.raises(
        ValueError,
        match=r"^speculative ema must be an int or float in \(0, 1\], "
        r"got Decimal\('0\.5'\), a Decimal$",
    ):
        LLM(str(stories_dir), kv_cache_bytes=4_000_000,
            speculative={"method": "ngram", "ema": Decimal("0.5")})  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"^speculative num_tokens must be an integer, got Decimal\('4'\), a Decimal$",
    ):
        SpeculativeConfig(num_tokens=Decimal("4"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^speculative ema must be in \(0, 1\], got 1000$"):
        SpeculativeConfig(ema=1000)
    # an int past 4,300 digits, whose repr Python refuses (a ValueError naming nothing)
    with pytest.raises(ValueError, match=r"^speculative ema must be in \(0, 1\], got an "
                       r"integer of 16610 bits$"):  # fmt: skip
        SpeculativeConfig(ema=10**5000)
    with pytest.raises(ValueError, match=r"max_batch_tokens \(64\) must be at least 1 \+ "
                       r"num_tokens \(an integer of 16610 bits\)"):  # fmt: skip
        SpeculativeConfig(num_tokens=10**5000, max_batch_tokens=64)
    assert SpeculativeConfig(ema=1).ema == 1.0
