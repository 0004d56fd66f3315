import json

import pytest
import torch
import torch.nn.functional as F

from kvevict.budgets import Budget, adakv_counts, headkv_capacities, load_head_profile, pooled_counts, pyramid_budgets

INF = float("inf")


def test_tokens_and_fraction() -> None:
    assert Budget(tokens=64).resolve(1000) == 64
    assert Budget(keep=0.25).resolve(1000) == 250
    assert Budget(keep=0.001).resolve(10) == 1
    assert Budget().resolve(1000) is None and not Budget().given


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tokens": 64, "keep": 0.5}, "either budget= .* or keep= .* not both"),
        ({"tokens": 0}, "positive integer"),
        ({"tokens": 2.5}, "positive integer"),
        ({"keep": 1.5}, r"fraction of the prompt in \(0, 1\]"),
        ({"keep": 0}, r"fraction of the prompt in \(0, 1\]"),
    ],
)
def test_bad_budgets_say_what_is_allowed(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Budget(**kwargs)


def test_adakv_splits_the_layer_budget_by_the_top_scores_of_all_heads() -> None:
    # budget 4, one protected entry per head: B' = 3 per head, 6 slots; safeguard 0.34 -> 1 each
    scores = torch.tensor([[[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, INF], [0.07, 0.06, 0.05, 0.04, 0.03, 0.02, 0.01, INF]]])
    assert adakv_counts(scores, 4, safeguard=0.0).tolist() == [[7, 1]]  # head 0 wins all 6 slots, +1 protected
    # safeguard: head 1 keeps its own top ⌊0.34·3⌋ = 1; the other 5 slots go to head 0
    assert adakv_counts(scores, 4, safeguard=0.34).tolist() == [[6, 2]]
    assert adakv_counts(scores, 4, safeguard=1.0).tolist() == [[4, 4]]  # a full safeguard is uniform


def test_adakv_budgets_sum_to_the_layers_total_and_skip_padding() -> None:
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(1, 3, 50, generator=generator)
    scores[..., -8:] = INF  # recent window
    scores[0, 2, :10] = -INF  # padding: head 2 holds 40 entries
    counts = adakv_counts(scores, 20, safeguard=0.2)
    assert int(counts.sum()) == 3 * 20
    assert bool((counts >= 8 + 2).all())  # window + ⌊0.2·12⌋
    assert int(counts[0, 2]) <= 40
    # fewer entries than the layer's budget: everything is kept
    assert adakv_counts(scores[..., :12], 20).tolist() == [[12, 12, 2]]


def test_a_global_pool_counts_each_head_by_what_it_would_keep_on_its_own() -> None:
    from kvevict.budgets import global_counts

    # a full layer of 8 entries and a "sliding" one that holds 3 (its window), budget 4, 1 protected each:
    # the pool is 4 + 3, not 2·4 (the short head's unused budget does not go to the other layer)
    full = torch.tensor([[[INF, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]]])
    sliding = torch.tensor([[[INF, 0.9, 0.8]]])
    counts = global_counts([full, sliding], 4, safeguard=0.0)
    assert [c.tolist() for c in counts] == [[[4]], [[3]]]  # .9, .8 and .7, .6, .5: 5 free slots
    low = torch.tensor([[[INF, 0.01, 0.02]]])  # the short head's entries lose: the full layer takes its slots
    assert [c.tolist() for c in global_counts([full, low], 4, safeguard=0.0)] == [[[6]], [[1]]]


@pytest.mark.parametrize(
    ("budget", "window", "length", "layers", "expected"),
    [
        # B' = 32: min = 1, max = 63, step = ⌊62/3⌋ = 20
        (64, 32, 1000, 4, [95, 75, 55, 35]),
        # max = 2·96 − 4 = 188 >= 150 − 32 = 118: max = 118, min = 192 − 118 = 74, step = ⌊44/2⌋ = 22
        (128, 32, 150, 3, [150, 128, 106]),
    ],
)
def test_pyramid_schedule_follows_the_formula(budget, window, length, layers, expected) -> None:
    assert pyramid_budgets(budget, window, length, layers) == expected


def test_headkv_capacities_follow_the_formula() -> None:
    importance = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # s = .1 .2 .3 .4
    # ⌊100/1.01⌋ = 99: cap = round(s·99·4 + 1) = round(40.6, 80.2, 119.8, 159.4)
    assert headkv_capacities(importance, 100).tolist() == [[41, 80], [120, 159]]


def test_head_profile_is_the_group_mean_of_each_query_heads_mean(tmp_path) -> None:
    heads = {f"{layer}-{head}": [float(layer * 4 + head), 1.0] for layer in range(2) for head in range(4)}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"model": {}, "heads": heads}))
    importance = load_head_profile(path, num_layers=2, num_query_heads=4, num_kv_heads=2)
    # query head means: (x + 1)/2 for x = 0..7; KV head = mean of 2 query heads
    assert importance.tolist() == [[0.75, 1.75], [2.75, 3.75]]
    with pytest.raises(ValueError, match="does not cover this model"):
        load_head_profile(heads, num_layers=3, num_query_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="kvevict analyze heads"):
        load_head_profile(tmp_path / "missing.json", 2, 4, 2)


def test_a_chunked_pool_counts_each_head_by_its_reach_and_caps_the_longest() -> None:
    from kvevict.budgets import global_counts

    # after an earlier chunk the first head holds 3 entries, the second 8; each has seen 8 tokens
    short = torch.tensor([[[INF, 0.05, 0.04]]])
    long = torch.tensor([[[INF, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]]])
    # held entries alone would give a pool of 3 + 4; each head's reach (8 tokens seen) gives 4 + 4
    assert [c.tolist() for c in global_counts([short, long], 4, safeguard=0.0)] == [[[1]], [[6]]]
    assert [c.tolist() for c in global_counts([short, long], 4, safeguard=0.0, reach=[8, 8])] == [[[1]], [[7]]]
    # a cap of 5 entries (protected included): the long head keeps its top 5, the rest of the pool goes to the
    # short head's next best, however low
    capped = global_counts([short, long], 4, safeguard=0.0, reach=[8, 8], cap=5)
    assert [c.tolist() for c in capped] == [[[3]], [[5]]]


@pytest.mark.parametrize("safeguard", [0.0, 0.2])
def test_layers_pooled_as_they_are_count_as_every_layer_padded_to_the_widest(safeguard: float) -> None:
    """``pooled_counts`` ranks each layer padded to its own longest head only: the same counts as
    AdaKV over every layer's heads padded to the widest (the real entries in the same order, so the
    same ties), protected entries (+inf) and padding (-inf) included."""
    generator = torch.Generator().manual_seed(0)
    layers = []
    for width in (7, 19, 12):
        scores = torch.randn(2, 3, width, generator=generator).round(decimals=1)  # ties across layers
        scores[..., :2] = float("inf")
        scores[torch.rand(2, 3, width, generator=generator) < 0.3] = float("-inf")
        layers.append(scores)
    budgets = [torch.tensor([[5, 4, 6], [3, 8, 2]]), 6, torch.tensor([[1, 9, 4], [7, 5, 5]])]
    padded = torch.cat([F.pad(scores, (0, 19 - scores.shape[-1]), value=float("-inf")) for scores in layers], dim=1)
    wide = torch.cat([torch.as_tensor(b).expand(2, 3) for b in budgets], dim=1)
    expected = adakv_counts(padded, wide, safeguard).split(3, dim=1)
    for counts, want in zip(pooled_counts(layers, budgets, safeguard), expected, strict=True):
        assert torch.equal(counts, want)
