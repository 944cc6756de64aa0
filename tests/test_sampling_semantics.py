"""Sampling semantics end to end on the real stories260K engine: penalties against transformers
on the same weights, seeds alone / in a batch / with n > 1 / after preemption, the settings that
must be exact no-ops, and SamplingParams' refusals (each naming its field)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.sampling_params import InvalidRequestError

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went", "One day, a big"]


@pytest.fixture(scope="module")
def llm(stories_dir: Path) -> LLM:
    return LLM(stories_dir, kv_cache_bytes=1 << 22)


def tokens(
    llm: LLM, prompts: list[str], params: SamplingParams | list[SamplingParams]
) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


# ----- penalties against transformers ------------------------------------------------------


@pytest.fixture(scope="module")
def hf(stories_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.8},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.7},
        {"repetition_penalty": 1.2, "presence_penalty": -0.5, "frequency_penalty": 0.5},
    ],
    ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()),
)
def test_greedy_with_penalties_follows_transformers(
    llm: LLM, hf: Any, penalties: dict[str, Any]
) -> None:
    """Greedy under penalties, token for token, against transformers' float32 logits on the same
    weights: its RepetitionPenaltyLogitsProcessor (prompt and output, once per distinct token,
    negative logits multiplied), then presence / frequency over the output only (vLLM's)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rep = penalties.get("repetition_penalty", 1.0)
    n = 30
    ids = llm.tokenizer.encode(PROMPTS[0])
    seq, out = list(ids), list[int]()
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([seq])).logits[:, -1].double()  # (1, V)
            if rep != 1.0:
                logits = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([seq]), logits)
            for t, c in Counter(out).items():
                logits[0, t] -= penalties.get("frequency_penalty", 0.0) * c
                logits[0, t] -= penalties.get("presence_penalty", 0.0)
            out.append(int(logits.argmax()))
            seq.append(out[-1])
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **penalties)
    assert tokens(llm, PROMPTS[:1], params)[0][0] == out
    plain = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    assert tokens(llm, PROMPTS[:1], plain)[0][0] != out  # (the penalties do change the answer)


# ----- seeds -------------------------------------------------------------------------------

SEEDED: list[dict[str, Any]] = [
    {"temperature": 0.9},
    {"top_k": 20, "top_p": 0.9, "min_p": 0.05},
    {"top_p": 0.8, "repetition_penalty": 1.3, "frequency_penalty": 0.5},
]


@pytest.mark.parametrize("mode", SEEDED, ids=lambda p: ",".join(p))
def test_a_seeded_request_gives_its_tokens_alone_in_a_batch_and_after_preemption(
    llm: LLM, stories_dir: Path, mode: dict[str, Any]
) -> None:
    params = SamplingParams(seed=1234, n=3, max_tokens=40, **mode)
    alone = tokens(llm, [PROMPTS[0]], params)[0]
    assert len({tuple(t) for t in alone}) == 3  # n completions, each its own
    assert tokens(llm, [PROMPTS[0]], params)[0] == alone  # and again the same
    others = [SamplingParams(temperature=1.2, max_tokens=50), SamplingParams(seed=5, top_k=100),
              SamplingParams(temperature=0, max_tokens=45)]  # fmt: skip
    assert tokens(llm, [*PROMPTS[1:], PROMPTS[0]], [*others, params])[-1] == alone
    # a KV cache of 6 blocks of 16 tokens: the newest request (this one) is preempted
    # (recomputed), its generator going on where it was
    engine = LLM(stories_dir, kv_cache_bytes=6 * 5 * 2 * 16 * 4 * 8 * 4, block_size=16).engine
    for i, prompt in enumerate(PROMPTS[1:]):
        engine.add_request(f"o{i}", prompt, SamplingParams(temperature=1.0, max_tokens=70))
    engine.add_request("s", PROMPTS[0], params)
    preempted, done = 0, None
    while engine.has_unfinished():
        seqs = [r for r in engine.scheduler.running if r.request_id.startswith("s#")]
        preempted = max([preempted, *(r.num_preemptions for r in seqs)])
        done = next((o for o in engine.step() if o.request_id == "s" and o.finished), done)
    assert preempted > 0
    assert done is not None and [c.token_ids for c in done.outputs] == alone


# ----- settings that are off ---------------------------------------------------------------


def test_settings_at_their_off_values_change_no_token(llm: LLM) -> None:
    """top_k 0, -1 or past the vocabulary, top_p 1 and min_p 0 are exact no-ops on a seeded
    draw; temperature 0 is greedy whatever top_k / top_p / min_p say."""
    base = tokens(llm, PROMPTS[:1], SamplingParams(seed=7, max_tokens=40))[0]
    for off in ({"top_k": 0}, {"top_k": 512}, {"top_k": 10**6}, {"top_p": 1.0},
                {"min_p": 0.0}, {"repetition_penalty": 1.0, "presence_penalty": 0.0}):  # fmt: skip
        assert tokens(llm, PROMPTS[:1], SamplingParams(seed=7, max_tokens=40, **off))[0] == base
    greedy = tokens(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=40))[0]
    truncated = SamplingParams(temperature=0, top_k=3, top_p=0.2, min_p=0.5, seed=3, max_tokens=40)
    assert tokens(llm, PROMPTS[:1], truncated)[0] == greedy


def test_a_stop_token_id_ends_the_request_even_with_ignore_eos(llm: LLM) -> None:
    greedy = tokens(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=30))[0][0]
    stop = greedy[5]
    first = greedy.index(stop)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
    out = llm.generate(PROMPTS[:1], params)[0].outputs[0]
    assert out.token_ids == greedy[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


# ----- SamplingParams' refusals ------------------------------------------------------------


@pytest.mark.parametrize(
    "field, sign, digits",  # (the value: sign * 10**digits; pytest's id of it would fail too)
    [
        ("n", 1, 5000),
        ("max_tokens", 1, 5000),
        ("top_k", -1, 5000),
        ("seed", 1, 5000),
        ("logprobs", 1, 20),
        ("temperature", 1, 400),
        ("repetition_penalty", 1, 400),
        ("presence_penalty", -1, 400),
    ],
)
def test_an_integer_too_large_is_refused_naming_its_field(
    llm: LLM, field: str, sign: int, digits: int
) -> None:
    """A huge Python integer was a ValueError (str() of one past 4,300 digits, printing it in
    the message) or an OverflowError (math.isfinite of one past float's range), not the
    InvalidRequestError naming the field; the engine queues nothing."""
    value = sign * 10**digits
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field
    params = SamplingParams(max_tokens=4)
    setattr(params, field, value)  # (set after construction: LLM.generate validates again)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(PROMPTS[:1], params)
    assert e.value.param == field
    assert not llm.engine.has_unfinished()


def test_a_stop_string_set_after_construction_is_taken(llm: LLM) -> None:
    """`params.stop = "..."` after construction: validate (run again by generate) refused it as
    "must be a string or a list of strings" (only __post_init__ made a string a list)."""
    params = SamplingParams(temperature=0, max_tokens=30)
    text = llm.generate(PROMPTS[:1], params)[0].outputs[0].text
    params.stop = "little"  # type: ignore[assignment]
    assert "little" in text
    out = llm.generate(PROMPTS[:1], params)[0].outputs[0]
    assert params.stop == ["little"]
    assert out.text == text[: text.index("little")] and out.finish_reason == "stop"


@pytest.mark.parametrize("temperature", [1e38, 1e39])
def test_a_huge_temperature_keeps_to_the_grammar(llm: LLM, temperature: float) -> None:
    """The grammar's mask is a -max bias: divided by a temperature of 1e38 it was about -3.4,
    near the allowed tokens' logits, and by 1e39 (inf in float32) 0 like them, so tokens the
    grammar refuses were drawn and the request ended with finish_reason "error"."""
    choice = {"choice": ["yes", "no"]}
    for seed in range(4):
        params = SamplingParams(temperature=temperature, seed=seed, structured_outputs=choice)
        out = llm.generate(PROMPTS[:1], params)[0].outputs[0]
        assert out.finish_reason == "stop" and out.text in ("yes", "no"), (seed, out.text)


def test_stop_and_stop_token_ids_of_none_mean_none(llm: LLM) -> None:
    """vLLM's defaults, and what OpenAI's `"stop": null` means: both were refused ("must be a
    string or a list of strings", "must be a list of integers")."""
    params = SamplingParams(temperature=0, max_tokens=8, stop=None, stop_token_ids=None)
    assert (params.stop, params.stop_token_ids) == ([], [])
    plain = tokens(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8))
    assert tokens(llm, PROMPTS[:1], params) == plain
    params.stop = None  # (set later: generate's re-check takes it too)
    assert tokens(llm, PROMPTS[:1], params) == plain and params.stop == []
    # tuples, as vLLM takes them (they were refused too)
    params = SamplingParams(stop=("a", "b"), stop_token_ids=(7,))
    assert (params.stop, params.stop_token_ids) == (["a", "b"], [7])


def test_seeds_2_to_the_32_apart_and_neighbouring_sequences_are_other_streams(
    llm: LLM,
) -> None:
    """torch's CPU generator keeps a seed's low 32 bits: seeded with `seed + i`, seeds 0 and
    2**32 sampled the same text, and sequence 1 of seed 7 was sequence 0 of seed 8. Each
    sequence's seed is now a mix of (seed, i); the same seed still gives the same text."""

    def texts(seed: int, n: int = 1) -> list[str]:
        params = SamplingParams(temperature=1.0, max_tokens=24, seed=seed, n=n, ignore_eos=True)
        return [c.text for c in llm.generate(["Once upon a time"], params)[0].outputs]

    assert texts(0) == texts(0)
    assert texts(0) != texts(2**32)
    assert texts(7, n=2)[1] != texts(8)[0]
    assert texts(2**63 - 1) == texts(2**63 - 1)
