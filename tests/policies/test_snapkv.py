import torch

import kvevict
from kvevict.policies.snapkv import snapkv_scores
from kvevict.signals import attention_rows
from tests.conftest import capture_passes, in_position_order, prompt, tiny_model

INF = float("inf")
# [B=1, Hq=2, w=2, n=6]: two query heads sharing one KV head
WINDOW = torch.tensor(
    [
        [[0.1, 0.2, 0.3, 0.1, 0.3, 0.0], [0.2, 0.1, 0.1, 0.2, 0.2, 0.2]],
        [[0.4, 0.0, 0.0, 0.2, 0.4, 0.0], [0.0, 0.2, 0.0, 0.0, 0.4, 0.4]],
    ]
)[None]


def test_snapkv_without_pooling_averages_window_votes_then_heads() -> None:
    # head 0 votes [.15 .15 .2 .15], head 1 [.2 .1 0 .1] → GQA mean [.175 .125 .1 .125]
    scores = snapkv_scores(WINDOW, num_kv_heads=1, kernel=1)
    torch.testing.assert_close(scores, torch.tensor([[[0.175, 0.125, 0.1, 0.125, INF, INF]]]))


def test_snapkv_max_pools_votes_before_the_gqa_mean() -> None:
    # max-pool k=3: head 0 [.15 .2 .2 .2], head 1 [.2 .2 .1 .1] → mean [.175 .2 .15 .15]
    scores = snapkv_scores(WINDOW, num_kv_heads=1, kernel=3, pool="max")
    torch.testing.assert_close(scores, torch.tensor([[[0.175, 0.2, 0.15, 0.15, INF, INF]]]))


def test_snapkv_avg_pool_counts_padding() -> None:
    # avg-pool k=3 (zero padding counted): head 0 [.1 .5/3 .5/3 .35/3], head 1 [.1 .1 .2/3 .1/3]
    scores = snapkv_scores(WINDOW, num_kv_heads=1, kernel=3, pool="avg")
    expected = torch.tensor([[[0.1, (0.5 / 3 + 0.1) / 2, (0.5 / 3 + 0.2 / 3) / 2, (0.35 / 3 + 0.1 / 3) / 2, INF, INF]]])
    torch.testing.assert_close(scores, expected)


def test_snapkv_compresses_the_prompt_by_window_votes_and_keeps_the_window() -> None:
    model = tiny_model()
    ids = prompt(96)
    cache = kvevict.EvictionCache(model, "snapkv", budget=48)
    passes = capture_passes(cache.layers[0])
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    layer0, captured = cache.layers[0], passes[0]
    rows = attention_rows(captured["query"][:, :, -32:], captured["keys"], captured["scaling"])
    scores = snapkv_scores(rows, num_kv_heads=2)
    # max pooling makes ties: they go to the earlier entry
    expected = scores.argsort(dim=-1, descending=True, stable=True)[..., :48].sort(dim=-1).values
    assert torch.equal(in_position_order(layer0), expected)
    assert set(range(64, 96)) <= set(layer0.positions[0, 0].tolist())
    # prefill only: decoding grows the cache again
    with torch.no_grad():
        model(input_ids=torch.tensor([[7]]), past_key_values=cache)
    assert cache.layer_lengths() == [49, 49]
