"""A draft model whose vocabulary is narrower than the target's (Qwen2.5-0.5B's 151,936 rows
drafting for Qwen2.5-7B's 152,064, the same tokenizer): it was refused ("a smaller
vocabulary"); it is taken when the tokenizers agree on every id the draft has.

The pair here: a tiny random Llama (`tiny_model_dir`, 512 rows, stories260K's tokenizer) is the
draft, and the target is the same model widened to 576 rows, ids its tokenizer does not name (as
Qwen's padding). The widened rows copy 64 real tokens' rows, a little larger, so the target
emits those ids wherever it would have emitted the real ones: the target makes ids the draft
cannot embed, and its distribution puts mass where the draft's q has none. Greedy output is the
target's alone token for token (prompts of text and of ids past the draft's vocabulary);
sampled output has its distribution (two-sample chi-square, as tests/test_speculative.py); the
draft reads an id past its vocabulary as `STAND_IN`; a sampled draft's q spans the target's
width, zero past the draft's, and `verify` keeps p exactly with such a q; a tokenizer differing
on a shared id is still refused; no draft or target KV block is left held.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import LLM, SamplingParams
from runtime.draft import STAND_IN, DraftProposer
from runtime.request import Request
from runtime.speculative import target_probs
from tests.test_speculative import _draft, _p_value, check_verify_distribution, swap_two_token_ids

DRAFT_VOCAB = 512  # the draft's rows, and every id stories260K's tokenizer names
TARGET_VOCAB = 576  # the target's: 64 more, named by no token
STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big red ball under a tree and ran to get it. "
)


def _widened(draft_dir: Path, out: Path) -> Path:
    """`draft_dir`'s model with TARGET_VOCAB rows: row 512 + j is 1.05 x the row of a real token
    (every 8th), in the embedding and the output layer, so the target emits id 512 + j where
    the draft picks the real one."""
    shutil.copytree(draft_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    like = torch.arange(0, DRAFT_VOCAB, DRAFT_VOCAB // (TARGET_VOCAB - DRAFT_VOCAB))  # (64,)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[name]  # (512, hidden)
        weights[name] = torch.cat([w, 1.05 * w[like]]).contiguous()  # (576, hidden)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "vocab_size": TARGET_VOCAB}))
    return out


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    """(draft, target) folders."""
    draft = tiny_model_dir("llama")
    return draft, _widened(draft, tmp_path_factory.mktemp("wide") / "target")


def _llm(target: Path, draft: Path | None = None) -> LLM:
    spec = None if draft is None else _draft(draft)
    return LLM(str(target), kv_cache_bytes=4_000_000, block_size=16, speculative=spec)


@pytest.fixture(scope="module")
def engines(pair: tuple[Path, Path]) -> tuple[LLM, LLM]:
    """(the target alone, the target drafted for by the narrower model)."""
    draft, target = pair
    return _llm(target), _llm(target, draft)


def _proposer(llm: LLM) -> DraftProposer:
    spec = llm.engine.spec
    assert spec is not None and isinstance(spec.proposer, DraftProposer)
    return spec.proposer


def _no_block_held(llm: LLM) -> None:
    draft_blocks, blocks = _proposer(llm).blocks, llm.engine.blocks
    assert draft_blocks.num_free_blocks == draft_blocks.num_blocks
    assert blocks.num_free_blocks == blocks.num_blocks


# prompts as ids: padding ids (past the draft's vocabulary) at the start, inside and at the end
ID_PROMPTS = [
    [1, 540, 37, 48, 575, 99, 512, 201],
    [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 560],
]


def test_greedy_output_is_the_target_s(engines: tuple[LLM, LLM]) -> None:
    """Text prompts and prompts of ids past the draft's vocabulary, batched: the target's greedy
    output token for token, ids past the draft's vocabulary among it; drafts made and most
    accepted (the draft is the target but for the widened rows)."""
    base, spec = engines
    ctl = spec.engine.spec
    assert ctl is not None
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompts: list[str | list[int]] = [STORY, "Once upon a time", *ID_PROMPTS]
    want, got = base.generate(prompts, params), spec.generate(prompts, params)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    wide = sum(t >= DRAFT_VOCAB for w in want for t in w.outputs[0].token_ids)
    assert wide >= 5  # the target emits ids the draft has no row for
    assert ctl.proposed > 50 and ctl.accepted >= 0.3 * ctl.proposed
    _no_block_held(spec)


def test_the_draft_reads_an_id_past_its_vocabulary_as_a_stand_in(
    engines: tuple[LLM, LLM],
) -> None:
    """Step by step, a prompt of ids past the draft's vocabulary: the draft's own context holds
    STAND_IN where the request holds such an id (an embedding lookup past its rows failed the
    step, and every request in it), its other ids as the request's; it drafts, and its drafts
    are ids it has."""
    _, spec = engines
    engine, proposer = spec.engine, _proposer(spec)
    engine.add_request("ids", ID_PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0))
    checked = drafted = 0
    while engine.has_unfinished():
        engine.step()
        running = [r for r in engine.scheduler.running if r.request_id.startswith("ids")]
        shadow = proposer._shadows.get(running[0].request_id) if running else None
        if shadow is None:
            continue
        r = running[0]
        # the tokens the draft was given this step (the request's then), before its drafts
        mine = shadow.prompt_token_ids[: proposer._base[r.request_id]]
        assert mine == [STAND_IN if t >= DRAFT_VOCAB else t for t in r.all_token_ids[: len(mine)]]
        assert all(t < DRAFT_VOCAB for t in shadow.prompt_token_ids)
        assert all(t < DRAFT_VOCAB for t in r.spec_token_ids)
        checked += 1
        drafted += bool(r.spec_token_ids)
    assert checked >= 5 and drafted >= 3
    _no_block_held(spec)


def test_a_sampled_draft_s_q_spans_the_target_s_width(
    engines: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The q each sampled draft rides with to verification is (k, 576): a distribution, zero on
    every id past the draft's vocabulary (it was the draft's 512 wide, against the target's
    576, or refused before that)."""
    _, spec = engines
    proposer = _proposer(spec)
    seen: list[torch.Tensor] = []
    propose = proposer.propose

    def kept(
        batch: list[tuple[Request, int]],
        running: list[Request],
        prefilling: Sequence[tuple[Request, int]] = (),
    ) -> None:
        propose(batch, running, prefilling)
        seen.extend(r.spec_draft_probs for r, _ in batch if r.spec_draft_probs is not None)

    monkeypatch.setattr(proposer, "propose", kept)
    spec.generate([STORY] * 2, SamplingParams(max_tokens=20, temperature=1.0))
    assert seen
    for q in seen:
        assert q.shape[1] == TARGET_VOCAB
        assert bool((q[:, DRAFT_VOCAB:] == 0).all())
        assert torch.allclose(q.sum(dim=1), torch.ones(q.shape[0]))
    _no_block_held(spec)


def test_sampled_output_has_the_target_s_distribution(engines: tuple[LLM, LLM]) -> None:
    """Many draws through both engines (unseeded, torch's generator seeded alike, as
    tests/test_speculative.py): each of the 2nd to 6th tokens' distribution agrees (two-sample
    chi-square, top_k=4 keeping it small). The target's mass on ids the draft has none for comes
    from the correction (max(p - q, 0)): such ids appear in both."""
    base, spec = engines
    ctl = spec.engine.spec
    assert ctl is not None
    prompt = STORY + "One day, she"
    n = 600
    # a flat distribution (temperature 3): the widened ids hold much of it (the ids the draft
    # has no row for kept out of the correction left p 10^-9 away at the 2nd token)
    params = SamplingParams(max_tokens=6, temperature=3.0, top_k=4)
    before = (ctl.proposed, ctl.accepted)
    outs: dict[str, list[list[int]]] = {}
    for name, llm in (("base", base), ("spec", spec)):
        torch.manual_seed(0)
        outs[name] = []
        for _ in range(0, n, 12):  # batches of 12: speculation stays on (12 x 5 <= 64)
            outs[name] += [r.outputs[0].token_ids for r in llm.generate([prompt] * 12, params)]
    proposed, accepted = ctl.proposed - before[0], ctl.accepted - before[1]
    assert proposed > n and 0 < accepted < proposed
    for name in outs:
        assert any(t >= DRAFT_VOCAB for o in outs[name] for t in o[1:]), name
    for pos in range(1, 6):
        a = Counter(t[pos] for t in outs["base"])
        b = Counter(t[pos] for t in outs["spec"])
        cells = [c for c in a.keys() | b.keys() if a[c] + b[c] >= 10]
        stat = sum((a[c] - b[c]) ** 2 / (a[c] + b[c]) for c in cells)
        assert _p_value(stat, len(cells) - 1) > 1e-4, (pos, a, b)
    _no_block_held(spec)


def test_verify_keeps_p_with_a_q_zero_past_the_draft_s_vocabulary() -> None:
    """`verify` with a q as a narrower draft gives it (6-token target, 4-token draft: q's last 2
    ids 0), exactly as tests/test_speculative.py's `test_verify_with_draft_distribution`: the
    first token is p0 (ids 4 and 5, which no draft can be, from the correction alone), an
    accepted draft a with probability min(p0(a), q0(a)), and then the next token is p1."""
    params = SamplingParams(temperature=1.0)  # (every id of p positive)
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5  # (k+1, V) the target's
    q = torch.zeros(2, 6)  # (k, V) the draft's, over the target's width
    q[:, :4] = target_probs(torch.randn(2, 4) * 1.5, params)
    counts, expected = check_verify_distribution(logits, q, params, 10000)
    assert sum(counts[(a, -1)] for a in (4, 5)) > 0.5 * sum(expected[(a, -1)] for a in (4, 5))


def test_a_constrained_request_drafts_within_the_draft_s_vocabulary(
    engines: tuple[LLM, LLM],
) -> None:
    """A grammar's mask over the widened draft logits (the target's width): greedy output as
    without speculation, and it matches the grammar."""
    base, spec = engines
    ctl = spec.engine.spec
    assert ctl is not None
    params = SamplingParams(max_tokens=30, temperature=0.0,
                            structured_outputs={"regex": "[0-9]{12}-[a-z]{12}"})  # fmt: skip
    before = ctl.proposed
    want = base.generate([STORY], params)[0].outputs[0]
    got = spec.generate([STORY], params)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert re.fullmatch("[0-9]{12}-[a-z]{12}", got.text), got.text
    assert ctl.proposed > before
    _no_block_held(spec)


def test_a_target_naming_tokens_past_the_draft_s_vocabulary_is_taken(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """The target's tokenizer names its widened ids (tokens the draft's lacks, past its
    vocabulary): taken, greedy output the target's."""
    draft, target = pair
    named = tmp_path / "named"
    shutil.copytree(target, named)
    tok = json.loads((named / "tokenizer.json").read_text())
    unk = tok["added_tokens"][0]  # (a special token's flags)
    tok["added_tokens"] += [
        {**unk, "id": i, "content": f"<extra_{i}>"} for i in range(DRAFT_VOCAB, TARGET_VOCAB)
    ]
    (named / "tokenizer.json").write_text(json.dumps(tok))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    spec = _llm(named, draft)
    want = _llm(named).generate(ID_PROMPTS, params)
    got = spec.generate(ID_PROMPTS, params)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    _no_block_held(spec)


def test_a_narrower_draft_with_another_tokenizer_is_refused(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """Two ids swapped in the narrower draft's tokenizer, or a token the target names inside
    the draft's vocabulary missing from it: refused as another vocabulary, naming the id."""
    draft, target = pair
    swapped = tmp_path / "swapped"
    shutil.copytree(draft, swapped)
    swap_two_token_ids(swapped)
    with pytest.raises(ValueError, match=r"another vocabulary \(its tokenizer differs from the "
                       r"target's: id 300 is "):  # fmt: skip
        _llm(target, swapped)
    short = tmp_path / "short"
    shutil.copytree(draft, short)
    tok = json.loads((short / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] != 2]
    del tok["model"]["vocab"]["</s>"]  # (id 2: no token left there)
    (short / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"another vocabulary .*id 2 is None in the draft, "
                       r"'</s>' in the target"):  # fmt: skip
        _llm(target, short)
