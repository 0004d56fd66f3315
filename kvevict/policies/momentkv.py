"""MomentKV (seed 003; Li, Li & Lan, 2026, "MomentKV: Closing the Directional Gap in KV Cache
Eviction for Long-Context Inference"): the ``momentkv`` policy and the ``moment-nc+<policy>``
wrapper. The math lives in :mod:`kvevict.moments`.

The moment statistics of a layer live in ``layer.memo["moments"]`` (they are not per token):
:func:`record_evictions` adds the entries every eviction drops (the ``on_evict`` hook) and
:func:`corrected_output` applies normalization-corrected inference to every later pass, the
decode steps and the question tokens after context compression alike (the
``correct_output`` hook, called before the pass evicts). Until something is evicted the
correction is the identity, bit for bit, and costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from kvevict.budgets import adakv_counts
from kvevict.moments import MomentStats, accumulate, mi_evict, nc_correct, nc_log_partition
from kvevict.policies.base import Policy, Wrapper, keep_top
from kvevict.policies.snapkv import snapkv_scores
from kvevict.signals import NOTHING, GroupReduce, Phase, Regime, Requirements, Signals, group_reduce

if TYPE_CHECKING:
    from kvevict.cache import EvictionCache, EvictionLayer

MOMENTS = "moments"
"""Key of a layer's :class:`~kvevict.moments.MomentStats` in ``layer.memo``."""
ORDERS = (0, 1)


def _check_order(name: str, order: int) -> None:
    if order not in ORDERS:
        raise ValueError(f"{name}: order must be 0 (mean value only) or 1 (mean + value-key covariance), got {order!r}")


def moments_of(layer: EvictionLayer, order: int = 1) -> MomentStats:
    """The layer's statistics (zeros before its first eviction)."""
    stats = layer.memo.get(MOMENTS)
    if stats is None:
        b, h, _, key_dim = layer.keys.shape
        stats = MomentStats.zeros(b, h, key_dim, layer.values.shape[-1], order, layer.keys.device)
    return stats


def record_evictions(layer: EvictionLayer, evicted: torch.Tensor, order: int) -> None:
    """Add the entries about to be dropped to the layer's statistics (Eq. 25)."""
    layer.memo[MOMENTS] = accumulate(moments_of(layer, order), layer.keys, layer.values, evicted)


def corrected_output(layer: EvictionLayer, query: torch.Tensor, output: torch.Tensor, scaling: float) -> torch.Tensor:
    """NC (Eq. 12) of the kernel's output ``[B, q, Hq, d]`` from the layer's statistics."""
    stats = layer.memo.get(MOMENTS)
    if stats is None or not bool(stats.count.any()):
        return output
    log_z = nc_log_partition(query, layer.keys, scaling, layer.valid)
    return nc_correct(output.transpose(1, 2), log_z, query, stats, scaling).transpose(1, 2)


def moment_bytes(cache: EvictionCache) -> int:
    """Bytes of moment statistics held by an :class:`~kvevict.cache.EvictionCache`."""
    return sum(layer.memo[MOMENTS].nbytes for layer in cache.eviction_layers if MOMENTS in layer.memo)


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


class MomentKV(Policy):
    """MomentKV (seed 003, Algorithm 1): moment statistics of the evicted set drive both
    eviction (MI) and a corrected attention output (NC).

    Per KV head, statistics of the evicted set in fp32: ``n_e``, ``s_k = Σk``, ``s_v = Σv``,
    ``S = Σ v kᵀ``; ``k̄ = s_k/n_e``, ``v̄ = s_v/n_e``, ``S̃ = S − s_v s_kᵀ/n_e`` (Eqs. 22-24).

    - **MI** (``mi=True``, Eq. 10): residual ``r_j = v_j − v̄ − S̃ k_j/(n_e √d)``, score
      ``α_j·‖r_j‖``; evict the argmin, update the statistics, repeat (``evict_chunk=1``, the
      exact loop; ``evict_chunk=c`` evicts ``c`` per update — on SmolLM2 at budget 128 of a
      2k-token prompt, ``c=4`` keeps a different entry for 0.16 % of the kept entries and
      ``c=16`` for 0.36 %, see the README). ``mi=False``: keep the top ``α``.
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
    as the paper's protocol; ``allocation="uniform"``: ``budget`` per head. Ablations: ``make_policy("momentkv", mi=False)`` (NC only),
    ``nc=False`` (MI only), ``order=0``; NC over any other policy: ``moment-nc+<policy>``.
    """

    name = "momentkv"
    summary = (
        "window attention x moment residual (MI) + normalization-corrected attention (NC); "
        "NC over any policy: moment-nc+<policy>"
    )
    regimes = ("prefill", "both", "decode")

    def __init__(
        self,
        *,
        mi: bool = True,
        nc: bool = True,
        order: int = 1,
        window: int = 32,
        sinks: int = 1,
        kernel: int = 7,
        pool_chunk: int = 4,
        evict_chunk: int = 1,
        group: GroupReduce = "mean",
        allocation: Literal["adakv", "uniform"] = "adakv",
        safeguard: float = 0.2,
        regime: Regime | None = None,
    ):
        _check_order(self.name, order)
        if allocation not in ("adakv", "uniform"):
            raise ValueError(f"momentkv: allocation must be 'adakv' or 'uniform', got {allocation!r}")
        if window < 1:
            raise ValueError(f"momentkv: window must be >= 1, got {window}")
        if kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"momentkv: kernel must be a positive odd number, got {kernel}")
        if pool_chunk < 1 or evict_chunk < 1:
            raise ValueError(
                f"momentkv: pool_chunk and evict_chunk must be >= 1, got pool_chunk={pool_chunk}, "
                f"evict_chunk={evict_chunk}"
            )
        super().__init__(sinks=sinks, window=window, regime=regime)
        self.mi, self.nc, self.order = bool(mi), bool(nc), order
        self.kernel, self.pool_chunk, self.evict_chunk, self.group = kernel, pool_chunk, evict_chunk, group
        self.allocation, self.safeguard = allocation, safeguard

    @property
    def corrects_output(self) -> bool:
        return self.nc

    def requirements(self, phase: Phase, evicting: bool) -> Requirements:
        if not evicting:
            return NOTHING
        return Requirements(window=self.window) if phase == "prefill" else Requirements(last_query_attention=True)

    def score(self, layer: EvictionLayer, signals: Signals) -> torch.Tensor:
        """``α``: pooled window votes at prefill (window entries +inf), the current query's
        attention at decode; ``[B, Hkv, n]``."""
        if signals.phase == "decode":
            return group_reduce(signals.last_query_attention.float(), layer.num_kv_heads, self.group)
        votes = snapkv_scores(signals.window_attention, layer.num_kv_heads, self.kernel, "max", self.group)
        before = votes.shape[-1] - signals.window_attention.shape[2]
        return torch.cat([chunk_pool(votes[..., :before], self.pool_chunk), votes[..., before:]], dim=-1)

    def allocate(self, layer: EvictionLayer, scores: torch.Tensor, budget: int) -> torch.Tensor:
        if self.allocation == "adakv":
            return adakv_counts(scores, budget, self.safeguard)
        return super().allocate(layer, scores, budget)

    def select(self, layer: EvictionLayer, signals: Signals, budget: int) -> torch.Tensor:
        scores = self.selection_scores(layer, signals, budget)  # α; protected +inf, padding -inf
        counts = self.allocate(layer, scores, budget)
        if not self.mi:
            return keep_top(scores, counts)
        protected = torch.isposinf(scores)
        alpha = scores.masked_fill(~torch.isfinite(scores), 0.0)  # protected and padding are never candidates
        stats = moments_of(layer, self.order)
        evicted = mi_evict(
            layer.keys,
            layer.values,
            alpha,
            stats,
            counts,
            signals.scaling,
            protected=protected,
            valid=layer.valid,
            chunk=self.evict_chunk,
        )
        return ~evicted if layer.valid is None else layer.valid & ~evicted

    def on_evict(self, layer: EvictionLayer, evicted: torch.Tensor) -> None:
        if self.mi or self.nc:
            record_evictions(layer, evicted, self.order)

    def correct_output(
        self, layer: EvictionLayer, query: torch.Tensor, output: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        return corrected_output(layer, query, output, scaling) if self.nc else output


class MomentNC(Wrapper):
    """MomentKV's normalization-corrected inference over any policy (seed 003, Eq. 12;
    the "NC only" ablation with another scorer): ``moment-nc+<policy>``.

    The inner policy decides what to evict, unchanged; every entry it drops is added to the
    layer's moment statistics (``order=1``: ``n_e, Σk, Σv, Σ v kᵀ``; ``order=0``: no outer
    product), and every later pass mixes the retained output with the moment estimate of
    the evicted one: ``w_R = σ(log Z_R − log Ẑ_E)``, ``w_R f_R + (1 − w_R) f̂_E``.
    Example: ``make_policy("moment-nc+h2o", sinks=2, **{"moment-nc": {"order": 0}})``.
    """

    prefix = "moment-nc"
    summary = "MomentKV's normalization-corrected attention over any policy (moment-nc+<policy>)"

    def __init__(self, inner: Policy, *, order: int = 1):
        super().__init__(inner)
        if inner.corrects_output:
            raise ValueError(f"{self.name}: {inner.name!r} already corrects its attention output")
        _check_order(self.name, order)
        self.order = order

    @property
    def corrects_output(self) -> bool:
        return True

    def on_evict(self, layer: EvictionLayer, evicted: torch.Tensor) -> None:
        self.inner.on_evict(layer, evicted)
        record_evictions(layer, evicted, self.order)

    def correct_output(
        self, layer: EvictionLayer, query: torch.Tensor, output: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        return corrected_output(layer, query, self.inner.correct_output(layer, query, output, scaling), scaling)
