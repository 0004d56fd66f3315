import pytest
import torch

import kvevict
from kvevict.policies.simple import keydiff_scores, knorm_scores
from tests.conftest import greedy, keeps_what_it_writes, prompt, tiny_model


def test_knorm_score_is_minus_the_key_norm() -> None:
    keys = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]])[None, None]  # [1, 1, 3, 2]
    assert knorm_scores(keys).tolist() == [[[-5.0, -1.0, -2.0]]]


def test_keydiff_score_is_minus_the_cosine_to_the_mean_unit_key() -> None:
    # unit keys (1, 0), (0, 1), (1, 0) (the third is (2, 0) normalised): anchor (2/3, 1/3)
    keys = torch.tensor([[1.0, 0.0], [0.0, 3.0], [2.0, 0.0]])[None, None]
    norm = (4 / 9 + 1 / 9) ** 0.5
    expected = [-(2 / 3) / norm, -(1 / 3) / norm, -(2 / 3) / norm]
    assert torch.allclose(keydiff_scores(keys), torch.tensor([[expected]]))
    # an entry that is not real leaves the anchor: (1, 0) and (0, 1) alone give (1/2, 1/2)
    valid = torch.tensor([[[True, True, False]]])
    assert torch.allclose(keydiff_scores(keys, valid)[..., :2], torch.tensor([[[-(0.5**0.5), -(0.5**0.5)]]]))


def test_keydiff_evicts_while_decoding_by_default() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "keydiff", budget=40)
    greedy(model, prompt(96), cache, new_tokens=5)
    assert cache.layer_lengths() == [40, 40]


def test_keydiff_keeps_the_tokens_just_written_by_default() -> None:
    # an attention-free score would otherwise evict a token as soon as it is written
    assert keeps_what_it_writes(kvevict.make_policy("keydiff"))
    assert not keeps_what_it_writes(kvevict.make_policy("keydiff", window=0))


def test_knorm_keeps_the_low_norm_keys() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "knorm", budget=40)
    with torch.no_grad():
        model(input_ids=prompt(96), past_key_values=cache)
    full = kvevict.EvictionCache(model, "full")
    with torch.no_grad():
        model(input_ids=prompt(96), past_key_values=full)
    for layer, reference in zip(cache.layers, full.layers):
        expected = reference.keys.norm(dim=-1).topk(40, dim=-1, largest=False).indices.sort(dim=-1).values
        assert torch.equal(layer.positions.sort(dim=-1).values, expected)  # entries are not kept in order


def test_streamingllm_keeps_sinks_and_the_most_recent() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "streamingllm", budget=40)
    sequences, _ = greedy(model, prompt(96), cache, new_tokens=5)
    seen = sequences.shape[1] - 1
    expected = list(range(4)) + list(range(seen - 36, seen))
    for layer in cache.layers:
        assert sorted(layer.positions[0, 0].tolist()) == expected
        assert torch.equal(layer.positions[0, 0], layer.positions[0, 1])


def test_random_is_reproducible_and_seeded() -> None:
    model = tiny_model()

    def positions(seed: int) -> torch.Tensor:
        cache = kvevict.EvictionCache(model, kvevict.make_policy("random", seed=seed), budget=40)
        with torch.no_grad():
            model(input_ids=prompt(96), past_key_values=cache)
        return cache.layers[0].positions

    assert torch.equal(positions(0), positions(0))
    assert not torch.equal(positions(0), positions(1))


def test_full_never_evicts() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "full")
    greedy(model, prompt(96), cache, new_tokens=4)
    assert cache.layer_lengths() == [99, 99]


@pytest.mark.parametrize("regime", ["prefill", "decode", "both"])
def test_regime_decides_when_knorm_evicts(regime: str) -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("knorm", regime=regime), budget=40)
    greedy(model, prompt(96), cache, new_tokens=4)
    # prefill: compressed once then grows; decode: prompt kept whole, then cut at the first step
    expected = {"prefill": 43, "decode": 40, "both": 40}[regime]
    assert cache.layer_lengths() == [expected, expected]


def test_random_rows_in_lockstep_draw_what_each_draws_alone() -> None:
    """Rows of one length run in lockstep from the prompt on (under inference mode, as the
    benchmarks run), each drawing from its own generator state."""
    model = tiny_model()
    ids = torch.cat([prompt(60, seed=seed) for seed in range(3)])
    cache = kvevict.EvictionCache(model, "random", budget=24)
    with torch.inference_mode():
        for pass_ids in (ids, ids[:, -1:], ids[:, -1:]):
            model(input_ids=pass_ids, past_key_values=cache, use_cache=True)
    assert [view.rows for view in cache.eviction_layers[0].views()] == [slice(0, 3)]
    for row in range(3):
        alone = kvevict.EvictionCache(model, "random", budget=24)
        with torch.inference_mode():
            for pass_ids in (ids[row : row + 1], ids[row : row + 1, -1:], ids[row : row + 1, -1:]):
                model(input_ids=pass_ids, past_key_values=alone, use_cache=True)
        for layer, alone_layer in zip(cache.eviction_layers, alone.eviction_layers, strict=True):
            assert torch.equal(layer.positions[row].sort(dim=-1).values, alone_layer.positions[0].sort(dim=-1).values)
