"""Baselines that read no attention: Full, Random, KNorm and StreamingLLM (DESIGN §3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvevict.policies.base import Method
from kvevict.policies.params import declare, integer
from kvevict.signals import Signals

if TYPE_CHECKING:
    from kvevict.views import EntryView

SINKS_AND_WINDOW = declare(sinks=integer(0), window=integer(0))
"""The protector's parameters of the simple methods: first and most recent tokens always kept."""


class Full(Method):
    """No eviction: the reference every other policy is compared with."""

    name = "full"
    batched = True  # no hooks: rows in lockstep share one view
    summary = "no eviction (the full cache)"
    evicts = False


class Random(Method):
    """Keeps a uniformly random subset, reproducible: every sequence draws from its own
    generator seeded with ``seed`` (the same choices on every new cache, and a row of a
    batch draws what it draws alone)."""

    name = "random"
    summary = "keep a seeded random subset of the entries"
    regimes = ("prefill", "decode", "both")
    PARAMS = declare(**SINKS_AND_WINDOW, seed=integer(0))

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        shared = self.shared(layer.owner)
        if "generator" not in shared:
            shared["generator"] = torch.Generator().manual_seed(self.seed)
        return torch.rand(layer.positions.shape, generator=shared["generator"]).to(layer.positions.device)


def knorm_scores(keys: torch.Tensor) -> torch.Tensor:
    """KNorm (Devoto et al., 2024): score ``-‖k‖₂``; low-norm keys draw attention, so they stay."""
    return -torch.linalg.vector_norm(keys.float(), dim=-1)


class KNorm(Method):
    """KNorm: evict the keys with the largest L2 norm (score ``-‖k‖₂``, DESIGN §3)."""

    name = "knorm"
    summary = "evict the keys with the largest L2 norm (score -||k||)"
    batched = True
    regimes = ("prefill", "decode", "both")
    PARAMS = SINKS_AND_WINDOW

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        return knorm_scores(layer.keys)


class StreamingLLM(Method):
    """StreamingLLM (Xiao et al., 2024): attention sinks plus the most recent tokens.

    Default: 4 sinks; every other retained entry is the most recent (score = position).
    """

    name = "streamingllm"
    summary = "keep 4 attention sinks + the most recent tokens"
    batched = True
    distinct_scores = True  # a head holds each position once
    stackable = True
    PARAMS = declare(sinks=integer(4))

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        return layer.positions.float()
