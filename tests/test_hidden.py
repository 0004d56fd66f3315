import copy
import gc
import itertools

import pytest
import torch
from transformers import DynamicCache

import kvevict
from kvevict.hidden import HiddenStateRecorder, decoder_layers, hidden_changes
from tests.conftest import prompt, tiny_model


def test_changes_are_the_l2_norm_of_consecutive_differences() -> None:
    hidden = torch.tensor([[[0.0, 0.0], [3.0, 4.0], [3.0, 5.0]]])
    assert hidden_changes(hidden).tolist() == [[0.0, 5.0, 1.0]]  # the first token has no predecessor
    assert hidden_changes(hidden[:, 1:], previous=hidden[:, 0]).tolist() == [[5.0, 1.0]]


def hooks(model) -> list[int]:
    return [len(layer._forward_hooks) for layer in decoder_layers(model)]


def test_hooks_only_the_requested_layers_and_removes_them() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("epikv", layers=(1, 1)), budget=64)
    assert hooks(model) == [0, 1]
    cache.close()
    assert hooks(model) == [0, 0] and not cache.hidden.active
    with kvevict.EvictionCache(model, kvevict.make_policy("band-adaptive", bands=((0,), (1,))), budget=64) as cache:
        assert hooks(model) == [1, 1]
    assert hooks(model) == [0, 0]
    assert kvevict.EvictionCache(model, "h2o", budget=64).hidden is None  # attention policies hook nothing
    assert hooks(model) == [0, 0]


def test_hooks_go_away_with_the_cache() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "epikv", budget=64)
    with torch.no_grad():
        model(input_ids=prompt(10), past_key_values=cache)
    assert sum(hooks(model)) == 1  # 2 layers: A and B both scale to layer 1
    del cache
    gc.collect()
    assert hooks(model) == [0, 0]


def test_changes_match_output_hidden_states_and_other_caches_are_ignored() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("band-adaptive", bands=((0,), (1,))), budget=10_000)
    ids = prompt(30)
    with torch.no_grad():
        model(input_ids=ids[:, :20], past_key_values=cache)
        model(input_ids=ids[:, :20], past_key_values=DynamicCache())  # not this cache: not recorded
        for i in range(20, 30):
            model(input_ids=ids[:, i : i + 1], past_key_values=cache)
        full = model(input_ids=ids, output_hidden_states=True)
    recorder = cache.hidden
    # hidden_states[l + 1] is the output of layer l (the last one after the final norm)
    torch.testing.assert_close(recorder.changes[0], hidden_changes(full.hidden_states[1]), rtol=1e-4, atol=1e-5)
    assert recorder.changes[1].shape == (1, 30) and recorder.scored == 30


def test_token_is_scored_after_its_own_pass_and_scores_are_frozen() -> None:
    """Eviction inside layer i during the pass of token t sees t unscored (+inf); scores of
    earlier tokens never change and equal the scorer over the whole series."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("epikv", layers=(0, 1), rolling=4), budget=24)
    seen_scored: list[tuple[int, int]] = []
    for layer in cache.layers:
        original = layer.after_attention

        def spy(query, scaling, module=None, row=None, layer=layer, original=original):
            seen_scored.append((layer.seen, cache.hidden.scored))
            assert torch.isinf(cache.hidden.lookup(torch.tensor([[[layer.seen - 1]]]))).all()
            original(query, scaling, module, row)

        layer.after_attention = spy
    snapshots = []
    with torch.no_grad():
        model(input_ids=prompt(20), past_key_values=cache)
        for step in range(12):
            model(input_ids=torch.tensor([[step + 3]]), past_key_values=cache)
            snapshots.append(cache.hidden.scores.clone())
    assert all(scored == seen - (20 if seen == 20 else 1) for seen, scored in seen_scored)
    for before, after in itertools.pairwise(snapshots):
        assert torch.equal(after[:, : before.shape[1]], before)
    recorder = cache.hidden
    expected = cache.policy.hidden_scores(recorder.changes)
    torch.testing.assert_close(recorder.scores, expected, rtol=0, atol=1e-5)
    assert cache.layer_lengths() == [24, 24]


def test_bad_layers_and_unsupported_models_are_refused() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match=r"hidden-state layers must be decoder layer indices in 0..1, got \[5\]"):
        HiddenStateRecorder(model, [5], lambda changes: changes[5])
    with pytest.raises(TypeError, match="cannot find the decoder layers of Linear"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_a_deep_copy_of_the_cache_records_its_own_passes() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("epikv", layers=(0, 1)), budget=64)
    with torch.no_grad():
        model(input_ids=prompt(10), past_key_values=cache)
        twin = copy.deepcopy(cache)
        assert hooks(model) == [2, 2]
        model(input_ids=torch.tensor([[5]]), past_key_values=twin)
    assert twin.hidden.scored == 11 and cache.hidden.scored == 10
    assert torch.equal(twin.hidden.scores[:, :10], cache.hidden.scores)
    del twin
    gc.collect()
    assert hooks(model) == [1, 1]


def test_a_lookup_told_where_positions_end_equals_the_clamped_one() -> None:
    """Positions past the scored ones read ``+inf`` whether the table is clamped or, told that
    every position lies below ``end``, indexed as is; one row reads what the whole batch does."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("epikv", layers=(0, 1), rolling=4), budget=10_000)
    with torch.no_grad():
        model(input_ids=prompt(20).repeat(2, 1), past_key_values=cache)
    recorder = cache.hidden
    positions = torch.arange(21).expand(2, 2, 21)  # position 20: not scored
    clamped = recorder.lookup(positions)
    assert torch.isinf(clamped[..., 20]).all() and torch.isfinite(clamped[..., 1:20]).all()
    assert torch.equal(recorder.lookup(positions, end=21), clamped)
    assert torch.equal(recorder.lookup(positions[:1], row=1, end=21), clamped[1:])
    assert torch.equal(recorder.lookup(positions[:1] + 500, row=0, end=None), torch.full((1, 2, 21), float("inf")))
