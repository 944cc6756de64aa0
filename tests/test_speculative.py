"""Speculative decoding: n-gram proposals, exact verification, KV roll-back.

Greedy output must be identical with and without speculation, n-gram and draft model (single
and batched, across block boundaries, stop strings and stop tokens hitting mid-draft, max_tokens
cutting a draft short, logprobs); under sampling, the distribution must be the target's: `verify`
against the exact distribution on a tiny vocabulary (point-mass drafts and drafts drawn from a
non-trivial q), and the engine with and without speculation over many seeds (two-sample
chi-square tests; a random-weight draft so that q != p matters). Rejected drafts' blocks go back
to the pool; a draft model's own KV blocks are all free once its requests finish.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.cli import _engine_args, engine_kwargs
from runtime.draft import DraftProposer
from runtime.kv_cache import BlockManager
from runtime.request import Request
from runtime.scheduler import Scheduler
from runtime.speculative import (
    MIN_HISTORY,
    PAUSE_STEPS,
    SpecController,
    SpeculativeConfig,
    ngram_propose,
    target_probs,
    verify,
)
from runtime.structured import StructuredOutputsParams

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big red ball under a tree and ran to get it. "
)
# sampling settings whose processed distribution `verify` must keep exactly
SAMPLING_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02),
]
SPEC = {"method": "ngram", "num_tokens": 4, "max_batch_tokens": 64}


@pytest.fixture(scope="module")
def engines(stories_dir: Path):  # type: ignore[no-untyped-def]
    base = LLM(str(stories_dir), kv_cache_bytes=4_000_000, block_size=16)
    spec = LLM(str(stories_dir), kv_cache_bytes=4_000_000, block_size=16, speculative=SPEC)
    return base, spec


def _p_value(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution."""
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


# ---------------------------------------------------------------------- the proposer
def test_ngram_proposes_what_followed_the_latest_match() -> None:
    toks = [5, 6, 7, 8, 9, 1, 5, 6, 7, 3, 4, 5, 6, 7]
    assert ngram_propose(toks, 3, 2, 4) == [3, 4, 5]  # "5 6 7" last seen at 6: then 3 4 5
    assert ngram_propose(toks, 10, 2, 4) == [3, 4, 5, 6, 7]  # capped by what follows
    assert ngram_propose([1, 2, 3, 4], 3, 2, 4) == []  # no earlier occurrence
    assert ngram_propose([1, 2, 1, 2], 2, 2, 2) == [1, 2]
    assert ngram_propose([7, 7, 7, 7], 3, 1, 3) == [7]  # overlapping match: what follows it
    assert ngram_propose([3], 2, 1, 2) == []


def test_bad_settings_fail_at_start(stories_dir: Path) -> None:
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        SpeculativeConfig(num_tokens=0)
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig(ngram_min=0)
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="below the context length"):
        LLM(str(stories_dir), kv_cache_bytes=4_000_000, max_model_len=8,
            speculative={"num_tokens": 8, "max_batch_tokens": 64})  # fmt: skip


# ---------------------------------------------------------------------- greedy: identical
PROMPTS = [STORY * 3, "Once upon a time", STORY + "Lily", "Tom and Tom and Tom and", STORY * 2]


@pytest.mark.parametrize("batched", [False, True])
def test_greedy_identical(engines, batched: bool) -> None:  # type: ignore[no-untyped-def]
    base, spec = engines
    params = SamplingParams(max_tokens=90, temperature=0.0)  # past several 16-token blocks
    before = spec.engine.spec.accepted
    groups = [PROMPTS] if batched else [[p] for p in PROMPTS]
    for prompts in groups:
        want, got = base.generate(prompts, params), spec.generate(prompts, params)
        for w, g in zip(want, got, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert g.outputs[0].text == w.outputs[0].text
    assert spec.engine.spec.accepted > before  # drafts were accepted, not just proposed
    assert spec.engine.blocks.num_free_blocks == spec.engine.blocks.num_blocks


def test_stops_and_max_tokens_mid_draft(engines) -> None:  # type: ignore[no-untyped-def]
    base, spec = engines
    ref = base.generate([STORY * 3], SamplingParams(max_tokens=60, temperature=0.0))[0]
    text, ids = ref.outputs[0].text, ref.outputs[0].token_ids
    cases = [
        SamplingParams(max_tokens=60, temperature=0.0, stop=[text[25:32]]),  # a stop string
        SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=[ids[30]]),
        SamplingParams(max_tokens=37, temperature=0.0),  # max_tokens cuts a draft
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=3),
        SamplingParams(
            max_tokens=40, temperature=0.0, stop=[text[25:32]], include_stop_str_in_output=True
        ),
    ]
    for params in cases:
        w = base.generate([STORY * 3], params)[0].outputs[0]
        g = spec.generate([STORY * 3], params)[0].outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
            w.token_ids, w.text, w.finish_reason, w.stop_reason
        )  # fmt: skip
        if params.logprobs:
            assert g.logprobs is not None and w.logprobs is not None
            for a, b in zip(g.logprobs, w.logprobs, strict=True):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert spec.engine.blocks.num_free_blocks == spec.engine.blocks.num_blocks


@pytest.mark.parametrize(
    "constraint",
    [
        {"choice": ["Once upon a time, there was a little girl named Lily."]},
        {"regex": "Once upon a time, there was a little girl named Lily\\."},
    ],
)
def test_a_constraint_completed_by_a_draft_ends_as_without_speculation(engines, constraint) -> None:  # type: ignore[no-untyped-def]
    """The story repeats, so drafts complete the constrained output; the step's bonus token
    (forced to end-of-sequence) is not output: the same tokens, logprobs and usage as without
    speculation (it came out one token longer, with one more logprob entry than tokens shown)."""
    base, spec = engines
    params = SamplingParams(temperature=0.0, max_tokens=60, logprobs=3,
                            structured_outputs=constraint)  # fmt: skip
    before = spec.engine.spec.accepted
    w = base.generate([STORY * 3], params)[0].outputs[0]
    g = spec.generate([STORY * 3], params)[0].outputs[0]
    assert spec.engine.spec.accepted > before
    assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert g.logprobs is not None and w.logprobs is not None
    assert len(g.logprobs) == len(g.token_ids)
    # the alternatives the grammar forbids are -inf in both (a verified draft's were -3.4e38)
    for a, b in zip(w.logprobs, g.logprobs, strict=True):
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in b.top] == pytest.approx([v for _, v in a.top], abs=1e-4)
    assert spec.engine.blocks.num_free_blocks == spec.engine.blocks.num_blocks


def test_ngram_drafts_stop_where_the_grammar_refuses(engines) -> None:  # type: ignore[no-untyped-def]
    """A constrained request proposes only the leading drafts its grammar allows: the rest would
    be rejected whatever the target says."""
    _, spec = engines
    eng = spec.engine
    ids = eng.tokenizer.encode(STORY * 2 + "Once upon a", add_special_tokens=False)
    drafts = ngram_propose(ids, 8, 2, 4)
    assert len(drafts) == 8
    text = eng.tokenizer.decode(ids)
    allowed = eng.tokenizer.decode(ids + drafts[:3])[len(text) :]  # (with its leading space)
    regex = re.escape(allowed) + "0123456789"  # the fourth draft (a piece of the story) refused
    grammar = eng.grammars.grammar(StructuredOutputsParams.coerce({"regex": regex}), "regex")
    params = SamplingParams(temperature=0.0)
    r = Request("g", ids, params, 16, frozenset(), grammar=grammar)
    free = Request("f", ids, params, 16, frozenset())
    spec_ctl = eng.spec
    assert spec_ctl is not None
    spec_ctl.proposer.propose([(r, 8), (free, 8)], [r, free])
    assert r.spec_token_ids == drafts[:3] and free.spec_token_ids == drafts
    assert grammar.matcher.validate_tokens(drafts[:3]) == 3  # the grammar's state is unchanged


def test_streaming_delivers_several_tokens_per_step(self_draft) -> None:  # type: ignore[no-untyped-def]
    engine = self_draft.engine  # its draft is the target itself: every draft is accepted
    engine.add_request("s", STORY * 3, SamplingParams(max_tokens=40, temperature=0.0))
    sizes = []
    while engine.has_unfinished():
        for out in engine.step():
            sizes.append(len(out.outputs[0].delta_token_ids))
    assert sum(sizes) == 40 and max(sizes) == 5  # 4 drafts and the bonus token in one step


def test_low_acceptance_pauses_drafting_then_probes() -> None:
    """A request whose drafts keep failing stops drafting for PAUSE_STEPS steps, then tries one;
    a failed probe doubles the next pause."""
    ctl = SpecController(SpeculativeConfig(num_tokens=4, ngram_min=1, ngram_max=2), 1000)
    r = Request("r", [5, 6, 7, 8] * 4, SamplingParams(temperature=0.0, max_tokens=500), 500,
                frozenset())  # fmt: skip
    r.output_token_ids = [5]
    r.num_computed_tokens = r.num_tokens - 1
    lengths = []
    for _ in range(MIN_HISTORY + PAUSE_STEPS + 1 + 2 * PAUSE_STEPS + 1):
        ctl.propose([r])
        lengths.append(len(r.spec_token_ids))
        if r.spec_token_ids:
            ctl.record(r, len(r.spec_token_ids), 0)  # every draft rejected
    assert lengths[0] == 4 and all(n >= 1 for n in lengths[:MIN_HISTORY])
    first = MIN_HISTORY + PAUSE_STEPS
    assert lengths[MIN_HISTORY:first] == [0] * PAUSE_STEPS
    assert lengths[first] == 1  # the probe after the pause: one draft; it fails
    assert lengths[first + 1 : first + 1 + 2 * PAUSE_STEPS] == [0] * (2 * PAUSE_STEPS)
    assert lengths[-1] == 1


# ---------------------------------------------------------------------- KV roll-back
def test_rejected_drafts_blocks_are_freed() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_waiting=10)
    r = Request("r", list(range(10, 17)), SamplingParams(temperature=0.0, max_tokens=20), 20,
                frozenset())  # fmt: skip
    s.add(r)
    out = s.schedule()
    s.update(out, {"r": [40]})  # prompt of 7 computed, 1 output: 8 tokens, 7 computed
    assert len(bm.block_table("r")) == 2
    r.spec_token_ids = [41, 42, 43, 44, 45, 46]
    out = s.schedule()
    assert out.scheduled[0].num_new_tokens == 7  # the last token and 6 drafts: up to 14 tokens
    assert len(bm.block_table("r")) == 4
    s.update(out, {"r": [41, 99]})  # 1 draft accepted, then the target's own token
    assert r.output_token_ids == [40, 41, 99] and r.num_computed_tokens == 9
    assert len(bm.block_table("r")) == 3  # 10 tokens: the 4th block held only rejected drafts
    assert bm.num_free_blocks == 13
    r.spec_token_ids = [1, 2, 3]
    out = s.schedule()
    s.update(out, {"r": [1, 2, 3, 4]})  # all accepted plus a bonus
    assert r.num_computed_tokens == 13 and r.num_tokens == 14


# ---------------------------------------------------------------------- sampling: exact
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=2, top_p=0.9),
    ],
    ids=["top_k", "top_p", "both"],
)
def test_target_probs_keeps_the_tokens_the_sampler_keeps(params: SamplingParams) -> None:
    """Weights 3, 2, 2, 2, 1: the sampler keeps the tokens tied with its threshold (1-3 beside
    0), and verification's target distribution must be that one (it kept 0 and 1 only)."""
    from runtime.sampler import Sampler, SamplingState

    logits = torch.log(torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0]]))
    p = target_probs(logits, params)[0]
    drawn = {
        Sampler()(
            logits, [SamplingState(params, torch.Generator().manual_seed(i), [], [])]
        ).token_ids[0]
        for i in range(300)
    }
    assert {i for i in range(5) if p[i] > 0} == drawn == {0, 1, 2, 3}


@pytest.mark.parametrize("params", SAMPLING_CASES)
def test_verify_keeps_the_target_distribution(params: SamplingParams) -> None:
    """Tiny vocabulary (6 tokens), two positions: the pair of tokens `verify` emits first has
    exactly the target's joint distribution p0(a) * p1(b | a), whatever the draft."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5  # (k+1, V)
    drafts = [2, 4]
    p = target_probs(logits, params)  # (3, V)
    gen = torch.Generator().manual_seed(1)
    n = 20000
    counts: Counter[tuple[int, int]] = Counter()
    for _ in range(n):
        out = verify(logits, drafts, params, gen)
        if out[0] != drafts[0]:
            counts[(out[0], -1)] += 1  # the second token then comes from another step
        else:
            counts[(out[0], out[1])] += 1
    expected: dict[tuple[int, int], float] = {}
    for a in range(6):
        if a != drafts[0]:
            expected[(a, -1)] = float(p[0, a]) * n
    for b in range(6):
        expected[(drafts[0], b)] = float(p[0, drafts[0]] * p[1, b]) * n
    cells = [c for c, e in expected.items() if e > 5]
    stat = sum((counts[c] - expected[c]) ** 2 / expected[c] for c in cells)
    assert _p_value(stat, len(cells) - 1) > 1e-3, (stat, len(cells))
    assert all(counts[c] == 0 for c, e in expected.items() if e == 0)


def test_sampled_engine_outputs_match_without_speculation(engines) -> None:  # type: ignore[no-untyped-def]
    """Many seeds through both engines; the 1st to 6th tokens' joint statistics agree: a
    two-sample chi-square on each position's token, top_k=4 keeping each a tiny vocabulary."""
    base, spec = engines
    prompt = STORY * 2 + "One day, she"  # drafts proposed, about half of them accepted
    n = 600
    # unseeded (a seeded request does not speculate): torch's default generator, seeded here
    params = SamplingParams(max_tokens=6, temperature=1.0, top_k=4)
    before = spec.engine.spec.proposed
    outs = {}
    for name, llm in (("base", base), ("spec", spec)):
        torch.manual_seed(0)
        outs[name] = []
        for _ in range(0, n, 4):  # batches of 4: speculation stays on (4 x 5 <= 64)
            res = llm.generate([prompt] * 4, params)
            outs[name] += [r.outputs[0].token_ids for r in res]
    assert spec.engine.spec.proposed > before + n // 2  # many draws went through verification
    for pos in range(1, 6):
        a = Counter(t[pos] for t in outs["base"])
        b = Counter(t[pos] for t in outs["spec"])
        cells = [c for c in a.keys() | b.keys() if a[c] + b[c] >= 10]
        stat = sum((a[c] - b[c]) ** 2 / (a[c] + b[c]) for c in cells)
        assert _p_value(stat, len(cells) - 1) > 1e-4, (pos, a, b)


def test_a_seeded_sample_is_the_same_whatever_the_batch(engines) -> None:  # type: ignore[no-untyped-def]
    """Whether drafts ride along depends on the step's load; a seeded request's tokens must
    not: it samples as without speculation, alone or beside 12 others (drafting off then)."""
    base, spec = engines
    prompt = STORY * 2 + "One day, she"
    seeded = SamplingParams(max_tokens=40, temperature=0.5, seed=11)
    others = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = spec.generate(prompt, seeded)[0].outputs[0].token_ids
    crowd = spec.generate([prompt] * 13, [seeded] + [others] * 12)[0].outputs[0].token_ids
    assert alone == crowd == base.generate(prompt, seeded)[0].outputs[0].token_ids


# ---------------------------------------------------------------------- the draft-model proposer
def _draft(model_dir: Path, **extra: object) -> dict[str, object]:
    return {"method": "draft", "draft_model": str(model_dir), "num_tokens": 4,
            "max_batch_tokens": 64, **extra}  # fmt: skip


@pytest.fixture(scope="module")
def self_draft(stories_dir: Path) -> LLM:
    """The target drafting for itself: every greedy draft should be accepted."""
    return LLM(str(stories_dir), kv_cache_bytes=4_000_000, block_size=16,
               speculative=_draft(stories_dir))  # fmt: skip


@pytest.fixture(scope="module")
def poor_draft(stories_dir: Path, tiny_model_dir) -> LLM:  # type: ignore[no-untyped-def]
    """A tiny random-weight Llama with the same tokenizer: q far from p."""
    return LLM(str(stories_dir), kv_cache_bytes=4_000_000, block_size=16,
               speculative=_draft(tiny_model_dir("llama")))  # fmt: skip


def _draft_blocks(llm: LLM) -> BlockManager:
    spec = llm.engine.spec
    assert spec is not None
    proposer = spec.proposer
    assert isinstance(proposer, DraftProposer)
    return proposer.blocks


def test_the_draft_is_out_of_the_targets_kv_budget(stories_dir: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Sized from a fraction of the free memory, the target's KV cache leaves out the draft
    model's weights and KV cache (it took its fraction of memory the draft then took too)."""
    from runtime.model_runner import kv_block_bytes

    monkeypatch.setattr("runtime.loader.available_memory", lambda: 200_000_000)
    kw = {"kv_cache_fraction": 0.25, "block_size": 16}
    plain = LLM(str(stories_dir), **kw)  # type: ignore[arg-type]
    llm = LLM(str(stories_dir), speculative=_draft(stories_dir), **kw)  # type: ignore[arg-type]
    proposer = llm.engine.spec.proposer if llm.engine.spec is not None else None
    assert isinstance(proposer, DraftProposer)
    weights = sum(p.nbytes for p in proposer.model.parameters())
    assert proposer.nbytes >= weights + proposer.blocks.num_blocks * 16
    block = kv_block_bytes(llm.engine.model, 16, llm.engine.kv_dtype)
    lost = (plain.engine.blocks.num_blocks - llm.engine.blocks.num_blocks) * block
    assert abs(lost - proposer.nbytes * 0.25) <= block, (lost, proposer.nbytes)


def test_draft_settings_fail_at_start(stories_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="draft_kv_cache_bytes"):
        SpeculativeConfig(method="draft", draft_model="x", draft_kv_cache_bytes=0)
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        SpeculativeConfig(method="draft", draft_model="x", num_tokens=0)
    with pytest.raises(ValueError, match="draft_model is for method 'draft'"):
        SpeculativeConfig(method="ngram", draft_model="x")
    # a config.json whose vocab_size its weights disagree with (a smaller or a larger
    # vocabulary is taken: tests/test_draft_vocab.py, tests/test_draft_defects.py)
    narrow = tmp_path / "narrow"
    shutil.copytree(stories_dir, narrow)
    cfg = json.loads((narrow / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**cfg, "vocab_size": 448}))
    with pytest.raises(ValueError, match=r"draft_model .*embed_tokens.weight' has shape "
                       r"\(512, 64\), config.json .*implies \(448, 64\)"):  # fmt: skip
        LLM(str(stories_dir), kv_cache_bytes=4_000_000, speculative=_draft(narrow))
    # same size, another tokenizer (two tokens' ids swapped)
    swapped = tmp_path / "swapped"
    shutil.copytree(stories_dir, swapped)
    swap_two_token_ids(swapped)
    with pytest.raises(ValueError, match=r"another vocabulary \(its tokenizer differs"):
        LLM(str(stories_dir), kv_cache_bytes=4_000_000, speculative=_draft(swapped))


def swap_two_token_ids(model_dir: Path) -> None:
    """Make the folder's tokenizer another one of the same size: two tokens' ids swapped."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == j) for j in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (model_dir / "tokenizer.json").write_text(json.dumps(tok))


def test_draft_cli_flags() -> None:
    p = argparse.ArgumentParser()
    _engine_args(p)
    args = p.parse_args(["--speculative", "draft", "--draft-model", "/m/draft",
                         "--num-speculative-tokens", "3"])  # fmt: skip
    spec = engine_kwargs(args)["speculative"]
    assert isinstance(spec, dict)
    assert (spec["method"], spec["draft_model"], spec["num_tokens"]) == ("draft", "/m/draft", 3)
    assert SpeculativeConfig(**spec).draft_kv_cache_bytes > 0


@pytest.mark.parametrize("batched", [False, True])
def test_draft_greedy_identical_and_accepted(engines, self_draft, batched: bool) -> None:  # type: ignore[no-untyped-def]
    base, _ = engines
    spec = self_draft.engine.spec
    params = SamplingParams(max_tokens=90, temperature=0.0)  # past several 16-token blocks
    before = (spec.proposed, spec.accepted)
    groups = [PROMPTS] if batched else [[p] for p in PROMPTS]
    for prompts in groups:
        want, got = base.generate(prompts, params), self_draft.generate(prompts, params)
        for w, g in zip(want, got, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert g.outputs[0].text == w.outputs[0].text
    proposed, accepted = spec.proposed - before[0], spec.accepted - before[1]
    assert proposed > 100 and accepted >= 0.95 * proposed  # the draft is the target
    blocks = _draft_blocks(self_draft)
    assert blocks.num_free_blocks == blocks.num_blocks
    assert self_draft.engine.blocks.num_free_blocks == self_draft.engine.blocks.num_blocks


@pytest.mark.parametrize("n", [1, 3])
def test_a_constrained_request_drafts_under_its_grammar(engines, self_draft, n: int) -> None:  # type: ignore[no-untyped-def]
    """The draft model drafts a constrained request's tokens under its grammar's mask: drafting
    for itself, every draft is the target's own pick (unmasked, its drafts were pieces of a
    story, every one rejected by the digits-only grammar). Greedy output as without speculation;
    the grammar stands where the request does after each step's drafts (the output is right)."""
    base, _ = engines
    spec = self_draft.engine.spec
    assert spec is not None
    params = SamplingParams(max_tokens=30, temperature=0.0, n=n,
                            structured_outputs={"regex": "[0-9]{12}-[a-z]{12}"})  # fmt: skip
    before = (spec.proposed, spec.accepted)
    want = base.generate([STORY], params)[0].outputs
    got = self_draft.generate([STORY], params)[0].outputs
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch("[0-9]{12}-[a-z]{12}", got[0].text), got[0].text
    proposed, accepted = spec.proposed - before[0], spec.accepted - before[1]
    assert proposed >= 8 * n and accepted == proposed
    blocks = _draft_blocks(self_draft)
    assert blocks.num_free_blocks == blocks.num_blocks


def test_poor_draft_greedy_identical(engines, poor_draft) -> None:  # type: ignore[no-untyped-def]
    base, _ = engines
    params = SamplingParams(max_tokens=60, temperature=0.0)
    before = poor_draft.engine.spec.proposed
    want, got = base.generate(PROMPTS, params), poor_draft.generate(PROMPTS, params)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert poor_draft.engine.spec.proposed > before
    blocks = _draft_blocks(poor_draft)
    assert blocks.num_free_blocks == blocks.num_blocks


def test_draft_stops_and_max_tokens_mid_draft(engines, self_draft, poor_draft) -> None:  # type: ignore[no-untyped-def]
    base, _ = engines
    ref = base.generate([STORY * 3], SamplingParams(max_tokens=60, temperature=0.0))[0]
    text, ids = ref.outputs[0].text, ref.outputs[0].token_ids
    cases = [
        SamplingParams(max_tokens=60, temperature=0.0, stop=[text[25:32]]),  # a stop string
        SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=[ids[30]]),
        SamplingParams(max_tokens=37, temperature=0.0),  # max_tokens cuts a draft
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=3),
    ]
    for llm in (self_draft, poor_draft):
        for params in cases:
            w = base.generate([STORY * 3], params)[0].outputs[0]
            g = llm.generate([STORY * 3], params)[0].outputs[0]
            assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
                w.token_ids, w.text, w.finish_reason, w.stop_reason
            )  # fmt: skip
        blocks = _draft_blocks(llm)
        assert blocks.num_free_blocks == blocks.num_blocks


def test_draft_blocks_freed_on_abort(self_draft) -> None:  # type: ignore[no-untyped-def]
    engine = self_draft.engine
    blocks = _draft_blocks(self_draft)
    engine.add_request("abort-me", STORY * 2, SamplingParams(max_tokens=80, temperature=0.0))
    for _ in range(4):
        engine.step()
    assert blocks.num_free_blocks < blocks.num_blocks  # the draft holds its KV
    engine.abort("abort-me")
    assert blocks.num_free_blocks == blocks.num_blocks


@pytest.mark.parametrize("params", SAMPLING_CASES)
def test_verify_with_draft_distribution(params: SamplingParams) -> None:
    """Drafts drawn from a non-trivial q (6 tokens, two positions): the first token is exactly
    p0; it is an accepted draft a with probability min(p0(a), q0(a)), and then the next token is
    exactly p1."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5  # (k+1, V) the target's
    q = target_probs(torch.randn(2, 6) * 1.5, params)  # (k, V) the draft's, other support
    check_verify_distribution(logits, q, params, 20000)


def check_verify_distribution(
    logits: torch.Tensor, q: torch.Tensor, params: SamplingParams, n: int
) -> tuple[Counter[tuple[int, int]], dict[tuple[int, int], float]]:
    """`verify` of two drafts drawn from `q` (2, V) against the target's `logits` (3, V), `n`
    times: the (first, second) tokens it returns (-1: no second) match, by a chi-square test,
    first = p0 (an accepted draft a with probability min(p0(a), q0(a))) and then p1; cells of
    probability 0 never occur. Returns the counts and the expected counts."""
    p = target_probs(logits, params)  # (3, V)
    vocab = logits.shape[-1]
    gen = torch.Generator().manual_seed(1)
    counts: Counter[tuple[int, int]] = Counter()
    for _ in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        out = verify(logits, drafts, params, gen, q)
        counts[(out[0], out[1] if len(out) > 1 else -1)] += 1
    expected: dict[tuple[int, int], float] = {}
    for a in range(vocab):
        kept = min(float(p[0, a]), float(q[0, a]))
        expected[(a, -1)] = (float(p[0, a]) - kept) * n
        for b in range(vocab):
            expected[(a, b)] = kept * float(p[1, b]) * n
    cells = [c for c, e in expected.items() if e > 5]
    stat = sum((counts[c] - expected[c]) ** 2 / expected[c] for c in cells)
    assert _p_value(stat, len(cells) - 1) > 1e-3, (stat, len(cells))
    assert all(counts[c] == 0 for c, e in expected.items() if e < 1e-9)
    return counts, expected


def test_sampled_outputs_match_with_a_poor_draft(engines, poor_draft) -> None:  # type: ignore[no-untyped-def]
    """As `test_sampled_engine_outputs_match_without_speculation`, drafting with a model whose
    q is far from p: the corrections (max(p - q, 0)) carry the distribution."""
    base, _ = engines
    spec = poor_draft.engine.spec
    prompt = STORY * 2 + "One day, she"
    n = 600
    params = SamplingParams(max_tokens=6, temperature=1.0, top_k=4)  # unseeded, as there
    before = (spec.proposed, spec.accepted)
    outs = {}
    for name, llm in (("base", base), ("draft", poor_draft)):
        torch.manual_seed(0)
        outs[name] = []
        for _ in range(0, n, 4):
            res = llm.generate([prompt] * 4, params)
            outs[name] += [r.outputs[0].token_ids for r in res]
    proposed, accepted = spec.proposed - before[0], spec.accepted - before[1]
    assert proposed > n and 0 < accepted < proposed  # drafts verified, some rejected
    for pos in range(1, 6):
        a = Counter(t[pos] for t in outs["base"])
        b = Counter(t[pos] for t in outs["draft"])
        cells = [c for c in a.keys() | b.keys() if a[c] + b[c] >= 10]
        stat = sum((a[c] - b[c]) ** 2 / (a[c] + b[c]) for c in cells)
        assert _p_value(stat, len(cells) - 1) > 1e-4, (pos, a, b)
    blocks = _draft_blocks(poor_draft)
    assert blocks.num_free_blocks == blocks.num_blocks


def test_a_draft_model_s_layers_count_as_the_engine_s_progress(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stall detector (AsyncLLM.stalled_s) counts the draft model's layers too: a draft
    catching up on a long prompt (one forward, before any of the target's layers) is progress.
    Counting the target's alone, layers 8x under the limit added up to a "stalled" engine."""
    import asyncio
    import time

    from runtime import async_engine
    from runtime.async_engine import AsyncLLM
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.model.llama import DecoderLayer

    monkeypatch.setattr(async_engine, "ENGINE_STALL_S", 0.5)
    spec = {"method": "draft", "draft_model": str(stories_dir), "num_tokens": 4,
            "max_batch_tokens": 64}  # fmt: skip
    engine = LLMEngine(EngineConfig(str(stories_dir), block_size=16, kv_cache_bytes=4_000_000,
                                    num_threads=1, max_num_batched_tokens=64, speculative=spec))  # fmt: skip
    layer = DecoderLayer.forward

    def slow(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.06)  # every layer, the target's and the draft's
        return layer(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "forward", slow)
    llm = AsyncLLM(engine)

    async def main() -> tuple[float, int]:
        stream = llm.submit("Once upon a time " * 40,
                            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))  # fmt: skip
        worst, stalled = 0.0, 0

        async def poll() -> None:
            nonlocal worst, stalled
            while True:
                worst = max(worst, llm.stalled_s())
                stalled += llm.is_stalled()
                await asyncio.sleep(0.02)

        polling = asyncio.ensure_future(poll())
        async for _ in stream:
            pass
        polling.cancel()
        return worst, stalled

    try:
        worst, stalled = asyncio.run(main())
    finally:
        llm.shutdown()
    assert engine.spec is not None and engine.spec.proposer.model.layers_run > 0  # type: ignore[attr-defined]
    assert stalled == 0 and worst < 0.5, worst


def test_verified_logprobs_list_a_tied_pick_first_as_the_sampler_does() -> None:
    """A draft accepted where two tokens tie lists first among equals, as plain decoding lists
    its pick (ties are common in bfloat16 logits): a request's logprobs are the same with and
    without speculation (topk's own order put the other one first)."""
    from runtime.speculative import logprobs_of

    logits = torch.full((1, 64), -4.0)
    logits[0, 5] = logits[0, 40] = 3.0
    logits[0, 7] = 1.0
    listed_first = int(torch.topk(torch.log_softmax(logits, -1), 3).indices[0, 0])
    other = 40 if listed_first == 5 else 5
    (lp,) = logprobs_of(logits, [other], 3)
    assert [t for t, _ in lp.top] == [other, listed_first, 7]


@pytest.mark.parametrize("temperature", [1e38, 1e39])
def test_verify_keeps_to_the_grammar_at_a_huge_temperature(temperature: float) -> None:
    """The grammar's mask is a -max bias: over a temperature of 1e38 it was about -3.4, near the
    allowed tokens, and over 1e39 (inf in float32) 0 like them, so verification drew tokens the
    grammar refuses (~40% of draws; 0c96d4c fixed the plain sampler's draw, not this one)."""
    import numpy as np

    from runtime.sampler import apply_token_bitmask

    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    mask = np.zeros((3, vocab // 32), dtype=np.int32)
    mask[:, 0] = 0b1111  # tokens 0-3 only
    masked = apply_token_bitmask(logits, mask)
    params = SamplingParams(temperature=temperature)
    probs = target_probs(masked, params)
    assert float(probs[:, 4:].abs().sum()) == 0.0
    assert torch.allclose(probs.sum(dim=-1), torch.ones(3))
    gen = torch.Generator().manual_seed(1)
    drawn = {t for _ in range(300) for t in verify(masked, [1, 2], params, gen)}
    assert drawn <= {0, 1, 2, 3}


def test_min_tokens_is_kept_with_speculation(engines) -> None:  # type: ignore[no-untyped-def]
    """A request short of its min_tokens is not speculated: verification (greedy: the argmax of
    the unmasked logits) would accept or emit the stop token the sampler holds back, and the
    request end early. Output identical to the engine without speculation."""
    base, spec = engines
    ref = base.generate([STORY * 3], SamplingParams(max_tokens=60, temperature=0.0))[0]
    ids = ref.outputs[0].token_ids
    before = spec.engine.spec.proposed
    for stop in (ids[16], ids[19]):  # (tokens the drafts or the target reach for before 20)
        params = SamplingParams(max_tokens=60, temperature=0.0, min_tokens=20,
                                stop_token_ids=[stop])  # fmt: skip
        w = base.generate([STORY * 3], params)[0].outputs[0]
        g = spec.generate([STORY * 3], params)[0].outputs[0]
        assert stop not in w.token_ids[:20] and len(w.token_ids) > 20
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert spec.engine.spec.proposed > before  # drafts after min_tokens were verified
    assert spec.engine.blocks.num_free_blocks == spec.engine.blocks.num_blocks
