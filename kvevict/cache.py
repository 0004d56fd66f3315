"""Eviction-aware KV storage for transformers (DESIGN §1.1, §1.5).

:class:`EvictionLayer` is a cache *layer* in the style of transformers'
``DynamicSlidingWindowLayer``: keys/values ``[B, Hkv, n, d]`` physically shrink to the
budget; next to them live the absolute position of each entry ``[B, Hkv, n]`` and the
policy's per-token state ``{name: [B, Hkv, n, ...]}``, gathered with the entries on every
eviction so they never drift apart. Each KV head keeps its own set of tokens.

``get_seq_length()`` counts tokens *seen* (so new tokens get their absolute RoPE
positions) and ``get_mask_sizes()`` describes the *retained* entries as the most recent
``n`` positions before the query: every retained entry is in the past, so the standard
causal mask is exact and ``model.generate(..., past_key_values=cache)`` just works.

A sliding-window layer (Mistral, Gemma 2/3, gpt-oss, Qwen2 with ``use_sliding_window``) is
an :class:`EvictionLayer` with a ``window``: after every pass it first drops the entries no
later query can see (positions ``≤ seen − window``, as transformers'
``DynamicSlidingWindowLayer`` does, without telling the policy: they are not evicted, the
model would not see them either), then the policy evicts the rest to the budget as on a
full layer. It so never holds more than ``min(window, budget)`` + interval entries between
passes, and its mask is built from positions (:mod:`kvevict.attention`).

When a pass evicts: a layer observes the pass (the policy's signals, e.g. the new query's
attention row) inside its own attention; a prefill eviction runs there too (or, for policies
that rescore or allocate across layers, once the prefill forward ends). A decode step of a
full layer that holds one lockstep view of every row leaves all its per-token work for the
end of the pass (:class:`PassHook`): the new entries' state, the observation of the signals
its attention computed, the eviction. Nothing reads a layer's state between its attention
and the next pass, so the retained entries are the same, and this work runs back to back
for every layer, on warm CPU caches, rather than each piece between two streams of model
weights. The policy's scores are read then (a hidden-state score of the new token counts at
every layer: each hooked layer has seen it). Where the policy's stages allow it, the layers
that hold as many entries end their step as one batch of their rows (:class:`LayerStack`),
their storage one tensor per kind (:class:`LayerArena`): one write of the new state, one
observation, one minimum and one refill of the dropped slots for all of them, instead of
one of each per layer.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from typing import Any, Self

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs

from kvevict import attention
from kvevict.budgets import Budget
from kvevict.compat import pass_cache
from kvevict.hidden import HiddenStateRecorder
from kvevict.models import RotaryTable, check_policy_fits, check_supported
from kvevict.policies import Method, Policy, make_policy
from kvevict.signals import LogitSpec, Phase, Signals, attention_rows, compute_signals

SidePassObserver = Callable[["EvictionLayer", torch.Tensor, float, torch.nn.Module | None], None]
"""Receives ``(layer, query, scaling, attention module)`` of each layer during a scoring pass."""


class PassHook:
    """A forward hook on the model's decoder that ends every pass through its cache once the
    forward has run through every layer (:meth:`EvictionCache.finish_pass`): the decode-step
    evictions the layers left pending, then a deferred prefill eviction.

    Why a hook on the decoder: it is transformers' public extension point that fires after
    the last layer, whichever entry point ran the pass (``model.generate``, ``model(...)``,
    ``model.model(...)``), and it sees the pass's ``input_ids`` and ``past_key_values``, so
    only passes through its own cache act. The hook holds a weak reference to the cache."""

    def __init__(self, decoder: torch.nn.Module, cache: EvictionCache):
        self._decoder, self._cache = decoder, weakref.ref(cache)
        ref = self._cache

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
            owner = ref()
            if owner is not None and pass_cache(kwargs) is owner:
                input_ids = kwargs.get("input_ids", args[0] if args else None)
                with torch.no_grad():
                    owner.finish_pass(module, input_ids)

        handle = decoder.register_forward_hook(hook, with_kwargs=True)
        self._finalizer = weakref.finalize(cache, handle.remove)

    def close(self) -> None:
        self._finalizer()

    def __deepcopy__(self, memo: dict[int, Any]) -> PassHook:
        """A hook of its own for the copy of the cache (``copy.deepcopy`` of an
        ``EvictionCache`` maps the cache to its copy in ``memo``), on the same decoder."""
        cache = self._cache()
        return PassHook(self._decoder, memo.get(id(cache), cache))


@dataclass
class _PendingPass:
    """A layer's decode step whose per-token work waits for the end of the pass
    (:meth:`EvictionLayer.observe_pending`)."""

    view: RowView
    signals: Signals | None = None
    """The pass's signals, once the layer attended."""
    due: bool = False
    """Whether the pass evicts."""


class _Row:
    """Bookkeeping of one sequence (batch row) of a layer: what a batch-1 layer holds as ints."""

    __slots__ = (
        "budget",
        "decode_peak",
        "interval",
        "memo",
        "new",
        "passes",
        "peak",
        "prompt_length",
        "seen",
        "start",
        "width",
    )

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
        self.decode_peak = 0
        self.peak = 0
        """Most entries a head of this row held at any moment (after an append, before evicting)."""
        self.start = 0
        """First storage column of this row (its left padding, until the first eviction)."""
        self.width = 0
        """Storage columns ``start .. start + width`` hold this row (its longest head)."""
        self.memo: dict[str, object] = {}


class _Columns:
    """Views of a layer's storage for one column count ``n``: its first ``n`` columns (what
    :attr:`EvictionLayer.keys`, ... expose) and, once asked for, column ``n`` (where a decode
    step appends). Why keep them: making a view is a dispatch, which costs microseconds on a
    CPU whose caches the model's weights just streamed through, in every layer of every
    pass; a decode step at interval 1 alternates between two column counts."""

    __slots__ = ("_grown", "_names", "_next", "_storage", "keys", "n", "positions", "state", "valid", "values")

    def __init__(self, storage: tuple[torch.Tensor | None, ...], names: Iterable[str], n: int):
        keys, values, positions, valid, *state = storage
        self._storage, self._names, self.n, self._next, self._grown = storage, tuple(names), n, None, None
        self.keys, self.values, self.positions = (x.narrow(2, 0, n) for x in (keys, values, positions))
        self.valid = None if valid is None else valid.narrow(2, 0, n)
        self.state = {name: value.narrow(2, 0, n) for name, value in zip(names, state)}

    def next_column(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Column ``n`` of the keys, values and positions ``[B, Hkv, 1, ...]`` (the storage has room for it)."""
        if self._next is None:
            self._next = tuple(x.narrow(2, self.n, 1) for x in self._storage[:3])
        return self._next

    def append(self, keys: torch.Tensor, values: torch.Tensor, position: int) -> None:
        """Write one decode step's entry ``[B, Hkv, 1, ...]`` of every row, at ``position``, into column ``n``."""
        new_keys, new_values, new_positions = self.next_column()
        new_keys.copy_(keys)
        new_values.copy_(values)
        new_positions.fill_(position)

    def grown(self) -> _Columns:
        """The views of the same storage's first ``n + 1`` columns (a decode step's append)."""
        if self._grown is None:
            self._grown = _Columns(self._storage, self._names, self.n + 1)
        return self._grown


class EvictionLayer(DynamicLayer):
    """One attention layer of an :class:`EvictionCache`: full attention, or a sliding
    window of ``window`` positions (a query at ``p`` sees keys at ``> p − window``).

    Storage is preallocated (``budget + interval`` entries once evicting) and shared by the
    rows of a batch: row ``b`` occupies columns ``[start_b, start_b + width_b)``; columns a
    row or a head does not hold (left padding of its prompt, rows or heads keeping fewer
    entries) are marked false in :attr:`valid` and masked out of attention and selection.
    Entries are *not* sorted by position: an evicted entry's slot is reused by an entry from
    the end (O(1) data movement per evicted entry), and :attr:`positions` says where each
    entry sits in its sequence (masks, windows included, are built from them).

    The policy never sees the batch: every hook runs on a :class:`RowView`, which holds one
    row exactly as a batch-1 layer holding that prompt alone would (same entries in the same
    order, same counters), so a batch gives each row what it gets alone.
    """

    is_croppable = False

    def __init__(self, owner: EvictionCache, layer_idx: int, window: int | None = None):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.window = window
        self.is_sliding = window is not None  # transformers builds sliding masks from such layers
        self._clear()

    def _clear(self) -> None:
        self.tokens = 0
        """Columns of every pass so far, padding included (transformers' ``cache_position``)."""
        self.passes = 0
        self.prompt_pass = False
        """Whether the current pass is (a chunk of) the prompt: prefill-time policies score it."""
        self.prompt_open = True
        """Whether a later pass of several tokens may still be a chunk of the prompt."""
        self.rows: list[_Row] = [_Row()]
        self.compacted = False
        """Whether an eviction reordered the storage (until then it is the model's own layout)."""
        self._num_new = 0
        self._capacity = 0
        self._keys = self._values = torch.empty(0, 0, 0, 0)
        self._positions = torch.empty(0, 0, 0, dtype=torch.long)
        self._valid: torch.Tensor | None = None
        self._state: dict[str, torch.Tensor] = {}
        self._pass_views: list[RowView] | None = None
        """The row views of the pass under way, from :meth:`begin_pass` to its eviction."""
        self.pending_pass: _PendingPass | None = None
        """A decode step's work left for the end of the pass (:meth:`observe_pending`)."""
        self.pending_eviction: tuple[RowView, Signals] | None = None
        """A decode step's eviction left for the end of the pass (:meth:`evict_pending`)."""
        self._viewed: tuple[torch.Tensor | None, ...] = ()
        self._column_views: dict[int, _Columns] = {}
        self._steady_pass = False
        """Whether the pass under way appended by the steady path (:meth:`settle`)."""
        self._refresh(0)

    def _refresh(self, n: int) -> None:
        """Expose the first ``n`` storage columns as :attr:`keys`, :attr:`values`, ... Every
        change of the storage ends here, so this also drops the steady record (:meth:`settle`;
        the two that do not end here at once, :meth:`_reserve` and :meth:`_ensure_valid`, drop it
        themselves)."""
        self._steady: tuple[_Columns, bool] | None = None
        """The views of the first ``n`` columns and whether the storage was made under
        ``inference_mode``, while the next decode step may take the steady path (:meth:`settle`)."""
        self._expose(self._columns(n))

    def _expose(self, columns: _Columns) -> None:
        """Expose the views ``columns`` (of the current storage) as :attr:`keys`, :attr:`values`, ..."""
        self.n = columns.n
        self._exposed = columns
        self.keys, self.values = columns.keys, columns.values
        self.positions = columns.positions
        """Absolute position of each entry in its own sequence ``[B, Hkv, n]`` (the model's RoPE
        position; negative for left padding, which is never valid)."""
        self.valid = columns.valid
        """``[B, Hkv, n]`` bool once rows or heads hold different numbers of entries (left
        padding, head-wise budgets, ``keep=`` with prompts of different lengths): each is
        padded to the longest and its padding is masked out of attention and selection.
        ``None`` while every entry is real."""
        self.state = dict(columns.state)

    def _columns(self, n: int) -> _Columns:
        """The views of the first ``n`` storage columns, made anew only when a storage tensor
        was replaced (compared by identity, so a kept view never outlives its tensor)."""
        storage = (self._keys, self._values, self._positions, self._valid, *self._state.values())
        if not _same_objects(storage, self._viewed):
            self._viewed, self._column_views = storage, {}
        columns = self._column_views.get(n)
        if columns is None:
            if len(self._column_views) == 2:  # the two column counts a decode step alternates between
                del self._column_views[next(iter(self._column_views))]
            columns = self._column_views[n] = _Columns(storage, self._state.keys(), n)
        return columns

    def storage(self) -> dict[str, torch.Tensor]:
        """Every per-entry storage tensor but :attr:`valid` (whole capacity), by name."""
        return {"keys": self._keys, "values": self._values, "positions": self._positions, **self._state}

    @property
    def policy(self) -> Policy:
        return self.owner.policy

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

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
        return torch.full(self.keys.shape[:2], self.length, dtype=torch.long, device=self.device)

    def row_view(self, row: int) -> RowView:
        """Row ``row`` as a batch-1 layer holding that sequence alone (what policies see)."""
        return RowView(self, row)

    def views(self) -> list[RowView]:
        """What the policy's hooks run on in this pass: one view of every row at once when the
        rows are in lockstep and the policy is :attr:`~kvevict.policies.Policy.batched` (its
        stages treat rows independently, so each row still gets what it gets alone), else a
        view per row. Lockstep: every row holds the same storage columns, all real (no
        padding, no head-wise ragged rows), under the same budget and interval, on a full
        layer (a sliding window drops per row), has as many real tokens in this pass, passes
        and tokens after its prompt; prompt lengths may differ."""
        rows, first = self.rows, self.rows[0]
        if len(rows) > 1 and self.policy.batched and self.window is None and self.valid is None:
            step = first.seen - first.prompt_length
            lockstep = all(
                row.start == 0
                and row.width == self.n
                and (row.budget, row.interval, row.new, row.passes)
                == (first.budget, first.interval, first.new, first.passes)
                and row.seen - row.prompt_length == step
                for row in rows
            )
            if lockstep:
                return [RowView(self, 0, len(rows))]
        return [RowView(self, i) for i in range(len(rows))]

    # -- transformers' layer API ------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        b, h = key_states.shape[:2]
        self.rows = [_Row() for _ in range(b)]
        self._keys = key_states.new_zeros(b, h, 0, key_states.shape[-1])
        self._values = value_states.new_zeros(b, h, 0, value_states.shape[-1])
        self._positions = torch.zeros(b, h, 0, dtype=torch.long, device=self.device)
        self._refresh(0)

    def _reserve(self, needed: int) -> None:
        """Make room for ``needed`` storage columns (grown geometrically: appends are O(1) amortised)."""
        if needed <= self._capacity:
            return
        capacity = max(needed, self._capacity + self._capacity // 2)

        def grow(x: torch.Tensor) -> torch.Tensor:
            bigger = x.new_zeros(*x.shape[:2], capacity, *x.shape[3:])
            bigger[:, :, : self.n] = x[:, :, : self.n]
            return bigger

        self._keys, self._values, self._positions = grow(self._keys), grow(self._values), grow(self._positions)
        self._valid = None if self._valid is None else grow(self._valid)
        self._state = {name: grow(value) for name, value in self._state.items()}
        self._capacity = capacity
        self._steady = None  # its views are of the old tensors

    def _leave_inference_mode(self) -> None:
        """Storage is written in place, which torch forbids on tensors made under ``inference_mode``
        once that mode is left (e.g. ``kvevict.answer`` filled the cache and the caller goes on
        under ``no_grad``): copy it once into ordinary tensors."""
        if torch.is_inference_mode_enabled() or not self._keys.is_inference():
            return
        self._keys, self._values, self._positions = (x.clone() for x in (self._keys, self._values, self._positions))
        self._valid = None if self._valid is None else self._valid.clone()
        self._state = {name: value.clone() for name, value in self._state.items()}
        self._refresh(self.n)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        steady = self._steady
        self._steady_pass = (
            steady is not None
            and key_states.shape[2] == 1
            and key_states.shape[0] == len(self.rows)
            and self.owner.side_pass is None
            and self.owner.ends_passes
            and not (steady[1] and not torch.is_inference_mode_enabled())  # else _leave_inference_mode
        )
        if self._steady_pass:  # a decode step as the last one: into the kept views of column n
            steady[0].append(key_states, value_states, self.rows[0].seen)
            return self._appended(1, steady[0].grown())
        if self.pending_pass is not None or self.pending_eviction is not None:  # a pass that raised
            self.observe_pending()
            self.evict_pending()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, num_new = key_states.shape[0], key_states.shape[2]
        self._leave_inference_mode()
        if b != len(self.rows):
            raise ValueError(f"batch size changed from {len(self.rows)} to {b}: an EvictionCache holds one batch")
        if self.owner.side_pass is None:  # a policy's own scoring pass is part of the pass it scores
            self.prompt_pass = self._is_prompt_pass(num_new)
        ends = [row.start + row.width for row in self.rows]
        self._reserve(max(ends) + num_new)
        if ends.count(self.n) == len(ends):  # rows end together: one slice
            seen = _uniform([row.seen for row in self.rows], self.device)
            if isinstance(seen, int) and num_new == 1:  # a decode step: into the kept views of column n
                self._columns(self.n).append(key_states, value_states, seen)
            else:
                self._keys[:, :, self.n : self.n + num_new] = key_states
                self._values[:, :, self.n : self.n + num_new] = value_states
                self._positions[:, :, self.n : self.n + num_new] = seen + torch.arange(num_new, device=self.device)
            if self._valid is not None:
                self._valid[:, :, self.n : self.n + num_new] = True
        else:  # each row appends at its own end
            for i, (row, end) in enumerate(zip(self.rows, ends)):
                self._keys[i, :, end : end + num_new] = key_states[i]
                self._values[i, :, end : end + num_new] = value_states[i]
                self._positions[i, :, end : end + num_new] = torch.arange(
                    row.seen, row.seen + num_new, device=self.device
                )
                self._valid[i, :, end : end + num_new] = True
        return self._appended(num_new, self._columns(max(ends) + num_new))

    def _appended(self, num_new: int, columns: _Columns) -> tuple[torch.Tensor, torch.Tensor]:
        """Count the ``num_new`` columns every row just appended and expose ``columns``."""
        for row in self.rows:
            row.width += num_new
            row.seen += num_new
            row.new = num_new
        self.tokens += num_new
        self.passes += 1
        self._num_new = num_new
        self._pass_views = None
        self._steady = None
        self._expose(columns)
        attention.mark_pending(self, self.keys)
        return self.keys, self.values

    def settle(self) -> None:
        """A decode step of this layer ended at the end of its pass (:meth:`_ends_with_pass`):
        record whether the next one may take the steady path, which decides nothing anew.

        Why: in the steady state of decoding (one view holding the whole storage, every row
        aligned at one position, room for one more column) each step of each layer would make
        the same checks — prompt chunk or not, rows' ends, room, padding, lockstep, whether the
        step waits for the end of the pass — at a few microseconds each (on a CPU whose caches
        the model's weights just streamed through), in every layer of every step. They cannot
        change before the next pass unless the storage does, and every change of the storage
        drops the record (:meth:`_refresh`). What the pass itself brings is still checked: one
        new token per row, no padding in the model's mask (:meth:`begin_pass`), no scoring
        pass, the passes still ending here, the same ``inference_mode``."""
        rows, n = self.rows, self.n
        if (
            self.owner.steady_steps
            and self._valid is None
            and n < self._capacity
            and all(row.start == 0 and row.width == n and row.seen == rows[0].seen for row in rows)
        ):
            self._steady = (self._exposed, self._keys.is_inference())

    def _is_prompt_pass(self, num_new: int) -> bool:
        """Whether a pass of ``num_new`` tokens (about to be appended) continues the prompt.

        The first pass is the prompt. Later ones are chunks of it (``generate(...,
        prefill_chunk_size=C)`` gives the cache no other sign) while the prompt is open: up to
        the whole prompt's length when the cache was told it (``prompt_length=``), else every
        pass of more than one token. The first pass that is not a chunk (a single decode
        token, or :meth:`EvictionCache.end_prompt`) closes the prompt for good."""
        if self.passes == 0:
            return True
        if self.prompt_open:
            whole = self.owner.prompt_length
            self.prompt_open = self.tokens < whole if whole is not None else num_new > 1
        return self.prompt_open

    def _continue_prompt(self, row: _Row) -> None:
        """A later chunk of the prompt: its tokens are prompt tokens of ``row`` (``decode_step`` stays 0)."""
        if self.policy.deferred_prefill:
            raise ValueError(
                f"policy {self.policy.name!r} evicts the prefill once the whole prompt has run through every layer "
                "(a scoring pass, or one budget across layers), so it cannot compress a prompt chunk by chunk: "
                "prefill the prompt in one pass (no prefill_chunk_size / prefill_chunk)"
            )
        if self.owner.budget.keep is not None and self.owner.prompt_length is None:
            raise ValueError(
                "keep= is a fraction of the whole prompt, which a prompt prefilled in chunks does not tell the cache "
                "up front: give EvictionCache(..., prompt_length=<prompt tokens>) or a token budget (budget=)"
            )
        row.prompt_length = row.seen

    def begin_pass(self, attention_mask: torch.Tensor | None) -> None:
        """Called by the attention path before the kernel: learn each row's padding in this pass
        from the model's mask (any pass: :meth:`_drop_padding`); start the rows that got their
        first real tokens; then give the policy the new entries' state.

        Why the mask: transformers hands a cache layer only keys and values, but passes the
        attention function the mask it built from the 2-D ``attention_mask``, in which a real
        token sees its own key (even in a sliding window) and a padding one does not.
        ``generate`` gives real token ``i`` of a row the RoPE position ``i`` (the cumulative
        sum of the mask), so a row's positions count its real tokens only."""
        real = _real_columns(attention_mask, self._num_new, len(self.rows))
        steady = self._steady_pass and real is None  # one view holds the whole storage, as in the last pass
        if real is not None:
            self._drop_padding((self._num_new - real.sum(dim=-1)).tolist())
        if self.passes == 1:
            self.owner.row_offsets = [row.start for row in self.rows]
        for row in self.rows:
            if row.new:  # a row whose pass is only padding does not take part in it, as alone
                row.passes += 1
                if row.passes == 1:
                    self._start_row(row)
                elif self.prompt_pass and self.owner.side_pass is None:
                    self._continue_prompt(row)
        views = [RowView(self, 0, len(self.rows))] if steady else self.views()
        if steady or self._ends_with_pass(views):  # its state, observation and eviction wait for the end of the pass
            self.pending_pass = _PendingPass(views[0])
            self.owner.pending.append(self)
            self._pass_views = views
        else:
            self._pass_views = self._start_tokens(views)
        for row in self.rows:
            row.peak = max(row.peak, row.width)
            if row.passes > 1 and not self.prompt_pass:
                row.decode_peak = max(row.decode_peak, row.width)

    def _start_tokens(self, views: list[RowView]) -> list[RowView]:
        """Write the policy's initial state of the pass's new entries; returns the views of
        the pass (made again when a state entry is new: a view made before it lacks it)."""
        names = len(self._state)
        for view in views:
            if not view.num_new:
                continue
            for name, value in self.policy.new_tokens(view, view.num_new).items():
                if name not in self._state:
                    self._state[name] = value.new_zeros(
                        len(self.rows), value.shape[1], self._capacity, *value.shape[3:]
                    )
                end = view.columns.stop
                self._state[name][view.rows, :, end - view.num_new : end] = value
        if len(self._state) == names:  # written in place, into what `state` and the views show
            return views
        self._refresh(self.n)
        return self.views()

    def _ends_with_pass(self, views: list[RowView]) -> bool:
        """Whether this pass is a decode step of one view holding the whole storage on a full
        layer, whose every per-token step (the new entries' state, the observation, the
        eviction) may wait for the end of the pass (:class:`PassHook`): nothing reads the
        layer's state before then (no output correction, no scoring pass of the policy's own)."""
        return (
            self.owner.ends_passes
            and self.owner.side_pass is None
            and self.window is None
            and len(views) == 1
            and views[0].num_new > 0
            and views[0].phase() == "decode"
            and self._holds_everything(views[0])
            and not self.policy.corrects_output
        )

    def pending_view(self) -> RowView | None:
        """The view of the decode step this layer left for the end of the pass, if any."""
        if self.pending_pass is not None:
            return self.pending_pass.view
        return None if self.pending_eviction is None else self.pending_eviction[0]

    def observe_pending(self) -> None:
        """The per-token work a decode step left for the end of the pass (:meth:`_ends_with_pass`):
        the new entries' state, then the policy's observation of the pass's signals (when the
        layer attended), and the eviction then due waits in :attr:`pending_eviction`."""
        pending, self.pending_pass = self.pending_pass, None
        if pending is None:
            return
        view = self._start_tokens([pending.view])[0]
        if pending.signals is None:  # the pass raised before this layer attended
            return
        self.policy.observe(view, pending.signals)
        view.write_back()
        if pending.due:
            self.pending_eviction = (view, pending.signals)

    def _drop_padding(self, pads: list[int]) -> None:
        """Take this pass's left padding (``pads[b]`` columns of row ``b``) out of the rows, in
        any pass: the prompt's, or a later one (a question of another length, a chunk that is
        still padding for a short row). A row with no real token yet just starts after it (its
        left padding); otherwise the pass's real entries move onto the padding, right after
        the row's older entries, as they lie alone. The columns this frees are masked out and
        given the padding queries' positions (``−pad .. −1``): a padding query sees only that
        column (:func:`kvevict.attention`), so it stays finite and no real query sees it.
        Real entries get consecutive positions, as ``generate`` gives them (cumulative mask)."""
        num_new = self._num_new
        if self.owner.hidden is not None and (self.passes > 1 or num_new in pads):
            raise ValueError(
                f"policy {self.policy.name!r} reads hidden states by column, which allows padding only on the left "
                "of the first pass, with a real token in every row: pad the whole prompt on the left and feed it in "
                "one pass, then decode (or batch prompts of equal length)"
            )
        if self._valid is None:
            self._valid = torch.zeros(self._positions.shape, dtype=torch.bool, device=self.device)
            self._valid[:, :, : self.n] = True
        for i, (row, pad) in enumerate(zip(self.rows, pads)):
            if not pad:
                continue
            first, real = row.start + row.width - num_new, num_new - pad
            positions = row.seen - num_new + torch.arange(real, device=self.device)
            if not row.passes:  # nothing real before: the padding is the row's left padding
                row.start += pad
                self._positions[i, :, first + pad : first + num_new] = positions
                freed = slice(first, first + pad)
            else:  # the model's layout no longer holds: masks are built from positions from now on
                for storage in (self._keys, self._values):
                    storage[i, :, first : first + real] = storage[i, :, first + pad : first + num_new].clone()
                self._positions[i, :, first : first + real] = positions
                freed = slice(first + real, first + num_new)
                self.compacted = True
            self._positions[i, :, freed] = torch.arange(-pad, 0, device=self.device)
            self._valid[i, :, freed] = False
            row.width -= pad
            row.seen -= pad
            row.new = real
        self._refresh(self.n)

    def _start_row(self, row: _Row) -> None:
        """A row's first real tokens are its prompt: resolve its budget (``keep=``) and interval."""
        row.prompt_length = row.new
        whole = self.owner.prompt_length  # columns of the whole prompt (chunked prefill), padding included
        row.budget = self.owner.budget.resolve(row.new if whole is None else whole - (self.tokens - row.new))
        if self.owner.budget.keep is not None:  # a token budget was checked up front
            self.policy.check_budget(row.budget)
        row.interval = self.owner.interval or (row.budget and self.policy.default_interval(row.budget)) or 1

    def query_positions(self, q: int) -> torch.Tensor:
        """Positions of the pass's ``q`` queries, ``[B, 1, q, 1]``: each row's newest real
        tokens, after its padding queries at ``−pad .. −1`` (see :meth:`_drop_padding`)."""
        seen = torch.tensor([row.seen for row in self.rows], device=self.device)[:, None]
        pad = torch.tensor([q - row.new for row in self.rows], device=self.device)[:, None]
        column = torch.arange(q, device=self.device)
        return torch.where(column >= pad, seen - q + column, column - pad)[:, None, :, None]

    @property
    def padded(self) -> bool:
        """Whether this pass holds padding (a row with fewer real tokens than the pass's columns)."""
        return any(row.new < self._num_new for row in self.rows)

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

    # -- eviction -----------------------------------------------------------------------
    def phase(self) -> Phase:
        """``prefill`` during the first pass and the later chunks of the prompt (a :class:`RowView`
        counts only its row's passes with real tokens)."""
        return "prefill" if self.passes == 1 or self.prompt_pass else "decode"

    def correct_output(self, query: torch.Tensor, output: torch.Tensor, scaling: float) -> torch.Tensor:
        """The policy's correction of the kernel's output ``[B, q, Hq, d]``, row by row."""
        rows = []
        for view in self._views_of_pass():
            if not view.num_new:
                rows.append(output[view.rows])
                continue
            real = slice(query.shape[2] - view.num_new, None)
            corrected = self.policy.correct_output(view, query[view.rows, :, real], output[view.rows, real], scaling)
            rows.append(torch.cat([output[view.rows, : real.start], corrected], dim=1))
        return torch.cat(rows)

    def decode_row(self, query: torch.Tensor, spec: LogitSpec) -> torch.Tensor | None:
        """The new query's attention probabilities ``[B, Hq, 1, n]`` (fp32) over this layer's
        entries, when the attention path may attend by them instead of calling the kernel: a
        decode step of one view over the whole storage, on a full-attention layer, after the
        first eviction (until then the model's own kernel runs, bit-identical to no eviction),
        and either the policy reads them this step (the last query's row, or column sums,
        which one query makes the same: the kernel would compute the logits a second time) or
        the step runs on a CPU, where one grouped product per KV head attends a single query as
        fast as the sdpa kernel at batch 1 and faster at batch 8 (paired steps on SmolLM2, see
        the README's decode-step cost). None otherwise."""
        on_cpu = query.is_cpu
        if query.shape[-2] != 1 or not self.compacted or self.window is not None:
            return None
        if not (on_cpu or self.policy.reads_decode_row):
            return None
        views = self._pass_views
        if views is None or len(views) != 1:
            return None
        view = views[0]
        if view.keys is not self.keys or not view.num_new:
            return None
        if not on_cpu:  # the policy reads the row only at some steps (an eviction's, say)
            phase = view.phase()
            requirements = self.policy.requirements(phase, view.eviction_due(phase, 1))
            if not (requirements.last_query_attention or requirements.column_sums):
                return None
        return attention_rows(query, view.keys, spec, view.valid)

    def after_attention(
        self,
        query: torch.Tensor,
        scaling: float | LogitSpec,
        module: torch.nn.Module | None = None,
        row: torch.Tensor | None = None,
    ) -> None:
        """Called by the attention path once this pass attended: for each row, compute the
        signals the policy asked for (with the kernel's logit recipe ``scaling``, see
        :class:`~kvevict.signals.LogitSpec`; ``row``: the :meth:`decode_row` the pass attended
        by), let it observe them, drop what left a sliding window, and evict down to the row's
        budget when due (or defer that eviction to the end of the prefill forward,
        :meth:`EvictionCache.finish_prefill`)."""
        if self.owner.side_pass is not None:  # a scoring pass of the policy's own (KVzip's repeat)
            self.owner.side_pass(self, query, scaling, module)
            return
        rows, changed = [], False
        views, self._pass_views = self._views_of_pass(), None
        if self.pending_pass is not None:  # observed and evicted at the end of the pass
            view = self.pending_pass.view
            phase = view.phase()
            self.pending_pass.due = due = view.eviction_due(phase, view.num_new)
            requirements = self.policy.requirements(phase, due)
            self.pending_pass.signals = compute_signals(requirements, view, phase, query, scaling, module, row)
            return
        for view in views:
            if not view.num_new:  # only padding in this pass: nothing to observe or evict
                rows.append((view, None))
                continue
            phase = view.phase()
            due = view.eviction_due(phase, view.num_new)
            requirements = self.policy.requirements(phase, due)
            whole = view.num_new == query.shape[-2] and view.rows == slice(0, len(self.rows))
            view_query = query if whole else query[view.rows, :, -view.num_new :]
            signals = compute_signals(requirements, view, phase, view_query, scaling, module, row)
            self.policy.observe(view, signals)
            dropped = view.drop_outside_window()
            deferred = due and phase == "prefill" and self.policy.deferred_prefill
            if deferred:
                self.owner.deferred.append((view, signals))
            elif due and not dropped and self._holds_everything(view):  # one view: every row, every entry
                if phase == "decode" and self.owner.ends_passes:  # at the end of the pass (module docstring)
                    self.pending_eviction = (view, signals)
                    self.owner.pending.append(self)
                else:
                    self._evict_whole(view, signals)
                return
            keep = self.policy.select(view, signals, view.budget) if due and not deferred else None
            view.write_back()
            rows.append((view, keep))
            changed |= not deferred and (keep is not None or dropped)
        if changed:
            self._keep_rows(rows)

    def evict_pending(self) -> None:
        """Run the eviction :meth:`after_attention` or :meth:`observe_pending` left for the end of the pass, if any."""
        if self.pending_eviction is not None:
            view, signals = self.pending_eviction
            self.pending_eviction = None
            self._evict_whole(view, signals)

    def _evict_whole(self, view: RowView, signals: Signals) -> None:
        """Evict ``view``, the whole storage (:meth:`_holds_everything`), to its budget: one
        entry per head by its minimum when that is the eviction (a decode step's, usually),
        else by the policy's selection."""
        slots = self.policy.drop_lowest(view, signals, view.budget)
        if slots is not None:
            self._drop_slots(view, slots)
            return
        keep = self.policy.select(view, signals, view.budget)
        view.write_back()
        self._keep_rows([(view, keep)])

    def _views_of_pass(self) -> list[RowView]:
        """The views :meth:`begin_pass` made for this pass (or new ones, for a pass that did not begin here)."""
        return self._pass_views if self._pass_views is not None else self.views()

    def keep(self, mask: torch.Tensor) -> None:
        """Retain the entries where ``mask`` ``[B, Hkv, n]`` (storage columns) is true."""
        self._keep_rows([(view, mask[view.rows, :, view.columns]) for view in self.views()])

    def _keep_rows(self, rows: list[tuple[RowView, torch.Tensor | None]]) -> None:
        """Retain, per view, the entries its mask ``[b, Hkv, width]`` (row columns; None: every
        held one) keeps, among the ones its view holds (``view.valid``: padding and entries
        that left a sliding window never survive, and are not reported to the policy as
        evicted). Per head, a kept entry stays in its slot and the slots of dropped entries are
        refilled from the end: O(dropped) data movement, and a row's layout depends only on
        that row (the same as alone). When only entries that left a sliding window go, the
        rest keep their position order instead (as transformers' own sliding layer)."""
        width = max(row.width for row in self.rows)
        kept = []
        for view, keep in rows:
            held = view.valid
            if keep is None:
                keep = held if held is not None else torch.ones_like(view.positions, dtype=torch.bool)
            elif held is not None:
                keep = keep & held
            if self.policy.watches_evictions:
                self.policy.on_evict(view, ~keep if held is None else held & ~keep)
            view.write_back()
            kept.append(keep)
        whole = len(rows) == 1 and kept[0].shape == (len(self.rows), self.num_kv_heads, width)  # one view, every row
        if whole and rows[0][1] is not None and self._valid is None and width == self.n and self._drop_one(kept[0]):
            return
        if whole:
            relative = kept[0]
        else:
            relative = torch.zeros(len(self.rows), self.num_kv_heads, width, dtype=torch.bool, device=self.device)
            for (view, _), keep in zip(rows, kept):
                relative[view.rows, :, : view.length] = keep
        counts = relative.sum(dim=-1)  # [B, Hkv]
        index = torch.arange(width, device=self.device)
        prefix = index < counts[..., None]
        holes, movers = (prefix & ~relative).nonzero(), (~prefix & relative).nonzero()
        new_n = int(counts.max())
        aligned = all(row.start == 0 for row in self.rows)
        ordered = all(keep is None for _, keep in rows)  # only entries that left a sliding window go
        if aligned and not ordered:  # in place: each mover fills a hole
            b, h, dst, src = holes[:, 0], holes[:, 1], holes[:, 2], movers[:, 2]
            for storage in (self._keys, self._values, self._positions, *self._state.values()):
                storage[b, h, dst] = storage[b, h, src]
        else:  # rows move to column 0: once for a left-padded batch, or keeping position order
            if ordered:  # as transformers' sliding layer (O(window)): a layer that never evicted stays bit-identical
                source = relative.to(torch.int8).argsort(dim=-1, descending=True, stable=True)
            else:
                source = index.expand(*counts.shape, width).clone()
                source[holes[:, 0], holes[:, 1], holes[:, 2]] = movers[:, 2]
            starts = torch.tensor([row.start for row in self.rows], device=self.device)[:, None, None]
            source = (source[..., :new_n] + starts).clamp(max=self.n - 1)  # beyond a head's count: unused
            capacity = new_n + max(row.interval for row in self.rows)
            self._keys, self._values, self._positions = (
                _gather(x, source, capacity) for x in (self._keys, self._values, self._positions)
            )
            self._state = {name: _gather(value, source, capacity) for name, value in self._state.items()}
            self._capacity = capacity
        uniform = bool((counts == new_n).all())
        if uniform:
            self._valid = None
        else:
            self._valid = torch.zeros(self._positions.shape, dtype=torch.bool, device=self.device)
            self._valid[:, :, :new_n] = prefix[..., :new_n]
        for row, longest in zip(self.rows, counts.max(dim=1).values.tolist()):
            row.start, row.width = 0, longest
        # the model's own mask still fits a layout that only lost its oldest entries, in order
        self.compacted = self.compacted or not (ordered and aligned and uniform)
        self._refresh(new_n)

    def _holds_everything(self, view: RowView) -> bool:
        """Whether ``view`` is the whole storage: every row, every column, all real."""
        return (
            self._valid is None
            and view.rows.stop - view.rows.start == len(self.rows)
            and view.columns == slice(0, self.n)
        )

    def _drop_slots(self, view: RowView, slots: torch.Tensor) -> None:
        """Evict entry ``slots[b, h]`` of every head of ``view``, the whole storage
        (:meth:`_holds_everything`): what :meth:`_keep_rows` does with the mask of every entry
        but those, without building it (unless a stage watches evictions)."""
        if self.policy.watches_evictions:
            evicted = torch.zeros(view.positions.shape, dtype=torch.bool, device=self.device)
            self.policy.on_evict(view, evicted.scatter_(-1, slots[..., None], True))
        view.write_back()
        self._fill_from_last(slots)

    def _drop_one(self, keep: torch.Tensor) -> bool:
        """A decode step's eviction, the common case of :meth:`_keep_rows`: every head of every
        row (all real, aligned) drops exactly one entry (:meth:`_fill_from_last`). Returns
        False, having done nothing, for any other mask."""
        dropped = ~keep
        if not bool((dropped.sum(dim=-1) == 1).all()):
            return False
        self._fill_from_last(dropped.to(torch.uint8).argmax(dim=-1))
        return True

    def _fill_from_last(self, slots: torch.Tensor) -> None:
        """Drop entry ``slots[b, h]`` ``[B, Hkv]`` of every head (all real, aligned): the entry of
        the last column takes its slot, as the general path of :meth:`_keep_rows` moves it, by
        one ``scatter_`` per storage tensor."""
        _move_last_into(self.storage().values(), slots, self.n - 1)
        self.dropped_last()

    def dropped_last(self) -> None:
        """The entry of the last column took an evicted slot in every head (:meth:`_fill_from_last`)."""
        last = self.n - 1
        for row in self.rows:
            row.width = last
        self.compacted = True
        self._refresh(last)

    def snapshot(self) -> tuple[int, int, int, list[tuple[int, ...]]]:
        """What :meth:`restore` needs to drop entries appended after this point."""
        rows = [(row.seen, row.start, row.width, row.passes, row.decode_peak) for row in self.rows]
        return self.n, self.tokens, self.passes, rows

    def restore(self, snapshot: tuple[int, int, int, list[tuple[int, ...]]]) -> None:
        """Drop every entry appended since :meth:`snapshot` (nothing was evicted in between),
        as if the passes since then never ran: a side pass leaves no trace. Appends only
        ever write past each row's end, so restoring the rows' widths and the logical length
        removes them; a row shorter than the storage also gets its padding columns back
        (hidden, at a position no query has), as it appended inside the shared length."""
        self.n, self.tokens, self.passes, rows = snapshot
        for i, (row, (seen, start, width, passes, decode_peak)) in enumerate(zip(self.rows, rows)):
            row.seen, row.start, row.width, row.passes, row.decode_peak = seen, start, width, passes, decode_peak
            if self._valid is not None:
                self._valid[i, :, row.start + row.width :] = False
                self._positions[i, :, row.start + row.width :] = -1
        self._refresh(self.n)

    # -- rows of a batch that runs on (continuous batching) ---------------------------------
    def splice(self, row: int, source: EvictionLayer) -> None:
        """Make batch row ``row`` (``batch_size``: a new last row) hold the only row of
        ``source``, the same layer of a batch-1 cache, exactly as ``source`` holds it: entries,
        positions, per-token state, counters and policy memo. Each row keeps its own columns
        from 0; columns past a row's width are invalid, so it attends exactly its own entries."""
        if row == len(self.rows):
            self._add_row()
        width = source.rows[0].width
        self._ensure_valid()
        self._reserve(width)
        columns = slice(source.rows[0].start, source.rows[0].start + width)
        for name, value in source._state.items():
            if name not in self._state:
                self._state[name] = value.new_zeros(len(self.rows), value.shape[1], self._capacity, *value.shape[3:])
        pairs = [(self._keys, source._keys), (self._values, source._values)]
        pairs += [(self._state[name], value) for name, value in source._state.items()]
        for mine, theirs in pairs:
            mine[row, :, :width] = theirs[0, :, columns]
        self._positions[row] = -1  # columns the row does not hold sit at a position no query has
        self._positions[row, :, :width] = source._positions[0, :, columns]
        self._valid[row] = False
        self._valid[row, :, :width] = True if source._valid is None else source._valid[0, :, columns]
        spliced = _Row()
        for name in _Row.__slots__:
            setattr(spliced, name, getattr(source.rows[0], name))
        spliced.start = 0
        self.rows[row] = spliced
        self.tokens = max(self.tokens, source.tokens)
        self.compacted = True  # rows no longer share the model's own column layout
        self._refresh(max(r.start + r.width for r in self.rows))

    def _add_row(self) -> None:
        """One more batch row, holding nothing yet."""

        def grow(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x.new_zeros(1, *x.shape[1:])])

        self._ensure_valid()
        self._keys, self._values, self._positions, self._valid = (
            grow(x) for x in (self._keys, self._values, self._positions, self._valid)
        )
        self._state = {name: grow(value) for name, value in self._state.items()}
        self.rows.append(_Row())

    def _ensure_valid(self) -> None:
        """Materialise :attr:`valid` (each row's columns ``start .. start + width`` are real)."""
        if self._valid is not None:
            return
        self._steady = None  # a step with a valid mask is not one like the last
        self._valid = torch.zeros(self._positions.shape, dtype=torch.bool, device=self.device)
        for i, row in enumerate(self.rows):
            self._valid[i, :, row.start : row.start + row.width] = True

    def remove_rows(self, rows: list[int]) -> None:
        """Drop batch rows ``rows`` (finished sequences); the others keep what they hold."""
        kept = [i for i in range(len(self.rows)) if i not in set(rows)]
        index = torch.tensor(kept, dtype=torch.long, device=self.device)
        self._keys, self._values, self._positions = (x[index] for x in (self._keys, self._values, self._positions))
        self._valid = None if self._valid is None else self._valid[index]
        self._state = {name: value[index] for name, value in self._state.items()}
        self.rows = [self.rows[i] for i in kept]
        self._refresh(max(row.start + row.width for row in self.rows))

    def row_bytes(self) -> list[tuple[int, int]]:
        """Per row: (bytes allocated, bytes of real entries). Allocated counts the row's
        longest head for every head (head-wise budgets pad heads); neither counts the row's
        left padding nor the padding up to longer rows of the batch."""
        if not self.is_initialized:
            return [(0, 0)] * len(self.rows)
        per_entry = self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size()
        real = self.head_lengths().sum(dim=-1).tolist()
        return [(self.num_kv_heads * row.width * per_entry, held * per_entry) for row, held in zip(self.rows, real)]

    def kv_bytes(self) -> int:
        """Bytes allocated for keys and values of every row (see :meth:`row_bytes`)."""
        return sum(allocated for allocated, _ in self.row_bytes())

    def retained_bytes(self) -> int:
        """Bytes of the real entries: what a head-wise ragged layout would hold."""
        return sum(real for _, real in self.row_bytes())


def _real_columns(mask: torch.Tensor | None, num_new: int, batch: int) -> torch.Tensor | None:
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


def _gather(x: torch.Tensor, indices: torch.Tensor, capacity: int) -> torch.Tensor:
    """Entries ``indices`` ``[B, H, m]`` along dim 2 of ``[B, H, n, ...]``, into a new buffer of ``capacity``."""
    index = indices.reshape(*indices.shape, *([1] * (x.dim() - 3))).expand(*indices.shape, *x.shape[3:])
    out = x.new_zeros(*x.shape[:2], capacity, *x.shape[3:])
    out[:, :, : indices.shape[-1]] = x.gather(2, index)
    return out


class RowView:
    """One row of an :class:`EvictionLayer` exactly as a batch-1 layer holding that sequence
    alone: ``keys``/``values`` ``[1, Hkv, n_b, d]``, ``positions``, ``valid`` (None when every
    entry of the row is real), ``state`` and ``memo`` of the row, and its own counters
    (``seen``, ``prompt_length``, ``budget``, ``decode_step``). Tensors are views of the
    layer's storage, so in-place writes land there; a state entry the policy replaces is
    written back by :meth:`write_back`."""

    def __init__(self, layer: EvictionLayer, row: int, stop: int | None = None):
        info = layer.rows[row]
        stop = row + 1 if stop is None else stop
        self.layer, self.row, self.info = layer, row, info
        columns = slice(info.start, info.start + info.width)
        rows = slice(row, stop)
        self.rows = rows
        """The batch rows this view holds: one, or (:meth:`EvictionLayer.views`) every row in lockstep."""
        if row == 0 and stop == len(layer.rows) and info.start == 0 and info.width == layer.n:
            cut = _whole  # the usual case, one row or rows in lockstep: the layer's own views
        else:
            cut = _narrowing(rows, columns)
        self.keys, self.values, self.positions = cut(layer.keys), cut(layer.values), cut(layer.positions)
        valid = None if layer.valid is None else cut(layer.valid)
        self.valid = None if valid is None or bool(valid.all()) else valid
        self._state = {name: cut(value) for name, value in layer.state.items()}
        self.state = dict(self._state)
        self.interval = info.interval
        if stop - row == 1:
            self.seen, self.prompt_length, self.budget = info.seen, info.prompt_length, info.budget
            self.owner: _RowOwner | _SpanOwner = _RowOwner(layer.owner, row)
        else:  # rows in lockstep (same storage columns, budget and step) may differ in length
            span = layer.rows[rows]
            self.seen, self.prompt_length = (
                _uniform([getattr(r, key) for r in span], layer.device) for key in ("seen", "prompt_length")
            )
            self.budget = info.budget
            self.owner = _SpanOwner(layer.owner, rows)
        self.prompt_pass = layer.prompt_pass
        self.passes, self.layer_idx, self.device, self.window = (
            info.passes,
            layer.layer_idx,
            layer.device,
            layer.window,
        )
        self.num_new = info.new
        self.columns = columns

    @property
    def memo(self) -> dict[str, object]:
        """Per-layer policy data of this row (a view of several rows has none: its policy is
        :attr:`~kvevict.policies.Policy.batched`, whose stages keep none)."""
        if self.rows.stop - self.rows.start != 1:
            raise ValueError("a view of several rows keeps no per-row policy data: only batched policies use it")
        return self.info.memo

    policy = property(lambda self: self.layer.policy)
    num_kv_heads = property(lambda self: self.keys.shape[1])
    length = property(lambda self: self.keys.shape[2])
    decode_step = property(lambda self: self.info.seen - self.info.prompt_length)  # the same for every row
    decode_peak = property(lambda self: self.info.decode_peak)
    phase = EvictionLayer.phase

    def head_lengths(self) -> torch.Tensor:
        if self.valid is not None:
            return self.valid.sum(dim=-1)
        return torch.full(self.keys.shape[:2], self.length, dtype=torch.long, device=self.device)

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
        after this pass), and (decode) the step counter crossed a multiple of ``interval``."""
        later_chunk = phase == "prefill" and self.passes > 1
        if (
            self.budget is None
            or self.held_after_pass() <= self.budget
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
                self.layer._state[name][self.rows, :, self.columns] = value
                self._state[name] = value


class LayerStack:
    """The decode steps several layers left for the end of a pass, as one batch for the
    policy's stackable stages (:attr:`~kvevict.policies.base.Stage.stackable`): the rows of
    every layer stacked along dim 0, layer after layer, with what such a stage reads
    (``positions``, ``state`` and the row counters). The views share one :meth:`key`, each
    holds its whole layer, every entry real (no ``valid``), and the layers' storage is one
    :class:`LayerArena`: ``positions`` and ``state`` are views of it, so a stage's in-place
    writes land in every layer at once."""

    valid = None

    def __init__(self, views: Sequence[RowView], arena: LayerArena):
        first = views[0]
        self.first, self.layers = first, len(views)
        self.rows_per_layer = first.positions.shape[0]
        n = first.length
        self.positions = arena.stacked(arena.positions, n)
        self.state = {name: arena.stacked(arena.state[name], n) for name in first.state}
        self._stored = dict(self.state)
        self.seen, self.prompt_length = (_repeat_rows(x, len(views)) for x in (first.seen, first.prompt_length))
        self.budget, self.decode_step, self.window, self.device = (
            first.budget,
            first.decode_step,
            first.window,
            first.device,
        )
        self.num_new, self.passes = first.num_new, first.passes

    num_kv_heads = property(lambda self: self.positions.shape[1])
    length = property(lambda self: self.positions.shape[2])
    owner = property(lambda self: self)  # what a stackable stage reads of the cache: the hidden scores

    def phase(self) -> Phase:
        return self.first.phase()

    @property
    def hidden(self) -> _StackedHidden | None:
        hidden = self.first.owner.hidden
        return None if hidden is None else _StackedHidden(hidden, self.layers)

    def replaced(self) -> dict[str, torch.Tensor]:
        """The state entries a stage replaced (rather than wrote in place), by name."""
        return {name: value for name, value in self.state.items() if value is not self._stored.get(name)}

    @staticmethod
    def key(view: RowView) -> tuple[object, ...]:
        """Pending views stack when they hold as many rows, heads and entries, under one
        budget and window, at one step of the same rows (every layer sees the same tokens)."""
        rows = (view.rows.start, view.rows.stop)
        return (view.positions.shape, view.budget, view.window, rows, view.info.seen, view.info.prompt_length)


class LayerArena:
    """The storage of several layers as one tensor per kind ``[L, B, Hkv, capacity, ...]``
    (keys, values, positions, each per-token state entry), each layer's own storage the view
    of its slice.

    Why: at the end of a pass the layers of a :class:`LayerStack` write the new entries'
    state, are observed and refill their evicted slots together, by one operation per kind
    rather than one per layer (on a CPU each operation costs microseconds of dispatch, more
    than moving one entry). A layer that replaces a storage tensor (growing it, a general
    eviction that compacts it, a batch change) just leaves the arena (:meth:`holds`), and the
    stack then runs layer by layer until its layers are moved into a new arena.

    Moving layers in costs one copy of their storage, one kind at a time (each layer's old
    tensor is freed as it moves): the memory briefly holds one kind twice."""

    def __init__(self, layers: Sequence[EvictionLayer]):
        self.layers = tuple(layers)
        self.capacity = max(layer._capacity for layer in layers)
        self.keys = self._adopt("_keys")
        self.values = self._adopt("_values")
        self.positions = self._adopt("_positions")
        self.state = {name: self._adopt("_state", name) for name in layers[0]._state}
        for layer in layers:
            layer._capacity = self.capacity
        self._held = self._storage_of(layers)

    def _adopt(self, kind: str, name: str | None = None) -> torch.Tensor:
        """One kind of storage of every layer, as slices of one new tensor (of the largest capacity)."""

        def get(layer: EvictionLayer) -> torch.Tensor:
            return getattr(layer, kind) if name is None else layer._state[name]

        like = get(self.layers[0])
        block = like.new_zeros(len(self.layers), *like.shape[:2], self.capacity, *like.shape[3:])
        for i, layer in enumerate(self.layers):
            old = get(layer)
            block[i].narrow(2, 0, old.shape[2]).copy_(old)
            if name is None:
                setattr(layer, kind, block[i])
            else:
                layer._state[name] = block[i]
            layer._refresh(layer.n)  # the old tensor's views go with it
        return block

    @staticmethod
    def fits(layers: Sequence[EvictionLayer]) -> bool:
        """Whether ``layers`` (more than one, every entry real) hold storage of one layout (capacities may differ)."""
        first = layers[0]

        def layout(layer: EvictionLayer) -> list[tuple[object, ...]]:
            return [(name, x.shape[:2], x.shape[3:], x.dtype, x.device) for name, x in layer.storage().items()]

        return len(layers) > 1 and all(
            layer._valid is None and layer.n == first.n and layout(layer) == layout(first) for layer in layers
        )

    def holds(self, layers: Sequence[EvictionLayer]) -> bool:
        """Whether the storage of ``layers`` is (still) this arena's, every tensor of it."""
        return tuple(layers) == self.layers and _same_objects(self._storage_of(layers), self._held)

    @staticmethod
    def _storage_of(layers: Sequence[EvictionLayer]) -> tuple[object, ...]:
        """What :meth:`EvictionLayer.storage` holds of every layer, flat: tensors and state
        names (compared by identity at every decode step's end)."""
        return tuple(chain.from_iterable(map(_storage_objects, layers)))

    @staticmethod
    def stacked(block: torch.Tensor, n: int) -> torch.Tensor:
        """``block`` ``[L, B, ...]``'s first ``n`` entries with the layers' rows stacked: ``[L·B, Hkv, n, ...]`` (a view)."""
        return block.narrow(3, 0, n).flatten(0, 1)

    def write_new(self, stack: LayerStack, values: dict[str, torch.Tensor]) -> None:
        """The new entries' state ``{name: [L·B, Hkv, num_new, ...]}`` (entries the arena holds) into every layer's last columns."""
        for name, value in values.items():
            block = self.state[name]
            new = block.narrow(3, stack.length - stack.num_new, stack.num_new)
            new.copy_(value.reshape(*block.shape[:3], *value.shape[2:]))

    def write_back(self, stack: LayerStack) -> None:
        """Copy the state entries a stage replaced into the layers."""
        for name, value in stack.replaced().items():
            self.stacked(self.state[name], stack.length).copy_(value)

    def fill(self, slots: torch.Tensor, last: int) -> None:
        """Drop entry ``slots`` ``[L·B, Hkv]`` of every head of every layer: the entry of column
        ``last`` takes its slot (:meth:`EvictionLayer._fill_from_last`, for all layers at once)."""
        blocks = [self.keys, self.values, self.positions, *self.state.values()]
        _move_last_into(blocks, slots.view(*self.keys.shape[:3]), last)


def _move_last_into(storages: Iterable[torch.Tensor], slots: torch.Tensor, last: int) -> None:
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


class _StackedHidden:
    """The frozen hidden-state scores of a :class:`LayerStack`: each layer's rows looked up
    as that layer's view looks them up (the layers' heads side by side in one lookup)."""

    def __init__(self, hidden: _RowHidden | _SpanHidden, layers: int):
        self.hidden, self.layers = hidden, layers

    def lookup(self, positions: torch.Tensor, end: int | None = None) -> torch.Tensor:
        stacked, heads, n = positions.shape
        rows = stacked // self.layers
        side_by_side = positions.view(self.layers, rows, heads, n).transpose(0, 1).reshape(rows, -1, n)
        scores = self.hidden.lookup(side_by_side, end=end)
        return scores.view(rows, self.layers, heads, n).transpose(0, 1).reshape(stacked, heads, n)


def _repeat_rows(x: int | torch.Tensor, times: int) -> int | torch.Tensor:
    """A row counter (an int, or ``[B, 1, 1]`` per row) for ``times`` layers' rows stacked."""
    return x if isinstance(x, int) else x.repeat(times, 1, 1)


def _storage_objects(layer: EvictionLayer) -> tuple[object, ...]:
    """What :meth:`EvictionLayer.storage` holds, flat: its tensors and state names."""
    return (layer._keys, layer._values, layer._positions, *layer._state, *layer._state.values())


def _same_objects(these: tuple[object, ...], those: tuple[object, ...]) -> bool:
    """Whether two tuples hold the very same objects, in order (a renamed or replaced entry,
    even an equal one, does not count: the answer errs on the side of 'changed')."""
    return len(these) == len(those) and all(map(operator.is_, these, those))


def _whole(x: torch.Tensor) -> torch.Tensor:
    return x


def _narrowing(rows: slice, columns: slice) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x[rows, :, columns]`` of a ``[B, H, n, ...]`` tensor, as a view."""
    return lambda x: x.narrow(0, rows.start, rows.stop - rows.start).narrow(
        2, columns.start, columns.stop - columns.start
    )


class _RowOwner:
    """What a policy reads of the cache, for one row (its own shared data and hidden scores)."""

    def __init__(self, cache: EvictionCache, row: int):
        self.cache, self.row = cache, row

    policy = property(lambda self: self.cache.policy)
    eviction_layers = property(lambda self: self.cache.eviction_layers)
    shared = property(lambda self: self.cache.row_shared(self.row))
    rotary = property(lambda self: self.cache.rotary)

    @property
    def hidden(self) -> _RowHidden | None:
        recorder = self.cache.hidden
        return None if recorder is None else _RowHidden(recorder, self.row, self.cache.row_offsets[self.row])


class _RowHidden:
    """A :class:`~kvevict.hidden.HiddenStateRecorder` seen from one row (positions of that row)."""

    def __init__(self, recorder: HiddenStateRecorder, row: int, offset: int):
        self.recorder, self.row, self.offset = recorder, row, offset

    def lookup(self, positions: torch.Tensor, end: int | None = None) -> torch.Tensor:
        if not self.offset:
            return self.recorder.lookup(positions, row=self.row, end=end)
        shifted_end = None if end is None else end + self.offset
        return self.recorder.lookup(positions + self.offset, row=self.row, end=shifted_end)


class _SpanOwner:
    """What a batched policy reads of the cache for rows in lockstep: hidden scores only (a
    batched stage keeps no shared data)."""

    def __init__(self, cache: EvictionCache, rows: slice):
        self.cache, self.rows = cache, rows

    policy = property(lambda self: self.cache.policy)
    eviction_layers = property(lambda self: self.cache.eviction_layers)
    rotary = property(lambda self: self.cache.rotary)

    @property
    def shared(self) -> dict[str, object]:
        raise ValueError("a view of several rows keeps no per-row shared data: only batched policies use it")

    @property
    def hidden(self) -> _SpanHidden | None:
        recorder = self.cache.hidden
        if recorder is None:
            return None
        return _SpanHidden(recorder, self.cache.row_offsets[self.rows])


class _SpanHidden:
    """A :class:`~kvevict.hidden.HiddenStateRecorder` seen from every row (each at its own offset)."""

    def __init__(self, recorder: HiddenStateRecorder, offsets: list[int]):
        self.recorder, self.offsets = recorder, offsets

    def lookup(self, positions: torch.Tensor, end: int | None = None) -> torch.Tensor:
        offsets = _uniform(self.offsets, positions.device)
        if isinstance(offsets, int) and not offsets:
            return self.recorder.lookup(positions, end=end)
        return self.recorder.lookup(positions + offsets, end=None if end is None else end + max(self.offsets))


def _uniform(values: list[int], device: torch.device) -> int | torch.Tensor:
    """``values`` (one per row) as an int when they agree, else ``[B, 1, 1]`` (broadcasting with positions)."""
    if values.count(values[0]) == len(values):
        return values[0]
    return torch.tensor(values, device=device)[:, None, None]


class EvictionCache(Cache):
    """A transformers ``Cache`` that evicts entries under a policy and a budget.

    Use it as ``past_key_values`` of ``model(...)`` or ``model.generate(...)``::

        cache = EvictionCache(model, "snapkv", budget=256)
        model.generate(input_ids, past_key_values=cache, max_new_tokens=32)

    Args:
        model: the causal LM; its attention implementation is switched to kvevict's wrapper
            of the same kernel (a pure pass-through for any other cache).
        policy: a registered policy name (see :func:`kvevict.list_policies`), a policy made by
            :func:`kvevict.make_policy`, or a method object (``LazyEviction(alpha=1e-3)``). The
            cache binds its own copy to the model; the object passed is left as it is.
        budget: retained tokens per KV head per layer.
        keep: fraction of the prompt to retain (resolved at prefill). Not with ``budget``.
        interval: decode-time eviction runs every ``interval`` steps once over budget
            (1 = every step; larger lets the cache grow to ``budget + interval``). Default:
            the policy's own schedule (LazyEviction's and R-KV's window), else 1.
        prompt_length: tokens of the whole prompt (its columns, left padding included), for a
            prompt prefilled in chunks (``generate(..., prefill_chunk_size=C)``): ``keep=`` then
            refers to it, and exactly the passes up to it are prompt chunks. Without it, every
            pass of more than one token until the first single-token one is a prompt chunk.

    Chunked prefill: each chunk attends to the retained entries plus itself, then the cache
    evicts back to the budget (prefill-time policies score each chunk as they score a whole
    prompt), so it never holds more than ``budget + C`` entries per KV head
    (:meth:`peak_entries`). Call :meth:`end_prompt` before feeding more than one token that
    is not prompt (a question after a context compressed on its own).

    Sliding-window layers (all-sliding or hybrid models) drop what left their window, then
    are evicted to the budget like full layers: one never holds more than
    ``min(window, budget)`` + interval entries between passes. Models kvevict cannot evict
    exactly are refused (:func:`kvevict.models.check_supported`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        policy: str | Policy = "full",
        *,
        budget: int | None = None,
        keep: float | None = None,
        interval: int | None = None,
        prompt_length: int | None = None,
    ):
        check_supported(model)
        policy = make_policy(policy) if isinstance(policy, str) else policy
        if isinstance(policy, Method):
            policy = Policy(policy)
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a policy name or a kvevict Policy, got {type(policy).__name__}")
        self.budget = Budget(budget, keep)
        if not self.budget.given and policy.name != "full":
            raise ValueError(f"policy {policy.name!r} needs a budget: give budget= (tokens) or keep= (fraction)")
        if budget is not None:
            policy.check_budget(budget)
        check_policy_fits(model, policy.corrects_output, budget)
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
            raise ValueError(f"interval must be an integer >= 1 (1 = evict every step), got {interval!r}")
        self.interval = interval
        if prompt_length is not None and (
            isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or prompt_length < 1
        ):
            raise ValueError(f"prompt_length must be a positive number of tokens, got {prompt_length!r}")
        self.prompt_length = prompt_length
        """Tokens of the whole prompt when it is prefilled in chunks (None: unknown)."""
        attention.install(model)
        config = model.config.get_text_config(decoder=True)
        self.policy = policy.bound(config)
        """This cache's copy of the policy, bound to the model (the object passed is left as it is)."""
        self._clear_sequences()
        hidden_layers = self.policy.hidden_layers(config.num_hidden_layers)
        self.hidden = (
            HiddenStateRecorder(
                model, hidden_layers, self.policy.hidden_scores, context=self.policy.hidden_context, cache=self
            )
            if hidden_layers
            else None
        )
        """Hooks on the decoder layers the policy reads (:mod:`kvevict.hidden`); None if it reads none."""
        self.hooks = self.policy.attach(model, self)
        """Hooks the policy installed on the model for this cache (Fast KVzip's gates); None if none."""
        self.rotary = RotaryTable(model)
        """cos/sin of the model's RoPE at any position (ExpectedAttention's future rotations)."""
        self.side_pass: SidePassObserver | None = None
        """Set while a policy runs a scoring pass of its own through this cache (KVzip)."""
        self._pass_hook = PassHook(model.get_decoder(), self)
        self.ends_passes = True
        """Whether :class:`PassHook` ends the passes (until :meth:`close`; then each layer evicts
        inside its attention again)."""
        self.stacks_pending = True
        """Whether the end of a pass scores the layers' pending evictions as one batch where
        the policy allows it (:meth:`evict_pending`); the same entries are kept either way."""
        self.steady_steps = True
        """Whether a decode step like the last one skips the checks that one made
        (:meth:`EvictionLayer.settle`); the same entries are kept either way."""
        _, layer_kwargs = get_layer_types_and_kwargs(config)  # check_supported: full or sliding layers only
        layers = [EvictionLayer(self, i, kwargs.get("sliding_window")) for i, kwargs in enumerate(layer_kwargs)]
        super().__init__(layers=layers)

    def __repr__(self) -> str:
        return f"EvictionCache(policy={self.policy!r}, {self.budget}, interval={self.interval})"

    def _clear_sequences(self) -> None:
        """The cache-wide data of the sequences held (besides each layer's own)."""
        self.shared: dict[str, object] = {}
        """Per-cache policy data shared across layers (e.g. ThinKV's per-token entropy), of
        the first row; every row of a batch has its own (:meth:`row_shared`)."""
        self._shared_rows: dict[int, dict[str, object]] = {0: self.shared}
        self.row_offsets: list[int] = [0]
        """Left padding of each row of the batch (columns before its first real token)."""
        self.deferred: list[tuple[RowView, Signals]] = []
        """Row views whose prefill eviction waits for the end of the prefill forward, with their signals."""
        self.pending: list[EvictionLayer] = []
        """Layers whose decode step waits for the end of the pass, in the order they attended."""
        self._arenas: dict[tuple[int, ...], LayerArena] = {}
        """The storage of layers that stack, by their indices (:class:`LayerArena`)."""

    def reset(self) -> None:
        """Empty the cache for new sequences: what a fresh cache of the same model and policy
        holds (every layer, the policy's shared data such as a seeded generator, the recorded
        hidden states), keeping the hooks installed."""
        super().reset()
        self._clear_sequences()
        if self.hidden is not None:
            self.hidden.reset()

    def close(self) -> None:
        """Remove the hooks from the model (also done on garbage collection)."""
        if self.hidden is not None:
            self.hidden.close()
        if self.hooks is not None:
            self.hooks.close()
        self._pass_hook.close()
        self.ends_passes = False
        self._arenas = {}  # the layers keep their storage; nothing stacks any more

    # -- evictions at the end of a pass ----------------------------------------------------
    def finish_pass(self, decoder: torch.nn.Module, input_ids: torch.Tensor | None) -> None:
        """End a pass that ran through every layer (called by :class:`PassHook`): the
        decode-step evictions the layers left pending, then a deferred prefill eviction."""
        self.evict_pending()
        self.finish_prefill(decoder, input_ids)

    def evict_pending(self) -> None:
        """End the decode steps the layers left for the end of the pass: each layer's new
        entries' state, the policy's observation, then the eviction then due. Where the
        policy's stages allow it (:attr:`~kvevict.policies.Policy.stacks_layers`) the layers
        of one :meth:`LayerStack.key` whose storage is one :class:`LayerArena` run it as one
        batch of their rows (:meth:`_end_stacked`); the others, layer by layer, all observing
        before any evicts. Each layer keeps what it keeps on its own: the stages treat rows
        independently. Layers that could have stacked are moved into an arena for the next pass."""
        layers = [layer for layer in dict.fromkeys(self.pending) if layer.pending_view() is not None]
        self.pending = []  # (a layer whose pass raised may be listed twice)
        whole_steps = [layer for layer in layers if layer.pending_pass is not None]  # (not just their eviction)
        # an arena a layer left would keep the others' old storage alive for nothing
        self._arenas = {key: arena for key, arena in self._arenas.items() if arena.holds(arena.layers)}
        stacking = self.stacks_pending and self.policy.stacks_layers
        groups: dict[tuple, list[EvictionLayer]] = {}
        for layer in layers:
            groups.setdefault(LayerStack.key(layer.pending_view()) if stacking else (layer,), []).append(layer)
        alone = []
        for group in groups.values():
            arena = self._arenas.get(tuple(layer.layer_idx for layer in group))
            if arena is None or not self._end_stacked(group, arena):
                alone.append(group)
        for group in alone:
            for layer in group:
                layer.observe_pending()
        for layer in layers:  # a stack whose minimum is not the eviction left each layer's own
            layer.evict_pending()
        for group in alone:
            key = tuple(layer.layer_idx for layer in group)
            held = key in self._arenas and self._arenas[key].holds(group)  # still (a step that did not stack)
            if stacking and not held and LayerArena.fits(group):
                self._arenas[key] = LayerArena(group)
        for layer in whole_steps:  # once nothing moves their storage any more in this pass
            layer.settle()

    def _end_stacked(self, layers: list[EvictionLayer], arena: LayerArena) -> bool:
        """End the pending decode steps of ``layers`` (of one :meth:`LayerStack.key`, stored in
        ``arena``) as one batch of their rows: the new entries' state written by one copy per
        state entry, one observation, one minimum, and the dropped slots refilled by one
        ``scatter_`` per storage entry (:meth:`LayerArena.fill`). False, having done nothing,
        when the layers' steps differ in what is left (some observed inside their layer). A
        stacked minimum that is not the eviction (a NaN score, ...) leaves each layer's own."""
        passes = [layer.pending_pass for layer in layers]
        if all(p is not None and p.signals is not None for p in passes):
            views, signals, due = [p.view for p in passes], [p.signals for p in passes], passes[0].due
        elif all(p is None and layer.pending_eviction is not None for p, layer in zip(passes, layers)):
            (views, signals), due = zip(*(layer.pending_eviction for layer in layers)), True
        else:
            return False
        stack, stacked = LayerStack(views, arena), Signals.stacked(signals)
        if passes[0] is not None:
            values = self.policy.new_tokens(stack, stack.num_new)
            if values.keys() - arena.state.keys():  # a state entry new to the layers: each makes its own
                return False
            arena.write_new(stack, values)
            self.policy.observe(stack, stacked)
            arena.write_back(stack)
            for layer, view, layer_signals in zip(layers, views, signals):
                layer.pending_pass = None
                layer.pending_eviction = (view, layer_signals) if due else None
        if not due:
            return True
        slots = self.policy.drop_lowest(stack, stacked, stack.budget)
        if slots is not None:
            arena.fill(slots, stack.length - 1)
            for layer in layers:
                layer.pending_eviction = None
                layer.dropped_last()
        return True

    def finish_prefill(self, decoder: torch.nn.Module, input_ids: torch.Tensor | None) -> None:
        """Evict the layers that deferred their prefill eviction, all at once: the policy
        may first run passes of its own (KVzip's repeat pass), then allocate across layers
        (``global+``), then each layer keeps its selection. Each row of a batch is allocated
        on its own, as alone. Called by the decoder's forward hook after the prefill forward
        returned; a no-op inside a side pass (re-entry)."""
        if self.side_pass is not None or not self.deferred:
            return
        try:  # the scoring passes read which rows deferred (KVzip repeats only those)
            self.policy.method.rescore(self, decoder, input_ids)
        finally:
            deferred, self.deferred = self.deferred, []
        chosen: dict[EvictionLayer, dict[int, tuple[RowView, torch.Tensor | None]]] = {}
        for row in dict.fromkeys(view.row for view, _ in deferred):
            views = []  # afresh: the scoring passes may have moved the storage
            for view, signals in deferred:
                if view.row == row:
                    views.append((view.layer.row_view(row), signals))
                    views[-1][0].drop_outside_window()
            for (view, _), keep in zip(views, self.policy.select_layers(views)):
                chosen.setdefault(view.layer, {})[row] = (view, keep)
        for layer, rows in chosen.items():  # rows that did not defer in a layer keep what they hold
            layer._keep_rows([rows.get(i) or (layer.row_view(i), None) for i in range(layer.batch_size)])

    @contextmanager
    def scoring_pass(self, observer: SidePassObserver) -> Iterator[None]:
        """Run a forward pass through this cache that only scores: each eviction layer hands
        the pass's queries to ``observer(layer, query, scaling, module)`` instead of its
        policy, and every entry the pass appended is dropped afterwards (``seen``, counters
        and positions as before it), so later tokens never see it."""
        snapshots = [(layer, layer.snapshot()) for layer in self.eviction_layers]
        self.side_pass = observer
        try:
            yield
        finally:
            self.side_pass = None
            for layer, snapshot in snapshots:
                layer.restore(snapshot)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def eviction_layers(self) -> list[EvictionLayer]:
        return [layer for layer in self.layers if isinstance(layer, EvictionLayer)]

    def row_shared(self, row: int) -> dict[str, object]:
        """Policy data shared across layers, for one row of the batch."""
        return self._shared_rows.setdefault(row, {})

    def kv_bytes(self) -> int:
        """Bytes allocated for the retained keys and values of every layer (never left padding)."""
        return sum(allocated for allocated, _ in self.layer_bytes())

    def row_bytes(self) -> list[tuple[int, int]]:
        """Per row of the batch: (bytes allocated, bytes of real entries) over every layer.
        Allocated counts each row's longest head for all its heads (head-wise budgets); neither
        counts left padding nor the padding that lets rows of different lengths share storage."""
        totals: list[list[int]] = []
        for layer in self.layers:
            rows = layer.row_bytes()
            totals += [[0, 0] for _ in range(len(rows) - len(totals))]
            for total, (allocated, real) in zip(totals, rows):
                total[0] += allocated
                total[1] += real
        return [(allocated, real) for allocated, real in totals]

    def layer_bytes(self) -> list[tuple[int, int]]:
        """Per layer (full-attention and sliding alike): (bytes allocated, bytes of real
        entries). They differ only where head-wise budgets pad heads to the longest one of
        their layer, or rows of a batch keep different numbers of entries."""
        return [(layer.kv_bytes(), layer.retained_bytes()) for layer in self.layers]

    def decode_peak(self) -> int:
        """Most entries any KV head held while decoding (budget + interval for lagged eviction)."""
        return max((layer.decode_peak for layer in self.eviction_layers), default=0)

    def peak_entries(self) -> int:
        """Most entries any KV head of any layer held at any moment of this cache's life,
        prefill included (after a pass appended, before it evicted): at most ``budget + C``
        with chunked prefill of chunk ``C``, the whole prompt when it is prefilled in one pass."""
        return max((row.peak for layer in self.eviction_layers for row in layer.rows), default=0)

    def end_prompt(self) -> None:
        """The prompt is complete: the next passes are decode passes, however many tokens they
        hold (a question fed after a context compressed on its own is not compressed with it)."""
        for layer in self.eviction_layers:
            layer.prompt_open = False

    # -- continuous batching ---------------------------------------------------------------
    def splice(self, row: int, source: EvictionCache) -> None:
        """Put the sequence ``source`` holds (a batch-1 cache of the same model, policy and
        budget, its prompt done) into batch row ``row`` of this cache, replacing a finished
        sequence, or as a new last row when ``row`` is the batch size: that row then goes on
        exactly as ``source`` would alone. Decode such a batch with each row's own positions
        (``position_ids=cache.next_positions()``): its rows have seen different numbers of tokens."""
        if not isinstance(source, EvictionCache) or source is self:
            raise ValueError("splice takes another EvictionCache holding the one sequence to put into this batch")
        if repr(source.policy) != repr(self.policy) or source.budget != self.budget:
            raise ValueError(
                f"cannot splice a cache of {source.policy.name!r} ({source.budget}) into one of "
                f"{self.policy.name!r} ({self.budget}): rows of a batch share the policy and the budget"
            )
        if self.hidden is not None or self.deferred or source.deferred:
            raise ValueError(
                f"policy {self.policy.name!r} reads hidden states recorded per column of the batch (or has a prefill "
                "eviction pending), which cannot move between caches: it cannot be spliced"
            )
        layers = list(zip(self.eviction_layers, source.eviction_layers))
        if any(not mine.is_initialized or not theirs.is_initialized for mine, theirs in layers):
            raise ValueError("splice needs both caches to hold a prefilled sequence")
        if source.eviction_layers[0].batch_size != 1:
            raise ValueError(f"splice takes a batch-1 cache, got one of {source.eviction_layers[0].batch_size} rows")
        if not 0 <= row <= self.eviction_layers[0].batch_size:
            raise ValueError(f"row {row} is out of range: 0 .. {self.eviction_layers[0].batch_size} (a new last row)")
        for mine, theirs in layers:
            mine.splice(row, theirs)
            mine.prompt_open = False
        self._shared_rows[row] = source.shared
        self.row_offsets[row : row + 1] = [0]

    def remove_rows(self, rows: Sequence[int]) -> None:
        """Drop the batch rows ``rows`` (finished sequences): the others go on as before, renumbered in order."""
        size = self.eviction_layers[0].batch_size
        if not rows or any(not 0 <= r < size for r in rows) or len(set(rows)) >= size:
            raise ValueError(f"remove_rows takes distinct rows in 0 .. {size - 1}, leaving at least one; got {rows}")
        for layer in self.eviction_layers:
            layer.remove_rows(list(rows))
        kept = [i for i in range(size) if i not in set(rows)]
        self._shared_rows = {new: self.row_shared(old) for new, old in enumerate(kept)}
        self.shared = self._shared_rows[0]
        self.row_offsets = [self.row_offsets[i] for i in kept]

    def next_positions(self) -> torch.Tensor:
        """``[B, 1]``: the absolute position of each row's next token (the tokens it has seen)."""
        layer = self.eviction_layers[0]
        return torch.tensor([[row.seen] for row in layer.rows], device=layer.device)

    def layer_lengths(self) -> list[int]:
        """Retained entries per KV head, per layer."""
        return [layer.keys.shape[-2] if layer.is_initialized else 0 for layer in self.layers]

    def row_memory(self, row: int) -> dict[str, Any]:
        """What one row of the batch holds, as the cache of that sequence alone reports it:
        ``kv_bytes`` (allocated), ``real_bytes``, ``layer_bytes`` (allocated, real) per layer,
        ``retained`` (entries of its longest layer and head), ``decode_peak`` and ``peak`` (prefill included)."""
        layers = [layer.row_bytes()[row] for layer in self.layers]
        rows = [layer.rows[row] for layer in self.eviction_layers]
        return {
            "kv_bytes": sum(allocated for allocated, _ in layers),
            "real_bytes": sum(real for _, real in layers),
            "layer_bytes": layers,
            "retained": max((info.width for info in rows), default=0),
            "decode_peak": max((info.decode_peak for info in rows), default=0),
            "peak": max((info.peak for info in rows), default=0),
        }
