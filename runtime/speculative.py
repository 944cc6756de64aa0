"""Speculative decoding: propose a few tokens cheaply, verify them all in one forward pass.

    before a step     the proposer drafts up to k tokens for each decoding request
                      (`Request.spec_token_ids`); the controller picks k per request
    schedule          a decode with drafts is 1 + k tokens to compute, like any other tokens
    execute           the target model scores the last real token and the k drafts in one pass
                      (a prefill chunk over the cached context); `verify` keeps the drafts the
                      target agrees with and adds one token of its own
    update            accepted tokens are appended one by one (stop tokens, max_tokens and stop
                      strings end the request mid-draft); the KV of rejected drafts is rolled
                      back: `num_computed_tokens` stops before them, whole blocks are freed

Verification keeps the target's output distribution exactly (Leviathan et al., Chen et al.):
with the target's processed distribution p_i at draft position i (temperature, min_p, top_k,
top_p applied, as the sampler would) and a draft token d with draft probability q(d), d is
accepted with probability min(1, p_i(d) / q(d)); the first rejection is replaced by a draw from
max(p_i - q_i, 0) renormalised; when all k are accepted a bonus token is drawn from p_k. An
n-gram draft is a point mass (q(d) = 1): accept with probability p_i(d), else draw from p_i
without d. Greedy rows accept d iff it is the argmax, so greedy output is identical token for
token. Requests with repetition / presence / frequency penalties are not speculated (their
distribution depends on the tokens still being verified), nor are requests with a logit_bias
(verification would have to bias each draft position's target distribution, and the draft
model's, to keep the output exact: not worth it for what is mostly a ban list), nor requests
short of their min_tokens (the stop tokens the sampler holds back until then would need holding
back at each draft position: verification sees none of the request's state but its parameters).

Proposers (one interface, `Proposer`: propose for (request, k) pairs, forget a request):
- n-gram (prompt lookup): the longest suffix of the request's tokens (n from `ngram_max` down to
  `ngram_min`) that occurred before; the tokens that followed its latest earlier occurrence.
- draft model (runtime/draft.py): a small model sharing the target's tokenizer, with its own
  paged KV cache, runs k single-token steps; for sampled requests its processed distribution q
  at each draft (`Request.spec_draft_probs`) goes to `verify`. It is also given the requests
  whose target prefill is under way (and that will speculate after it), to compute its own KV
  of their prompts alongside the target's, so that they draft from their first decode steps.
Adaptive control (`SpecController`): each request's draft length follows its recent acceptance
(an exponential average of accepted drafts per step, plus one, between 1 and k; the full k again
as soon as a verification keeps every draft: copying is all or nothing); a request whose average
falls below `MIN_ACCEPTED` drafts per step (after `MIN_HISTORY` verifications) stops drafting
for `PAUSE_STEPS` steps, twice as long after each failed probe (up to `MAX_PAUSE_STEPS`), then
probes with one draft (a proposer that rarely agrees costs a few percent, not a fifth); no request
is speculated (nor a draft's prefill computed) while the step's decodes would exceed
`max_batch_tokens` tokens with their drafts (on a batch that large the forward pass is
compute-bound and drafts cost what they save).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from runtime.request import Request
from runtime.sampler import (
    GREEDY_TEMPERATURE_EPS,
    MASKED_BELOW,
    TokenLogprobs,
    chosen_first,
    truncation_threshold,
)
from runtime.sampling_params import SamplingParams

METHODS = ("ngram", "draft")
# SpeculativeConfig's integer settings
_COUNTS = ("num_tokens", "ngram_min", "ngram_max", "max_batch_tokens", "draft_kv_cache_bytes")


@dataclass(slots=True)
class SpeculativeConfig:
    method: str = "ngram"  # ngram (prompt lookup) or draft (a small draft model)
    num_tokens: int = 4  # most drafts per request per step (k)
    ngram_min: int = 2  # shortest suffix matched (n-gram)
    ngram_max: int = 4  # longest suffix matched (n-gram)
    max_batch_tokens: int = 32  # no speculation when decodes x (1 + k) would exceed this
    ema: float = 0.5  # weight of the newest step in a request's acceptance average
    draft_model: str | None = None  # the draft model's folder (method draft); same tokenizer
    draft_kv_cache_bytes: int = 64 * 2**20  # bytes for the draft model's own KV cache

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        # counts given from Python as other types passed here: 4.0 or 2.5 failed the engine's
        # first step with drafts (a TypeError in the proposer, every request in that step lost),
        # "4" failed start-up with a TypeError naming no setting (numpy's integers are integers;
        # a bool is not a count). The type refused is named: Decimal('0.5') is "a number in
        # (0, 1]" to its user, yet no numbers.Real (its float() rounds)
        for name in _COUNTS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise ValueError(
                    f"speculative {name} must be an integer, got {_shown(value)}, {_a(value)}"
                )
            setattr(self, name, int(value))
        if not isinstance(self.ema, numbers.Real) or isinstance(self.ema, bool):
            raise ValueError(
                f"speculative ema must be an int or float in (0, 1], got {_shown(self.ema)}, {_a(self.ema)}"
            )
        if not 0 < self.ema <= 1:  # (before float(): an int past its range raised OverflowError)
            raise ValueError(f"speculative ema must be in (0, 1], got {_shown(self.ema)}")
        self.ema = float(self.ema)
        if isinstance(self.draft_model, os.PathLike):
            self.draft_model = str(self.draft_model)
        if self.draft_model is not None and not isinstance(self.draft_model, str):
            raise ValueError(
                f"speculative draft_model must be a folder's path, got {_shown(self.draft_model)}"
            )
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model (the draft's folder)")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(
                f"speculative draft_model is for method 'draft', the method is {_shown(self.method)}"
            )
        if self.draft_kv_cache_bytes <= 0:
            raise ValueError(
                f"speculative draft_kv_cache_bytes must be > 0, got {_shown(self.draft_kv_cache_bytes)}"
            )
        if self.num_tokens < 1:
            raise ValueError(f"speculative num_tokens must be >= 1, got {_shown(self.num_tokens)}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {_shown(self.ngram_min)} and {_shown(self.ngram_max)}"
            )
        if self.max_batch_tokens < 1 + self.num_tokens:
            raise ValueError(
                f"speculative max_batch_tokens ({_shown(self.max_batch_tokens)}) must be at least "
                f"1 + num_tokens ({_shown(1 + self.num_tokens)})"
            )


def _shown(value: object) -> str:
    """repr(value) for an error, a huge integer by its size: Python refuses the repr of an int
    past 4,300 digits (a ValueError naming no setting)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        bits = abs(int(value)).bit_length()
        if bits > 128:
            return f"an integer of {bits} bits"
    return repr(value)


def _a(value: object) -> str:
    """A value's type for an error: "a Decimal", "an int"."""
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def ngram_propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of length n in [n_min, n_max]; [] when no such suffix occurred before."""
    size = len(tokens)
    if size < n_min + 1 or k < 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = arr[size - n :]
        # windows starting at 0 .. size-n-1: every earlier position, the suffix itself excluded
        windows = np.lib.stride_tricks.sliding_window_view(arr[: size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


class Proposer(Protocol):
    def propose(
        self,
        batch: list[tuple[Request, int]],
        running: list[Request],
        prefilling: Sequence[tuple[Request, int]] = (),
    ) -> None:
        """Set `spec_token_ids` (at most k) of each request in `batch`, and `spec_draft_probs`
        where the drafts were drawn from a distribution other than a point mass. `running`: every
        running request (state kept for any other may go). `prefilling`: running requests whose
        target prefill is under way and that will speculate once it ends, each with the most
        drafts it may then ask for; a proposer with a cache of its own may fill it over the
        tokens the target has computed meanwhile (no drafts for them this step)."""

    def forget(self, request_id: str) -> None:
        """The request finished (or was aborted): drop what is kept for it."""


def grammar_allowed(r: Request, drafts: list[int]) -> list[int]:
    """The leading drafts a constrained request's grammar accepts one after the other (all of
    them without a grammar): a draft the grammar refuses would be rejected by verification
    anyway, where the target's masked distribution gives it no mass, and so would every draft
    after it; proposing none of them spares their share of the step's forward pass."""
    g = r.grammar
    if g is None or not drafts:
        return drafts
    m = g.matcher
    return [] if m.is_error() else drafts[: m.validate_tokens(drafts)]


class NgramProposer:
    """Prompt lookup over the request's own tokens, cut where a request's grammar refuses a
    draft (`grammar_allowed`); nothing kept between steps."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(
        self,
        batch: list[tuple[Request, int]],
        running: list[Request],
        prefilling: Sequence[tuple[Request, int]] = (),
    ) -> None:
        for r, k in batch:
            drafts = ngram_propose(r.all_token_ids, k, self.n_min, self.n_max)
            r.spec_token_ids = grammar_allowed(r, drafts)

    def forget(self, request_id: str) -> None:
        pass


MIN_ACCEPTED = 0.3  # accepted drafts per verification below which a request pauses drafting
PAUSE_STEPS = 16  # steps a request decodes without drafts after its acceptance fell that low
MIN_HISTORY = 4  # verifications of a request before its acceptance can pause it
MAX_PAUSE_STEPS = 256  # the longest pause, after repeated failed probes


class SpecController:
    """Which requests speculate this step, and how many tokens each drafts."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer or NgramProposer(config.ngram_min, config.ngram_max)
        self._accept: dict[str, float] = {}  # request id -> average accepted drafts per step
        self._all: set[str] = set()  # requests whose last verification kept every draft
        self._paused: dict[str, int] = {}  # request id -> steps left without drafts
        self._seen: dict[str, int] = {}  # request id -> its verifications so far
        self._backoff: dict[str, int] = {}  # request id -> its next pause's length
        self.proposed = 0  # drafts verified, since start
        self.accepted = 0  # of those, accepted
        self.steps = 0  # verifications (request-steps with drafts), since start

    def propose(self, running: list[Request]) -> None:
        """Set `spec_token_ids` of every running request (most to [])."""
        cfg = self.config
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        for r in running:
            r.spec_token_ids, r.spec_draft_probs = [], None
        batch: list[tuple[Request, int]] = []
        prefilling: list[tuple[Request, int]] = []
        if len(decodes) * (1 + cfg.num_tokens) > cfg.max_batch_tokens:
            decodes = []  # compute-bound: drafts would cost what they save
        else:  # (compute-bound, a draft's prefill is spared too)
            for r in running:
                # (one held to min_tokens drafts only once it has them: min_tokens = max_tokens
                # never does, and its draft catches up when it begins, not beside its prefill)
                if (r.num_tokens - r.num_computed_tokens > 1 and r.params.min_tokens <= 1
                        and self._may_speculate(r)):  # fmt: skip
                    # the most it may draft at its first decode (the token its prefill samples
                    # counted in); none: no draft prefill (max_tokens 1, a full context)
                    k = min(cfg.num_tokens, self._room(r) - 1)
                    if k >= 1 and not self._paused.get(r.request_id, 0):
                        prefilling.append((r, k))
        for r in decodes:
            if len(r.output_token_ids) < r.params.min_tokens:
                continue  # (the sampler holds its stop tokens back: one token a step until then)
            if not self._may_speculate(r):
                continue
            left = self._paused.get(r.request_id, 0)
            if left:
                self._paused[r.request_id] = left - 1
                continue
            k = min(self._length(r.request_id), self._room(r))
            if k >= 1:
                batch.append((r, k))
        self.proposer.propose(batch, running, prefilling)

    @staticmethod
    def _may_speculate(r: Request) -> bool:
        p = r.params
        # a seeded sample must not depend on the batch: whether drafts ride along does (the
        # step's load decides), and verification draws from the seed's generator differently
        # from plain sampling
        return not (
            _has_penalty(p) or p.logit_bias or (p.seed is not None and p.temperature > 0)
        )

    def _room(self, r: Request) -> int:
        """The most drafts a decode of `r` may carry now: what max_tokens and the context leave
        after the token it samples."""
        return min(r.max_tokens - len(r.output_token_ids) - 1, self.max_model_len - r.num_tokens)

    def _length(self, request_id: str) -> int:
        avg = self._accept.get(request_id)
        if avg is None or request_id in self._all:
            return self.config.num_tokens  # no history, or copying right now: try the most
        return max(1, min(self.config.num_tokens, round(avg) + 1))

    def record(self, request: Request, proposed: int, accepted: int) -> None:
        """A verification: `accepted` of `proposed` drafts kept."""
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
        request.spec_proposed += proposed
        request.spec_accepted += accepted
        if accepted == proposed:
            self._all.add(request.request_id)
        else:
            self._all.discard(request.request_id)
        a = self.config.ema
        old = self._accept.get(request.request_id)
        avg = accepted if old is None else a * accepted + (1 - a) * old
        self._accept[request.request_id] = avg
        seen = self._seen[request.request_id] = self._seen.get(request.request_id, 0) + 1
        if avg < MIN_ACCEPTED and seen >= MIN_HISTORY:
            pause = self._backoff.get(request.request_id, PAUSE_STEPS)
            self._paused[request.request_id] = pause
            self._backoff[request.request_id] = min(2 * pause, MAX_PAUSE_STEPS)
        elif avg >= MIN_ACCEPTED:
            self._backoff.pop(request.request_id, None)

    def forget(self, request_id: str) -> None:
        self._accept.pop(request_id, None)
        self._all.discard(request_id)
        self._paused.pop(request_id, None)
        self._seen.pop(request_id, None)
        self._backoff.pop(request_id, None)
        self.proposer.forget(request_id)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


# ---------------------------------------------------------------------- verification
def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from for rows of `logits` (R, V) under `p`
    (temperature, then min_p, top_k, top_p), normalised. Not for greedy params."""
    probs = torch.softmax(logits / p.temperature, dim=-1)  # (R, V)
    # a grammar-masked token (-max) over a temperature past ~1e37 comes near the others (over
    # one float32 rounds to inf, to 0 as they do): kept out, as the sampler keeps it out
    probs = probs.masked_fill(logits < -MASKED_BELOW, 0.0)
    vocab = probs.shape[-1]
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * p.min_p, 0.0)
    if 0 < p.top_k < vocab or p.top_p < 1.0:
        # the sampler's rule and masses (runtime.sampler._sample_truncated): every token reaching
        # the threshold kept, ties included
        vals = torch.sort(probs, dim=-1, descending=True).values  # (R, V)
        if 0 < p.top_k < vocab:
            vals[:, p.top_k :] = 0.0
            total = vals.cumsum(dim=-1)[:, p.top_k - 1 : p.top_k]  # (R, 1)
        else:
            total = probs.sum(dim=-1, keepdim=True)
        top_p = torch.full_like(total, p.top_p if p.top_p < 1.0 else 2.0)
        threshold, _ = truncation_threshold(vals, total, top_p)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand(1, generator=generator))


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from unnormalised weights (V,) >= 0 with a positive entry."""
    cdf = weights.double().cumsum(0)
    u = _uniform(generator) * float(cdf[-1])
    i = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True))
    return min(i, int(torch.searchsorted(cdf, cdf[-1:], right=False)))


def verify(
    logits: torch.Tensor,
    drafts: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """Tokens to append after scoring `drafts`: `logits` (k+1, V) are the target's at the last
    real token and at each draft; `draft_probs` (k, V) the draft's distribution q each draft was
    drawn from, over the target's width V (a narrower draft's is 0 past its own vocabulary: the
    target's mass there comes from the correction max(p - q, 0) alone); None: point masses, as
    n-gram drafts are. Returns the accepted drafts and one more token (1..k+1)."""
    k = len(drafts)
    assert draft_probs is None or draft_probs.shape[-1] == logits.shape[-1], (
        f"q over {draft_probs.shape[-1]} ids, the target's logits over {logits.shape[-1]}"
    )
    out: list[int] = []
    if params.temperature < GREEDY_TEMPERATURE_EPS:
        best = logits.argmax(dim=-1).tolist()  # (k+1,)
        for i in range(k):
            if drafts[i] != best[i]:
                return [*out, best[i]]
            out.append(drafts[i])
        return [*out, best[k]]
    probs = target_probs(logits, params)  # (k+1, V)
    for i, d in enumerate(drafts):
        p_d = float(probs[i, d])
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if _uniform(generator) * q_d < p_d:  # accept with probability min(1, p(d) / q(d))
            out.append(d)
            continue
        if draft_probs is None:
            residual = probs[i].clone()
            residual[d] = 0.0  # max(p - q, 0) for a point mass q at d
        else:
            residual = (probs[i].double() - draft_probs[i].double()).clamp_(min=0.0)  # (V,)
            if float(residual.sum()) <= 0.0:  # p == q up to rounding: no rejection mass left
                residual = probs[i]
        return [*out, draw(residual, generator)]
    return [*out, draw(probs[k], generator)]


def logprobs_of(logits: torch.Tensor, tokens: list[int], count: int) -> list[TokenLogprobs]:
    """The sampler's logprobs (raw log_softmax, no penalties here) for `tokens`, one per row."""
    lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # (n, V)
    lp.masked_fill_(lp < -MASKED_BELOW, -math.inf)  # grammar-masked: -inf, as the sampler says
    chosen = lp.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
    top_vals: list[list[float]] = [[] for _ in tokens]
    top_ids: list[list[int]] = [[] for _ in tokens]
    if count > 0:
        top = torch.topk(lp, count, dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    return [  # (a tie ordered as the sampler orders it: the chosen token first among equals)
        TokenLogprobs(t, v, chosen_first(t, list(zip(top_ids[j], top_vals[j], strict=True))))
        for j, (t, v) in enumerate(zip(tokens, chosen, strict=True))
    ]
