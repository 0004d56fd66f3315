"""A ragged layer's real entries between passes, and the decode steps that attend them as they lie.

Owns: :class:`PackedEntries`, the entries of a layer whose rows or heads hold different
numbers of entries (head-wise budgets, ``keep=`` over prompts of different lengths) once a
pass is over: no padding to the longest head, every entry of one head (one *segment*) next to
the others in storage order, and each segment with a little room to grow, so that a decode
step appends in place (:meth:`PackedEntries.append`) and attends each head's segment where it
lies (:meth:`PackedEntries.attend`) instead of spreading the layer into padded storage and
packing it again, which cost more than the model's own step on ragged layers.

Must not touch: which entries a layer holds, its rows or its passes: the layer decides when a
step may stay packed (:mod:`kvevict.layer`) and the storage when to unpack (:mod:`kvevict.storage`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import accumulate

import torch
import torch.nn.functional as F

from kvevict.signals import as_dtype, as_float32

LOWEST = torch.finfo(torch.float32).min
"""The bias of a slot not filled yet (not −inf: a page of room alone then has a finite largest logit, and no NaN)."""

LARGEST_PAGE = 32
"""The most slots of a page (:func:`page_size`): larger pages hold more room unfilled, and were no faster."""


def page_size(rooms: list[int]) -> int:
    """Slots per page of segments that want ``rooms`` more slots each: the least power of two no
    smaller than their mean room, up to :data:`LARGEST_PAGE`. Rounding each segment up to whole
    pages then adds less than a page to its room: a decode step's room of 16 slots (or a 16th)
    stays 16 (a short segment's is never more than its own), a long segment's at most 32 more."""
    mean = max(1, -(-sum(rooms) // len(rooms)))
    return min(LARGEST_PAGE, 1 << (mean - 1).bit_length())


def starts_of(sizes: list[int]) -> list[int]:
    """Where each of consecutive blocks of ``sizes`` begins."""
    return [0, *accumulate(sizes)][:-1]


def held_slots(held: torch.Tensor, columns: int) -> torch.Tensor:
    """The ``[B·Hkv·columns]`` flat indices of the true slots of ``held`` ``[B, Hkv, n]`` (``n`` ≤
    ``columns``), in storage order: index ``x.view(B·Hkv·columns, ...)`` with them to pick the
    entries ``x[:, :, :n][held]`` picks, without a boolean mask per tensor."""
    b, h, n = held.shape
    head, column = held.view(b * h, n).nonzero().unbind(1)
    return head * columns + column


class PackedEntries:
    """A ragged layer's real entries: each entry ``[capacity, ...]`` lists them head after head
    (row-major over ``[B, Hkv]``), each head's in column order, followed by its room to grow.

    Made tight from the padded layout at the end of a pass (``held`` ``[B, Hkv, n]``: which
    slots were real; ``ends[b]``: the column row ``b`` appends at next). A decode step then
    appends one entry per head at the end of its segment; in the padded layout that entry sits
    at column ``ends[b]`` of its row, the next at ``ends[b] + 1``, ..., which is where the
    padded storage puts a step's entries, so :attr:`held` and :meth:`real` give back exactly
    the padded layout a pass would have left (:meth:`~kvevict.storage.LayerStorage.unpack`)."""

    def __init__(self, held: torch.Tensor, entries: dict[str, torch.Tensor], ends: list[int]):
        self._held, self.entries, self._ends = held, entries, ends
        self.appended = 0
        """Entries each head gained since it was packed (one per decode step, a chunk's per prompt chunk)."""
        self.lengths: list[int] = held.flatten(0, 1).sum(dim=-1).tolist()
        """Real entries of each head (segment), row-major over ``[B, Hkv]``."""
        self.starts = starts_of(self.lengths)
        """Where each segment begins in the entries."""
        self._room = 0
        """Entries the fullest segment can still take."""
        self._next: torch.Tensor | None = None
        """``[B·Hkv]``: where each segment's next entry goes (made at the first append)."""
        self._page = 0
        """Slots per page once a decode step made every segment whole pages (:meth:`_grow`), else 0."""
        self._bias: torch.Tensor | None = None
        """``[capacity]`` fp32: 0 at a slot that holds an entry, :data:`LOWEST` at room not filled
        yet (made while the segments are whole pages): what a decode step adds to its logits, page by page."""
        self._page_segments: torch.Tensor | None = None
        """``[capacity / page]``: the segment of each page (made with :attr:`_bias` by a decode step)."""

    @property
    def held(self) -> torch.Tensor:
        """``[B, Hkv, n]``: which slots of the padded layout hold a real entry."""
        if not self.appended:
            return self._held
        b, h, n = self._held.shape
        width = max(n, max(self._ends) + self.appended)
        held = self._held.new_zeros(b, h, width)
        held[..., :n] = self._held
        for row, end in enumerate(self._ends):
            held[row, :, end : end + self.appended] = True
        return held

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held: the entries with their room, which slots were real at packing, and
        (while a decode step's append made the segments whole pages) which slots are filled and the
        segment of every page."""
        extra = [x for x in (self._bias, self._page_segments) if x is not None]
        return [self._held, *self.entries.values(), *extra]

    @property
    def capacity(self) -> int:
        """Slots the entries hold, room included."""
        return self.entries["keys"].shape[0]

    def row_capacities(self, rows: int) -> list[int]:
        """Entries each row's segments hold room for (its real ones while packed tight)."""
        ends = [*self.starts[1:], self.capacity]
        heads = len(self.starts) // rows
        return [ends[(row + 1) * heads - 1] - self.starts[row * heads] for row in range(rows)]

    def real(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The real entries only, in storage order, of ``names`` (default: every entry); the
        entries themselves while no segment has room."""
        names = self.entries if names is None else names
        if self.capacity == sum(self.lengths):
            return {name: self.entries[name] for name in names}
        index = self._real_index(self.starts)
        return {name: self.entries[name].index_select(0, index) for name in names}

    def _real_index(self, starts: list[int]) -> torch.Tensor:
        """Where the real entries lie when segment ``s`` begins at ``starts[s]``, in storage order."""
        device = self._held.device
        lengths = torch.tensor(self.lengths, device=device)
        shift = torch.tensor(starts, device=device) - torch.tensor(starts_of(self.lengths), device=device)
        return torch.repeat_interleave(shift, lengths) + torch.arange(sum(self.lengths), device=device)

    def append(self, new: dict[str, torch.Tensor], capacity: Callable[[int], int]) -> None:
        """One pass's ``q`` entries ``new[name]`` ``[B, Hkv, q, ...]`` of every head at the end of its
        segment (every entry of the layer is given): a decode step's one, or a prompt chunk's
        (:meth:`attend_chunk`). A segment without room for them makes every segment move into new
        tensors, each with room up to ``capacity(its length)`` (at least ``q``): for decode steps
        O(1) amortised per step, within the storage's bounded slack
        (:func:`~kvevict.storage.capacity_bound`), and whole pages (:meth:`attend`)."""
        q = new["keys"].shape[2]
        if (
            self._next is None
            or (self._next.is_inference() and not torch.is_inference_mode_enabled())
            or self._room < q
            or (q == 1 and not self._page)  # (a decode step attends whole pages: a chunk's growth made none)
        ):
            # new tensors (also for entries made under inference_mode: they are written in place here)
            self._grow(capacity, paged=q == 1)
        assert self._next is not None
        assert self._room >= q, "capacity() gives every segment room for the pass"
        slots = self._next if q == 1 else (self._next[:, None] + torch.arange(q, device=self._next.device)).flatten()
        for name, x in self.entries.items():
            x.index_copy_(0, slots, new[name].reshape(slots.shape[0], *x.shape[1:]))
        if self._bias is not None:
            self._bias.index_fill_(0, slots, 0.0)
        self._next += q
        self._room -= q
        self.lengths = [length + q for length in self.lengths]
        self.appended += q

    def _grow(self, capacity: Callable[[int], int], paged: bool) -> None:
        """Every segment into new tensors with room up to ``capacity(its length)``; with ``paged``
        (decode steps), each rounded up to whole pages of :func:`page_size` slots."""
        extra = [capacity(length) - length for length in self.lengths]
        self._page = page_size(extra) if paged else 0
        if paged:
            extra = [
                -(-(length + more) // self._page) * self._page - length for length, more in zip(self.lengths, extra)
            ]
        capacities = [length + more for length, more in zip(self.lengths, extra)]
        starts, capacity = starts_of(capacities), sum(capacities)
        real, index = self.real(), self._real_index(starts)
        self.entries = {name: x.new_zeros(capacity, *x.shape[1:]).index_copy_(0, index, x) for name, x in real.items()}
        self.starts, self._room = starts, min(extra)
        device = self._held.device
        self._next = torch.tensor(self.starts, device=device) + torch.tensor(self.lengths, device=device)
        if not paged:  # (a chunk's pass attends segment by segment, attend_chunk: no pages, no bias)
            self._bias = self._page_segments = None
            return
        self._bias = torch.full((capacity,), LOWEST, device=device).index_fill_(0, index, 0.0)
        pages = torch.tensor([slots // self._page for slots in capacities], device=device)
        self._page_segments = torch.repeat_interleave(torch.arange(len(capacities), device=device), pages)

    def write_last(self, name: str, rows: slice, value: torch.Tensor) -> None:
        """Entry ``name`` of the last ``q`` entries appended to the segments of batch rows ``rows``:
        ``value`` ``[b, Hkv, q, ...]`` (an entry new to the layer: zeros elsewhere)."""
        assert self._next is not None, "write after an append"
        heads, q = self._held.shape[1], value.shape[2]
        ends = self._next[rows.start * heads : rows.stop * heads]
        slots = (ends[:, None] - q + torch.arange(q, device=ends.device)).flatten()
        if name not in self.entries:
            self.entries[name] = value.new_zeros(self.capacity, *value.shape[3:])
        entry = self.entries[name]
        entry.index_copy_(0, slots, value.reshape(slots.shape[0], *value.shape[3:]).to(entry.dtype))

    def attend(
        self, query: torch.Tensor, scaling: float, log_partition: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention output ``[B, 1, Hq, d]`` (the kernel's layout, the values' dtype) of one
        query per row, ``query`` ``[B, Hq, 1, d]`` (query head ``h`` reads KV head ``h // (Hq / Hkv)``),
        over every real entry (in fp32); and with ``log_partition``, each query's ``log Z``
        ``[B, Hq, 1]`` over them (else None). Page by page (a decode step's append made every
        segment whole pages): each KV head's queries over each page of its own segment, as one
        batched product over the pages, then each page's part weighed by its share of its
        segment's partition, as flash-decoding splits the keys. Why: the segments differ in
        length, and padding them to one would copy the layer, while a row's queries over all of
        its slots (masked to their own head) would cost ``Hkv``× the products."""
        assert self._bias is not None and self._page_segments is not None and self._page, "attend after a step"
        b, hq, _, d = query.shape
        segments, page, pages = len(self.lengths), self._page, self._page_segments
        keys, values = (
            as_float32(self.entries[name]).view(-1, page, self.entries[name].shape[-1]) for name in ("keys", "values")
        )
        queries = (as_float32(query).reshape(segments, -1, d) * scaling).index_select(0, pages)  # [pages, group, d]
        logits = torch.baddbmm(self._bias.view(-1, 1, page), queries, keys.transpose(1, 2))  # [pages, group, page]
        page_max = logits.amax(dim=-1)
        weights = logits.sub_(page_max[..., None]).exp_()
        page_sums = weights.sum(dim=-1)
        page_outputs = torch.bmm(weights, values)  # [pages, group, d]
        group_max = page_max.new_full((segments, page_max.shape[1]), LOWEST)
        group_max.scatter_reduce_(0, pages[:, None].expand_as(page_max), page_max, "amax")
        shares = page_max.sub_(group_max.index_select(0, pages)).exp_()
        sums = page_sums.new_zeros(group_max.shape).index_add_(0, pages, page_sums.mul_(shares))
        output = page_outputs.new_zeros(segments, *page_outputs.shape[1:]).index_add_(
            0, pages, page_outputs.mul_(shares[..., None])
        )
        output = as_dtype(output.div_(sums[..., None]).view(b, 1, hq, -1), self.entries["values"].dtype)
        return output, group_max.add_(sums.log_()).view(b, hq, 1) if log_partition else None

    def attend_chunk(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The attention output ``[B, q, Hq, d]`` (the kernel's layout) of a prompt chunk's ``q``
        queries ``[B, Hq, q, d]`` (query head ``h`` reads KV head ``h // (Hq / Hkv)``), the chunk's
        entries being the last ``q`` appended to every segment: every earlier entry of a head is
        visible to every query (all lie before the chunk), the chunk's own causally. Per (row, KV
        head), one scaled dot-product attention of its query heads over its own segment as it
        lies: no head is padded to the longest (its keys cost what it holds)."""
        b, hq, q, _ = query.shape
        heads = self._held.shape[1]
        group = hq // heads
        keys, values = self.entries["keys"], self.entries["values"]
        causal = torch.ones(q, q, dtype=torch.bool, device=query.device).tril_()
        output = query.new_empty(b, q, hq, values.shape[-1])
        for segment, (start, length) in enumerate(zip(self.starts, self.lengths)):
            row, head = divmod(segment, heads)
            mask = torch.cat([causal.new_ones(q, length - q), causal], dim=1)
            own = slice(head * group, (head + 1) * group)
            attended = F.scaled_dot_product_attention(
                query[row, own].unsqueeze(0),
                keys[start : start + length].expand(1, group, length, -1),
                values[start : start + length].expand(1, group, length, -1),
                attn_mask=mask,
                scale=scaling,
            )
            output[row, :, own] = attended[0].transpose(0, 1)
        return output

    def slots(self) -> torch.Tensor:
        """``[B, Hkv, width]``: where the entry of each slot of the padded layout (:attr:`held`)
        lies in :attr:`entries` (meaningless where no entry is held)."""
        held = self.held
        starts = torch.tensor(self.starts, device=held.device).view(*held.shape[:2], 1)
        return held.cumsum(dim=-1).add_(starts - 1)
