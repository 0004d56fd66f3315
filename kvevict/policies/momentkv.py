"""MomentKV (seed 003; Li, Li & Lan, 2026, "MomentKV: Closing the Directional Gap in KV Cache
Eviction for Long-Context Inference"): the ``momentkv`` method and the ``moment-nc`` stage.
The math lives in :mod:`kvevict.moments`.

MomentKV is a few stages over one observer: :class:`MomentStatistics` keeps the moment
statistics of every entry a layer evicts (its ``on_evict`` hook; they are not per token, so
they live in the stage's ``memo``); :class:`MomentMI`, the selector, evicts by the moment
residual; :class:`MomentNC`, the corrector, applies normalization-corrected inference to
every later pass, the decode steps and the question tokens after context compression alike
(called before the pass evicts). Until something is evicted the correction is the identity,
bit for bit, and costs nothing. ``moment-nc+<policy>`` is the corrector, with its own
statistics, over any policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvevict.moments import MomentStats, accumulate, accumulate_one, mi_evict, nc_correct, nc_log_partition
from kvevict.policies.allocation import AdaKV
from kvevict.policies.base import Corrector, Method, Observer, Ranking, Selector, SinksAndWindow, Stage, Stages, Uniform
from kvevict.policies.h2o import GROUP
from kvevict.policies.params import choice, declare, flag, integer, number
from kvevict.policies.selection import in_position_order, position_order
from kvevict.policies.snapkv import snapkv_scores
from kvevict.signals import NOTHING, Phase, Regime, Requirements, Signals, group_reduce, kept_after

if TYPE_CHECKING:
    from kvevict.views import EntryView, ScoringCache

MOMENTS = "moments"
"""Key of a layer's :class:`~kvevict.moments.MomentStats` in the statistics stage's ``memo``."""
ORDER = choice(1, 0, 1)
"""0: mean value only; 1: mean + value-key covariance."""


class MomentStatistics(Observer):
    """The moment statistics of the entries each layer evicted (Eq. 25), ``order`` 0 or 1."""

    name = "moments"
    batched = True
    stackable_evictions = True  # reads the evicted entries' keys and values, keeps its sums in memo
    PARAMS = declare(order=ORDER)

    def statistics(self, layer: EntryView) -> MomentStats:
        """The layer's statistics (zeros before its first eviction)."""
        stats = self.memo(layer).get(MOMENTS)
        if stats is None:
            b, h, _, key_dim = layer.keys.shape
            stats = MomentStats.zeros(b, h, key_dim, layer.values.shape[-1], self.order, layer.keys.device)
        return stats

    def recorded(self, layer: EntryView) -> MomentStats | None:
        """The layer's statistics once it evicted something, else None."""
        return self.memo(layer).get(MOMENTS)

    def on_evict(self, layer: EntryView, evicted: torch.Tensor) -> None:
        self.memo(layer)[MOMENTS] = accumulate(self.statistics(layer), layer.keys, layer.values, evicted)

    def on_evict_one(self, layer: EntryView, slots: torch.Tensor) -> None:
        stats = self.statistics(layer).writable()
        accumulate_one(stats, layer.keys, layer.values, slots)
        self.memo(layer)[MOMENTS] = stats  # free where the memo holds it already, or its rows' views of it


class MomentNC(Corrector):
    """MomentKV's normalization-corrected inference (seed 003, Eq. 12), as the corrector of
    ``momentkv`` or over any policy: ``moment-nc+<policy>`` (the "NC only" ablation with another
    scorer).

    The policy decides what to evict, unchanged; every entry it drops is added to the layer's
    moment statistics (``order=1``: ``n_e, Σk, Σv, Σ v kᵀ``; ``order=0``: no outer product), and
    every later pass mixes the retained output with the moment estimate of the evicted one:
    ``w_R = σ(log Z_R − log Ẑ_E)``, ``w_R f_R + (1 − w_R) f̂_E``.
    Example: ``make_policy("moment-nc+h2o", sinks=2, **{"moment-nc": {"order": 0}})``.
    """

    name = "moment-nc"
    batched = True
    reads_token_state = False  # only the statistics (memo) and the pass's log Z
    summary = "MomentKV's normalization-corrected attention over any policy (moment-nc+<policy>)"
    PARAMS = declare(order=ORDER)

    def __init__(self, *, statistics: MomentStatistics | None = None, **params: object):
        super().__init__(**params)
        self.statistics = MomentStatistics(order=self.order) if statistics is None else statistics
        """The statistics it reads: its own, or those its method keeps (``momentkv``)."""

    def companions(self) -> tuple[Stage, ...]:
        return (self.statistics,)

    def correct(
        self,
        layer: EntryView,
        query: torch.Tensor,
        output: torch.Tensor,
        scaling: float,
        log_partition: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """NC (Eq. 12) of the kernel's output ``[B, q, Hq, d]`` from the layer's statistics
        (``log Z_R``: ``log_partition`` when the pass computed it, the same logits' log-sum-exp)."""
        stats = self.statistics.recorded(layer)
        if stats is None:  # nothing evicted yet (a head that evicted nothing passes through bit for bit)
            return output
        log_z = nc_log_partition(query, layer.keys, scaling, layer.valid) if log_partition is None else log_partition
        return nc_correct(output.transpose(1, 2), log_z, query, stats, scaling).transpose(1, 2)


class MomentMI(Selector):
    """Moment-informed eviction (Eq. 10): residual ``r_j = v_j − v̄ − S̃ k_j/(n_e √d)``, score
    ``α_j·‖r_j‖``; evict the argmin, update the statistics, repeat, until each head holds its
    count (``max(evict_chunk, ⌊evict_fraction·n_e⌋)`` entries per update; 1 and 0 are the
    exact loop, see :func:`~kvevict.moments.mi_evict`)."""

    name = "momentkv-mi"
    batched = True

    def __init__(self, statistics: MomentStatistics, evict_chunk: int, evict_fraction: float):
        super().__init__()
        self.statistics, self.evict_chunk, self.evict_fraction = statistics, evict_chunk, evict_fraction

    def keep(self, layer: EntryView, signals: Signals, ranking: Ranking) -> torch.Tensor:
        alpha = ranking.scores.masked_fill(~torch.isfinite(ranking.scores), 0.0)  # protected, padding: never candidates
        evicted = mi_evict(
            layer.keys,
            layer.values,
            alpha,
            self.statistics.statistics(layer),
            ranking.counts,
            signals.scaling,
            protected=ranking.protected,
            valid=layer.valid,
            chunk=self.evict_chunk,
            fraction=self.evict_fraction,
        )
        return kept_after(evicted, layer.valid)


def moment_bytes(cache: ScoringCache) -> int:
    """Bytes of moment statistics held by an :class:`~kvevict.cache.EvictionCache`."""
    observers = [stage for stage in cache.policy.stages if isinstance(stage, MomentStatistics)]
    return sum(
        stats.nbytes
        for layer in cache.eviction_layers
        for observer in observers
        if (stats := observer.recorded(layer)) is not None
    )


def chunk_pool(scores: torch.Tensor, size: int) -> torch.Tensor:
    """Each entry takes the mean score of its chunk of ``size`` adjacent entries (chunks start
    at the first entry; the last one may be shorter), ``[..., n]`` → ``[..., n]``."""
    n = scores.shape[-1]
    if size == 1 or n == 0:
        return scores
    pad = -n % size
    sums = F.pad(scores, (0, pad)).reshape(*scores.shape[:-1], -1, size).sum(-1)
    lengths = torch.full((sums.shape[-1],), float(size), device=scores.device)
    lengths[-1] = size - pad
    return (sums / lengths).repeat_interleave(size, dim=-1)[..., :n]


class MomentKV(Method):
    """MomentKV (seed 003, Algorithm 1): moment statistics of the evicted set drive both
    eviction (MI) and a corrected attention output (NC).

    Per KV head, statistics of the evicted set in fp32: ``n_e``, ``s_k = Σk``, ``s_v = Σv``,
    ``S = Σ v kᵀ``; ``k̄ = s_k/n_e``, ``v̄ = s_v/n_e``, ``S̃ = S − s_v s_kᵀ/n_e`` (Eqs. 22-24).

    - **MI** (``mi=True``, Eq. 10): residual ``r_j = v_j − v̄ − S̃ k_j/(n_e √d)``, score
      ``α_j·‖r_j‖``; evict the argmin, update the statistics, repeat. By default each update
      evicts each head's ``max(evict_chunk, ⌊evict_fraction·n_e⌋)`` lowest (``evict_fraction
      = 0.25``: the statistics of ``n_e`` evicted entries move by about a quarter of
      themselves per update, and a 2k-token prompt takes ~30 updates per layer instead of
      ~1,500); on SmolLM2 (1,024-token essay prompt, budget 256, AdaKV budgets) it keeps a
      different entry than the exact loop for 0.8 % of the kept entries (docs/seedspeed.md).
      ``evict_fraction=0`` with ``evict_chunk=1`` is the paper's exact one-at-a-time loop
      (``evict_chunk=c`` alone: ``c`` per update). ``mi=False``: keep the top ``α``.
    - **NC** (``nc=True``, Eqs. 9, 11, 12): ``f_R, log Z_R`` over the retained keys,
      ``log Ẑ_E = log n_e + q·k̄/√d`` (Jensen), ``f̂_E = v̄ + S̃ q/(n_e √d)``,
      ``w_R = σ(log Z_R − log Ẑ_E)``, output ``w_R f_R + (1 − w_R) f̂_E``; every pass after
      an eviction, per query head with its KV head's statistics.
    - ``order=0``: ``f̂_E = v̄`` and ``r_j = v_j − v̄`` (no outer product; Table 4).

    ``α``, the paper's prefill protocol (DESIGN §3): SnapKV's votes of the last
    ``window=32`` queries (max-pool ``kernel=7``, GQA ``group`` mean), then the mean over
    chunks of ``pool_chunk=4`` adjacent tokens; the first token is a sink (``sinks=1``); the
    window is kept. At decode (``regime="both"|"decode"``) ``α`` is the current query's
    attention (GQA mean), with the sink and the last ``window`` tokens kept.

    Head budgets: AdaKV's (``allocation="adakv"``, ``safeguard=0.2``, from the pooled ``α``),
    as the paper's protocol; ``allocation="uniform"``: ``budget`` per head. An allocator named
    over it (``pyramidkv+momentkv``) takes the place of this default, unless ``allocation`` or
    ``safeguard`` was given. Ablations: ``make_policy("momentkv", mi=False)`` (NC only),
    ``nc=False`` (MI only), ``order=0``; NC over any other policy: ``moment-nc+<policy>``.

    Stages: this scorer (``α``), sinks and window, the allocator, :class:`MomentMI` (top-k
    when ``mi=False``), :class:`MomentNC` (none when ``nc=False``), and the
    :class:`MomentStatistics` both read.
    """

    name = "momentkv"
    batched = True
    summary = (
        "window attention x moment residual (MI) + normalization-corrected attention (NC); "
        "NC over any policy: moment-nc+<policy>"
    )
    regimes = ("prefill", "both", "decode")
    attention_scores = True
    PARAMS = declare(
        mi=flag(True),
        nc=flag(True),
        order=ORDER,
        window=integer(32, low=1),
        sinks=integer(1),
        kernel=integer(7, low=1, odd=True),
        pool_chunk=integer(4, low=1),
        evict_chunk=integer(1, low=1),
        evict_fraction=number(0.25, 0, 1, open_high=True),
        group=GROUP,
        allocation=choice(None, "adakv", "uniform", unset="'adakv', unless an allocator is named over momentkv"),
        safeguard=number(None, 0, 1, unset="0.2, AdaKV's"),
    )

    def stages(self) -> Stages:
        statistics = MomentStatistics(order=self.order) if self.mi or self.nc else None
        allocator = Uniform() if self.allocation == "uniform" else AdaKV(safeguard=self.safeguard)
        return Stages(
            scorer=self,
            protector=SinksAndWindow(self.sinks, self.window),
            allocator=allocator,
            selector=MomentMI(statistics, self.evict_chunk, self.evict_fraction) if self.mi else None,
            corrector=MomentNC(order=self.order, statistics=statistics) if self.nc else None,
            observers=() if statistics is None else (statistics,),
            replaceable=frozenset(() if self.given("allocation") or self.given("safeguard") else ("allocator",)),
        )

    def clash_advice(self, stage: Stage) -> str:
        if stage.slot == "selector":
            return f"use {stage.name}+momentkv[mi=false] (no MI loop) or momentkv alone"
        if stage.slot == "corrector":
            return f"use {stage.name}+momentkv[nc=false] or momentkv alone (it applies NC)"
        return f"leave momentkv's allocation and safeguard unset to let {stage.name} set the head budgets"

    def requirements(self, phase: Phase, evicting: bool, regime: Regime) -> Requirements:
        if not evicting:
            return NOTHING
        return Requirements(window=self.window) if phase == "prefill" else Requirements(last_query_attention=True)

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        """``α``: pooled window votes at prefill (window entries +inf; chunks of adjacent
        *positions*: after an eviction the cache refills slots, so storage order is not position
        order), the current query's attention at decode; ``[B, Hkv, n]``."""
        if signals.phase == "decode":
            return group_reduce(signals.last_query_attention.float(), layer.num_kv_heads, self.group)
        votes = snapkv_scores(signals.window_attention, layer.num_kv_heads, self.kernel, "max", self.group)
        before = votes.shape[-1] - signals.window_attention.shape[2]
        real = None if layer.valid is None else layer.valid[..., :before]
        order = position_order(layer.positions[..., :before], real)
        pooled = in_position_order(lambda x: chunk_pool(x, self.pool_chunk), votes[..., :before], order)
        return torch.cat([pooled, votes[..., before:]], dim=-1)
