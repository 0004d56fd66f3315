"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from kvevict.policies.base import Method
from kvevict.policies.h2o import GROUP
from kvevict.policies.params import choice, declare, integer
from kvevict.signals import NOTHING, GroupReduce, Phase, Regime, Requirements, Signals, group_reduce

if TYPE_CHECKING:
    from kvevict.views import EntryView

POOLING = declare(kernel=integer(7, low=1, odd=True), pool=choice("max", "max", "avg"))


def snapkv_scores(
    window_attention: torch.Tensor,
    num_kv_heads: int,
    kernel: int = 7,
    pool: Literal["max", "avg"] = "max",
    group: GroupReduce = "mean",
) -> torch.Tensor:
    """SnapKV's score of every key from the attention of the observation window.

    ``window_attention`` is ``[B, Hq, w, n]`` (post-softmax over all ``n`` keys, causal in
    the window). The scores of the ``n - w`` keys before the window are the mean over the
    ``w`` window queries, smoothed by a 1-D pooling of width ``kernel`` (stride 1, same
    length), then reduced over the GQA group. Window keys get ``+inf`` (always kept).
    Returns ``[B, Hkv, n]`` fp32.
    """
    b, hq, w, n = window_attention.shape
    votes = window_attention.float().mean(dim=2)[..., : n - w]
    if kernel > 1 and n > w:
        flat = votes.reshape(b * hq, 1, n - w)
        pooled = (
            F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
            if pool == "max"
            else F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
        )
        votes = pooled.reshape(b, hq, n - w)
    scores = group_reduce(votes, num_kv_heads, group)
    return F.pad(scores, (0, w), value=float("inf"))


class SnapKV(Method):
    """SnapKV: compress the prompt once by the votes of its last ``window`` queries.

    DESIGN §3: the last ``w=32`` queries (post-RoPE, causal inside the window) attend to all
    keys; softmax; mean over the window queries; 1-D max pooling of kernel 7
    (``pool="max"|"avg"``); GQA mean; the window's own tokens are always kept.
    Prefill only.
    """

    name = "snapkv"
    comparable_scores = True  # attention probabilities
    summary = "compress the prompt by the attention of its last 32 queries, max-pooled (prefill)"
    regimes = ("prefill",)
    batched = True
    attention_scores = True
    PARAMS = declare(window=integer(32, low=1), **POOLING, group=GROUP, sinks=integer(0))

    def requirements(self, phase: Phase, evicting: bool, regime: Regime) -> Requirements:
        return Requirements(window=self.window) if evicting else NOTHING

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        return snapkv_scores(signals.window_attention, layer.num_kv_heads, self.kernel, self.pool, self.group)
