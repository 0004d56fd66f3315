import math
from types import SimpleNamespace

import pytest
import torch

import kvevict
from kvevict.policies.rkv import QUERIES, rkv_importance, rkv_redundancy
from kvevict.signals import Signals
from tests.conftest import capture_passes, prompt, tiny_model


def softmax(xs: list[float]) -> list[float]:
    total = sum(math.exp(x) for x in xs)
    return [math.exp(x) / total for x in xs]


def test_redundancy_penalises_older_near_duplicates_and_spares_the_newest() -> None:
    # k0, k2, k3 point the same way (cos 1); k1 is orthogonal to all.
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [1.0, 0.0]])[None, None]
    # S (zero diagonal): S02 = S03 = S23 = 1. Row 0 zeroes S03 (newest duplicate 3), row 2
    # zeroes S23, row 3 zeroes S32 (its newest duplicate is 2), row 1 has none.
    # Column means over 4 rows: [(S20 + S30)/4, 0, S02/4, 0] = [.5, 0, .25, 0].
    expected = softmax([0.5, 0.0, 0.25, 0.0])
    torch.testing.assert_close(rkv_redundancy(keys), torch.tensor([[expected]]))


def test_redundancy_of_a_lone_pair_and_of_rows_without_near_duplicates() -> None:
    # A lone pair: each is the other's newest near-duplicate, both entries are zeroed.
    pair = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 0.0]])[None, None]
    torch.testing.assert_close(rkv_redundancy(pair), torch.full((1, 1, 3), 1 / 3))
    # cos .3 <= .5: no near-duplicate, nothing is zeroed (column means .15, .15)
    apart = torch.tensor([[1.0, 0.0], [0.3, math.sqrt(1 - 0.09)]])[None, None]
    torch.testing.assert_close(rkv_redundancy(apart), torch.full((1, 1, 2), 0.5))
    torch.testing.assert_close(rkv_redundancy(apart, threshold=0.2), torch.full((1, 1, 2), 0.5))  # both zeroed


def test_importance_takes_the_group_max_of_logits_then_softmax_then_query_mean() -> None:
    keys = torch.tensor([[1.0], [0.0], [-1.0]])[None, None]  # Hkv = 1, m = 3, d = 1
    queries = torch.tensor([[[2.0], [0.0]], [[-1.0], [1.0]]])[None]  # Hq = 2, r = 2
    # logits: head 0 [2 0 -2], [0 0 0]; head 1 [-1 0 1], [1 0 -1] → max [2 0 1], [1 0 0]
    first, second = softmax([2.0, 0.0, 1.0]), softmax([1.0, 0.0, 0.0])
    raw = [(a + b) / 2 for a, b in zip(first, second)]
    torch.testing.assert_close(rkv_importance(queries, keys, 1.0, kernel=1), torch.tensor([[raw]]))
    pooled = [max(raw[:2]), max(raw), max(raw[1:])]
    torch.testing.assert_close(rkv_importance(queries, keys, 1.0, kernel=3), torch.tensor([[pooled]]))
    torch.testing.assert_close(rkv_importance(queries, keys, 1.0), torch.tensor([[[max(raw)] * 3]]))  # kernel 7
    # the logit scale applies before the softmax
    halved = [(a + b) / 2 for a, b in zip(softmax([1.0, 0.0, 0.5]), softmax([0.5, 0.0, 0.0]))]
    torch.testing.assert_close(rkv_importance(queries, keys, 0.5, kernel=1), torch.tensor([[halved]]))


def test_select_keeps_the_window_and_evicts_the_most_redundant() -> None:
    # uniform importance (zero queries): the ranking is by redundancy alone
    keys = torch.tensor([[1.0, 0, 0], [0, 1, 0], [2, 0, 0], [1, 0, 0], [0, 0, 1]])[None, None]
    layer = SimpleNamespace(
        keys=keys,
        positions=torch.arange(5)[None, None],
        seen=5,
        length=5,
        memo={},
        valid=None,
        head_lengths=lambda: torch.tensor([[5]]),
    )
    signals = Signals(phase="decode", num_new=1, query=torch.zeros(1, 2, 1, 3), scaling=1.0)
    policy = kvevict.make_policy("rkv", window=1)
    policy.scorer.memo(layer)[QUERIES] = torch.zeros(1, 2, 1, 3)
    # column means over 5 rows: [.4, 0, .2, 0 | 0] → k0 (the oldest duplicate) goes
    scores = policy.scorer.score(layer, signals)[0, 0]
    r = softmax([0.4, 0.0, 0.2, 0.0, 0.0])
    torch.testing.assert_close(scores[:4], torch.tensor([0.1 / 4 - 0.9 * x for x in r[:4]]))
    assert scores[4] == float("inf")
    assert policy.select(layer, signals, 4).tolist() == [[[False, True, True, True, True]]]


def test_first_eviction_keeps_the_window_plus_the_top_scores() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "rkv", budget=40)  # W = 20
    twin = kvevict.EvictionCache(model, "rkv", budget=10_000, interval=20)
    passes = capture_passes(twin.layers[0])
    with torch.no_grad():
        for c in (cache, twin):
            model(input_ids=prompt(30), past_key_values=c)
            for step in range(1, 21):  # 50 entries at step 20: the first eviction
                model(input_ids=torch.tensor([[step + 2]]), past_key_values=c)
    scaling = passes[-1]["scaling"]
    queries = torch.cat([p["query"] for p in passes[-8:]], dim=2)
    assert torch.equal(twin.layers[0].policy.scorer.memo(twin.layers[0])[QUERIES], queries)
    for layer, full in zip(cache.layers, twin.layers):
        importance = rkv_importance(full.policy.scorer.memo(full)[QUERIES], full.keys[:, :, :42], scaling)
        redundancy = rkv_redundancy(full.keys)[..., :42]
        scores = 0.1 * importance - 0.9 * redundancy
        expected = scores.topk(32, dim=-1).indices.sort(dim=-1).values
        kept = full.positions.gather(2, expected)
        for head in range(2):  # the top 32 and the window of 8, in the slots they were given
            assert sorted(layer.positions[0, head].tolist()) == sorted([*kept[0, head].tolist(), *range(42, 50)])


def test_schedule_evicts_every_w_steps_and_lives_between_b_and_b_plus_w() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "rkv", budget=40)  # W = min(128, 40 // 2) = 20
    lengths, buffered = [], []
    with torch.no_grad():
        model(input_ids=prompt(30), past_key_values=cache)
        buffered.append(cache.layers[0].policy.scorer.memo(cache.layers[0])[QUERIES].shape[2])
        for step in range(1, 61):
            model(input_ids=torch.tensor([[step + 2]]), past_key_values=cache)
            lengths.append(cache.layer_lengths()[0])
            buffered.append(cache.layers[0].policy.scorer.memo(cache.layers[0])[QUERIES].shape[2])
    assert lengths[:20] == list(range(31, 50)) + [40]
    assert lengths[20:] == (list(range(41, 60)) + [40]) * 2
    assert cache.decode_peak() == 60
    assert buffered == [8] * 61  # the 30-token prompt fills the buffer; never more than 8


def test_query_buffer_holds_the_latest_queries_only() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "rkv", budget=40)
    passes = capture_passes(cache.layers[0])
    with torch.no_grad():
        model(input_ids=prompt(5), past_key_values=cache)
        assert torch.equal(
            cache.layers[0].policy.scorer.memo(cache.layers[0])[QUERIES], passes[0]["query"]
        )  # 5 < 8 queries so far
        for step in range(1, 12):
            model(input_ids=torch.tensor([[step + 2]]), past_key_values=cache)
            memo = cache.layers[0].policy.scorer.memo(cache.layers[0])[QUERIES]
            assert memo.shape[2] == min(8, 5 + step)
            latest = torch.cat([passes[0]["query"]] + [p["query"] for p in passes[1:]], dim=2)[:, :, -8:]
            assert torch.equal(memo, latest)


@pytest.mark.parametrize(("budget", "interval"), [(64, 32), (200, 100), (256, 128), (4096, 128)])
def test_interval_scales_with_small_budgets(budget: int, interval: int) -> None:
    policy = kvevict.make_policy("rkv")
    assert policy.default_interval(budget) == interval and policy.recent_window(budget) == 8
    assert kvevict.make_policy("rkv", interval=5).default_interval(budget) == 5


def test_both_regime_compresses_the_prompt_with_its_last_queries() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("rkv", regime="both"), budget=40)
    with torch.no_grad():
        model(input_ids=prompt(96), past_key_values=cache)
    assert cache.layer_lengths() == [40, 40]
    assert set(range(88, 96)) <= set(cache.layers[0].positions[0, 0].tolist())


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"window": 0}, "rkv: parameter 'window' expects an integer >= 1, got 0"),
        ({"interval": 0}, r"rkv: parameter 'interval' expects an integer >= 1, or None \(min\(128, budget // 2\)\)"),
        ({"kernel": 4}, "rkv: parameter 'kernel' expects an odd integer >= 1, got 4"),
        ({"mix_lambda": 1.5}, r"rkv: parameter 'mix_lambda' expects a number in \[0, 1\], got 1.5"),
        ({"threshold": 1.0}, r"rkv: parameter 'threshold' expects a number in \[-1, 1\), got 1.0"),
        ({"regime": "prefill"}, "rkv: parameter 'regime' expects one of 'decode', 'both', got 'prefill'"),
    ],
)
def test_bad_parameters_are_refused(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvevict.make_policy("rkv", **params)


def test_recency_and_pooling_follow_stored_positions_not_storage_order() -> None:
    """The cache refills evicted slots, so storage order is not position order: scoring entries
    stored out of order gives each entry the score it gets in position order."""
    # k0, k2, k3 are near-duplicates (a triple: who is newest matters), k1 stands alone
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [1.0, 0.1]])[None, None]
    queries = torch.tensor([[1.0, 0.5], [-0.5, 1.0]])[None, None]
    positions = torch.arange(4)[None, None]
    shuffled = torch.tensor([3, 0, 2, 1])  # entry 3 refilled the first slot
    moved_keys, moved_positions = keys[:, :, shuffled], positions[:, :, shuffled]
    expected = rkv_redundancy(keys)[..., shuffled]
    torch.testing.assert_close(rkv_redundancy(moved_keys, positions=moved_positions), expected)
    assert not torch.allclose(rkv_redundancy(moved_keys), expected)  # storage order as age is wrong
    expected = rkv_importance(queries, keys, 0.5, kernel=3)[..., shuffled]
    torch.testing.assert_close(rkv_importance(queries, moved_keys, 0.5, kernel=3, positions=moved_positions), expected)
    assert not torch.allclose(rkv_importance(queries, moved_keys, 0.5, kernel=3), expected)
