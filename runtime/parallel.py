"""How one worker's model is split over ranks: tensor, pipeline and expert parallelism.

    ranks = pp stages x g ranks each, g = max(tp, ep); rank = stage * g + local
      stage s holds layers stages[s] (contiguous, balanced by cost, not by count) and their KV
      stage 0 also holds the embedding and the LM head (tied models keep one tensor), so the
        tokens go in and the logits come out on rank 0, which owns the scheduler
      the last stage holds the final norm and sends its hidden states back to stage 0
      within a stage, tp > 1: each rank holds n_heads / tp query heads and their KV heads (a KV
        head replicated where there are fewer KV heads than ranks), 1 / tp of every MLP's
        intermediate rows, 1 / tp of the vocabulary; one all-reduce after o_proj and one after
        down_proj per layer, one all-reduce after the embedding, one gather of the logits
      within a stage, ep > 1: each rank holds num_experts / ep of every sparse layer's experts
        (runtime.model.moe); with tp > 1 too, ep must be tp: the experts spread over the same
        ranks, not sliced

`ParallelConfig` is the user's setting, checked against a model's config before anything starts
(a ValueError naming the setting and the constraint); `RankPlace` is one rank's position in it,
with its process groups once torch.distributed is up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

from runtime.config import ModelConfig

if TYPE_CHECKING:  # runtime.model imports this module
    from runtime.model.moe import ExpertParallel


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Degrees of parallelism of one worker: its ranks are pp * max(tp, ep) processes."""

    tp: int = 1  # tensor parallel: attention heads, MLP rows and the vocabulary split
    pp: int = 1  # pipeline parallel: contiguous layer ranges (stages)
    ep: int = 1  # expert parallel: a mixture-of-experts model's experts spread

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.tp > 1 and self.ep > 1 and self.tp != self.ep:
            raise ValueError(
                f"ep={self.ep} with tp={self.tp}: when both are above 1 they must be equal (the "
                "experts are spread over the tensor-parallel ranks)"
            )

    @property
    def group_size(self) -> int:
        """Ranks per pipeline stage."""
        return max(self.tp, self.ep)

    @property
    def world_size(self) -> int:
        return self.pp * self.group_size

    def check(self, cfg: ModelConfig) -> None:
        """That `cfg` can be split so; a ValueError naming the setting and the constraint."""
        arch = cfg.architecture
        if self.tp > 1:
            if cfg.num_heads % self.tp:
                raise ValueError(
                    f"tp={self.tp} does not divide the {cfg.num_heads} attention heads of {arch} "
                    "(tp must divide num_attention_heads)"
                )
            kv = cfg.num_kv_heads
            if kv % self.tp and self.tp % kv:
                raise ValueError(
                    f"tp={self.tp} and the {kv} key/value heads of {arch}: one must divide the "
                    "other (KV heads are split over the ranks, or replicated when fewer)"
                )
            dense = [
                i for i in range(cfg.num_layers) if cfg.moe is None or not cfg.moe.is_sparse(i)
            ]
            if dense and cfg.intermediate_size % self.tp:
                raise ValueError(
                    f"tp={self.tp} does not divide the intermediate size {cfg.intermediate_size} "
                    f"of {arch} (tp must divide intermediate_size)"
                )
            if cfg.moe is not None and self.ep != self.tp:
                raise ValueError(
                    f"tp={self.tp} on the mixture-of-experts model {arch} needs ep={self.tp}: "
                    "its experts are spread over the tensor-parallel ranks, not sliced"
                )
        if self.pp > cfg.num_layers:
            raise ValueError(
                f"pp={self.pp} is more than the {cfg.num_layers} layers of {arch} (every "
                "pipeline stage needs at least one layer)"
            )
        from runtime.model.moe import ExpertParallel

        ExpertParallel(0, self.ep).check(cfg)

    def stages(self, cfg: ModelConfig) -> list[range]:
        """Each stage's layers: contiguous, the most expensive stage as cheap as can be, with the
        embedding and the LM head counted on stage 0 (which holds them)."""
        return balanced_stages([layer_cost(cfg, i) for i in range(cfg.num_layers)],
                               self.pp, head=head_cost(cfg))  # fmt: skip

    def kv_heads(self, cfg: ModelConfig) -> int:
        """KV heads each rank caches."""
        return max(1, cfg.num_kv_heads // self.tp)


def layer_cost(cfg: ModelConfig, i: int) -> float:
    """Weights one token goes through in layer i (its matmul work, up to a constant)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    if cfg.moe is not None and cfg.moe.is_sparse(i):
        moe = cfg.moe
        mlp = h * moe.num_experts + 3 * h * moe.intermediate_size * moe.top_k
        mlp += 3 * h * moe.shared_expert_intermediate_size
    else:
        mlp = 3 * h * cfg.intermediate_size
    return float(attn + mlp)


def head_cost(cfg: ModelConfig) -> float:
    """The LM head's weights per sampled token (the embedding lookup is next to free)."""
    return float(cfg.vocab_size * cfg.hidden_size)


def balanced_stages(costs: list[float], pp: int, head: float = 0.0) -> list[range]:
    """Split layers with these costs into `pp` contiguous non-empty ranges minimising the largest
    range's cost, `head` added to the first one's. Ties go to the split with more layers early."""
    n = len(costs)
    if not 1 <= pp <= n:
        raise ValueError(f"cannot split {n} layers into {pp} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][j]: the least largest cost of splitting layers [0, j) into s stages; cut: where the
    # last of them starts
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for s in range(1, pp + 1):
        for j in range(s, n - (pp - s) + 1):
            for i in range(s - 1, j):
                cost = prefix[j] - prefix[i] + (head if i == 0 else 0.0)
                worst = max(best[s - 1][i], cost)
                if worst < best[s][j]:
                    best[s][j], cut[s][j] = worst, i
    ranges: list[range] = []
    j = n
    for s in range(pp, 0, -1):
        i = cut[s][j]
        ranges.append(range(i, j))
        j = i
    return ranges[::-1]


@dataclass(frozen=True, slots=True)
class RankPlace:
    """One rank's position: its stage and its layers, its place within the stage, and the process
    group of its stage (None before torch.distributed is up, or with one rank per stage)."""

    config: ParallelConfig = field(default_factory=ParallelConfig)
    rank: int = 0
    stages: tuple[range, ...] = ()  # every stage's layers; () until a model's config is known
    group: dist.ProcessGroup | None = None  # this stage's ranks (tp all-reduces, ep exchanges)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def stage(self) -> int:
        return self.rank // self.config.group_size

    @property
    def local(self) -> int:
        """Index within the stage."""
        return self.rank % self.config.group_size

    @property
    def tp_rank(self) -> int:
        return self.local if self.config.tp > 1 else 0

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.config.pp - 1

    def layers(self, num_layers: int) -> range:
        return self.stages[self.stage] if self.stages else range(num_layers)

    @property
    def ep(self) -> ExpertParallel:
        from runtime.model.moe import SINGLE, ExpertParallel

        if self.config.ep == 1:
            return SINGLE
        return ExpertParallel(self.local, self.config.ep, self.group)

    def stage_rank(self, stage: int) -> int:
        """The rank of `stage` in this rank's position within its stage (where its hidden states
        go and come from)."""
        return stage * self.config.group_size + self.local

    def with_model(self, cfg: ModelConfig) -> RankPlace:
        """This place with the stages of `cfg` filled in (after checking it can be split so)."""
        self.config.check(cfg)
        return RankPlace(self.config, self.rank, tuple(self.config.stages(cfg)), self.group)


SINGLE_RANK = RankPlace()
