"""Per-request sampling settings, validated before a request reaches the scheduler."""

from __future__ import annotations

import math
import numbers
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.structured import StructuredOutputsParams


# The largest repetition penalty taken: larger ones turn a logit of 0 times it into NaN in float32
# (and no model's answer changes past a few units anyway).
MAX_REPETITION_PENALTY = 1e4
# logit_bias: the most entries taken (OpenAI's documented limit), and the bound on each bias
# (OpenAI's and vLLM's: -100 bans a token in practice, +100 forces it)
MAX_LOGIT_BIAS_TOKENS = 300
MAX_LOGIT_BIAS = 100.0
MAX_LOGPROBS = 20  # top alternatives per token, for logprobs and prompt_logprobs


class InvalidRequestError(ValueError):
    """Bad user input. `param` names the offending field; the message states the limit;
    `code`, where OpenAI has one for the case (context_length_exceeded).

    The gateway maps this to an OpenAI-style 400 error with `error.param` set.
    """

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message
        self.code = code


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request (OpenAI / vLLM semantics).

    `temperature == 0` means greedy. `top_k == -1` (or 0) disables top-k.
    """

    n: int = 1  # number of independent completions for the prompt
    max_tokens: int | None = 16  # tokens to generate; None = up to the context length
    min_tokens: int = 0  # tokens generated before end-of-sequence, a stop token or a stop
    # string may end the request (those tokens cannot be sampled until then), <= max_tokens
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass, in (0, 1]
    top_k: int = -1  # keep the k most likely tokens (and any tied with the k-th); -1 or 0 = all
    min_p: float = 0.0  # drop tokens below min_p * p(most likely), in [0, 1]
    seed: int | None = None  # same seed, same output
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in prompt or output (CTRL style)
    presence_penalty: float = (
        0.0  # subtracted once from logits of tokens already generated, [-2, 2]
    )
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output, [-2, 2]
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the output;
    # a string is one, None none
    stop_token_ids: list[int] = field(default_factory=list)  # extra tokens that end the request
    # (None: none)
    ignore_eos: bool = False  # keep generating past the model's end-of-sequence token
    logprobs: int | None = None  # return the sampled token's logprob and this many top alternatives
    # the prompt's logprobs (vLLM's prompt_logprobs): each prompt token's (the first has none)
    # and this many top alternatives; computed over the whole prompt (never from the prefix
    # cache), raw (the model's log_softmax)
    prompt_logprobs: int | None = None
    # token id -> bias added to its logit before sampling, in [-100, 100] (OpenAI's logit_bias;
    # JSON's string keys are taken: "50256"); zero biases are dropped. Logprobs are of the logits
    # before it (vLLM's raw logprobs). At most MAX_LOGIT_BIAS_TOKENS entries; ids are checked
    # against the model's vocabulary by the engine
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    # what the output must match (JSON schema, regex, choice, grammar): runtime/structured.py;
    # a dict as it arrives from the gateway becomes a StructuredOutputsParams
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    # vLLM's SamplingParams arguments that edgeinfer takes only at the value that is what it
    # does (its default; best_of 1 or n); any other is refused, naming the argument, where a
    # TypeError said only that the argument is unknown. Init-only: not fields, so not among
    # what the gateway sends the worker (`sampling`, every field); read back, each is its
    # default. (`_vllm_extras` checks them.)
    best_of: InitVar[int | None] = None
    skip_special_tokens: InitVar[bool] = True
    spaces_between_special_tokens: InitVar[bool] = True
    detokenize: InitVar[bool] = True
    truncate_prompt_tokens: InitVar[int | None] = None
    bad_words: InitVar[list[str] | None] = None
    allowed_token_ids: InitVar[list[int] | None] = None

    def __post_init__(
        self,
        best_of: int | None,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
        detokenize: bool,
        truncate_prompt_tokens: int | None,
        bad_words: list[str] | None,
        allowed_token_ids: list[int] | None,
    ) -> None:
        self.validate()
        _vllm_extras(self.n, best_of, skip_special_tokens, spaces_between_special_tokens,
                     detokenize, truncate_prompt_tokens, bad_words, allowed_token_ids)  # fmt: skip

    def validate(self) -> None:
        if isinstance(self.stop, str):  # (here, not only at init: one set later is taken too)
            self.stop = [self.stop]
        elif self.stop is None:  # (vLLM's default, and what OpenAI's null means)
            self.stop = []
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        self.n = _int_field("n", self.n)
        if self.n < 1 or self.n > 128:
            raise InvalidRequestError("n", f"must be in [1, 128], got {self.n}")
        if self.max_tokens is not None:
            self.max_tokens = _int_field("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise InvalidRequestError(
                    "max_tokens", f"must be at least 1, got {self.max_tokens}"
                )
        self.min_tokens = _int_field("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise InvalidRequestError("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens",
                f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        self.temperature = _num_field("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        self.top_p = _num_field("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        self.top_k = _int_field("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidRequestError("top_k", f"must be -1 (disabled) or >= 0, got {self.top_k}")
        self.min_p = _num_field("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = _int_field("seed", self.seed)
            if not -(2**63) <= self.seed < 2**63:  # (OpenAI's range; the engine mixes it with
                # the sequence's index into the 64 bits torch's generators take)
                raise InvalidRequestError(
                    "seed", f"must be a 64-bit signed integer, in [-2**63, 2**63), got {self.seed}"
                )
        self.repetition_penalty = _num_field("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(
                "repetition_penalty",
                f"must be > 0 and at most {MAX_REPETITION_PENALTY:g}, got {self.repetition_penalty}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _num_field(name, getattr(self, name))
            setattr(self, name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty")
        if len(self.stop) > 16:
            raise InvalidRequestError("stop", f"at most 16 stop strings, got {len(self.stop)}")
        if not isinstance(self.stop_token_ids, list):
            raise InvalidRequestError("stop_token_ids", "must be a list of integers")
        self.stop_token_ids = [_int_field("stop_token_ids", t) for t in self.stop_token_ids]
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                value = _int_field(name, value)
                setattr(self, name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise InvalidRequestError(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        self.logit_bias = _logit_bias(self.logit_bias)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            value = getattr(self, name)  # ("no" is true: it kept stop strings, say)
            if not isinstance(value, bool):
                raise InvalidRequestError(name, f"must be true or false, got {value!r}")
        if self.structured_outputs is not None:
            from runtime.structured import StructuredOutputsParams

            self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
            self.structured_outputs.validate()

    @property
    def greedy(self) -> bool:
        # The sampler treats temperatures this small as greedy too (dividing by them overflows).
        return self.temperature < 1e-5


def _vllm_extras(
    n: int,
    best_of: int | None,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
    detokenize: bool,
    truncate_prompt_tokens: int | None,
    bad_words: list[str] | None,
    allowed_token_ids: list[int] | None,
) -> None:
    """vLLM's arguments edgeinfer has no other value of: each at what edgeinfer does, or an
    InvalidRequestError naming it ("not supported by edgeinfer") rather than a wrong answer."""
    if best_of is not None and _int_field("best_of", best_of) not in (1, n):  # (the gateway's)
        raise InvalidRequestError(
            "best_of", f"only None, 1 or n ({n}) is supported by edgeinfer (every completion "
            f"sampled is returned; none is picked by its logprob), got {best_of}"
        )  # fmt: skip
    for name, value, meaning in (
        ("skip_special_tokens", skip_special_tokens,
         "special tokens are always left out of the text; their ids are in token_ids"),
        ("spaces_between_special_tokens", spaces_between_special_tokens,
         "the text is the tokenizer's decoding"),
        ("detokenize", detokenize, "every completion's text is made as it is generated"),
    ):  # fmt: skip
        if not isinstance(value, bool):
            raise InvalidRequestError(name, f"must be true or false, got {value!r}")
        if not value:
            raise InvalidRequestError(name, f"False is not supported by edgeinfer ({meaning})")
    if truncate_prompt_tokens is not None:
        raise InvalidRequestError(
            "truncate_prompt_tokens", "is not supported by edgeinfer; give the prompt's last "
            "k token ids as the prompt (llm.get_tokenizer().encode(prompt)[-k:])"
        )  # fmt: skip
    if bad_words:
        raise InvalidRequestError(
            "bad_words", "is not supported by edgeinfer; logit_bias of -100 bans single tokens"
        )
    if allowed_token_ids is not None:
        raise InvalidRequestError(
            "allowed_token_ids", "is not supported by edgeinfer; structured_outputs (a regex, a "
            "choice, a grammar) constrains what may be generated"
        )  # fmt: skip


def _logit_bias(value: object) -> dict[int, float]:
    """`logit_bias` as {token id: nonzero float bias}: a mapping (None: none) of at most
    MAX_LOGIT_BIAS_TOKENS entries, each key a token id >= 0 (an integer, or a string of one, as
    JSON's object keys are), each value a finite number in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError(
            "logit_bias", f"must be an object mapping token ids to biases, got {type(value).__name__}"
        )
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequestError(
            "logit_bias", f"at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(value)}"
        )
    out: dict[int, float] = {}
    seen: set[int] = set()
    for key, bias in value.items():
        if isinstance(key, str):
            if not (key.isascii() and key.isdigit()) or len(key) > 19:
                raise InvalidRequestError(
                    "logit_bias", f"keys must be token ids (integers >= 0), got {key[:40]!r}"
                )
            token = int(key)
        else:
            token = _int_field("logit_bias", key)
        if token < 0:
            raise InvalidRequestError("logit_bias", f"token ids must be >= 0, got {token}")
        try:
            number = float(_num_field("logit_bias", bias))
        except InvalidRequestError as e:
            raise InvalidRequestError("logit_bias", f"token {token}: {e.message}") from None
        if not -MAX_LOGIT_BIAS <= number <= MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                "logit_bias", f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {number:g} for token {token}",
            )  # fmt: skip
        if token in seen:
            raise InvalidRequestError("logit_bias", f"token {token} is given twice")
        seen.add(token)
        if number != 0.0:
            out[token] = number
    return out


def _int_field(name: str, value: object) -> int:
    """`value` as a Python int, if it is an integer (numpy's are too; a bool is not: True was
    taken for 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequestError(name, f"must be an integer, got {type(value).__name__}")
    value = int(value)  # (numpy's int64 was refused: "must be an integer, got int64")
    # (an integer past 64 bits means nothing here, and the messages that printed one past 4,300
    # digits raised ValueError: str() refuses it)
    if not -(2**63) <= value < 2**64:
        raise InvalidRequestError(
            name, f"must fit in 64 bits, got an integer of {value.bit_length()} bits"
        )
    return value


def _num_field(name: str, value: object) -> int | float:
    """`value` as a Python int or float, if it is a real number (numpy's are too: float32 was
    refused; a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequestError(name, f"must be a number, got {type(value).__name__}")
    if isinstance(value, numbers.Integral):
        value = int(value)
        if value.bit_length() >= 1024:  # (math.isfinite: OverflowError)
            raise InvalidRequestError(
                name, f"must be a finite number, got an integer of {value.bit_length()} bits"
            )
    else:
        try:
            value = float(value)
        except (OverflowError, ValueError) as e:  # (a Fraction past float's range)
            raise InvalidRequestError(name, f"must be a finite number ({e})") from None
    if not math.isfinite(value):
        raise InvalidRequestError(name, f"must be a finite number, got {value}")
    return value


def check_text(param: str, text: str) -> None:
    """InvalidRequestError naming `param` when `text` is not Unicode that UTF-8 can encode: it
    holds a lone surrogate, as Python decodes bytes that are not UTF-8 in a command-line
    argument, stdin or a file name (the tokenizer would fail with a TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = text[e.start]
        byte = (f" (byte 0x{ord(c) - 0xDC00:02x}, which is not UTF-8: text in another "
                "encoding?)" if 0xDC80 <= ord(c) <= 0xDCFF else "")  # fmt: skip
        raise InvalidRequestError(
            param, f"is not UTF-8 text: character {e.start} is {c!r}, a lone surrogate{byte}; "
            "give UTF-8 text (iconv -t UTF-8 converts a file)"
        ) from None  # fmt: skip
