import json

import pytest
import torch

import kvevict
from kvevict.calibration import qfilters, record_queries, save_qfilters
from kvevict.policies.allocation import bundled_profile
from kvevict.policies.qfilters import FOLDER, qfilter_directions, qfilter_scores
from tests.conftest import keeps_what_it_writes, prompt, tiny_model, tiny_qfilters


def test_the_filter_is_the_queries_principal_direction_oriented_towards_them() -> None:
    # queries mostly along -x: the direction is x's axis, turned so the queries project positively
    queries = torch.tensor([[-3.0, 0.1], [-2.0, -0.1], [-4.0, 0.0], [-1.0, 0.05]])
    direction = qfilter_directions(queries)
    assert torch.allclose(direction, torch.tensor([-1.0, 0.0]), atol=1e-2)
    assert float((queries @ direction).mean()) > 0


def test_a_key_s_score_is_its_projection_on_its_head_s_filter() -> None:
    keys = torch.tensor([[[1.0, 2.0], [3.0, -1.0]], [[0.0, 1.0], [2.0, 2.0]]])[None]  # [1, 2 heads, 2, 2]
    filters = torch.tensor([[1.0, 0.0], [0.0, -1.0]])
    assert qfilter_scores(keys, filters).tolist() == [[[1.0, 3.0], [-1.0, -2.0]]]


def test_the_cache_keeps_the_keys_that_project_highest() -> None:
    model = tiny_model()
    filters = tiny_qfilters()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("qfilters", filters=filters, sinks=0, window=0), budget=40)
    full = kvevict.EvictionCache(model, "full")
    with torch.no_grad():
        for c in (cache, full):
            model(input_ids=prompt(96), past_key_values=c)
    for index, (layer, reference) in enumerate(zip(cache.layers, full.layers)):
        expected = qfilter_scores(reference.keys, filters[index]).topk(40, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(layer.positions.sort(dim=-1).values, expected)


def test_decoding_keeps_the_tokens_just_written_by_default() -> None:
    # no query is read, so without the default recent window a token that projects low would go as
    # soon as it is written (on needle prompts the answer then repeats one digit)
    filters = tiny_qfilters()
    assert keeps_what_it_writes(kvevict.make_policy("qfilters", filters=filters))
    assert not keeps_what_it_writes(kvevict.make_policy("qfilters", filters=filters, window=0))


def test_a_model_without_filters_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="qfilters has no filters for this model") as refused:
        kvevict.EvictionCache(tiny_model(), "qfilters", budget=40)
    assert "\n" not in str(refused.value) and "calibrate-qfilters" in str(refused.value)
    wrong = torch.ones(2, 3, 16)
    with pytest.raises(ValueError, match=r"are \(2, 3, 16\) .* the model needs \(2, 2, 16\)"):
        kvevict.EvictionCache(tiny_model(), kvevict.make_policy("qfilters", filters=wrong), budget=40)


def test_calibration_reads_every_layer_s_queries_and_writes_filters_the_policy_loads(tmp_path) -> None:
    model = tiny_model()
    contexts = [prompt(64, seed=1), prompt(48, seed=2)]
    recorded = record_queries(model, contexts)
    assert sorted(recorded) == [0, 1] and recorded[0].shape == (4, 112, 16)
    filters = qfilters(model, contexts)
    assert filters.shape == (2, 2, 16)
    assert torch.allclose(filters[1, 0], qfilter_directions(recorded[1][:2].reshape(-1, 16)))
    assert model.config._attn_implementation == "sdpa"  # the model is left as it was
    path = tmp_path / "filters.json"
    save_qfilters(path, model.config, filters, "two tiny contexts")
    assert json.loads(path.read_text())["source"] == "two tiny contexts"
    cache = kvevict.EvictionCache(model, f"qfilters[filters={path}]", budget=40)
    with torch.no_grad():
        model(input_ids=prompt(96), past_key_values=cache)
    assert cache.layer_lengths() == [40, 40]


@pytest.mark.slow
def test_smollm2_s_shipped_filters_rank_keys_as_attention_does(smollm2) -> None:
    """On text the calibration never saw (the essays' end), each head's Q-Filter scores rank keys
    as the mean attention they receive does: measured Spearman 0.72 on average over the 90 heads,
    0.29 at the least; ranked the wrong way round it would be negative."""
    from kvevict.bench.haystack import essays

    model, tokenizer = smollm2
    assert bundled_profile(model.config, FOLDER) is not None
    policy = kvevict.make_policy("qfilters")
    policy.bind(model.config)
    ids = torch.tensor([tokenizer.encode(essays()[-40000:], add_special_tokens=False)[:512]])
    cache = kvevict.EvictionCache(model, "full")
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(input_ids=ids, output_attentions=True, past_key_values=cache).attentions
    finally:
        model.set_attn_implementation(previous)
    correlations = []
    for index, weights in enumerate(attentions):
        received = (weights[0].sum(1) / torch.arange(512, 0, -1)).view(3, 3, 512).mean(1)[:, 8:]
        scores = qfilter_scores(cache.layers[index].keys[:, :, 8:], policy.scorer._filters[index])[0]
        for head in range(3):
            ranks = torch.stack([scores[head], received[head]]).argsort(-1).argsort(-1).float()
            correlations.append(float(torch.corrcoef(ranks)[0, 1]))
    assert sum(correlations) / len(correlations) > 0.6 and min(correlations) > 0
