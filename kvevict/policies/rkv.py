"""R-KV (Cai et al., 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning
Models"), as specified by DESIGN §3."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvevict.budgets import capped_share
from kvevict.policies.base import Policy
from kvevict.signals import Regime, Signals, attention_logits, group_reduce

if TYPE_CHECKING:
    from kvevict.cache import EvictionLayer

QUERIES = "rkv_queries"
"""``layer.memo`` key of the post-RoPE queries of the last ``window`` tokens, ``[B, Hq, ≤w, d]``."""


def rkv_importance(queries: torch.Tensor, keys: torch.Tensor, scaling: float, kernel: int = 7) -> torch.Tensor:
    """R-KV's attention importance of ``keys`` ``[B, Hkv, m, d]`` (the non-window keys) from
    ``queries`` ``[B, Hq, r, d]`` (the last ``r`` queries, all after the keys: no mask).

    Logits ``q·k·scaling`` are reduced over each GQA group by **max** (before the softmax),
    softmaxed over the ``m`` keys, averaged over the ``r`` queries and smoothed by a 1-D max
    pool of width ``kernel`` (stride 1, same length). Returns ``[B, Hkv, m]`` fp32.
    """
    logits = attention_logits(queries, keys, scaling, causal=False)  # [B, Hq, r, m]
    importance = group_reduce(logits, keys.shape[1], "max").softmax(dim=-1).mean(dim=2)  # [B, Hkv, m]
    if kernel > 1:
        importance = F.max_pool1d(importance, kernel, stride=1, padding=kernel // 2)
    return importance


def rkv_redundancy(keys: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """R-KV's redundancy of each key among ``keys`` ``[B, H, n, d]``; returns ``[B, H, n]`` fp32.

    Exactly (DESIGN §3, per head, fp32): ``K̂`` = keys divided by their L2 norm (+1e-8);
    ``S = K̂K̂ᵀ`` with a zero diagonal; in every row ``i`` that has near-duplicates
    (``j ≠ i`` with ``S_ij > threshold``), the entry ``S_ij*`` of the most recent one
    (largest index ``j*``) is set to 0 (a row without near-duplicates is left unchanged);
    ``R_j = softmax_j(mean_i S_ij)`` (column means over all ``n`` rows).

    So a column ``j`` collects the similarity of every row except those whose newest
    near-duplicate is ``j``: the newest member of a group of near-duplicates is not
    penalised by the group, and the older members are. For a pair of near-duplicates
    only, each one is the other's newest near-duplicate, so neither penalises the other.
    Memory: one ``n × n`` matrix per head at a time (``n`` ≤ budget + interval).
    """
    out = keys.new_empty(keys.shape[:3], dtype=torch.float32)
    index = torch.arange(keys.shape[2], device=keys.device)
    for b in range(keys.shape[0]):
        for h in range(keys.shape[1]):
            k = keys[b, h].float()
            k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
            sim = k @ k.T
            sim.fill_diagonal_(0.0)
            near = sim > threshold
            newest = torch.where(near, index, -1).amax(dim=-1)  # -1: no near-duplicate
            rows = (newest >= 0).nonzero().squeeze(-1)
            sim[rows, newest[rows]] = 0.0
            out[b, h] = sim.mean(dim=0).softmax(dim=-1)
    return out


class RKV(Policy):
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
      (``n ≤ B + W``), computed one KV head at a time, as R-KV does.

    ``interval`` (``W``) defaults to 128 (the paper's buffer), scaled down for small budgets
    to ``min(128, budget // 2)`` so the cache never more than doubles; the cache's own
    ``interval=`` overrides it. Regimes: ``"decode"`` (default; the prompt is compressed by
    the first decode-time eviction) or ``"both"`` (a prompt over budget is compressed at
    prefill with the prompt's last 8 queries).
    """

    name = "rkv"
    summary = "every W steps keep important, non-redundant tokens (attention - key similarity)"
    regimes = ("decode", "both")

    def __init__(
        self,
        *,
        window: int = 8,
        interval: int | None = None,
        kernel: int = 7,
        mix_lambda: float = 0.1,
        threshold: float = 0.5,
        regime: Regime | None = None,
    ):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"rkv: window must be an integer >= 1, got {window!r}")
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
            raise ValueError(f"rkv: interval must be an integer >= 1 or None (min(128, budget // 2)), got {interval!r}")
        if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"rkv: kernel must be a positive odd number, got {kernel!r}")
        if not 0 <= mix_lambda <= 1:
            raise ValueError(f"rkv: mix_lambda must be in [0, 1], got {mix_lambda}")
        if not -1 <= threshold < 1:
            raise ValueError(f"rkv: threshold (cosine similarity) must be in [-1, 1), got {threshold}")
        super().__init__(window=window, regime=regime)
        self.interval = interval  # None: min(128, budget // 2)
        self.kernel = kernel
        self.mix_lambda = mix_lambda
        self.threshold = threshold

    def default_interval(self, budget: int) -> int:
        return max(1, capped_share(budget, divisor=2)) if self.interval is None else self.interval

    def observe(self, layer: EvictionLayer, signals: Signals) -> None:
        """Keep the post-RoPE queries of the last ``window`` tokens (every pass)."""
        recent = signals.query[:, :, -self.window :].detach()
        previous = layer.memo.get(QUERIES)
        if previous is not None and recent.shape[2] < self.window:
            recent = torch.cat([previous.to(recent.dtype), recent], dim=2)[:, :, -self.window :]
        layer.memo[QUERIES] = recent.clone()

    def score(self, layer: EvictionLayer, signals: Signals) -> torch.Tensor:
        n = layer.length
        m = n - min(self.window, n)  # the window is the last entries (always retained)
        scores = torch.full(layer.positions.shape, float("inf"), device=layer.positions.device)
        if m == 0:
            return scores
        importance = rkv_importance(layer.memo[QUERIES], layer.keys[:, :, :m], signals.scaling, self.kernel)
        redundancy = rkv_redundancy(layer.keys, self.threshold)[..., :m]
        scores[..., :m] = self.mix_lambda * importance - (1 - self.mix_lambda) * redundancy
        return scores
