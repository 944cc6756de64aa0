"""The model runner: turns a scheduler decision into one forward pass and one sampling call.

It owns the KV-cache tensors and the sampler. Per step it builds the batch once (input ids,
positions, cache slots, attention metadata: `PagedAttentionMetadata`), runs the model over all
scheduled tokens, computes logits only for the requests that sample this step (and, for a request
that asked for prompt logprobs, for the prompt positions it computes: `PromptRows`), and samples.

Batch types, and their two hand-offs:
    Scheduler ──SchedulerOutput──▶ ModelRunner ──(token ids, logprobs per request)──▶ Scheduler.update

Prompt logprobs, which only requests that ask for them compute, are appended to the request's
own list (`Request.prompt_logprobs`, shared by its n sequences) as the step finishes.

A model split over ranks (runtime.ranks): the runner on rank 0 builds the step's plan (with
pipeline parallelism, one per micro-batch) and hands it to every rank, each holding the KV cache
of its layers and heads; the logits come back to rank 0, which samples.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels import cpu_ext
from kernels.attention import (
    DecodeGroup,
    PagedAttentionMetadata,
    PrefillChunk,
    TritonAttention,
    check_triton_head_dim,
)
from kernels.dispatch import CPU_KERNEL_DTYPES, FORCE_TRITON
from kernels.linear import onednn_linear_on
from runtime.cuda_graphs import DecodeGraphs
from runtime.model import LlamaForCausalLM, StepContext
from runtime.ranks import RankGroup
from runtime.request import Request
from runtime.sampler import Sampler, SamplingState, TokenLogprobs, apply_token_bitmask
from runtime.scheduler import ScheduledRequest, SchedulerOutput
from runtime.shard_reader import Arena
from runtime.speculative import logprobs_of, verify

log = logging.getLogger(__name__)


def kv_block_bytes(model: LlamaForCausalLM, block_size: int,
                   kv_dtype: torch.dtype | None = None) -> int:  # fmt: skip
    """Bytes one block takes across all layers, keys and values, in `kv_dtype` (default: the
    model's); split over ranks, summed over them (they share the host's memory; a KV head
    replicated on several is counted on each)."""
    cfg, par = model.cfg, model.place.config
    itemsize = torch.empty((), dtype=kv_dtype or model.dtype).element_size()
    per_layer_rank = 2 * block_size * par.kv_heads(cfg) * cfg.head_dim * itemsize
    return cfg.num_layers * par.group_size * per_layer_rank


def kv_cache_dtype(setting: str, model: LlamaForCausalLM, triton: bool) -> torch.dtype:
    """The KV cache's element type for `EngineConfig.kv_cache_dtype`: "auto", the model's;
    "bfloat16", bfloat16 (under a float32 model: on the CPU's own kernels only, `triton` says
    whether the step goes through the Triton kernels, which take a cache in the model's dtype)."""
    if setting == "auto" or model.dtype == torch.bfloat16:
        return model.dtype
    if model.dtype != torch.float32 or triton:
        where = "the Triton kernels" if triton else model.device.type
        raise ValueError(
            "kv_cache_dtype='bfloat16' takes a bfloat16 model, or a float32 one on the CPU's own "
            f"kernels; this one is {model.dtype} on {where}"
        )
    return torch.bfloat16  # under float32 activations: keys and values rounded when written


def _decodes(s: ScheduledRequest) -> bool:
    """Computed as decode rows: one token, or one token and its speculative drafts."""
    return s.num_new_tokens == 1 or bool(s.spec_token_ids)


@dataclass(slots=True)
class _Chunk:
    """Tokens [start, start + len(ids)) of one request, computed in one forward pass."""

    request_id: str
    start: int
    ids: list[int]
    decode: bool  # decode rows (each attends up to itself through the paged decode kernel)


def _chunks(order: list[ScheduledRequest]) -> list[_Chunk]:
    return [_Chunk(s.request.request_id, s.request.num_computed_tokens, s.token_ids(),
                   _decodes(s)) for s in order]  # fmt: skip


# A pipeline-parallel step is cut into micro-batches only where it is compute-bound: each
# micro-batch reads every weight of a stage again, which a memory-bound decode step cannot
# afford (pp=2 with 2 micro-batches ran a batch-8 decode at 0.65x of one rank, bench/parallel).
MICRO_BATCH_TOKENS = 64  # the least tokens of a micro-batch


@dataclass(slots=True)
class PromptRows:
    """Prompt positions of one request whose logits a step computes for its prompt logprobs."""

    request: Request  # the sequence computing them
    first_row: int  # its first logits row (after every sampling request's rows)
    first_token: int  # the prompt token the first row predicts (its logprob): position + 1
    count: int  # rows, consecutive


@dataclass(slots=True)
class Launched:
    """A step whose forward pass has started: what sampling it needs once its logits are in."""

    sampling: list[ScheduledRequest]  # the requests that sample, in logits order
    first: list[int]  # per sampling request: its first logits row
    rows: torch.Tensor  # (R,) hidden rows whose logits are computed
    logits: torch.Tensor | None = None  # (R, vocab) once computed
    sizes: list[int] | None = None  # a pipelined step's micro-batch sizes (RankGroup.finish)
    prompt: list[PromptRows] = field(default_factory=list)  # prompt logprobs' rows, after the
    # sampling rows (requests that asked for prompt_logprobs and have prompt rows this step)


def padded_tables(tables: list[list[int]], width: int, dtype: torch.dtype) -> torch.Tensor:
    """Block tables as one (len(tables), width) tensor, each cut or padded with block 0 to width
    (padding is never read: the kernels stop at each row's length)."""
    return torch.tensor([t[:width] + [0] * (width - len(t)) for t in tables], dtype=dtype)


COMMIT_PIECE = 256 << 20  # bytes committed per call when the KV cache is committed eagerly
COMMIT_REPORT_S = 2.0  # the least seconds between two progress lines of that commit


def _commit(arena: Arena) -> None:
    """Commit the whole arena now, piece by piece, saying how far it got on long commits (a
    fresh page can cost a microVM's host a fault of its own: ~3 s per GB in a Firecracker guest,
    2026-11-23)."""
    t0 = last = time.perf_counter()
    for start in range(0, arena.nbytes, COMMIT_PIECE):
        arena.commit(start, start + COMMIT_PIECE)
        now = time.perf_counter()
        if now - last >= COMMIT_REPORT_S:
            done = min(start + COMMIT_PIECE, arena.nbytes)
            log.info("KV cache: %.1f of %.1f GB committed (%.0f s)", done / 1e9,
                     arena.nbytes / 1e9, now - t0)  # fmt: skip
            last = now
    if last > t0:
        log.info("KV cache: %.1f GB committed in %.1f s", arena.nbytes / 1e9,
                 time.perf_counter() - t0)  # fmt: skip


# Background packing threads (ModelRunner.pack_weights) still alive, and the flag that ends
# them: at exit each is stopped between two weights and joined, as a daemon thread killed inside
# the extension's search aborts the interpreter's shutdown (`edgeinfer generate` exited with
# SIGABRT when its one token came before the search ended).
_PACKERS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_STOP_PACKING = threading.Event()


@atexit.register
def _stop_packing() -> None:
    _STOP_PACKING.set()
    for thread in list(_PACKERS):
        thread.join()


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        attention: str = "auto",
        cpu_kernels: str = "auto",
        ranks: RankGroup | None = None,
        kv_commit: str = "lazy",
        packed_weights: bool = True,
        kv_dtype: torch.dtype | None = None,
    ):
        """`ranks`: the model's other ranks (on rank 0 of a split model), which build their own
        runners with the same settings. `kv_commit` (CPU): "lazy", the KV cache's pages committed as
        blocks first use them; "eager", all of them now (`EngineConfig.kv_cache_commit`).
        `packed_weights` (CPU, float32): few-row matmuls read the exact GGUF blocks (Q4_1, Q4_0,
        Q4_K, Q5_*, Q8_0, Q6_K) of the weights that are such values (`EngineConfig.packed_weights`), found
        by `pack_weights` once the weights are all read. `kv_dtype`: the KV cache's element type
        (default: the model's; bfloat16 under a float32 model on the CPU,
        `EngineConfig.kv_cache_dtype`)."""
        cfg = model.cfg
        if model.device.type == "cuda" or FORCE_TRITON:  # refused now, not at the first step
            check_triton_head_dim(cfg.head_dim)
        self.ranks = ranks
        if ranks is not None:
            ranks.setup(num_blocks=num_blocks, block_size=block_size, attention=attention,
                        cpu_kernels=cpu_kernels, kv_commit=kv_commit,
                        packed_weights=packed_weights, kv_dtype=kv_dtype)  # fmt: skip
        t0 = time.perf_counter()
        # Matmuls (float32 or bfloat16 weights), RMSNorm, RoPE + KV write, SiLU-and-mul: C++
        # kernels where they build and the activations are float32 or bfloat16; the references
        # otherwise. bfloat16 activations take the few-row matmul kernel up to MAX_ROWS_BF16_ACT
        # rows (kernels.linear: torch's bfloat16 GEMM reads the weights at half speed), and the
        # others rounded as their references round (the same bits).
        gemm = norm = fused = None
        on_cpu = model.device.type == "cpu"
        if cpu_kernels != "torch" and model.dtype in CPU_KERNEL_DTYPES and on_cpu:
            gemm, norm = cpu_ext.load_small_gemm(), cpu_ext.load_rms_norm()
            fused = cpu_ext.load_fused()
            if (gemm is None or norm is None or fused is None) and cpu_kernels == "cpu_ext":
                raise RuntimeError(
                    "cpu_kernels='cpu_ext' asked for, but an extension did not build"
                )
        model.use_cpu_kernels(gemm, norm, fused)
        if on_cpu and model.dtype == torch.float32:
            onednn_linear_on()  # decided (a bad EDGEINFER_ONEDNN_LINEAR raised) before serving
        self._pack = packed_weights and gemm is not None
        self._packer: threading.Thread | None = None  # pack_weights' search
        if gemm is None and on_cpu and model.weight_dtype != model.dtype:
            # torch's matmul then widens every bfloat16 weight on every call: slower than float32
            log.warning("bfloat16 weights without the CPU matmul kernel (cpu_kernels=%r or the "
                        "extension did not build): each call widens its weight, slower than "
                        "float32 weights", cpu_kernels)  # fmt: skip
        # Decode attention: the in-place CPU extension where it builds, else the reference.
        if attention == "auto":
            attention = "cpu_ext" if on_cpu and cpu_ext.load() is not None else "torch"
        elif attention == "cpu_ext" and cpu_ext.load() is None:
            raise RuntimeError("attention='cpu_ext' asked for, but the extension did not build")
        self.decode_impl = attention
        # Prompt chunks: in place through the same extension where it takes the model's heads
        # (float32, AVX-512); torch's SDPA otherwise. Not for bfloat16 activations: torch's
        # fused bfloat16 SDPA (its flash-attention kernel, bfloat16 GEMMs) beat the kernel
        # (float32 FMAs on widened rows) even with the cached keys gathered and masked, on a
        # CPU with AMX; not measured on one without. SmolLM2's heads, 512 fresh tokens 0.97
        # against 3.4 ms, 256 new over 768 cached 2.2 against 5.0, 32 over 128 0.12 against
        # 0.14 (2-core Xeon with AMX, 2026-11-25).
        self.model = model
        self.device = model.device
        self.triton = self.device.type == "cuda" or FORCE_TRITON  # the kernels' metadata
        ext = cpu_ext.load() if attention == "cpu_ext" and model.dtype == torch.float32 else None
        group = cfg.num_heads // cfg.num_kv_heads
        self.prefill_in_place = (
            not self.triton and ext is not None and ext.prefill_supported(group, cfg.head_dim)
        )
        self.graphs: DecodeGraphs | None = None  # decode steps replayed (capture_decode_graphs)
        # called before each replay: weights kept compressed join the side stream's decodes an
        # eager forward that raised left running (CompressedBlocks.join)
        self.before_replay: Callable[[], None] | None = None
        self.block_size = block_size
        self.num_blocks = num_blocks
        t1 = time.perf_counter()
        # (layers, 2, slots, n_kv_heads, head_dim): keys then values of this rank's layers and
        # heads. Zeros (what a slot holds before it is written is masked out on every path),
        # from the kernel's zero pages: nothing is written now, and a page is committed when a
        # block first uses it, unless kv_commit="eager" commits them all here. On huge pages
        # only then: a decode step's scattered reads miss the TLB less (153 -> 147 ms a
        # 64-request step, 2026-11-23), but in a microVM guest a fresh 2 MiB page can cost the
        # host tenths of a second when first touched, and a fresh worker's first request
        # touches one in each layer's keys and values (its first token 0.05 s, at times 0.34 s,
        # on 4 KiB pages always 0.035 s; 2-core Xeon guest, 2026-11-25).
        heads, layers = len(model.kv_head_range), len(model.local_layers)
        shape = (layers, 2, num_blocks * block_size, heads, cfg.head_dim)
        self.kv_dtype = kv_dtype or model.dtype
        nbytes = math.prod(shape) * self.kv_dtype.itemsize
        if self.device.type == "cpu":
            arena = Arena(nbytes, huge=kv_commit == "eager")
            if kv_commit == "eager":
                _commit(arena)
            self.kv = arena.tensor()[:nbytes].view(self.kv_dtype).view(shape)
        else:  # preallocated once on the device
            self.kv = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(layers)]
        self.sampler = Sampler(fused)  # (its greedy rows' argmax: the extension's, where built)
        # where start-up went: (start, end) time.perf_counter() of each phase
        self.startup = {"kernels": (t0, t1), "KV cache": (t1, time.perf_counter())}

    def pack_weights(self) -> None:
        """Once the weights are all read (not before: they may still be streaming in), find the
        exact GGUF blocks (Q4_1, Q4_0, Q4_K, Q8_0, Q6_K) of those that are such values, for few-row
        matmuls to read (`packed_weights`); a no-op where it is off or the matmul kernel is not
        used.

        In a background thread on one core, at the lowest priority: nothing waits for it (0.19 s
        on both cores for SmolLM2 would have delayed a fresh worker's first token by as much),
        and each weight's blocks are read from the step after they are found, the float32 weight
        until then. `wait_packed` joins it."""
        if not self._pack or self._packer is not None:
            return

        def run() -> None:
            t0 = time.perf_counter()
            # at the lowest priority: a request's steps come first (Linux: per thread)
            with contextlib.suppress(AttributeError, OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            try:
                self.model.pack_weights(threads=1, stop=_STOP_PACKING.is_set)
            except Exception:  # (out of memory?) the weights packed so far are exact and stay
                log.exception("packed weights: the search stopped; the weights not packed yet "
                              "serve as float32")  # fmt: skip
                return
            packed, dense, nbytes = self.model.packed_weights()
            if _STOP_PACKING.is_set():  # (the process is exiting: a partial count is no result)
                log.info("packed weights: the search stopped at exit (%d of %d matrices packed)",
                         packed, packed + dense)  # fmt: skip
            elif packed:
                formats = ", ".join(f"{n} {f}" for f, n in self.model.packed_formats().items())
                log.info("packed weights: %d of %d matrices are exact GGUF blocks (%s), "
                         "%.0f MB read by a decode pass instead of their float32 (%.2f s, in the "
                         "background)", packed, packed + dense, formats, nbytes / 1e6,
                         time.perf_counter() - t0)  # fmt: skip

        self._packer = threading.Thread(target=run, name="pack-weights", daemon=True)
        self._packer.start()
        _PACKERS.add(self._packer)

    def wait_packed(self) -> None:
        """Return once pack_weights' search is over (at once where none was started)."""
        if self._packer is not None:
            self._packer.join()

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, block_tables: dict[str, list[int]]
    ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
        """Run one step. Returns the tokens to append (one, or with speculative drafts the
        accepted drafts and one more) and their logprobs, where asked, per request id. Prompt
        logprobs it computed are appended to their requests' `prompt_logprobs`."""
        return self.finish(self.launch(out, block_tables))

    @property
    def pipelined(self) -> bool:
        """Whether steps can be launched before earlier ones finish (pipeline parallelism: each
        stage works on a different step)."""
        return self.ranks is not None and self.model.place.config.pp > 1

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> Launched:
        """Start one step's forward pass. Pipelined, it returns once stage 0 has handed the step
        on; otherwise once the logits are in."""
        # Decodes first, shortest context first, so that decodes of similar length are
        # neighbours and share one batched attention call; then prefill chunks. A decode with k
        # speculative drafts is k + 1 decode rows (each position attends up to itself).
        order = sorted(
            out.scheduled,
            key=lambda s: (not _decodes(s), s.request.num_computed_tokens),
        )
        sampling = [(i, s) for i, s in enumerate(order) if s.samples]
        last = (torch.tensor([o.num_new_tokens for o in order]).cumsum(0) - 1).tolist()  # (B,)
        rows: list[int] = []  # hidden rows whose logits are needed: each sampling position
        first: list[int] = []  # per sampling request: its first row in `rows` (and logits)
        for i, s in sampling:
            first.append(len(rows))
            rows.extend(range(last[i] - len(s.spec_token_ids), last[i] + 1))
        prompt: list[PromptRows] = []  # prompt logprobs: only requests that asked for them
        for i, s in enumerate(order):
            req = s.request
            if not req.prompt_rows_left:
                continue
            assert req.prompt_logprobs is not None
            # positions [lo, hi) predict prompt tokens lo + 1 .. hi: those still missing that
            # this chunk computes (the last prompt position predicts the first output token)
            start = req.num_computed_tokens
            lo = max(start, len(req.prompt_logprobs) - 1)
            hi = min(start + s.num_new_tokens, len(req.prompt_token_ids) - 1)
            if lo < hi:
                row0 = last[i] - s.num_new_tokens + 1 + (lo - start)  # its hidden row
                prompt.append(PromptRows(req, len(rows), lo + 1, hi - lo))
                rows.extend(range(row0, row0 + hi - lo))
        step = Launched([s for _, s in sampling], first, torch.tensor(rows, dtype=torch.int64),
                        prompt=prompt)  # fmt: skip
        if self.ranks is None:
            hidden = self._graphed(order, block_tables)
            if hidden is None:
                hidden = self.forward(order, block_tables)  # (T, hidden)
            at = step.rows.to(hidden.device)
            step.logits = self.model.logits(hidden[at]) if rows else hidden.new_empty(0)
            return step
        parts = micro_batches(_chunks(order), self.model.place.config.pp)
        plans = [self._prepare(part, block_tables) for part in parts]
        if self.pipelined:
            step.sizes = self.ranks.launch(self.model, self.kv_caches, plans)
        else:
            step.logits = self.ranks.step(self.model, self.kv_caches, plans, step.rows)
        return step

    @torch.inference_mode()
    def finish(
        self, step: Launched
    ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
        """The launched step's logits (waiting for the pipeline's last stage), sampled: see
        `execute`. Pipelined steps finish in the order they were launched."""
        logits = step.logits
        if logits is None:
            assert self.ranks is not None and step.sizes is not None
            logits = self.ranks.finish(self.model, step.sizes, step.rows)
        logits = logits.cpu()  # sampled on the host (a no-op on the CPU)
        sampling, first = step.sampling, step.first
        for p in step.prompt:  # raw log_softmax of the model's logits, as vLLM's
            req, lps = p.request, p.request.prompt_logprobs
            assert lps is not None and req.params.prompt_logprobs is not None
            skip = len(lps) - p.first_token  # rows a sibling sequence gave meanwhile
            if 0 <= skip < p.count:  # (< 0: rows missing before these, never the case: the
                # scheduler keeps such requests out of the prefix cache)
                targets = req.prompt_token_ids[p.first_token + skip : p.first_token + p.count]
                rows_p = logits[p.first_row + skip : p.first_row + p.count]  # (count, vocab)
                entries = logprobs_of(rows_p, targets, req.params.prompt_logprobs)
                at = rows_p.gather(1, torch.tensor(targets).unsqueeze(1))  # (count, 1)
                for e, rank in zip(entries, ((rows_p > at).sum(dim=-1) + 1).tolist(),
                                   strict=True):  # fmt: skip
                    e.rank = rank  # (1 + the tokens with a larger logit)
                lps.extend(entries)
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if not sampling:
            return tokens, logprobs
        plain = [j for j, s in enumerate(sampling) if not s.spec_token_ids]
        if plain:
            rows = [first[j] for j in plain]
            # every row, in order (no speculation in the step): no gather of a (B, vocab) copy
            whole = rows == list(range(logits.shape[0]))
            picked = logits if whole else logits[torch.tensor(rows)]
            self._sample([sampling[j] for j in plain], picked, tokens, logprobs)
        for j, s in enumerate(sampling):  # speculative rows: verify their drafts
            k = len(s.spec_token_ids)
            if k:
                req = s.request
                rows_k = logits[first[j] : first[j] + k + 1]  # (k+1, vocab)
                if req.grammar is not None:  # drafts the grammar refuses are never accepted
                    rows_k = apply_token_bitmask(rows_k, req.grammar.mask())
                q = req.spec_draft_probs  # a draft model's q, or None: point masses
                kept = verify(rows_k, s.spec_token_ids, req.params, req.generator,
                              None if q is None else q[:k])  # fmt: skip
                tokens[req.request_id] = kept
                if req.params.logprobs is not None:
                    logprobs[req.request_id] = logprobs_of(rows_k, kept, req.params.logprobs)
        return tokens, logprobs

    def capture_decode_graphs(self, max_batch: int, max_model_len: int, capture: bool = True) -> None:
        """Decode steps of up to `max_batch` requests from now on run through `DecodeGraphs`
        (captured now, on CUDA; `capture=False`: the same padded steps, eagerly). A dense model
        only: a mixture-of-experts model's steps stay eager."""
        if self.model.cfg.moe is not None:
            return
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_batch,
                                   max_model_len, capture)  # fmt: skip

    def _graphed(self, order: list[ScheduledRequest],
                 block_tables: dict[str, list[int]]) -> torch.Tensor | None:  # fmt: skip
        """A step of plain decodes (one token each) through the decode graphs; None for any other
        step, or without graphs."""
        g = self.graphs
        if g is None or len(order) > g.max_batch:
            return None
        if any(s.num_new_tokens != 1 or s.spec_token_ids for s in order):
            return None
        ids, positions, slots, tables, lens = [], [], [], [], []
        for s in order:
            start = s.request.num_computed_tokens
            table = block_tables[s.request.request_id]
            ids.append(s.request.token_at(start))
            positions.append(start)
            slots.append(table[start // self.block_size] * self.block_size + start % self.block_size)
            tables.append(table)
            lens.append(start + 1)
        if self.before_replay is not None:
            self.before_replay()
        return g.run(ids, positions, slots, tables, lens)

    @torch.inference_mode()
    def forward(
        self, order: list[ScheduledRequest], block_tables: dict[str, list[int]]
    ) -> torch.Tensor:
        """The model over the scheduled tokens, in `order` (decodes first, then prefill chunks),
        writing their keys and values; the hidden states (T, hidden). A draft model's runner
        calls this directly and computes its own logits."""
        input_ids, ctx = self._prepare(_chunks(order), block_tables)
        return self.model(input_ids, ctx, self.kv_caches)  # (T, hidden)

    def _sample(
        self,
        scheduled: list[ScheduledRequest],
        logits: torch.Tensor,
        tokens: dict[str, list[int]],
        logprobs: dict[str, list[TokenLogprobs]],
    ) -> None:
        """One token per request from its logits row (the sampler, batched)."""
        states = [
            SamplingState(
                params=s.request.params,
                generator=s.request.generator,
                prompt_token_ids=s.request.prompt_token_ids,
                output_token_ids=s.request.output_token_ids,
                token_bitmask=None if s.request.grammar is None else s.request.grammar.mask()[0],
            )
            for s in scheduled
        ]
        result = self.sampler(logits, states)
        for s, t, lp in zip(scheduled, result.token_ids, result.logprobs, strict=True):
            tokens[s.request.request_id] = [t]
            if lp is not None:
                logprobs[s.request.request_id] = [lp]

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.int64)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def _decode_groups(self, tables: list[list[int]], lens: list[int]) -> list[DecodeGroup]:
        """Split the (length-sorted) decodes into groups whose padding stays under ~1/3: the
        reference pads every request of a group to its longest. The CPU extension reads each
        request's own length, so it takes them all in one group, without a mask."""
        if self.decode_impl == "cpu_ext" and lens:
            return [self._decode_group(0, tables, lens, masked=False)]
        groups: list[DecodeGroup] = []
        i = 0
        while i < len(lens):
            j = i + 1
            while j < len(lens) and (lens[j] * 3 <= lens[i] * 4 or j - i < 4):
                j += 1
            groups.append(self._decode_group(i, tables[i:j], lens[i:j]))
            i = j
        return groups

    def _decode_group(
        self, start: int, tables: list[list[int]], lens: list[int], masked: bool = True
    ) -> DecodeGroup:
        n, max_len = len(lens), max(lens)
        width = -(-max_len // self.block_size)
        padded = padded_tables(tables, width, torch.int64)  # (n, blocks), one tensor per step
        mask = None
        if masked and min(lens) != width * self.block_size:
            lengths = torch.tensor(lens)
            keys = torch.arange(width * self.block_size)
            mask = (keys[None, :] < lengths[:, None])[:, None, None, :]  # (n, 1, 1, L)
        return DecodeGroup(
            start=start, size=n, block_ids=padded, lens=torch.tensor(lens), mask=mask
        )

    def _prepare(
        self, order: list[_Chunk], block_tables: dict[str, list[int]]
    ) -> tuple[torch.Tensor, StepContext]:
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        prefill_tables: list[list[int]] = []  # for the in-place prefill kernel
        for c in order:
            start, n = c.start, len(c.ids)
            table = block_tables[c.request_id]
            ids.extend(c.ids)
            if c.decode:
                decode_tables += [table] * n
                decode_lens += range(start + 1, start + n + 1)
            else:
                chunk = PrefillChunk(query_start=len(ids) - n, query_len=n, context_len=start)
                if self.prefill_in_place:
                    prefill_tables.append(table)
                elif start > 0 and not self.triton:
                    chunk.kv_slots = self._slots(table, 0, start + n)
                    q_pos = torch.arange(start, start + n)[:, None]  # (n, 1)
                    chunk.mask = torch.arange(start + n)[None, :] <= q_pos  # (n, start + n)
                prefills.append(chunk)
            positions.append(torch.arange(start, start + n))
            slots.append(self._slots(table, start, start + n))

        dev = self.device
        meta = PagedAttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev, non_blocking=True),
            block_size=self.block_size,
            decode_impl=self.decode_impl,
        )
        if self.triton:
            meta.triton = self._triton_meta(decode_tables, decode_lens, order, prefills,
                                            block_tables)  # fmt: skip
        else:
            meta.prefills = prefills
            meta.decodes = self._decode_groups(decode_tables, decode_lens)
            if prefill_tables:
                width = max(len(t) for t in prefill_tables)
                meta.prefill_tables = padded_tables(prefill_tables, width, torch.int64)
                meta.prefill_spans = torch.tensor(
                    [[p.query_start, p.query_len, p.context_len] for p in prefills],
                    dtype=torch.int64,
                )
        ctx = StepContext(positions=torch.cat(positions).to(dev, non_blocking=True), attn=meta)
        return torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True), ctx

    def _triton_meta(self, decode_tables: list[list[int]], decode_lens: list[int],
                     order: list[_Chunk], prefills: list[PrefillChunk],
                     block_tables: dict[str, list[int]]) -> TritonAttention:  # fmt: skip
        """The step as the Triton kernels read it: block tables padded with block 0 (never read
        past a row's length), int32, on the model's device."""
        chunks = [c for c in order if not c.decode]
        prefill_tables = [block_tables[c.request_id] for c in chunks]
        width = max([1, *(len(t) for t in decode_tables + prefill_tables)])

        def table(rows: list[list[int]]) -> torch.Tensor:
            return padded_tables(rows, width, torch.int32).to(self.device, non_blocking=True)

        starts = [0]
        for p in prefills:
            starts.append(starts[-1] + p.query_len)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(self.device, non_blocking=True)

        return TritonAttention(
            num_decodes=len(decode_lens),
            decode_block_tables=table(decode_tables),
            decode_seq_lens=ints(decode_lens),
            prefill_block_tables=table(prefill_tables),
            query_start_loc=ints(starts),
            context_lens=ints([p.context_len for p in prefills]),
            max_query_len=max((p.query_len for p in prefills), default=0),
        )

    # --------------------------------------------------------------- KV of a split model
    def kv_read(self, layers: slice, block_ids: list[int]) -> tuple[range, range, torch.Tensor]:
        """This rank's share of blocks `block_ids` of the model's layers `layers`: (its layers
        among them, its KV heads, (layers, 2, blocks, block_size, heads, head_dim))."""
        mine, local = self._local_layers(layers)
        blocks = self._blocks()[local]
        data = blocks.index_select(2, torch.tensor(block_ids, dtype=torch.int64))
        return mine, self.model.kv_head_range, data

    def kv_write_local(self, layers: slice, block_ids: list[int], data: torch.Tensor) -> None:
        """Write this rank's share (as `kv_read` gives it) of blocks `block_ids`."""
        _, local = self._local_layers(layers)
        index = torch.tensor(block_ids, dtype=torch.int64)
        self._blocks()[local].index_copy_(2, index, data)

    def copy_slots(self, src: int, dst: int, n: int) -> None:
        """Copy the keys and values of block `src`'s first `n` slots into block `dst`'s, every
        layer (a kept partial block that a second request continues: BlockManager.copy_slots).
        Queued on the device's stream before the step that reads `dst`. This process's cache
        only: a split model's ranks hold theirs."""
        assert self.ranks is None, "a split model's ranks would each need the copy"
        b = self.block_size
        self.kv[:, :, dst * b : dst * b + n] = self.kv[:, :, src * b : src * b + n]

    def _blocks(self) -> torch.Tensor:
        """(local layers, 2, num_blocks, block_size, heads, head_dim) view of the cache."""
        n, _, slots, heads, dim = self.kv.shape
        return self.kv.view(n, 2, slots // self.block_size, self.block_size, heads, dim)

    def _local_layers(self, layers: slice) -> tuple[range, slice]:
        """Of the model's layers `layers`, the ones this rank holds, and their local slice."""
        wanted = range(*layers.indices(self.model.cfg.num_layers))
        own = self.model.local_layers
        lo, hi = max(wanted.start, own.start), min(wanted.stop, own.stop)
        hi = max(lo, hi)
        return range(lo, hi), slice(lo - own.start, hi - own.start)


def micro_batches(chunks: list[_Chunk], pp: int) -> list[list[_Chunk]]:
    """A step's chunks cut into micro-batches of about equal tokens, in order, for `pp` pipeline
    stages: up to 2 * pp of them (bubble (pp - 1) / (m + pp - 1)), none under
    MICRO_BATCH_TOKENS tokens; a prefill chunk may be cut in two (its second part attends to the
    first, written before it on every stage), decode rows are not."""
    total = sum(len(c.ids) for c in chunks)
    m = min(2 * pp, total // MICRO_BATCH_TOKENS)
    if pp == 1 or m < 2:
        return [chunks]
    size = -(-total // m)
    parts: list[list[_Chunk]] = [[]]
    room = size
    for c in chunks:
        while True:
            if room == 0:
                parts.append([])
                room = size
            if c.decode or len(c.ids) <= room:
                parts[-1].append(c)
                room = max(0, room - len(c.ids))
                break
            head = _Chunk(c.request_id, c.start, c.ids[:room], False)
            parts[-1].append(head)
            c = _Chunk(c.request_id, c.start + room, c.ids[room:], False)
            room = 0
    return [p for p in parts if p]
