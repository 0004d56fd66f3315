"""MomentKV (seed 003): the ``momentkv`` policy, its variants and the ``moment-nc`` stage over any policy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvevict
from kvevict.budgets import adakv_counts
from kvevict.moments import MomentStats, mi_evict
from kvevict.policies.base import keep_top
from kvevict.policies.momentkv import MomentKV, MomentNC, MomentStatistics, chunk_pool, moment_bytes
from kvevict.policies.snapkv import snapkv_scores
from kvevict.signals import Signals, attention_rows
from tests.conftest import (
    assert_next_logits_match_reference,
    build_policy,
    capture_passes,
    greedy,
    prompt,
    reference_logits,
    tiny_model,
)

INF = float("inf")
PROMPT, BUDGET = 96, 40


def recorded(cache: kvevict.EvictionCache, layer: int = 0) -> MomentStats | None:
    """The moment statistics the cache's policy recorded for a layer (None: none kept)."""
    observers = [stage for stage in cache.policy.stages if isinstance(stage, MomentStatistics)]
    return observers[0].recorded(cache.layers[layer]) if observers else None


def test_chunk_pool_by_hand() -> None:
    scores = torch.tensor([[[1.0, 3.0, 2.0, 6.0, 4.0, 8.0, 9.0]]])
    torch.testing.assert_close(chunk_pool(scores, 4), torch.tensor([[[3.0, 3.0, 3.0, 3.0, 7.0, 7.0, 7.0]]]))
    torch.testing.assert_close(chunk_pool(scores, 2), torch.tensor([[[2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 9.0]]]))
    assert torch.equal(keep_top(scores, torch.tensor([[2]])), torch.tensor([[[0, 0, 0, 0, 0, 1, 1]]], dtype=torch.bool))


def test_prefill_alpha_is_window_votes_then_chunk_means_by_hand() -> None:
    # [B=1, Hq=2, w=2, n=7], one KV head; no max-pooling (kernel 1): votes = mean over window, then heads
    window = torch.tensor(
        [
            [[0.1, 0.3, 0.2, 0.0, 0.2, 0.2, 0.0], [0.3, 0.1, 0.0, 0.2, 0.0, 0.2, 0.2]],
            [[0.0, 0.2, 0.2, 0.2, 0.2, 0.2, 0.0], [0.2, 0.2, 0.2, 0.0, 0.2, 0.0, 0.2]],
        ]
    )[None]
    # head votes [.2 .2 .1 .1 .1], [.1 .2 .2 .1 .2] → GQA mean [.15 .2 .15 .1 .15]
    # → chunks of 2: [.175 .175 .125 .125 .15]
    policy = MomentKV(kernel=1, pool_chunk=2, window=2)
    layer = SimpleNamespace(num_kv_heads=1, positions=torch.arange(7)[None, None], valid=None)
    signals = Signals(phase="prefill", num_new=7, query=None, scaling=1.0, window_attention=window)
    expected = torch.tensor([[[0.175, 0.175, 0.125, 0.125, 0.15, INF, INF]]])
    torch.testing.assert_close(policy.score(layer, signals), expected)  # the method is its own scorer


def test_prefill_alpha_pools_chunks_of_adjacent_positions_not_storage_slots() -> None:
    """After an eviction the cache refills slots (chunked prefill), so storage order is not
    position order: each entry gets the α it gets with the entries stored in position order."""
    window = torch.rand(1, 2, 2, 9, generator=torch.Generator().manual_seed(0))  # [B, Hq, w=2, n=9]
    policy = MomentKV(kernel=1, pool_chunk=3, window=2)
    ordered = SimpleNamespace(num_kv_heads=1, positions=torch.arange(9)[None, None], valid=None)
    expected = policy.score(ordered, Signals("prefill", 9, None, 1.0, window_attention=window))
    moved = torch.tensor([5, 0, 6, 2, 1, 3, 4, 7, 8])  # earlier entries refilled; the window's last
    stored = SimpleNamespace(num_kv_heads=1, positions=moved[None, None], valid=None)
    score = policy.score(stored, Signals("prefill", 9, None, 1.0, window_attention=window[..., moved]))
    torch.testing.assert_close(score, expected[..., moved])
    assert not torch.allclose(chunk_pool(expected[..., moved][..., :7], 3), expected[..., moved][..., :7])


@pytest.mark.parametrize(("spelling", "fraction"), [("momentkv", 0.25), ("momentkv[evict_fraction=0]", 0.0)])
def test_momentkv_prefill_evicts_by_the_mi_loop_and_records_the_evicted_moments(spelling: str, fraction: float) -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, build_policy(spelling), budget=BUDGET)
    passes = capture_passes(cache.layers[0])
    with torch.no_grad():
        model(input_ids=prompt(PROMPT), past_key_values=cache)
    layer, captured = cache.layers[0], passes[0]
    rows = attention_rows(captured["query"][:, :, -32:], captured["keys"], captured["scaling"])
    votes = snapkv_scores(rows, num_kv_heads=2)
    alpha = torch.cat([chunk_pool(votes[..., :-32], 4), votes[..., -32:]], dim=-1)
    protected = alpha.isinf() | (captured["positions"] < 1)  # the window and the first token
    counts = adakv_counts(alpha.masked_fill(protected, INF), BUDGET)  # the paper's AdaKV head budgets
    evicted = mi_evict(
        captured["keys"],
        captured["values"],
        alpha.masked_fill(protected, 0),
        MomentStats.zeros(1, 2, 16, 16),
        counts,
        captured["scaling"],
        protected=protected,
        fraction=fraction,
    )
    assert layer.head_lengths().tolist() == counts.tolist() and int(counts.sum()) == 2 * BUDGET
    for head in range(2):
        held = layer.positions[0, head] if layer.valid is None else layer.positions[0, head][layer.valid[0, head]]
        assert sorted(held.tolist()) == (~evicted[0, head]).nonzero().flatten().tolist()
    assert (layer.positions[..., 0] == 0).all() and set(range(64, 96)) <= set(layer.positions[0, 1].tolist())
    stats = recorded(cache)
    for head in range(2):
        gone = evicted[0, head]
        k, v = captured["keys"][0, head, gone], captured["values"][0, head, gone]
        assert stats.count[0, head] == PROMPT - counts[0, head]
        torch.testing.assert_close(stats.key_sum[0, head], k.sum(0))
        torch.testing.assert_close(stats.value_sum[0, head], v.sum(0))
        torch.testing.assert_close(stats.centered[0, head], (v - v.mean(0)).T @ (k - k.mean(0)))


@pytest.mark.parametrize("policy", ["moment-nc+h2o", "moment-nc+tova"])
def test_decode_time_statistics_equal_sums_over_every_evicted_token(policy: str) -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, policy, budget=BUDGET)
    passes = capture_passes(cache.layers[1])
    greedy(model, prompt(PROMPT), cache, new_tokens=8)
    layer = cache.layers[1]
    keys, values = {}, {}  # position → (per-head) key and value when the token entered the cache
    for captured in passes:
        for head in range(2):
            for slot, position in enumerate(captured["positions"][0, head].tolist()):
                keys.setdefault((head, position), captured["keys"][0, head, slot])
                values.setdefault((head, position), captured["values"][0, head, slot])
    stats = recorded(cache, 1)
    for head in range(2):
        retained = set(layer.positions[0, head].tolist())
        gone = [p for p in range(layer.seen) if p not in retained]
        assert stats.count[0, head] == len(gone) == layer.seen - BUDGET
        k = torch.stack([keys[head, p] for p in gone])
        v = torch.stack([values[head, p] for p in gone])
        torch.testing.assert_close(stats.key_sum[0, head], k.sum(0))
        torch.testing.assert_close(stats.centered[0, head], (v - v.mean(0)).T @ (k - k.mean(0)), rtol=1e-5, atol=1e-5)


def test_nc_corrects_the_question_tokens_after_context_compression() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "momentkv", budget=BUDGET)
    with torch.no_grad():
        model(input_ids=prompt(PROMPT), past_key_values=cache)  # the context, compressed
    question = prompt(6, seed=5)
    expected, plain = (
        reference_logits(model, cache, question),
        reference_logits(model, cache, question, corrected=False),
    )
    with torch.no_grad():
        logits = model(input_ids=question, past_key_values=cache).logits[:, -1]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert (logits - plain).abs().max() > 1e-3  # the correction is not a no-op


def test_momentkv_at_decode_time_matches_the_corrected_reference() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("momentkv", regime="both", evict_chunk=2), budget=BUDGET)
    sequences, _ = greedy(model, prompt(PROMPT), cache, new_tokens=6)
    assert [int(layer.head_lengths().sum()) for layer in cache.eviction_layers] == [2 * BUDGET] * 2  # AdaKV total
    token = sequences[:, -1:]
    assert_next_logits_match_reference(model, cache, token)


def test_variants() -> None:
    model, ids = tiny_model(), prompt(PROMPT)
    runs = {}
    variants = {
        "full": {},
        "nc_only": {"mi": False},
        "mi_only": {"nc": False},
        "neither": {"mi": False, "nc": False},
        "order0": {"order": 0},
    }
    for label, params in variants.items():
        cache = kvevict.EvictionCache(model, kvevict.make_policy("momentkv", **params), budget=BUDGET)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
        runs[label] = cache
    # NC only = top-k of the pooled window votes; MI changes the kept set
    assert torch.equal(runs["nc_only"].layers[0].positions, runs["neither"].layers[0].positions)
    assert not torch.equal(runs["full"].layers[0].positions, runs["nc_only"].layers[0].positions)
    assert recorded(runs["neither"]) is None  # no statistics when nothing uses them
    assert not any(isinstance(stage, MomentStatistics) for stage in runs["neither"].policy.stages)
    assert recorded(runs["order0"]).centered is None
    assert runs["mi_only"].policy.corrects_output is False and runs["full"].policy.corrects_output is True
    question = prompt(3, seed=7)
    expected = reference_logits(model, runs["mi_only"], question, corrected=False)
    with torch.no_grad():  # MI only: plain attention over the retained entries
        logits = model(input_ids=question, past_key_values=runs["mi_only"]).logits[:, -1]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    # storage: the sums (1 + 2d + d²) and what NC reads (2 + 2d), fp32 per KV head and layer (2 layers ×
    # 2 heads × d=16); order 0 drops d²
    assert moment_bytes(runs["full"]) == 2 * 2 * (1 + 32 + 256 + 2 + 32) * 4
    assert moment_bytes(runs["order0"]) == 2 * 2 * (1 + 32 + 2 + 32) * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_statistics_stay_fp32_under_half_precision(dtype: torch.dtype) -> None:
    model = tiny_model(dtype=dtype)
    cache = kvevict.EvictionCache(model, "momentkv", budget=BUDGET)
    _, logits = greedy(model, prompt(PROMPT), cache, new_tokens=4)
    assert torch.isfinite(logits).all()
    stats = recorded(cache)
    assert {stats.count.dtype, stats.key_sum.dtype, stats.value_sum.dtype, stats.centered.dtype} == {torch.float32}


def test_nc_stage_composes_by_name_over_the_method() -> None:
    policy = kvevict.make_policy("moment-nc+h2o", sinks=2, window=8, **{"moment-nc": {"order": 0}})
    assert isinstance(policy.corrector, MomentNC) and policy.name == "moment-nc+h2o"
    assert (policy.corrector.order, policy.method.sinks, policy.method.window, policy.regime) == (0, 2, 8, "both")
    assert policy.corrector.statistics in policy.stages and policy.corrector.statistics.order == 0
    h2o = {"sinks": 2, "window": 8, "regime": "both", "group": "mean"}
    assert policy.params() == {**h2o, "moment-nc": {"order": 0}}
    assert policy.min_budget(64) == 10 and policy.evicts_in("decode")
    # NC over momentkv without its own: two statistics, each under its own namespace
    both = kvevict.make_policy("moment-nc+momentkv[nc=false,moment-nc.order=0]")
    observers = [stage for stage in both.stages if isinstance(stage, MomentStatistics)]
    assert [stage.order for stage in observers] == [1, 0]
    assert len({stage.namespace for stage in observers}) == 2


def test_bad_parameters_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="momentkv: parameter 'order' expects one of 0, 1, got 2"):
        kvevict.make_policy("momentkv", order=2)
    with pytest.raises(ValueError, match="moment-nc: parameter 'order' expects one of 0, 1, got 3"):
        kvevict.make_policy("moment-nc+h2o", **{"moment-nc": {"order": 3}})
    with pytest.raises(ValueError, match="momentkv: parameter 'kernel' expects an odd integer >= 1, got 4"):
        kvevict.make_policy("momentkv", kernel=4)
    with pytest.raises(ValueError, match="momentkv: parameter 'evict_chunk' expects an integer >= 1, got 0"):
        kvevict.make_policy("momentkv", evict_chunk=0)
    with pytest.raises(ValueError, match="moment-nc and momentkv's own moment-nc are both correctors"):
        kvevict.make_policy("moment-nc+momentkv")
    with pytest.raises(ValueError, match="h2o: unknown parameter 'windw'; its parameters: sinks, window"):
        kvevict.make_policy("moment-nc+h2o", windw=3)
    with pytest.raises(ValueError, match="unknown policy 'moment-nc\\+h2'.*prefixes.*moment-nc"):
        kvevict.make_policy("moment-nc+h2")
    with pytest.raises(
        ValueError, match="budget 20 is smaller than momentkv's sinks \\(1\\) \\+ recent window \\(32\\)"
    ):
        kvevict.EvictionCache(tiny_model(), "momentkv", budget=20)
