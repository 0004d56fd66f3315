"""Passes that leave a ragged layer packed: a decode step, and a prompt chunk under a pooled budget.

Between passes a layer whose rows or heads hold different numbers of entries keeps only its
real entries (:class:`~kvevict.packed.PackedEntries`). Two kinds of pass append to them where
they lie and attend them there, instead of spreading the layer into storage padded to its
longest head (:meth:`~kvevict.layer.EvictionLayer.unpack`):

- a decode step under a policy with nothing to do while decoding (:meth:`PackedPasses.attend_packed`);
- a later chunk of a prompt fed in chunks under one budget pooled across layers (``fastkvzip``,
  ``global+knorm``: :func:`chunks_stay_packed`), whose eviction waits for the chunk to pass every
  layer and then runs on the packed entries (:meth:`PackedPasses.keep_packed`). Why: the pooled
  eviction comes after the last layer, so a padded pass holds every layer padded to its longest
  head at once; a head the pool lets keep its whole context would then pad its layer to the whole
  context, and the peak would grow with it (docs/fastkvzip.md, rounds 8 and 9). Packed, a head
  costs its own entries, and the pass the entries held plus the chunk.

Owns: when a pass may stay packed (:meth:`PackedPasses._stays_packed`), appending it, attending it,
the chunk's part for the policy (its new entries' state; the deferred eviction) and that
eviction's keeping of entries (from the packed entries: no padded copy of the layer).

Must not touch: which entries the policy keeps (:mod:`kvevict.driver`, :mod:`kvevict.passes`), or
tensors other than through :class:`~kvevict.storage.LayerStorage`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from kvevict.attention import mark_pending
from kvevict.rows import RowState, RowView, mask_if_padded
from kvevict.signals import compute_signals
from kvevict.storage import Columns, LayerStorage

NOTHING_EXPOSED = Columns(LayerStorage(), 0)
"""What a layer exposes between passes, when its storage is packed or quantized (its properties
read the storage then): views of no tensor of its own, made once."""


class PackedRowView(RowView):
    """A :class:`RowView` of a layer whose entries are packed (:class:`~kvevict.packed.PackedEntries`:
    a prompt chunk that stayed packed, this module, until its pooled eviction), the
    same view but for when it reads the layer: the padded layout's positions, validity and state
    (a few numbers per entry) when first read, then kept; the keys and values anew at every read,
    never kept. Why: a pooled eviction holds a view of every layer at once, and keys and values
    kept by each would hold every layer padded to its longest head at once, the very peak a
    packed pass avoids (a scorer that reads keys, ``knorm``, makes one layer's at a time)."""

    def _read(self, cut: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._cut = cut

    keys = property(lambda self: self._cut(self.layer.keys))  # type: ignore[assignment]
    values = property(lambda self: self._cut(self.layer.values))  # type: ignore[assignment]

    @functools.cached_property
    def positions(self) -> torch.Tensor:  # type: ignore[override]
        return self._cut(self.layer.positions)

    @functools.cached_property
    def valid(self) -> torch.Tensor | None:  # type: ignore[override]
        valid = self.layer.valid
        return mask_if_padded(None if valid is None else self._cut(valid))

    @functools.cached_property
    def _state(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {name: self._cut(value) for name, value in self.layer.state.items()}

    @functools.cached_property
    def state(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return dict(self._state)


def chunks_stay_packed(policy: Any) -> bool:
    """Whether a prompt chunk through a packed layer may stay packed under ``policy``: its
    eviction is one budget pooled across layers over scores a pass computes as it runs
    (``fastkvzip``, ``global+X``: :attr:`~kvevict.policies.Policy.rescores_chunks`), which waits
    for the end of the pass, so nothing evicts the layer while the chunk passes; no stage reads
    the pass's attention probabilities or values, which are computed over the padded layout
    (SnapKV's window, H2O's column sums, ...), nor observes the pass; no output correction. The
    chunk's part for the policy is then only its new entries' state, written where they lie."""
    return (
        policy.allocator.across_layers
        and policy.rescores_chunks
        and not policy.requirements("prefill", True).any
        and not policy.requirements("prefill", False).any
        and not policy.observes
        and not policy.corrects_output
    )


class PackedPasses:
    """The packed passes of :class:`~kvevict.layer.EvictionLayer` (a mixin: it reads the layer's
    rows, storage and pass state, declared below)."""

    owner: Any
    policy: Any
    device: torch.device
    storage: LayerStorage
    keys: torch.Tensor
    values: torch.Tensor
    rows: list[RowState]
    window: int | None
    n: int
    passes: int
    prompt_pass: bool
    packed_pass: bool
    compacted: bool
    _exposed: Columns
    _state_views: dict[str, torch.Tensor]
    _steady: Any
    _row_log_partition: torch.Tensor | None

    def continues_prompt(self, num_new: int) -> bool: ...
    def _is_prompt_pass(self, num_new: int) -> bool: ...
    def _count_appended(self, num_new: int) -> None: ...
    def _free_positions(self, before_pass: bool = False) -> torch.Tensor: ...
    def refresh(self, n: int | None = None) -> None: ...
    def views(self) -> list[RowView]: ...
    def correct_output(self, query: torch.Tensor, output: torch.Tensor, scaling: float) -> torch.Tensor: ...

    def _stays_packed(self, num_new: int) -> bool:
        """Whether this pass may leave the layer packed: a packed (ragged) full-attention layer,
        on a CPU (on a GPU the padded layout costs little and a product per head a launch), no
        scoring pass of the policy's own nor hidden states read by column, every row past its
        first pass, and either a decode step (one token per row, the prompt closed) under a
        policy that has nothing to do while decoding but, maybe, correct the output from its
        own data (it evicts only at prefill: its state of decode tokens would never be read), or
        a later chunk of the prompt under a policy whose chunks may stay packed
        (:func:`chunks_stay_packed`). Then the pass appends each head's entries where its
        entries lie and attends them there (:meth:`attend_packed`). Asked once the counters
        moved to this pass (:meth:`~kvevict.cache.EvictionCache.advance`)."""
        owner = self.owner
        return (
            self.storage.packed is not None
            and self.compacted  # (until an eviction the model's own kernel runs: bit-identical to no eviction)
            and self.device.type == "cpu"
            and self.window is None  # (a sliding layer holds at most its window anyway)
            and owner.side_pass is None
            and owner.hidden is None
            and (not self.policy.evicts_in("decode") if num_new == 1 else chunks_stay_packed(self.policy))
            and all(row.sequence.start_passes and row.channels is None for row in self.rows)  # (ThinK masks keys)
            and self.continues_prompt(num_new) == (num_new > 1)
        )

    def append_packed(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass :meth:`_stays_packed` allowed: its entries at the end of each head's segment;
        returns the keys and values the attention path hands back to :meth:`attend_packed`."""
        num_new = key_states.shape[2]
        positions = torch.tensor([row.sequence.start_seen for row in self.rows], device=self.device)
        self.storage.append_packed(key_states, value_states, positions)
        self.prompt_pass = self._is_prompt_pass(num_new)  # (a decode step closes the prompt)
        self.n = max(row.start + row.width for row in self.rows) + num_new
        self._count_appended(num_new)
        self.packed_pass = True
        mark_pending(self, key_states)
        return key_states, value_states

    def leave_packed_pass(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass :meth:`_stays_packed` let append into packed entries cannot attend them there
        (padding in the model's mask, a kernel or logit recipe :meth:`attend_packed` does not
        follow): spread them, its entries included, into padded storage as
        :meth:`~kvevict.layer.EvictionLayer.update` would have, and return the keys and values to attend."""
        self.packed_pass = False
        self.refresh(self.storage.unpack(max(row.interval for row in self.rows), self._free_positions(True)))
        return self.keys, self.values

    def attend_packed(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The output ``[B, q, Hq, d]`` of this pass's queries ``[B, Hq, q, d]`` over the packed
        entries: a decode step's, corrected by the policy (MomentKV's NC) from the ``log Z``
        computed with it; a prompt chunk's, whose part for the policy follows (:meth:`_defer_chunk`)."""
        packed = self.storage.packed
        assert packed is not None
        if query.shape[2] > 1:
            output = packed.attend_chunk(query, scaling)
            self._defer_chunk(query, scaling)
            return output
        corrects = self.policy.corrects_output
        output, self._row_log_partition = packed.attend(query, scaling, corrects)
        return self.correct_output(query, output, scaling) if corrects else output

    def _defer_chunk(self, query: torch.Tensor, scaling: float) -> None:
        """A prompt chunk that stayed packed, for the policy (:func:`chunks_stay_packed`): each
        view's new entries' state, written where they lie, and the pooled eviction, deferred to
        the end of the pass (:meth:`~kvevict.passes.PassEnds.finish_prefill`) as after a padded
        pass. The views read nothing of the layer's entries here (:class:`PackedRowView`)."""
        policy = self.policy
        for view in self.views():
            values = policy.new_tokens(view, view.num_new)
            if values:
                self.storage.write_packed(view.rows, values)
            phase = view.phase()
            if view.eviction_due(phase, view.num_new):
                rows = query if view.rows == slice(0, len(self.rows)) else query[view.rows]
                signals = compute_signals(policy.requirements(phase, True), view, phase, rows, scaling)
                self.owner.deferred.append((view, policy.deferred_signals(signals)))

    def keep_packed(self, counts: torch.Tensor, source: torch.Tensor) -> None:
        """:meth:`~kvevict.driver.PolicyDriver.keep_rows` of a packed layer (a chunk that stayed
        packed): head ``(b, h)`` keeps ``counts[b, h]`` entries, slot ``j`` below that count the one
        at column ``source[b, h, j]`` (:func:`~kvevict.driver.refill_sources`: its kept ones in
        place, the kept ones above the count in the others, in order): the entries and the order
        the padded path leaves, copied from the packed entries (no padded copy of the layer);
        packed anew, or in padded storage when every head keeps as many."""
        kept_n = source.shape[-1]
        kept = torch.arange(kept_n, device=self.device) < counts[..., None]
        self.storage.keep_packed(source, kept, max(row.interval for row in self.rows))
        for row, longest in zip(self.rows, counts.max(dim=1).values.tolist()):
            row.start, row.width = 0, longest
        self.compacted = True
        if self.storage.packed is None:
            self.refresh(kept_n)
        else:
            self.n = kept_n
            self.expose_nothing()

    def expose_nothing(self) -> None:
        """Between passes, a packed or quantized layer exposes no view of its storage's tensors."""
        self._steady = None
        self._exposed, self._state_views = NOTHING_EXPOSED, {}
