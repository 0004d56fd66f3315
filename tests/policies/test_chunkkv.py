import pytest
import torch

import kvevict
from kvevict.policies.chunkkv import chunk_keep, chunk_ranks
from tests.conftest import prompt, tiny_model


def test_chunks_are_ranked_by_their_score_summed_over_heads() -> None:
    # chunks of 2 over positions 0..5; two heads: chunk sums 1+2+0+1=4, 5+0+1+0=6, 0+0+0+3=3
    scores = torch.tensor([[[1.0, 2.0, 5.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0, 0.0, 3.0]]])
    positions = torch.arange(6).expand(1, 2, 6)
    assert chunk_ranks(scores, positions, 2, None).tolist() == [[1, 0, 2]]
    protected = scores.clone()
    protected[0, 1, 5] = float("inf")  # a protected entry puts its chunk first
    assert chunk_ranks(protected, positions, 2, None).tolist() == [[2, 1, 0]]


def test_whole_chunks_are_kept_then_the_best_entries_of_the_next() -> None:
    scores = torch.tensor([[[1.0, 2.0, 5.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0, 0.0, 3.0]]])
    positions = torch.tensor([[[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]])
    ranks = torch.tensor([[1, 0, 2]])  # chunk 1 (positions 2, 3), then chunk 0, then chunk 2
    keep = chunk_keep(scores, positions // 2, ranks, torch.tensor([[3, 3]]), None)
    # both heads keep chunk 1 whole, then chunk 0's better entry: head 0 position 1, head 1 position 1
    assert keep.tolist() == [[[False, True, True, True, False, False], [False, True, True, True, False, False]]]


def test_every_head_keeps_the_same_whole_chunks() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "chunk+snapkv[window=8]", budget=40)
    with torch.no_grad():
        model(input_ids=prompt(120), past_key_values=cache)
    for layer in cache.layers:
        kept = layer.positions.sort(dim=-1).values
        assert torch.equal(kept[0, 0], kept[0, 1])
        chunks = (kept[0, 0] // 10).bincount(minlength=12)
        assert sorted(chunks.tolist())[-4:] == [10, 10, 10, 10]  # 40 entries: four whole chunks
        assert set(range(112, 120)) <= set(kept[0, 0].tolist())  # the window's chunks come first


def test_layers_reuse_the_first_layer_s_chunks() -> None:
    model = tiny_model()
    alone = kvevict.EvictionCache(model, "chunk+snapkv[window=8]", budget=40)
    reused = kvevict.EvictionCache(model, "chunk+snapkv[window=8,chunk.reuse=2]", budget=40)
    with torch.no_grad():
        for cache in (alone, reused):
            model(input_ids=prompt(120), past_key_values=cache)
    first, second = (layer.positions.sort(dim=-1).values for layer in reused.layers)
    assert torch.equal(first, second)  # layer 1 kept layer 0's chunks
    assert torch.equal(first, alone.layers[0].positions.sort(dim=-1).values)
    assert not torch.equal(second, alone.layers[1].positions.sort(dim=-1).values)  # its own choice differs


def test_a_budget_under_one_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk: at least 10"):
        kvevict.EvictionCache(tiny_model(), "chunk+snapkv[window=4]", budget=8)
