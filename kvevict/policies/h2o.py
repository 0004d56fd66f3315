"""H2O (Zhang et al., 2023, "Heavy-Hitter Oracle"), the cumulative attention score it shares
with ThinKV and the Attn×HS hybrid, and ObservedAttention, its prefill form."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvevict.policies.base import Method
from kvevict.policies.params import RECENT_WINDOW, choice, declare, integer
from kvevict.signals import NOTHING, GroupReduce, Phase, Regime, Requirements, Signals, group_reduce

if TYPE_CHECKING:
    from kvevict.views import EntryView

ACCUMULATED = "attention"
"""Per-token state of :class:`CumulativeAttention`: attention received so far, ``[B, Hkv, n]`` fp32."""
GROUP = choice("mean", "mean", "max")


def h2o_accumulate(
    accumulated: torch.Tensor, column_sums: torch.Tensor, group: GroupReduce = "mean", *, in_place: bool = False
) -> torch.Tensor:
    """H2O's score update: add the attention each key received in this pass, reduced over
    the GQA group (``[B, Hkv, n]`` += reduce(``[B, Hq, n]``)); ``in_place``: into ``accumulated``."""
    received = group_reduce(column_sums.float(), accumulated.shape[1], group)
    return accumulated.add_(received) if in_place else accumulated + received


class CumulativeAttention(Method):
    """Scores every entry by the attention it received from every query so far: prompt column
    sums (computed in query chunks, no eager attention) plus each later pass's, reduced over
    the GQA group by ``group`` (``mean`` unless a ``group`` parameter says otherwise)."""

    attention_scores = True
    group: GroupReduce = "mean"

    def requirements(self, phase: Phase, evicting: bool, regime: Regime) -> Requirements:
        # Scores accumulate over the whole sequence: observe every pass that can still
        # lead to an eviction.
        return Requirements(column_sums=True) if phase == "prefill" or regime != "prefill" else NOTHING

    def new_tokens(self, layer: EntryView, num_new: int) -> dict[str, torch.Tensor]:
        b, h = layer.positions.shape[:2]
        return {ACCUMULATED: torch.zeros(b, h, num_new, dtype=torch.float32, device=layer.positions.device)}

    def observe(self, layer: EntryView, signals: Signals) -> None:
        if signals.column_sums is None:  # a pass that can no longer lead to an eviction (regime=prefill)
            return
        # in place: the state is a view of the cache's storage (no copy back, every layer of every step)
        h2o_accumulate(self.state(layer)[ACCUMULATED], signals.column_sums, self.group, in_place=True)

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        return self.state(layer)[ACCUMULATED]


class H2O(CumulativeAttention):
    """H2O: keep heavy hitters by cumulative attention plus a recent window.

    Per KV head, the score of an entry is the attention it has received from every query
    so far — prompt column sums (computed in query chunks, no eager attention) plus each
    decode query's row — reduced over the GQA group by ``group`` (DESIGN §3). Sinks and the
    recent window are kept; the lowest non-recent score is evicted.

    Defaults (DESIGN §3): ``sinks=4``; ``window=None`` means ``min(128, budget // 4)`` as
    EpiKV does; pass ``window=budget // 2`` for the original H2O (heavy = recent).
    """

    name = "h2o"
    stackable = True  # its score is the state it accumulated
    comparable_scores = True  # attention probabilities
    summary = "keep heavy hitters by cumulative attention + sinks + a recent window"
    batched = True
    PARAMS = declare(sinks=integer(4), window=RECENT_WINDOW, group=GROUP)


def observed_attention_scores(
    accumulated: torch.Tensor, positions: torch.Tensor, seen: int | torch.Tensor
) -> torch.Tensor:
    """ObservedAttention's score: the attention an entry received from the prompt's queries,
    divided by how many of them could see it (``seen − position``: a causal prompt's early keys
    are seen by more queries, which would favour them alone). ``[B, Hkv, n]`` fp32."""
    return accumulated / (seen - positions).clamp(min=1).float()


class ObservedAttention(CumulativeAttention):
    """ObservedAttention (the prefill form of H2O, Zhang et al., 2023, as kvpress's
    ``ObservedAttentionPress``): compress the prompt by the mean attention each entry received
    from every prompt query that could see it (:func:`observed_attention_scores`).

    The column sums are computed in query chunks (no ``n × n`` matrix, no eager attention),
    reduced over the GQA group by ``group``; prefill only; no sinks or window unless given
    (docs/policies.md).
    """

    name = "observed-attention"
    comparable_scores = True  # attention probabilities
    summary = "compress the prompt by the mean attention each entry got from the prompt (prefill H2O)"
    batched = True
    regimes = ("prefill",)
    PARAMS = declare(sinks=integer(0), window=integer(0), group=GROUP)

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        return observed_attention_scores(self.state(layer)[ACCUMULATED], layer.positions, layer.seen)
