"""Batched token sampler: one call per decode step picks the next token of every row.

Order of operations (vLLM semantics):

    logits (B, V) from the model
      -> grammar: tokens a row's token bitmask forbids get -max (structured output; the mask
         was filled beside the forward pass, runtime/structured_decoding.py)
      -> penalties: repetition (prompt + output), then frequency and presence (output only)
      -> logprobs: log_softmax of the penalized logits, before logit_bias, temperature and
         truncation
      -> logit_bias: each row's biases added to its tokens' logits (greedy rows too: +100
         forces a token, -100 bans it)
      -> min_tokens: a row with fewer output tokens than its min_tokens gets -inf for the
         end-of-sequence tokens and its stop_token_ids (unless that leaves its grammar nothing)
      -> greedy rows: argmax                     (temperature below 1e-5 counts as greedy)
      -> other rows: / temperature -> min_p -> top_k -> top_p -> draw

Logprobs are vLLM's default `raw_logprobs` for rows without penalties; for rows with penalties
they are taken after the penalties (vLLM's raw mode takes them before). Temperature, min_p, top_k,
top_p and min_tokens never change the reported logprobs (vLLM's min_tokens does not either: a stop
token it holds back keeps its logprob among the alternatives), nor does logit_bias (vLLM's default
raw logprobs are taken before it too; a token a +100 bias forced is reported with the logprob the
model gave it). vLLM adds logit_bias before the penalties, this sampler after them: they differ
only where a repetition penalty scales the logit of a biased token (here +100 still forces it).

Cost: this runs every step for batches of 64+ rows over a vocabulary of ~50k on a CPU, so each
feature costs only for the rows that use it.
- All rows greedy, no penalties, no logprobs: one `argmax`, nothing else.
- Penalties touch only the (row, token) pairs seen in the prompt / output (gather, scatter);
  logit_bias only its (row, token) pairs, added in place and put back after the draw.
- One softmax per sampled row; min_p, top_k and top_p then zero out weights.
- top_k / top_p work on sorted candidates from `torch.topk`: the top k, or for top_p alone the
  top 256 when they already hold top_p of the mass; only rows whose nucleus is wider than that
  sort the full vocabulary.
- The draw is inverse-CDF: one uniform number per row, a cumulative sum and a binary search.

Reproducibility: a row with its own `torch.Generator` (a seeded request) takes its uniform number
from it, one row at a time, and everything else it goes through is row-wise, so a seeded row gives
the same tokens whatever else is in the batch, given the same logits (the model's forward pass is
not batch-invariant to the last bit, even in float32: README, `--dtype`). All other rows share
one batched draw from torch's default generator.

Ending a request on a stop token or end-of-sequence is not the sampler's job (Request.check_stop);
it only keeps them from being drawn under min_tokens.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from runtime.sampling_params import SamplingParams

log = logging.getLogger("edgeinfer.sampler")

# Temperatures below this are treated as greedy: dividing by them overflows float32 logits.
GREEDY_TEMPERATURE_EPS = 1e-5
# Largest magnitude of a logit after the repetition penalty: finite even divided by
# GREEDY_TEMPERATURE_EPS (float32 overflows past 3.4e38).
PENALIZED_BOUND = 1e30
MASKED_BELOW = 1e37  # a logprob below -this is a grammar-masked token's (-max bias)

# Candidates tried first for rows with top_p but no top_k; wider nuclei fall back to a full sort.
_NUCLEUS_CANDIDATES = 256


@dataclass(slots=True)
class SamplingState:
    """One row of a batch, as the sampler sees it."""

    params: SamplingParams  # the request's sampling settings
    generator: torch.Generator | None  # per-sequence; seeded when params.seed is set, else None
    prompt_token_ids: list[int]  # the prompt, for the repetition penalty
    output_token_ids: list[int]  # tokens generated so far, for all three penalties
    token_bitmask: np.ndarray | None = None  # (ceil(V / 32),) int32, bit t set: token t is
    # allowed (a grammar's mask); None: every token


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of the chosen token and of the most likely alternatives."""

    token_id: int  # the sampled token
    logprob: float  # its log-probability (see the module docstring for which distribution)
    top: list[tuple[int, float]]  # the params.logprobs most likely (token id, logprob), best first
    rank: int | None = None  # the token's rank, 1 = the most likely (prompt logprobs: vLLM's
    # `rank`); None where not computed


@dataclass(slots=True)
class SamplerOutput:
    """The next token of every row, in batch order."""

    token_ids: list[int]  # one sampled token per row
    logprobs: list[TokenLogprobs | None]  # per row; None where params.logprobs is None


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature < GREEDY_TEMPERATURE_EPS


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _is_plain_greedy(p: SamplingParams) -> bool:
    return _is_greedy(p) and p.logprobs is None and not _has_penalty(p)


class Sampler:
    """Stateless; all per-sequence state lives in the `SamplingState` rows. `ext`: the CPU
    extension (`kernels.cpu_ext.load_fused()`) whose `argmax_rows` takes greedy rows' argmax (the
    same index as torch.argmax, ~7x faster over a large vocabulary), or None for torch's.
    `eos_token_ids`: the model's end-of-sequence tokens, which a row under its min_tokens may not
    draw (the engine sets them once it has read the model's and the tokenizer's)."""

    def __init__(
        self, ext: ModuleType | None = None, eos_token_ids: frozenset[int] = frozenset()
    ) -> None:
        self.ext = ext
        self.eos_token_ids = eos_token_ids

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if (self.ext is not None and logits.device.type == "cpu" and logits.dim() == 2
                and logits.dtype == torch.float32 and logits.is_contiguous()):  # fmt: skip
            return self.ext.argmax_rows(logits)  # type: ignore[no-any-return]
        return logits.argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """Pick one token per row. `logits` is (B, V) float32 and is not modified."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be (B, V) with B = len(states) = {len(states)}, "
                f"got {tuple(logits.shape)}"
            )
        params = [s.params for s in states]
        masked = [i for i, s in enumerate(states) if s.token_bitmask is not None]
        if masked:
            bitmask = np.stack([states[i].token_bitmask for i in masked])  # type: ignore[misc]
            logits = apply_token_bitmask(logits, bitmask, masked)
        plain = all(_is_plain_greedy(p) for p in params)
        if not plain and any(_has_penalty(p) for p in params):
            logits = apply_penalties(logits, states)
        # logit_bias: added in place at its (row, token) pairs, whose values are kept aside and
        # put back after the draw (the logprobs are of the logits before it)
        unbiased = None
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        if biased:
            at, bias = _bias_index(params, biased, logits.device, logits.dtype)
            unbiased = logits[at]  # (N,), a copy
            logits.index_put_(at, bias, accumulate=True)
        # Rows under their min_tokens: their stop tokens at -inf, in place, those rows kept
        # aside and put back after the draw (not a copy of the whole batch): the logprobs are
        # of the rows as they were (a held token keeps its logprob)
        held = [i for i, s in enumerate(states) if len(s.output_token_ids) < s.params.min_tokens]
        saved = None
        if held:
            held_t = torch.tensor(held, device=logits.device)
            saved = logits[held_t]  # (R, V), a copy
            logits[held_t] = self._hold_stops(logits, states, held)
        if plain:
            token_ids = self._argmax(logits)
            if saved is not None:
                logits[held_t] = saved
            if unbiased is not None:
                logits[at] = unbiased
            return SamplerOutput(token_ids.tolist(), [None] * len(states))

        sampled = [i for i, p in enumerate(params) if not _is_greedy(p)]
        if not sampled:
            token_ids = self._argmax(logits)  # (B,)
        elif len(sampled) == len(states):
            token_ids = _sample_rows(logits, states)
        else:
            device = logits.device
            greedy_t = torch.tensor(
                [i for i, p in enumerate(params) if _is_greedy(p)], device=device
            )
            sampled_t = torch.tensor(sampled, device=device)
            token_ids = torch.empty(len(states), dtype=torch.long, device=device)
            token_ids[greedy_t] = logits[greedy_t].argmax(dim=-1)
            token_ids[sampled_t] = _sample_rows(logits[sampled_t], [states[i] for i in sampled])

        if saved is not None:
            logits[held_t] = saved
        if unbiased is not None:
            logits[at] = unbiased
        out_logprobs: list[TokenLogprobs | None] = [None] * len(states)
        with_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        if with_logprobs:
            counts = [params[i].logprobs or 0 for i in with_logprobs]
            rows = _logprobs(logits, token_ids, with_logprobs, counts)
            for i, row in zip(with_logprobs, rows, strict=True):
                out_logprobs[i] = row
        return SamplerOutput(token_ids.tolist(), out_logprobs)

    def _hold_stops(
        self, logits: torch.Tensor, states: list[SamplingState], rows: list[int]
    ) -> torch.Tensor:
        """`rows` of `logits` (B, V), copied (R, V), each (under its min_tokens) with -inf for
        the tokens that would end it: end-of-sequence (with ignore_eos too, as vLLM holds it)
        and its stop_token_ids. A row whose grammar allows nothing else is left as it was: the
        constraint's end comes first (min_tokens cannot be met inside it)."""
        vocab = logits.shape[1]
        device = logits.device
        out = logits[torch.tensor(rows, device=device)]  # (R, V), a copy
        pairs = [
            (j, t)
            for j, i in enumerate(rows)
            for t in self.eos_token_ids.union(states[i].params.stop_token_ids)
            if 0 <= t < vocab
        ]
        if not pairs:
            return out
        original = out.clone() if any(states[i].token_bitmask is not None for i in rows) else None
        out[torch.tensor([j for j, _ in pairs], device=device),
            torch.tensor([t for _, t in pairs], device=device)] = -math.inf  # fmt: skip
        if original is not None:
            stuck = ~(out > -MASKED_BELOW).any(dim=-1)  # (R,) rows with nothing left
            out[stuck] = original[stuck]
        return out


# ----- grammar masks -----------------------------------------------------------------------


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: np.ndarray, rows: list[int] | None = None
) -> torch.Tensor:
    """A copy of `logits` (B, V) where each of `rows` (default: all, in order) has the tokens
    its row of `bitmask` (len(rows), ceil(V / 32)) int32 does not allow pushed to the float32
    minimum (or -inf): softmax gives them exactly 0, argmax never picks them. Bit t of word
    t // 32 is token t (little-endian words: unpacking the bytes little-bit-first gives the
    tokens in order); tokens past the mask are not allowed.

    Added as a bias (0 or -max) rather than masked_fill: one fused pass, ~3x faster on the CPU
    at 32 x 49k (1.7 ms against 5 ms)."""
    vocab = logits.shape[1]
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")  # (R, 32 W)
    if allowed.shape[1] < vocab:
        allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
    bias = torch.from_numpy(np.ascontiguousarray(allowed[:, :vocab])).to(logits.device)
    bias = bias.to(logits.dtype).sub_(1.0).mul_(torch.finfo(logits.dtype).max)  # (R, V)
    if rows is None:
        return logits + bias
    out = logits.clone()
    out.index_add_(0, torch.tensor(rows, device=logits.device), bias)
    return out


# ----- logit bias --------------------------------------------------------------------------


def _bias_index(
    params: list[SamplingParams], rows: list[int], device: torch.device, dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The (row, token) pairs of `rows`' logit_bias and their biases: ((N,), (N,)) long and
    (N,) `dtype`. Token ids were checked against the vocabulary (LLMEngine.prepare_request)."""
    row_of = [i for i in rows for _ in params[i].logit_bias]
    tokens = [t for i in rows for t in params[i].logit_bias]
    bias = [b for i in rows for b in params[i].logit_bias.values()]
    at = (torch.tensor(row_of, dtype=torch.long, device=device),
          torch.tensor(tokens, dtype=torch.long, device=device))  # fmt: skip
    return at, torch.tensor(bias, dtype=dtype, device=device)


# ----- penalties ---------------------------------------------------------------------------


def apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """A copy of `logits` (B, V) with each row's penalties applied (row i has states[i]).

    Repetition (CTRL): for tokens in prompt or output, positive logits are divided by the
    penalty and negative ones multiplied. Then `frequency * count + presence * (count > 0)` is
    subtracted, counting output tokens only. Only (row, token) pairs that occur are touched.
    """
    vocab = logits.shape[1]
    device = logits.device
    out = logits.clone()
    params = [s.params for s in states]

    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        seqs = [states[i].prompt_token_ids + states[i].output_token_ids for i in rep_rows]
        seen = torch.unique(_flat_keys(seqs, rep_rows, vocab, device))  # (N,) row * vocab + token
        rows, toks = seen // vocab, seen % vocab
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=out.dtype, device=device)
        rep = rep[rows]  # (N,)
        vals = out[rows, toks]
        # bounded: a penalty near 0 (or huge) would overflow float32 to +-inf, and an inf logit
        # makes the softmax NaN (1e30 stays finite divided by any temperature the sampler uses)
        # (a logit of 0 stays 0: 0 times a penalty that overflowed would be NaN)
        lowered = torch.where(vals < 0, vals * rep, vals)
        penalized = torch.where(vals > 0, vals / rep, lowered).clamp_(
            -PENALIZED_BOUND, PENALIZED_BOUND
        )
        # a token the grammar masked stays masked (the clamp lifted it to -1e30, which logprobs
        # then reported as a number, not -inf)
        out[rows, toks] = torch.where(vals < -MASKED_BELOW, vals, penalized)

    freq_rows = [
        i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if freq_rows:
        keys = _flat_keys([states[i].output_token_ids for i in freq_rows], freq_rows, vocab, device)
        uniq, counts = torch.unique(keys, return_counts=True)  # (N,), (N,)
        rows, toks = uniq // vocab, uniq % vocab
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=out.dtype, device=device)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=out.dtype, device=device)
        freq, pres = freq[rows], pres[rows]  # (N,)
        out[rows, toks] -= freq * counts.to(out.dtype) + pres
    return out


def _flat_keys(
    seqs: list[list[int]], rows: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """All tokens of seqs[j] as keys `rows[j] * vocab + token`, one flat int64 tensor."""
    flat = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.long, device=device)
    row_of = torch.repeat_interleave(
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor([len(s) for s in seqs], device=device),
    )
    return row_of * vocab + flat


# ----- sampling ----------------------------------------------------------------------------


def _sample_rows(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Draw one token per row of `logits` (R, V), all rows non-greedy. Returns (R,) long."""
    device = logits.device
    vocab = logits.shape[1]
    params = [s.params for s in states]
    temps = [p.temperature for p in params]
    if all(t == 1.0 for t in temps):
        probs = torch.softmax(logits, dim=-1)  # (R, V)
    else:
        t = torch.tensor(temps, dtype=logits.dtype, device=device).unsqueeze(1)  # (R, 1)
        probs = torch.softmax(logits / t, dim=-1)  # (R, V)
        if any(s.token_bitmask is not None for s in states):
            # a grammar-masked token (-max) over a temperature past ~1e37 came near the others
            # (over one float32 rounds to inf, to 0 as they do) and was drawn: kept out here
            probs.masked_fill_(logits < -MASKED_BELOW, 0.0)

    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=device)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # (R, 1)
        probs.masked_fill_(probs < threshold, 0.0)  # weights from here on: no longer sum to 1

    truncated = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if not truncated:
        return _draw(probs, [s.generator for s in states])
    if len(truncated) == len(states):
        return _sample_truncated(probs, states, min_width=0)
    truncated_set = set(truncated)
    plain = [j for j in range(len(states)) if j not in truncated_set]
    plain_t = torch.tensor(plain, device=device)
    truncated_t = torch.tensor(truncated, device=device)
    token_ids = torch.empty(len(states), dtype=torch.long, device=device)
    token_ids[plain_t] = _draw(probs[plain_t], [states[j].generator for j in plain])
    token_ids[truncated_t] = _sample_truncated(
        probs[truncated_t], [states[j] for j in truncated], min_width=0
    )
    return token_ids


def _sample_truncated(
    weights: torch.Tensor, states: list[SamplingState], min_width: int
) -> torch.Tensor:
    """Draw from rows of `weights` (R, V) >= 0 that use top_k and/or top_p.

    A row keeps the tokens whose weight reaches its threshold: the smallest weight among its top
    k (top_k), and among the nucleus, the most likely tokens in descending order up to and
    including the one that brings their mass to top_p (so the most likely token always
    survives). Tokens tied with the threshold all stay, and the draw runs over the row in
    vocabulary order: a seeded draw depends on the row alone, not on the rows beside it (torch's
    topk orders tied weights differently at different widths, and the width is the batch's
    largest top_k; tied logits are common in bfloat16). The thresholds come from the top
    `max(min_width, _NUCLEUS_CANDIDATES)` weights (top_k's for a top_k row); a row whose nucleus
    reaches past them is done again with 8 times as many, up to its whole vocabulary (straight
    to the whole, a sort of every row, took 125 ms for 64 flat rows of SmolLM2's vocabulary at
    top_p 0.9; 36 ms this way).
    """
    device = weights.device
    vocab = weights.shape[1]
    params = [s.params for s in states]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    has_k = [k < vocab for k in ks]
    width = max(k for k in ks if k < vocab) if any(has_k) else 0
    if not all(has_k):
        width = max(width, min_width, _NUCLEUS_CANDIDATES)
    width = min(width, vocab)

    cand, idx = torch.topk(weights, width, dim=-1)  # (R, C), descending (ties in any order)
    ks_t = torch.tensor(ks, device=device).unsqueeze(1)  # (R, 1)
    cand.masked_fill_(torch.arange(width, device=device) >= ks_t, 0.0)  # top_k
    # Mass to normalize by: a top_k row's k candidates', summed in order (a cumsum: the same
    # float32 sum at any width, where sum() groups by the width), the whole row's otherwise.
    no_k = [j for j, h in enumerate(has_k) if not h]
    total = cand.cumsum(dim=-1).gather(1, ks_t.clamp(max=width) - 1).squeeze(1)  # (R,)
    if no_k:
        no_k_t = torch.tensor(no_k, device=device)
        total[no_k_t] = weights[no_k_t].sum(dim=-1)
    # top_p of 1 means "off": a threshold above 1 keeps every candidate despite rounding.
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=device)
    threshold, cum = truncation_threshold(cand, total.unsqueeze(1), top_p.unsqueeze(1))

    covered = [True] * len(states)
    if no_k and width < vocab:
        short = (cum[:, -1] < top_p).tolist()  # nucleus extends past the candidates
        covered = [has_k[j] or not short[j] for j in range(len(states))]
    if all(covered):
        return _draw_kept(weights, cand, idx, threshold, [s.generator for s in states])

    token_ids = torch.empty(len(states), dtype=torch.long, device=device)
    ok = [j for j, c in enumerate(covered) if c]
    wide = [j for j, c in enumerate(covered) if not c]
    if ok:
        ok_t = torch.tensor(ok, device=device)
        token_ids[ok_t] = _draw_kept(
            weights[ok_t], cand[ok_t], idx[ok_t], threshold[ok_t],
            [states[j].generator for j in ok],
        )  # fmt: skip
    wide_t = torch.tensor(wide, device=device)
    token_ids[wide_t] = _sample_truncated(
        weights[wide_t], [states[j] for j in wide], min_width=min(vocab, 8 * width)
    )
    return token_ids


def truncation_threshold(
    cand: torch.Tensor, total: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest weight each row keeps under top_k and top_p (the sampler's rule, which
    speculative decoding's target distribution shares): `cand` (R, C) the row's largest weights
    in descending order, zero past its top_k; `total` (R, 1) the mass top_p is a share of;
    `top_p` (R, 1), above 1 for off. A candidate survives while the share before it is under
    top_p (the first always does). Returns (threshold (R, 1), the cumulative shares (R, C))."""
    probs = cand / total
    cum = probs.cumsum(dim=-1)
    survives = (cum - probs < top_p) & (cand > 0)  # a prefix of each row
    last = (survives.sum(dim=-1, keepdim=True) - 1).clamp_(min=0)
    return cand.gather(1, last), cum


def _draw_kept(
    weights: torch.Tensor,
    cand: torch.Tensor,
    idx: torch.Tensor,
    threshold: torch.Tensor,
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """One draw per row of `weights` (R, V) over the tokens whose weight reaches the row's
    `threshold` (R, 1), in vocabulary order. `cand`, `idx` (R, C): the row's top C weights and
    their tokens; where they hold every kept token (all but a tie straddling the C-th place,
    or C = V), the draw runs over those, sorted by token, not over the whole row."""
    vocab = weights.shape[1]
    in_cand = cand >= threshold  # (R, C)
    if cand.shape[1] == vocab:
        whole = torch.ones(weights.shape[0], dtype=torch.bool, device=weights.device)
    else:
        whole = (weights >= threshold).sum(dim=-1) != in_cand.sum(dim=-1)  # (R,)
        # a NaN row (no threshold): the whole row's draw, which logs it and stays in the row
        whole |= ~(threshold.squeeze(1) > 0)
    token_ids = torch.empty(weights.shape[0], dtype=torch.long, device=weights.device)
    some = (~whole).nonzero().squeeze(1).tolist()
    if some:
        every = len(some) == len(generators)  # (the common case: no copies of the rows)
        some_t = torch.tensor(some, device=weights.device)
        keep, ids, rows = (in_cand, idx, weights) if every else (
            in_cand[some_t], idx[some_t], weights[some_t])  # fmt: skip
        ids = torch.sort(torch.where(keep, ids, vocab), dim=-1).values
        w = torch.where(ids < vocab, rows.gather(1, ids.clamp(max=vocab - 1)), 0.0)
        choice = _draw(w, [generators[j] for j in some])
        token_ids[some_t] = ids.gather(1, choice.unsqueeze(1)).squeeze(1)
    if len(some) < len(generators):  # the kept tokens from the whole row
        rows = whole.nonzero().squeeze(1)
        full = weights[rows]
        token_ids[rows] = _draw(
            full.masked_fill_(full < threshold[rows], 0.0), [generators[j] for j in rows.tolist()]
        )
    return token_ids


def _draw(weights: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Index of one draw per row from unnormalized weights (R, C) >= 0, each row with a positive
    entry: inverse CDF with one uniform number per row. Consumes `weights`."""
    rows = weights.shape[0]
    device = weights.device
    cdf = torch.cumsum(weights, dim=-1, out=weights)  # (R, C)
    total = cdf[:, -1:].contiguous()  # (R, 1)
    u = torch.empty(rows, 1, dtype=cdf.dtype, device=device)
    shared = [j for j, g in enumerate(generators) if g is None]
    if len(shared) == rows:
        u.uniform_()
    else:
        if shared:
            shared_t = torch.tensor(shared, device=device)
            u[shared_t] = torch.rand(len(shared), 1, dtype=u.dtype, device=device)
        for j, g in enumerate(generators):
            if g is not None:
                u[j] = torch.rand(1, generator=g, dtype=u.dtype, device=device)
    # First index whose cdf exceeds u * total: never a zero-weight token. `last` (the first index
    # reaching the total) guards the case where rounding makes u * total == total.
    picked = torch.searchsorted(cdf, u * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)
    picked = torch.minimum(picked, last).squeeze(1)
    if not bool(torch.isfinite(total).all()):  # a NaN weight: never an index past the row
        log.error("sampling: non-finite weights in %d row(s)", int((~torch.isfinite(total)).sum()))
        picked.clamp_(max=cdf.shape[1] - 1)
    return picked


# ----- logprobs ----------------------------------------------------------------------------


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, rows: list[int], counts: list[int]
) -> list[TokenLogprobs]:
    """Logprob of each row's chosen token and its `counts[j]` best alternatives."""
    rows_t = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[rows_t].float(), dim=-1)  # (R, V)
    # a token the grammar rules out carries the mask's -max bias (apply_bitmask), not -inf: its
    # logprob is -inf, as it is sampled (never); penalties stay within PENALIZED_BOUND
    lp.masked_fill_(lp < -MASKED_BELOW, -math.inf)
    chosen = token_ids[rows_t]  # (R,)
    chosen_lp: list[float] = lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    top_vals: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    kmax = max(counts)
    if kmax > 0:
        top = torch.topk(lp, kmax, dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprobs(
            token_id=tok,
            logprob=tok_lp,
            top=chosen_first(
                tok, list(zip(top_ids[j][: counts[j]], top_vals[j][: counts[j]], strict=True))
            ),
        )
        for j, (tok, tok_lp) in enumerate(zip(chosen.tolist(), chosen_lp, strict=True))
    ]


def chosen_first(token: int, top: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """`top` (descending) with the chosen token first among those of its exact logprob: topk
    orders a tie as it likes, and a greedy pick listed below a token of the same logprob reads
    as a pick of the second best (ties are common in bfloat16 logits)."""
    at = next((i for i, (t, _) in enumerate(top) if t == token), None)
    if at is None:
        return top
    first = next(i for i, (_, v) in enumerate(top) if v == top[at][1])
    return [*top[:first], top[at], *top[first:at], *top[at + 1 :]]
