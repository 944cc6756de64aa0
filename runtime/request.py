"""A request as the scheduler sees it: how many tokens it has, how many it has computed."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime.sampler import TokenLogprobs
    from runtime.structured_decoding import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # eos, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its output constraint failed (RequestGrammar.error)

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


@dataclass(slots=True, eq=False)
class Request:
    """One sequence. A prompt asked for with n > 1 becomes n requests sharing the prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what is left of the context
    eos_token_ids: frozenset[int]  # ends the request unless params.ignore_eos
    generator: torch.Generator | None = None  # seeded when params.seed is set
    arrival: float = 0.0  # time.monotonic() at arrival, for FCFS and metrics
    scheduled_at: float = 0.0  # time.monotonic() when first scheduled (0 until then): metrics
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose keys/values are in the cache
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    lane: int = 0  # pipeline parallelism: the batch (of the scheduler's lanes) it runs in
    num_cached_tokens: int = -1  # prompt tokens reused from the prefix cache; -1 until admitted
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step
    spec_draft_probs: torch.Tensor | None = None  # (len(spec_token_ids), vocab): the draft
    # model's distribution each draft was drawn from; None: point masses (n-gram) or greedy
    spec_proposed: int = 0  # drafts verified for this request, since it arrived
    spec_accepted: int = 0  # of those, accepted
    grammar: RequestGrammar | None = None  # structured output: the grammar state over the
    # output so far and this step's token masks (runtime/structured_decoding.py)
    counts_lookup: bool = True  # its first admission counts in the prefix-cache hit rate:
    # the first of a request's n sequences only (they share the prompt: the request is one
    # lookup, as the worker's telemetry and its usage count it); not a KV import, whose prompt
    # the prefill worker looked up and computed
    first: Request | None = None  # n > 1, prefix caching on: the request's first sequence,
    # whose prompt this one takes from the cache (admitted once that is computed, not beside it
    # computing the same prompt again: n sequences computed it n times)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # params.prompt_logprobs: the
    # prompt tokens' logprobs gathered so far, entry i for prompt token i (the first None), one
    # list shared by the request's n sequences (whichever computes a prompt row first gives it);
    # None: not asked for
    hold_kv: bool = False  # a KV export (prefill for another worker): when it finishes, its
    # blocks stay allocated until released (the puller acknowledged them, or a deadline passed)

    @property
    def prompt_rows_left(self) -> bool:
        """Whether prompt logprobs were asked for and some are still to compute."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) < len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) without joining the prompt and the output first (a decode step
        asks every running request for one token)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def check_stop(self) -> RequestStatus | None:
        """After a token is appended: the finish status it causes, if any."""
        last = self.output_token_ids[-1]
        if not self.params.ignore_eos and last in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in self.params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
