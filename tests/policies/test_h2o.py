import pytest
import torch

import kvevict
from kvevict.policies.h2o import ACCUMULATED, h2o_accumulate, observed_attention_scores
from tests.conftest import greedy, prompt, tiny_model


def test_h2o_accumulates_group_reduced_column_sums() -> None:
    accumulated = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])  # [1, Hkv=2, 3]
    sums = torch.tensor([[[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [0.0, 0.0, 6.0], [2.0, 2.0, 2.0]]])  # [1, Hq=4, 3]
    assert h2o_accumulate(accumulated, sums, "mean").tolist() == [[[3.0, 2.0, 2.0], [1.0, 1.0, 5.0]]]
    assert h2o_accumulate(accumulated, sums, "max").tolist() == [[[4.0, 2.0, 3.0], [2.0, 2.0, 7.0]]]
    assert h2o_accumulate(accumulated, sums, "mean", in_place=True) is accumulated  # the cache's storage
    assert accumulated.tolist() == [[[3.0, 2.0, 2.0], [1.0, 1.0, 5.0]]]


def test_h2o_scores_equal_the_attention_matrix_column_sums() -> None:
    """Chunked prompt column sums + decode rows == columns of the full eager attention."""
    model = tiny_model(attn="eager")
    ids = prompt(300)
    cache = kvevict.EvictionCache(model, "h2o", budget=1000)
    with torch.no_grad():
        model(input_ids=ids[:, :296], past_key_values=cache)
        for t in range(296, 300):
            model(input_ids=ids[:, t : t + 1], past_key_values=cache)
        attentions = model(input_ids=ids, output_attentions=True).attentions
    for layer, weights in zip(cache.layers, attentions):
        expected = weights.sum(dim=2).reshape(1, 2, 2, 300).mean(dim=2)  # GQA mean
        torch.testing.assert_close(layer.policy.scorer.state(layer)[ACCUMULATED], expected, rtol=1e-4, atol=1e-4)


def test_h2o_keeps_sinks_recent_window_and_heaviest() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "h2o", budget=40)  # window = min(128, 40 // 4) = 10
    reference = kvevict.EvictionCache(model, "h2o", budget=1000)
    with torch.no_grad():
        model(input_ids=prompt(96), past_key_values=cache)
        model(input_ids=prompt(96), past_key_values=reference)
    for layer, full in zip(cache.layers, reference.layers):
        scores = full.policy.scorer.state(full)[ACCUMULATED].clone()
        scores[..., :4] = scores[..., 86:] = float("inf")
        expected = scores.topk(40, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(layer.positions, expected)
        torch.testing.assert_close(
            layer.policy.scorer.state(layer)[ACCUMULATED],
            full.policy.scorer.state(full)[ACCUMULATED].gather(2, expected),
        )


@pytest.mark.parametrize(("window", "budget", "recent"), [(None, 40, 10), (None, 1024, 128), (20, 40, 20)])
def test_h2o_recent_window_default(window: int | None, budget: int, recent: int) -> None:
    assert kvevict.make_policy("h2o", window=window).recent_window(budget) == recent


def test_h2o_prefill_regime_evicts_the_prompt_then_keeps_every_decoded_token() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "h2o[regime=prefill]", budget=16)
    greedy(model, prompt(40), cache, new_tokens=5)
    assert cache.layer_lengths() == [16 + 4] * 2  # the prompt to the budget, then every decoded entry


def test_observed_attention_is_the_mean_attention_from_the_queries_that_saw_each_entry() -> None:
    accumulated = torch.tensor([[[3.0, 1.0, 0.5]]])  # attention received, positions 0, 1, 2 of a 3-token prompt
    positions = torch.tensor([[[0, 1, 2]]])
    assert observed_attention_scores(accumulated, positions, 3).tolist() == [[[1.0, 0.5, 0.5]]]


def test_observed_attention_keeps_the_entries_with_the_most_mean_attention() -> None:
    """Against the eager attention matrix: column sums over every prompt query, divided by the
    queries below each key, GQA mean; the prompt compressed once, nothing evicted while decoding."""
    model = tiny_model(attn="eager")
    ids = prompt(120)
    cache = kvevict.EvictionCache(model, "observed-attention", budget=40)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        attentions = model(input_ids=ids, output_attentions=True).attentions
    seen_by = torch.arange(120, 0, -1).float()
    for layer, weights in zip(cache.layers, attentions):
        scores = (weights.sum(dim=2) / seen_by).reshape(1, 2, 2, 120).mean(dim=2)
        expected = scores.topk(40, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(layer.positions.sort(dim=-1).values, expected)
    generating = kvevict.EvictionCache(model, "observed-attention", budget=40)
    greedy(model, ids, generating, new_tokens=3)  # the prompt, then two more tokens fed
    assert generating.layer_lengths() == [42, 42]
