"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured at start-up.

A decode step on a GPU is ~10 launches per layer of tiny kernels; replaying a captured graph
issues them as one. A graph fixes its tensors' addresses and shapes, so every input lives in a
static buffer sized for the largest bucket, and a step of n decodes runs the graph of the
smallest bucket >= n with its rows n.. padded: token 0 at position 0, cache slot -1 (its key and
value are not written), sequence length 0 (its attention is zeros), block table 0. Their hidden
states are computed and dropped; nothing reads them.

The Triton kernels take everything from tensors (no host reads), so a captured step is the same
code as an eager one. Only dense models are captured: a mixture-of-experts layer sorts its
tokens by expert, whose group sizes differ from step to step.

`capture=False` runs the same padded static-buffer steps eagerly: on the CPU, with the Triton
kernels interpreted (kernels.dispatch), that is how the padding is tested without a GPU.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from kernels.attention import PagedAttentionMetadata, TritonAttention

if TYPE_CHECKING:
    from runtime.model import LlamaForCausalLM

log = logging.getLogger("edgeinfer.cuda_graphs")


def buckets(max_batch: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every 8 up to max_batch (vLLM's spacing)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_batch: int,
        max_model_len: int,
        capture: bool = True,
    ):
        from runtime.model import StepContext

        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.sizes = buckets(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        dev, n = model.device, self.max_batch
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(n, dtype=torch.int32, device=dev)
        none = torch.zeros(0, dtype=torch.int32, device=dev)
        no_tables = torch.zeros(0, self.max_blocks, dtype=torch.int32, device=dev)
        self.contexts: dict[int, StepContext] = {}
        for b in self.sizes:
            meta = PagedAttentionMetadata(
                slot_mapping=self.slots[:b],
                block_size=block_size,
                triton=TritonAttention(
                    num_decodes=b,
                    decode_block_tables=self.tables[:b],
                    decode_seq_lens=self.lens[:b],
                    prefill_block_tables=no_tables,
                    query_start_loc=torch.zeros(1, dtype=torch.int32, device=dev),
                    context_lens=none,
                    max_query_len=0,
                ),
            )
            self.contexts[b] = StepContext(positions=self.positions[:b], attn=meta)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        t0 = time.perf_counter()
        pool = None
        for b in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles, the allocator settles
                    self._forward(b)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured decode graphs for batch sizes %s in %.2f s", self.sizes,
                 time.perf_counter() - t0)  # fmt: skip

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(self.ids[:b], self.contexts[b], self.kv_caches)

    def bucket(self, n: int) -> int | None:
        """The batch size whose graph runs n decodes; None when n is above the largest."""
        return next((b for b in self.sizes if b >= n), None)

    @torch.inference_mode()
    def run(self, ids: list[int], positions: list[int], slots: list[int],
            tables: list[list[int]], lens: list[int]) -> torch.Tensor:  # fmt: skip
        """One decode step of n = len(ids) rows (n <= max_batch; each row one token, attending to
        lens[i] keys through tables[i]); the hidden states (n, hidden)."""
        n = len(ids)
        b = self.bucket(n)
        if b is None:
            raise ValueError(f"{n} decodes: above the largest captured batch ({self.max_batch})")
        width = self.max_blocks
        if any(len(t) > width for t in tables):  # past max_model_len: the scheduler's to prevent
            raise ValueError(f"a block table longer than the graphs' {width} blocks")
        pad = b - n
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad,
                             dtype=torch.int32)  # fmt: skip
        self.ids[:b].copy_(torch.tensor(ids + [0] * pad), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.slots[:b].copy_(torch.tensor(slots + [-1] * pad), non_blocking=True)
        self.lens[:b].copy_(torch.tensor(lens + [0] * pad, dtype=torch.int32), non_blocking=True)
        self.tables[:b].copy_(table, non_blocking=True)
        graph = self.graphs.get(b)
        if graph is None:  # capture=False: the same step, eagerly
            return self._forward(b)[:n]
        graph.replay()
        return self.outputs[b][:n]
