"""Rows of a batch: counters kept once per sequence, read by every layer's view."""

import torch

import kvevict
from kvevict.batching import left_padded
from kvevict.generation import prefill
from tests.conftest import greedy_batch, prompt, tiny_model


def test_a_rows_counters_live_once_for_every_layer() -> None:
    """Each row's seen, prompt length and new tokens are one object that every layer reads:
    after a left-padded prefill and decode steps, and after a row is spliced in or removed."""
    model = tiny_model("qwen2_hybrid")  # a sliding layer and a full one
    ids, mask = left_padded([prompt(30), prompt(22, seed=1)])
    cache = kvevict.EvictionCache(model, "h2o", budget=16)
    greedy_batch(model, ids, mask, cache, 5)
    for layer in cache.eviction_layers:
        assert [row.sequence for row in layer.rows] == cache.sequences
        assert all(row.sequence is sequence for row, sequence in zip(layer.rows, cache.sequences))
    assert [(s.seen, s.prompt_length) for s in cache.sequences] == [(34, 30), (26, 22)]
    newcomer = kvevict.EvictionCache(model, "h2o", budget=16)
    prefill(model, prompt(12, seed=2), newcomer)
    cache.splice(2, newcomer)
    cache.remove_rows([0])
    assert [(s.seen, s.prompt_length) for s in cache.sequences] == [(26, 22), (12, 12)]
    assert cache.sequences[1] is not newcomer.sequences[0]  # a copy: the source goes on alone
    for layer in cache.eviction_layers:
        assert all(row.sequence is sequence for row, sequence in zip(layer.rows, cache.sequences))
    with torch.no_grad():
        model(input_ids=torch.tensor([[3], [4]]), position_ids=cache.next_positions(), past_key_values=cache)
    assert [s.seen for s in cache.sequences] == [27, 13]
