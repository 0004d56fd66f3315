"""kvevict/signals.py: reading and writing the entries a pass appended, and log Z from a softmax."""

from __future__ import annotations

import math

import torch

from kvevict.signals import Signals, kept_after, new_entries, row_lengths, softmax_log_partition, write_new_entries


def test_the_last_columns_unless_each_row_says_where_its_own_lie() -> None:
    x = torch.arange(2 * 3 * 5, dtype=torch.float32).view(2, 3, 5)
    assert torch.equal(new_entries(x, 2), x[:, :, 3:])
    columns = torch.tensor([[2], [4]])  # row 0 ends at column 3, row 1 at 5
    assert torch.equal(new_entries(x, 1, columns), torch.stack([x[0, :, 2:3], x[1, :, 4:5]]))
    assert row_lengths(5, 2) == [5, 5]
    assert row_lengths(5, 2, columns) == [3, 5]


def test_a_rows_signals_are_its_part_of_each_per_row_tensor_and_stacking_puts_them_back() -> None:
    query, sums = torch.randn(3, 4, 2, 8), torch.randn(3, 2, 5)
    signals = Signals("prefill", 2, query, 0.5, column_sums=sums, output_projection=torch.ones(8, 8))
    rows = [signals.of_row(index) for index in range(3)]
    assert torch.equal(rows[1].query, query[1:2]) and torch.equal(rows[1].column_sums, sums[1:2])
    assert rows[1].last_query_attention is None and rows[1].output_projection is signals.output_projection
    assert (rows[2].phase, rows[2].num_new, rows[2].scaling) == ("prefill", 2, 0.5)
    again = Signals.stacked(rows)
    assert torch.equal(again.query, query) and torch.equal(again.column_sums, sums)


def test_writes_land_in_each_rows_columns_and_nowhere_else() -> None:
    x = torch.zeros(2, 3, 5, 4)
    value = torch.ones(2, 3, 1, 4)
    write_new_entries(x, value, torch.tensor([[2], [4]]))
    assert bool((x[0, :, 2] == 1).all()) and bool((x[1, :, 4] == 1).all())
    assert int(x.sum()) == 2 * 3 * 4
    last = torch.zeros(2, 3, 5)
    write_new_entries(last, torch.ones(2, 3, 2))
    assert bool((last[:, :, 3:] == 1).all()) and int(last.sum()) == 2 * 3 * 2


def test_log_z_from_the_softmax_is_the_log_sum_exp_of_the_row() -> None:
    """Logits [0, ln 3] and [5, 5, −∞]: log Z = ln(1 + 3) = ln 4, and 5 + ln 2 (a masked entry adds nothing)."""
    logits = torch.tensor([[0.0, math.log(3.0), float("-inf")], [5.0, 5.0, float("-inf")]])
    log_z = softmax_log_partition(logits.clone(), logits.softmax(dim=-1))
    torch.testing.assert_close(log_z, torch.tensor([math.log(4.0), 5.0 + math.log(2.0)]))


def test_kept_after_is_what_was_held_less_what_was_evicted() -> None:
    evicted = torch.tensor([[[True, False, False, True]]])
    valid = torch.tensor([[[False, True, True, True]]])  # a left-padded row: its first column is padding
    assert kept_after(evicted, None).tolist() == [[[False, True, True, False]]]
    assert kept_after(evicted, valid).tolist() == [[[False, True, True, False]]]
    assert kept_after(~evicted, valid).tolist() == [[[False, False, False, True]]]
