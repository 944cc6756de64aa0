"""The engine: a synchronous step loop over the scheduler, the model runner and the detokenizer.

    step() = schedule → execute → update
    with pipeline parallelism (pp stages), up to pp steps in flight, each of its own lane of
    requests: step() = schedule lane l → launch it; then finish the oldest → update

`add_request` validates (raising `InvalidRequestError`, a ValueError, naming the field and the
limit) before anything reaches the scheduler. A prompt asked for with n > 1 becomes n sequences
("<id>#<i>") that share the prompt; they are reported together under the request's id.

Disaggregated serving (runtime/disagg.py drives it):
- prefill side, a KV export: `prepare_request(..., hold_kv=True)`; every step that advanced it
  reports `num_computed_tokens` and `block_ids`, and when it finishes its blocks stay allocated
  until `release_kv` (the puller acknowledged them, or gave up).
- decode side, a KV import: `reserve_import` takes the prompt's longest cached prefix and
  reserves blocks for the rest of the prompt but its last token (None: no room, refused before
  any byte moves); the transfer fills them; `commit_import` queues the request as a decode of
  the last prompt token (which samples the first output token), `cancel_import` frees them.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kernels.dispatch import FORCE_TRITON
from kvstore.block_hash import cache_seed
from kvstore.tokenizer_files import tokenizer_digest
from runtime.config import EngineConfig
from runtime.detokenizer import IncrementalDetokenizer
from runtime.draft import DraftProposer
from runtime.kv_cache import BlockManager
from runtime.loader import IMPORT_MARKER, PendingLoad, model_revision
from runtime.model import LlamaForCausalLM
from runtime.model_runner import Launched, ModelRunner, kv_block_bytes, kv_cache_dtype
from runtime.outputs import CompletionOutput, RequestOutput
from runtime.parallel import RankPlace
from runtime.ranks import RankFailure, start_weights
from runtime.request import Request, RequestStatus
from runtime.sampler import TokenLogprobs
from runtime.sampling_params import InvalidRequestError, SamplingParams, check_text
from runtime.scheduler import QueueFullError, Scheduler, SchedulerOutput, StepResult
from runtime.speculative import SpecController
from runtime.structured import StructuredOutputsParams
from runtime.structured_decoding import GrammarCompiler, RequestGrammar, TokenMasks
from runtime.tokenizer import Tokenizer
from runtime.weights import ReadStats

if TYPE_CHECKING:
    from runtime.compression import CompressedBlocks

log = logging.getLogger("edgeinfer.engine")

Prompt = str | list[int]


@dataclass(slots=True)
class Startup:
    """Where an engine's start-up went. Phases overlap: the weights are read while the
    tokenizer, the scheduler, the kernels and the KV cache are set up."""

    phases: dict[str, tuple[float, float]]  # name -> (start, end), time.perf_counter()
    read: ReadStats  # what the weight read did (bytes, GB/s, O_DIRECT or not, chunks checked)
    kv_cache: str = ""  # what the KV cache holds, e.g. "6.05 GB bfloat16, 10254 blocks of 16"
    compressed: str = ""  # weights kept compressed: CompressedBlocks.summary()
    ranks: int = 1  # processes the model is split over: the phases are rank 0's (its share)

    @property
    def ready(self) -> float:
        return max(end for _, end in self.phases.values())

    def timeline(self, process_start: float, imports_done: float, drive: str,
                 ranks_started: tuple[float, float] | None = None) -> str:  # fmt: skip
        """One line for a worker's log: each phase as seconds since the process started (its
        imports first), and the weight read's GB/s beside the drive's (`drive` says it).
        `ranks_started`: when the worker, between its imports, started the other ranks of a
        split model (spawned them, joined them and waited for each to read its share)."""
        read, files = self.read, self.read.direct + self.read.buffered
        checked = (
            f", {read.verified} checksums verified" if read.verified else ", no manifest to check"
        )
        phases = dict(self.phases)
        imports = f"0.00-{imports_done - process_start:.2f}"
        if ranks_started is not None:  # (they had counted the spawning, joining and reads)
            phases["ranks started"] = ranks_started
            start, end = (t - process_start for t in ranks_started)
            imports = f"0.00-{start:.2f}, {end:.2f}-{imports_done - process_start:.2f}"
        parts = [f"imports {imports}"]
        for name, (start, end) in sorted(phases.items(), key=lambda kv: kv[1][0]):
            part = f"{name} {start - process_start:.2f}-{end - process_start:.2f}"
            if name == "weights read":
                share = f"rank 0's share, 1 of {self.ranks} ranks: " if self.ranks > 1 else ""
                part += (
                    f" ({share}{read.bytes / 1e9:.2f} GB at {read.gb_per_s:.2f} GB/s; {drive}; "
                    f"{read.direct} of {files} files O_DIRECT{checked})"
                )
            elif name == "ranks started":
                others = "rank 1" if self.ranks == 2 else f"ranks 1-{self.ranks - 1}"
                their = "its share" if self.ranks == 2 else "their shares"
                part += f" ({others} of {self.ranks} spawned and joined, {their} read)"
            elif name == "KV cache" and self.kv_cache:
                part += f" ({self.kv_cache})"
            elif name == "weights compressed" and self.compressed:
                part += f" ({self.compressed})"
            parts.append(part)
        parts.append(f"ready {self.ready - process_start:.2f} (seconds since the process started)")
        return "start-up: " + " | ".join(parts)


@dataclass(slots=True, eq=False)
class RequestGroup:
    """A request as the user sent it: its n sequences and their outputs."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer]
    outputs: list[CompletionOutput]


def _packable_bytes(model: LlamaForCausalLM) -> int:
    """The most bytes pack_weights can add on all the ranks of the model's world: each packs
    its own weights, out of this host's memory. The other ranks' parts are built on the meta
    device (their shapes, no memory: all that packable_bytes reads)."""
    par = model.place.config
    total = model.packable_bytes()
    for rank in range(1, par.world_size):
        with torch.device("meta"):
            other = LlamaForCausalLM(model.cfg, model.dtype, model.max_model_len,
                                     place=RankPlace(par, rank), weight_dtype=model.weight_dtype)  # fmt: skip
        total += other.packable_bytes()
    return total


_MASK64 = (1 << 64) - 1


def sequence_seed(seed: int, i: int) -> int:
    """The generator seed of a request's i-th sequence: (seed, i) mixed by splitmix64's
    finalizer (a bijection of 64 bits whose low 32 depend on every input bit). torch's CPU
    generator keeps only a seed's low 32 bits, so `seed + i` made seeds 2**32 apart one stream,
    and sequence i of seed s the same as sequence 0 of seed s + i (n > 1 beside n = 1 requests)."""
    x = (seed + i * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class LLMEngine:
    def __init__(self, config: EngineConfig, weights: PendingLoad | None = None):
        """`weights`: the load of `config.model` in `config.dtype` that the caller started
        already (`runtime.loader.start_load`: a worker starts it before its heavier imports);
        by default the engine starts it. The tokenizer, the scheduler, the kernels and the KV
        cache are set up while the weights are read."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        if weights is None:
            weights = start_weights(config)
        elif (weights.model_dir, weights.dtype, weights.weight_dtype) != (
            Path(config.model), config.dtype, config.weight_dtype
        ):
            raise ValueError(
                f"the weights being loaded are {weights.model_dir} as {weights.dtype} (weights "
                f"{weights.weight_dtype}), the engine is for {config.model} as {config.dtype} "
                f"(weights {config.weight_dtype})"
            )
        try:
            self._start(config, weights)
        except BaseException:
            weights.close()
            if weights.ranks is not None:  # the followers wait for their KV cache: stop them
                weights.ranks.close()
            raise
        eos = frozenset(self.model.cfg.eos_token_ids) | self.tokenizer.eos_token_ids
        vocab = self.model.cfg.vocab_size
        if outside := sorted(t for t in eos if not 0 <= t < vocab):  # (generation_config.json
            # or the tokenizer's files: the structured-output eos mask failed on one, IndexError)
            log.warning("end-of-sequence ids %s of %s are outside the vocabulary [0, %d): left "
                        "out (no such token can be sampled)", outside, config.model, vocab)  # fmt: skip
        self.eos_token_ids = frozenset(t for t in eos if 0 <= t < vocab)
        self.runner.sampler.eos_token_ids = self.eos_token_ids  # (held back under min_tokens)
        self._groups: dict[str, RequestGroup] = {}
        self._seq_to_group: dict[str, tuple[RequestGroup, int]] = {}
        self._ids = itertools.count(1)  # next_request_id's (next() on it is atomic)
        self._num_aborted = 0  # requests aborted before they finished, for stats
        self._exports: dict[str, RequestGroup] = {}  # KV exports by sequence id, until released
        self._imports: dict[str, RequestGroup] = {}  # KV imports reserved, not yet queued
        self._dropped: list[RequestOutput] = []  # exports the scheduler aborted: the next outputs
        self.last_step_idle = False  # the last step could run nothing (see AsyncLLM._run)
        # pipelined steps launched, not yet finished, oldest first: (lane, plan, the step)
        self._in_flight: deque[tuple[int, SchedulerOutput, Launched]] = deque()
        self._last_lane = -1
        # structured output: grammars compiled once per schema, masks filled beside the forward
        vocab = self.model.cfg.vocab_size
        self.grammars = GrammarCompiler(self.tokenizer, vocab, self.eos_token_ids)
        self.masks = TokenMasks(vocab)

    def _start(self, config: EngineConfig, weights: PendingLoad) -> None:
        self.model = weights.model
        cuda = config.device == "cuda"
        self.compressed: CompressedBlocks | None = None
        t_encode = (0.0, 0.0)
        if config.keep_weights_compressed:  # coded from the weights loaded into host memory,
            weights.finish()  # where they are decoded (on a GPU: each layer copied there first)
            t0 = time.perf_counter()
            from runtime.compression import compress_layers  # numpy and the decoder: only here

            self.compressed = compress_layers(self.model, config.device)
            t_encode = (t0, time.perf_counter())
        if cuda:  # the weights are read onto the GPU (through pinned buffers, start_load) or,
            weights.finish()  # kept compressed, loaded into host memory; the rest moves now
            self.model.to(config.device)
        t_model = time.perf_counter()
        self.tokenizer = Tokenizer.from_dir(config.model)
        cfg = self.model.cfg
        # (one past the model's was served as the model's, silently; vLLM and the CLI refuse it)
        if refusal := cfg.max_model_len_refusal(
            config.model, config.max_model_len, "max_model_len"
        ):
            raise ValueError(refusal)
        self.max_model_len = config.max_model_len or cfg.max_model_len
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.model, cuda or FORCE_TRITON)
        block_bytes = kv_block_bytes(self.model, config.block_size, self.kv_dtype)
        spec = config.speculative
        if spec is not None and spec.num_tokens >= self.max_model_len:
            raise ValueError(
                f"speculative num_tokens ({spec.num_tokens}) must be below the context length "
                f"({self.max_model_len})"
            )
        # a draft model (its weights and KV cache) before the target's KV cache is sized: out of
        # the memory that sizing sees as free (on a GPU, the draft sat beside a cache that had
        # taken kv_cache_fraction of the memory without it)
        proposer = None
        if spec is not None and spec.method == "draft":
            proposer = DraftProposer(config, cfg.vocab_size, self.max_model_len)
        if cuda:  # of the GPU memory left once the weights are on it
            torch.cuda.empty_cache()  # what placing (or encoding) them freed counts as free
            free = torch.cuda.mem_get_info(self.model.device)[0]
        else:  # of the memory left once the weights are in (they may be arriving): every
            # rank's, split over ranks, as block_bytes is every rank's share of a block (they
            # all take the host's memory; rank 0's alone over-committed a high fraction)
            free = weights.memory_before - weights.host_nbytes
            if proposer is not None:
                free -= proposer.nbytes
            if self.compressed is not None:  # what the compressed layers gave back
                free += self.compressed.dense_bytes - self.compressed.compressed_bytes
                free -= self.compressed.buffer_bytes
            if config.packed_weights and (Path(config.model) / IMPORT_MARKER).exists():
                # a GGUF import's weights are exact blocks: pack_weights will keep those too
                free -= _packable_bytes(self.model)
        budget = config.kv_cache_bytes or int(free * config.kv_cache_fraction)
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={budget} holds no block of {config.block_size} tokens "
                f"({block_bytes} bytes each); give at least {block_bytes}"
            )
        # The prefix cache's identity: anything that changes a block's KV for the same tokens.
        self.model_revision = (
            config.model_revision or weights.revision or model_revision(config.model)
        )
        dtypes = str(self.model.dtype).removeprefix("torch.")
        if self.model.weight_dtype != self.model.dtype:  # other weights: other KV
            dtypes += "-w" + str(self.model.weight_dtype).removeprefix("torch.")
        if self.kv_dtype != self.model.dtype:  # KV rounded to another dtype
            dtypes += "-kv" + str(self.kv_dtype).removeprefix("torch.")
        # and its tokenizer's (chat template, special tokens): one request rendered as other ids
        # by another template must not find, nor be routed to, this cache's blocks
        tokenizer = tokenizer_digest(Path(config.model))[:8]
        self.cache_id = f"{self.model_revision}-t{tokenizer}-{dtypes}-b{config.block_size}"
        self.blocks = BlockManager(
            num_blocks,
            config.block_size,
            seed=cache_seed(self.cache_id),
            caching=config.enable_prefix_caching,
        )
        # Pipeline parallelism: one batch in flight per stage, each a lane of the scheduler
        # (with speculative decoding, one: a proposal reads the tokens of every running request)
        self.lanes = config.pp if config.speculative is None and weights.ranks is not None else 1
        self.scheduler = Scheduler(
            self.blocks, config.max_num_seqs, config.max_num_batched_tokens, config.max_waiting,
            lanes=self.lanes,
        )  # fmt: skip
        self.spec = None
        if spec is not None:
            self.spec = SpecController(spec, self.max_model_len, proposer)
        t_tokenizer = time.perf_counter()
        self.runner = ModelRunner(
            self.model, num_blocks, config.block_size, config.attention, config.cpu_kernels,
            ranks=weights.ranks, kv_commit=config.kv_cache_commit,
            packed_weights=config.packed_weights, kv_dtype=self.kv_dtype,
        )
        self.model.rope_rows(min(self.max_model_len, num_blocks * config.block_size))  # now
        if weights.ranks is None:  # (a split model's ranks would each need to copy)
            self.blocks.copy_slots = self.runner.copy_slots  # kept partial blocks, shared
        # No warm-up step: on the CPU a first request is as fast as the next (measured: a
        # prefill + decode warm-up took 0.11 s and saved the first request 0.00-0.04 s).
        # With weights kept compressed, a graph holds each layer's decode kernels too: the
        # hooks that launch them point the parameters at one buffer, whose address the graph keeps
        if cuda and config.cuda_graphs:  # at start-up
            if self.compressed is not None:
                self.runner.before_replay = self.compressed.join
            self.runner.capture_decode_graphs(
                min(config.max_num_seqs, config.cuda_graph_max_batch), self.max_model_len
            )
        t_placement = time.perf_counter()
        if not cuda:
            weights.finish()
            self.runner.pack_weights()
        read = weights.stats
        self.startup = Startup(
            phases={
                "model set-up": (weights.started, weights.queued),
                "weights read": (read.started, read.finished),
                **({"weights compressed": t_encode} if self.compressed is not None else {}),
                "tokenizer and scheduler": (t_model, t_tokenizer),
                **self.runner.startup,
                # waiting for the read, if it is still going, is not placement; where the
                # weights were in place before (on CUDA, or kept compressed) it took no time here
                "placement": (
                    max(t_placement, read.finished),
                    max(t_placement, read.finished, weights.placed),
                ),
            },
            read=read,
            kv_cache=f"{num_blocks * block_bytes / 1e9:.2f} GB "  # all ranks' shares
            f"{str(self.kv_dtype).removeprefix('torch.')}, {num_blocks} blocks of "
            f"{config.block_size} tokens",
            compressed=self.compressed.summary() if self.compressed is not None else "",
            ranks=weights.ranks.world_size if weights.ranks is not None else 1,
        )

    # ------------------------------------------------------------------ requests in
    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            check_text("prompt", prompt)  # (a lone surrogate: a TypeError in the tokenizer)
            ids = self.tokenizer.encode(prompt)
            vocab = self.model.cfg.vocab_size
            if ids and (top := max(ids)) >= vocab:  # (an embedding lookup past its end would
                # fail the engine's step, and with it every request in flight)
                raise InvalidRequestError(
                    "prompt", f"tokenizes to id {top}, outside the model's vocabulary [0, "
                    f"{vocab}): the model's tokenizer.json has more tokens than its "
                    "config.json's vocab_size",
                )  # fmt: skip
            return ids
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequestError("prompt", "must be a non-empty string or list of token ids")
        vocab = self.model.cfg.vocab_size
        plain = True  # (numpy's integers are integers too: np.int64 ids were refused)
        for t in prompt:
            if type(t) is not int:
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise InvalidRequestError("prompt", f"token ids must be integers, got {t!r}")
                plain = False
            if not 0 <= t < vocab:
                raise InvalidRequestError("prompt", f"token id {t} is outside [0, {vocab})")
        return list(prompt) if plain else [int(t) for t in prompt]

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None
    ) -> list[int]:
        """Validate and queue a request. Returns its prompt token ids."""
        if request_id in self._groups:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        group = self.prepare_request(request_id, prompt, params)
        self.enqueue(group)
        return group.prompt_token_ids

    def prepare_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        hold_kv: bool = False,
        check_room: bool = True,
        grammar: RequestGrammar | None = None,
    ) -> RequestGroup:
        """Validate and tokenize a request without touching the scheduler.

        Safe to call from another thread while a step runs (the async front does, so that its
        event loop never waits for a step): it reads only configuration, the tokenizer, and the
        length of the waiting queue. `enqueue` then hands the result to the scheduler.
        `check_room`: raise QueueFullError now when the waiting queue is full (off: a caller
        that enqueues once `has_room`). `grammar`: params.structured_outputs' grammar, compiled
        already (`self.grammars.grammar`, by a caller that compiled it on a thread: the worker,
        whose event loop runs this): not compiled again, as the compiler may have dropped it
        from its cache since.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", "must be a SamplingParams")
        params.validate()
        if hold_kv and params.n != 1:
            raise InvalidRequestError("n", "a KV export computes one sequence; n must be 1")
        prompt_ids = self.tokenize_prompt(prompt)
        vocab = self.model.cfg.vocab_size
        for t in params.stop_token_ids:  # (as a prompt's ids: one outside could never be sampled)
            if not 0 <= t < vocab:
                raise InvalidRequestError(
                    "stop_token_ids", f"token id {t} is outside [0, {vocab})"
                )
        if params.logit_bias and (top := max(params.logit_bias)) >= vocab:
            raise InvalidRequestError(
                "logit_bias", f"token id {top} is outside the model's vocabulary [0, {vocab})"
            )
        n_prompt, limit = len(prompt_ids), self.max_model_len
        capacity = self.scheduler.capacity_tokens
        room = min(limit, capacity)  # (a KV cache smaller than the context bounds a request)
        max_tokens = params.max_tokens if params.max_tokens is not None else room - n_prompt
        if n_prompt >= room or n_prompt + max_tokens > room:
            raise _too_long(n_prompt, max(max_tokens, 1), limit, capacity)
        if params.min_tokens > max_tokens:  # (max_tokens not given: validate could not tell)
            raise InvalidRequestError(
                "min_tokens", f"must be at most {max_tokens}, the tokens the context leaves "
                f"after the prompt's {n_prompt} (max_tokens not given), got {params.min_tokens}",
                "context_length_exceeded",
            )  # fmt: skip
        if params.n > self.scheduler.max_waiting:  # (would never fit: not worth a retry)
            raise InvalidRequestError(
                "n", f"at most {self.scheduler.max_waiting} (the waiting queue's bound), got {params.n}"
            )
        if check_room and not self.has_room(params.n):
            raise QueueFullError(f"the waiting queue is full ({self.scheduler.max_waiting})")
        if params.structured_outputs is None:
            grammar = None
        elif grammar is None:  # compiled here, off the step thread
            spec = StructuredOutputsParams.coerce(params.structured_outputs)
            grammar = self.grammars.grammar(spec, "structured_outputs")
        now = time.monotonic()
        seqs, detoks = [], []
        # (one list for the n sequences: whichever computes a prompt row first gives its entry)
        prompt_lps: list[TokenLogprobs | None] | None = (
            None if params.prompt_logprobs is None else [None]
        )
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator().manual_seed(sequence_seed(params.seed, i))
            seqs.append(
                Request(
                    request_id=f"{request_id}#{i}",
                    prompt_token_ids=prompt_ids,
                    params=params,
                    max_tokens=max_tokens,
                    eos_token_ids=self.eos_token_ids,
                    generator=gen,
                    arrival=now,
                    hold_kv=hold_kv,
                    grammar=None if grammar is None else grammar.copy(),
                    counts_lookup=i == 0,  # (n sequences, one prompt: one lookup)
                    prompt_logprobs=prompt_lps,
                )
            )
            detoks.append(
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_ids,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens,
                )
            )
        if self.config.enable_prefix_caching:  # the others take the first's prompt blocks
            for seq in seqs[1:]:
                seq.first = seqs[0]
        group = RequestGroup(
            request_id,
            prompt_ids,
            params,
            seqs,
            detoks,
            [
                CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None)
                for i in range(params.n)
            ],
        )
        return group

    def has_room(self, seqs: int) -> bool:
        """Whether the waiting queue has room for `seqs` more sequences now."""
        return len(self.scheduler.waiting) + seqs <= self.scheduler.max_waiting

    def _check_unused(self, group: RequestGroup) -> None:
        """A request id must not be one whose blocks are still somebody's: a running request, a
        KV import reserved, or a finished export held until released (the scheduler would take
        those blocks for the new request's own, and their owner would free them under it)."""
        if (group.request_id in self._groups or group.request_id in self._imports
                or any(s.request_id in self._exports for s in group.seqs)):  # fmt: skip
            raise InvalidRequestError("request_id", f"{group.request_id!r} is already in use")

    def enqueue(self, group: RequestGroup, check_room: bool = True) -> None:
        """Queue a request `prepare_request` built (on the thread that runs `step`); QueueFullError
        when the waiting queue is full, unless `check_room` is off (a KV import, admitted when
        its blocks were reserved)."""
        self._check_unused(group)
        if check_room and not self.has_room(len(group.seqs)):
            raise QueueFullError(f"the waiting queue is full ({self.scheduler.max_waiting})")
        for i, seq in enumerate(group.seqs):
            self.scheduler.add(seq, check_room)
            self._seq_to_group[seq.request_id] = (group, i)
            if seq.hold_kv:
                self._exports[seq.request_id] = group
        self._groups[group.request_id] = group

    def release_kv(self, request_id: str) -> int:
        """Free the blocks a finished KV export holds (an unfinished one is aborted instead).
        Returns the number of blocks freed."""
        if request_id in self._groups:
            self.abort(request_id)
        seq_id = f"{request_id}#0"  # an export is one sequence (n == 1)
        if self._exports.pop(seq_id, None) is None:
            return 0
        return self.scheduler.release(seq_id)

    # ------------------------------------------------------------------ KV imports (decode side)
    def reserve_import(self, group: RequestGroup) -> tuple[int, list[int]] | None:
        """Reserve KV blocks for the prompt of a request whose prefill runs elsewhere.

        Returns (prompt tokens already in this worker's prefix cache, the blocks the transfer
        must fill, in table order from the first uncached block), or None when the KV cache has
        no room: refused before any byte moves.
        """
        seq = group.seqs[0]
        self._check_unused(group)
        if not self._import_admissible():
            return None
        want = len(group.prompt_token_ids) - 1  # the last prompt token is computed here
        # whole blocks only: the transfer fills every block from the first one not cached
        cached = self.blocks.match_prefix(seq.request_id, group.prompt_token_ids, tails=False,
                                          count=False)  # fmt: skip
        table = self.blocks.allocate(seq.request_id, want)
        # room left for the running requests to grow: a block each, as their next tokens need
        # (an import that takes it would preempt them, and recompute them here)
        reserve = min(len(self.scheduler.running), self.blocks.num_blocks // 10)
        if table is None or self.blocks.num_free_blocks < reserve:
            self.blocks.free(seq.request_id)
            return None
        self._imports[group.request_id] = group
        # (not in the hit rate: the prefill worker's lookup counted this prompt, where it was
        # computed; counted again here, a request's tokens counted twice over the cluster)
        seq.counts_lookup = False
        return cached, list(table[cached // self.config.block_size :])

    def _import_admissible(self) -> bool:
        """Whether a KV import may take blocks now, as the scheduler would admit a new request:
        no request waits ahead of it for blocks (first come, first served), and a seat is free
        (imports reserved or queued, and running requests, under max_num_seqs)."""
        if any(not self.blocks.holds(r.request_id) for r in self.scheduler.waiting):
            return False
        seats = len(self.scheduler.running) + len(self.scheduler.waiting) + len(self._imports)
        return seats < self.config.max_num_seqs

    def commit_import(self, group: RequestGroup, cached_tokens: int) -> None:
        """The reserved blocks hold the prompt's KV (but its last token's): queue the request.

        `cached_tokens`: prompt tokens no worker computed for it (prefix-cache hits), for usage.
        """
        seq = group.seqs[0]
        del self._imports[group.request_id]
        n = len(group.prompt_token_ids) - 1
        self.blocks.commit(seq.request_id, group.prompt_token_ids[:n])
        seq.num_computed_tokens = n
        seq.num_cached_tokens = cached_tokens
        try:  # (admitted at its reservation, under max_num_seqs: a full queue since then does
            self.enqueue(group, check_room=False)  # not throw away the KV it pulled)
        except Exception:
            self.blocks.free(seq.request_id)
            raise

    def cancel_import(self, group: RequestGroup) -> None:
        """Free the blocks reserved for an import that did not complete."""
        if self._imports.pop(group.request_id, None) is not None:
            self.blocks.free(group.seqs[0].request_id)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its KV blocks are freed before this returns."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        self._num_aborted += 1
        try:
            for i, seq in enumerate(group.seqs):
                self.scheduler.finish(seq.request_id, RequestStatus.FINISHED_ABORTED)
                # (a no-op for a sequence that had finished; one the scheduler finished in a
                # step whose processing then failed is finished here)
                self._finish_seq(group, i, RequestStatus.FINISHED_ABORTED, None)
        finally:  # whatever failed above, the request is gone and its id free again
            self._groups.pop(request_id, None)
            for seq in group.seqs:
                self._seq_to_group.pop(seq.request_id, None)
        return self._emit(group)

    def end_at_next_token(self, request_id: str, indices: list[int]) -> None:
        """End completions `indices` of request `request_id` at their next token, finished
        "length", as any completion ends (its blocks freed; the request's last output once every
        completion has ended): for completions the caller has already answered, such as a tool
        call complete under parallel_tool_calls false. Not an abort: the request's other
        completions run on, and nothing counts as aborted. One that has ended is left alone."""
        group = self._groups.get(request_id)
        if group is None:
            return
        for i in indices:
            seq = group.seqs[i]
            seq.max_tokens = min(seq.max_tokens, len(seq.output_token_ids) + 1)

    # ------------------------------------------------------------------ the loop
    def unfinished_request_ids(self) -> list[str]:
        return list(self._groups)

    def has_unfinished(self) -> bool:
        # (_dropped: outputs of exports the scheduler aborted, not yet returned because the step
        # that dropped them failed: the next step, idle or not, returns them)
        return self.scheduler.has_unfinished() or bool(self._in_flight) or bool(self._dropped)

    def step(self) -> list[RequestOutput]:
        """One step: with pipeline parallelism (lanes), launch the next lane's step and finish
        the oldest in flight once every stage has one (or there is nothing to launch)."""
        outputs = self._step()
        if self._dropped:
            outputs, self._dropped = self._dropped + outputs, []
        return outputs

    def _step(self) -> list[RequestOutput]:
        self.last_step_idle = False
        if self.lanes == 1:
            out = self._schedule(0)
            if out.empty:
                self.last_step_idle = True  # unfinished requests wait that nothing can run
                return []
            return self._complete(out, self.runner.execute(out, self._block_tables(out)))
        launched = False
        if len(self._in_flight) < self.lanes:
            busy = {lane for lane, _, _ in self._in_flight}
            after = [(self._last_lane + k) % self.lanes for k in range(1, self.lanes + 1)]
            for lane in (lane for lane in after if lane not in busy):  # the next with work
                out = self._schedule(lane)
                if out.empty:
                    continue
                self._last_lane = lane
                try:
                    step = self.runner.launch(out, self._block_tables(out))
                except RankFailure:
                    self._in_flight.clear()  # nothing in flight will finish
                    raise
                self._in_flight.append((lane, out, step))
                launched = True
                break
        if not self._in_flight or (launched and len(self._in_flight) < self.lanes):
            self.last_step_idle = not launched and not self._in_flight
            return []
        _, out, step = self._in_flight.popleft()
        try:
            result = self.runner.finish(step)
        except RankFailure:
            self._in_flight.clear()
            raise
        # Any other failure (in sampling, say) consumed only this step: the steps behind it
        # are still coming back from the ranks, in order, and finish on the next calls.
        return self._complete(out, result)

    def _schedule(self, lane: int) -> SchedulerOutput:
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        out = self.scheduler.schedule(lane)
        for seq in out.dropped:  # finished by the scheduler, aborted: reported with this step's
            group, i = self._seq_to_group[seq.request_id]
            self._finish_seq(group, i, RequestStatus.FINISHED_ABORTED, None)
            self._dropped.append(self._emit(group))
        if not out.empty:
            self.masks.start(out.scheduled)  # grammar masks, computed while the forward runs
        return out

    def _complete(self, out: SchedulerOutput, result: tuple[dict, dict]) -> list[RequestOutput]:  # type: ignore[type-arg]
        """A step's sampled tokens into its requests and their outputs."""
        tokens, logprobs = result
        if self.spec is not None:
            for s in out.scheduled:
                kept = tokens.get(s.request.request_id)
                if s.spec_token_ids and kept:
                    self.spec.record(s.request, len(s.spec_token_ids), len(kept) - 1)
        results = self.scheduler.update(out, tokens)
        outputs = self._process(results, logprobs)
        if self._exports:  # KV exports report each step's progress, so transfer overlaps prefill
            emitted = {o.request_id for o in outputs}
            for s in out.scheduled:
                group = self._exports.get(s.request.request_id)
                if s.request.status is RequestStatus.FINISHED_ABORTED:
                    continue  # aborted while its step was in flight: reported then
                if group is not None and group.request_id not in emitted:
                    outputs.append(self._emit(group))
        return outputs

    def _block_tables(self, out) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
        return {
            s.request.request_id: self.blocks.block_table(s.request.request_id)
            for s in out.scheduled
        }

    def _process(self, results: list[StepResult], logprobs: dict) -> list[RequestOutput]:  # type: ignore[type-arg]
        touched: dict[str, RequestGroup] = {}
        for r in results:
            group, i = self._seq_to_group[r.request.request_id]
            touched[group.request_id] = group
            out = group.outputs[i]
            lps = logprobs.get(r.request.request_id)
            detok = group.detoks[i]
            status: RequestStatus | None = None
            stop_reason: str | int | None = None
            grammar = r.request.grammar
            if grammar is not None and r.new_tokens:
                kept = grammar.accept(r.new_tokens)
                if grammar.finished:  # only end-of-sequence could follow
                    # what the step appended after the token that ended the grammar (an
                    # accepted draft's bonus token, which the mask forced to end-of-sequence)
                    # is not output, as without speculation, where the request ends right there
                    del r.new_tokens[kept:]
                    if r.finished is None:
                        self.scheduler.finish(r.request.request_id, RequestStatus.FINISHED_STOPPED)
                    r.finished = RequestStatus.FINISHED_STOPPED
            # a stop token (end-of-sequence, or one of stop_token_ids) ends the request without
            # its text, as vLLM does, unless include_stop_str_in_output
            cut = len(r.new_tokens) - 1 if self._ends_on_stop_token(r) else -1
            for j, token in enumerate(r.new_tokens):  # several: accepted speculative drafts
                out.token_ids.append(token)
                out.delta_token_ids.append(token)
                if out.logprobs is not None and lps is not None:
                    out.logprobs.append(lps[j])
                if j == cut:
                    continue  # (the last token: the loop ends as without a cut)
                delta = detok.append(token)
                out.delta_text += delta
                out.text += delta
                out.num_shown_tokens = detok.num_shown
                if detok.stop_matched is not None:  # a stop string, maybe mid-draft
                    self.scheduler.finish(r.request.request_id, RequestStatus.FINISHED_STOPPED)
                    status, stop_reason = RequestStatus.FINISHED_STOPPED, detok.stop_matched
                    break
            else:
                status = r.finished
                last = r.new_tokens[-1]
                if (
                    status is RequestStatus.FINISHED_STOPPED
                    and last in r.request.params.stop_token_ids
                ):
                    stop_reason = last
            if grammar is not None and grammar.error is not None:  # not what it asked for
                status, stop_reason = RequestStatus.FINISHED_ERROR, grammar.error
            if status is not None:
                self._finish_seq(group, i, status, stop_reason)
        return [self._emit(g) for g in touched.values()]

    @staticmethod
    def _ends_on_stop_token(r: StepResult) -> bool:
        params = r.request.params
        if r.finished is not RequestStatus.FINISHED_STOPPED or params.include_stop_str_in_output:
            return False
        last = r.new_tokens[-1]
        return last in params.stop_token_ids or (
            not params.ignore_eos and last in r.request.eos_token_ids
        )

    def _finish_seq(
        self, group: RequestGroup, i: int, status: RequestStatus, stop_reason: str | int | None
    ) -> None:
        out = group.outputs[i]
        if out.finish_reason is not None:
            return
        detok = group.detoks[i]
        if detok.stop_matched is None:
            tail = detok.flush()
            out.text += tail
            out.delta_text += tail
            out.num_shown_tokens = detok.num_shown
            # a stop string completed by the held-back tail (bytes of a character the last
            # tokens left unfinished) ended the text: it is the reason, as it is mid-stream
            if detok.stop_matched is not None and status in (
                RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED
            ):
                status, stop_reason = RequestStatus.FINISHED_STOPPED, detok.stop_matched
        out.finish_reason = status.value
        out.stop_reason = stop_reason
        self._seq_to_group.pop(group.seqs[i].request_id, None)
        if self.spec is not None:
            self.spec.forget(group.seqs[i].request_id)

    def _emit(self, group: RequestGroup) -> RequestOutput:
        finished = all(o.finished for o in group.outputs)
        snapshot = RequestOutput(
            request_id=group.request_id,
            prompt_token_ids=group.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=o.index,
                    text=o.text,
                    token_ids=list(o.token_ids),
                    finish_reason=o.finish_reason,
                    stop_reason=o.stop_reason,
                    logprobs=list(o.logprobs) if o.logprobs is not None else None,
                    num_shown_tokens=o.num_shown_tokens,
                    delta_text=o.delta_text,
                    delta_token_ids=list(o.delta_token_ids),
                )
                for o in group.outputs
            ],
            finished=finished,
            prompt_logprobs=None if group.seqs[0].prompt_rows_left else group.seqs[0].prompt_logprobs,
            num_cached_tokens=max(0, group.seqs[0].num_cached_tokens),
            arrival_time=group.seqs[0].arrival,
            spec_proposed=sum(q.spec_proposed for q in group.seqs),
            spec_accepted=sum(q.spec_accepted for q in group.seqs),
            scheduled_time=min((q.scheduled_at for q in group.seqs if q.scheduled_at), default=0.0),
        )
        seq = group.seqs[0]
        if seq.hold_kv:
            snapshot.num_computed_tokens = seq.num_computed_tokens
            snapshot.block_ids = list(self.blocks.block_table(seq.request_id))
        for o in group.outputs:
            o.delta_text, o.delta_token_ids = "", []
        if finished:
            self._groups.pop(group.request_id, None)
        return snapshot

    def next_request_id(self) -> str:
        """An id for a request its caller gave none: one no live request, import or held export
        has (a caller's own "req-1" took the count's next id, and the caller that gave none was
        refused, 'already in use'). Thread-safe: the count is an itertools counter."""
        while True:
            rid = f"req-{next(self._ids)}"
            if not (rid in self._groups or rid in self._imports or f"{rid}#0" in self._exports):
                return rid

    def stats(self) -> dict[str, int]:
        """Load figures a worker publishes: counts, KV blocks, and tokens still to compute."""
        sched = self.scheduler
        prefill = outputs = decodes = 0  # one pass: this runs after every step
        for r in (*sched.running, *sched.waiting):
            left = len(r.prompt_token_ids) - r.num_computed_tokens
            prefill += max(0, left)
            outputs += r.max_tokens - len(r.output_token_ids)
            if left <= 0 and r.status is RequestStatus.RUNNING:
                decodes += 1
        return {
            "prefill_tokens": prefill,  # prompt tokens still to compute
            "decode_seqs": decodes,  # running sequences past their prompt
            "kv_exports_held": len(sched.held),
            "kv_imports_reserved": len(self._imports),
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            # prompt tokens not yet in the cache plus output tokens not yet generated
            "load_tokens": prefill + outputs,
            "free_kv_blocks": self.blocks.num_free_blocks,
            "total_kv_blocks": self.blocks.num_blocks,
            "capacity_tokens": sched.capacity_tokens,
            "num_preemptions": sched.num_preemptions,
            "num_aborted": self._num_aborted,
            "prefix_cache_query_tokens": self.blocks.query_tokens,
            "prefix_cache_hit_tokens": self.blocks.hit_tokens,
            "prefix_cached_blocks": self.blocks.num_cached_blocks,
            "prefix_cached_tail_blocks": self.blocks.num_tail_blocks,
            "spec_proposed_tokens": self.spec.proposed if self.spec else 0,
            "spec_accepted_tokens": self.spec.accepted if self.spec else 0,
            "spec_verifications": self.spec.steps if self.spec else 0,
        }


def _too_long(n_prompt: int, max_tokens: int, limit: int, capacity: int) -> InvalidRequestError:
    """A request longer than the context or the KV cache, as OpenAI words and codes it (clients
    that trim and retry match the code, or 'maximum context length')."""
    room = min(limit, capacity)
    why = (f"This model's maximum context length is {limit} tokens" if room == limit else
           f"This worker's KV cache holds {capacity} tokens, under the model's maximum context "
           f"length of {limit}")  # fmt: skip
    message = (
        f"{why}. However, you requested {n_prompt + max_tokens} tokens ({n_prompt} in the "
        f"prompt, {max_tokens} in the completion). Please reduce the length of the prompt or "
        "the completion"
    )
    if n_prompt >= room:
        return InvalidRequestError("prompt", message + ".", "context_length_exceeded")
    return InvalidRequestError(
        "max_tokens", f"{message} (max_tokens: at most {room - n_prompt}).",
        "context_length_exceeded",
    )  # fmt: skip
