"""CriticalKV (Feng et al., 2025, "Optimizing KV Cache Eviction from an Output Perturbation
Perspective", arXiv 2502.03805): perturbation-constrained selection over any scorer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvevict.policies.base import Policy, Wrapper, keep_top
from kvevict.signals import Phase, Requirements, Signals

if TYPE_CHECKING:
    from kvevict.cache import EvictionLayer

VALUE_NORM = "critical_value_norm"
"""Per-token state: ``‖v W_O‖₁`` of the entry (mean over its KV head's query heads)."""


def critical_keep(
    scores: torch.Tensor, value_norms: torch.Tensor, counts: torch.Tensor, alpha: float = 0.5, eps: float = 1e-4
) -> torch.Tensor:
    """Algorithm 1 (two-stage perturbation-constrained selection), per head.

    ``scores`` ``[B, H, n]`` are the base policy's selection scores (protected entries at
    ``+inf``, padding at ``-inf``); ``counts`` ``[B, H]`` the entries each head keeps.
    Of a head's ``b = counts − protected`` free slots, stage 1 keeps the top ``⌊α·b⌋`` by
    the base score; stage 2 fills the rest by ``(score + ε)·‖v W_O‖₁``, the entry's bound
    on the output perturbation (Theorem 3.5). Returns the keep mask ``[B, H, n]``.
    """
    protected = torch.isposinf(scores).sum(dim=-1)
    free = (counts - protected).clamp(min=0)
    stage1 = keep_top(scores, protected + (alpha * free).floor().long())
    bound = ((scores + eps) * value_norms).masked_fill(~torch.isfinite(scores), float("-inf"))
    return keep_top(bound.masked_fill(stage1, float("inf")), counts)


class Critical(Wrapper):
    """CriticalKV over any attention scorer and any budget allocator (``critical+X``).

    For a head with budget ``b_h`` (from ``X``'s allocator: uniform, ``adakv``,
    ``pyramidkv``, ``headkv``): stage 1 keeps the top ``⌊α·b_h⌋`` entries by ``X``'s score
    (``α = 0.5``), stage 2 the rest by ``(score + ε)·‖v_i W_O‖₁`` (``ε = 1e-4``), where query
    head ``h`` projects its KV head's value by ``W_O[:, h·d:(h+1)·d]``, the L1 norm is over
    the hidden dimension and the group's heads are averaged (DESIGN §3). The norms are
    computed once per entry, when it enters the cache, one query head at a time. Works at
    prefill and at decode time, wherever ``X`` evicts. ``alpha=0`` is the stage-2-only
    ablation.
    """

    prefix = "critical"
    summary = "two-stage perturbation-constrained selection (CriticalKV, α = 0.5) over any attention scorer"

    def __init__(self, inner: Policy, *, alpha: float = 0.5, eps: float = 1e-4):
        if not 0 <= alpha <= 1:
            raise ValueError(
                f"critical: alpha must be in [0, 1] (share of each head's budget chosen by score), got {alpha}"
            )
        if eps < 0:
            raise ValueError(f"critical: eps must be >= 0, got {eps}")
        super().__init__(inner)
        self.alpha = alpha
        self.eps = eps

    def requirements(self, phase: Phase, evicting: bool) -> Requirements:
        # decode entries need their norm only if a later decode-time eviction may drop them
        needs_norms = phase == "prefill" or self.evicts_in("decode")
        return self.inner.requirements(phase, evicting) | Requirements(value_norms=needs_norms)

    def new_tokens(self, layer: EvictionLayer, num_new: int) -> dict[str, torch.Tensor]:
        b, h = layer.keys.shape[:2]
        zeros = torch.zeros(b, h, num_new, dtype=torch.float32, device=layer.device)
        return {**self.inner.new_tokens(layer, num_new), VALUE_NORM: zeros}

    def observe(self, layer: EvictionLayer, signals: Signals) -> None:
        self.inner.observe(layer, signals)
        if signals.value_norms is not None:
            layer.state[VALUE_NORM][..., -signals.num_new :] = signals.value_norms

    def select_from_scores(self, layer: EvictionLayer, scores: torch.Tensor, budget: int) -> torch.Tensor:
        counts = self.allocate(layer, scores, budget)
        return critical_keep(scores, layer.state[VALUE_NORM], counts, self.alpha, self.eps)
