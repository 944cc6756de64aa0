"""What the engine hands back per request: cumulative state plus the delta of the last step."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.sampler import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    """One of the n completions of a request."""

    index: int  # which of the n completions
    text: str = ""  # all text so far (stop strings removed)
    token_ids: list[int] = field(default_factory=list)  # all generated tokens so far
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error", once finished
    stop_reason: str | int | None = None  # the stop string or stop token that ended it; for
    # "error", what failed (its grammar: the output is not what the constraint asked for)
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, when asked for
    # leading tokens whose text is in `text` so far; the others made only a stop string that was
    # cut, or no text (a final end-of-sequence token). The OpenAI API's logprobs stop there.
    num_shown_tokens: int = 0
    delta_text: str = ""  # text added by the last step
    delta_token_ids: list[int] = field(default_factory=list)  # tokens added by the last step

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the sampled tokens' logprobs (every token in `token_ids`, the
        stop token included), when logprobs were asked for (`SamplingParams.logprobs`, 0 too);
        None when not."""
        if self.logprobs is None:
            return None
        return sum((lp.logprob for lp in self.logprobs), 0.0)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]  # the prompt as tokenized
    outputs: list[CompletionOutput]  # n completions, by index
    # params.prompt_logprobs: one per prompt token (the first None: nothing precedes it), once
    # the whole prompt is computed (None until then, and when not asked for)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finished: bool = False  # every completion has finished
    num_cached_tokens: int = 0  # prompt tokens its first admission took from the prefix cache
    # (computed for earlier requests); a readmission after preemption does not change it
    num_computed_tokens: int = 0  # KV exports only: tokens whose KV is in the cache now
    block_ids: list[int] | None = None  # KV exports only: the request's block table
    arrival_time: float = 0.0  # time.monotonic() when the engine took the request
    scheduled_time: float = 0.0  # time.monotonic() when it was first scheduled (0: not yet)
    spec_proposed: int = 0  # speculative drafts verified for it (all its sequences)
    spec_accepted: int = 0  # of those, accepted
    # the prompt as given, where it was text (vLLM's `prompt`): `LLM.generate` sets it, and
    # `LLM.chat` to the rendered conversation; None for a prompt of token ids, and from the
    # engine itself (LLMEngine.step, AsyncLLM)
    prompt: str | None = None
