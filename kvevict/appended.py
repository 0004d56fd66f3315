"""Where the entries a pass appended lie in a view's ``[B, H, n, ...]`` tensors.

Owns: reading and writing them. Usually they are each row's last ``num_new`` columns; in a
view of rows in lockstep whose heads keep different numbers of entries (head-wise budgets),
a row whose longest head is shorter than another row's ends before column ``n``, so the view
gives each row's columns of them (``EntryView.new_columns`` ``[B, num_new]``).

Must not touch: anything else (a leaf module: pure functions of tensors).
"""

from __future__ import annotations

import torch


def _index(columns: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``columns`` ``[B, m]`` as a gather index into ``x`` ``[B, H, n, ...]`` along dim 2."""
    b, m = columns.shape
    index = columns.view(b, 1, m, *([1] * (x.dim() - 3)))
    return index.expand(b, x.shape[1], m, *x.shape[3:])


def new_entries(x: torch.Tensor, num_new: int, columns: torch.Tensor | None = None) -> torch.Tensor:
    """The appended entries of ``x`` ``[B, H, n, ...]`` → ``[B, H, num_new, ...]``: its last
    ``num_new`` columns, or each row's ``columns`` ``[B, num_new]``."""
    if columns is None:
        return x[:, :, x.shape[2] - num_new :]
    return x.gather(2, _index(columns, x))


def write_new_entries(x: torch.Tensor, value: torch.Tensor, columns: torch.Tensor | None = None) -> None:
    """Write ``value`` ``[B, H, num_new, ...]`` into the appended entries of ``x`` (in place)."""
    if columns is None:
        x[:, :, x.shape[2] - value.shape[2] :] = value
    else:
        x.scatter_(2, _index(columns, x), value.to(x.dtype))


def row_lengths(length: int, rows: int, columns: torch.Tensor | None = None) -> list[int]:
    """Each row's columns in use (its length alone): the view's ``length``, or one past each
    row's last appended entry."""
    return [length] * rows if columns is None else (columns[:, -1] + 1).tolist()
