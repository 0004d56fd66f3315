"""StackedRows: the per-row data of rows in lockstep, read as one batch and written back row by row."""

import torch

from kvevict.moments import MomentStats
from kvevict.stacked import StackedRows


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
