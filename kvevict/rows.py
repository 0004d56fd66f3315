"""Rows of a batch: each sequence's counters, and the views policies run on.

Owns: a row's bookkeeping in one layer (:class:`RowState`), the view of one row (or of rows
in lockstep) exactly as a batch-1 layer holding that sequence alone (:class:`RowView`), the
stack of several layers' rows at the end of a pass (:class:`LayerStack`), what such views
read of the cache (:class:`RowOwner`, :class:`SpanOwner`) and the padding of a pass read
from the model's mask (:func:`real_columns`).

Must not touch: storage tensors (a view writes only into the views it was given, and a
replaced state entry back through :meth:`~kvevict.storage.LayerStorage.write_state`), pass
scheduling or eviction. It imports neither the layer nor the cache: what it reads of them is
the structural :class:`ViewedLayer` and :class:`RowsCache`.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, Protocol

import torch

from kvevict.arena import LayerArena
from kvevict.hidden import HiddenStateRecorder
from kvevict.signals import Phase
from kvevict.stacked import StackedRows
from kvevict.storage import LayerStorage
from kvevict.views import CacheSide, HiddenScores


class RowsCache(Protocol):
    """What a row's view reads of its cache."""

    hidden: HiddenStateRecorder | None
    row_offsets: list[int]

    @property
    def policy(self) -> Any: ...
    @property
    def eviction_layers(self) -> Sequence[Any]: ...
    @property
    def rotary(self) -> Any: ...
    def row_shared(self, row: int) -> dict[str, object]: ...


class ViewedLayer(Protocol):
    """What a :class:`RowView` reads of its layer."""

    rows: list[RowState]
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None
    state: dict[str, torch.Tensor]
    storage: LayerStorage
    n: int
    prompt_pass: bool
    prompt_continues: bool
    layer_idx: int
    window: int | None
    device: torch.device

    @property
    def owner(self) -> RowsCache: ...
    @property
    def policy(self) -> Any: ...


def phase_of(passes: int, prompt_pass: bool) -> Phase:
    """``prefill`` during the first pass and the later chunks of the prompt, else ``decode``."""
    return "prefill" if passes == 1 or prompt_pass else "decode"


class SequenceState:
    """The counters of one sequence (batch row), kept once for every layer: the cache holds
    them (:attr:`~kvevict.cache.EvictionCache.sequences`), each layer's :class:`RowState` points
    at them. The first layer to run a pass advances them (:meth:`advance`, :meth:`begin`);
    ``start_seen`` and ``start_passes`` keep what they were before it, for the other layers."""

    __slots__ = ("budget", "interval", "new", "passes", "prompt_length", "seen", "start_passes", "start_seen")

    def __init__(self) -> None:
        self.seen = 0
        """Real tokens of this row seen so far (its next absolute position)."""
        self.new = 0
        """Real tokens of this row in the current pass (the pass's padding excluded)."""
        self.passes = 0
        """Passes that brought this row real tokens (its first one is its prefill)."""
        self.prompt_length = 0
        self.budget: int | None = None
        self.interval = 1
        self.start_seen = 0
        """:attr:`seen` before the current pass (the position of its first token)."""
        self.start_passes = 0
        """:attr:`passes` before the current pass."""

    def advance(self, columns: int) -> None:
        """A pass of ``columns`` columns began (its padding is taken out by :meth:`drop_padding`)."""
        self.start_seen, self.start_passes = self.seen, self.passes
        self.seen += columns
        self.new = columns

    def drop_padding(self, pad: int) -> None:
        """``pad`` of the pass's columns are this row's left padding, not tokens."""
        self.seen -= pad
        self.new -= pad

    def copy(self) -> SequenceState:
        twin = SequenceState()
        for name in self.__slots__:
            setattr(twin, name, getattr(self, name))
        return twin

    def counters(self) -> tuple[int, ...]:
        """What a scoring pass must give back (:meth:`restore`)."""
        return self.seen, self.new, self.passes, self.start_seen, self.start_passes

    def restore(self, counters: tuple[int, ...]) -> None:
        self.seen, self.new, self.passes, self.start_seen, self.start_passes = counters


class RowState:
    """One sequence (batch row) in one layer: where its entries lie, its peaks and the policy's
    per-layer data; its counters (``seen``, ``new``, ``passes``, ``prompt_length``, ``budget``,
    ``interval``) are read from its :class:`SequenceState`, shared by every layer."""

    __slots__ = ("channels", "decode_peak", "memo", "peak", "pruned_at", "sequence", "start", "width")

    def __init__(self, sequence: SequenceState | None = None) -> None:
        self.sequence = SequenceState() if sequence is None else sequence
        self.decode_peak = 0
        self.peak = 0
        """Most entries a head of this row held at any moment (after an append, before evicting)."""
        self.start = 0
        """First storage column of this row (its left padding, until the first eviction)."""
        self.width = 0
        """Storage columns ``start .. start + width`` hold this row (its longest head)."""
        self.memo: dict[str, object] = {}
        self.channels: torch.Tensor | None = None
        """``[Hkv, d]`` bool: the key channels this row's prompt keys keep once pruned (ThinK); None: every one."""
        self.pruned_at = 0
        """The tokens seen when the row pruned them: entries at this position and later keep every channel."""

    seen = property(lambda self: self.sequence.seen)
    new = property(lambda self: self.sequence.new)
    passes = property(lambda self: self.sequence.passes)
    prompt_length = property(lambda self: self.sequence.prompt_length)
    budget = property(lambda self: self.sequence.budget)
    interval = property(lambda self: self.sequence.interval)


def real_columns(mask: torch.Tensor | None, num_new: int, batch: int) -> torch.Tensor | None:
    """The real (not padding) columns ``[B, n]`` of a pass, from the mask the model built
    (None: no padding). Refuses padding anywhere but on the left of the pass."""
    if mask is None:
        return None
    if mask.dim() == 2:  # flash kernels receive the 2-D padding mask itself
        real = mask.bool()
    else:  # whether each query sees its own key: a sliding window hides old keys from later queries, never this
        own = mask[:, 0].diagonal(offset=mask.shape[-1] - mask.shape[-2], dim1=-2, dim2=-1)
        real = own if mask.dtype == torch.bool else own > torch.finfo(mask.dtype).min / 2
    real = real.expand(batch, -1)[:, -num_new:]
    if bool((real[:, 1:] < real[:, :-1]).any()):
        raise ValueError(
            "right padding (or padding inside a prompt) is not supported by an EvictionCache: pad prompts on the "
            "left (tokenizer.padding_side = 'left'), so that every row ends with its last real token"
        )
    return None if bool(real.all()) else real


class RowView:
    """One row of an :class:`EvictionLayer` exactly as a batch-1 layer holding that sequence
    alone: ``keys``/``values`` ``[1, Hkv, n_b, d]``, ``positions``, ``valid`` (None when every
    entry of the row is real), ``state`` and ``memo`` of the row, and its own counters
    (``seen``, ``prompt_length``, ``budget``, ``decode_step``). Tensors are views of the
    layer's storage, so in-place writes land there; a state entry the policy replaces is
    written back by :meth:`write_back`."""

    def __init__(self, layer: ViewedLayer, row: int, stop: int | None = None):
        info = layer.rows[row]
        stop = row + 1 if stop is None else stop
        self.layer, self.row, self.info = layer, row, info
        lockstep = stop - row > 1  # every row, from column 0 (rows may end apart: head-wise budgets)
        columns = slice(0, layer.n) if lockstep else slice(info.start, info.start + info.width)
        rows = slice(row, stop)
        self.rows = rows
        """The batch rows this view holds: one, or every row in lockstep
        (:meth:`~kvevict.layer.EvictionLayer.views`)."""
        if row == 0 and stop == len(layer.rows) and columns == slice(0, layer.n):
            cut = _whole  # the usual case, one row or rows in lockstep: the layer's own views
        else:
            cut = _narrowing(rows, columns)
        self._read(cut)
        self.interval = info.interval
        if stop - row == 1:
            self.seen, self.prompt_length, self.budget = info.seen, info.prompt_length, info.budget
            self.owner: RowOwner | SpanOwner = RowOwner(layer.owner, row)
        else:  # rows in lockstep (same storage columns, budget and step) may differ in length
            span = layer.rows[rows]
            self.seen, self.prompt_length = (
                uniform([getattr(r, key) for r in span], layer.device) for key in ("seen", "prompt_length")
            )
            self.budget = info.budget
            self.owner = SpanOwner(layer.owner, rows)
        self.prompt_pass, self.prompt_continues = layer.prompt_pass, layer.prompt_continues
        self.passes, self.layer_idx, self.device, self.window = (
            info.passes,
            layer.layer_idx,
            layer.device,
            layer.window,
        )
        self.num_new = info.new
        self.columns = columns
        self.new_columns: torch.Tensor | None = None
        ends = [r.width for r in layer.rows[rows]]
        if lockstep and ends.count(layer.n) != len(ends):  # see :attr:`~kvevict.views.EntryView.new_columns`
            first = torch.tensor(ends, device=layer.device)[:, None] - info.new
            self.new_columns = first + torch.arange(info.new, device=layer.device)

    def _read(self, cut: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Take the view's part ``cut`` of the layer's entries, validity and state."""
        layer = self.layer
        self.keys, self.values, self.positions = cut(layer.keys), cut(layer.values), cut(layer.positions)
        self.valid = mask_if_padded(None if layer.valid is None else cut(layer.valid))
        self._state = {name: cut(value) for name, value in layer.state.items()}
        self.state = dict(self._state)

    @property
    def memo(self) -> MutableMapping[str, object]:
        """Per-layer policy data of this row; of rows in lockstep, every row's data stacked
        along dim 0 (:class:`StackedRows`: what a :attr:`~kvevict.policies.Policy.batched`
        policy keeps is rows of tensors)."""
        return rows_memo(self.layer.rows, self.rows)

    policy = property(lambda self: self.layer.policy)
    num_kv_heads = property(lambda self: self.positions.shape[1])
    length = property(lambda self: self.positions.shape[2])
    decode_step = property(lambda self: self.info.seen - self.info.prompt_length)  # the same for every row
    decode_peak = property(lambda self: self.info.decode_peak)

    def phase(self) -> Phase:
        return phase_of(self.passes, self.prompt_pass)

    def keep_channels(self, keep: torch.Tensor) -> None:
        """Prune key channels of the keys held (ThinK: the prompt's): each head keeps its channels where
        ``keep`` ``[b, Hkv, d]`` (bool, the same number per head), its others are zeroed; keys appended
        later keep every channel. Between passes the storage holds only the kept channels of the pruned
        keys (:meth:`~kvevict.layer.EvictionLayer.prune_key_channels`)."""
        self.keys.mul_(keep[:, :, None].to(self.keys.dtype))  # in place: the layer's own keys
        for row, mask in zip(self.layer.rows[self.rows], keep, strict=True):
            row.channels, row.pruned_at = mask, row.seen

    def head_lengths(self) -> torch.Tensor:
        if self.valid is not None:
            return self.valid.sum(dim=-1)
        return torch.full(self.positions.shape[:2], self.length, dtype=torch.long, device=self.device)

    def outside_window(self) -> torch.Tensor | None:
        """``[1, Hkv, n]``: entries no later query can see (positions ``≤ seen − window``);
        None on a full layer or when there are none."""
        if self.window is None:
            return None
        outside = self.positions <= self.seen - self.window
        return outside if bool(outside.any()) else None

    def drop_outside_window(self) -> bool:
        """Hide the entries that left the sliding window from selection (they are no longer
        attended by the model itself, so they go before the policy chooses); whether any did."""
        outside = self.outside_window()
        if outside is None:
            return False
        self.valid = ~outside if self.valid is None else self.valid & ~outside
        return True

    def held_after_pass(self) -> int:
        """Entries the longest head holds once the entries that left the window are dropped."""
        outside = self.outside_window()
        if outside is None:
            return self.length
        held = ~outside if self.valid is None else self.valid & ~outside
        return int(held.sum(dim=-1).max())

    def eviction_due(self, phase: Phase, num_new: int) -> bool:
        """Over budget (counting, on a sliding layer, only the entries still in the window
        after this pass, except under one budget pooled across layers, where every layer of a
        prompt over budget joins the pool: :func:`~kvevict.budgets.global_counts`), and (decode)
        the step counter crossed a multiple of ``interval``."""
        later_chunk = phase == "prefill" and self.passes > 1
        pooled = phase == "prefill" and self.policy.allocator.across_layers
        if (
            self.budget is None
            or (int(torch.as_tensor(self.seen).max()) if pooled else self.held_after_pass()) <= self.budget
            or not self.policy.evicts_in(phase, later_chunk)
        ):
            return False
        if phase == "prefill":
            return True
        step = self.decode_step  # the first decode step is 1
        return step // self.interval > (step - num_new) // self.interval

    def write_back(self) -> None:
        """Copy state entries the policy replaced (rather than wrote in place) into the layer."""
        for name, value in self.state.items():
            if value is not self._state.get(name):
                self.layer.storage.write_state(name, self.rows, self.columns, value)
                self._state[name] = value


def mask_if_padded(valid: torch.Tensor | None) -> torch.Tensor | None:
    """A view's validity mask, or None when every entry it holds is real."""
    return None if valid is None or bool(valid.all()) else valid


class LayerStack:
    """The decode steps several layers left for the end of a pass, as one batch for the
    policy's stackable stages (:attr:`~kvevict.policies.base.Stage.stackable`): the rows of
    every layer stacked along dim 0, layer after layer, an :class:`~kvevict.views.EntryView`
    like any other. The views share one :meth:`key`, each holds its whole layer, every entry
    real (no ``valid``), and the layers' storage is one :class:`LayerArena`: ``keys``,
    ``positions``, ``state``, ... are views of it, so a stage's in-place writes land in every
    layer at once."""

    valid = None
    new_columns = None

    def __init__(self, views: Sequence[RowView], arena: LayerArena):
        first = views[0]
        self.first, self.layers, self.views = first, len(views), views
        self.rows_per_layer = first.positions.shape[0]
        n = first.length
        self.keys, self.values, self.positions = (
            arena.stacked(block, n) for block in (arena.keys, arena.values, arena.positions)
        )
        self.state = {name: arena.stacked(arena.state[name], n) for name in first.state}
        self._stored = dict(self.state)
        self.seen, self.prompt_length = (repeat_rows(x, len(views)) for x in (first.seen, first.prompt_length))
        self.budget, self.decode_step, self.window, self.device = (
            first.budget,
            first.decode_step,
            first.window,
            first.device,
        )
        self.num_new, self.passes, self.prompt_continues = first.num_new, first.passes, first.prompt_continues
        self.owner = StackOwner(first.owner, self.layers)
        """What a stackable stage reads of the cache: the hidden scores, layer after layer."""

    num_kv_heads = property(lambda self: self.positions.shape[1])
    length = property(lambda self: self.positions.shape[2])
    policy = property(lambda self: self.first.policy)

    @property
    def layer_idx(self) -> int:
        raise ValueError("a stack of layers has no single layer index: a stage that reads it is not stackable")

    @property
    def memo(self) -> MutableMapping[str, object]:
        """Every stacked row's policy data, layer after layer, as rows in lockstep read theirs
        (:class:`StackedRows`): for a stage that is told the stack's evictions at once
        (:attr:`~kvevict.policies.base.Stage.stackable_evictions`)."""
        return StackedRows([row.memo for view in self.views for row in view.layer.rows[view.rows]])

    def phase(self) -> Phase:
        return self.first.phase()

    def head_lengths(self) -> torch.Tensor:
        return torch.full(self.positions.shape[:2], self.length, dtype=torch.long, device=self.device)

    def eviction_due(self, phase: Phase, num_new: int) -> bool:
        """As each stacked view's: they stack only at one budget and step (:meth:`key`)."""
        return self.first.eviction_due(phase, num_new)

    def keep_channels(self, keep: torch.Tensor) -> None:
        """Each stacked layer's rows prune their part of ``keep`` (rows stacked layer after layer)."""
        for view, part in zip(self.views, keep.split(self.rows_per_layer), strict=True):
            view.keep_channels(part)

    def replaced(self) -> dict[str, torch.Tensor]:
        """The state entries a stage replaced (rather than wrote in place), by name."""
        return {name: value for name, value in self.state.items() if value is not self._stored.get(name)}

    @staticmethod
    def key(view: RowView) -> tuple[object, ...]:
        """Pending views stack when they hold as many rows, heads and entries, under one
        budget and window, at one step of the same rows (every layer sees the same tokens)."""
        rows = (view.rows.start, view.rows.stop)
        return (view.positions.shape, view.budget, view.window, rows, view.info.seen, view.info.prompt_length)


class StackOwner:
    """What the views of a :class:`LayerStack` read of the cache: the first view's, with the
    hidden scores looked up layer by layer."""

    def __init__(self, first: CacheSide, layers: int):
        self.first, self.layers = first, layers

    policy = property(lambda self: self.first.policy)
    eviction_layers = property(lambda self: self.first.eviction_layers)
    rotary = property(lambda self: self.first.rotary)
    shared = property(lambda self: self.first.shared)

    @property
    def hidden(self) -> _StackedHidden | None:
        hidden = self.first.hidden
        return None if hidden is None else _StackedHidden(hidden, self.layers)


class _StackedHidden:
    """The frozen hidden-state scores of a :class:`LayerStack`: each layer's rows looked up
    as that layer's view looks them up (the layers' heads side by side in one lookup)."""

    def __init__(self, hidden: HiddenScores, layers: int):
        self.hidden, self.layers = hidden, layers

    def lookup(self, positions: torch.Tensor, end: int | None = None) -> torch.Tensor:
        stacked, heads, n = positions.shape
        rows = stacked // self.layers
        side_by_side = positions.view(self.layers, rows, heads, n).transpose(0, 1).reshape(rows, -1, n)
        scores = self.hidden.lookup(side_by_side, end=end)
        return scores.view(rows, self.layers, heads, n).transpose(0, 1).reshape(stacked, heads, n)


def repeat_rows(x: int | torch.Tensor, times: int) -> int | torch.Tensor:
    """A row counter (an int, or ``[B, 1, 1]`` per row) for ``times`` layers' rows stacked."""
    return x if isinstance(x, int) else x.repeat(times, 1, 1)


def _whole(x: torch.Tensor) -> torch.Tensor:
    return x


def _narrowing(rows: slice, columns: slice) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x[rows, :, columns]`` of a ``[B, H, n, ...]`` tensor, as a view."""
    return lambda x: x.narrow(0, rows.start, rows.stop - rows.start).narrow(
        2, columns.start, columns.stop - columns.start
    )


class RowOwner:
    """What a policy reads of the cache, for one row (its own shared data and hidden scores)."""

    def __init__(self, cache: RowsCache, row: int):
        self.cache, self.row = cache, row

    policy = property(lambda self: self.cache.policy)
    eviction_layers = property(lambda self: self.cache.eviction_layers)
    shared = property(lambda self: self.cache.row_shared(self.row))
    rotary = property(lambda self: self.cache.rotary)

    @property
    def hidden(self) -> _RowHidden | None:
        recorder = self.cache.hidden
        return None if recorder is None else _RowHidden(recorder, self.row)


class _RowHidden:
    """A :class:`~kvevict.hidden.HiddenStateRecorder` seen from one row."""

    def __init__(self, recorder: HiddenStateRecorder, row: int):
        self.recorder, self.row = recorder, row

    def lookup(self, positions: torch.Tensor, end: int | None = None) -> torch.Tensor:
        return self.recorder.lookup(positions, row=self.row, end=end)


class SpanOwner:
    """What a batched policy reads of the cache for every row of the batch in lockstep: the
    rows' shared data stacked, and the hidden scores."""

    def __init__(self, cache: RowsCache, rows: slice):
        self.cache, self.rows = cache, rows

    policy = property(lambda self: self.cache.policy)
    eviction_layers = property(lambda self: self.cache.eviction_layers)
    rotary = property(lambda self: self.cache.rotary)

    @property
    def shared(self) -> StackedRows:
        """Every row's shared policy data, stacked along dim 0 (:class:`StackedRows`)."""
        return StackedRows([self.cache.row_shared(row) for row in range(self.rows.start, self.rows.stop)])

    @property
    def hidden(self) -> HiddenStateRecorder | None:
        """The recorder itself: its rows are the view's (a lockstep view holds every row)."""
        return self.cache.hidden


def rows_memo(rows: list[RowState], span: slice) -> MutableMapping[str, object]:
    """The per-layer policy data of ``rows[span]``: a row's own, or the rows' stacked (:class:`StackedRows`)."""
    if span.stop - span.start == 1:
        return rows[span.start].memo
    return StackedRows([row.memo for row in rows[span]])


class PackedRows:
    """Rows of a decode step that left its layer packed (:meth:`~kvevict.layer.EvictionLayer.attend_packed`)
    as an output corrector reads them: one row, or every row when their policy data agree, each
    with one new token, and their ``memo``. No entries: a packed step exposes none, so the
    step hands the corrector the queries' ``log Z`` it computed (MomentKV's NC reads only that
    and its statistics)."""

    num_new = 1

    def __init__(self, rows: list[RowState], span: slice):
        self._rows, self.rows = rows, span

    @property
    def memo(self) -> MutableMapping[str, object]:
        return rows_memo(self._rows, self.rows)

    @staticmethod
    def of(rows: list[RowState]) -> list[PackedRows]:
        """Every row at once when their policy data hold the same keys (they stack), else one by one."""
        if all(row.memo.keys() == rows[0].memo.keys() for row in rows):
            return [PackedRows(rows, slice(0, len(rows)))]
        return [PackedRows(rows, slice(row, row + 1)) for row in range(len(rows))]


def uniform(values: list[int], device: torch.device) -> int | torch.Tensor:
    """``values`` (one per row) as an int when they agree, else ``[B, 1, 1]`` (broadcasting with positions)."""
    if values.count(values[0]) == len(values):
        return values[0]
    return torch.tensor(values, device=device)[:, None, None]
