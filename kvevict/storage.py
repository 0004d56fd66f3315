"""The tensors one eviction layer holds, and the only code that replaces them.

Owns: a layer's keys, values, positions, validity mask and per-token policy state
``[B, Hkv, capacity, ...]`` (:class:`LayerStorage`) and the views of its first ``n`` columns
(:class:`Columns`); :mod:`kvevict.arena` holds several layers' storage as one tensor per
kind. Every replacement of a tensor goes through :class:`LayerStorage` and bumps its
:attr:`~LayerStorage.version`: cached views, the steady decode path and arenas compare that
number rather than trusting each writer to clear what it made stale.

Between passes a ragged layer keeps only its real entries (:class:`PackedEntries`) and a
quantized cache's layer holds its keys and values as codes (:mod:`kvevict.quant`,
:meth:`LayerStorage.quantize`), and a layer whose key channels were pruned (ThinK) only the kept
channels (:meth:`LayerStorage.keep_channels`); the next pass gets the padded, dequantized,
full-width layout back.

Must not touch: rows, passes or policies. Which columns a row occupies, and what a pass
appends where, is decided by :mod:`kvevict.layer`; this module only moves entries it is
told to move (gather, refill from the last column, grow, add or drop batch rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import astuple, dataclass

import torch

from kvevict.channels import PrunedKeys
from kvevict.packed import PackedEntries, held_slots
from kvevict.quant import QuantConfig, QuantizedEntries, ReusableCodes, compress

SLACK = 16
"""Columns a storage may hold beyond its entries and its room to grow before it gives them back."""


def capacity_bound(entries: int, room: int) -> int:
    """The most columns a storage holds while it never holds more than ``entries`` entries per
    row and head and keeps ``room`` columns to grow (the eviction interval): what it may keep
    before :meth:`LayerStorage.fit` gives columns back, which also bounds geometric growth
    (≤ 1.125×, or :data:`SLACK` columns more)."""
    return entries + room + max(SLACK, entries // 4)


@dataclass(frozen=True)
class ColumnBytes:
    """The resident bytes of one row's entries in one layer, as a scheduler bounds them
    (:func:`kvevict.bench.serving.batch_bound`). Unquantized (``coded`` 0): ``dense`` per column
    of the padded storage's capacity (a key and a value per KV head at the model's dtype, their
    positions, validity, per-token state). Quantized (:mod:`kvevict.quant`), between passes:
    ``kept`` per padded column (validity, state, each head's position: at most int32, as
    :class:`~kvevict.quant.CompactPositions` holds positions below 2^31), ``coded`` per entry
    (codes, scales, zero points) and at most ``tail`` entries at full precision (``full`` bytes
    each: a key and a value per head); while a pass attends the layer it also holds its
    ``dense`` columns and one bool per head of each (which codes were real as it began)."""

    dense: int
    coded: int = 0
    kept: int = 0
    full: int = 0
    tail: int = 0
    heads: int = 0

    @classmethod
    def of(cls, dense: int, heads: int, head_dim: int, itemsize: int, quant: QuantConfig | None) -> ColumnBytes:
        """A layer's, from its ``dense`` column bytes (which count each head's position as int64)."""
        if quant is None:
            return cls(dense)
        full = heads * 2 * head_dim * itemsize
        coded = heads * quant.coded_bytes(head_dim, itemsize)
        return cls(dense, coded, dense - full - heads * 4, full, quant.flush - 1, heads)

    def resident(self, entries: int, room: int) -> int:
        """Bytes between passes of a row holding ``entries`` per head with ``room`` to grow."""
        columns = capacity_bound(entries, room)
        if not self.coded:
            return columns * self.dense
        return columns * self.kept + entries * self.coded + min(entries, self.tail) * self.full

    def attended(self, entries: int, room: int) -> int:
        """Bytes a pass holds besides :meth:`resident` while it attends this layer (quantized:
        the dequantized columns, and which codes were real; unquantized: nothing)."""
        return capacity_bound(entries, room) * (self.dense + self.heads) if self.coded else 0

    def widest(self, other: ColumnBytes) -> ColumnBytes:
        """Each figure the larger of the two (a setting's estimate raised to a built cache's)."""
        return ColumnBytes(*(max(mine, theirs) for mine, theirs in zip(astuple(self), astuple(other))))


def spread(
    entries: torch.Tensor, held: torch.Tensor, columns: int, slots: torch.Tensor, free: torch.Tensor | None
) -> torch.Tensor:
    """Real ``entries`` ``[real entries, ...]`` (storage order) in the padded layout ``[B, Hkv, columns, ...]``
    of ``held`` ``[B, Hkv, n]`` (``slots``: :func:`~kvevict.packed.held_slots` of ``columns``): zeros
    elsewhere, and for positions (``free`` given) row ``b``'s free slots at position ``free[b]``."""
    dense = entries.new_zeros((*held.shape[:2], columns, *entries.shape[1:]))
    if free is not None:
        dense[:] = free.view(-1, 1, 1)
    dense.view(-1, *entries.shape[1:]).index_copy_(0, slots, entries)
    return dense


class Columns:
    """Views of a storage's first ``n`` columns (what a layer exposes as ``keys``, ``values``,
    ...) and, once asked for, column ``n`` (where a decode step appends). Why keep them: making a
    view is a dispatch, which costs microseconds on a CPU whose caches the model's weights just
    streamed through, in every layer of every pass."""

    __slots__ = ("_kv_positions", "_next", "keys", "n", "positions", "state", "valid", "values")

    def __init__(self, storage: LayerStorage, n: int):
        # the tensors, not the storage object, which keeps these views (no reference cycle)
        self._kv_positions, self.n, self._next = storage.kv_positions(), n, None
        self.keys, self.values, self.positions = (x.narrow(2, 0, n) for x in self._kv_positions)
        self.valid = None if storage.valid is None else storage.valid.narrow(2, 0, n)
        self.state = {name: value.narrow(2, 0, n) for name, value in storage.state.items()}

    def next_column(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Column ``n`` of the keys, values and positions ``[B, Hkv, 1, ...]`` (the storage has room for it)."""
        if self._next is None:
            self._next = tuple(x.narrow(2, self.n, 1) for x in self._kv_positions)
        return self._next

    def append(self, keys: torch.Tensor, values: torch.Tensor, position: int) -> None:
        """Write one decode step's entry ``[B, Hkv, 1, ...]`` of every row, at ``position``, into column ``n``."""
        new_keys, new_values, new_positions = self.next_column()
        new_keys.copy_(keys)
        new_values.copy_(values)
        new_positions.fill_(position)


class LayerStorage:
    """One layer's per-entry tensors ``[B, Hkv, capacity, ...]``: ``keys``, ``values``,
    ``positions`` (absolute position of each entry in its own sequence), ``valid`` (None while
    every column in use is real) and the policy's per-token ``state`` by name. Columns past
    those in use are room to grow (appends are O(1) amortised)."""

    def __init__(self) -> None:
        self.version = 0
        """Bumped whenever a tensor is replaced (grown, gathered, adopted by an arena, ...)."""
        self.clear()

    def clear(self) -> None:
        self.keys = self.values = torch.empty(0, 0, 0, 0)
        self.positions = torch.empty(0, 0, 0, dtype=torch.long)
        self.valid: torch.Tensor | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.capacity = 0
        self.packed: PackedEntries | None = None
        """Between passes, the real entries of a ragged layer, and nothing else (:meth:`pack`)."""
        self.quantized: QuantizedEntries | None = None
        """Between passes, the keys and values of a quantized layer (:meth:`quantize`)."""
        self.pruned: PrunedKeys | None = None
        """Between passes, when the keys hold only some channels of each head (ThinK,
        :meth:`keep_channels`): which, and the rest of the entries that keep them all."""
        self.previous: ReusableCodes | None = None
        """During a pass, what :attr:`quantized` was: its codes still in place are kept at the pass's end."""
        self._aside: tuple[tuple[object, ...], tuple[torch.Tensor, ...]] | None = None
        """The empty keys, values and positions a layer set aside holds (:meth:`_set_aside`), with their layout."""
        self.replaced()

    def replaced(self) -> None:
        """A tensor (or the set of state entries) changed: every view made before is stale."""
        self.version += 1
        self._views: dict[int, Columns] = {}

    def kv_positions(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.keys, self.values, self.positions

    def entries(self) -> dict[str, torch.Tensor]:
        """Every per-entry tensor but :attr:`valid` (whole capacity), by name."""
        return {"keys": self.keys, "values": self.values, "positions": self.positions, **self.state}

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held, :attr:`valid` and packed entries included."""
        held = [self.keys, self.values, self.positions, *self.state.values()]
        if self.valid is not None:
            held.append(self.valid)
        if self.packed is not None:
            held += self.packed.tensors()
        if self.pruned is not None:
            held += self.pruned.tensors()
        for quantized in (self.quantized, self.previous):
            held += [] if quantized is None else quantized.tensors()
        return held

    def columns(self, n: int) -> Columns:
        """The views of the first ``n`` columns, kept for the two column counts a decode step
        alternates between, and made anew once a tensor is replaced (:attr:`version`)."""
        columns = self._views.get(n)
        if columns is None:
            if len(self._views) == 2:
                del self._views[next(iter(self._views))]
            columns = self._views[n] = Columns(self, n)
        return columns

    def append(self, n: int, keys: torch.Tensor, values: torch.Tensor, position: int) -> None:
        """Write one decode step's entry ``[B, Hkv, 1, ...]`` of every row, at ``position``, into column ``n``:
        through the kept views of column ``n`` (:meth:`columns`: the next step of a dense layer
        reuses them), but directly in a quantized layer's pass, whose storage is new every pass."""
        if self.previous is None:
            self.columns(n).append(keys, values, position)
            return
        self.keys[:, :, n : n + 1] = keys
        self.values[:, :, n : n + 1] = values
        self.positions[:, :, n : n + 1] = position

    def initialize(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Empty storage for ``keys``/``values`` ``[B, Hkv, *, d]``'s batch, heads, dtype and device."""
        b, h = keys.shape[:2]
        self.keys = keys.new_zeros(b, h, 0, keys.shape[-1])
        self.values = values.new_zeros(b, h, 0, values.shape[-1])
        self.positions = torch.zeros(b, h, 0, dtype=torch.long, device=keys.device)
        self.valid, self.state, self.capacity = None, {}, 0
        self.packed = self.quantized = self.previous = self.pruned = None
        self.replaced()

    def _map(self, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.keys, self.values, self.positions = (change(x) for x in self.kv_positions())
        self.valid = None if self.valid is None else change(self.valid)
        self.state = {name: change(value) for name, value in self.state.items()}
        self.replaced()

    def reserve(self, used: int, needed: int) -> None:
        """Room for ``needed`` columns, of which the first ``used`` hold entries (grown
        geometrically: appends are O(1) amortised)."""
        if needed <= self.capacity:
            return
        # ≤ 1.125× what is held, or 16 columns more: O(1) amortised, within the slack a partial block would have
        capacity = max(needed, self.capacity + max(SLACK, self.capacity // 8))

        def grow(x: torch.Tensor) -> torch.Tensor:
            bigger = x.new_zeros(*x.shape[:2], capacity, *x.shape[3:])
            bigger[:, :, :used] = x[:, :, :used]
            return bigger

        self._map(grow)
        self.capacity = capacity

    def fit(self, used: int, room: int) -> None:
        """Give back what the storage holds beyond ``used`` columns plus ``room`` to grow (the
        eviction interval) and a small slack: after an eviction compacted in place, after a
        prompt compressed, after a scoring pass. Costs one copy of the ``used`` columns, once."""
        if self.capacity > capacity_bound(used, room):
            capacity = used + room

            def shrink(x: torch.Tensor) -> torch.Tensor:
                return x.narrow(2, 0, min(capacity, x.shape[2])).clone()

            self._map(shrink)
            self.capacity = capacity

    def pack(self, n: int, ends: list[int]) -> None:
        """Between passes, a layer whose rows or heads hold different numbers of entries keeps
        only the real ones (:class:`~kvevict.packed.PackedEntries`): nothing is padded to the
        longest. ``ends[b]``: the column row ``b`` appends at next."""
        assert self.valid is not None and self.packed is None
        held = self.valid.narrow(2, 0, n).clone()
        slots = held_slots(held, self.keys.shape[2])  # one index for every entry, not a boolean mask per tensor
        entries = {name: x.reshape(-1, *x.shape[3:]).index_select(0, slots) for name, x in self.entries().items()}
        self.packed = PackedEntries(held, entries, ends)
        self._set_aside()
        self.state = {
            name: value.new_empty(*value.shape[:2], 0, *value.shape[3:]) for name, value in self.state.items()
        }
        self.valid, self.capacity = None, 0
        self.replaced()

    def append_packed(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """A pass into packed entries, left packed: keys and values ``[B, Hkv, q, d]`` (a decode
        step's one, a prompt chunk's ``q``), each row's position of the first ``[B]``; per-token
        state entries start at zero, as in padded storage."""
        packed = self.packed
        assert packed is not None
        q = keys.shape[2]
        new = {"keys": keys, "values": values}
        new["positions"] = (positions.view(-1, 1, 1) + torch.arange(q, device=positions.device)).expand(*keys.shape[:3])
        for name, value in self.state.items():
            new[name] = value.new_zeros(*keys.shape[:3], *value.shape[3:])
        if q == 1:  # room for 16 entries or a 16th more, whichever is more: moves every 16+ steps,
            # resident ≤ 1.0625× + 16 per head (the layer's room at most doubled by whole pages: PackedEntries)
            packed.append(new, lambda length: length + max(SLACK, length // 16))
        else:  # a chunk's entries, and no more: the eviction at the end of the pass packs the layer anew
            packed.append(new, lambda length: length + q)

    def write_packed(self, rows: slice, values: dict[str, torch.Tensor]) -> None:
        """The state ``values[name]`` ``[b, Hkv, q, ...]`` of the ``q`` entries just appended to the
        packed segments of batch rows ``rows`` (a state entry new to the layer starts at zero elsewhere)."""
        packed = self.packed
        assert packed is not None
        for name, value in values.items():
            if name not in self.state:
                self.state[name] = value.new_empty(*self.keys.shape[:2], 0, *value.shape[3:])
            packed.write_last(name, rows, value)
        self.replaced()

    def keep_packed(self, source: torch.Tensor, kept: torch.Tensor, room: int) -> None:
        """Keep, of the packed entries, those at the padded layout's columns ``source`` ``[B, Hkv,
        m]`` where ``kept`` ``[B, Hkv, m]`` (each head's first entries: what :meth:`gather` and
        :meth:`set_valid` leave in padded storage), in that order: packed anew when the heads
        keep different numbers, else in padded storage with ``room`` columns to grow. Only the
        kept entries are copied (no padded copy of the layer is made)."""
        packed = self.packed
        assert packed is not None
        index = packed.slots().gather(2, source)[kept]
        entries = {name: x.index_select(0, index) for name, x in packed.entries.items()}
        counts = kept.sum(dim=-1)
        if bool((counts == kept.shape[-1]).all()):  # every head the same: no padding, no packing
            self.packed = None
            self._spread(entries, kept, room, free=None)
        else:
            self.packed = PackedEntries(kept, entries, counts.amax(dim=1).tolist())
        self.replaced()

    def unpack(self, room: int, free: torch.Tensor) -> int:
        """The packed entries back in padded storage with ``room`` columns to grow, before a
        pass writes into it; returns the columns in use. A free slot of row ``b`` gets position
        ``free[b]`` (a past position no query of the pass has: ``seen − 1``, or −1)."""
        packed = self.packed
        assert packed is not None
        self.packed = None
        held = packed.held
        n = held.shape[-1]
        self._spread(packed.real(), held, room, free)
        self.valid = torch.zeros(*held.shape[:2], self.capacity, dtype=torch.bool, device=held.device)
        self.valid[:, :, :n] = held
        self.replaced()
        return n

    def _spread(
        self, entries: dict[str, torch.Tensor], held: torch.Tensor, room: int, free: torch.Tensor | None
    ) -> None:
        """Hold ``entries`` (every kind, real entries only, in storage order) in padded storage
        where ``held`` ``[B, Hkv, n]`` is true, with ``room`` columns to grow; a free slot's
        position is ``free`` (None: 0)."""
        self.capacity = held.shape[-1] + room
        slots = held_slots(held, self.capacity)
        dense = {
            name: spread(x, held, self.capacity, slots, free if name == "positions" else None)
            for name, x in entries.items()
        }
        self.keys, self.values, self.positions = dense.pop("keys"), dense.pop("values"), dense.pop("positions")
        self.state = dense

    def quantize(self, n: int, spans: Sequence[tuple[int, int]], config: QuantConfig) -> None:
        """Between passes, hold the first ``n`` columns' keys and values quantized
        (:func:`kvevict.quant.compress`; row ``b`` holds columns ``spans[b] = (start, width)``);
        the positions compactly (:class:`kvevict.quant.CompactPositions`); validity and state stay as they are."""
        assert self.quantized is None and self.packed is None
        valid = None if self.valid is None else self.valid.narrow(2, 0, n)
        keys, values, positions = (x.narrow(2, 0, n) for x in self.kv_positions())
        self.quantized = compress(keys, values, valid, positions, spans, config, self.previous)
        self.previous = None
        self._set_aside()
        self.replaced()

    def _set_aside(self) -> None:
        """Between passes (packed or quantized) the keys, values and positions are held elsewhere:
        the storage keeps empty tensors of their batch, heads, dtype and device, made once for
        as long as those stay (a layer is set aside at the end of every pass)."""
        keys, values = self.keys, self.values
        layout = (keys.shape[:2], keys.shape[3], values.shape[3], keys.dtype, keys.device)
        if self._aside is None or self._aside[0] != layout:
            self._aside = layout, tuple(x.new_empty(*x.shape[:2], 0, *x.shape[3:]) for x in self.kv_positions())
        self.keys, self.values, self.positions = self._aside[1]

    def dequantize(self) -> None:
        """The quantized keys and values (dequantized) and the positions back in padded storage before a pass."""
        quantized = self.quantized
        assert quantized is not None
        self.quantized = None
        self.previous = quantized.reusable(None if self.valid is None else self.valid.narrow(2, 0, quantized.n))
        self.keys, self.values = quantized.restore(self.capacity)
        self.positions = quantized.positions.restore(self.capacity)
        self.replaced()

    def keep_channels(self, channels: torch.Tensor, whole: torch.Tensor) -> None:
        """Between passes, hold of each head's keys only the channels ``channels`` ``[B, Hkv, k]``
        (ascending), but every channel of the entries where ``whole`` ``[B, Hkv, n]`` (ThinK prunes the
        prompt's keys, whose other channels are zero: nothing is lost); the keys' bytes fall by the
        pruned share of the others (:meth:`widen_keys` before the next pass). Before :meth:`pack`."""
        assert self.pruned is None and self.quantized is None and self.packed is None
        self.keys, self.pruned = PrunedKeys.narrow(self.keys, channels, whole)
        self.replaced()

    def widen_keys(self) -> None:
        """Every channel of the keys back before a pass or a change of the rows."""
        assert self.pruned is not None
        self.keys = self.pruned.widen(self.keys)
        self.pruned = None
        self.replaced()

    def dense(self, name: str, free: torch.Tensor, n: int) -> torch.Tensor | None:
        """Entry ``name`` (``keys``, ``values``, ``positions``, ``valid``, a state entry) of the
        packed, quantized or channel-pruned entries of ``n`` columns, padded as a pass would see
        it (free slots of row ``b`` at position ``free[b]``; keys and values dequantized, keys at
        every channel): a new tensor, or a view, not kept (reading a layer between passes does
        not inflate it)."""
        quantized = self.quantized
        if quantized is not None:
            if name in ("keys", "values"):
                return quantized.restore(quantized.n)[name == "values"]
            if name == "positions":
                return quantized.positions.restore(quantized.n)
            value = self.valid if name == "valid" else self.entries()[name]
            return None if value is None else value.narrow(2, 0, quantized.n)
        packed, pruned = self.packed, self.pruned
        if packed is None:  # only the keys' channels are set aside
            value = self.valid if name == "valid" else self.entries()[name]
            if value is None:
                return None
            return pruned.widen(value.narrow(2, 0, n)) if name == "keys" and pruned else value.narrow(2, 0, n)
        held = packed.held
        if name == "valid":
            return held
        slots = held_slots(held, held.shape[-1])
        dense = spread(packed.real([name])[name], held, held.shape[-1], slots, free if name == "positions" else None)
        return pruned.widen(dense) if name == "keys" and pruned is not None else dense

    def leave_inference_mode(self) -> None:
        """Storage is written in place, which torch forbids on tensors made under ``inference_mode``
        once that mode is left (e.g. ``kvevict.answer`` filled the cache and the caller goes on
        under ``no_grad``): copy it once into ordinary tensors."""
        held = [*self.entries().values(), *([] if self.valid is None else [self.valid])]
        if not torch.is_inference_mode_enabled() and any(x.is_inference() for x in held):
            self._map(torch.clone)

    def ensure_valid(self, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Materialise :attr:`valid`, row ``b`` real at columns ``spans[b] = (start, stop)``."""
        if self.valid is None:
            self.valid = torch.zeros(self.positions.shape, dtype=torch.bool, device=self.positions.device)
            for i, (start, stop) in enumerate(spans):
                self.valid[i, :, start:stop] = True
            self.replaced()
        return self.valid

    def drop_valid(self) -> None:
        if self.valid is not None:
            self.valid = None
            self.replaced()

    def add_state(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A new per-token state entry shaped as ``like`` ``[B, Hkv, *, ...]`` over the whole capacity (zeros)."""
        self.state[name] = like.new_zeros(self.keys.shape[0], like.shape[1], self.capacity, *like.shape[3:])
        self.replaced()
        return self.state[name]

    def gather(self, source: torch.Tensor, capacity: int) -> None:
        """Keep entries ``source`` ``[B, Hkv, m]`` (column indices), in that order, in new tensors of
        ``capacity`` columns (the old ones are freed)."""
        self.keys, self.values, self.positions = (_gather(x, source, capacity) for x in self.kv_positions())
        self.state = {name: _gather(value, source, capacity) for name, value in self.state.items()}
        self.valid = None  # the caller sets it anew from what each head kept (:meth:`set_valid`)
        self.capacity = capacity
        self.replaced()

    def set_valid(self, held: torch.Tensor | None) -> None:
        """Columns ``0 .. n`` of each head are real where ``held`` ``[B, Hkv, n]`` (None: all are)."""
        if held is None:
            self.drop_valid()
            return
        self.valid = torch.zeros(self.positions.shape, dtype=torch.bool, device=self.positions.device)
        self.valid[:, :, : held.shape[-1]] = held
        self.replaced()

    def move_last_into(self, slots: torch.Tensor, last: int) -> None:
        """The entry of column ``last`` takes slot ``slots[b, h]`` of its head, in place."""
        move_last_into(self.entries().values(), slots, last)

    def add_row(self) -> None:
        """One more batch row, holding nothing (:attr:`valid` must exist: the row is not real)."""
        self._map(lambda x: torch.cat([x, x.new_zeros(1, *x.shape[1:])]))
        self.previous = None  # the rows changed: quantized anew

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` only, in that order."""
        self._map(lambda x: x[index])
        self.previous = None

    def copy_row(self, row: int, source: LayerStorage, columns: slice, source_row: int = 0) -> int:
        """Batch row ``row`` holds ``source``'s row ``source_row`` at ``columns``, from column 0 (room
        must exist; new state entries are made). Columns past them are invalid, at position -1."""
        width = columns.stop - columns.start
        self.previous = None  # another sequence's entries: quantized anew
        for name, value in source.state.items():
            if name not in self.state:
                self.add_state(name, value)
        pairs = [(self.keys, source.keys), (self.values, source.values)]
        pairs += [(self.state[name], value) for name, value in source.state.items()]
        for mine, theirs in pairs:
            mine[row, :, :width] = theirs[source_row, :, columns]
        self.positions[row] = -1  # columns the row does not hold sit at a position no query has
        self.positions[row, :, :width] = source.positions[source_row, :, columns]
        assert self.valid is not None
        self.valid[row] = False
        self.valid[row, :, :width] = True if source.valid is None else source.valid[source_row, :, columns]
        return width

    def write_state(self, name: str, rows: slice, columns: slice, value: torch.Tensor) -> None:
        """A state entry a policy replaced (rather than wrote in place), back into the storage."""
        self.state[name][rows, :, columns] = value


def _gather(x: torch.Tensor, indices: torch.Tensor, capacity: int) -> torch.Tensor:
    """Entries ``indices`` ``[B, H, m]`` along dim 2 of ``[B, H, n, ...]``, into a new buffer of ``capacity``."""
    index = indices.reshape(*indices.shape, *([1] * (x.dim() - 3))).expand(*indices.shape, *x.shape[3:])
    out = x.new_zeros(*x.shape[:2], capacity, *x.shape[3:])
    out[:, :, : indices.shape[-1]] = x.gather(2, index)
    return out


def move_last_into(storages: Iterable[torch.Tensor], slots: torch.Tensor, last: int) -> None:
    """In each of ``storages`` (entries along dim ``slots.dim()``), the entry at ``last`` takes
    slot ``slots[...]`` of its head: one ``scatter_`` per tensor."""
    slot = slots[..., None]
    indices: dict[tuple[int, ...], torch.Tensor] = {(): slot}  # per trailing shape (keys and values share one)
    for storage in storages:
        trailing = storage.shape[slot.dim() :]
        if trailing not in indices:
            indices[trailing] = slot.view(*slot.shape, *[1] * len(trailing)).expand(*slot.shape, *trailing)
        # the source column is copied (one entry per head): torch refuses a scatter whose
        # source lies inside the written tensor whenever it can see the overlap
        storage.scatter_(slots.dim(), indices[trailing], storage.narrow(slots.dim(), last, 1).clone())
