"""MomentKV's statistics, moment-informed eviction and normalization-corrected inference."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvevict.moments import (
    MomentStats,
    accumulate,
    accumulate_one,
    mi_evict,
    mi_residual_norms,
    nc_correct,
    nc_log_partition,
)

B, HKV, G, N, D = 1, 2, 3, 12, 8
SCALING = D**-0.5


def _kv(seed: int = 0, n: int = N, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, HKV, n, D, generator=generator)
    values = torch.randn(B, HKV, n, D, generator=generator)
    return keys.to(dtype), values.to(dtype)


def _stats_of(keys: torch.Tensor, values: torch.Tensor, evicted: torch.Tensor, order: int = 1) -> MomentStats:
    return accumulate(MomentStats.zeros(B, HKV, D, D, order=order), keys, values, evicted)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain float64 attention of every query over every key: ``(output, log Z)`` per query head."""
    k = keys.double().repeat_interleave(G, dim=1)
    v = values.double().repeat_interleave(G, dim=1)
    logits = query.double() @ k.transpose(-1, -2) * SCALING
    return logits.softmax(-1) @ v, logits.logsumexp(-1)


def _nc_brute(query, retained_keys, retained_values, evicted_keys, evicted_values) -> torch.Tensor:
    """Eq. 12 written out in float64 from the evicted tokens themselves (one KV head's group)."""
    f_r, log_z_r = _attend(query, retained_keys, retained_values)
    k_bar, v_bar = evicted_keys.double().mean(2), evicted_values.double().mean(2)
    n_e = evicted_keys.shape[2]
    s_tilde = evicted_values.double().transpose(-1, -2) @ (evicted_keys.double() - k_bar[:, :, None])
    q = query.double()
    k_bar_q, v_bar_q, s_q = (x.repeat_interleave(G, dim=1) for x in (k_bar, v_bar, s_tilde))
    z_e = n_e * torch.exp((q @ k_bar_q[..., None]).squeeze(-1) * SCALING)
    f_e = v_bar_q[:, :, None] + (q @ s_q.transpose(-1, -2)) * SCALING / n_e
    w_r = (torch.exp(log_z_r) / (torch.exp(log_z_r) + z_e))[..., None]
    return w_r * f_r + (1 - w_r) * f_e


@pytest.mark.parametrize("order", [0, 1])
def test_one_entry_per_head_adds_up_bit_for_bit_as_its_mask(order: int) -> None:
    """A decode step's eviction (one entry per head, by its slot, in place) gives exactly the
    statistics the mask of those entries gives, after earlier evictions too, derived fields included."""
    keys, values = _kv()
    earlier = torch.zeros(B, HKV, N, dtype=torch.bool)
    earlier[0, 0, [1, 4]] = True
    earlier[0, 1, [0, 2, 7]] = True
    stats = _stats_of(keys, values, earlier, order)
    slots = torch.tensor([[5, 11]])
    evicted = torch.zeros_like(earlier).scatter_(-1, slots[..., None], True)
    expected = accumulate(stats, keys, values, evicted)
    accumulate_one(stats, keys, values, slots)
    for field in dataclasses.fields(MomentStats):
        ours, theirs = getattr(stats, field.name), getattr(expected, field.name)
        assert (ours is None and theirs is None) or torch.equal(ours, theirs), field.name


def test_centred_statistics_keep_their_digits_where_raw_sums_would_cancel() -> None:
    """Keys and values far from zero (means 100 and 30, spread 1), evicted one at a time and all at
    once: ``S̃`` stays within 1e-4 of float64's, where fp32 raw sums ``S − s_v s_kᵀ / n_e`` lose about
    16 % of it over these 2,000 entries (measured; the reason ``S`` is not held)."""
    generator = torch.Generator().manual_seed(3)
    n = 2000
    keys = 100 + torch.randn(B, HKV, n, D, generator=generator)
    values = 30 + torch.randn(B, HKV, n, D, generator=generator)
    exact_k, exact_v = (x.double() - x.double().mean(2, keepdim=True) for x in (keys, values))
    truth = exact_v.transpose(-1, -2) @ exact_k
    one_by_one = MomentStats.zeros(B, HKV, D, D)
    for slot in range(n):
        accumulate_one(one_by_one, keys, values, torch.full((B, HKV), slot))
    at_once = accumulate(MomentStats.zeros(B, HKV, D, D), keys, values, torch.ones(B, HKV, n, dtype=torch.bool))
    for stats in (one_by_one, at_once):
        assert float((stats.centered.double() - truth).norm() / truth.norm()) < 1e-4


def test_statistics_equal_sums_recomputed_from_the_evicted_tokens() -> None:
    keys, values = _kv()
    first = torch.zeros(B, HKV, N, dtype=torch.bool)
    first[0, 0, [1, 4]] = True
    first[0, 1, [0, 2, 7]] = True
    second = torch.zeros_like(first)
    second[0, 0, [9]] = True
    stats = accumulate(_stats_of(keys, values, first), keys, values, second)  # two evictions add up
    for head in range(HKV):
        gone = (first | second)[0, head]
        k, v = keys[0, head, gone], values[0, head, gone]
        assert stats.count[0, head] == gone.sum()
        torch.testing.assert_close(stats.key_sum[0, head], k.sum(0))
        torch.testing.assert_close(stats.value_sum[0, head], v.sum(0))
        torch.testing.assert_close(stats.centered[0, head], (v - v.mean(0)).T @ (k - k.mean(0)))
    assert all(t.dtype == torch.float32 for t in (stats.count, stats.key_sum, stats.value_sum, stats.centered))


def test_storage_is_independent_of_the_context_length() -> None:
    short, long = (_stats_of(*_kv(n=n), torch.ones(B, HKV, n, dtype=torch.bool)) for n in (4, 400))
    # the sums, then the count's log and inverse and the two means that NC reads, derived
    assert short.nbytes == long.nbytes == B * HKV * (1 + D + D + D * D + 2 + D + D) * 4
    assert MomentStats.zeros(B, HKV, D, D, order=0).nbytes == B * HKV * (1 + 2 * D + 2 + 2 * D) * 4  # no S
    with pytest.raises(ValueError, match="order must be 0"):
        MomentStats.zeros(B, HKV, D, D, order=2)


def test_nc_is_exact_when_the_evicted_keys_are_one_cluster() -> None:
    keys, values = _kv(1)
    keys[:, :, : N // 2] = keys[:, :, :1]  # evicted: identical keys (any values), so δ_i = 0
    evicted = torch.zeros(B, HKV, N, dtype=torch.bool)
    evicted[..., : N // 2] = True
    query = torch.randn(B, HKV * G, 3, D, generator=torch.Generator().manual_seed(2)) * 3
    full, _ = _attend(query, keys, values)
    retained_keys, retained_values = keys[:, :, N // 2 :], values[:, :, N // 2 :]
    f_r, log_z_r = _attend(query, retained_keys, retained_values)
    corrected = nc_correct(f_r.float(), log_z_r.float(), query, _stats_of(keys, values, evicted), SCALING)
    torch.testing.assert_close(corrected.double(), full, rtol=0, atol=1e-5)
    assert (f_r - full).abs().max() > 1e-2  # renormalising alone is not


@pytest.mark.parametrize("order", [0, 1])
def test_nc_matches_the_formula_computed_from_the_evicted_tokens(order: int) -> None:
    keys, values = _kv(3)
    evicted = torch.zeros(B, HKV, N, dtype=torch.bool)
    evicted[..., 2:9] = True
    query = torch.randn(B, HKV * G, 4, D, generator=torch.Generator().manual_seed(4))
    retained_keys, retained_values = keys[:, :, ~evicted[0, 0]], values[:, :, ~evicted[0, 0]]
    f_r, log_z_r = _attend(query, retained_keys, retained_values)
    expected = _nc_brute(query, retained_keys, retained_values, keys[:, :, 2:9], values[:, :, 2:9])
    if order == 0:  # f̂_E = v̄
        v_bar = values[:, :, 2:9].double().mean(2).repeat_interleave(G, dim=1)[:, :, None]
        k_bar = keys[:, :, 2:9].double().mean(2).repeat_interleave(G, dim=1)
        log_z_e = math.log(7) + (query.double() @ k_bar[..., None]).squeeze(-1) * SCALING
        w_r = torch.sigmoid(log_z_r - log_z_e)[..., None]
        expected = w_r * f_r + (1 - w_r) * v_bar
    stats = _stats_of(keys, values, evicted, order)
    corrected = nc_correct(f_r.float(), log_z_r.float(), query, stats, SCALING)
    torch.testing.assert_close(corrected.double(), expected, rtol=0, atol=1e-5)


def test_log_partition_is_causal_chunked_and_honours_the_validity_mask() -> None:
    keys, _ = _kv(5)
    query = torch.randn(B, HKV * G, 5, D, generator=torch.Generator().manual_seed(6))
    logits = query @ keys.repeat_interleave(G, dim=1).transpose(-1, -2) * SCALING  # [B, Hq, 5, N]
    causal = torch.arange(N)[None, :] > torch.arange(N - 5, N)[:, None]
    valid = torch.ones(B, HKV, N, dtype=torch.bool)
    valid[0, 1, [0, 3]] = False  # head 1 is padded at two places
    hidden = causal | ~valid.repeat_interleave(G, dim=1)[:, :, None, :]
    expected = logits.masked_fill(hidden, float("-inf")).logsumexp(-1)
    for chunk in (1, 2, 256):
        torch.testing.assert_close(nc_log_partition(query, keys, SCALING, valid=valid, chunk=chunk), expected)


def test_nothing_evicted_is_the_identity() -> None:
    keys, values = _kv()
    query = torch.randn(B, HKV * G, 2, D)
    output = torch.randn(B, HKV * G, 2, D).to(torch.bfloat16)
    stats = MomentStats.zeros(B, HKV, D, D)
    assert torch.equal(nc_correct(output, nc_log_partition(query, keys, SCALING), query, stats, SCALING), output)
    # a head that evicted nothing is untouched while its neighbour is corrected
    evicted = torch.zeros(B, HKV, N, dtype=torch.bool)
    evicted[0, 1, :3] = True
    corrected = nc_correct(output, nc_log_partition(query, keys, SCALING), query, _stats_of(keys, values, evicted), 1)
    assert torch.equal(corrected[:, :G], output[:, :G])
    assert not torch.equal(corrected[:, G:], output[:, G:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_give_finite_outputs(dtype: torch.dtype) -> None:
    keys, values = _kv(7, dtype=dtype)
    keys = keys * 30  # large logits
    evicted = torch.zeros(B, HKV, N, dtype=torch.bool)
    evicted[..., :6] = True
    stats = _stats_of(keys, values, evicted)
    query = (torch.randn(B, HKV * G, 3, D) * 30).to(dtype)
    output = torch.randn(B, HKV * G, 3, D).to(dtype)
    corrected = nc_correct(output, nc_log_partition(query, keys[:, :, 6:], SCALING), query, stats, SCALING)
    assert corrected.dtype == dtype and torch.isfinite(corrected).all()
    alpha = torch.rand(B, HKV, N).to(dtype)
    kept = ~mi_evict(keys, values, alpha, stats, torch.full((B, HKV), 4), SCALING)
    assert (kept.sum(-1) == 4).all()


def test_log_domain_mixing_is_stable_for_large_logits() -> None:
    keys, values = _kv(8)
    evicted = torch.zeros(B, HKV, N, dtype=torch.bool)
    evicted[..., :5] = True
    stats = _stats_of(keys, values, evicted)
    for scale in (1.0, 1e3, 1e5):  # exp(q·k/√d) overflows fp32 (and fp64) long before 1e5
        query = torch.randn(B, HKV * G, 2, D, generator=torch.Generator().manual_seed(9)) * scale
        log_z = nc_log_partition(query, keys[:, :, 5:], SCALING)
        f_r = torch.randn(B, HKV * G, 2, D)
        corrected = nc_correct(f_r, log_z, query, stats, SCALING)
        assert torch.isfinite(corrected).all()
        # reference: the same mix with w_R from float64 log-partitions
        k_bar, v_bar = (x.double().repeat_interleave(G, 1) for x in stats.means())
        log_z_e = math.log(5) + (query.double() @ k_bar[..., None]).squeeze(-1) * SCALING
        w_r = torch.sigmoid(log_z.double() - log_z_e)[..., None]
        s_tilde = stats.centered.double()
        f_e = v_bar[:, :, None] + query.double() @ s_tilde.repeat_interleave(G, 1).transpose(-1, -2) * SCALING / 5
        torch.testing.assert_close(corrected.double(), w_r * f_r.double() + (1 - w_r) * f_e, rtol=1e-4, atol=1e-4)


def _brute_force_mi(keys, values, alpha, keep: int, protected) -> torch.Tensor:
    """Algorithm 1 lines 6-18 literally: recompute the statistics and every residual, evict the argmin."""
    evicted = torch.zeros(keys.shape[:3], dtype=torch.bool)
    for b in range(B):
        for h in range(HKV):
            while (~evicted[b, h]).sum() > keep:
                gone = evicted[b, h]
                k, v = keys[b, h].double(), values[b, h].double()
                n_e = int(gone.sum())
                if n_e:
                    k_bar, v_bar = k[gone].mean(0), v[gone].mean(0)
                    s_tilde = v[gone].T @ (k[gone] - k_bar)
                    residual = v - v_bar - (k @ s_tilde.T) * SCALING / n_e
                else:
                    residual = v
                score = (alpha[b, h].double() * residual.norm(dim=-1)).masked_fill(gone | protected[b, h], math.inf)
                evicted[b, h, int(score.argmin())] = True
    return evicted


def test_mi_exact_loop_matches_a_brute_force_argmin() -> None:
    keys, values = _kv(10, n=16)
    alpha = torch.rand(B, HKV, 16, generator=torch.Generator().manual_seed(11)) + 0.05
    protected = torch.zeros(B, HKV, 16, dtype=torch.bool)
    protected[..., 0] = True  # a sink
    stats = MomentStats.zeros(B, HKV, D, D)
    evicted = mi_evict(keys, values, alpha, stats, torch.full((B, HKV), 5), SCALING, protected=protected)
    assert torch.equal(evicted, _brute_force_mi(keys, values, alpha, 5, protected))
    assert not evicted[..., 0].any() and (evicted.sum(-1) == 11).all()
    assert stats.count.sum() == 0  # the caller's statistics are untouched


def test_mi_continues_from_earlier_statistics_and_per_head_budgets() -> None:
    keys, values = _kv(12)
    earlier = torch.zeros(B, HKV, N, dtype=torch.bool)
    earlier[..., :3] = True
    stats = _stats_of(keys, values, earlier)
    alpha = torch.rand(B, HKV, N - 3, generator=torch.Generator().manual_seed(13))
    rest_k, rest_v = keys[:, :, 3:], values[:, :, 3:]
    counts = torch.tensor([[6, 2]])
    evicted = mi_evict(rest_k, rest_v, alpha, stats, counts, SCALING)
    assert evicted.sum(-1).tolist() == [[3, 7]]
    # first pick of each head = argmin of α·‖r‖ under the earlier statistics
    first = (alpha * mi_residual_norms(rest_k, rest_v, stats, SCALING)).argmin(-1)
    assert evicted.gather(2, first[..., None]).all()


def test_mi_chunked_variant_and_validity_mask() -> None:
    keys, values = _kv(14, n=20)
    alpha = torch.rand(B, HKV, 20, generator=torch.Generator().manual_seed(15))
    stats = MomentStats.zeros(B, HKV, D, D)
    counts = torch.full((B, HKV), 8)
    # one chunk covering every eviction = a single scoring pass with the initial statistics: top-k of α·‖v‖
    one_shot = mi_evict(keys, values, alpha, stats, counts, SCALING, chunk=12)
    lowest = (alpha * values.norm(dim=-1)).topk(12, dim=-1, largest=False).indices
    assert torch.equal(one_shot, torch.zeros_like(one_shot).scatter_(2, lowest, True))
    valid = torch.ones(B, HKV, 20, dtype=torch.bool)
    valid[0, 1, 15:] = False  # head 1 has 15 real entries
    evicted = mi_evict(keys, values, alpha, stats, counts, SCALING, valid=valid, chunk=3)
    assert evicted.sum(-1).tolist() == [[12, 7]] and not (evicted & ~valid).any()
    for bad in ({"chunk": 0}, {"fraction": 1.0}, {"fraction": -0.1}):
        with pytest.raises(ValueError, match="needs chunk >= 1 and 0 <= fraction < 1"):
            mi_evict(keys, values, alpha, stats, counts, SCALING, **bad)
    with pytest.raises(ValueError, match="smaller than its protected entries"):
        mi_evict(keys, values, alpha, stats, torch.full((B, HKV), 2), SCALING, protected=torch.rand(B, HKV, 20) < 2)


def test_mi_by_a_fraction_of_the_evicted_set_is_the_exact_loop_while_the_fraction_is_below_one_entry() -> None:
    keys, values = _kv(10, n=16)
    alpha = torch.rand(B, HKV, 16, generator=torch.Generator().manual_seed(11)) + 0.05
    protected = torch.zeros(B, HKV, 16, dtype=torch.bool)
    stats = MomentStats.zeros(B, HKV, D, D)
    # ⌊0.05·n_e⌋ = 0 for the 11 evictions (n_e ≤ 10): one entry per update, as the exact loop
    evicted = mi_evict(keys, values, alpha, stats, torch.full((B, HKV), 5), SCALING, fraction=0.05)
    assert torch.equal(evicted, _brute_force_mi(keys, values, alpha, 5, protected))


def test_mi_by_a_fraction_of_the_evicted_set_keeps_nearly_what_the_exact_loop_keeps() -> None:
    generator = torch.Generator().manual_seed(16)
    keys, values = torch.randn(1, 2, 400, D, generator=generator), torch.randn(1, 2, 400, D, generator=generator)
    alpha = torch.rand(1, 2, 400, generator=generator) + 0.05
    stats, counts = MomentStats.zeros(1, 2, D, D), torch.full((1, 2), 100)
    exact = mi_evict(keys, values, alpha, stats, counts, SCALING)
    fast = mi_evict(keys, values, alpha, stats, counts, SCALING, fraction=0.125)
    assert (fast.sum(-1) == 300).all()
    assert int((fast & ~exact).sum()) <= 4  # of 200 kept entries (the approximation measured in docs/seedspeed.md)
