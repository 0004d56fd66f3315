"""The per-row policy data of rows in lockstep (their ``memo`` or ``shared`` dicts) read as one
batch and written back row by row (:class:`StackedRows`, :func:`stack_rows`, :func:`split_rows`).

Owns: nothing but the view; each row keeps its own data in its dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch


class StackedRows(MutableMapping):
    """The per-row policy data of rows in lockstep (their ``memo`` or ``shared`` dicts) seen as
    one batch: a tensor is read as the rows' tensors concatenated along dim 0 and written back
    split along it, one part per row; a dataclass of tensors (e.g. MomentKV's statistics) field
    by field. So a batched stage keeps exactly what it would keep row by row, and a row later
    run alone (or spliced elsewhere) finds its own data. Other values must be the same in every
    row (they are stored as they are)."""

    def __init__(self, rows: list[dict[str, object]]):
        self.rows = rows

    def __getitem__(self, key: str) -> object:
        present = [key in row for row in self.rows]
        if not any(present):
            raise KeyError(key)
        if not all(present):
            raise ValueError(f"policy data {key!r} is kept by some rows of a batch only: they are not in lockstep")
        return stack_rows([row[key] for row in self.rows], key)

    def __setitem__(self, key: str, value: object) -> None:
        if all(key in row for row in self.rows) and _whole_of([row[key] for row in self.rows]) is value:
            return  # the rows' parts are already views of it (a value read and updated in place)
        for row, part in zip(self.rows, split_rows(value, len(self.rows), key), strict=True):
            row[key] = part

    def __delitem__(self, key: str) -> None:
        for row in self.rows:
            del row[key]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.rows[0]))

    def __len__(self) -> int:
        return len(self.rows[0])


STACKED_FROM = "_stacked_from"
"""Where a row's part of a batch's dataclass came from (:func:`split_rows`): ``(whole, row, rows)``."""


def stack_rows(values: list[Any], key: str) -> Any:
    """One row's values (see :class:`StackedRows`) as the batch's. Parts that :func:`split_rows`
    made of one batch's value, still every row's in order, give that value back as it was (a
    tensor's split views their base, a dataclass the object itself): rows in lockstep read what
    they wrote without a copy (MomentKV's statistics, read by every decode step's NC)."""
    first = values[0]
    whole = _whole_of(values)
    if whole is not None:
        return whole
    if isinstance(first, torch.Tensor):
        return torch.cat(values)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = {f.name: stack_rows([getattr(v, f.name) for v in values], key) for f in dataclasses.fields(first)}
        return type(first)(**fields)
    if all(value is first or value == first for value in values[1:]):
        return first
    raise ValueError(f"policy data {key!r} differs between rows and is no tensor: it cannot be read as one batch")


def _whole_of(values: list[Any]) -> Any:
    """The batch's value that :func:`split_rows` split into ``values`` (every part, in row order), else None."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        whole = first._base
        if whole is not None and whole.shape[0] == len(values) and whole.is_contiguous():
            step = whole.stride(0) * whole.element_size()
            if all(
                value._base is whole and value.shape[0] == 1 and value.data_ptr() == whole.data_ptr() + row * step
                for row, value in enumerate(values)
            ):
                return whole
        return None
    whole = getattr(first, STACKED_FROM, (None,))[0]
    if whole is not None and all(
        (made := getattr(value, STACKED_FROM, None)) is not None and made[0] is whole and made[1:] == (row, len(values))
        for row, value in enumerate(values)
    ):
        return whole
    return None


def split_rows(value: Any, rows: int, key: str) -> list[Any]:
    """The batch's ``value`` as each of ``rows`` rows' (the inverse of :func:`stack_rows`)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != rows:
            raise ValueError(
                f"policy data {key!r} of a batch of {rows} rows must hold one row per batch row along dim 0, "
                f"got shape {tuple(value.shape)}"
            )
        return list(value.split(1))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        parts = {f.name: split_rows(getattr(value, f.name), rows, key) for f in dataclasses.fields(value)}
        split = [type(value)(**{name: part[i] for name, part in parts.items()}) for i in range(rows)]
        for row, part in enumerate(split):
            object.__setattr__(part, STACKED_FROM, (value, row, rows))  # (frozen dataclasses too: not a field)
        return split
    return [value] * rows
