"""Text <-> token ids for one model directory, and chat-template rendering.

Wraps a `tokenizers.Tokenizer` loaded from the directory's `tokenizer.json` and reads the small
config files around it the way `transformers.AutoTokenizer` (v5) does:

    tokenizer.json          vocabulary, normalizer, pre-tokenizer, post-processor, decoder (required)
    tokenizer_config.json   named special tokens (bos/eos/unk/pad/...), chat_template
    chat_template.jinja     chat template; takes priority over tokenizer_config["chat_template"]
    config.json             bos_token_id / eos_token_id (int or list)
    generation_config.json  bos_token_id / eos_token_id (int or list)

Special tokens at the start and end of `encode` come from tokenizer.json's post-processor alone.
Like transformers v5, `add_bos_token` / `add_eos_token` in tokenizer_config.json are ignored when a
tokenizer.json exists, so a bos is never added twice. A rendered chat prompt usually already starts
with the bos text, so encode it with `add_special_tokens=False` (as vLLM does).

`clean_up_tokenization_spaces` is not applied on decode: transformers v5 ignores it for BPE
tokenizers, and it would make incremental decoding disagree with full decoding.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from runtime.sampling_params import InvalidRequestError

# Named special tokens in tokenizer_config.json (transformers' SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


# Texts longer than this (characters) are tokenized without the GIL (Tokenizer.encode), and the
# gateway and the worker tokenize prompts longer than this on a thread, not their event loop
LONG_TEXT_CHARS = 16_384


class TokenizerFileError(ValueError):
    """A tokenizer file exists but cannot be used. `path` names the file."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


class ChatTemplateError(ValueError):
    """The chat template failed on a conversation (jinja2's error is the cause): a sandbox
    violation, an undefined call. Its own raise_exception() is an InvalidRequestError."""


class NoChatTemplateError(ValueError):
    """The model ships no chat template, so chat messages cannot be turned into a prompt."""


class Tokenizer:
    """A model's tokenizer. Build it with `Tokenizer.from_dir`."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        special_tokens: dict[str, str],
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
        chat_templates: dict[str, str],
        source: str,
    ) -> None:
        self._backend = backend
        self.special_tokens = special_tokens  # "bos_token" -> "<s>", ...; templates see these
        self.bos_token_id = bos_token_id  # None if the model has no bos token
        self.eos_token_ids = eos_token_ids  # every id that ends generation (may be several)
        self.chat_templates = chat_templates  # name -> jinja source; "default" is the usual one
        self.source = source  # the directory it was loaded from, for messages
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)  # = len(AutoTokenizer)
        # Ids that decode(skip_special_tokens=True) drops: every added token marked special,
        # which includes the named ones (transformers' all_special_ids lists only the named ones).
        self.all_special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        # Byte-fallback tokens "<0xNN>": their text depends on the bytes around them.
        self.byte_fallback_ids = _byte_fallback_ids(backend)
        # byte-level BPE (GPT-2): a vocabulary string spells its bytes one character each
        decoder = backend.decoder
        self._byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()
        self._added_ids = frozenset(backend.get_added_tokens_decoder())
        self._template_cache: dict[str, Any] = {}  # source -> compiled (a jinja2.Template)

    # ----- loading -------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load from a model directory. Missing tokenizer.json -> FileNotFoundError; an
        unreadable or malformed file -> TokenizerFileError naming it."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file}: no tokenizer.json in the model directory")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises plain Exception on bad files
            raise TokenizerFileError(tokenizer_file, f"not a valid tokenizer.json ({e})") from e
        backend.no_truncation()
        backend.no_padding()
        _probe_encode(backend, tokenizer_file)

        tok_config = _read_json_object(root / "tokenizer_config.json")
        model_config = _read_json_object(root / "config.json")
        gen_config = _read_json_object(root / "generation_config.json")

        # A bos token tokenizer.json does not have would be added past its vocabulary (the
        # model's), and every prompt that holds or starts with it fails: refuse it here.
        bos_text = tok_config.get("bos_token")
        bos_text = bos_text.get("content") if isinstance(bos_text, dict) else bos_text
        if isinstance(bos_text, str) and backend.token_to_id(bos_text) is None:
            raise TokenizerFileError(
                root / "tokenizer_config.json",
                f'"bos_token" {bos_text!r} is not a token of tokenizer.json',
            )
        special_tokens = _register_special_tokens(
            backend, root / "tokenizer_config.json", tok_config
        )

        def token_id(name: str) -> int | None:
            text = special_tokens.get(name)
            return None if text is None else backend.token_to_id(text)

        bos_ids = _ids_field(root / "config.json", model_config, "bos_token_id")
        bos_ids += _ids_field(root / "generation_config.json", gen_config, "bos_token_id")
        bos_token_id = token_id("bos_token")
        if bos_token_id is None and bos_ids:
            bos_token_id = bos_ids[0]

        eos_ids = _ids_field(root / "config.json", model_config, "eos_token_id")
        eos_ids += _ids_field(root / "generation_config.json", gen_config, "eos_token_id")
        tok_eos = token_id("eos_token")
        if tok_eos is not None:
            eos_ids.append(tok_eos)

        return cls(
            backend,
            special_tokens=special_tokens,
            bos_token_id=bos_token_id,
            eos_token_ids=frozenset(eos_ids),
            chat_templates=_read_chat_templates(root, tok_config),
            source=str(root),
        )

    # ----- text <-> ids ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, wrapped as tokenizer.json's
        post-processor says (usually a leading bos). A text over LONG_TEXT_CHARS is tokenized
        without holding the GIL, so a server that tokenizes it on a thread keeps serving."""
        try:
            if len(text) > LONG_TEXT_CHARS:  # (tokenizers' `encode` holds the GIL throughout: a
                # MB of text stalled a server's event loop ~0.5 s, from a thread as from the loop;
                # its `encode_batch` releases it, and gives the same ids)
                batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
                long_ids: list[int] = batch[0].ids
                return long_ids
            ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as e:  # the Rust side raises plain Exception (a WordLevel tokenizer
            # whose unk_token is not in its vocabulary, on a word it does not have)
            if type(e) is not Exception:
                raise
            raise InvalidRequestError(
                "prompt", f"{self.source}/tokenizer.json cannot tokenize it ({e})"
            ) from e
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Vocabulary strings of `ids` ("▁Once", "<0xF0>", ...); "" for an unknown id."""
        return [self._backend.id_to_token(i) or "" for i in ids]

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes of a token that may hold part of a UTF-8 character: a byte-fallback
        token's one byte ("<0xF0>"), a byte-level BPE token's bytes (GPT-2's byte-to-unicode
        mapping undone: "ĠðŁ" is b" \\xf0\\x9f"); None for any other token, whose decoded text is
        whole (a SentencePiece piece: "▁" is a space)."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            return None
        if token_id in self.byte_fallback_ids:
            return bytes([int(token[3:5], 16)])
        if not self._byte_level or token_id in self._added_ids:
            return None
        try:
            return bytes(_UNICODE_TO_BYTE[c] for c in token)
        except KeyError:  # not a byte-level spelling after all
            return None

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def to_json_str(self) -> str:
        """The tokenizer as tokenizer.json text, special tokens from tokenizer_config.json
        included (the grammar engine builds its token trie from it)."""
        text: str = self._backend.to_str()
        return text

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    # ----- chat ----------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render `messages` into a prompt string with the model's chat template.

        Same variables as transformers: `messages`, `tools`, `documents` (None unless passed in
        `extra`), `add_generation_prompt`, the named special tokens (`bos_token`, ...), and any
        `extra` keyword. A template's `raise_exception(msg)` becomes an InvalidRequestError on
        "messages", since it reports a conversation the model cannot take.
        """
        template = self._compiled_template(self._template_source(tools))
        # As transformers does, a key set to None is left out ({"content": None} beside tool
        # calls): templates test whether a key is defined, and would render None as "None".
        messages = [
            {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
            for m in messages
        ]
        context: dict[str, Any] = {**self.special_tokens, "documents": None, **extra}
        context.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
        from runtime.chat_template import TemplateRaised, render

        try:
            return render(template, context)
        except TemplateRaised as e:
            raise InvalidRequestError("messages", str(e)) from e

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_templates)

    def chat_template_source(self, tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template `apply_chat_template` uses (the "tool_use" one when tools are
        given and the model has it); NoChatTemplateError when there is none."""
        return self._template_source(tools)

    @property
    def added_tokens(self) -> dict[str, int]:
        """Added tokens (special or not) as text -> id: markers such as "<tool_call>" or
        "[TOOL_CALLS]" that are one token."""
        return {t.content: i for i, t in self._backend.get_added_tokens_decoder().items()}

    def _template_source(self, tools: list[dict[str, Any]] | None) -> str:
        if not self.chat_templates:
            raise NoChatTemplateError(
                f"{self.source}: the model has no chat template (no chat_template.jinja and no "
                '"chat_template" in tokenizer_config.json); use the completions API instead'
            )
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        raise NoChatTemplateError(
            f"{self.source}: several chat templates {sorted(self.chat_templates)} and none is "
            '"default"'
        )

    def _compiled_template(self, source: str) -> Any:
        cache = self._template_cache
        if source not in cache:
            from runtime.chat_template import TemplateSyntaxError, compile_template

            try:
                cache[source] = compile_template(source)
            except (TemplateSyntaxError, RecursionError) as e:  # (nested past the parser's depth)
                raise TokenizerFileError(
                    Path(self.source), f"chat template does not compile: {e}"
                ) from e
        return cache[source]

    def check_chat_template(self) -> None:
        """Compile the chat template `apply_chat_template` uses without tools, now (importing
        jinja2): TokenizerFileError for one that does not compile, NoChatTemplateError for a
        model without one. It stays compiled for the first chat request."""
        self._compiled_template(self._template_source(None))

    def warm_chat_template(self) -> None:
        """check_chat_template, best effort (a worker does it once it serves, off its
        start-up's path; the gateway as it builds a tokenizer), so that the first chat request
        does not compile it: nothing raised for a model without one, or one that does not
        compile (its first chat request says why, as it did)."""
        with contextlib.suppress(TokenizerFileError, NoChatTemplateError):
            self.check_chat_template()


# ----- file reading ------------------------------------------------------------------------


# Encoded once at load: words, a digit, punctuation, and characters a small vocabulary lacks (a
# WordLevel tokenizer whose unk_token is not in its vocabulary fails on a word it does not have).
_PROBE_TEXT = "Hello world, 1 \u00e9\u4e2d\U0001f600 zqxjv"


def _probe_encode(backend: HFTokenizer, path: Path) -> None:
    """TokenizerFileError naming `path` if the tokenizer cannot encode a short text: one that
    fails there fails on requests, each with the Rust side's bare error."""
    try:
        backend.encode(_PROBE_TEXT, add_special_tokens=True)
    except Exception as e:  # the Rust side raises plain Exception
        raise TokenizerFileError(path, f"cannot tokenize a short text ({e})") from e


def _read_json_object(path: Path) -> dict[str, Any]:
    """An optional JSON object file: {} if absent, TokenizerFileError if unreadable."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # (RecursionError: nested too deep)
        raise TokenizerFileError(path, f"cannot read JSON ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerFileError(path, f"expected a JSON object, got {type(data).__name__}")
    return data


def _ids_field(path: Path, data: dict[str, Any], key: str) -> list[int]:
    """`data[key]` as a list of ids: absent/null -> [], int -> [int], list of int -> list."""
    value = data.get(key)
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return list(value)
    raise TokenizerFileError(path, f'"{key}" must be an integer or a list of integers')


def _token_text(path: Path, key: str, value: object) -> str:
    """A special token entry: a string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise TokenizerFileError(path, f'"{key}" must be a string or {{"content": ...}}')


def _register_special_tokens(
    backend: HFTokenizer, path: Path, config: dict[str, Any]
) -> dict[str, str]:
    """Named special tokens from tokenizer_config.json (`path`). As transformers v5 does, any of
    them (and any extra special token) that tokenizer.json lacks is added to `backend` as
    special, and so is a named one (also one of a dict of extra ones) that it has as a plain
    added token (decode's skip_special_tokens then drops it). Names are the standard ones plus
    model-specific "*_token" strings (image_token)."""
    named: dict[str, str] = {}
    for key, value in config.items():
        if value is None or not key.endswith("_token"):
            continue
        # Standard names must be well formed; other "*_token" keys only count when they look
        # like a token (so e.g. a stray "foo_token": 3 is not an error).
        looks_like_token = isinstance(value, str) or (
            isinstance(value, dict) and "content" in value
        )
        if key in _NAMED_SPECIAL_TOKENS or looks_like_token:
            named[key] = _token_text(path, key, value)
    by_name = list(named.values())
    extra: list[str] = []  # (listed, not named: one tokenizer.json has as plain stays plain)
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = config.get(key)
        items = value.values() if isinstance(value, dict) else value or []
        texts = [_token_text(path, key, v) for v in items]
        (by_name if isinstance(value, dict) else extra).extend(texts)

    added = backend.get_added_tokens_decoder().values()
    present, special = {t.content for t in added}, {t.content for t in added if t.special}
    missing = [t for t in by_name if t not in special]
    missing += [t for t in extra if t not in present]
    if missing:
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(missing)]
        )
    return named


def _read_chat_templates(root: Path, tok_config: dict[str, Any]) -> dict[str, str]:
    """name -> template. chat_template.jinja and additional_chat_templates/*.jinja win over
    tokenizer_config["chat_template"] (a string, or a list of {"name", "template"})."""
    templates: dict[str, str] = {}
    jinja_file = root / "chat_template.jinja"
    files = [("default", jinja_file)] if jinja_file.is_file() else []
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        files += [(f.name.removesuffix(".jinja"), f) for f in sorted(extra_dir.glob("*.jinja"))]
    for name, file in files:
        try:
            templates[name] = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerFileError(file, f"cannot read chat template ({e})") from e
    if templates:
        return templates

    value = tok_config.get("chat_template")
    path = root / "tokenizer_config.json"
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise TokenizerFileError(
        path, '"chat_template" must be a string or a list of {"name": ..., "template": ...}'
    )


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable Latin-1 bytes stand for themselves, the
    other bytes, in order, for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_UNICODE_TO_BYTE = _unicode_to_byte()


def _byte_fallback_ids(backend: HFTokenizer) -> frozenset[int]:
    """Ids of "<0xNN>" tokens when the model uses byte fallback, else empty."""
    if not getattr(backend.model, "byte_fallback", False):
        return frozenset()
    ids = set()
    for n in range(256):
        i = backend.token_to_id(f"<0x{n:02X}>")
        if i is not None:
            ids.add(i)
    return frozenset(ids)
