"""The one view type a policy's hooks receive, and what a policy may read of its cache.

A hook of a stage (``score``, ``observe``, ``keep``, ...) runs on an :class:`EntryView`: one
row of a layer, rows of a batch in lockstep, a stack of several layers' rows at the end of a
pass, or a whole layer. All of them hold the same attributes, shaped ``[B, Hkv, n, ...]``
where ``B`` is however many rows the view holds, so a method author learns this one
protocol. A leaf module: it imports neither the cache nor the policies.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from kvevict.signals import Phase


class HiddenScores(Protocol):
    """Frozen hidden-state scores of a view's rows (:mod:`kvevict.hidden`)."""

    def lookup(self, positions: torch.Tensor, end: int | None = None) -> torch.Tensor: ...


class CacheSide(Protocol):
    """What a policy reads of the cache behind a view: data shared across layers (per row),
    the hidden-state scores, the rotary table and the other layers."""

    @property
    def policy(self) -> Any: ...
    @property
    def shared(self) -> dict[str, object]: ...
    @property
    def hidden(self) -> HiddenScores | None: ...
    @property
    def rotary(self) -> Any: ...
    @property
    def eviction_layers(self) -> Sequence[Any]: ...


class EntryView(Protocol):
    """Retained entries of some rows of one layer (or of a stack of layers), with their
    sequences' counters. Tensors are views of the layer's storage: in-place writes land there.

    Counters are ints when every row agrees, else ``[B, 1, 1]`` per row (broadcasting with
    :attr:`positions`)."""

    keys: torch.Tensor
    """``[B, Hkv, n, d]``."""
    values: torch.Tensor
    positions: torch.Tensor
    """Absolute position of each entry in its own sequence, ``[B, Hkv, n]`` (int64)."""
    valid: torch.Tensor | None
    """``[B, Hkv, n]`` bool where rows or heads hold fewer entries than ``n``; None: all real."""
    state: dict[str, torch.Tensor]
    """The policy's per-token state by name, ``[B, Hkv, n, ...]``."""
    seen: int | torch.Tensor
    """Real tokens seen: the next absolute position."""
    prompt_length: int | torch.Tensor
    budget: int | None | torch.Tensor
    num_new: int
    """Entries the current pass appended (the last ``num_new`` columns, unless :attr:`new_columns`)."""
    new_columns: torch.Tensor | None
    """``[B, num_new]``: each row's columns of the appended entries, in a view of rows in
    lockstep whose rows end at different columns (head-wise budgets); None: the last
    ``num_new`` columns. Read and write them with :func:`kvevict.signals.new_entries` and
    :func:`~kvevict.signals.write_new_entries`."""
    passes: int
    prompt_continues: bool
    """Whether more of a prompt fed in chunks comes after this pass (its whole length known)."""
    window: int | None
    """The layer's sliding window, or None for full attention."""
    device: torch.device

    @property
    def decode_step(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def layer_idx(self) -> int: ...
    @property
    def memo(self) -> dict[str, object]: ...
    @property
    def owner(self) -> CacheSide: ...
    @property
    def policy(self) -> Any: ...
    def phase(self) -> Phase: ...
    def head_lengths(self) -> torch.Tensor: ...
    def keep_channels(self, keep: torch.Tensor) -> None: ...
    def eviction_due(self, phase: Phase, num_new: int) -> bool: ...


class ScoringCache(Protocol):
    """What a policy's own scoring pass (KVzip's repeat) uses of the cache."""

    deferred: list[tuple[Any, Any]]
    row_offsets: list[int]

    @property
    def eviction_layers(self) -> Sequence[Any]: ...
    @property
    def policy(self) -> Any: ...
    def get_seq_length(self, layer_idx: int = 0) -> int: ...
    def scoring_pass(self, observer: Any) -> AbstractContextManager[None]: ...
    def row_shared(self, row: int) -> dict[str, object]: ...
    def alone(self) -> ScoringCache: ...
    def close(self) -> None: ...
