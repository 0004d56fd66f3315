"""ExpectedAttention: hand-computed expected logits and scores, and the policy end to end."""

from __future__ import annotations

import math

import pytest
import torch

import kvevict
from kvevict.policies.expected_attention import (
    RECENT_QUERIES,
    average_rotation,
    expected_attention_scores,
    expected_logits,
    query_statistics,
    rope_inverse,
)
from tests.conftest import assert_next_logits_match_reference, greedy, prompt, tiny_model


def test_expected_logits_with_known_mean_covariance_and_rotation() -> None:
    # d = 2: R̄ = [[c, -s], [s, c]]; μ = [1, 0], Σ = diag(1, 0), k = [1, 1], s = 1/√2
    c, s = 0.6, 0.8
    rotation = torch.tensor([[c, -s], [s, c]])
    mean, cov = torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[[1.0, 0.0], [0.0, 0.0]]]])
    keys = torch.tensor([[[[1.0, 1.0], [0.0, 0.0]]]])
    z = expected_logits(keys, mean, cov, rotation, scaling=1 / math.sqrt(2))
    # μ' = [c, s] → k·μ'/√d = 1.4/√2; Σ' = [[c², cs], [cs, s²]] → kᵀΣ'k/(2d) = 1.96/4
    torch.testing.assert_close(z, torch.tensor([[[1.4 / math.sqrt(2) + 1.96 / 4, 0.0]]]))
    mean_only = expected_logits(keys, mean, None, rotation, scaling=1 / math.sqrt(2))
    torch.testing.assert_close(mean_only, torch.tensor([[[1.4 / math.sqrt(2), 0.0]]]))


def test_average_rotation_is_the_mean_of_the_future_rotations() -> None:
    # d = 2, angles 0 and π/2: R̄ = (I + [[0, -1], [1, 0]]) / 2
    cos, sin = torch.tensor([[1.0, 1.0], [0.0, 0.0]]), torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    torch.testing.assert_close(average_rotation(cos, sin), torch.tensor([[0.5, -0.5], [0.5, 0.5]]))


def test_scores_are_softmax_gqa_mean_plus_eps_times_value_norm() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0), 5.0], [0.0, 0.0, 0.0]]])  # two query heads, one KV head
    values = torch.tensor([[[[3.0, 4.0], [0.0, 2.0], [1.0, 0.0]]]])
    eligible = torch.tensor([[[True, True, False]]])  # the last entry is a sink: not in the softmax
    scores = expected_attention_scores(logits, values, eligible, eps=0.01)
    p = torch.tensor([(0.25 + 0.5) / 2, (0.75 + 0.5) / 2])
    torch.testing.assert_close(scores[..., :2], ((p + 0.01) * torch.tensor([5.0, 2.0]))[None, None])
    assert scores[0, 0, 2] == float("-inf")


def test_query_statistics_are_the_population_mean_and_covariance() -> None:
    queries = torch.tensor([[[[1.0, 0.0], [3.0, 2.0]]]])
    mean, cov = query_statistics(queries)
    torch.testing.assert_close(mean, torch.tensor([[[2.0, 1.0]]]))
    torch.testing.assert_close(cov, torch.tensor([[[[1.0, 1.0], [1.0, 1.0]]]]))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefill_keeps_the_top_expected_attention_of_the_prompt_queries(arch: str) -> None:
    """End to end against pre-RoPE queries read at the q projection (+ q_norm for Qwen3)."""
    model = tiny_model(arch)
    ids, budget, sinks = prompt(96), 40, 4
    captured = {}
    attention = model.model.layers[1].self_attn
    module = attention.q_norm if arch == "qwen3" else attention.q_proj
    handle = module.register_forward_hook(lambda m, a, out: captured.setdefault("q", out.detach()))
    cache = kvevict.EvictionCache(model, "expected-attention", budget=budget)
    keys = {}
    original = cache.layers[1].keep_rows  # the keys as they are when the layer evicts
    cache.layers[1].keep_rows = lambda rows: (keys.setdefault("k", cache.layers[1].keys.clone()), original(rows))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    handle.remove()
    d = attention.head_dim
    queries = captured["q"].reshape(1, 96, -1, d).transpose(1, 2)[:, :, sinks:]
    mean, cov = query_statistics(queries)
    cos, sin = model.model.rotary_emb(queries, torch.arange(96, 96 + 512)[None])
    z = expected_logits(keys["k"], mean, cov, average_rotation(cos[0], sin[0]), d**-0.5)
    full = kvevict.EvictionCache(model, "full")  # the values of every prompt token
    with torch.no_grad():
        model(input_ids=ids, past_key_values=full)
    eligible = torch.arange(96)[None, None].expand(1, 2, 96) >= sinks
    scores = expected_attention_scores(z, full.layers[1].values, eligible).masked_fill(~eligible, float("inf"))
    expected = scores.topk(budget, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(cache.layers[1].positions.sort(dim=-1).values, expected)  # slots are not in order


def test_rope_inverse_undoes_the_models_rotation() -> None:
    model = tiny_model()
    q = torch.randn(1, 4, 5, 16)
    cos, sin = model.model.rotary_emb(q, torch.arange(10, 15)[None])
    rotated = q * cos[:, None] + torch.cat([-q[..., 8:], q[..., :8]], dim=-1) * sin[:, None]
    torch.testing.assert_close(rope_inverse(rotated, cos[0], sin[0]), q, rtol=0, atol=1e-5)


def test_decode_regime_uses_recent_query_statistics_and_stays_exact() -> None:
    model = tiny_model()
    policy = kvevict.make_policy("expected-attention", regime="both", stats_window=16)
    cache = kvevict.EvictionCache(model, policy, budget=40)
    sequences, _ = greedy(model, prompt(96), cache, new_tokens=6)
    assert all(cache.policy.method.memo(layer)[RECENT_QUERIES].shape[2] == 16 for layer in cache.eviction_layers)
    assert cache.layer_lengths() == [40, 40]  # evicted at every decode step too
    token = sequences[:, -1:]
    assert_next_logits_match_reference(model, cache, token)


def test_bad_parameters_say_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="n_future"):
        kvevict.make_policy("expected-attention", n_future=0)
    with pytest.raises(ValueError, match="eps"):
        kvevict.make_policy("expected-attention", eps=-1.0)
