"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvevict.policies.base import Method
from kvevict.policies.simple import SINKS_AND_WINDOW
from kvevict.signals import NOTHING, Phase, Regime, Requirements, Signals

if TYPE_CHECKING:
    from kvevict.views import EntryView


def tova_scores(last_query_attention: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """TOVA's score: the current query's attention averaged over *all* query heads of the
    layer (``[B, Hq, n]`` → ``[B, Hkv, n]``, the same row for every KV head)."""
    row = last_query_attention.float().mean(dim=1, keepdim=True)
    return row.expand(-1, num_kv_heads, -1)


class TOVA(Method):
    """TOVA: at every step drop the entry the current query attends to least.

    Score (DESIGN §3): attention of the current (last) query, mean over all query heads of
    the layer. Evicts every step by default (``interval=1`` on the cache).
    """

    name = "tova"
    stackable = True
    comparable_scores = True  # attention probabilities
    summary = "evict the entry the current query attends least (mean over heads)"
    batched = True
    attention_scores = True
    mixes_heads = True  # the mean over every query head of the layer
    PARAMS = SINKS_AND_WINDOW

    def requirements(self, phase: Phase, evicting: bool, regime: Regime) -> Requirements:
        return Requirements(last_query_attention=True) if evicting else NOTHING

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        return tova_scores(signals.last_query_attention, layer.num_kv_heads)
