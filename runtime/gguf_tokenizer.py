"""Rebuild a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json, chat
templates, generation_config.json) from a GGUF file's `tokenizer.ggml.*` metadata."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from runtime.gguf_common import (
    GGUFImportError,
    Metadata,
    UnsupportedGGUFError,
    token_ids,
    write_json,
)

_T = gguf.TokenType
_ADDED_TYPES = (_T.CONTROL, _T.UNKNOWN, _T.USER_DEFINED)  # matched whole in raw text

# How text is split before BPE, by `tokenizer.ggml.pre` (llama.cpp's names), for byte-level
# vocabularies. "smollm" isolates every digit, as SmolLM2's own tokenizer.json does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = {"default", "gpt2", "gpt-2"}
_DIGITS_PRE = {"smollm"}
_LLAMA3_PRE = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe"}
# Llama 3's own: llama.cpp takes a word the vocabulary holds whole as one token (tokenizer.json's
# "ignore_merges") and adds a bos unless the file says otherwise, as Llama 3's tokenizer.json does
_LLAMA3_OWN_PRE = {"llama-bpe", "llama3", "llama-v3"}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes stand for themselves,
    the other 68 bytes take the code points from U+0100 upwards, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(0x100 + extra)
            extra += 1
    return spelling


def check_token_lists(meta: Metadata, vocab_size: int | None, src: Path) -> list[str]:
    """The vocabulary (`tokenizer.ggml.tokens`), checked against its per-token lists (types,
    scores: one entry per token) and the embedding's `vocab_size` rows (it may have more, as
    padding, never fewer: a token past the last row fails the model's first lookup of it).
    A GGUFImportError naming the keys and both counts otherwise, before any weight is read."""
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise GGUFImportError(src, "the file has no tokenizer (tokenizer.ggml.tokens is missing)")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        value = meta.get(key)
        if value is not None and (not isinstance(value, list) or len(value) != len(tokens)):
            got = f"{len(value)} entries" if isinstance(value, list) else repr(value)[:40]
            raise GGUFImportError(
                src,
                f"metadata {key!r} has {got}, tokenizer.ggml.tokens has {len(tokens)} (one each)",
            )
    if vocab_size is not None and len(tokens) > vocab_size:
        raise GGUFImportError(
            src,
            f"tokenizer.ggml.tokens has {len(tokens)} tokens, tensor 'token_embd.weight' "
            f"only {vocab_size} rows (a token past them has no embedding)",
        )
    return tokens


def write_tokenizer(out: Path, meta: Metadata, config: dict[str, Any], src: Path) -> None:
    kind = meta.get("tokenizer.ggml.model")
    tokens = check_token_lists(meta, config.get("vocab_size"), src)
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [int(_T.NORMAL)] * len(tokens)
    merges = [_split_merge(m, src) for m in meta.get("tokenizer.ggml.merges") or []]
    ids = token_ids(meta)
    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre")
        tokenizer = _byte_level_bpe(tokens, types, merges, pre)
        add_bos_default = pre in _LLAMA3_OWN_PRE
    elif kind == "llama":
        scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        unk = tokens[ids["unk_token_id"]] if "unk_token_id" in ids else None
        prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tokenizer = _sentencepiece_bpe(tokens, types, scores, merges, unk, prefix_space)
        add_bos_default = True  # llama.cpp's default for sentencepiece vocabularies
    else:
        raise UnsupportedGGUFError(src, f"tokenizer model {kind!r} is not supported")

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = ids.get("bos_token_id"), ids.get("eos_token_id")
    tokenizer.post_processor = _post_processor(
        (tokens[bos], bos) if add_bos and bos is not None else None,
        (tokens[eos], eos) if add_eos and eos is not None else None,
    )
    tokenizer.save(str(out / "tokenizer.json"))

    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    for name in ("bos", "eos", "unk", "pad"):
        if f"{name}_token_id" in ids:
            tok_config[f"{name}_token"] = tokens[ids[f"{name}_token_id"]]
    templates = _chat_templates(meta)
    if "default" in templates:
        (out / "chat_template.jinja").write_text(templates["default"], encoding="utf-8")
    if len(templates) > 1:
        extra_dir = out / "additional_chat_templates"
        extra_dir.mkdir()
        for name, text in templates.items():
            if name != "default":
                (extra_dir / f"{name}.jinja").write_text(text, encoding="utf-8")
        tok_config["chat_template"] = [{"name": n, "template": t} for n, t in templates.items()]
    elif templates:
        tok_config["chat_template"] = next(iter(templates.values()))
    write_json(out / "tokenizer_config.json", tok_config)

    generation: dict[str, Any] = {}
    if "bos_token_id" in ids:
        generation["bos_token_id"] = ids["bos_token_id"]
    stops = [ids[k] for k in ("eos_token_id", "eot_token_id", "eom_token_id") if k in ids]
    stops = list(dict.fromkeys(stops))
    if stops:
        generation["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    if "pad_token_id" in ids:
        generation["pad_token_id"] = ids["pad_token_id"]
    write_json(out / "generation_config.json", generation)


def _split_merge(merge: str, src: Path) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise GGUFImportError(src, f"malformed tokenizer merge {merge!r}")
    return left, right


def _chat_templates(meta: Metadata) -> dict[str, str]:
    templates: dict[str, str] = {}
    default = meta.get("tokenizer.chat_template")
    if default:
        templates["default"] = default
    for name in meta.get("tokenizer.chat_templates") or []:
        text = meta.get(f"tokenizer.chat_template.{name}")
        if text:
            templates[name] = text
    return templates


def _added_tokens(tokens: list[str], types: list[int]) -> tuple[list[AddedToken], list[AddedToken]]:
    """(special, plain): control tokens are special, user-defined ones are plain added tokens.
    Both are matched whole in raw text, as llama.cpp does."""
    special = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, types, strict=True)
        if kind in (_T.CONTROL, _T.UNKNOWN)
    ]
    plain = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind in zip(tokens, types, strict=True)
        if kind == _T.USER_DEFINED
    ]
    return special, plain


def _byte_level_bpe(
    tokens: list[str], types: list[int], merges: list[tuple[str, str]], pre: str | None
) -> Tokenizer:
    """GPT-2 style byte-level BPE (`tokenizer.ggml.model == "gpt2"`)."""
    spell = _byte_alphabet()
    alphabet = set(spell.values())
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
        if not set(tok) <= alphabet and kind not in _ADDED_TYPES:
            tok = "".join(spell[b] for b in tok.encode("utf-8"))  # a normal token in raw text
        vocab[tok] = i
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre in _LLAMA3_OWN_PRE,
        )
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGITS_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in _LLAMA3_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(
                    add_prefix_space=False, trim_offsets=True, use_regex=False
                ),
            ]
        )
    else:
        if pre is not None and pre not in _GPT2_PRE:
            warnings.warn(
                f"GGUF pre-tokenizer {pre!r} is not known; splitting text the GPT-2 way",
                stacklevel=3,
            )
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    special, plain = _added_tokens(tokens, types)
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
    return tokenizer


def _sentencepiece_bpe(
    tokens: list[str],
    types: list[int],
    scores: list[float],
    merges: list[tuple[str, str]],
    unk: str | None,
    prefix_space: bool,
) -> Tokenizer:
    """SentencePiece BPE (`tokenizer.ggml.model == "llama"`) as a byte-fallback BPE, the way
    transformers' LlamaTokenizer builds it: ▁ for spaces, a ▁ before the first word only."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges or _merges_from_scores(tokens, scores),
            unk_token=unk,
            dropout=None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    special, plain = _added_tokens(tokens, types)
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece keeps no merge list: a token's score ranks its merge. Every way of cutting a
    token into two vocabulary tokens is a merge; best first by the token's score, then by the
    longer left piece, then the longer right piece; remaining ties by the pieces' ids."""
    ids = {tok: i for i, tok in enumerate(tokens)}
    score_of = dict(zip(tokens, scores, strict=True))
    found: list[tuple[float, int, int, str, str]] = []
    for tok, score in score_of.items():
        cuts = [(tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in ids and tok[k:] in ids]
        cuts.sort(key=lambda cut: (ids[cut[0]], ids[cut[1]]))
        found.extend((score, len(left), len(right), left, right) for left, right in cuts)
    found.sort(key=lambda m: (-m[0], -m[1], -m[2]))  # stable: equal keys keep the order above
    return [(left, right) for _, _, _, left, right in found]


def _post_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """Adds bos / eos (token, id) around every encoded sequence, as the add_*_token flags ask."""
    first, last = [bos] if bos else [], [eos] if eos else []
    single = [tok for tok, _ in first] + ["$A"] + [tok for tok, _ in last]
    pair = single + [f"{tok}:1" for tok, _ in first] + ["$B:1"] + [f"{tok}:1" for tok, _ in last]
    specials = dict(first + last)
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(specials.items())
    )
