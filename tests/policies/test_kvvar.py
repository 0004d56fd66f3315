from types import SimpleNamespace

import pytest
import torch

import kvevict
from kvevict.policies.epikv import rolling_mean
from kvevict.policies.kvvar import SCORE, head_variance, lag_normalize, lagkv_chunk_scores
from tests.conftest import kept_indices, prompt, tiny_model

EPS = 1e-6


def test_lag_normalisation_uses_the_previous_chunk_and_streams() -> None:
    x = torch.tensor([[[[0.0, 0.0], [2.0, 4.0], [1.0, 2.0], [3.0, 0.0], [2.0, 2.0]]]])
    ranges: dict[str, torch.Tensor] = {}
    out = torch.cat([lag_normalize(x[:, :, :3], 0, 2, ranges), lag_normalize(x[:, :, 3:], 3, 2, ranges)], dim=2)
    expected = [
        [0.0, 0.0],  # chunk 0 has no predecessor: its own running range (0 wide)
        [2 / (2 + EPS), 4 / (4 + EPS)],
        [1 / (2 + EPS), 2 / (4 + EPS)],  # chunk 1: chunk 0's range [0, 2] x [0, 4]
        [3 / (2 + EPS), 0.0],
        [1 / (2 + EPS), 2 / (2 + EPS)],  # chunk 2: chunk 1's range [1, 3] x [0, 2]
    ]
    torch.testing.assert_close(out[0, 0], torch.tensor(expected))


def test_kv_variance_state_is_the_rolling_mean_of_each_new_vector() -> None:
    model = tiny_model()
    caches = {
        name: kvevict.EvictionCache(model, kvevict.make_policy(name, rolling=5), budget=10_000)
        for name in ("kv-key-var", "kv-val-var")
    }
    with torch.no_grad():
        for cache in caches.values():
            model(input_ids=prompt(20), past_key_values=cache)
            for step in range(8):
                model(input_ids=torch.tensor([[step + 3]]), past_key_values=cache)
    for name, cache in caches.items():
        for layer in cache.layers:
            vectors = layer.keys if name == "kv-key-var" else layer.values
            torch.testing.assert_close(layer.policy.scorer.state(layer)[SCORE], rolling_mean(head_variance(vectors), 5))


def test_lag_kv_decode_state_sums_the_normalised_variances() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("lag-kv", lag=4, rolling=3), budget=10_000)
    with torch.no_grad():
        model(input_ids=prompt(10), past_key_values=cache)
        for step in range(7):
            model(input_ids=torch.tensor([[step + 3]]), past_key_values=cache)
    layer = cache.layers[1]
    raw = sum(head_variance(lag_normalize(x, 0, 4, {})) for x in (layer.keys, layer.values))
    torch.testing.assert_close(layer.policy.scorer.state(layer)[SCORE], rolling_mean(raw, 3))


def test_lagkv_chunk_score_is_the_softmax_of_the_std_against_the_next_chunk() -> None:
    x = torch.tensor([[[[0.0, 1.0], [4.0, 0.0], [0.0, 0.0], [4.0, 2.0]]]])
    # next chunk's range [0, 4] x [0, 2]: [0, .5] and [1, 0]; std over 2 values = |a − b| / √2
    spread = torch.tensor([0.5 / 2**0.5, 1 / 2**0.5])
    torch.testing.assert_close(lagkv_chunk_scores(x, 2), spread.softmax(dim=-1)[None, None], atol=1e-5, rtol=0)


def test_lagkv_keeps_sinks_tail_and_an_even_share_of_every_chunk() -> None:
    keys = torch.randn(1, 2, 10, 4, generator=torch.Generator().manual_seed(0))
    values = torch.randn(1, 2, 10, 4, generator=torch.Generator().manual_seed(1))
    layer = SimpleNamespace(
        length=10,
        seen=10,
        keys=keys,
        values=values,
        positions=torch.arange(10).expand(1, 2, 10),
        valid=None,
        head_lengths=lambda: torch.tensor([[10, 10]]),
    )
    policy = kvevict.make_policy("lagkv", lag=3, sinks=1)  # chunks 1-3, 4-6 scored; 7-9 the tail
    score = lagkv_chunk_scores(keys[:, :, 1:10], 3) + lagkv_chunk_scores(values[:, :, 1:10], 3)
    best = score.reshape(1, 2, 2, 3).argmax(dim=-1)  # the top entry of each chunk, per head
    kept = kept_indices(policy.select(layer, None, 6))
    for head in range(2):
        expected = sorted([0, 1 + best[0, head, 0].item(), 4 + best[0, head, 1].item(), 7, 8, 9])
        assert kept[0][head] == expected
    assert kept_indices(policy.select(layer, None, 3)) == [
        [[0, 8, 9], [0, 8, 9]]
    ]  # tail over budget: most recent first


def test_lagkv_chunks_follow_positions_not_storage_slots() -> None:
    """After an eviction the cache refills slots, so storage order is not position order: the
    entries kept are those kept with the same entries stored in position order."""
    keys = torch.randn(1, 2, 13, 4, generator=torch.Generator().manual_seed(2))
    values = torch.randn(1, 2, 13, 4, generator=torch.Generator().manual_seed(3))
    policy = kvevict.make_policy("lagkv", lag=3, sinks=1)

    def layer(order: torch.Tensor, positions: torch.Tensor | None = None) -> SimpleNamespace:
        return SimpleNamespace(
            length=13,
            seen=13,
            keys=keys[:, :, order],
            values=values[:, :, order],
            positions=(order if positions is None else positions).expand(1, 2, 13),
            valid=None,
            head_lengths=lambda: torch.tensor([[13, 13]]),
        )

    in_order = torch.arange(13)
    moved = torch.tensor([12, 0, 7, 1, 2, 11, 3, 4, 5, 6, 8, 9, 10])  # later entries refilled earlier slots
    expected = policy.select(layer(in_order), None, 7)
    kept = policy.select(layer(moved), None, 7)
    assert torch.equal(kept, expected[..., moved])
    slots_as_positions = policy.select(layer(moved, positions=in_order), None, 7)  # what reading slots would keep
    assert not torch.equal(slots_as_positions, expected[..., moved])


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="lag-kv: parameter 'lag' expects an integer >= 1, got 0"):
        kvevict.make_policy("lag-kv", lag=0)
    with pytest.raises(ValueError, match="kv-key-var: parameter 'rolling' expects an integer >= 1, got 0"):
        kvevict.make_policy("kv-key-var", rolling=0)
    with pytest.raises(ValueError, match="kv-val-var: parameter 'regime' expects one of 'decode', got 'both'"):
        kvevict.make_policy("kv-val-var", regime="both")
