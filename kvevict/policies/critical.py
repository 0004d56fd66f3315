"""CriticalKV (Feng et al., 2025, "Optimizing KV Cache Eviction from an Output Perturbation
Perspective", arXiv 2502.03805): perturbation-constrained selection over any scorer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvevict.policies.base import Assembly, Protector, Ranking, Selector, keep_top, lowest_slots
from kvevict.policies.params import declare, number
from kvevict.signals import Phase, Regime, Requirements, Signals, projected_value_norms, write_new_entries

if TYPE_CHECKING:
    from kvevict.views import EntryView

VALUE_NORM = "value_norm"
"""Per-token state: ``‖v W_O‖₁`` of the entry (mean over its KV head's query heads); NaN for a
decode entry whose norm waits to be computed with others (:meth:`Critical.observe`)."""
PENDING = "pending"
"""Memo key: decode entries per KV head whose norm is not computed yet, an int."""
ATTENTION_SCORERS = "tova, h2o, snapkv, observed-attention, momentkv[mi=false] (with any allocator)"
"""The registered methods whose scores are attention received and that leave the selection to
``critical`` (checked against the registry by tests/policies/test_composition.py)."""


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


def critical_drop_one(
    scores: torch.Tensor, value_norms: torch.Tensor, alpha: float = 0.5, eps: float = 1e-4
) -> torch.Tensor | None:
    """The entry ``[B, H]`` each head drops when it keeps all but one of its ``n`` entries: what
    :func:`critical_keep` leaves out, by one k-th value and one minimum instead of a sort.

    Stage 1 holds the ``s = p + ⌊α·(n − 1 − p)⌋`` highest scores (``p`` protected); with ``t`` the
    ``s``-th highest, those are the scores above ``t`` and the earliest of those tied with it
    (:func:`keep_top`'s ties). Of the others, the entry of the lowest bound goes, the latest of
    those tied (:func:`lowest_slots`). None when the heads' stage 1 sizes differ (one k-th value
    serves one size) or a score or bound is NaN."""
    n = scores.shape[-1]
    protected = torch.isposinf(scores).sum(dim=-1)
    first = protected + (alpha * (n - 1 - protected).clamp(min=0)).floor().long()
    size = int(first.max())
    if size != int(first.min()) or bool(scores.isnan().any()):
        return None
    stage1 = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if size:
        threshold = scores.kthvalue(n - size + 1, dim=-1, keepdim=True).values  # the size-th highest
        above, tied = scores > threshold, scores == threshold
        needed = size - above.sum(dim=-1, keepdim=True)  # tied entries stage 1 takes, the earliest first
        stage1 = above | (tied & (tied.cumsum(dim=-1) <= needed))
    bound = ((scores + eps) * value_norms).masked_fill(~torch.isfinite(scores), float("-inf"))
    return lowest_slots(bound.masked_fill(stage1, float("inf")))


class Critical(Selector):
    """CriticalKV's selection over any attention scorer and any budget allocator (``critical+X``).

    For a head with budget ``b_h`` (from the policy's allocator: uniform, ``adakv``,
    ``pyramidkv``, ``headkv``, in any order of the prefixes): stage 1 keeps the top
    ``⌊α·b_h⌋`` entries by ``X``'s score (``α = 0.5``), stage 2 the rest by
    ``(score + ε)·‖v_i W_O‖₁`` (``ε = 1e-4``), where query head ``h`` projects its KV head's
    value by ``W_O[:, h·d:(h+1)·d]``, the L1 norm is over the hidden dimension and the group's
    heads are averaged (DESIGN §3). The norms are computed once per entry: a prompt's as it
    enters the cache; decode entries, which the recent window protects for ``w`` steps, half a
    window at a time (one product for ``⌈w/2⌉`` entries rather than one per step, each reading
    all of ``W_O``). Works at prefill and at decode time, wherever ``X`` evicts. ``alpha=0`` is
    the stage-2-only ablation.

    ``X`` must score by attention received (tova, h2o, snapkv, observed-attention, momentkv with ``mi=false``):
    the bound weights an attention probability by the value's norm.
    """

    name = "critical"
    batched = True
    stacks = True  # keep and drop_one read the ranking and the value norms (state)
    by_top_scores = True  # stage 1 is a top-k by score; a +inf score survives both stages
    summary = "two-stage perturbation-constrained selection (CriticalKV, α = 0.5) over any attention scorer"
    PARAMS = declare(alpha=number(0.5, 0, 1), eps=number(1e-4, 0))

    def __init__(self, **params: object):
        super().__init__(**params)
        self._protector: Protector | None = None
        self._regime: Regime = "prefill"

    def check(self, policy: Assembly) -> None:
        self._protector, self._regime = policy.protector, policy.regime
        scorer = policy.scorer
        if scorer is None or not scorer.attention_scores:
            raise ValueError(
                f"critical weights attention scores by ‖v W_O‖₁, and {policy.method.name}'s scores "
                f"are not attention received; critical works over: {ATTENTION_SCORERS}"
            )

    def requirements(self, phase: Phase, evicting: bool, regime: Regime) -> Requirements:
        if phase == "prefill":
            return Requirements(value_norms=True)
        # decode entries need their norm only if a later decode-time eviction may drop them
        return Requirements(output_projection=regime != "prefill")

    def new_tokens(self, layer: EntryView, num_new: int) -> dict[str, torch.Tensor]:
        b, h = layer.keys.shape[:2]
        pending = layer.phase() == "decode" and self._regime != "prefill"
        fill = torch.nan if pending else 0.0
        return {VALUE_NORM: torch.full((b, h, num_new), fill, dtype=torch.float32, device=layer.device)}

    def observe(self, layer: EntryView, signals: Signals) -> None:
        if signals.value_norms is not None:
            write_new_entries(self.state(layer)[VALUE_NORM], signals.value_norms, layer.new_columns)
        if signals.output_projection is None:
            return
        memo = self.memo(layer)
        pending = memo.get(PENDING, 0) + signals.num_new
        window = 0 if self._protector is None else self._protector.recent_window(layer.budget)
        if pending < max(1, (window + 1) // 2):  # all still in the recent window: nothing evicts them yet
            memo[PENDING] = pending
            return
        norms = self.state(layer)[VALUE_NORM]
        slots = norms.isnan().to(torch.uint8).topk(pending, dim=-1).indices  # every head holds `pending`
        values = layer.values.gather(2, slots[..., None].expand(-1, -1, -1, layer.values.shape[-1]))
        norms.scatter_(-1, slots, projected_value_norms(values, signals.output_projection, signals.query.shape[1]))
        memo[PENDING] = 0

    def keep(self, layer: EntryView, signals: Signals, ranking: Ranking) -> torch.Tensor:
        return critical_keep(ranking.scores, self.state(layer)[VALUE_NORM], ranking.counts, self.alpha, self.eps)

    def drop_one(self, layer: EntryView, signals: Signals, ranking: Ranking) -> torch.Tensor | None:
        return critical_drop_one(ranking.scores, self.state(layer)[VALUE_NORM], self.alpha, self.eps)
