"""MomentKV's moment statistics of the evicted set, as pure functions (seed 003, DESIGN §3).

Li, Li & Lan (2026), "MomentKV: Closing the Directional Gap in KV Cache Eviction".
Per (batch, KV head), in fp32, over the evicted set ``E`` (Eq. 22)::

    n_e = |E|,   s_k = Σ k,   s_v = Σ v,   S = Σ v kᵀ   (d_v × d_k)
    k̄ = s_k / n_e,   v̄ = s_v / n_e,   S̃ = S − s_v s_kᵀ / n_e          (Eq. 24)

``S`` itself is never held: ``S̃ = Σ (v − v̄)(k − k̄)ᵀ`` is, updated by the pairwise (Chan et al.)
rule when entries join (:func:`accumulate`, :func:`accumulate_one`). Both methods read ``S̃``, and
in fp32 ``S − s_v s_kᵀ / n_e`` cancels away the digits of ``S̃`` wherever the means outweigh the
spread (keys' means often do); a centred sum keeps them, and NC's product needs no
correction term. Storage is ``3 + 2·d_k + 2·d_v + d_v·d_k`` floats per KV head whatever the
context length (the sums, and the means and counts NC reads, derived once per update;
:attr:`MomentStats.nbytes`; SmolLM2-135M, 30 layers × 3 KV heads × d=64: 1.58 MB in fp32).

- **MI** (Eq. 10, Algorithm 1 lines 6-18): residual ``r_j = v_j − v̄ − S̃ k_j·c / n_e``
  (``c`` = the attention's logit scale, 1/√d), score ``α_j·‖r_j‖``, evict the argmin, update
  the statistics, repeat (:func:`mi_evict`).
- **NC** (Eqs. 9, 11, 12, Algorithm 1 lines 19-25): ``log Ẑ_E = log n_e + c·q·k̄``,
  ``f̂_E = v̄ + c·S̃ q / n_e``, ``w_R = σ(log Z_R − log Ẑ_E)``, output
  ``w_R f_R + (1 − w_R) f̂_E`` (:func:`nc_log_partition`, :func:`nc_correct`).

Every function takes entries as ``[B, Hkv, n, d]`` with an optional ``valid`` mask
``[B, Hkv, n]`` of real entries (heads padded to a common length; None = all real), and
per-head budgets as ``counts [B, Hkv]`` (entries to keep). Query head ``h`` uses KV head
``h // g`` (GQA, as ``repeat_kv``). ``order=0`` keeps no outer product: ``f̂_E = v̄`` and
``r_j = v_j − v̄`` (the paper's zeroth-order ablation, Table 4).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import torch

from kvevict.signals import as_dtype, as_float32, attention_logits, query_chunks

LOG_PARTITION_CHUNK = 256
"""Queries per chunk of :func:`nc_log_partition`: memory is ``chunk × n`` per head."""


@dataclass(frozen=True)
class MomentStats:
    """Sufficient statistics of the evicted entries of each (batch, KV head), fp32."""

    count: torch.Tensor
    """``n_e``, ``[B, Hkv]``."""
    key_sum: torch.Tensor
    """``s_k = Σ k``, ``[B, Hkv, d_k]``."""
    value_sum: torch.Tensor
    """``s_v = Σ v``, ``[B, Hkv, d_v]``."""
    centered: torch.Tensor | None
    """``S̃ = Σ (v − v̄)(k − k̄)ᵀ`` ``[B, Hkv, d_v, d_k]`` (the module's docstring: why centred); None for
    the zeroth order."""
    log_count: torch.Tensor
    """``log n_e`` ``[B, Hkv]`` (``−∞`` for a head that evicted nothing), derived: NC reads it every pass."""
    inverse_count: torch.Tensor
    """``1 / max(n_e, 1)`` ``[B, Hkv]``, derived."""
    mean_key: torch.Tensor
    """``k̄`` ``[B, Hkv, d_k]`` (zero for a head that evicted nothing), derived."""
    mean_value: torch.Tensor
    """``v̄`` ``[B, Hkv, d_v]``, derived."""

    @classmethod
    def of(
        cls, count: torch.Tensor, key_sum: torch.Tensor, value_sum: torch.Tensor, centered: torch.Tensor | None
    ) -> MomentStats:
        """The statistics of these sums, with the means and counts NC reads derived once (every
        pass until the next update reads them)."""
        empty = torch.empty_like
        stats = cls(count, key_sum, value_sum, centered, empty(count), empty(count), empty(key_sum), empty(value_sum))
        stats.derive()
        return stats

    def derive(self) -> None:
        """Recompute the derived fields from the sums, into their own tensors (in place: a
        decode step's update keeps every view of them current, :func:`accumulate_one`)."""
        count = self.count.clamp(min=1)
        torch.log(self.count, out=self.log_count)
        torch.reciprocal(count, out=self.inverse_count)
        torch.div(self.key_sum, count[..., None], out=self.mean_key)
        torch.div(self.value_sum, count[..., None], out=self.mean_value)

    @classmethod
    def zeros(
        cls, batch: int, heads: int, key_dim: int, value_dim: int, order: int = 1, device: torch.device | None = None
    ) -> MomentStats:
        if order not in (0, 1):
            raise ValueError(f"moment order must be 0 (mean value) or 1 (mean + covariance), got {order!r}")
        options = {"dtype": torch.float32, "device": device}
        centered = torch.zeros(batch, heads, value_dim, key_dim, **options) if order == 1 else None
        return cls.of(
            torch.zeros(batch, heads, **options),
            torch.zeros(batch, heads, key_dim, **options),
            torch.zeros(batch, heads, value_dim, **options),
            centered,
        )

    @property
    def order(self) -> int:
        return 0 if self.centered is None else 1

    @property
    def nbytes(self) -> int:
        """Bytes held, independent of the context length."""
        return sum(t.nbytes for f in fields(self) if (t := getattr(self, f.name)) is not None)

    @cached_property
    def nc_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Views of the fields NC reads, one batch entry per (batch, KV head), shaped for its
        products: ``k̄`` ``[B·Hkv, d_k, 1]``, ``log n_e`` and ``1/n_e`` ``[B·Hkv, 1, 1]``, ``S̃ᵀ``
        ``[B·Hkv, d_k, d_v]`` (None for the zeroth order), ``v̄`` ``[B·Hkv, 1, d_v]``. Made once:
        a decode step's update writes the fields in place (:func:`accumulate_one`), so the views
        stay current, and every layer's every step is spared making them again."""
        heads = self.count.numel()
        centered = self.centered
        return (
            self.mean_key.view(heads, -1, 1),
            self.log_count.view(heads, 1, 1),
            self.inverse_count.view(heads, 1, 1),
            None if centered is None else centered.view(heads, *centered.shape[2:]).transpose(1, 2),
            self.mean_value.view(heads, 1, -1),
        )

    def writable(self) -> MomentStats:
        """Statistics :func:`accumulate_one` may update in place: these, or a copy of them when they
        were made under ``inference_mode`` and are written outside it (which torch forbids)."""
        if not self.count.is_inference() or torch.is_inference_mode_enabled():
            return self
        return MomentStats(*(None if x is None else x.clone() for x in (getattr(self, f.name) for f in fields(self))))

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k̄, v̄)``; zero for heads that evicted nothing."""
        return self.mean_key, self.mean_value


def accumulate(stats: MomentStats, keys: torch.Tensor, values: torch.Tensor, evicted: torch.Tensor) -> MomentStats:
    """Statistics after adding the entries flagged in ``evicted`` ``[B, Hkv, n]`` (Eq. 25).

    The evicted entries are never needed again: their own count, sums and centred ``S̃`` are
    merged into the statistics (:func:`_merge_centered`). When each head drops a few of its
    entries (a decode step drops one), only those are gathered and summed: adding the others'
    zero weights changes nothing but the cost (``O(n·d²)`` for the outer product).
    """
    most = int(evicted.sum(dim=-1).max()) if evicted.numel() else 0
    if 0 < 4 * most <= evicted.shape[-1]:
        slots = evicted.to(torch.uint8).topk(most, dim=-1).indices  # every evicted entry, then kept ones
        evicted = evicted.gather(-1, slots)
        keys, values = (x.gather(2, slots[..., None].expand(-1, -1, -1, x.shape[-1])) for x in (keys, values))
    weight = evicted.float()
    k, v = keys.float().flatten(0, 1), values.float().flatten(0, 1)  # [B·Hkv, m, d]: one batched product each
    rows = weight.flatten(0, 1)[:, None]
    added = weight.sum(-1)
    key_sum, value_sum = (torch.bmm(rows, x).view(*weight.shape[:2], -1) for x in (k, v))  # the evicted ones'
    centered = None
    if stats.centered is not None:
        inverse = added.clamp(min=1).reciprocal()[..., None]
        mean_key, mean_value = key_sum * inverse, value_sum * inverse  # the evicted ones' (0 where none)
        weighted = ((v - mean_value.flatten(0, 1)[:, None]) * rows.transpose(1, 2)).transpose(1, 2)
        centered = torch.baddbmm(stats.centered.flatten(0, 1), weighted, k - mean_key.flatten(0, 1)[:, None])
        centered = centered.view_as(stats.centered)
        _merge_centered(centered, stats, added, mean_key, mean_value)
    return MomentStats.of(stats.count + added, stats.key_sum + key_sum, stats.value_sum + value_sum, centered)


def accumulate_one(stats: MomentStats, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """:func:`accumulate` of entry ``slots[b, h]`` ``[B, Hkv]`` of every head (a decode step's
    eviction), **in place**: the same statistics, bit for bit, from the entries gathered by their
    slots (no mask to build; one entry's own ``S̃`` is zero), and the derived fields recomputed
    into their own tensors. In place because a decode step of 30 layers in lockstep updates one
    stacked whole whose rows' statistics are views of it (:class:`~kvevict.rows.StackedRows`):
    nothing to split back, step after step."""
    index = slots[..., None, None]
    k, v = (x.gather(2, index.expand(-1, -1, 1, x.shape[-1])).float()[:, :, 0] for x in (keys, values))  # [B, Hkv, d]
    if stats.centered is not None:  # (before the means move)
        _merge_centered(stats.centered, stats, 1.0, k, v)  # (one entry: its own means)
    stats.count.add_(1)
    stats.key_sum.add_(k)
    stats.value_sum.add_(v)
    stats.derive()


def _merge_centered(
    centered: torch.Tensor,
    stats: MomentStats,
    count: torch.Tensor | float,
    mean_key: torch.Tensor,
    mean_value: torch.Tensor,
) -> None:
    """Add to ``centered`` (``S̃`` of ``stats`` plus that of the joining entries) the pairwise
    term of merging ``count`` entries with means ``mean_key``, ``mean_value`` into ``stats``:
    ``n_a n_b / (n_a + n_b) · (v̄_b − v̄_a)(k̄_b − k̄_a)ᵀ``, in place (Chan, Golub & LeVeque)."""
    total = (stats.count + count).clamp(min=1)
    share = stats.count * count / total  # n_a n_b / n: 0 where either side is empty
    value_gap = (mean_value - stats.mean_value).mul_(share[..., None])
    key_gap = mean_key - stats.mean_key
    dv, dk = centered.shape[2:]
    centered.view(-1, dv, dk).baddbmm_(value_gap.view(-1, dv, 1), key_gap.view(-1, 1, dk))


# -- moment-informed eviction -------------------------------------------------------------
def mi_residual_norms(keys: torch.Tensor, values: torch.Tensor, stats: MomentStats, scaling: float) -> torch.Tensor:
    """``‖r_j‖`` of every entry, ``r_j = v_j − v̄ − S̃ k_j·c / n_e`` (Eq. 10), ``[B, Hkv, n]``.

    With nothing evicted yet ``v̄ = 0`` and ``S̃ = 0`` (Algorithm 1, line 7): ``r_j = v_j``.
    ``S̃`` (``d_v × d_k`` per head) is scaled by ``c / n_e`` first, so every entry's residual
    takes one batched product and one subtraction: the ``n × d`` work is three passes, not one
    per term of the expansion.
    """
    k, v = keys.float(), values.float()
    v_mean = stats.mean_value[..., None, :]
    if stats.centered is None:
        return (v - v_mean).norm(dim=-1)
    centered = stats.centered * (scaling * stats.inverse_count)[..., None, None]
    residual = torch.baddbmm(v.flatten(0, 1), k.flatten(0, 1), centered.transpose(-1, -2).flatten(0, 1), alpha=-1)
    return residual.view_as(v).sub_(v_mean).norm(dim=-1)


def mi_evict(
    keys: torch.Tensor,
    values: torch.Tensor,
    alpha: torch.Tensor,
    stats: MomentStats,
    counts: torch.Tensor,
    scaling: float,
    *,
    protected: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    chunk: int = 1,
    fraction: float = 0.0,
) -> torch.Tensor:
    """Moment-informed eviction (Algorithm 1, lines 6-18): the entries to evict, ``[B, Hkv, n]`` bool.

    Each KV head evicts down to ``counts`` retained entries. ``chunk=1`` is the exact loop:
    score ``α_j·‖r_j‖`` with the current statistics, evict the argmin, add it to the
    statistics, repeat. ``chunk=c`` evicts the ``c`` lowest scores before updating (fewer
    steps, approximate). ``fraction=ρ > 0`` evicts, per head, ``max(chunk, ⌊ρ·n_e⌋)`` before
    updating (approximate): a chunk moves the statistics of ``n_e`` entries by about ``ρ``
    of themselves whatever ``n_e`` is, and the loop takes ``O(log n / ρ)`` updates instead of
    ``n``. ``alpha`` ``[B, Hkv, n]`` is fixed during the loop: renormalising a
    query's softmax over the shrinking retained set scales every ``α_j`` by the same factor,
    which leaves the argmin unchanged. ``protected`` entries are never evicted. ``stats``
    are not modified: the caller adds the returned entries with :func:`accumulate`.

    Cost of the exact loop: ``‖r_j‖²`` is expanded into per-entry scalars kept up to date incrementally
    (``P_j = S k_j`` gains ``σ_je v_e`` with ``σ_je = k_j·k_e`` when ``e`` is evicted), so a
    step costs a few ``n × d`` matrix-vector products and ``O(n)`` scalar work, never
    ``O(n·d²)``; the scalars are float64 (cancellation in the expansion).
    """
    if chunk < 1 or not 0 <= fraction < 1:
        raise ValueError(
            f"MI eviction needs chunk >= 1 and 0 <= fraction < 1 (1 and 0: the exact loop), got {chunk} and {fraction}"
        )
    valid = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device) if valid is None else valid
    candidate = valid & ~protected if protected is not None else valid.clone()
    remaining = (valid.sum(-1) - counts.to(valid.device)).clamp(min=0)
    if bool((remaining > candidate.sum(-1)).any()):
        raise ValueError("MI eviction: a head's budget is smaller than its protected entries")
    if chunk == 1 and not fraction:
        return _exact_loop(keys, values, alpha, stats, scaling, candidate, remaining)
    return _chunked_loop(keys, values, alpha, stats, scaling, candidate, remaining, chunk, fraction)


def _chunked_loop(
    keys: torch.Tensor,
    values: torch.Tensor,
    alpha: torch.Tensor,
    stats: MomentStats,
    scaling: float,
    candidate: torch.Tensor,
    remaining: torch.Tensor,
    chunk: int,
    fraction: float,
) -> torch.Tensor:
    """:func:`mi_evict` evicting several entries per update: each update scores every entry
    from the statistics directly (:func:`mi_residual_norms`, fp32: one ``n × d × d`` product
    per head, no cancelling expansion), evicts each head's lowest ``max(chunk, ⌊ρ·n_e⌋)``
    candidates and adds them to the statistics."""
    evicted = torch.zeros_like(candidate)
    alpha = alpha.float()
    while bool((remaining > 0).any()):
        norms = mi_residual_norms(keys, values, stats, scaling)
        score = (alpha * norms).masked_fill(~candidate, float("inf"))
        steps = torch.minimum(remaining, (fraction * stats.count).long().clamp(min=chunk))  # ρ = 0: chunk
        step = int(steps.max())
        picked = score.topk(step, dim=-1, largest=False).indices  # [B, Hkv, step]
        take = torch.arange(step, device=keys.device) < steps[..., None]  # heads that are done take nothing
        flags = torch.zeros_like(evicted).scatter_(2, picked, take)
        stats = accumulate(stats, keys, values, flags)
        evicted |= flags
        candidate &= ~flags
        remaining = remaining - steps
    return evicted


def _exact_loop(
    keys: torch.Tensor,
    values: torch.Tensor,
    alpha: torch.Tensor,
    stats: MomentStats,
    scaling: float,
    candidate: torch.Tensor,
    remaining: torch.Tensor,
) -> torch.Tensor:
    """:func:`mi_evict` one entry per update, with the scalars of its docstring's Cost."""
    k, v, a = keys.double(), values.double(), alpha.double()
    count, key_sum, value_sum = stats.count.double(), stats.key_sum.double(), stats.value_sum.double()
    first_order = stats.centered is not None
    if first_order:  # the loop's scalars expand the raw sums: S = S̃ + s_v k̄ᵀ
        outer = stats.centered.double() + value_sum[..., :, None] * stats.mean_key.double()[..., None, :]
    else:
        outer = torch.zeros(*value_sum.shape, k.shape[-1]).to(k)
    projected = k @ outer.transpose(-1, -2)  # P_j = S k_j, only to start the scalars below
    v_norm2 = (v * v).sum(-1)  # ‖v_j‖²
    v_dot_p = (v * projected).sum(-1)  # v_j·P_j
    p_norm2 = (projected * projected).sum(-1)  # ‖P_j‖²
    sv_dot_v = (v @ value_sum[..., None]).squeeze(-1)  # s_v·v_j
    sv_dot_p = (projected @ value_sum[..., None]).squeeze(-1)  # s_v·P_j
    sk_dot_k = (k @ key_sum[..., None]).squeeze(-1)  # s_k·k_j
    evicted = torch.zeros_like(candidate)
    while bool((remaining > 0).any()):
        # ‖r_j‖² = ‖v_j − βP_j‖² − 2λ_j m·(v_j − βP_j) + λ_j² ‖m‖²,
        # with m = s_v/n_e, β = c/n_e, λ_j = 1 − β s_k·k_j
        n_e = count.clamp(min=1)[..., None]
        beta = scaling / n_e if first_order else torch.zeros_like(n_e)
        lam = 1 - beta * sk_dot_k
        m_dot = (sv_dot_v - beta * sv_dot_p) / n_e
        m_norm2 = (value_sum * value_sum).sum(-1, keepdim=True) / n_e**2
        r_norm2 = v_norm2 - 2 * beta * v_dot_p + beta**2 * p_norm2 - 2 * lam * m_dot + lam**2 * m_norm2
        score = (a * r_norm2.clamp(min=0).sqrt()).masked_fill(~candidate, float("inf"))
        picked = score.topk(1, dim=-1, largest=False).indices  # [B, Hkv, 1]
        take = remaining[..., None] > 0  # heads that are done take nothing
        weight = take.to(k.dtype)[..., None]
        k_e = k.gather(2, picked[..., None].expand(-1, -1, -1, k.shape[-1])) * weight
        v_e = v.gather(2, picked[..., None].expand(-1, -1, -1, v.shape[-1])) * weight
        sigma = k @ k_e.transpose(-1, -2)  # k_j·k_e, [B, Hkv, n, step]
        v_dot_ve = v @ v_e.transpose(-1, -2)  # v_j·v_e
        p_dot_ve = k @ (v_e @ outer).transpose(-1, -2)  # P_j·v_e = k_j·(Sᵀ v_e)
        gram = v_e @ v_e.transpose(-1, -2)  # v_e·v_e'
        sigma_gram = sigma @ gram
        if first_order:
            v_dot_p = v_dot_p + (sigma * v_dot_ve).sum(-1)
            p_norm2 = p_norm2 + 2 * (sigma * p_dot_ve).sum(-1) + (sigma_gram * sigma).sum(-1)
            sv_dot_p = sv_dot_p + p_dot_ve.sum(-1) + (sigma @ (v_e @ value_sum[..., None])).squeeze(-1)
            sv_dot_p = sv_dot_p + sigma_gram.sum(-1)
            outer = outer + v_e.transpose(-1, -2) @ k_e
        sv_dot_v = sv_dot_v + v_dot_ve.sum(-1)
        sk_dot_k = sk_dot_k + sigma.sum(-1)
        count = count + take.sum(-1)
        key_sum = key_sum + k_e.sum(2)
        value_sum = value_sum + v_e.sum(2)
        flags = torch.zeros_like(evicted).scatter_(2, picked, take)
        evicted |= flags
        candidate &= ~flags
        remaining = remaining - take.sum(-1)
    return evicted


# -- normalization-corrected inference ---------------------------------------------------
def nc_log_partition(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    valid: torch.Tensor | None = None,
    chunk: int = LOG_PARTITION_CHUNK,
) -> torch.Tensor:
    """``log Z_R`` of each query over the retained keys, ``[B, Hq, q]`` fp32.

    ``query`` ``[B, Hq, q, d]`` sits at the end of ``keys`` ``[B, Hkv, n, d]`` (row ``i``
    sees keys ``0 .. n − q + i``, the pass's own entries being causal). A log-sum-exp over
    ``chunk`` queries at a time: never exponentiated outside it, never an n×n matrix.
    """
    out = query.new_empty(query.shape[:3], dtype=torch.float32)
    for start, stop, rows, visible_keys, visible_valid in query_chunks(query, keys, valid, chunk):
        out[..., start:stop] = attention_logits(rows, visible_keys, scaling, visible_valid).logsumexp(dim=-1)
    return out


def nc_correct(
    output: torch.Tensor, log_z_retained: torch.Tensor, query: torch.Tensor, stats: MomentStats, scaling: float
) -> torch.Tensor:
    """Normalization-corrected attention output (Eq. 12), same shape and dtype as ``output``.

    ``output`` is ``f_R`` ``[B, Hq, q, d_v]`` (attention over the retained entries),
    ``log_z_retained`` its ``log Z_R`` ``[B, Hq, q]``, ``query`` ``[B, Hq, q, d_k]``. From the
    statistics' derived means: ``log Ẑ_E = log n_e + c·k̄·x`` (Jensen, Eq. 11) and
    ``f̂_E = v̄ + (c/n_e)·S̃ x`` (Eq. 9): two products and three element-wise operations a layer. Mixing in the log
    domain, ``w_R = σ(log Z_R − log Ẑ_E)``, output ``f̂_E + w_R (f_R − f̂_E)``, stays finite for
    any logit size; fp32 inside. Heads with nothing evicted (``log n_e = −∞``, ``w_R = 1``) are
    returned bit for bit.
    """
    b, hq, q, dv = output.shape
    heads = stats.count.numel()
    mean_key, log_count, inverse_count, centered, mean_value = stats.nc_operands
    rows = as_float32(query.reshape(heads, -1, query.shape[-1]))  # [B·Hkv, G·q, d_k]: the group's queries
    log_z_evicted = torch.baddbmm(log_count, rows, mean_key, alpha=scaling)  # log n_e + c·k̄·x
    f_evicted = (
        mean_value if centered is None else torch.baddbmm(mean_value, rows * inverse_count, centered, alpha=scaling)
    )
    weight = torch.sub(as_float32(log_z_retained.reshape(heads, -1, 1)), log_z_evicted).sigmoid_()
    mixed = torch.lerp(f_evicted, as_float32(output.reshape(heads, -1, dv)), weight).view(b, hq, q, dv)
    return as_dtype(mixed, output.dtype)
