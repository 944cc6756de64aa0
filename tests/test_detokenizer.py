"""IncrementalDetokenizer on the real stories260K tokenizer (SentencePiece-style BPE with byte
fallback): deltas must add up to what a full decode gives, never show half a character, and
stop strings must cut the text exactly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from runtime.detokenizer import IncrementalDetokenizer
from runtime.tokenizer import Tokenizer

BOS, EOS = 1, 2

TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "She saw a big, red ball 😀 and said: héllo!",
    "🎉🎉 CJK 你好世界 and a combining é at the end é",
    "  two leading spaces, then\nnew lines\n\nand\ttabs",
    "x",
]


@pytest.fixture(scope="module")
def tok(stories_dir: Path) -> Tokenizer:  # stories_dir: conftest.py
    return Tokenizer.from_dir(stories_dir)


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A tiny GPT-2 style byte-level BPE (as SmolLM2 uses): no byte-fallback tokens, characters
    outside the training text split into single-byte tokens that decode to U+FFFD alone."""
    corpus = ["Once upon a time there was a girl named Lily.", "héllo café naïve"] * 20
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    d = tmp_path_factory.mktemp("byte_level")
    backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return Tokenizer.from_dir(d)


def run(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """All deltas, then the flush."""
    return [detok.append(i) for i in ids] + [detok.flush()]


def continuation(tok: Tokenizer, prompt: list[int], output: list[int]) -> str:
    """What `output` adds to the text of `prompt`, by full decodes (the reference)."""
    full = tok.decode(prompt + output)
    head = tok.decode(prompt)
    assert full.startswith(head)
    return full[len(head) :]


# ----- the central property ----------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_decode_of_output(tok: Tokenizer, text: str) -> None:
    output = tok.encode(text, add_special_tokens=False)
    deltas = run(IncrementalDetokenizer(tok, [BOS]), output)
    assert "".join(deltas) == tok.decode(output)
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_after_a_prompt(tok: Tokenizer, text: str) -> None:
    prompt = tok.encode("Once upon a")
    output = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = run(detok, output)
    assert "".join(deltas) == continuation(tok, prompt, output) == detok.text


def test_random_token_sequences(tok: Tokenizer) -> None:
    """Any tokens at all, byte tokens that never form valid UTF-8 and specials included."""
    rng = random.Random(1)
    byte_ids = sorted(tok.byte_fallback_ids)
    for trial in range(300):
        pool = byte_ids if trial % 3 == 0 else range(tok.vocab_size)
        output = [rng.choice(pool) for _ in range(rng.randrange(0, 40))]
        prompt = [BOS] if trial % 2 else tok.encode("The cat sat")
        expected = tok.decode(output) if prompt == [BOS] else continuation(tok, prompt, output)
        deltas = run(IncrementalDetokenizer(tok, prompt), output)
        assert "".join(deltas) == expected, (prompt, output)


def test_random_token_sequences_byte_level(byte_level: Tokenizer) -> None:
    rng = random.Random(3)
    assert not byte_level.byte_fallback_ids
    for trial in range(300):
        # Low ids are the single-byte tokens: many invalid or split characters.
        high = 258 if trial % 3 == 0 else byte_level.vocab_size
        output = [rng.randrange(high) for _ in range(rng.randrange(0, 40))]
        prompt = [] if trial % 2 else byte_level.encode("Once upon")
        deltas = run(IncrementalDetokenizer(byte_level, prompt), output)
        assert "".join(deltas) == continuation(byte_level, prompt, output), (prompt, output)


def test_text_round_trip_byte_level(byte_level: Tokenizer) -> None:
    for text in TEXTS:
        output = byte_level.encode(text)
        deltas = run(IncrementalDetokenizer(byte_level, []), output)
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)


def test_skip_special_tokens_false_keeps_them(tok: Tokenizer) -> None:
    output = [*tok.encode("a cat", add_special_tokens=False), EOS]
    detok = IncrementalDetokenizer(tok, [BOS], skip_special_tokens=False)
    # The bos now has text ("<s>"), so the output continues it with its leading space.
    expected = tok.decode([BOS, *output], skip_special_tokens=False).removeprefix("<s>")
    assert "".join(run(detok, output)) == expected == " a cat</s>"


def test_cost_per_token_is_bounded(tok: Tokenizer, stories_dir: Path) -> None:
    """Each step decodes a short window, however long the output grows: at most the last
    emitted chunk plus the pending tokens, each bounded by the longest run of byte tokens."""
    longest = 0

    class Spy(Tokenizer):
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            nonlocal longest
            longest = max(longest, len(ids))
            return super().decode(ids, skip_special_tokens)

    spy = Spy.from_dir(stories_dir)
    output = tok.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    assert len(output) > 1000
    deltas = run(IncrementalDetokenizer(spy, tok.encode("Once upon a time")), output)
    assert len("".join(deltas)) > 2000
    runs = "".join("b" if i in tok.byte_fallback_ids else " " for i in output).split()
    assert longest <= 2 * (max(len(r) for r in runs) + 1) == 26


# ----- the two decoding hazards ------------------------------------------------------------


def test_emoji_split_over_byte_tokens(tok: Tokenizer) -> None:
    output = tok.encode("a 😀 b", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(output)
    assert pieces == ["▁a", "▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "▁b"]
    detok = IncrementalDetokenizer(tok, [BOS])
    deltas = [detok.append(i) for i in output]
    # Nothing of the emoji shows until its run of byte tokens has ended; then all of it.
    assert deltas == ["a", " ", "", "", "", "", "😀 b"]
    assert detok.flush() == ""


def test_emoji_split_over_byte_level_tokens(byte_level: Tokenizer) -> None:
    output = byte_level.encode("a 😀 b")
    assert byte_level.convert_ids_to_tokens(output) == ["a", "Ġ", "ð", "Ł", "ĺ", "Ģ", "Ġ", "b"]
    detok = IncrementalDetokenizer(byte_level, [])
    # Held while the text ends in half a character; out as soon as the character is whole.
    assert [detok.append(i) for i in output] == ["a", " ", "", "", "", "😀", " ", "b"]


def test_incomplete_character_at_the_end_is_flushed_as_decode_gives_it(tok: Tokenizer) -> None:
    output = tok.encode("hi 😀", add_special_tokens=False)[:-2]  # cut the emoji's last 2 bytes
    detok = IncrementalDetokenizer(tok, [BOS])
    deltas = [detok.append(i) for i in output]
    assert "".join(deltas) == "hi "
    tail = detok.flush()
    assert tail == "\ufffd\ufffd" and "hi " + tail == tok.decode(output)
    assert detok.append(output[0]) == ""  # finished


def test_leading_space_of_sentencepiece_tokens(tok: Tokenizer) -> None:
    once = tok.encode("Once", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(once) == ["▁Once"]
    # At the start of the text the space is dropped, as decode does ...
    assert IncrementalDetokenizer(tok, [BOS]).append(once[0]) == "Once"
    assert IncrementalDetokenizer(tok, []).append(once[0]) == "Once"
    # ... after prompt text it is kept, so prompt + output reads right.
    time = tok.encode("time", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(time) == ["▁time"]
    prompt = tok.encode("Once upon a")
    assert IncrementalDetokenizer(tok, prompt).append(time[0]) == " time"
    # A special token between words does not eat the space either.
    detok = IncrementalDetokenizer(tok, [BOS])
    assert [detok.append(i) for i in [*once, EOS, *time]] == ["Once", "", " time"]


# ----- stop strings ------------------------------------------------------------------------


def test_stop_string_spanning_tokens(tok: Tokenizer) -> None:
    output = tok.encode("there was a little girl", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [BOS], stop=["s a lit"])
    deltas = [detok.append(i) for i in output]
    assert detok.stop_matched == "s a lit"
    assert "".join(deltas) == detok.text == "there wa"
    assert detok.finished
    assert detok.append(output[0]) == "" and detok.flush() == ""


def test_stop_string_included_in_output(tok: Tokenizer) -> None:
    output = tok.encode("there was a little girl", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [BOS], stop=["s a lit"], include_stop_str_in_output=True)
    assert "".join(detok.append(i) for i in output) == "there was a lit"
    assert detok.stop_matched == "s a lit"


def test_possible_stop_prefix_is_held_then_released(tok: Tokenizer) -> None:
    stop = "was a dog"
    detok = IncrementalDetokenizer(tok, [BOS], stop=[stop])
    output = tok.encode("it was a cat", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(output) == ["▁it", "▁was", "▁a", "▁c", "at"]
    shown, deltas = "", []
    for i in output:
        deltas.append(detok.append(i))
        shown += deltas[-1]
        # Shown text never ends in something that could still grow into the stop string.
        assert not any(shown.endswith(stop[:k]) for k in range(1, len(stop)))
    # "was a c" cannot become "was a dog": released at once.
    assert deltas == ["it", " ", "", "was a c", "at"]
    assert detok.stop_matched is None
    assert shown + detok.flush() == "it was a cat"


def test_held_stop_prefix_is_flushed_at_the_end(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [BOS], stop=["girl!"])
    shown = "".join(detok.append(i) for i in tok.encode("a girl", add_special_tokens=False))
    assert shown == "a "
    assert detok.flush() == "girl"
    assert detok.text == "a girl" and detok.stop_matched is None


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [BOS], stop=["ball", "big"])
    text = "".join(run(detok, tok.encode("a big red ball", add_special_tokens=False)))
    assert text == "a " and detok.stop_matched == "big"


def test_stop_string_at_the_start_and_with_an_emoji(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [BOS], stop=["Once"])
    assert "".join(run(detok, tok.encode("Once upon", add_special_tokens=False))) == ""
    assert detok.stop_matched == "Once"

    detok = IncrementalDetokenizer(tok, [BOS], stop=["😀 b"])
    text = "".join(run(detok, tok.encode("a 😀 b c", add_special_tokens=False)))
    assert text == "a " and detok.stop_matched == "😀 b"


def test_stop_strings_match_output_only(tok: Tokenizer) -> None:
    prompt = tok.encode("Once upon a time")
    detok = IncrementalDetokenizer(tok, prompt, stop=["time there"])
    out = tok.encode("there was", add_special_tokens=False)
    assert "".join(run(detok, out)) == " there was"
    assert detok.stop_matched is None


def test_stop_property_on_random_text(tok: Tokenizer) -> None:
    """With stops: the text is the full decode cut before the earliest stop string."""
    rng = random.Random(2)
    words = ["a", "cat", "sat", "on", "the", "mat", "😀", "é", "big", "ball", "Lily"]
    stops = ["cat sat", "é b", "😀😀", "ll L", "t o"]
    for _ in range(200):
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 15)))
        output = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, [BOS], stop=stops)
        got = "".join(run(detok, output))
        full = tok.decode(output)
        hits = [(full.find(s), s) for s in stops if s in full]
        if hits:
            at, stop = min(hits)
            assert (got, detok.stop_matched) == (full[:at], stop), text
        else:
            assert (got, detok.stop_matched) == (full, None), text


def test_tokens_shown_are_those_whose_text_is_out(tok: Tokenizer) -> None:
    """num_shown: the leading tokens whose text was returned (what logprobs are given for)."""
    output = tok.encode("there was a little girl", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(output)[:3] == ["▁there", "▁was", "▁a"]
    # cut by a stop string: "there wa" is out, "▁a" and the rest made only the stop string
    detok = IncrementalDetokenizer(tok, [BOS], stop=["s a lit"])
    counts = []
    for i in output:
        detok.append(i)
        counts.append(detok.num_shown)
    assert detok.text == "there wa" and counts[-1] == 2
    assert counts == sorted(counts)  # never taken back
    # the same with the stop string kept: its tokens are shown too ("▁little" holds "lit")
    detok = IncrementalDetokenizer(tok, [BOS], stop=["s a lit"], include_stop_str_in_output=True)
    run(detok, output)
    assert detok.text == "there was a lit"
    assert "".join(tok.convert_ids_to_tokens(output[: detok.num_shown])) == "▁there▁was▁a▁little"
    # a final end-of-sequence token adds no text: not shown; one followed by text is
    detok = IncrementalDetokenizer(tok, [BOS])
    run(detok, [*output, EOS])
    assert detok.num_shown == len(output)
    detok = IncrementalDetokenizer(tok, [BOS])
    run(detok, [*output[:2], EOS, *output[2:]])
    assert detok.num_shown == len(output) + 1
    # a token held back (a possible stop prefix) is shown once its text is released
    detok = IncrementalDetokenizer(tok, [BOS], stop=["was a dog"])
    counts = [
        (detok.append(i), detok.num_shown)[1]
        for i in tok.encode("it was a cat", add_special_tokens=False)
    ]
    assert counts == [1, 2, 2, 4, 5]
