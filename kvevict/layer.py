"""One attention layer of an :class:`~kvevict.cache.EvictionCache` (DESIGN §1.1, §1.5).

:class:`EvictionLayer` is a cache *layer* in the style of transformers'
``DynamicSlidingWindowLayer``: keys/values ``[B, Hkv, n, d]`` physically shrink to the
budget; next to them live the absolute position of each entry ``[B, Hkv, n]`` and the
policy's per-token state ``{name: [B, Hkv, n, ...]}``, gathered with the entries on every
eviction so they never drift apart. Each KV head keeps its own set of tokens.

``get_seq_length()`` counts tokens *seen* (so new tokens get their absolute RoPE positions)
and ``get_mask_sizes()`` describes the *retained* entries as the most recent ``n`` positions
before the query: every retained entry is in the past, so the standard causal mask is exact
and ``model.generate(..., past_key_values=cache)`` just works.

A sliding-window layer (Mistral, Gemma 2/3, gpt-oss, Qwen2 with ``use_sliding_window``) is an
:class:`EvictionLayer` with a ``window``: after every pass it first drops the entries no later
query can see (positions ``≤ seen − window``, as transformers' ``DynamicSlidingWindowLayer``
does, without telling the policy), then the policy evicts the rest to the budget as on a
full layer; its mask is built from positions (:mod:`kvevict.attention`).

Owns: transformers' layer API (``update``, ``get_seq_length``, ...), the rows of the batch
in this layer, appending a pass's entries, exposing the storage's first ``n`` columns as
``keys``, ``values``, ``positions``, ``valid`` and ``state``, splicing and removing rows, and
the layer's byte counts. The pass bookkeeping (:mod:`kvevict.passes`), the policy driver
(:mod:`kvevict.driver`) and the passes that leave a ragged layer packed (:mod:`kvevict.packedpass`)
are its mixins; the tensors are its :class:`~kvevict.storage.LayerStorage`.

Must not touch: the cache's other layers, or tensors other than through its storage.
"""

from __future__ import annotations

import copy
import math
import weakref
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from kvevict.attention import mark_pending
from kvevict.driver import PolicyDriver
from kvevict.packedpass import PackedPasses, PackedRowView
from kvevict.passes import PassBookkeeping, PendingPass, SteadyRecord
from kvevict.rows import RowState, RowView, SequenceState, phase_of, uniform
from kvevict.signals import Signals
from kvevict.storage import ColumnBytes, Columns, LayerStorage


class EvictionLayer(PassBookkeeping, PolicyDriver, PackedPasses, DynamicLayer):
    """One attention layer of an eviction cache: full attention, or a sliding window of
    ``window`` positions (a query at ``p`` sees keys at ``> p − window``).

    Storage is preallocated (``budget + interval`` entries once evicting) and shared by the
    rows of a batch: row ``b`` occupies columns ``[start_b, start_b + width_b)``; columns a
    row or a head does not hold (left padding of its prompt, rows or heads keeping fewer
    entries) are marked false in :attr:`valid` and masked out of attention and selection.
    Entries are *not* sorted by position: an evicted entry's slot is reused by an entry from
    the end (O(1) data movement per evicted entry), and :attr:`positions` says where each
    entry sits in its sequence (masks, windows included, are built from them).

    The policy never sees the batch: every hook runs on a :class:`~kvevict.rows.RowView`,
    which holds one row exactly as a batch-1 layer holding that prompt alone would (same
    entries in the same order, same counters), so a batch gives each row what it gets alone.

    The layer holds its cache by a weak reference: a dropped cache is freed at once, with
    no reference cycle for the garbage collector to find.
    """

    is_croppable = False
    new_columns = None
    """A layer seen as a view (a batch of one row) holds a pass's entries in its last columns."""

    def __init__(self, owner: Any, layer_idx: int, window: int | None = None):
        # not DynamicLayer.__init__: it assigns keys and values, which are read-only views here
        self.is_initialized = False
        self._owner = weakref.ref(owner)
        self.layer_idx = layer_idx
        self.window = window
        self.is_sliding = window is not None  # transformers builds sliding masks from such layers
        self.storage = LayerStorage()
        """The layer's tensors: every replacement goes through it and bumps its version."""
        self._clear()

    @property
    def owner(self) -> Any:
        """The :class:`~kvevict.cache.EvictionCache` this layer belongs to."""
        owner = self._owner()
        if owner is None:
            raise RuntimeError("the EvictionCache of this layer was garbage-collected")
        return owner

    def __deepcopy__(self, memo: dict[int, Any]) -> EvictionLayer:
        """A copy whose weak reference points at the copy of its cache (``copy.deepcopy`` of an
        ``EvictionCache`` maps the cache to its copy in ``memo``): a weak reference itself is
        copied as is."""
        twin = self.__class__.__new__(self.__class__)
        memo[id(self)] = twin
        for name, value in self.__dict__.items():
            setattr(twin, name, copy.deepcopy(value, memo))
        owner = self._owner()
        twin._owner = weakref.ref(memo.get(id(owner), owner))
        return twin

    def _clear(self) -> None:
        self.tokens = 0
        """Columns of every pass so far, padding included (transformers' ``cache_position``)."""
        self.passes = 0
        self.prompt_pass = False
        """Whether the current pass is (a chunk of) the prompt: prefill-time policies score it."""
        self.prompt_open = True
        """Whether a later pass of several tokens may still be a chunk of the prompt."""
        self.rows: list[RowState] = [RowState()]
        self.compacted = False
        """Whether an eviction reordered the storage (until then it is the model's own layout)."""
        self._num_new = 0
        self.storage.clear()
        self._pass_views: list[RowView] | None = None
        """The row views of the pass under way, from :meth:`begin_pass` to its eviction."""
        self.pending_pass: PendingPass | None = None
        """A decode step's work left for the end of the pass (:meth:`observe_pending`)."""
        self.pending_eviction: tuple[RowView, Signals] | None = None
        """A decode step's eviction left for the end of the pass (:meth:`evict_pending`)."""
        self._steady_pass = False
        """Whether the pass under way appended by the steady path (:meth:`settle`)."""
        self.packed_pass = False
        """Whether the pass under way is a decode step that leaves the layer packed (:meth:`_stays_packed`)."""
        self.refresh(0)

    _steady: SteadyRecord | None
    """What the next decode step needs to take the steady path (:meth:`settle`), while the
    storage keeps the version recorded there."""

    def refresh(self, n: int | None = None) -> None:
        """Expose the storage's first ``n`` columns (default: as many as now) as :attr:`keys`,
        :attr:`values`, ... (after the storage or the columns in use changed). The steady record
        goes with the old exposure; a replaced tensor is caught by the storage's version anyway."""
        self._steady = None
        self._expose(self.storage.columns(self.n if n is None else n))

    def _expose(self, columns: Columns) -> None:
        """Expose the views ``columns`` (of the current storage) as :attr:`keys`, :attr:`values`, ..."""
        self.n = columns.n
        self._exposed = columns
        self._state_views = dict(columns.state)

    # What the layer holds, as ``[B, Hkv, n, ...]`` views of its storage during a pass. Between
    # passes a ragged layer's storage is packed and a quantized layer's keys and values are
    # codes (:meth:`end_pass`): reading these then gives new padded (dequantized) tensors,
    # and leaves the storage as it is.
    def _between_passes(self) -> bool:
        storage = self.storage
        return storage.packed is not None or storage.quantized is not None or storage.pruned is not None

    @property
    def keys(self) -> torch.Tensor:
        return (
            self.storage.dense("keys", self._free_positions(), self.n) if self._between_passes() else self._exposed.keys
        )

    @property
    def values(self) -> torch.Tensor:
        return (
            self.storage.dense("values", self._free_positions(), self.n)
            if self._between_passes()
            else self._exposed.values
        )

    @property
    def positions(self) -> torch.Tensor:
        """Absolute position of each entry in its own sequence ``[B, Hkv, n]`` (the model's RoPE
        position; negative for left padding and free slots, which are never valid)."""
        if self._between_passes():
            return self.storage.dense("positions", self._free_positions(), self.n)
        return self._exposed.positions

    @property
    def valid(self) -> torch.Tensor | None:
        """``[B, Hkv, n]`` bool once rows or heads hold different numbers of entries (left
        padding, head-wise budgets, ``keep=`` with prompts of different lengths): each is
        padded to the longest and its padding is masked out of attention and selection.
        ``None`` while every entry is real."""
        return (
            self.storage.dense("valid", self._free_positions(), self.n)
            if self._between_passes()
            else self._exposed.valid
        )

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The policy's per-token state by name, ``[B, Hkv, n, ...]``."""
        if not self._between_passes():
            return self._state_views
        free = self._free_positions()
        return {name: self.storage.dense(name, free, self.n) for name in self.storage.state}

    def _free_positions(self, before_pass: bool = False) -> torch.Tensor:
        """``[B]``: where free slots of unpacked storage sit, a past position of their row that
        no query of a pass has (``seen − 1``; −1 for a row that has seen nothing)."""
        seen = [row.sequence.start_seen if before_pass else row.seen for row in self.rows]
        return torch.tensor([s - 1 if s else -1 for s in seen], device=self.device)

    def end_pass(self) -> None:
        """At the end of a pass: the pass's views go (they may be of tensors an eviction
        replaced); a quantized cache's layer goes back to codes (:meth:`quantize`), and otherwise
        a layer whose rows or heads hold different numbers of entries keeps only its real
        entries until the next pass (its storage bytes follow them)."""
        self._pass_views, self.packed_pass = None, False
        if self.owner.quant is not None:
            self.quantize()
            return
        self.prune_key_channels()
        if self.is_initialized and self.storage.valid is not None and self.storage.packed is None:
            self.storage.pack(self.n, [row.start + row.width for row in self.rows])
            self.expose_nothing()  # no view of the old tensors

    def prune_key_channels(self) -> None:
        """At the end of a pass, once every row pruned its prompt's key channels (ThinK,
        :meth:`RowView.keep_channels`), the storage holds only the kept channels of those keys until
        the next pass, and every channel of the keys appended since
        (:meth:`~kvevict.storage.LayerStorage.keep_channels`)."""
        storage = self.storage
        masks = [row.channels for row in self.rows]
        if not self.n or storage.packed is not None or storage.pruned is not None or any(m is None for m in masks):
            return
        mask = torch.stack(masks)
        channels = mask.nonzero()[:, -1].view(*mask.shape[:2], -1).clone()  # (not a view of nonzero's [N, 3])
        pruned_at = torch.tensor([row.pruned_at for row in self.rows], device=self.device).view(-1, 1, 1)
        whole = storage.positions[:, :, : self.n] >= pruned_at
        if storage.valid is not None:
            whole &= storage.valid[:, :, : self.n]
        storage.keep_channels(channels, whole)
        self.expose_nothing()

    def quantize(self) -> None:
        """A quantized cache's layer holds its keys and values as codes until its next pass
        (:mod:`kvevict.quant`; a ragged layer's codes and tail are packed: its real entries only).
        A no-op without quantization."""
        if self.owner.quant is not None and self.is_initialized and self.n and self.storage.quantized is None:
            spans = [(row.start, row.width) for row in self.rows]
            self.storage.quantize(self.n, spans, self.owner.quant)
            self._pass_views = None
            self.expose_nothing()  # no view of the old tensors

    def attended(self) -> None:
        """Called by the attention path once this layer's pass attended and its policy ran: a
        quantized layer whose pass left nothing for later (no eviction waiting for the end of
        the prefill, no scoring pass of the policy's own) goes back to codes at once, so a
        pass holds one layer dequantized at a time."""
        owner = self.owner
        if (
            owner.side_pass is None
            and self.pending_pass is None
            and self.pending_eviction is None
            and not any(view.layer is self for view, _ in owner.deferred)
        ):
            self.quantize()
            if not owner.ends_passes:  # (a closed cache's passes have no end_pass)
                self.prune_key_channels()

    def unpack(self, before_pass: bool = False) -> None:
        """Before a pass (``before_pass``: its tokens are already counted) or a change of the
        rows: a packed layer back in padded storage, a quantized one dequantized."""
        if self.storage.packed is not None:
            room = max(row.interval for row in self.rows)
            self.refresh(self.storage.unpack(room, self._free_positions(before_pass)))
        elif self.storage.quantized is not None:
            self.storage.dequantize()
            if before_pass:  # the pass exposes its columns once it appended (_appended): not twice
                self._steady = None
            else:
                self.refresh()
        if self.storage.pruned is not None:
            self.storage.widen_keys()
            self.refresh()

    @property
    def policy(self) -> Any:
        return self.owner.policy

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def num_kv_heads(self) -> int:
        return self.storage.positions.shape[1]

    @property
    def length(self) -> int:
        """Storage columns in use (entries of the longest row and head)."""
        return self.n

    def _per_row(self, name: str) -> int | torch.Tensor:
        values = [getattr(row, name) for row in self.rows]
        if len(values) == 1:
            return values[0]
        return torch.tensor(values, device=self.device)[:, None, None]

    @property
    def seen(self) -> int | torch.Tensor:
        """Real tokens seen (an int; per row ``[B, 1, 1]`` for a batch, broadcasting with :attr:`positions`)."""
        return self._per_row("seen")

    @property
    def prompt_length(self) -> int | torch.Tensor:
        """Prompt tokens without padding (an int; per row ``[B, 1, 1]`` for a batch)."""
        return self._per_row("prompt_length")

    @property
    def budget(self) -> int | None | torch.Tensor:
        """The resolved budget (an int; per row ``[B, 1, 1]`` for a batch, ``keep=`` resolves per row)."""
        return None if self.rows[0].budget is None else self._per_row("budget")

    @property
    def decode_peak(self) -> int:
        """Most entries a row held during a decode pass (after appending, before evicting)."""
        return max(row.decode_peak for row in self.rows)

    @property
    def decode_step(self) -> int:
        """Tokens processed after the prompt (the same for every row)."""
        return self.rows[0].seen - self.rows[0].prompt_length

    @property
    def memo(self) -> dict[str, object]:
        """Per-layer policy data that is not per token (of the only row; see :meth:`row_view` for a batch)."""
        if len(self.rows) != 1:
            raise ValueError("a batched layer keeps policy data per row: read layer.row_view(b).memo")
        return self.rows[0].memo

    def head_lengths(self) -> torch.Tensor:
        """Real (unpadded) entries of each KV head, ``[B, Hkv]`` int64."""
        if self.valid is not None:
            return self.valid.sum(dim=-1)
        return torch.full(self.storage.positions.shape[:2], self.length, dtype=torch.long, device=self.device)

    def row_view(self, row: int) -> RowView:
        """Row ``row`` as a batch-1 layer holding that sequence alone (what policies see)."""
        return self._view_type()(self, row)

    def _view_type(self) -> type[RowView]:
        """A packed layer's views read it when they read it (:class:`~kvevict.packedpass.PackedRowView`)."""
        return RowView if self.storage.packed is None else PackedRowView

    def views(self) -> list[RowView]:
        """What the policy's hooks run on in this pass: one view of every row at once when the
        rows are in lockstep and the policy is :attr:`~kvevict.policies.Policy.batched` (its
        stages treat rows independently, so each row still gets what it gets alone), else a
        view per row. Lockstep: every row holds the same storage columns (from column 0 to
        :attr:`n`: no left padding), under the same budget and interval, on a full layer (a
        sliding window drops per row), has as many real tokens in this pass, passes and tokens
        after its prompt, and keeps the same policy data (``memo`` and ``shared`` keys, read
        stacked: :class:`~kvevict.rows.StackedRows`); prompt lengths may differ. Heads that
        hold different numbers of entries (head-wise budgets) may be in lockstep: the view
        then carries the rows' validity mask ``[B, Hkv, n]``, which every stage honours per
        row as it does for one row alone. In a decode pass such rows may even end at
        different columns (each row's longest head): the columns past a row's end are not
        valid, and the view says where each row's new entries lie
        (:attr:`~kvevict.rows.RowView.new_columns`), as long as every row is over its budget
        or none is (whether an eviction is due reads the view's length); during the prompt
        every row ends at ``n``."""
        rows, first = self.rows, self.rows[0]
        if len(rows) > 1 and self.policy.batched and self.window is None:
            step = first.seen - first.prompt_length
            shared = self.owner.row_shared
            ends_apart = self.valid is not None and phase_of(first.passes, self.prompt_pass) == "decode"
            budget = first.budget
            over = budget is not None and self.n > budget  # the view's eviction is due as each row's alone
            lockstep = all(
                row.start == 0
                and (row.width == self.n or (ends_apart and (budget is None or (row.width > budget) == over)))
                and (row.budget, row.interval, row.new, row.passes)
                == (first.budget, first.interval, first.new, first.passes)
                and row.seen - row.prompt_length == step
                and row.memo.keys() == first.memo.keys()
                and shared(i).keys() == shared(0).keys()
                for i, row in enumerate(rows)
            )
            if lockstep:
                return [self._view_type()(self, 0, len(rows))]
        return [self._view_type()(self, i) for i in range(len(rows))]

    # -- transformers' layer API ------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        self.rows = [RowState(sequence) for sequence in self.owner.sequences_of(key_states.shape[0])]
        self.storage.initialize(key_states, value_states)
        self.refresh(0)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        steady, owner, storage = self._steady, self.owner, self.storage
        self._steady_pass = (
            steady is not None
            and steady.version == storage.version  # no tensor replaced since the record
            and key_states.shape[2] == 1
            and key_states.shape[0] == len(self.rows)
            and owner.side_pass is None
            and owner.ends_passes
            and not (steady.inference and not torch.is_inference_mode_enabled())  # else leave_inference_mode
        )
        if self._steady_pass:  # a decode step as the last one: into the kept views of column n
            owner.advance(self.passes + 1, 1)
            steady.columns.append(key_states, value_states, self.rows[0].sequence.start_seen)
            return self._appended(1, storage.columns(self.n + 1))
        self.packed_pass = False
        if self.pending_pass is not None or self.pending_eviction is not None:  # a pass that raised
            self.observe_pending()
            self.evict_pending()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, num_new = key_states.shape[0], key_states.shape[2]
        if b != len(self.rows):
            raise ValueError(f"batch size changed from {len(self.rows)} to {b}: an EvictionCache holds one batch")
        owner.advance(self.passes + 1, num_new)
        if self._stays_packed(num_new):  # appended where its entries lie, attended there (attend_packed)
            return self.append_packed(key_states, value_states)
        self.unpack(before_pass=True)
        storage.leave_inference_mode()
        if owner.side_pass is None:  # a policy's own scoring pass is part of the pass it scores
            self.prompt_pass = self._is_prompt_pass(num_new)
        ends = [row.start + row.width for row in self.rows]
        storage.fit(self.n, num_new + max(row.interval for row in self.rows))  # e.g. a prompt's chunks are done
        storage.reserve(self.n, max(ends) + num_new)
        n = self.n
        if ends.count(n) == len(ends):  # rows end together: one slice
            seen = uniform([row.sequence.start_seen for row in self.rows], self.device)
            if isinstance(seen, int) and num_new == 1:  # a decode step: into the kept views of column n
                storage.append(n, key_states, value_states, seen)
            else:
                storage.keys[:, :, n : n + num_new] = key_states
                storage.values[:, :, n : n + num_new] = value_states
                storage.positions[:, :, n : n + num_new] = seen + torch.arange(num_new, device=self.device)
            if storage.valid is not None:
                storage.valid[:, :, n : n + num_new] = True
        else:  # each row appends at its own end
            assert storage.valid is not None  # rows end apart only once some are ragged
            for i, (row, end) in enumerate(zip(self.rows, ends)):
                storage.keys[i, :, end : end + num_new] = key_states[i]
                storage.values[i, :, end : end + num_new] = value_states[i]
                start = row.sequence.start_seen
                storage.positions[i, :, end : end + num_new] = torch.arange(start, start + num_new, device=self.device)
                storage.valid[i, :, end : end + num_new] = True
        return self._appended(num_new, storage.columns(max(ends) + num_new))

    def _appended(self, num_new: int, columns: Columns) -> tuple[torch.Tensor, torch.Tensor]:
        """Count the ``num_new`` columns every row just appended and expose ``columns``."""
        self._count_appended(num_new)
        self._expose(columns)
        mark_pending(self, self.keys)
        return self.keys, self.values

    def _count_appended(self, num_new: int) -> None:
        for row in self.rows:
            row.width += num_new
        self.tokens += num_new
        self.passes += 1
        self._num_new = num_new
        self._pass_views = None
        self._steady = None

    def get_seq_length(self) -> int:
        return self.tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, self.tokens - self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an EvictionCache cannot be cropped: evicted entries cannot be restored")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError(
            "beam search (and any decoding that reorders or regroups cache rows) is not supported with an "
            "EvictionCache: each row is evicted on its own; use greedy decoding or sampling (num_beams=1)"
        )

    batch_repeat_interleave = batch_select_indices = reorder_cache

    # -- rows of a batch that runs on (continuous batching) ---------------------------------
    def splice(self, row: int, source: EvictionLayer, sequence: SequenceState, source_row: int = 0) -> None:
        """Make batch row ``row`` (``batch_size``: a new last row) hold row ``source_row`` of
        ``source``, the same layer of another cache, exactly as ``source`` holds it: entries,
        positions, per-token state, peaks and policy memo, with the counters ``sequence`` (the
        cache's copy of the source's). Each row keeps its own columns from 0; columns past a
        row's width are invalid, so it attends exactly its own entries."""
        self.unpack()
        source.unpack()
        self.storage.ensure_valid([(r.start, r.start + r.width) for r in self.rows])
        if row == len(self.rows):
            self.storage.add_row()
            self.rows.append(RowState())
        theirs = source.rows[source_row]
        self.storage.reserve(self.n, theirs.width)
        self.storage.copy_row(row, source.storage, slice(theirs.start, theirs.start + theirs.width), source_row)
        spliced = RowState(sequence)
        spliced.width, spliced.peak, spliced.decode_peak, spliced.memo = (
            theirs.width,
            theirs.peak,
            theirs.decode_peak,
            theirs.memo,
        )
        spliced.channels, spliced.pruned_at = theirs.channels, theirs.pruned_at
        self.rows[row] = spliced
        self.tokens = max(self.tokens, source.tokens)
        self.compacted = True  # rows no longer share the model's own column layout
        self.refresh(max(r.start + r.width for r in self.rows))
        self.quantize()
        source.quantize()

    def remove_rows(self, rows: list[int]) -> None:
        """Drop batch rows ``rows`` (finished sequences); the others keep what they hold."""
        self.unpack()
        kept = [i for i in range(len(self.rows)) if i not in set(rows)]
        self.storage.select_rows(torch.tensor(kept, dtype=torch.long, device=self.device))
        self.rows = [self.rows[i] for i in kept]
        self.refresh(max(row.start + row.width for row in self.rows))
        self.quantize()

    def row_bytes(self) -> list[tuple[int, int]]:
        """Per row: (resident bytes, bytes of its real entries' keys and values). Resident is
        what the storage holds for the row: its share of the padded storage (capacity, room
        to grow and padding included) during a pass or for a layer whose rows and heads agree,
        else (packed between passes) its real entries with their positions and state."""
        if not self.is_initialized:
            return [(0, 0)] * len(self.rows)
        storage = self.storage
        kv_entry = sum(x.shape[-1] * x.element_size() for x in (storage.keys, storage.values))
        real = self.head_lengths().sum(dim=-1).tolist()
        if storage.packed is None:
            share = self.kv_bytes() // len(self.rows)
            return [(share, held * kv_entry) for held in real]
        packed = storage.packed
        per_entry = sum(x[:1].numel() * x.element_size() for x in packed.entries.values())
        mask = packed.held[0].numel() * packed.held.element_size()
        held = packed.row_capacities(len(self.rows))  # each row's entries and their room to grow
        return [(slots * per_entry + mask, count * kv_entry) for slots, count in zip(held, real)]

    def column_bytes(self) -> int:
        """Bytes one column of one row takes in padded storage: a key and a value per KV head,
        their positions, validity and per-token state (0 before the first pass)."""
        if not self.is_initialized:
            return 0
        entries = self.storage.entries().values()  # shapes [B, Hkv, capacity, ...] (packed: capacity 0)
        per_head = sum(math.prod(x.shape[3:]) * x.element_size() for x in entries) + torch.bool.itemsize  # + valid
        return self.storage.keys.shape[1] * per_head

    def storage_bytes(self) -> ColumnBytes:
        """:meth:`column_bytes` and, quantized, what a column holds between passes (:class:`ColumnBytes`)."""
        keys = self.storage.keys
        heads, head_dim = keys.shape[1], keys.shape[-1]
        return ColumnBytes.of(self.column_bytes(), heads, head_dim, keys.element_size(), self.owner.quant)

    def kv_bytes(self) -> int:
        """Bytes this layer's storage holds: keys, values, positions, validity, per-token state,
        the room to grow (of an arena's block, this layer's slice)."""
        return sum(x.numel() * x.element_size() for x in self.storage.tensors())

    def retained_bytes(self) -> int:
        """Bytes of the real entries' keys and values."""
        return sum(real for _, real in self.row_bytes())
