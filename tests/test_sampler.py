"""Sampler: every transform checked against a plain-Python reference of vLLM's semantics, the
draw checked by frequencies over many rows (fixed seeds, so the bounds cannot flake), and seeded
rows checked to be independent of what else is in the batch."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

import runtime.sampler as sampler_mod
from runtime.sampler import Sampler, SamplingState, apply_penalties
from runtime.sampling_params import MAX_REPETITION_PENALTY, InvalidRequestError, SamplingParams

sample = Sampler()


def state(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
    **params: Any,
) -> SamplingState:
    p = SamplingParams(seed=seed, **params)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingState(p, gen, list(prompt or []), list(output or []))


# ----- plain-Python reference --------------------------------------------------------------


def ref_penalized(logits: list[float], s: SamplingState) -> list[float]:
    p = s.params
    x = list(logits)
    for t in set(s.prompt_token_ids) | set(s.output_token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(s.output_token_ids).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def ref_distribution(logits: list[float], s: SamplingState) -> list[float]:
    """The distribution a non-greedy row is drawn from: penalties, temperature, min_p, top_k,
    top_p (smallest set of most likely tokens reaching top_p), each renormalizing."""
    p = s.params
    x = [v / p.temperature for v in ref_penalized(logits, s)]
    m = max(x)
    probs = [math.exp(v - m) for v in x]
    probs = [v / sum(probs) for v in probs]
    if p.min_p > 0:
        cut = p.min_p * max(probs)
        probs = [v if v >= cut else 0.0 for v in probs]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if 0 < p.top_k < len(probs):
        for i in order[p.top_k :]:
            probs[i] = 0.0
    total = sum(probs)
    probs = [v / total for v in probs]
    if p.top_p < 1:
        kept, before = set(), 0.0
        for i in order:  # most likely first
            if before < p.top_p:
                kept.add(i)
            before += probs[i]
        probs = [v if i in kept else 0.0 for i, v in enumerate(probs)]
        total = sum(probs)
        probs = [v / total for v in probs]
    return probs


def draw_many(logits: torch.Tensor, s: SamplingState, n: int) -> Counter[int]:
    """n draws of one row, as one batch of n identical unseeded rows."""
    assert s.generator is None
    torch.manual_seed(1234)
    out = sample(logits.expand(n, -1).contiguous(), [s] * n)
    return Counter(out.token_ids)


def assert_follows(counts: Counter[int], probs: list[float]) -> None:
    """Same support, and Pearson's chi-square far below anything a correct sampler reaches:
    mean k-1, bound k-1 + 12 standard deviations + 10 (draws are seeded, so this is fixed)."""
    n = sum(counts.values())
    support = {i for i, p in enumerate(probs) if p > 0}
    assert set(counts) <= support, f"drew tokens outside the support: {set(counts) - support}"
    assert {i for i in support if probs[i] * n >= 20} <= set(counts)
    chi2 = sum((counts[i] - n * probs[i]) ** 2 / (n * probs[i]) for i in support)
    k = len(support)
    assert chi2 < (k - 1) + 12 * math.sqrt(2 * max(k - 1, 1)) + 10, chi2


def logits_row(vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, vocab, generator=g) * scale


# ----- greedy ------------------------------------------------------------------------------


def test_all_greedy_is_one_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the greedy fast path must not reach this")

    monkeypatch.setattr(sampler_mod, "apply_penalties", forbidden)
    monkeypatch.setattr(sampler_mod, "_sample_rows", forbidden)
    monkeypatch.setattr(sampler_mod, "_logprobs", forbidden)
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [state(temperature=0.0, output=[1, 2, 3]) for _ in range(64)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 64


def test_greedy_rows_in_a_mixed_batch_take_the_argmax() -> None:
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1))
    states = [
        state(temperature=0.0) if i % 2 else state(temperature=1.0, top_k=5) for i in range(8)
    ]
    out = sample(logits, states)
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in range(1, 8, 2)] == argmax[1::2]


def test_tiny_temperature_counts_as_greedy() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2)) * 30
    out = sample(logits, [state(temperature=1e-7) for _ in range(4)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    states = [
        state(prompt=[1, 2], output=[3, 3], repetition_penalty=1.5, frequency_penalty=1.0),
        state(temperature=0.7, top_p=0.8, min_p=0.1),
        state(temperature=0.0, logprobs=3),
    ]
    sample(logits, states)
    assert torch.equal(logits, before)


# ----- penalties ---------------------------------------------------------------------------


def test_penalties_by_hand() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    s = state(
        prompt=[0, 1],
        output=[2, 2, 3],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    got = apply_penalties(logits, [s])[0].tolist()
    # token 0: prompt, positive -> 2 / 2 = 1
    # token 1: prompt, negative -> -2 * 2 = -4
    # token 2: output twice -> 1 / 2 - 0.5 * 2 - 0.25 = -0.75
    # token 3: output once, negative -> -1 * 2 - 0.5 - 0.25 = -2.75
    # token 4: unseen -> 0.5
    assert got == [1.0, -4.0, -0.75, -2.75, 0.5]


def test_penalties_match_reference_on_a_batch() -> None:
    gen = torch.Generator().manual_seed(4)
    vocab = 97
    logits = torch.randn(6, vocab, generator=gen) * 3
    states = []
    for i in range(6):
        prompt = torch.randint(0, vocab, (i * 7,), generator=gen).tolist()
        output = torch.randint(0, vocab, (i * 5 + (i % 2),), generator=gen).tolist()
        states.append(
            state(
                prompt=prompt,
                output=output,
                repetition_penalty=[1.0, 1.3, 0.8, 1.0, 2.0, 1.1][i],
                frequency_penalty=[0.0, 0.5, -0.3, 1.0, 0.0, 2.0][i],
                presence_penalty=[0.0, 0.0, 0.7, -1.0, 0.2, 0.1][i],
            )
        )
    got = apply_penalties(logits, states)
    for i, s in enumerate(states):
        want = ref_penalized(logits[i].tolist(), s)
        assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_greedy_with_penalties_takes_argmax_of_penalized_logits() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0], [5.0, 4.0, 3.0]])
    states = [
        state(temperature=0.0, output=[0], frequency_penalty=2.0),  # 5 - 2 = 3 < 4
        state(temperature=0.0, prompt=[0, 1], repetition_penalty=2.0),  # 2.5, 2, 3
    ]
    assert sample(logits, states).token_ids == [1, 2]


@pytest.mark.parametrize("penalty", [1e-38, 1e-45, MAX_REPETITION_PENALTY])
@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.5, "top_p": 0.5},
        {"top_k": 1},
        {"temperature": 0.0},
        {"temperature": 1.0, "logprobs": 5},
    ],
    ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()),
)
def test_extreme_repetition_penalties_stay_finite(penalty: float, params: dict[str, Any]) -> None:
    """A penalty near 0 divides positive logits of seen tokens into float32 overflow (and a huge
    one multiplies negative ones): the penalized logits stay finite, the draw stays in the
    vocabulary, and the other rows of the batch are untouched (a NaN row once failed the whole
    engine step, every request in it)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 512, generator=gen) * 4
    seen = [3, 7, 11, 300]
    states = [state(prompt=seen, output=[7], repetition_penalty=penalty, seed=1, **params),
              state(temperature=0.0), state(seed=2)]  # fmt: skip
    penalized = apply_penalties(logits, states)
    assert bool(torch.isfinite(penalized).all())
    out = sample(logits, states)
    assert all(0 <= t < 512 for t in out.token_ids)
    assert out.token_ids[1] == int(logits[1].argmax())
    if penalty < 1:  # seen tokens with a positive logit now lead by far
        positive = [t for t in seen if logits[0, t] > 0]
        if params.get("temperature") == 0.0 or params.get("top_k") == 1:
            assert out.token_ids[0] in positive
    if params.get("logprobs"):
        lp = out.logprobs[0]
        assert lp is not None and not math.isnan(lp.logprob)
        assert all(0 <= t < 512 and not math.isnan(x) for t, x in lp.top)


# ----- truncation and the draw: distributions ----------------------------------------------


CASES: list[dict[str, Any]] = [
    {"temperature": 1.0},
    {"temperature": 0.5},
    {"temperature": 1.7},
    {"top_k": 5},
    {"top_k": 1},
    {"top_p": 0.6},
    {"top_p": 0.95, "temperature": 0.8},
    {"min_p": 0.2},
    {"min_p": 0.05, "top_k": 8, "top_p": 0.9, "temperature": 1.3},
    {"top_k": 6, "top_p": 0.999},
    {"repetition_penalty": 1.5, "presence_penalty": 0.5, "top_p": 0.9},
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_draws_follow_the_reference_distribution(params: dict[str, Any]) -> None:
    logits = logits_row(24, seed=5)
    s = state(prompt=[0, 1, 2], output=[3, 3, 4], **params)
    probs = ref_distribution(logits[0].tolist(), s)
    n = 4000 if s.prompt_token_ids and "repetition_penalty" in params else 10_000
    assert_follows(draw_many(logits, s, n), probs)


def test_wide_nucleus_falls_back_to_a_full_sort() -> None:
    """top_p alone over a flat distribution: the nucleus is wider than the first candidates."""
    vocab = 1000
    logits = logits_row(vocab, seed=6, scale=0.3)
    s = state(top_p=0.5)
    probs = ref_distribution(logits[0].tolist(), s)
    support = sum(p > 0 for p in probs)
    assert support > sampler_mod._NUCLEUS_CANDIDATES
    counts = draw_many(logits, s, 1000)
    assert set(counts) <= {i for i, p in enumerate(probs) if p > 0}
    assert len(counts) > sampler_mod._NUCLEUS_CANDIDATES


@pytest.mark.parametrize("top_p", [0.3, 0.97])
def test_wide_nucleus_widens_its_candidates_in_steps(top_p: float) -> None:
    """A nucleus past the first 256 candidates of a 5,000-token row: drawn again over 2,048
    (top_p 0.3: ~900 tokens), then the whole row (0.97), within the reference's support."""
    vocab = 5000
    logits = logits_row(vocab, seed=11, scale=0.5)
    s = state(top_p=top_p)
    probs = ref_distribution(logits[0].tolist(), s)
    support = {i for i, p in enumerate(probs) if p > 0}
    assert len(support) > sampler_mod._NUCLEUS_CANDIDATES
    assert (len(support) < 8 * sampler_mod._NUCLEUS_CANDIDATES) == (top_p == 0.3)
    counts = draw_many(logits, s, 2000)
    assert set(counts) <= support and len(counts) > sampler_mod._NUCLEUS_CANDIDATES


def test_top_k_and_top_p_supports_match_reference_on_a_batch() -> None:
    """Rows with different top_k / top_p in one batch: each row stays in its own support."""
    vocab = 400
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(8, vocab, generator=gen) * 4
    settings: list[dict[str, Any]] = [
        {"top_k": 3},
        {"top_k": 50, "top_p": 0.5},
        {"top_p": 0.3},
        {"top_p": 0.97},  # wide: needs the full sort
        {},
        {"min_p": 0.3},
        {"top_k": 399},
        {"top_k": 400, "top_p": 0.2},  # top_k == vocab is "off"
    ]
    states = [state(**p) for p in settings]
    torch.manual_seed(0)
    reps = 300
    out = sample(logits.repeat(reps, 1), states * reps).token_ids
    for i, s in enumerate(states):
        probs = ref_distribution(logits[i].tolist(), s)
        support = {t for t, p in enumerate(probs) if p > 0}
        drawn = set(out[i::8])
        assert drawn <= support, settings[i]
        if len(support) <= 5:
            assert drawn == support


def test_zero_probability_tokens_are_never_drawn() -> None:
    logits = torch.full((1, 1000), -math.inf)
    logits[0, 17] = 0.0
    logits[0, 999] = -1.0
    for params in ({}, {"top_p": 0.5}, {"top_k": 10}, {"min_p": 0.01}):
        counts = draw_many(logits, state(**params), 500)
        assert set(counts) <= {17, 999}


# ----- seeds -------------------------------------------------------------------------------


SEEDED_MODES: list[dict[str, Any]] = [
    {"temperature": 0.9},
    {"top_k": 20},
    {"top_p": 0.8},
    {"top_p": 0.999},  # full-sort fallback
    {"min_p": 0.05, "top_k": 40, "top_p": 0.9},
]


def run_steps(logits: torch.Tensor, rows: list[SamplingState], steps: int) -> list[list[int]]:
    """Sample `steps` times; returns per-row token lists (logits fixed, outputs appended)."""
    tokens: list[list[int]] = [[] for _ in rows]
    for _ in range(steps):
        out = sample(logits, rows)
        for j, t in enumerate(out.token_ids):
            tokens[j].append(t)
            rows[j].output_token_ids.append(t)
    return tokens


@pytest.mark.parametrize("mode", SEEDED_MODES, ids=lambda p: ",".join(p))
def test_same_seed_same_tokens_in_any_batch(mode: dict[str, Any]) -> None:
    vocab = 2000
    row = logits_row(vocab, seed=8, scale=1.0)
    alone = run_steps(row, [state(seed=42, **mode)], steps=6)[0]

    # The same request in a batch of others (seeded and not, other settings), at position 3.
    others = [
        state(temperature=0.0),
        state(seed=7, top_k=500),
        state(top_p=0.5),
        None,
        state(temperature=1.5, min_p=0.1),
        state(seed=43, **mode),
    ]
    rows = [s if s is not None else state(seed=42, **mode) for s in others]
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(len(rows), vocab, generator=gen)
    logits[3] = row[0]
    torch.manual_seed(99)
    batched = run_steps(logits, rows, steps=6)
    assert batched[3] == alone
    assert batched[5] != alone  # another seed, another sequence


@pytest.mark.parametrize("mode", [{"top_p": 0.9}, {"top_k": 50}, {"top_k": 300, "top_p": 0.8}])
def test_same_seed_same_tokens_beside_any_batch_when_logits_tie(mode: dict[str, Any]) -> None:
    """bfloat16 logits tie often: a seeded row's tokens do not depend on its neighbours' top_k
    (which set the candidates' width, and torch's topk orders ties differently at each width)."""
    vocab = 2000
    row = (logits_row(vocab, seed=3, scale=1.5)).bfloat16().float()  # many exact ties
    assert row.unique().numel() < vocab // 2
    for seed in range(40):
        alone = sample(row, [state(seed=seed, **mode)]).token_ids[0]
        batch = torch.cat([row, logits_row(vocab, seed=5)])
        beside = sample(batch, [state(seed=seed, **mode), state(seed=1, top_k=400)]).token_ids[0]
        assert beside == alone, seed


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("mode", [{"top_k": 5}, {"top_p": 0.9}, {"top_k": 5, "top_p": 0.9}])
def test_a_non_finite_row_draws_a_token_of_the_vocabulary(bad: float, mode: dict[str, Any]) -> None:
    """A NaN or +inf logit makes its row's softmax NaN: the truncated draw still gives a token id
    of the vocabulary (it gave `vocab`, past the embedding), and the other row is untouched."""
    vocab = 1000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(4))
    logits[0, 3] = bad
    out = sample(logits, [state(seed=1, **mode), state(seed=2, **mode)])
    assert all(0 <= t < vocab for t in out.token_ids)
    assert out.token_ids[1] == sample(logits[1:], [state(seed=2, **mode)]).token_ids[0]


def test_top_p_on_a_cumulative_mass_draws_the_same_beside_a_wider_top_k() -> None:
    """top_p set to exactly a token's mass-before under top_k, as the candidates' mass rounds
    when summed at the row's own width or at a wider batch's: the cut falls in the same place
    whatever the batch's widest top_k (the mass was a sum() whose grouping, and so rounding,
    changed with the width: such rows drew otherwise for up to 85 of 200 seeds)."""
    vocab, k = 49152, 284
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(2)) * 2
    w = torch.softmax(logits, dim=-1)
    wide = torch.cat([logits, logits])
    befores = []
    for width in (k, 4096):
        cand = torch.topk(w, width, dim=-1).values
        cand[:, k:] = 0
        probs = cand / cand.sum(dim=-1, keepdim=True)
        befores.append((probs.cumsum(dim=-1) - probs)[0, :k])
    differ = (befores[0] != befores[1]).nonzero().squeeze(1).tolist()
    assert differ  # this row's masses do round differently at the two widths
    for i in differ[:8]:
        for top_p in {float(befores[0][i]), float(befores[1][i])}:
            for seed in range(20):
                alone = sample(logits, [state(seed=seed, top_k=k, top_p=top_p)]).token_ids[0]
                beside = sample(wide, [state(seed=seed, top_k=k, top_p=top_p),
                                       state(seed=9, top_k=4096)]).token_ids[0]  # fmt: skip
                assert alone == beside, (i, top_p, seed)


def test_tokens_tied_with_the_top_k_threshold_all_stay() -> None:
    """top_k keeps every token whose weight reaches the k-th largest (vLLM's rule): with weights
    3, 2, 2, 2, 1 and top_k 2, tokens 1-3 are drawn, never token 4."""
    logits = torch.log(torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0]]))
    drawn = {sample(logits, [state(seed=s, top_k=2)]).token_ids[0] for s in range(200)}
    assert drawn == {0, 1, 2, 3}


def test_unseeded_rows_differ() -> None:
    row = logits_row(5000, seed=10, scale=0.5)
    torch.manual_seed(0)
    out = sample(row.expand(16, -1).contiguous(), [state() for _ in range(16)])
    assert len(set(out.token_ids)) > 8


# ----- logprobs ----------------------------------------------------------------------------


def test_logprobs_are_of_penalized_logits_before_temperature() -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 64, generator=gen) * 3
    states = [
        state(temperature=0.0, logprobs=5),
        state(temperature=0.5, top_k=3, logprobs=2, output=[1, 1], frequency_penalty=1.0),
        state(temperature=1.0),
        state(temperature=0.3, top_p=0.5, logprobs=0, seed=3),
    ]
    out = sample(logits, states)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert lp is not None
        ref = torch.log_softmax(
            torch.tensor(ref_penalized(logits[i].tolist(), states[i]), dtype=torch.float64), -1
        )
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[lp.token_id].item(), abs=1e-5)
        k = states[i].params.logprobs
        want_top = torch.topk(ref, k) if k else None
        assert [t for t, _ in lp.top] == (want_top.indices.tolist() if want_top else [])
        for (_, got), want in zip(
            lp.top, want_top.values.tolist() if want_top else [], strict=True
        ):
            assert got == pytest.approx(want, abs=1e-5)
    assert out.logprobs[0] is not None and out.logprobs[0].token_id == logits[0].argmax().item()


def test_a_greedy_pick_at_a_tie_is_listed_first_among_its_equals() -> None:
    """Two tokens of exactly one logit (common in bfloat16): whichever greedy picks comes first
    in top_logprobs among the tied ones, never below its equal."""
    for first, second in ((5, 40), (40, 5)):
        logits = torch.full((1, 64), -4.0)
        logits[0, first] = logits[0, second] = 3.0
        logits[0, 7] = 1.0
        out = sample(logits, [state(temperature=0.0, logprobs=3)])
        lp = out.logprobs[0]
        assert lp is not None and lp.token_id == out.token_ids[0] in (first, second)
        assert lp.top[0][0] == lp.token_id and {t for t, _ in lp.top[:2]} == {first, second}
        assert lp.top[2][0] == 7 and lp.top[0][1] == lp.top[1][1] > lp.top[2][1]
    # topk orders ties as it likes (here it happened to agree with argmax); the reordering:
    top = [(40, -0.5), (5, -0.5), (9, -0.5), (7, -2.0)]
    assert sampler_mod.chosen_first(9, top) == [(9, -0.5), (40, -0.5), (5, -0.5), (7, -2.0)]
    assert sampler_mod.chosen_first(7, top) == top  # no equal above it
    assert sampler_mod.chosen_first(3, top) == top  # not listed


# ----- shapes ------------------------------------------------------------------------------


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="len\\(states\\)"):
        sample(torch.zeros(2, 10), [state()])


@pytest.mark.parametrize("penalty", [1.0, 1.2])
def test_a_token_the_grammar_rules_out_has_logprob_minus_inf(penalty: float) -> None:
    # the grammar's mask is a -max bias: such tokens' logprobs came out as -3.4e38, finite, and
    # went to clients as that number (not OpenAI's -9999.0, which the gateway gives -inf); with a
    # repetition penalty, the masked tokens the prompt holds (5, 7) came out as -1e30
    import numpy as np

    vocab = 64
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, 5] = logits[0, 7] = 30.0  # masked, but the highest: first among the alternatives
    mask = np.zeros(vocab // 32, dtype=np.int32)
    mask[0] = 0b11  # tokens 0 and 1 only
    params = SamplingParams(temperature=0, logprobs=4, repetition_penalty=penalty)
    state = SamplingState(params, None, [5, 7], [], mask)
    out = Sampler()(logits, [state])
    lps = out.logprobs[0]
    assert lps.token_id in (0, 1) and math.isfinite(lps.logprob)
    allowed = [v for t, v in lps.top if t in (0, 1)]
    assert len(allowed) == 2 and all(math.isfinite(v) for v in allowed)
    assert sum(math.exp(v) for v in allowed) == pytest.approx(1.0, abs=1e-5)
    assert [v for t, v in lps.top if t not in (0, 1)] == [-math.inf, -math.inf]


def test_a_repetition_penalty_past_the_bound_is_refused_and_a_zero_logit_stays_zero() -> None:
    # 1e39 became inf in float32: a seen token whose logit was exactly 0 got 0 * inf = NaN, which
    # greedy picked (argmax prefers NaN) and sampling logged as non-finite weights
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(repetition_penalty=1e39)
    assert e.value.param == "repetition_penalty" and "at most" in e.value.message
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    penalized = apply_penalties(logits, [state(prompt=[0, 1, 2], repetition_penalty=1e4)])
    assert penalized[0].tolist() == pytest.approx([0.0, 1e-4, -1e4, 2.0])
