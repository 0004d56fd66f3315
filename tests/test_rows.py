"""Rows of a batch: counters kept once per sequence, read by every layer's view."""

import torch

import kvevict
from kvevict.batching import left_padded
from kvevict.generation import prefill
from kvevict.moments import MomentStats
from kvevict.rows import StackedRows
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


def test_rows_read_back_what_a_batch_wrote_without_a_copy() -> None:
    """Split a batch's values into rows and stack them again: the same tensor (the parts are
    views of it) and the same dataclass object (a cache on it lasts); once a row holds a value
    of its own, the rows are stacked afresh, with the same values either way."""
    stats, sums = MomentStats.zeros(3, 2, 4, 4), torch.arange(6.0).reshape(3, 2).clone()
    rows = [{} for _ in range(3)]
    stacked = StackedRows(rows)
    stacked["stats"], stacked["sums"] = stats, sums
    assert stacked["stats"] is stats and stacked["sums"] is sums
    first_two = StackedRows(rows[:2])["stats"]  # some of the rows only: their own, not the batch's
    assert first_two is not stats and first_two.count.shape == (2, 2)
    rows[1]["sums"] = rows[1]["sums"] + 1  # a row's own value now
    rows[2]["stats"] = MomentStats.zeros(1, 2, 4, 4)
    again = stacked["stats"]
    assert again is not stats and torch.equal(again.count, stats.count) and torch.equal(again.centered, stats.centered)
    assert torch.equal(stacked["sums"], torch.tensor([[0.0, 1.0], [3.0, 4.0], [4.0, 5.0]]))


def test_writing_back_the_value_read_keeps_the_rows_views_of_it() -> None:
    """A stage that reads the batch's value, updates it in place and writes it back (MomentKV's
    statistics at a decode step) leaves each row's part a view of it: the rows see the update
    and nothing is split again; a new value is split into the rows as before."""
    rows = [{} for _ in range(3)]
    stacked = StackedRows(rows)
    stacked["stats"], stacked["sums"] = MomentStats.zeros(3, 2, 4, 4), torch.zeros(3, 2)
    parts, sum_parts = [row["stats"] for row in rows], [row["sums"] for row in rows]
    stats, sums = stacked["stats"], stacked["sums"]
    stats.count.add_(1)
    sums.add_(2)
    stacked["stats"], stacked["sums"] = stats, sums
    assert all(row["stats"] is part for row, part in zip(rows, parts))
    assert all(row["sums"] is part for row, part in zip(rows, sum_parts))
    assert all(torch.equal(row["stats"].count, torch.ones(1, 2)) for row in rows)
    assert all(torch.equal(row["sums"], torch.full((1, 2), 2.0)) for row in rows)
    stacked["sums"] = sums + 1  # a new value: split into the rows
    assert all(
        torch.equal(row["sums"], torch.full((1, 2), 3.0)) and row["sums"] is not part
        for row, part in zip(rows, sum_parts)
    )
