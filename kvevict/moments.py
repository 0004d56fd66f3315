"""MomentKV's moment statistics of the evicted set, as pure functions (seed 003, DESIGN §3).

Li, Li & Lan (2026), "MomentKV: Closing the Directional Gap in KV Cache Eviction".
Per (batch, KV head), in fp32, over the evicted set ``E`` (Eq. 22)::

    n_e = |E|,   s_k = Σ k,   s_v = Σ v,   S = Σ v kᵀ   (d_v × d_k)
    k̄ = s_k / n_e,   v̄ = s_v / n_e,   S̃ = S − s_v s_kᵀ / n_e          (Eq. 24)

Storage is ``1 + d_k + d_v + d_v·d_k`` floats per KV head whatever the context length
(:attr:`MomentStats.nbytes`; SmolLM2-135M, 30 layers × 3 KV heads × d=64: 1.52 MB in fp32).

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

import torch

from kvevict.signals import attention_logits, query_chunks

SPECULATION = (8, 256)
"""Smallest and largest guess of :func:`mi_evict`'s speculative exact loop (evictions per check)."""
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
    outer: torch.Tensor | None
    """``S = Σ v kᵀ``, ``[B, Hkv, d_v, d_k]``; None for the zeroth order."""

    @classmethod
    def zeros(
        cls, batch: int, heads: int, key_dim: int, value_dim: int, order: int = 1, device: torch.device | None = None
    ) -> MomentStats:
        if order not in (0, 1):
            raise ValueError(f"moment order must be 0 (mean value) or 1 (mean + covariance), got {order!r}")
        options = {"dtype": torch.float32, "device": device}
        outer = torch.zeros(batch, heads, value_dim, key_dim, **options) if order == 1 else None
        return cls(
            torch.zeros(batch, heads, **options),
            torch.zeros(batch, heads, key_dim, **options),
            torch.zeros(batch, heads, value_dim, **options),
            outer,
        )

    @property
    def order(self) -> int:
        return 0 if self.outer is None else 1

    @property
    def nbytes(self) -> int:
        """Bytes held, independent of the context length."""
        return sum(t.nbytes for f in fields(self) if (t := getattr(self, f.name)) is not None)

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k̄, v̄)``; zero for heads that evicted nothing."""
        n = self.count.clamp(min=1)[..., None]
        return self.key_sum / n, self.value_sum / n


def accumulate(stats: MomentStats, keys: torch.Tensor, values: torch.Tensor, evicted: torch.Tensor) -> MomentStats:
    """Statistics after adding the entries flagged in ``evicted`` ``[B, Hkv, n]`` (Eq. 25).

    Purely additive: the evicted entries are never needed again.
    """
    weight = evicted.float()
    k, v = keys.float(), values.float()
    outer = None
    if stats.outer is not None:
        outer = stats.outer + (v * weight[..., None]).transpose(-1, -2) @ k
    return MomentStats(
        count=stats.count + weight.sum(-1),
        key_sum=stats.key_sum + (weight[..., None, :] @ k).squeeze(-2),
        value_sum=stats.value_sum + (weight[..., None, :] @ v).squeeze(-2),
        outer=outer,
    )


# -- moment-informed eviction -------------------------------------------------------------
def mi_residual_norms(keys: torch.Tensor, values: torch.Tensor, stats: MomentStats, scaling: float) -> torch.Tensor:
    """``‖r_j‖`` of every entry, ``r_j = v_j − v̄ − S̃ k_j·c / n_e`` (Eq. 10), ``[B, Hkv, n]``.

    With nothing evicted yet ``v̄ = 0`` and ``S̃ = 0`` (Algorithm 1, line 7): ``r_j = v_j``.
    """
    k, v = keys.float(), values.float()
    _, v_mean = stats.means()
    residual = v - v_mean[..., None, :]
    if stats.outer is not None:
        residual = residual - _centered_outer_times(stats, k) * (scaling / stats.count.clamp(min=1)[..., None, None])
    return residual.norm(dim=-1)


def _centered_outer_times(stats: MomentStats, x: torch.Tensor) -> torch.Tensor:
    """``S̃ x`` for rows ``x`` ``[B, Hkv, m, d_k]`` without forming ``S̃``:
    ``S x − s_v (s_k·x) / n_e`` → ``[B, Hkv, m, d_v]``."""
    n = stats.count.clamp(min=1)[..., None, None]
    key_dot = x @ stats.key_sum[..., None]  # [B, Hkv, m, 1]
    return x @ stats.outer.transpose(-1, -2) - key_dot * stats.value_sum[..., None, :] / n


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
    speculate: bool = True,
) -> torch.Tensor:
    """Moment-informed eviction (Algorithm 1, lines 6-18): the entries to evict, ``[B, Hkv, n]`` bool.

    Each KV head evicts down to ``counts`` retained entries. ``chunk=1`` is the exact loop:
    score ``α_j·‖r_j‖`` with the current statistics, evict the argmin, add it to the
    statistics, repeat. ``chunk=c`` evicts the ``c`` lowest scores before updating (fewer
    steps, approximate). ``alpha`` ``[B, Hkv, n]`` is fixed during the loop: renormalising a
    query's softmax over the shrinking retained set scales every ``α_j`` by the same factor,
    which leaves the argmin unchanged. ``protected`` entries are never evicted. ``stats``
    are not modified: the caller adds the returned entries with :func:`accumulate`.

    Cost: ``‖r_j‖²`` is expanded into per-entry scalars kept up to date incrementally
    (``P_j = S k_j`` gains ``σ_je v_e`` with ``σ_je = k_j·k_e`` when ``e`` is evicted), so a
    step costs a few ``n × d`` matrix-vector products and ``O(n)`` scalar work, never
    ``O(n·d²)``; the scalars are float64 (cancellation in the expansion).

    ``speculate`` (``chunk=1`` only) makes the exact loop take many steps per update: it
    guesses the next ``w`` evictions as the ``w`` lowest current scores, computes every
    entry's score after each prefix of that guess at once (:func:`_verified_prefix`: the
    scalars gain prefix sums over the guess, ``n × w`` work), and evicts the longest prefix
    whose every entry is the argmin the loop would pick next. The same selection as the loop
    one step at a time (``speculate=False``, the reference), up to float64 rounding in
    near-exact ties; ``w`` doubles while whole guesses hold and shrinks when they break.
    """
    if chunk < 1:
        raise ValueError(f"MI eviction chunk must be >= 1 (1 = the exact loop), got {chunk}")
    valid = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device) if valid is None else valid
    candidate = valid & ~protected if protected is not None else valid.clone()
    remaining = (valid.sum(-1) - counts.to(valid.device)).clamp(min=0)
    if bool((remaining > candidate.sum(-1)).any()):
        raise ValueError("MI eviction: a head's budget is smaller than its protected entries")
    k, v, a = keys.double(), values.double(), alpha.double()
    count, key_sum, value_sum = stats.count.double(), stats.key_sum.double(), stats.value_sum.double()
    first_order = stats.outer is not None
    outer = stats.outer.double() if first_order else torch.zeros(*value_sum.shape, k.shape[-1]).to(k)
    projected = k @ outer.transpose(-1, -2)  # P_j = S k_j, only to start the scalars below
    v_norm2 = (v * v).sum(-1)  # ‖v_j‖²
    v_dot_p = (v * projected).sum(-1)  # v_j·P_j
    p_norm2 = (projected * projected).sum(-1)  # ‖P_j‖²
    sv_dot_v = (v @ value_sum[..., None]).squeeze(-1)  # s_v·v_j
    sv_dot_p = (projected @ value_sum[..., None]).squeeze(-1)  # s_v·P_j
    sk_dot_k = (k @ key_sum[..., None]).squeeze(-1)  # s_k·k_j
    beta_scale = scaling if first_order else 0.0
    evicted = torch.zeros_like(valid)
    guess = SPECULATION[0]
    while bool((remaining > 0).any()):
        # ‖r_j‖² = ‖v_j − βP_j‖² − 2λ_j m·(v_j − βP_j) + λ_j² ‖m‖²,  m = s_v/n_e, β = c/n_e, λ_j = 1 − β s_k·k_j
        n_e = count.clamp(min=1)[..., None]
        m_norm2 = (value_sum * value_sum).sum(-1, keepdim=True) / n_e**2
        scalars = (v_norm2, v_dot_p, p_norm2, sv_dot_v, sv_dot_p, sk_dot_k)
        r_norm2 = _residual_norm2(scalars, n_e, m_norm2, beta_scale)
        score = (a * r_norm2.clamp(min=0).sqrt()).masked_fill(~candidate, float("inf"))
        speculating = speculate and chunk == 1
        step = min(guess if speculating else chunk, int(remaining.max()))
        picked = score.topk(step, dim=-1, largest=False).indices  # [B, Hkv, step]
        limit = remaining
        k_e = k.gather(2, picked[..., None].expand(-1, -1, -1, k.shape[-1]))
        v_e = v.gather(2, picked[..., None].expand(-1, -1, -1, v.shape[-1]))
        if speculating and step > 1:
            picked, exact = _verified_prefix(
                k, v, a, k_e, v_e, picked, candidate, scalars, count, value_sum, outer, beta_scale
            )
            k_e = k.gather(2, picked[..., None].expand(-1, -1, -1, k.shape[-1]))
            v_e = v.gather(2, picked[..., None].expand(-1, -1, -1, v.shape[-1]))
            limit = torch.minimum(remaining, exact)
            longest = int(exact.masked_fill(remaining <= 0, step).min())
            guess = min(SPECULATION[1], 2 * guess) if longest == step else max(SPECULATION[0], 2 * longest)
        take = torch.arange(step, device=keys.device) < limit[..., None]  # heads that are done take nothing
        weight = take.to(k.dtype)[..., None]
        k_e, v_e = k_e * weight, v_e * weight
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
        flags = (
            torch.zeros(evicted.shape, dtype=torch.long, device=keys.device).scatter_add_(2, picked, take.long()) > 0
        )
        evicted |= flags
        candidate &= ~flags
        remaining = remaining - take.sum(-1)
    return evicted


def _residual_norm2(scalars: tuple[torch.Tensor, ...], n_e: torch.Tensor, m_norm2: torch.Tensor, beta_scale: float):
    """``‖r_j‖²`` from the per-entry scalars of :func:`mi_evict` (broadcast over any trailing axes):
    ``‖v_j − βP_j‖² − 2λ_j m·(v_j − βP_j) + λ_j² ‖m‖²``, ``m = s_v/n_e``, ``β = c/n_e``, ``λ_j = 1 − β s_k·k_j``."""
    v_norm2, v_dot_p, p_norm2, sv_dot_v, sv_dot_p, sk_dot_k = scalars
    beta = beta_scale / n_e
    lam = 1 - beta * sk_dot_k
    m_dot = (sv_dot_v - beta * sv_dot_p) / n_e
    return v_norm2 - 2 * beta * v_dot_p + beta**2 * p_norm2 - 2 * lam * m_dot + lam**2 * m_norm2


def _verified_prefix(
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    k_e: torch.Tensor,
    v_e: torch.Tensor,
    picked: torch.Tensor,
    candidate: torch.Tensor,
    scalars: tuple[torch.Tensor, ...],
    count: torch.Tensor,
    value_sum: torch.Tensor,
    outer: torch.Tensor,
    beta_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(picks, taken)``: how many of the guessed evictions ``picked`` ``[B, Hkv, w]`` the exact
    loop makes in that order, ``taken`` ``[B, Hkv]`` (at least 1: the first is the current
    argmin), and the guess with its first wrong entry replaced by the loop's pick there (the
    argmin after the verified prefix, counted in ``taken``).

    After evicting the guess's first ``t + 1`` entries, each per-entry scalar of
    :func:`mi_evict` is its current value plus a prefix sum over the guess (``σ_ji = k_j·k_ei``,
    ``G = V_e V_eᵀ``; ``P_j`` gains ``Σ_i σ_ji v_ei``, so ``‖P_j‖²`` and ``s_v·P_j`` gain
    quadratic terms, summed through the lower triangle of ``G``): every entry's score after
    every prefix, ``[B, Hkv, n, w]``, in a few batched products. Entry ``t + 1`` of the guess
    is verified when no remaining candidate scores lower after prefix ``t``.
    """
    v_norm2, v_dot_p, p_norm2, sv_dot_v, sv_dot_p, sk_dot_k = (x[..., None] for x in scalars)
    step = picked.shape[-1]
    sigma = k @ k_e.transpose(-1, -2)  # k_j·k_ei, [B, Hkv, n, w]
    v_dot_ve = v @ v_e.transpose(-1, -2)  # v_j·v_ei
    p_dot_ve = k @ (v_e @ outer).transpose(-1, -2)  # P_j·v_ei with the current S
    gram = v_e @ v_e.transpose(-1, -2)  # G_ii'
    lower = sigma @ gram.tril().transpose(-1, -2)  # Σ_{i' ≤ t} G_ti' σ_ji'
    above = gram.triu(1).sum(-2)[..., None, :]  # Σ_{i < t} G_it
    diagonal = gram.diagonal(dim1=-2, dim2=-1)[..., None, :]
    sv_dot_ve = (v_e @ value_sum[..., None]).transpose(-1, -2)  # s_v·v_ei, [B, Hkv, 1, w]
    prefix = (
        v_norm2,
        v_dot_p + (sigma * v_dot_ve).cumsum(-1),
        p_norm2 + (2 * sigma * p_dot_ve + sigma * (2 * lower - diagonal * sigma)).cumsum(-1),
        sv_dot_v + v_dot_ve.cumsum(-1),
        sv_dot_p + (sigma * sv_dot_ve + p_dot_ve + lower + sigma * above).cumsum(-1),
        sk_dot_k + sigma.cumsum(-1),
    )
    ranks = torch.arange(1, step + 1, device=k.device, dtype=k.dtype)
    n_e = (count[..., None] + ranks)[..., None, :]  # [B, Hkv, 1, w]
    sums = value_sum[..., None, :] + v_e.cumsum(-2)  # s_v after each prefix, [B, Hkv, w, d_v]
    m_norm2 = ((sums * sums).sum(-1) / n_e.squeeze(-2) ** 2)[..., None, :]
    score = alpha[..., None] * _residual_norm2(prefix, n_e, m_norm2, beta_scale).clamp(min=0).sqrt()
    order = torch.full_like(candidate, step, dtype=torch.long).scatter_(
        2, picked, torch.arange(step, device=k.device).expand_as(picked)
    )
    gone = order[..., None] <= torch.arange(step, device=k.device)  # evicted by prefix t, [B, Hkv, n, w]
    score = score.masked_fill(gone | ~candidate[..., None], float("inf"))
    best = score.amin(dim=2)[..., :-1]  # the lowest score after prefixes 1 .. w − 1
    guessed = score[..., :-1].gather(2, picked[..., None, 1:]).squeeze(2)  # the guess's next entry's score
    holds = (guessed <= best) & torch.isfinite(guessed)
    verified = 1 + holds.long().cumprod(-1).sum(-1)  # [B, Hkv]
    # the loop's pick after the verified prefix is the argmin there: it replaces the broken guess
    at = verified.clamp(max=step - 1)[..., None]
    after = score.gather(3, (at - 1)[..., None, :].expand(-1, -1, score.shape[2], -1)).squeeze(-1)
    corrected = picked.scatter(2, at, after.argmin(-1, keepdim=True))
    fixed = (verified < step) & torch.isfinite(after.amin(-1))
    return torch.where(fixed[..., None], corrected, picked), verified + fixed.long()


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
    ``log_z_retained`` its ``log Z_R`` ``[B, Hq, q]``, ``query`` ``[B, Hq, q, d_k]``. Mixing
    in the log domain, ``w_R = σ(log Z_R − log Ẑ_E)`` and ``1 − w_R = σ(log Ẑ_E − log Z_R)``,
    stays finite for any logit size; fp32 inside. Heads with nothing evicted are returned
    bit for bit, and so is everything when nothing was evicted at all.
    """
    has = stats.count > 0
    if not bool(has.any()):
        return output
    b, hq, q, dv = output.shape
    hkv = stats.count.shape[1]
    rows = query.float().reshape(b, hkv, (hq // hkv) * q, -1)
    key_mean, value_mean = stats.means()
    n_e = stats.count.clamp(min=1)[..., None]
    log_z_evicted = torch.log(n_e) + scaling * (rows @ key_mean[..., None]).squeeze(-1)  # Jensen, Eq. 11
    f_evicted = value_mean[..., None, :].expand(b, hkv, rows.shape[2], dv)
    if stats.outer is not None:
        f_evicted = f_evicted + _centered_outer_times(stats, rows) * (scaling / n_e)[..., None]  # Eq. 9
    f_retained = output.float().reshape(b, hkv, -1, dv)
    gap = log_z_retained.float().reshape(b, hkv, -1) - log_z_evicted
    mixed = torch.sigmoid(gap)[..., None] * f_retained + torch.sigmoid(-gap)[..., None] * f_evicted
    mixed = mixed.reshape(b, hq, q, dv).to(output.dtype)
    return torch.where(has.repeat_interleave(hq // hkv, dim=1)[..., None, None], mixed, output)
