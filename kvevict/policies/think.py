"""ThinK (Xu et al., 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning", arXiv 2407.21018):
prune the key channels the queries use least, as a second axis beside the tokens.

ThinK looks for the channel selection ``S`` (``T`` of the ``D`` channels of a head) that keeps
the attention logits of the observation window closest to the full ones,
``min_S ‖Q Kᵀ − Q S (K S)ᵀ‖_F``, and solves it greedily: channel ``j`` scores
``‖Q[:, j] K[:, j]ᵀ‖_F``, the norm of its rank-one share of the logits, which is
``‖Q[:, j]‖₂ · ‖K[:, j]‖₂``; each head prunes its ``⌊λ D⌋`` worst, ``λ`` the pruning ratio
(the paper's main setting 0.4, which with the values untouched frees 20 % of the cache). ``Q``: the
last ``w = 32`` queries of the prompt (SnapKV's observation window, across the chunks of a chunked prompt); with grouped-query attention,
every query head of the KV head's group, as one matrix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from kvevict.policies.base import Observer
from kvevict.policies.params import declare, integer, number
from kvevict.signals import kept_after, new_entries

if TYPE_CHECKING:
    from kvevict.signals import Signals
    from kvevict.views import EntryView


def channel_scores(queries: torch.Tensor, keys: torch.Tensor, held: torch.Tensor | None) -> torch.Tensor:
    """ThinK's score of every key channel, ``[B, Hkv, d]`` fp32: ``‖Q[:, j]‖₂ · ‖K[:, j]‖₂``, ``Q``
    the window's queries ``[B, Hq, w, d]`` of the KV head's query group, ``K`` its keys ``[B, Hkv,
    n, d]`` where ``held`` ``[B, Hkv, n]`` (None: all)."""
    b, hq, w, d = queries.shape
    hkv = keys.shape[1]
    query_norms = queries.float().reshape(b, hkv, hq // hkv * w, d).square().sum(dim=2).sqrt()
    keys = keys.float() if held is None else keys.float() * held[..., None]
    return query_norms * keys.square().sum(dim=2).sqrt()


def kept_channels(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """``[B, H, d]`` bool: each head's ``keep`` highest-scoring channels (ties: the earlier channel)."""
    best = scores.argsort(dim=-1, descending=True, stable=True)[..., :keep]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True)


def channels_to_keep(head_dim: int, ratio: float) -> int:
    """``T = D − ⌊λ D⌋`` (``λ D`` rounded as decimals are), at least one: 39 of 64 at ``λ = 0.4``."""
    return max(1, head_dim - int(round(ratio * head_dim, 6)))


class Think(Observer):
    """ThinK: at the end of the prompt, each KV head prunes its ``⌊ratio·d⌋`` key channels of
    lowest ``‖Q[:, j]‖·‖K[:, j]‖`` (:func:`channel_scores`, the window's last ``window`` queries
    and the keys the token policy keeps of the prompt, as kvpress's ``ComposedPress([press, ThinKPress])``
    scores them); the prompt's keys are zero there from then on, so attention is exactly
    attention over what is kept (the logit scale stays the model's). Keys appended afterwards keep
    every channel, as ThinK (and kvpress's ``ThinKPress``) prune the prompt's cache only: pruning
    the generated keys too lost every answer kvpress kept on our RULER comparison
    (docs/measurements.md). Between passes the cache holds the prompt's keys at the kept channels
    only: their bytes fall by ``ratio``. Composes with any token policy (``think+snapkv``: SnapKV picks the tokens
    with every channel, then ThinK prunes the channels of what is kept); ``think`` alone prunes
    channels of the full cache. Refused with ``quant=`` (the channels of codes cannot be dropped
    without re-quantizing)."""

    name = "think"
    summary = "prune each head's key channels the window's queries use least (ThinK; frees key bytes)"
    batched = True
    rewrites_keys: ClassVar[bool] = True
    acts_alone: ClassVar[bool] = True
    PARAMS = declare(ratio=number(0.4, 0.0, 1.0, open_high=True), window=integer(32, low=1))

    def observe(self, layer: EntryView, signals: Signals) -> None:
        if signals.phase != "prefill" or not self.ratio:
            return
        queries = signals.query[:, :, -self.window :]
        held = layer.valid
        if held is not None:  # a left-padded row's padding queries are not its own: zero, they add nothing
            real = new_entries(held, signals.num_new, layer.new_columns)[:, :1, -queries.shape[2] :]
            queries = queries * real[..., None].to(queries.dtype)
        memo = self.memo(layer)
        if "queries" in memo:  # a prompt in chunks: the window may reach into the chunks before
            queries = torch.cat([memo.pop("queries"), queries], dim=2)[:, :, -self.window :]
        if layer.prompt_continues:
            memo["queries"] = queries
            return
        if layer.eviction_due(signals.phase, signals.num_new):  # the prompt's eviction follows: score what it keeps
            memo["window"] = queries
            return
        self._prune(layer, queries, held)

    def on_evict(self, layer: EntryView, evicted: torch.Tensor) -> None:
        memo = self.memo(layer)
        if "window" in memo:  # the prompt's eviction (observe): ThinK scores the channels of the entries kept
            self._prune(layer, memo.pop("window"), kept_after(evicted, layer.valid))

    def _prune(self, layer: EntryView, queries: torch.Tensor, held: torch.Tensor | None) -> None:
        head_dim = layer.keys.shape[-1]
        keep = kept_channels(channel_scores(queries, layer.keys, held), channels_to_keep(head_dim, self.ratio))
        layer.keep_channels(keep)
