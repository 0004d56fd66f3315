"""Baselines that read no attention: Full, Random, KNorm and StreamingLLM (DESIGN §3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvevict.policies.base import Policy
from kvevict.signals import Phase, Regime, Signals

if TYPE_CHECKING:
    from kvevict.cache import EvictionLayer


class Full(Policy):
    """No eviction: the reference every other policy is compared with."""

    name = "full"
    summary = "no eviction (the full cache)"

    def evicts_in(self, phase: Phase) -> bool:
        return False


class Random(Policy):
    """Keeps a uniformly random subset (seeded, reproducible): each sequence draws from its
    own generator seeded with ``seed``, so a row of a batch draws what it draws alone."""

    name = "random"
    summary = "keep a seeded random subset of the entries"
    regimes = ("prefill", "decode", "both")

    def __init__(self, *, seed: int = 0, sinks: int = 0, window: int = 0, regime: Regime | None = None):
        super().__init__(sinks=sinks, window=window, regime=regime)
        self.seed = seed

    def score(self, layer: EvictionLayer, signals: Signals) -> torch.Tensor:
        generator = layer.owner.shared.setdefault("random.generator", torch.Generator().manual_seed(self.seed))
        return torch.rand(layer.positions.shape, generator=generator).to(layer.positions.device)


def knorm_scores(keys: torch.Tensor) -> torch.Tensor:
    """KNorm (Devoto et al., 2024): score ``-‖k‖₂``; low-norm keys draw attention, so they stay."""
    return -keys.float().norm(dim=-1)


class KNorm(Policy):
    """KNorm: evict the keys with the largest L2 norm (score ``-‖k‖₂``, DESIGN §3)."""

    name = "knorm"
    summary = "evict the keys with the largest L2 norm (score -||k||)"
    regimes = ("prefill", "decode", "both")

    def score(self, layer: EvictionLayer, signals: Signals) -> torch.Tensor:
        return knorm_scores(layer.keys)


class StreamingLLM(Policy):
    """StreamingLLM (Xiao et al., 2024): attention sinks plus the most recent tokens.

    Default: 4 sinks; every other retained entry is the most recent (score = position).
    """

    name = "streamingllm"
    summary = "keep 4 attention sinks + the most recent tokens"

    def __init__(self, *, sinks: int = 4, regime: Regime | None = None):
        super().__init__(sinks=sinks, window=0, regime=regime)

    def score(self, layer: EvictionLayer, signals: Signals) -> torch.Tensor:
        return layer.positions.float()
