"""Methods that read no attention: Full, Random, KNorm and StreamingLLM (DESIGN §3), and KeyDiff
(docs/policies.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvevict.policies.base import Method
from kvevict.policies.params import WRITTEN_WINDOW, declare, integer
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


def keydiff_scores(keys: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """KeyDiff (Park et al., 2025, arXiv 2504.15364, Eq. 3–4): score ``−cos(k_i, a)``, where the
    anchor ``a`` is the mean of the head's unit keys (``valid`` ``[B, Hkv, n]``: the real ones).
    Keys that point away from the rest are the distinct ones, so they stay. ``[B, Hkv, n]`` fp32."""
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    if valid is None:
        anchor = unit.mean(dim=2, keepdim=True)
    else:
        weight = valid[..., None].float()
        anchor = (unit * weight).sum(dim=2, keepdim=True) / weight.sum(dim=2, keepdim=True).clamp(min=1)
    return -torch.nn.functional.cosine_similarity(unit, anchor, dim=-1)


class KeyDiff(Method):
    """KeyDiff: evict the keys most similar to their head's mean key direction.

    Score (arXiv 2504.15364, Eq. 3–4; docs/policies.md): ``−cos(k_i, ā)``, ``ā`` the mean of the
    head's unit keys over the entries it holds. Attention-free, so it runs in fused-attention
    stacks and evicts while decoding as well as at prefill (``regime="both"`` by default).
    Defaults: no sinks; a recent window of 16 tokens, since a score that reads no query would
    otherwise evict the tokens a sequence has just written (its answer then repeats one digit).
    """

    name = "keydiff"
    summary = "evict the keys most similar to their head's mean key (attention-free)"
    batched = True
    PARAMS = declare(sinks=integer(0), window=WRITTEN_WINDOW)

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        return keydiff_scores(layer.keys, layer.valid)


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
