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


GENERATOR = "generator"
"""Shared data key of :class:`Random`: each row's generator state, ``[1, S]`` uint8."""


class Random(Method):
    """Keeps a uniformly random subset, reproducible: every sequence draws from its own
    generator seeded with ``seed`` (the same choices on every new cache, and a row of a
    batch draws what it draws alone). A row keeps its generator's state as a ``[1, S]``
    byte tensor in its shared data, so rows in lockstep read them stacked and each row
    draws from its own, in turn."""

    name = "random"
    summary = "keep a seeded random subset of the entries"
    batched = True
    regimes = ("prefill", "decode", "both")
    PARAMS = declare(**SINKS_AND_WINDOW, seed=integer(0))

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        shared = self.shared(layer.owner)
        rows, *shape = layer.positions.shape
        generator = torch.Generator().manual_seed(self.seed)
        states = shared.get(GENERATOR)
        if states is None:
            states = generator.get_state()[None].expand(rows, -1)
        draws, after = [], []
        for state in states:
            generator.set_state(state.clone())  # set_state reads a tensor from its storage's start
            draws.append(torch.rand([1, *shape], generator=generator))
            after.append(generator.get_state())
        shared[GENERATOR] = torch.stack(after)
        return torch.cat(draws).to(layer.positions.device)


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
