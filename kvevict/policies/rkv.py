"""R-KV (Cai et al., 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning
Models"), as specified by DESIGN §3."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvevict.budgets import capped_share
from kvevict.policies.base import Method
from kvevict.policies.params import declare, integer, number
from kvevict.policies.selection import in_position_order, position_order
from kvevict.signals import Signals, attention_logits, group_reduce, kept_after

if TYPE_CHECKING:
    from kvevict.views import EntryView

QUERIES = "queries"
"""``layer.memo`` key of the post-RoPE queries of the last ``window`` tokens, ``[B, Hq, ≤w, d]``."""


def rkv_importance(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    kernel: int = 7,
    candidates: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """R-KV's attention importance of ``keys`` ``[B, Hkv, m, d]`` from ``queries``
    ``[B, Hq, r, d]`` (the last ``r`` queries, all after the keys: no causal mask).

    Logits ``q·k·scaling`` are reduced over each GQA group by **max** (before the softmax),
    softmaxed over the candidate keys (``candidates`` ``[B, Hkv, m]`` bool: the non-window
    entries; default all; the others get 0), averaged over the ``r`` queries and smoothed by a
    1-D max pool of width ``kernel`` (stride 1, same length) over neighbouring *positions*
    (``positions`` ``[B, Hkv, m]``: the keys' absolute positions, as the cache stores them
    out of order; default: the keys are in position order; ``valid`` marks the real entries,
    the others pooled last). Returns ``[B, Hkv, m]`` fp32.
    """
    logits = attention_logits(queries, keys, scaling, candidates, causal=False)  # [B, Hq, r, m]
    reduced = group_reduce(logits, keys.shape[1], "max").softmax(dim=-1).nan_to_num(0.0)  # no candidate: 0
    importance = reduced.mean(dim=2)  # [B, Hkv, m]
    if kernel > 1:
        order = None if positions is None else position_order(positions, valid)
        pool = lambda x: F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
        importance = in_position_order(pool, importance, order)
    return importance


def rkv_redundancy(
    keys: torch.Tensor,
    threshold: float = 0.5,
    valid: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """R-KV's redundancy of each key among ``keys`` ``[B, H, n, d]``; returns ``[B, H, n]`` fp32
    (over the real entries of each head where ``valid`` ``[B, H, n]`` marks them; 0 on padding).
    Recency is by ``positions`` ``[B, H, n]`` (the keys' absolute positions: the cache stores
    entries out of order; default: the keys are in position order).

    Exactly (DESIGN §3, per head, fp32): ``K̂`` = keys divided by their L2 norm (+1e-8);
    ``S = K̂K̂ᵀ`` with a zero diagonal; in every row ``i`` that has near-duplicates
    (``j ≠ i`` with ``S_ij > threshold``), the entry ``S_ij*`` of the most recent one
    (largest position ``j*``) is set to 0 (a row without near-duplicates is left unchanged);
    ``R_j = softmax_j(mean_i S_ij)`` (column means over all ``n`` rows).

    So a column ``j`` collects the similarity of every row except those whose newest
    near-duplicate is ``j``: the newest member of a group of near-duplicates is not
    penalised by the group, and the older members are. For a pair of near-duplicates
    only, each one is the other's newest near-duplicate, so neither penalises the other.
    Memory: one ``n × n`` matrix per head of every row at once (``n`` ≤ budget + interval),
    computed once per eviction, every ``interval`` steps.
    """
    k = keys.float()
    k = k / (torch.linalg.vector_norm(k, dim=-1, keepdim=True) + 1e-8)
    sim = k @ k.transpose(-1, -2)  # [B, H, n, n]: every head at once
    n = sim.shape[-1]
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    near = sim > threshold
    if valid is not None:  # padding is no row and no column
        pairs = valid[..., :, None] & valid[..., None, :]
        sim.masked_fill_(~pairs, 0.0)
        near &= pairs
    age = torch.arange(n, device=keys.device).expand(keys.shape[:3]) if positions is None else positions
    newest = torch.where(near, age[..., None, :], -1).argmax(dim=-1, keepdim=True)  # the newest near-duplicate
    has = near.any(dim=-1, keepdim=True)
    sim.scatter_(-1, newest, torch.where(has, 0.0, sim.gather(-1, newest)))  # rows without one: unchanged
    rows = n if valid is None else valid.sum(dim=-1, keepdim=True).clamp(min=1)
    means = sim.sum(dim=-2) / rows
    if valid is None:
        return means.softmax(dim=-1)
    return means.masked_fill(~valid, float("-inf")).softmax(dim=-1).nan_to_num(0.0).masked_fill(~valid, 0.0)


class RKV(Method):
    """R-KV: every ``W`` decode steps, keep the important and non-redundant tokens.

    DESIGN §3. Once the cache exceeds the budget ``B``, every ``interval`` (``W``) decode
    steps the cache keeps its last ``window`` (8) entries plus the top ``B − 8`` of the rest
    by ``λ·I − (1−λ)·R`` (``λ = mix_lambda = 0.1``), so it lives between ``B`` and ``B + W``:

    * ``I`` (:func:`rkv_importance`): the last 8 queries' logits over the non-window keys
      (``signals.scaling``), max over the GQA group, softmax, mean over the 8 queries, max
      pool of width ``kernel`` (7). The queries are the post-RoPE queries of the most
      recent passes, kept in ``layer.memo`` (never more than ``window``, model dtype); only
      these ``8 × n`` rows are computed, no attention matrix and no work on the attention
      path (the policy asks for no signal).
    * ``R`` (:func:`rkv_redundancy`): cosine similarity of the retained keys (the window
      included, as in R-KV's code; the window's columns are then dropped), the most recent
      near-duplicate (``S > threshold = 0.5``) of each row zeroed, column means, softmax.
      This is an ``n × n`` *key-similarity* matrix over the retained keys only
      (``n ≤ B + W``), computed for every row and head at once, once per eviction.

    ``interval`` (``W``) defaults to 128 (the paper's buffer), scaled down for small budgets
    to ``min(128, budget // 2)`` so the cache never more than doubles; the cache's own
    ``interval=`` overrides it. Regimes: ``"decode"`` (default; the prompt is compressed by
    the first decode-time eviction) or ``"both"`` (a prompt over budget is compressed at
    prefill with the prompt's last 8 queries).
    """

    name = "rkv"
    batched = True
    summary = "every W steps keep important, non-redundant tokens (attention - key similarity)"
    regimes = ("decode", "both")
    PARAMS = declare(
        window=integer(8, low=1),
        interval=integer(None, low=1, unset="min(128, budget // 2)"),
        kernel=integer(7, low=1, odd=True),
        mix_lambda=number(0.1, 0, 1),
        threshold=number(0.5, -1, 1, open_high=True),
    )

    def default_interval(self, budget: int) -> int:
        return max(1, capped_share(budget, divisor=2)) if self.interval is None else self.interval

    def observe(self, layer: EntryView, signals: Signals) -> None:
        """Keep the post-RoPE queries of the last ``window`` tokens (every pass)."""
        memo = self.memo(layer)
        recent = signals.query[:, :, -self.window :].detach()
        previous = memo.get(QUERIES)
        if previous is not None and recent.shape[2] < self.window:
            recent = torch.cat([previous.to(recent.dtype), recent], dim=2)[:, :, -self.window :]
        memo[QUERIES] = recent.clone()

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        window = layer.positions >= layer.seen - self.window  # the most recent entries (always retained)
        candidates = kept_after(window, layer.valid)  # the held entries outside the window
        scores = torch.full(layer.positions.shape, float("inf"), device=layer.positions.device)
        if not bool(candidates.any()):
            return scores
        queries = self.memo(layer)[QUERIES]
        importance = rkv_importance(
            queries, layer.keys, signals.scaling, self.kernel, candidates, layer.positions, layer.valid
        )
        redundancy = rkv_redundancy(layer.keys, self.threshold, layer.valid, layer.positions)
        mixed = self.mix_lambda * importance - (1 - self.mix_lambda) * redundancy
        return torch.where(candidates, mixed, scores)
