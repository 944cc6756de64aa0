"""The mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE) and expert parallelism.

    x (T, hidden) ─▶ router: softmax over the E experts' logits (float32), top-k, the k weights
                     renormalised to sum to 1 (Mixtral always; Qwen when norm_topk_prob)
      ─▶ the T*k (token, expert) pairs sorted by expert (a stable argsort of the flat top-k
         assignments) and counted per expert
      ─▶ each expert with tokens: one gate/up matmul, SiLU, one down matmul, over its
         contiguous rows of the sorted batch (a loop over experts, never over tokens)
      ─▶ the results put back in (token, k) order and summed with the router weights
      (+ Qwen2-MoE: a dense shared expert on every token, scaled by sigmoid(shared_expert_gate))

The experts' weights are stacked: gate/up (E, 2 * inter, hidden), gate rows first, and down
(E, hidden, inter), the layout transformers 5 keeps them in, so the loader places each expert's
checkpoint tensors (or the stacked ones) once.

Expert parallelism over `ep` ranks (torch.distributed; gloo on the CPU, whose all_to_all_single
takes uneven splits): rank r holds experts [r*E/ep, (r+1)*E/ep). Attention is replicated, so
every rank has the same (T, hidden). Rank r routes tokens [r*c, (r+1)*c), c = ceil(T/ep), and:

    counts per (destination rank, its expert) ──all_to_all──▶ what each rank will receive
    its (token, expert) rows, sorted by expert ──all_to_all──▶ the experts' owners
    each owner: its received rows regrouped by expert, one matmul pair per expert
    the results ──all_to_all──▶ back to the token's rank, summed with the router weights
    + the shared expert on its tokens; every rank's c rows ──all_gather──▶ (T, hidden) everywhere

The token split makes each rank route and dispatch only its share; where ranks hold different
tokens (attention split by request), the all_gather would drop out and the rest stays as is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist
from torch import nn

from kernels.linear import small_linear
from runtime.config import ModelConfig
from runtime.model.layers import MLP, Linear, WeightTarget, _param


@dataclass(frozen=True, slots=True)
class ExpertParallel:
    """This process's place among the ranks that share a model's experts."""

    rank: int  # 0 <= rank < size
    size: int  # ranks; each holds num_experts / size of every sparse layer's experts
    group: dist.ProcessGroup | None = None  # the ranks' process group; None: the default one

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"ep must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"ep rank must be in [0, {self.size}), got {self.rank}")

    def check(self, cfg: ModelConfig) -> None:
        """That this model's experts can be spread over `size` ranks."""
        if self.size == 1:
            return
        if cfg.moe is None:
            raise ValueError(
                f"ep={self.size} needs a mixture-of-experts model; {cfg.architecture} has no experts"
            )
        if cfg.moe.num_experts % self.size:
            raise ValueError(
                f"ep={self.size} does not divide the {cfg.moe.num_experts} experts of "
                f"{cfg.architecture} (ep must divide the expert count)"
            )


SINGLE = ExpertParallel(0, 1)

# (pair rows sorted by expert (N, hidden), their experts (N,)) -> the experts' outputs (N, hidden)
ExpertRun = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Per-expert checkpoint names (Mixtral's w1/w3/w2 and Qwen's) -> (our stacked parameter, piece):
# piece 0 and 1 are the gate and up halves of an expert's gate_up_proj rows.
_EXPERT_PROJ = {
    "w1": ("gate_up_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "up_proj": ("gate_up_proj", 1),
    "w2": ("down_proj", 0),
    "down_proj": ("down_proj", 0),
}


class Experts(nn.Module):
    """This rank's experts, stacked: experts [first, first + n) of the layer's E."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ep: ExpertParallel):
        super().__init__()
        assert cfg.moe is not None
        self.num_experts, self.inter, self.hidden = (
            cfg.moe.num_experts,
            cfg.moe.intermediate_size,
            cfg.hidden_size,
        )
        self.n = self.num_experts // ep.size
        self.first = ep.rank * self.n
        self.mixtral_names = cfg.family == "mixtral"
        self.gate_up_proj = _param(self.n, 2 * self.inter, self.hidden, dtype=dtype)
        self.down_proj = _param(self.n, self.hidden, self.inter, dtype=dtype)
        # the CPU's few-row matmul kernel (kernels.linear), set by use_cpu_kernels: decoding
        # sends each expert a few rows
        self.small_gemm: ModuleType | None = None

    def forward(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """xs: (N, hidden), rows sorted by local expert, counts[e] rows each -> (N, hidden)."""
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = xs[start : start + n]  # (n, hidden): the tokens sent to expert e
                gate_up = small_linear(rows, self.gate_up_proj[e], None, self.small_gemm)
                gate, up = gate_up.split(self.inter, -1)
                h = nn.functional.silu(gate) * up  # (n, inter)
                out[start : start + n] = small_linear(h, self.down_proj[e], None, self.small_gemm)
            start += n
        return out

    def weight_target(self, parts: list[str]) -> WeightTarget | None:
        """Where a checkpoint tensor named `experts.<parts>` goes, relative to this module: one
        expert's `<e>.<proj>.weight` fills its rows of the stack; the stacked `gate_up_proj` /
        `down_proj` (transformers 5's layout) fill the whole stack from this rank's rows. None:
        another rank's expert. A name that is neither maps to no parameter (the loader says so)."""
        unknown = WeightTarget(".".join(parts))
        if len(parts) == 1 and parts[0] in ("gate_up_proj", "down_proj"):
            rows_per = 2 * self.inter if parts[0] == "gate_up_proj" else self.hidden
            cols = self.hidden if parts[0] == "gate_up_proj" else self.inter
            return WeightTarget(
                parts[0],
                rows=self.n * rows_per,
                src_row=self.first * rows_per,
                shape=(self.num_experts, rows_per, cols),
            )
        if len(parts) != 3 or parts[2] != "weight" or parts[1] not in _EXPERT_PROJ:
            return unknown
        try:
            e = int(parts[0])
        except ValueError:
            return unknown
        if not 0 <= e < self.num_experts:
            return unknown
        if not self.first <= e < self.first + self.n:
            return None
        param, piece = _EXPERT_PROJ[parts[1]]
        if param == "gate_up_proj":
            return WeightTarget(param, row=(e - self.first) * 2 * self.inter + piece * self.inter,
                                rows=self.inter)  # fmt: skip
        return WeightTarget(param, row=(e - self.first) * self.hidden, rows=self.hidden)

    def checkpoint_name(self, param: str, row: int) -> str:
        """The per-expert checkpoint tensor (relative to the MoE block) that fills `row`."""
        if param == "gate_up_proj":
            e, piece = divmod(row, 2 * self.inter)
            proj = ("w3" if self.mixtral_names else "up_proj") if piece >= self.inter else (
                "w1" if self.mixtral_names else "gate_proj")  # fmt: skip
        else:
            e, proj = row // self.hidden, "w2" if self.mixtral_names else "down_proj"
        return f"experts.{self.first + e}.{proj}.weight"


class MoE(nn.Module):
    """A sparse layer's MLP: router, experts (this rank's), and Qwen2-MoE's shared expert."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ep: ExpertParallel):
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.top_k, self.norm_topk_prob, self.ep = moe.top_k, moe.norm_topk_prob, ep
        self.gate = Linear(cfg.hidden_size, moe.num_experts, False, dtype)  # the router
        self.experts = Experts(cfg, dtype, ep)
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = MLP(cfg, dtype, shared) if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, False, dtype) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden), the same on every rank -> (T, hidden)."""
        if self.ep.size == 1:
            return self._tokens(x, self._experts_here)
        T, H = x.shape
        c = -(-T // self.ep.size)
        mine = x[self.ep.rank * c : (self.ep.rank + 1) * c]  # (n, hidden), n <= c, maybe 0
        out = x.new_zeros(c, H)  # padded: all_gather takes equal sizes
        out[: mine.shape[0]] = self._tokens(mine, self._experts_exchanged)
        gathered = [torch.empty_like(out) for _ in range(self.ep.size)]
        dist.all_gather(gathered, out, group=self.ep.group)
        return torch.cat(gathered)[:T]  # (T, hidden)

    def _tokens(self, x: torch.Tensor, run: ExpertRun) -> torch.Tensor:
        """Route x (n, hidden), run the pairs sorted by expert through `run`, combine."""
        n, k = x.shape[0], self.top_k
        if n:
            probs = self.gate(x).softmax(dim=-1, dtype=torch.float32)  # (n, E)
            weights, ids = probs.topk(k, dim=-1)  # (n, k) each
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:  # a rank with no tokens this step still takes part in the exchange
            weights = torch.empty(0, k, device=x.device)
            ids = torch.empty(0, k, dtype=torch.int64, device=x.device)
        flat = ids.flatten()  # (n*k,): expert of each (token, slot) pair
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        xs = x[order // k]  # (n*k, hidden), sorted by expert
        ys = run(xs, flat[order])  # (n*k, hidden), same order
        back = torch.empty_like(ys)
        back[order] = ys  # (n*k, hidden) in (token, slot) order
        out = (back.view(n, k, x.shape[1]).float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)
        if n and self.shared_expert is not None and self.shared_expert_gate is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out  # (n, hidden)

    def _experts_here(self, xs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(ids, minlength=self.experts.n).tolist()
        return self.experts(xs, counts)

    def _experts_exchanged(self, xs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """xs (N, hidden) sorted by expert `ids`, sent to the experts' ranks and back."""
        ep, group, per_rank = self.ep, self.ep.group, self.experts.n
        send = torch.bincount(ids, minlength=self.experts.num_experts).view(ep.size, per_rank)
        recv = torch.empty_like(send)  # (ep, per_rank): from each rank, rows for each expert
        dist.all_to_all_single(recv, send, group=group)
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        xr = xs.new_empty(sum(recv_splits), xs.shape[1])  # by source rank, then by expert
        dist.all_to_all_single(xr, xs, recv_splits, send_splits, group=group)
        local = torch.repeat_interleave(
            torch.arange(per_rank, device=recv.device).repeat(ep.size), recv.flatten()
        )
        order = torch.argsort(local, stable=True)  # received rows grouped by expert
        yr = torch.empty_like(xr)
        yr[order] = self.experts(xr[order], recv.sum(0).tolist())
        ys = torch.empty_like(xs)
        dist.all_to_all_single(ys, yr, send_splits, recv_splits, group=group)
        return ys
