"""min_tokens (vLLM's): until a sequence has min_tokens output tokens, end-of-sequence and its
stop_token_ids cannot be sampled (held at -inf, so greedy, top_k and top_p pick something else)
and no stop string ends it; a stop string counts where it ends in the text of the tokens after
the first min_tokens (vLLM's detokenizer rule). The sampler's part is checked on hand-made
logits, the detokenizer's against a reference, and the engine's on stories260K, whose greedy
path emits a token early that the tests then name as a stop token (it never emits its eos)."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.detokenizer import IncrementalDetokenizer
from runtime.sampler import Sampler, SamplingState
from runtime.sampling_params import InvalidRequestError
from runtime.tokenizer import Tokenizer

PROMPT = "Once upon a time"
EOS = 2


@pytest.fixture(scope="module")
def llm(stories_dir: Path) -> LLM:
    return LLM(stories_dir, kv_cache_bytes=1 << 22)


@pytest.fixture(scope="module")
def greedy(llm: LLM) -> list[int]:
    """The greedy path's first 30 tokens after PROMPT."""
    params = SamplingParams(temperature=0, max_tokens=30)
    return llm.generate(PROMPT, params)[0].outputs[0].token_ids


# ----- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"min_tokens": -1}, "must be >= 0, got -1"),
        ({"min_tokens": 2.5}, "must be an integer"),
        ({"min_tokens": True}, "must be an integer"),
        ({"min_tokens": None}, "must be an integer"),
        ({"min_tokens": 17}, "at most max_tokens (16), got 17"),
        ({"min_tokens": 6, "max_tokens": 5}, "at most max_tokens (5), got 6"),
    ],
)
def test_min_tokens_is_validated_naming_its_limit(kwargs: dict[str, Any], text: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == "min_tokens" and text in e.value.message


def test_min_tokens_up_to_max_tokens_is_taken() -> None:
    assert SamplingParams(min_tokens=16).min_tokens == 16  # (max_tokens' default)
    # no max_tokens (up to the context): any; the context's end ends it ("length"), as in vLLM
    assert SamplingParams(max_tokens=None, min_tokens=10**6).min_tokens == 10**6


# ----- the sampler -----------------------------------------------------------------------------


def _row(output: int, **params: Any) -> SamplingState:
    return SamplingState(SamplingParams(**params), None, [0], [1] * output)


def test_greedy_passes_over_eos_and_stop_tokens_until_min_tokens() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0, 2.0]])  # eos (2) best, then 3, then 4
    sample = Sampler(eos_token_ids=frozenset({EOS}))
    for output, want in [(0, 4), (2, 4), (3, 2), (5, 2)]:  # 3 and 2 are held until 3 tokens
        row = _row(output, temperature=0, max_tokens=10, min_tokens=3, stop_token_ids=[3])
        assert sample(logits, [row]).token_ids == [want], output
    # ignore_eos does not free it (vLLM holds it too); without min_tokens nothing is held
    row = _row(0, temperature=0, max_tokens=10, min_tokens=3, ignore_eos=True)
    assert sample(logits, [row]).token_ids == [3]
    assert sample(logits, [_row(0, temperature=0)]).token_ids == [2]


@pytest.mark.parametrize(
    "params",
    [{"temperature": 1.0}, {"temperature": 0.5, "top_k": 2}, {"temperature": 2.0, "top_p": 0.5},
     {"temperature": 1.0, "min_p": 0.5}, {"temperature": 0.7, "repetition_penalty": 1.5}],
    ids=repr,
)  # fmt: skip
def test_a_held_token_is_never_drawn(params: dict[str, Any]) -> None:
    """The held tokens hold nearly all the mass; top_k / top_p / min_p then keep the others."""
    rows = 2000
    logits = torch.tensor([[0.0, 1.0, 12.0, 12.0, 1.5, 0.5]]).repeat(rows, 1)
    states = [_row(1, max_tokens=9, min_tokens=2, stop_token_ids=[3], **params)] * rows
    torch.manual_seed(0)
    drawn = Sampler(eos_token_ids=frozenset({EOS}))(logits, states).token_ids
    assert not {2, 3} & set(drawn) and len(set(drawn)) > 1


def test_logprobs_and_batch_neighbours_are_untouched() -> None:
    """The held token keeps its logprob (vLLM's raw logprobs: taken before min_tokens), and the
    rows beside a held one are sampled as without it."""
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0], [0.0, 1.0, 9.0, 8.0]])
    held = _row(0, temperature=0, min_tokens=2, logprobs=2)
    free = _row(0, temperature=0, logprobs=1)
    out = Sampler(eos_token_ids=frozenset({EOS}))(logits, [held, free])
    assert out.token_ids == [3, 2]
    lp = torch.log_softmax(logits[0], dim=-1)
    held_lp, free_lp = out.logprobs
    assert held_lp is not None and free_lp is not None
    assert held_lp.logprob == pytest.approx(float(lp[3]))
    assert [t for t, _ in held_lp.top] == [2, 3] and held_lp.top[0][1] == pytest.approx(lp[2])
    assert free_lp.token_id == 2


def test_a_grammar_that_allows_only_a_stop_token_still_gets_it() -> None:
    """Held under min_tokens, the row would have nothing left to draw (NaN weights): the
    constraint's end comes first."""
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0]])
    mask = np.array([0b0100], dtype=np.int32)  # eos only
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, min_tokens=4)
        row = SamplingState(params, None, [5], [], mask)
        assert Sampler(eos_token_ids=frozenset({EOS}))(logits, [row]).token_ids == [2]


# ----- the detokenizer -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(stories_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(stories_dir)


def _reference(tok: Tokenizer, output: list[int], stops: list[str], min_tokens: int) -> str:
    """vLLM's rule: the full decode cut before the earliest-starting stop string among those
    that end past the text of the first min_tokens tokens (none before min_tokens + 1 tokens)."""
    full = tok.decode(output)
    if len(output) <= min_tokens:
        return full
    # (a character the first min_tokens tokens only begin is not theirs)
    floor = len(tok.decode(output[:min_tokens]).rstrip("\ufffd")) if min_tokens else 0
    hits = [full.find(s, max(0, floor - len(s) + 1)) for s in stops]
    return full[: min((h for h in hits if h >= 0), default=len(full))]


def test_a_stop_string_counts_once_it_ends_past_min_tokens(tok: Tokenizer) -> None:
    """vLLM's own case (tests/detokenizer/test_min_tokens.py), on this tokenizer: stop "e" in
    text whose first tokens hold an "e"."""
    output = tok.encode(" is Lee, and I'm a student in the college", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(output)[:6] == ["▁", "▁", "is", "▁L", "e", "e"]
    cases = [(0, " is L"), (4, " is L"), (5, " is Le"), (6, " is Lee, and I'm a stud")]
    for min_tokens, want in cases:
        detok = IncrementalDetokenizer(tok, [1], stop=["e"], min_tokens=min_tokens)
        text = "".join(detok.append(t) for t in output) + detok.flush()
        assert text == want == _reference(tok, output, ["e"], min_tokens), min_tokens
        assert detok.stop_matched == "e"


def test_stop_strings_under_min_tokens_on_random_text(tok: Tokenizer) -> None:
    """Overlapping, repeating stop strings (the scan's borders), any min_tokens: the text is
    the reference's, and no stop string that the text so far could still complete starts in
    what is shown."""
    rng = random.Random(5)
    words = ["a", "aa", "ab", "b", "ba", "abab", "cat", "sat"]
    stops_pool = ["aa", "aba", "abab", "a a", "b b", "ab ab a", "cat sat", "aab"]
    for case in range(300):
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 14)))
        output = tok.encode(text, add_special_tokens=False)
        stops = rng.sample(stops_pool, rng.randrange(1, 4))
        min_tokens = rng.choice([0, 0, 1, 2, 4, 8])
        detok = IncrementalDetokenizer(tok, [1], stop=stops, min_tokens=min_tokens)
        shown = ""
        for j, t in enumerate(output):
            shown += detok.append(t)
            so_far = tok.decode(output[: j + 1])
            starts = [so_far[i:] for i in range(len(shown))]
            if not detok.finished:  # (a whole one under min_tokens is shown: it did not count)
                assert not any(s.startswith(x) and s != x for s in stops for x in starts)
        shown += detok.flush()
        assert shown == _reference(tok, output, stops, min_tokens), (case, text, stops)


def test_the_floor_is_where_the_first_tokens_text_ends_when_they_end_in_a_byte_run(
    tok: Tokenizer,
) -> None:
    """A byte-fallback token ("\n" is <0x0A> here, as in Llama 2 or Mistral) is decoded with
    the token after it: when the min_tokens-th token was one, the floor was set before its text
    came, and a stop string ending inside the first min_tokens tokens' text counted (stop "\n"
    at min_tokens 5 of "Once upon a time\nthere was" ended the text at "time")."""
    output = tok.encode("Once upon a time\nthere was", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(output)[4] == "<0x0A>"
    detok = IncrementalDetokenizer(tok, [1], stop=["\n"], min_tokens=5)
    text = "".join(detok.append(t) for t in output) + detok.flush()
    assert (text, detok.stop_matched) == ("Once upon a time\nthere was", None)
    rng = random.Random(7)
    words = ["a", "b", "ab", "\n", "é", "éa", "a\n", "😀", "\n\n", "cat"]
    for case in range(400):
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 12)))
        output = tok.encode(text, add_special_tokens=False)
        stop = rng.choice(["\n", "a\n", "\n a", "é", "😀", "a é", "\n\n"])
        min_tokens = rng.randrange(0, len(output) + 1)
        detok = IncrementalDetokenizer(tok, [1], stop=[stop], min_tokens=min_tokens)
        shown = "".join(detok.append(t) for t in output) + detok.flush()
        assert shown == _reference(tok, output, [stop], min_tokens), (case, text, stop, min_tokens)


class _Counted(str):
    """A stop string that counts the characters its indexing and slicing return."""

    read = 0

    def __getitem__(self, key: Any) -> str:
        part = str.__getitem__(self, key)
        _Counted.read += len(part)
        return part


def test_a_long_held_back_stop_prefix_costs_its_length_not_its_square(tok: Tokenizer) -> None:
    """A stop string of 60,000 characters that the output follows for 20,000 of them, then
    leaves: every tail of the held-back text was compared with the stop's prefix (a slice of
    it each), 2e8 characters for the last step alone, ~1 s of the step loop. The scan reads
    each character a bounded number of times."""
    n = 20_000
    stop = _Counted("a" * 60_000)
    output = tok.encode("a" * n + "c", add_special_tokens=False)
    _Counted.read = 0
    detok = IncrementalDetokenizer(tok, [1], stop=[stop])
    text = "".join(detok.append(t) for t in output) + detok.flush()
    assert text == "a" * n + "c" and detok.stop_matched is None
    assert _Counted.read < 10 * n  # (the old check: over 2e8)


# ----- the engine ------------------------------------------------------------------------------


def test_greedy_passes_an_early_stop_token_until_min_tokens(llm: LLM, greedy: list[int]) -> None:
    stop = greedy[1]  # greedy emits it second
    early = llm.generate(PROMPT, SamplingParams(temperature=0, stop_token_ids=[stop]))[0]
    assert early.outputs[0].token_ids == greedy[:2]
    for min_tokens in (2, 5):
        params = SamplingParams(
            temperature=0, max_tokens=30, min_tokens=min_tokens, stop_token_ids=[stop]
        )
        out = llm.generate(PROMPT, params)[0].outputs[0]
        ids = out.token_ids
        assert stop not in ids[:min_tokens] and len(ids) > min_tokens, min_tokens
        assert ids[0] == greedy[0]  # (the best token that is not the stop token)
        if out.finish_reason == "stop":  # the stop token, once allowed, ends it as before
            assert (ids[-1], out.stop_reason) == (stop, stop) and stop not in ids[:-1]
    # a min_tokens of max_tokens: the request ends at max_tokens, never on its stop token
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, stop_token_ids=[stop])
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (12, "length")
    assert stop not in out.token_ids


def test_eos_is_held_until_min_tokens(llm: LLM, greedy: list[int]) -> None:
    """The model's end-of-sequence (stories260K never samples its own: the test names the
    token greedy emits third as the engine's eos for the while)."""
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = engine.runner.sampler.eos_token_ids = frozenset({greedy[2]})
    try:
        plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
        assert plain.token_ids == greedy[:3] and plain.finish_reason == "stop"
        params = SamplingParams(temperature=0, max_tokens=30, min_tokens=6)
        out = llm.generate(PROMPT, params)[0].outputs[0]
        assert greedy[2] not in out.token_ids[:6] and len(out.token_ids) > 6
    finally:
        engine.eos_token_ids = engine.runner.sampler.eos_token_ids = saved


def test_n_seeded_samples_with_logprobs_each_pass_min_tokens(llm: LLM, greedy: list[int]) -> None:
    stop = greedy[1]
    params = SamplingParams(
        n=4, temperature=1.0, seed=7, max_tokens=20, min_tokens=8, stop_token_ids=[stop],
        logprobs=3,
    )  # fmt: skip
    out = llm.generate(PROMPT, params)[0]
    again = llm.generate(PROMPT, params)[0]
    for c, d in zip(out.outputs, again.outputs, strict=True):
        assert stop not in c.token_ids[:8] and len(c.token_ids) >= 9
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        assert all(math.isfinite(lp.logprob) and len(lp.top) == 3 for lp in c.logprobs)
        assert c.token_ids == d.token_ids  # seeded: the same again
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_a_stop_string_in_the_first_min_tokens_does_not_end_the_request(
    llm: LLM, greedy: list[int], tok: Tokenizer
) -> None:
    text = tok.decode(greedy)
    stop = text[text.index("a") : text.index("a") + 1]  # in the second or third token
    for min_tokens in (0, 4, 9):
        params = SamplingParams(temperature=0, max_tokens=30, min_tokens=min_tokens, stop=[stop])
        out = llm.generate(PROMPT, params)[0].outputs[0]
        assert out.token_ids == greedy[: len(out.token_ids)]  # (stop strings hold no token)
        assert out.text == _reference(tok, greedy, [stop], min_tokens), min_tokens
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert len(out.token_ids) > min_tokens
