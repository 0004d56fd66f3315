"""The policy driver: what an eviction layer does with its policy once a pass attended.

Owns: writing the new entries' initial state, computing and handing over the signals the
policy asked for (:meth:`PolicyDriver.after_attention`), the policy's output correction,
attending a decode query by the probabilities the policy reads (:meth:`~PolicyDriver.decode_row`),
and carrying out a selection: which entries stay, refilling dropped slots from the end, or
compacting rows to column 0 (:meth:`~PolicyDriver.keep_rows`).

Must not touch: when a pass begins or ends and what waits for its end (:mod:`kvevict.passes`),
or how tensors are replaced (every replacement goes through :class:`~kvevict.storage.LayerStorage`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvevict.rows import PackedRows, RowState, RowView
from kvevict.signals import (
    LogitSpec,
    Signals,
    attention_logits,
    compute_signals,
    softmax_log_partition,
    softmax_rows,
    write_new_entries,
)
from kvevict.storage import LayerStorage


class PolicyDriver:
    """The policy-driving half of :class:`~kvevict.layer.EvictionLayer` (a mixin: it reads the
    layer's rows, storage and pass state, declared below)."""

    storage: LayerStorage
    rows: list[RowState]
    n: int
    window: int | None
    compacted: bool
    packed_pass: bool
    pending_pass: Any
    pending_eviction: tuple[RowView, Signals] | None
    _pass_views: list[RowView] | None
    _row_log_partition: torch.Tensor | None = None
    """``log Z`` ``[B, Hq, 1]`` of the :meth:`decode_row` this pass attended by, for the
    policy's output correction (MomentKV's NC reads it rather than compute the logits again)."""
    device: torch.device
    owner: Any
    policy: Any
    num_kv_heads: int

    keep_packed: Callable[[torch.Tensor, torch.Tensor], None]
    """A packed layer's :meth:`keep_rows` (:meth:`~kvevict.packedpass.PackedPasses.keep_packed`)."""

    def refresh(self, n: int | None = None) -> None: ...
    def unpack(self) -> None: ...
    def views(self) -> list[RowView]: ...

    def _start_tokens(self, views: list[RowView]) -> list[RowView]:
        """Write the policy's initial state of the pass's new entries; returns the views of
        the pass (made again when a state entry is new: a view made before it lacks it)."""
        names = len(self.storage.state)
        for view in views:
            if not view.num_new:
                continue
            for name, value in self.policy.new_tokens(view, view.num_new).items():
                if name not in self.storage.state:
                    self.storage.add_state(name, value)
                write_new_entries(self.storage.state[name][view.rows, :, : view.columns.stop], value, view.new_columns)
        if len(self.storage.state) == names:  # written in place, into what `state` and the views show
            return views
        self.refresh()
        return self.views()

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

    def correct_output(self, query: torch.Tensor, output: torch.Tensor, scaling: float) -> torch.Tensor:
        """The policy's correction of the kernel's output ``[B, q, Hq, d]``, row by row."""
        rows = []
        log_partition, self._row_log_partition = self._row_log_partition, None
        views = PackedRows.of(self.rows) if self.packed_pass else self._views_of_pass()
        for view in views:
            if not view.num_new:
                rows.append(output[view.rows])
                continue
            real = query.shape[2] - view.num_new  # the row's padding columns come first
            whole = len(views) == 1 and not real  # (a decode step, usually: no slicing to do)
            corrected = self.policy.correct_output(
                view,
                query if whole else query[view.rows, :, real:],
                output if whole else output[view.rows, real:],
                scaling,
                log_partition if log_partition is None or whole else log_partition[view.rows],
            )
            rows.append(torch.cat([output[view.rows, :real], corrected], dim=1) if real else corrected)
        return rows[0] if len(rows) == 1 else torch.cat(rows)

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
        self._row_log_partition = None
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
        logits = attention_logits(query, view.keys, spec, view.valid)
        row = softmax_rows(logits, spec)
        if self.policy.corrects_output and spec.softcap is None:  # log Z of the logits the correction reads
            if spec.sinks is None:  # from the softmax
                self._row_log_partition = softmax_log_partition(logits, row)
            else:
                self._row_log_partition = logits.logsumexp(dim=-1)
        return row

    def side_attention(
        self, query: torch.Tensor, spec: LogitSpec, module: torch.nn.Module | None = None
    ) -> torch.Tensor | None:
        """In a scoring pass of the policy's own (KVzip's repeat, :meth:`EvictionCache.scoring_pass`):
        hand the pass's queries to its observer before the kernel runs, and return the attention
        output ``[B, q, Hq, d]`` when the observer computed it (the kernel then does not run);
        None when it did not, or outside a scoring pass."""
        if self.owner.side_pass is None:
            return None
        return self.owner.side_pass(self, query, spec, module)

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
        if self.owner.side_pass is not None:  # a scoring pass of the policy's own: observed before (side_attention)
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
                self.owner.deferred.append((view, self.policy.deferred_signals(signals)))
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
            self.keep_rows(rows)

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
        self.keep_rows([(view, keep)])

    def _views_of_pass(self) -> list[RowView]:
        """The views :meth:`begin_pass` made for this pass (or new ones, for a pass that did not begin here)."""
        return self._pass_views if self._pass_views is not None else self.views()

    def keep(self, mask: torch.Tensor) -> None:
        """Retain the entries where ``mask`` ``[B, Hkv, n]`` (storage columns) is true."""
        self.unpack()
        self.keep_rows([(view, mask[view.rows, :, view.columns]) for view in self.views()])

    def keep_rows(self, rows: list[tuple[RowView, torch.Tensor | None]]) -> None:
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
        if (
            whole
            and rows[0][1] is not None
            and self.storage.valid is None
            and self.storage.packed is None
            and width == self.n
            and self._drop_one(kept[0])
        ):
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
        if self.storage.packed is not None:  # a prompt chunk that stayed packed (kvevict.packedpass)
            self.keep_packed(counts, refill_sources(width, counts, holes, movers)[..., :new_n])
            return
        aligned = all(row.start == 0 for row in self.rows)
        ordered = all(keep is None for _, keep in rows)  # only entries that left a sliding window go
        if aligned and not ordered:  # in place: each mover fills a hole
            b, h, dst, src = holes[:, 0], holes[:, 1], holes[:, 2], movers[:, 2]
            for entries in self.storage.entries().values():
                entries[b, h, dst] = entries[b, h, src]
        else:  # rows move to column 0: once for a left-padded batch, or keeping position order
            if ordered:  # as transformers' sliding layer (O(window)): a layer that never evicted stays bit-identical
                source = relative.to(torch.int8).argsort(dim=-1, descending=True, stable=True)
            else:
                source = refill_sources(width, counts, holes, movers)
            starts = torch.tensor([row.start for row in self.rows], device=self.device)[:, None, None]
            source = (source[..., :new_n] + starts).clamp(max=self.n - 1)  # beyond a head's count: unused
            self.storage.gather(source, new_n + max(row.interval for row in self.rows))
        uniform = bool((counts == new_n).all())
        self.storage.set_valid(None if uniform else prefix[..., :new_n])
        for row, longest in zip(self.rows, counts.max(dim=1).values.tolist()):
            row.start, row.width = 0, longest
        # the model's own mask still fits a layout that only lost its oldest entries, in order
        self.compacted = self.compacted or not (ordered and aligned and uniform)
        self.storage.fit(new_n, max(row.interval for row in self.rows))  # evicted in place: give the rest back
        self.refresh(new_n)

    def _holds_everything(self, view: RowView) -> bool:
        """Whether ``view`` is the whole storage: every row, every column, all real."""
        return (
            self.storage.valid is None
            and view.rows.stop - view.rows.start == len(self.rows)
            and view.columns == slice(0, self.n)
        )

    def _drop_slots(self, view: RowView, slots: torch.Tensor) -> None:
        """Evict entry ``slots[b, h]`` of every head of ``view``, the whole storage
        (:meth:`_holds_everything`): what :meth:`keep_rows` does with the mask of every entry
        but those, without building it (unless a stage watches evictions)."""
        if self.policy.watches_evictions:
            self.policy.on_evict_one(view, slots)
        view.write_back()
        self._fill_from_last(slots)

    def _drop_one(self, keep: torch.Tensor) -> bool:
        """A decode step's eviction, the common case of :meth:`keep_rows`: every head of every
        row (all real, aligned) drops exactly one entry (:meth:`_fill_from_last`). Returns
        False, having done nothing, for any other mask."""
        dropped = ~keep
        if not bool((dropped.sum(dim=-1) == 1).all()):
            return False
        self._fill_from_last(dropped.to(torch.uint8).argmax(dim=-1))
        return True

    def _fill_from_last(self, slots: torch.Tensor) -> None:
        """Drop entry ``slots[b, h]`` ``[B, Hkv]`` of every head (all real, aligned): the entry of
        the last column takes its slot, as the general path of :meth:`keep_rows` moves it, by
        one ``scatter_`` per storage tensor."""
        self.storage.move_last_into(slots, self.n - 1)
        self.dropped_last()

    def dropped_last(self) -> None:
        """The entry of the last column took an evicted slot in every head (:meth:`_fill_from_last`)."""
        last = self.n - 1
        for row in self.rows:
            row.width = last
        self.compacted = True
        self.refresh(last)


def refill_sources(width: int, counts: torch.Tensor, holes: torch.Tensor, movers: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, width]``: the column each slot of a head takes its entry from when the head keeps
    its first ``counts`` slots in place and its kept entries beyond them (``movers``, ``[k, 3]``)
    fill, in order, the dropped slots below (``holes``); slots from ``counts`` on keep their own column."""
    source = torch.arange(width, device=counts.device).expand(*counts.shape, width).clone()
    source[holes[:, 0], holes[:, 1], holes[:, 2]] = movers[:, 2]
    return source
