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
from itertools import accumulate, pairwise

import torch
import torch.nn.functional as F

from kvevict.signals import as_dtype, as_float32, softmax_log_partition


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
        self._heads: torch.Tensor | None = None
        """``[capacity]`` int16: the KV head of the entry in each slot, −1 for room not filled yet
        (made at the first append: a decode step attends a row's slots at once by it)."""
        self._segment_heads: torch.Tensor | None = None
        """``[B·Hkv]`` int16: the KV head of each segment (made with :attr:`_heads`)."""
        self._own: torch.Tensor | None = None
        """``[Hq, 1]``: the KV head of each query head (made at the first :meth:`attend`)."""

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
        (once appended to, attended) the head of every slot and of every query head."""
        extra = [x for x in (self._heads, self._own) if x is not None]
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
        (:func:`~kvevict.storage.capacity_bound`)."""
        q = new["keys"].shape[2]
        if (
            self._next is None
            or (self._next.is_inference() and not torch.is_inference_mode_enabled())
            or self._room < q
        ):
            # new tensors (also for entries made under inference_mode: they are written in place here)
            self._grow(capacity, even=q == 1)
        assert self._next is not None and self._heads is not None and self._segment_heads is not None
        assert self._room >= q, "capacity() gives every segment room for the pass"
        slots = self._next if q == 1 else (self._next[:, None] + torch.arange(q, device=self._next.device)).flatten()
        for name, x in self.entries.items():
            x.index_copy_(0, slots, new[name].reshape(slots.shape[0], *x.shape[1:]))
        self._heads.index_copy_(0, slots, self._segment_heads if q == 1 else self._segment_heads.repeat_interleave(q))
        self._next += q
        self._room -= q
        self.lengths = [length + q for length in self.lengths]
        self.appended += q

    def _grow(self, capacity: Callable[[int], int], even: bool) -> None:
        """Every segment into new tensors with room up to ``capacity(its length)``; with ``even``
        (decode steps), rows made one width where that is cheap (:meth:`_even_rows`)."""
        extra = [capacity(length) - length for length in self.lengths]
        capacities = [length + more for length, more in zip(self.lengths, extra)]
        if even:
            self._even_rows(capacities, extra)
        starts, capacity = starts_of(capacities), sum(capacities)
        real, index = self.real(), self._real_index(starts)
        self.entries = {name: x.new_zeros(capacity, *x.shape[1:]).index_copy_(0, index, x) for name, x in real.items()}
        self.starts, self._room = starts, min(extra)
        device = self._held.device
        lengths = torch.tensor(self.lengths, device=device)
        self._next = torch.tensor(self.starts, device=device) + lengths
        self._segment_heads = torch.arange(len(lengths), device=device).remainder_(self._held.shape[1]).to(torch.int16)
        held_heads = torch.repeat_interleave(self._segment_heads, lengths)
        self._heads = torch.full((capacity,), -1, dtype=torch.int16, device=device).index_copy_(0, index, held_heads)

    def _even_rows(self, capacities: list[int], extra: list[int]) -> None:
        """Give every row's last segment the room that brings the row to the widest row's slots,
        where that at most doubles each row's room (rows of one budget, in lockstep, differ by a
        few slots of rounding): rows of one width attend as one batched product (:meth:`attend`).
        Rows far apart (a ragged batch of very different prompts) keep their own widths."""
        rows, heads = self._held.shape[:2]
        if rows < 2:
            return
        totals = [sum(capacities[row * heads : (row + 1) * heads]) for row in range(rows)]
        rooms = [sum(extra[row * heads : (row + 1) * heads]) for row in range(rows)]
        widest = max(totals)
        if all(widest - total <= room for total, room in zip(totals, rooms)):
            for row, total in enumerate(totals):
                capacities[(row + 1) * heads - 1] += widest - total
                extra[(row + 1) * heads - 1] += widest - total

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
        ``[B, Hq, 1]`` over them (else None). Per row, one product of its queries with every slot
        of its segments as they lie, each query masked to its own KV head's filled slots: the
        segments differ in length, and padding them would copy the layer (a query's products
        with other heads' entries are the price: ``Hkv``× a padded step's, at one query). Rows of
        one width (:meth:`_even_rows`) take one batched product for all of them, which the BLAS
        splits over rows rather than inside one row's small product. The mask is one additive
        bias made once a step, which the product adds (its zeros exactly: bit for bit the masked
        product), not a comparison and a masked fill per row."""
        assert self._heads is not None, "attend after an append"
        b, hq, _, d = query.shape
        keys, values = self.entries["keys"], self.entries["values"]
        queries = as_float32(query).view(b, hq, d) * scaling
        bias = torch.where(self._heads == self._query_heads(hq), 0.0, float("-inf"))  # [Hq, slots]
        per_row = len(self.lengths) // b
        bounds = [*self.starts[::per_row], keys.shape[0]]
        width = keys.shape[0] // b
        if b > 1 and bounds == list(range(0, keys.shape[0] + 1, width)):  # rows of one width: one product for all
            logits = torch.baddbmm(
                bias.view(hq, b, width).transpose(0, 1), queries, as_float32(keys).view(b, width, d).transpose(1, 2)
            )
            probs = logits.softmax(dim=-1)
            output = torch.bmm(probs, as_float32(values).view(b, width, -1))
            log_z = softmax_log_partition(logits, probs) if log_partition else None
        else:
            output = torch.empty(b, hq, values.shape[-1], dtype=torch.float32, device=query.device)
            log_z = torch.empty(b, hq, dtype=torch.float32, device=query.device) if log_partition else None
            for row, (start, stop) in enumerate(pairwise(bounds)):
                logits = torch.addmm(bias[:, start:stop], queries[row], as_float32(keys[start:stop]).t())
                probs = logits.softmax(dim=-1)
                torch.mm(probs, as_float32(values[start:stop]), out=output[row])
                if log_z is not None:
                    log_z[row] = softmax_log_partition(logits, probs)
        return as_dtype(output.view(b, 1, hq, -1), values.dtype), None if log_z is None else log_z.view(b, hq, 1)

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

    def _query_heads(self, hq: int) -> torch.Tensor:
        """``[Hq, 1]``: the KV head each query head reads (made once: every decode step masks by it)."""
        if self._own is None or self._own.shape[0] != hq:
            group = hq // self._held.shape[1]
            heads = torch.arange(hq, device=self._held.device).div_(group, rounding_mode="floor")
            self._own = heads.to(torch.int16)[:, None]  # the dtype of the slots' heads: compared without a cast
        return self._own
