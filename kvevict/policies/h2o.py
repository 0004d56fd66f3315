"""H2O (Zhang et al., 2023, "Heavy-Hitter Oracle")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvevict.budgets import capped_share
from kvevict.policies.base import Policy
from kvevict.signals import NOTHING, GroupReduce, Phase, Regime, Requirements, Signals, group_reduce

if TYPE_CHECKING:
    from kvevict.cache import EvictionLayer

ACCUMULATED = "h2o_attention"


def h2o_accumulate(accumulated: torch.Tensor, column_sums: torch.Tensor, group: GroupReduce = "mean") -> torch.Tensor:
    """H2O's score update: add the attention each key received in this pass, reduced over
    the GQA group (``[B, Hkv, n]`` += reduce(``[B, Hq, n]``))."""
    return accumulated + group_reduce(column_sums.float(), accumulated.shape[1], group)


class H2O(Policy):
    """H2O: keep heavy hitters by cumulative attention plus a recent window.

    Per KV head, the score of an entry is the attention it has received from every query
    so far — prompt column sums (computed in query chunks, no eager attention) plus each
    decode query's row — reduced over the GQA group by ``group`` (DESIGN §3). Sinks and the
    recent window are kept; the lowest non-recent score is evicted.

    Defaults (DESIGN §3): ``sinks=4``; ``window=None`` means ``min(128, budget // 4)`` as
    EpiKV does; pass ``window=budget // 2`` for the original H2O (heavy = recent).
    """

    name = "h2o"
    comparable_scores = True  # attention probabilities
    summary = "keep heavy hitters by cumulative attention + sinks + a recent window"

    def __init__(
        self,
        *,
        sinks: int = 4,
        window: int | None = None,
        group: GroupReduce = "mean",
        regime: Regime | None = None,
    ):
        super().__init__(sinks=sinks, regime=regime)
        self.window = window  # None: scales with the budget, see recent_window
        self.group = group

    def recent_window(self, budget: int) -> int:
        return capped_share(budget) if self.window is None else self.window

    def requirements(self, phase: Phase, evicting: bool) -> Requirements:
        # Scores accumulate over the whole sequence: observe every pass that can still
        # lead to an eviction.
        return Requirements(column_sums=True) if phase == "prefill" or self.evicts_in("decode") else NOTHING

    def new_tokens(self, layer: EvictionLayer, num_new: int) -> dict[str, torch.Tensor]:
        b, h = layer.positions.shape[:2]
        return {ACCUMULATED: torch.zeros(b, h, num_new, dtype=torch.float32, device=layer.positions.device)}

    def observe(self, layer: EvictionLayer, signals: Signals) -> None:
        layer.state[ACCUMULATED] = h2o_accumulate(layer.state[ACCUMULATED], signals.column_sums, self.group)

    def score(self, layer: EvictionLayer, signals: Signals) -> torch.Tensor:
        return layer.state[ACCUMULATED]
