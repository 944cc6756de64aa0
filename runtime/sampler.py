"""Batched token sampler: one call per decode step picks the next token of every row.

Order of operations (vLLM semantics):

    logits (B, V) from the model
      -> penalties: repetition (prompt + output), then frequency and presence (output only)
      -> logprobs: log_softmax of the penalized logits, before temperature and truncation
      -> greedy rows: argmax                     (temperature below 1e-5 counts as greedy)
      -> other rows: / temperature -> min_p -> top_k -> top_p -> draw

Logprobs follow vLLM's default `raw_logprobs` mode for rows without penalties; for rows with
penalties they are taken after the penalties (vLLM's raw mode takes them before). Temperature,
min_p, top_k and top_p never change the reported logprobs.

The draw is an exponential race, `argmax(probs / q)` with `q ~ Exp(1)`, which picks token i with
probability probs[i]. Rows with their own `torch.Generator` (seeded requests) draw `q` from it, one
row at a time, so a seeded row gives the same tokens whatever else is in the batch; all other rows
share one batched draw from torch's default generator.

Fast path: when every row is greedy with no penalties and no logprobs, the whole call is one
`argmax`. Elsewhere, each feature costs only for the rows that use it: penalty tensors are built
for penalized rows only, top_k uses `torch.topk`, and the full vocabulary is sorted only for rows
that ask for top_p without top_k.

Stop tokens and end-of-sequence handling are not the sampler's job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.sampling_params import SamplingParams

# Temperatures below this are treated as greedy: dividing by them overflows float32 logits.
GREEDY_TEMPERATURE_EPS = 1e-5

_TINY = torch.finfo(torch.float32).tiny  # floor for q, so probs / q never divides by zero


@dataclass(slots=True)
class SamplingState:
    """One row of a batch, as the sampler sees it."""

    params: SamplingParams  # the request's sampling settings
    generator: torch.Generator | None  # per-sequence; seeded when params.seed is set, else None
    prompt_token_ids: list[int]  # the prompt, for the repetition penalty
    output_token_ids: list[int]  # tokens generated so far, for all three penalties


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of the chosen token and of the most likely alternatives."""

    token_id: int  # the sampled token
    logprob: float  # its log-probability (see the module docstring for which distribution)
    top: list[tuple[int, float]]  # the params.logprobs most likely (token id, logprob), best first


@dataclass(slots=True)
class SamplerOutput:
    """The next token of every row, in batch order."""

    token_ids: list[int]  # one sampled token per row
    logprobs: list[TokenLogprobs | None]  # per row; None where params.logprobs is None


def _is_plain_greedy(p: SamplingParams) -> bool:
    return (
        p.temperature < GREEDY_TEMPERATURE_EPS
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
    )


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class Sampler:
    """Stateless; all per-sequence state lives in the `SamplingState` rows."""

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """Pick one token per row. `logits` is (B, V) float32 and is not modified."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be (B, V) with B = len(states) = {len(states)}, "
                f"got {tuple(logits.shape)}"
            )
        params = [s.params for s in states]
        if all(_is_plain_greedy(p) for p in params):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(states))

        penalized = [i for i, p in enumerate(params) if _has_penalty(p)]
        if penalized:
            logits = apply_penalties(logits, [states[i] for i in penalized], penalized)

        greedy = [i for i, p in enumerate(params) if p.temperature < GREEDY_TEMPERATURE_EPS]
        if len(greedy) == len(states):
            token_ids = logits.argmax(dim=-1)  # (B,)
        else:
            token_ids = torch.empty(len(states), dtype=torch.long, device=logits.device)
            if greedy:
                greedy_t = torch.tensor(greedy, device=logits.device)
                token_ids[greedy_t] = logits[greedy_t].argmax(dim=-1)
            sampled = [i for i, p in enumerate(params) if p.temperature >= GREEDY_TEMPERATURE_EPS]
            sampled_t = torch.tensor(sampled, device=logits.device)
            token_ids[sampled_t] = _sample_rows(logits[sampled_t], [states[i] for i in sampled])

        with_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        out_logprobs: list[TokenLogprobs | None] = [None] * len(states)
        if with_logprobs:
            counts = [params[i].logprobs or 0 for i in with_logprobs]
            rows = _logprobs(logits, token_ids, with_logprobs, counts)
            for i, row in zip(with_logprobs, rows, strict=True):
                out_logprobs[i] = row
        return SamplerOutput(token_ids.tolist(), out_logprobs)


def apply_penalties(
    logits: torch.Tensor, states: list[SamplingState], rows: list[int]
) -> torch.Tensor:
    """Return a copy of `logits` with penalties applied to `rows` (states[j] belongs to rows[j]).

    Repetition (CTRL): for tokens in prompt or output, positive logits are divided by the
    penalty and negative ones multiplied. Then `frequency * count + presence * (count > 0)` is
    subtracted, counting output tokens only.
    """
    vocab = logits.shape[1]
    device = logits.device
    rows_t = torch.tensor(rows, device=device)
    x = logits[rows_t]  # (R, V), a copy
    # Output token counts, (R, V): pad ragged lists with an extra "vocab" column, then drop it.
    out_ids = _padded([s.output_token_ids for s in states], pad=vocab, device=device)
    counts = torch.zeros(len(rows), vocab + 1, dtype=x.dtype, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=x.dtype))
    counts = counts[:, :vocab]  # (R, V)

    rep = torch.tensor([s.params.repetition_penalty for s in states], device=device)
    if bool((rep != 1.0).any()):
        prompt_ids = _padded([s.prompt_token_ids for s in states], pad=vocab, device=device)
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | (counts > 0)  # (R, V)
        rep = rep.to(x.dtype).unsqueeze(1)  # (R, 1)
        penalized = torch.where(x > 0, x / rep, x * rep)
        x = torch.where(seen, penalized, x)

    freq = torch.tensor([s.params.frequency_penalty for s in states], dtype=x.dtype, device=device)
    pres = torch.tensor([s.params.presence_penalty for s in states], dtype=x.dtype, device=device)
    x = x - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0).to(x.dtype)

    out = logits.clone()
    out[rows_t] = x
    return out


def _padded(seqs: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """(R, max_len) long tensor, rows right-padded with `pad`; at least one column."""
    width = max(1, max(len(s) for s in seqs))
    return torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=device)


def _sample_rows(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Draw one token per row of `logits` (R, V), all rows non-greedy. Returns (R,) long."""
    device = logits.device
    vocab = logits.shape[1]
    params = [s.params for s in states]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    x = logits / temps.unsqueeze(1)  # (R, V), our own copy from here on

    min_p_rows = [j for j, p in enumerate(params) if p.min_p > 0.0]
    if min_p_rows:
        idx = torch.tensor(min_p_rows, device=device)
        min_p = torch.tensor([params[j].min_p for j in min_p_rows], dtype=x.dtype, device=device)
        x[idx] = _min_p(x[idx], min_p)

    top_k_rows = [j for j, p in enumerate(params) if 0 < p.top_k < vocab]
    if top_k_rows:
        idx = torch.tensor(top_k_rows, device=device)
        ks = torch.tensor([params[j].top_k for j in top_k_rows], device=device)
        x[idx] = _top_k(x[idx], ks)

    top_p_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
    if top_p_rows:
        idx = torch.tensor(top_p_rows, device=device)
        top_p = torch.tensor([params[j].top_p for j in top_p_rows], dtype=x.dtype, device=device)
        # When every such row also has top_k, its candidates are within the top max(k): no need
        # to sort the whole vocabulary.
        ks = [params[j].top_k for j in top_p_rows]
        candidates = max(ks) if all(0 < k < vocab for k in ks) else None
        x[idx] = _top_p(x[idx], top_p, candidates)

    probs = torch.softmax(x, dim=-1)  # (R, V)
    q = torch.empty_like(probs)
    unseeded = [j for j, s in enumerate(states) if s.generator is None]
    if len(unseeded) == len(states):
        q.exponential_()
    else:
        if unseeded:
            idx = torch.tensor(unseeded, device=device)
            q[idx] = torch.empty(len(unseeded), vocab, dtype=q.dtype, device=device).exponential_()
        for j, s in enumerate(states):
            if s.generator is not None:
                q[j].exponential_(generator=s.generator)
    q.clamp_min_(_TINY)
    return (probs / q).argmax(dim=-1)


def _min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * p(most likely token). x (R, V), min_p (R,)."""
    probs = torch.softmax(x, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # (R, 1)
    return x.masked_fill(probs < threshold, float("-inf"))


def _top_k(x: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (ties with the k-th are kept). x (R, V), ks (R,)."""
    top = torch.topk(x, int(ks.max()), dim=-1).values  # (R, kmax), descending
    kth = top.gather(1, (ks - 1).unsqueeze(1))  # (R, 1)
    return x.masked_fill(x < kth, float("-inf"))


def _top_p(x: torch.Tensor, top_p: torch.Tensor, candidates: int | None) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to at least top_p.

    Token at sorted position i is kept iff the mass of the tokens before it is below top_p, so
    the most likely token is always kept. `candidates`: if set, every row has at most this many
    finite logits worth considering (top_k was applied), and only those are sorted.
    """
    if candidates is None:
        sorted_x = torch.sort(x, dim=-1, descending=True).values  # (R, V)
    else:
        sorted_x = torch.topk(x, candidates, dim=-1).values  # (R, candidates), descending
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (R, C)
    kept = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_min(1)  # (R, 1)
    threshold = sorted_x.gather(1, kept - 1)  # (R, 1), smallest kept logit
    return x.masked_fill(x < threshold, float("-inf"))


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, rows: list[int], counts: list[int]
) -> list[TokenLogprobs]:
    """Logprob of each row's chosen token and its `counts[j]` best alternatives."""
    rows_t = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[rows_t].float(), dim=-1)  # (R, V)
    chosen = token_ids[rows_t]  # (R,)
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    kmax = max(counts)
    if kmax > 0:
        top = torch.topk(lp, kmax, dim=-1)
        top_vals: list[list[float]] = top.values.tolist()
        top_ids: list[list[int]] = top.indices.tolist()
    out = []
    for j, (tok, tok_lp) in enumerate(zip(chosen.tolist(), chosen_lp, strict=True)):
        k = counts[j]
        top_list = list(zip(top_ids[j][:k], top_vals[j][:k], strict=True)) if k else []
        out.append(TokenLogprobs(token_id=tok, logprob=tok_lp, top=top_list))
    return out
