"""Passes through an eviction cache: when one begins, what waits for its end, and how it ends.

Owns: a layer's pass bookkeeping (:class:`PassBookkeeping`: whether a pass is a prompt
chunk, the padding it brings, starting rows, the steady decode path's record, snapshots
around a scoring pass) and the cache's end of a pass (:class:`PassEnds`: the decode steps
left pending, stacked over :class:`~kvevict.storage.LayerArena` where the policy allows, the
deferred prefill eviction, and the scoring pass), driven by :class:`PassHook`.

Must not touch: storage tensors except through :class:`~kvevict.storage.LayerStorage`, and
what the policy keeps (that is :mod:`kvevict.driver`'s).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kvevict.arena import LayerArena
from kvevict.compat import pass_cache
from kvevict.rows import LayerStack, RowState, RowView, SequenceState, phase_of, real_columns
from kvevict.signals import Phase, Signals
from kvevict.storage import Columns, LayerStorage

SidePassObserver = Callable[[Any, torch.Tensor, Any, torch.nn.Module | None], torch.Tensor | None]
"""Receives ``(layer, query, logit spec, attention module)`` of each layer during a scoring pass, before
the kernel; returns the layer's attention output ``[B, q, Hq, d]`` when it computed it, else None."""


class PassHook:
    """A forward hook on the model's decoder that ends every pass through its cache once the
    forward has run through every layer (:meth:`PassEnds.finish_pass`): the decode-step
    evictions the layers left pending, then a deferred prefill eviction.

    Why a hook on the decoder: it is transformers' public extension point that fires after
    the last layer, whichever entry point ran the pass (``model.generate``, ``model(...)``,
    ``model.model(...)``), and it sees the pass's ``input_ids`` and ``past_key_values``, so
    only passes through its own cache act. The hook holds a weak reference to the cache."""

    def __init__(self, decoder: torch.nn.Module, cache: PassEnds):
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
class PendingPass:
    """A layer's decode step whose per-token work waits for the end of the pass
    (:meth:`~kvevict.driver.PolicyDriver.observe_pending`)."""

    view: RowView
    signals: Signals | None = None
    """The pass's signals, once the layer attended."""
    due: bool = False
    """Whether the pass evicts."""


class SteadyRecord(NamedTuple):
    """What :meth:`PassBookkeeping.settle` recorded for the next decode step: the views of the
    first ``n`` columns, the storage version they belong to, and whether the storage was made
    under ``inference_mode``."""

    columns: Columns
    version: int
    inference: bool


class PassBookkeeping:
    """The pass-bookkeeping half of :class:`~kvevict.layer.EvictionLayer` (a mixin: it reads
    the layer's rows and storage, declared below)."""

    storage: LayerStorage
    rows: list[RowState]
    n: int
    tokens: int
    passes: int
    prompt_pass: bool
    prompt_open: bool
    compacted: bool
    window: int | None
    device: torch.device
    owner: Any
    policy: Any
    pending_pass: PendingPass | None
    pending_eviction: tuple[RowView, Signals] | None
    _num_new: int
    _steady: SteadyRecord | None
    _steady_pass: bool
    packed_pass: bool
    _exposed: Columns
    _pass_views: list[RowView] | None

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
            and self.storage.valid is None
            and n < self.storage.capacity
            and all(row.start == 0 and row.width == n and row.seen == rows[0].seen for row in rows)
        ):
            self._steady = SteadyRecord(self._exposed, self.storage.version, self.storage.keys.is_inference())

    def _is_prompt_pass(self, num_new: int) -> bool:
        """Whether a pass of ``num_new`` tokens (about to be appended) continues the prompt
        (:meth:`continues_prompt`); the first pass that does not closes it for good."""
        self.prompt_open = self.continues_prompt(num_new)
        return self.prompt_open

    def continues_prompt(self, num_new: int) -> bool:
        """Whether a pass of ``num_new`` tokens, before it is appended, will continue the prompt.

        The first pass is the prompt. Later ones are chunks of it (``generate(...,
        prefill_chunk_size=C)`` gives the cache no other sign) while the prompt is open: up to
        the whole prompt's length when the cache was told it (``prompt_length=``), else every
        pass of more than one token. The first pass that is not a chunk (a single decode
        token, or :meth:`EvictionCache.end_prompt`) closes the prompt for good."""
        if self.passes == 0:
            return True
        if not self.prompt_open:
            return False
        whole = self.owner.prompt_length
        return self.tokens < whole if whole is not None else num_new > 1

    def _continue_prompt(self, row: SequenceState) -> None:
        """A later chunk of the prompt: its tokens are prompt tokens of ``row`` (``decode_step`` stays 0)."""
        if not self.policy.takes_chunks:
            raise ValueError(
                self.policy.chunk_refusal(
                    "prefill the prompt in one pass (no prefill_chunk_size / prefill_chunk), or give each layer its "
                    "own budget (per_layer=true)"
                )
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
        real = real_columns(attention_mask, self._num_new, len(self.rows))
        steady = self._steady_pass and real is None  # one view holds the whole storage, as in the last pass
        first = self.owner.begin_sequences(self.passes)  # the first layer of the pass: counters move once
        if real is not None:
            self._drop_padding((self._num_new - real.sum(dim=-1)).tolist(), first)
        if self.passes == 1:
            self.owner.row_offsets = [row.start for row in self.rows]
        for sequence in (row.sequence for row in self.rows) if first else ():
            if sequence.new:  # a row whose pass is only padding does not take part in it, as alone
                sequence.passes += 1
                if sequence.passes == 1:
                    self._start_row(sequence)
                elif self.prompt_pass and self.owner.side_pass is None:
                    self._continue_prompt(sequence)
        if self.packed_pass:  # it stays packed: its part for the policy, if any, once it attended (packedpass)
            self._pass_views = None
        else:
            self._begin_views(steady)
        for row in self.rows:
            row.peak = max(row.peak, row.width)
            if row.passes > 1 and not self.prompt_pass:
                row.decode_peak = max(row.decode_peak, row.width)

    def _begin_views(self, steady: bool) -> None:
        """The views of this pass, and the new entries' state now or at the end of the pass."""
        views = [RowView(self, 0, len(self.rows))] if steady else self.views()
        if steady or self._ends_with_pass(views):  # its state, observation and eviction wait for the end of the pass
            self.pending_pass = PendingPass(views[0])
            self.owner.pending.append(self)
            self._pass_views = views
        else:
            self._pass_views = self._start_tokens(views)

    def _ends_with_pass(self, views: list[RowView]) -> bool:
        """Whether this pass is a decode step of one view holding the whole storage on a full
        layer, whose every per-token step (the new entries' state, the observation, the
        eviction) may wait for the end of the pass (:class:`PassHook`): nothing reads the
        layer's state before then (no output correction that reads it, no scoring pass of the
        policy's own)."""
        return (
            self.owner.ends_passes
            and self.owner.side_pass is None
            and self.window is None
            and len(views) == 1
            and views[0].num_new > 0
            and views[0].phase() == "decode"
            and self._holds_everything(views[0])
            and not self.policy.corrects_by_token_state
        )

    def pending_view(self) -> RowView | None:
        """The view of the decode step this layer left for the end of the pass, if any."""
        if self.pending_pass is not None:
            return self.pending_pass.view
        return None if self.pending_eviction is None else self.pending_eviction[0]

    def _drop_padding(self, pads: list[int], first: bool) -> None:
        """Take this pass's left padding (``pads[b]`` columns of row ``b``) out of the rows, in
        any pass: the prompt's, or a later one (a question of another length, a chunk that is
        still padding for a short row). A row with no real token yet just starts after it (its
        left padding); otherwise the pass's real entries move onto the padding, right after
        the row's older entries, as they lie alone. The columns this frees are masked out and
        given the padding queries' positions (``−pad .. −1``): a padding query sees only that
        column (:func:`kvevict.attention`), so it stays finite and no real query sees it.
        Real entries get consecutive positions, as ``generate`` gives them (cumulative mask).
        ``first``: this is the pass's first layer, which takes the padding out of the counters."""
        num_new = self._num_new
        if self.owner.hidden is not None and (self.passes > 1 or num_new in pads):
            raise ValueError(
                f"policy {self.policy.name!r} reads hidden states by column, which allows padding only on the left "
                "of the first pass, with a real token in every row: pad the whole prompt on the left and feed it in "
                "one pass, then decode (or batch prompts of equal length)"
            )
        valid = self.storage.ensure_valid([(row.start, row.start + row.width) for row in self.rows])
        for i, (row, pad) in enumerate(zip(self.rows, pads)):
            if not pad:
                continue
            sequence = row.sequence
            first_column, real = row.start + row.width - num_new, num_new - pad
            positions = sequence.start_seen + torch.arange(real, device=self.device)
            if not sequence.start_passes:  # nothing real before: the padding is the row's left padding
                row.start += pad
                self.storage.positions[i, :, first_column + pad : first_column + num_new] = positions
                freed = slice(first_column, first_column + pad)
            else:  # the model's layout no longer holds: masks are built from positions from now on
                for storage in (self.storage.keys, self.storage.values):
                    storage[i, :, first_column : first_column + real] = storage[
                        i, :, first_column + pad : first_column + num_new
                    ].clone()
                self.storage.positions[i, :, first_column : first_column + real] = positions
                freed = slice(first_column + real, first_column + num_new)
                self.compacted = True
            self.storage.positions[i, :, freed] = torch.arange(-pad, 0, device=self.device)
            valid[i, :, freed] = False
            row.width -= pad
            if first:
                sequence.drop_padding(pad)
        self.refresh()

    def _start_row(self, row: SequenceState) -> None:
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

    def phase(self) -> Phase:
        """``prefill`` during the first pass and the later chunks of the prompt (a :class:`RowView`
        counts only its row's passes with real tokens)."""
        return phase_of(self.passes, self.prompt_pass)

    @property
    def prompt_continues(self) -> bool:
        """Whether more of the prompt comes after this pass: a chunk before the last of a prompt
        whose whole length the cache was told (``prompt_length=``; :func:`kvevict.generation.prefill`
        tells it). Without that length no chunk is known to be the last, and this is false."""
        whole = self.owner.prompt_length
        return self.prompt_pass and whole is not None and self.tokens < whole

    def snapshot(self) -> tuple[int, int, int, list[tuple[int, ...]]]:
        """What :meth:`restore` needs to drop entries appended after this point (the rows'
        counters are the cache's to give back: :meth:`PassEnds.scoring_pass`)."""
        rows = [(row.start, row.width, row.decode_peak) for row in self.rows]
        return self.n, self.tokens, self.passes, rows

    def restore(self, snapshot: tuple[int, int, int, list[tuple[int, ...]]]) -> None:
        """Drop every entry appended since :meth:`snapshot` (nothing was evicted in between),
        as if the passes since then never ran: a side pass leaves no trace. Appends only
        ever write past each row's end, so restoring the rows' widths and the logical length
        removes them; a row shorter than the storage also gets its padding columns back
        (hidden, at a position no query has), as it appended inside the shared length. The room
        the side pass grew is given back (a layer the pass's owner does not evict afterwards, such
        as a sliding layer within its budget, would hold it until its next pass)."""
        self.n, self.tokens, self.passes, rows = snapshot
        for i, (row, (start, width, decode_peak)) in enumerate(zip(self.rows, rows)):
            row.start, row.width, row.decode_peak = start, width, decode_peak
            if self.storage.valid is not None:
                self.storage.valid[i, :, row.start + row.width :] = False
                self.storage.positions[i, :, row.start + row.width :] = -1
        self.storage.fit(self.n, max(row.interval for row in self.rows))
        self.refresh()


class PassEnds:
    """The end of a pass, for :class:`~kvevict.cache.EvictionCache` (a mixin: it reads the
    cache's layers, policy and the lists below)."""

    pending: list[Any]
    deferred: list[tuple[RowView, Signals]]
    sequences: list[SequenceState]
    appended_pass: int
    begun_pass: int
    side_pass: SidePassObserver | None
    stacks_pending: bool
    policy: Any
    _arenas: dict[tuple[int, ...], LayerArena]

    def finish_pass(self, decoder: torch.nn.Module, input_ids: torch.Tensor | None) -> None:
        """End a pass that ran through every layer (called by :class:`PassHook`): the
        decode-step evictions the layers left pending, then a deferred prefill eviction; then
        each ragged layer keeps only its real entries until the next pass."""
        self.evict_pending()
        self.finish_prefill(decoder, input_ids)
        if self.side_pass is None:
            for layer in self.eviction_layers:
                layer.end_pass()
            self._drop_left_arenas()

    def evict_pending(self) -> None:
        """End the decode steps the layers left for the end of the pass: each layer's new
        entries' state, the policy's observation, then the eviction then due. Where the
        policy's stages allow it (:attr:`~kvevict.policies.Policy.stacks_layers`) the layers
        of one :meth:`LayerStack.key` whose storage is one :class:`LayerArena` run it as one
        batch of their rows (:meth:`_end_stacked`); the others, layer by layer, all observing
        before any evicts, and then evicting as one batch where the policy allows only that
        (:attr:`~kvevict.policies.Policy.stacks_evictions`). Each layer keeps what it keeps on
        its own: the stages treat rows independently. Layers that could have stacked are moved
        into an arena for the next pass."""
        layers = [layer for layer in dict.fromkeys(self.pending) if layer.pending_view() is not None]
        self.pending = []  # (a layer whose pass raised may be listed twice)
        whole_steps = [layer for layer in layers if layer.pending_pass is not None]  # (not just their eviction)
        self._drop_left_arenas()  # (a layer may have left one since: a grown storage, a spliced row)
        stacking = self.stacks_pending and self.policy.stacks_evictions
        groups: dict[tuple, list[Any]] = {}
        for layer in layers:
            groups.setdefault(LayerStack.key(layer.pending_view()) if stacking else (layer,), []).append(layer)
        alone = []
        for group in groups.values():
            arena = self._arenas.get(tuple(layer.layer_idx for layer in group))
            if arena is None or not self.policy.stacks_layers or not self._end_stacked(group, arena):
                alone.append(group)
        for group in alone:
            for layer in group:
                layer.observe_pending()
        for group in alone if stacking else ():  # observed layer by layer, evicted at once where still an arena
            arena = self._arenas.get(tuple(layer.layer_idx for layer in group))
            if arena is not None and arena.holds(group):
                self._end_stacked(group, arena)
        for layer in layers:  # a stack whose minimum is not the eviction left each layer's own
            layer.evict_pending()
        for group in alone:
            key = tuple(layer.layer_idx for layer in group)
            held = key in self._arenas and self._arenas[key].holds(group)  # still (a step that did not stack)
            if stacking and not held and LayerArena.fits(group):
                self._arenas[key] = LayerArena(group)
        for layer in whole_steps:  # once nothing moves their storage any more in this pass
            layer.settle()
        self._drop_left_arenas()

    def _drop_left_arenas(self) -> None:
        """Forget the arenas a layer left (its storage was replaced): an arena's block would
        otherwise keep the others' old storage alive for nothing."""
        self._arenas = {key: arena for key, arena in self._arenas.items() if arena.holds(arena.layers)}

    def _end_stacked(self, layers: list[Any], arena: LayerArena) -> bool:
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
            arena.write_new(stack.length, stack.num_new, values)
            self.policy.observe(stack, stacked)
            arena.write_back(stack.length, stack.replaced())
            for layer, view, layer_signals in zip(layers, views, signals):
                layer.pending_pass = None
                layer.pending_eviction = (view, layer_signals) if due else None
        if not due:
            return True
        slots = self.policy.drop_lowest(stack, stacked, stack.budget)
        if slots is not None:
            if self.policy.watches_evictions:  # every layer's, while the entries are there
                self.policy.on_evict_one(stack, slots)
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
        chosen = self._select_deferred(deferred)
        # what still refers to a layer's storage before it evicts goes first, and each layer's selection once it
        # is kept: an eviction that rebuilds a layer's storage frees the old one at once, not after every layer's
        del deferred
        while chosen:  # rows that did not defer in a layer keep what they hold
            rows = chosen.pop(layer := next(iter(chosen)))
            layer.keep_rows([rows.get(i) or (layer.row_view(i), None) for i in range(layer.batch_size)])

    def _select_deferred(
        self, deferred: list[tuple[RowView, Signals]]
    ) -> dict[Any, dict[int, tuple[RowView, torch.Tensor | None]]]:
        """What each row of each layer that deferred keeps (:meth:`finish_prefill`), row by row
        (a view of rows in lockstep split into its rows, each with its own part of the signals)."""
        by_row: dict[int, list[tuple[Any, Signals]]] = {}
        for view, signals in deferred:
            for row in range(view.rows.start, view.rows.stop):
                by_row.setdefault(row, []).append((view.layer, signals.of_row(row - view.rows.start)))
        chosen: dict[Any, dict[int, tuple[RowView, torch.Tensor | None]]] = {}
        for row, layers in by_row.items():
            # views made afresh: the scoring passes may have moved the storage
            views = [(layer.row_view(row), signals) for layer, signals in layers]
            for view, _ in views:
                view.drop_outside_window()
            for (view, _), keep in zip(views, self.policy.select_layers(views)):
                chosen.setdefault(view.layer, {})[row] = (view, keep)
        return chosen

    @contextmanager
    def scoring_pass(self, observer: SidePassObserver) -> Iterator[None]:
        """Run a forward pass through this cache that only scores: each eviction layer hands
        the pass's queries to ``observer(layer, query, scaling, module)`` instead of its
        policy, and every entry the pass appended is dropped afterwards (``seen``, counters
        and positions as before it), so later tokens never see it."""
        snapshots = [(layer, layer.snapshot()) for layer in self.eviction_layers]
        counters = [sequence.counters() for sequence in self.sequences], self.appended_pass, self.begun_pass
        self.side_pass = observer
        try:
            yield
        finally:
            self.side_pass = None
            for layer, snapshot in snapshots:
                layer.restore(snapshot)
            for sequence, before in zip(self.sequences, counters[0]):
                sequence.restore(before)
            self.appended_pass, self.begun_pass = counters[1:]
