"""Packed entries (kvevict.packed): a ragged layer's entries, the steps and chunks appended to them
where they lie, attended as the padded layout with its mask (the passes that use them:
tests/test_packedpass.py)."""

from __future__ import annotations

import pytest
import torch

from kvevict.attention import attend
from kvevict.packed import PackedEntries, held_slots, page_size
from kvevict.signals import attention_logits, attention_rows


def ragged(batch: int = 2, heads: int = 3, n: int = 9, dim: int = 4, seed: int = 0):
    """A padded layout ``[B, Hkv, n, d]`` whose heads hold different numbers of entries, and its packing."""
    generator = torch.Generator().manual_seed(seed)
    held = torch.rand(batch, heads, n, generator=generator) < 0.6
    held[0, :, -1] = True  # row 0 ends at column n, row 1 earlier
    held[1, :, n - 3 :] = False
    held[1, 0, 0] = True
    keys, values = torch.randn(2, batch, heads, n, dim, generator=generator)
    positions = torch.arange(n).expand(batch, heads, n)
    slots = held_slots(held, n)
    entries = {
        name: x.reshape(batch * heads * n, *x.shape[3:]).index_select(0, slots)
        for name, x in (("keys", keys), ("values", values), ("positions", positions))
    }
    return held, {"keys": keys, "values": values, "positions": positions}, PackedEntries(held, entries, [n, n - 3])


def decode_steps(held, dense, packed, steps: int):
    """``steps`` decode steps appended to ``packed`` (segments with room for 2 more each time they
    move); returns the padded layout they make: which slots hold entries, and the entries."""
    batch, heads, n, dim = dense["keys"].shape
    grown = torch.zeros(batch, heads, n + steps, dtype=torch.bool)
    grown[..., :n] = held
    expected = {name: torch.cat([x, x.new_zeros(batch, heads, steps, *x.shape[3:])], 2) for name, x in dense.items()}
    for step in range(steps):
        new = {"keys": torch.randn(batch, heads, 1, dim), "values": torch.randn(batch, heads, 1, dim)}
        new["positions"] = torch.full((batch, heads, 1), 100 + step)
        packed.append(new, lambda length: length + 2)
        for row, end in enumerate((n, n - 3)):
            grown[row, :, end + step] = True
            for name, x in new.items():
                expected[name][row, :, end + step] = x[row, :, 0]
    return grown, expected


def test_appended_entries_lie_where_the_padded_layout_puts_a_decode_step() -> None:
    """Row ``b``'s step ``j`` lands at column ``ends[b] + j``; segments that run out of room move
    (here every other step) and keep every entry, in storage order."""
    held, dense, packed = ragged()
    grown, expected = decode_steps(held, dense, packed, 5)
    assert torch.equal(packed.held, grown)
    assert packed.lengths == grown.flatten(0, 1).sum(-1).tolist()
    slots = held_slots(grown, grown.shape[-1])
    for name, x in packed.real().items():
        assert torch.equal(x, expected[name].reshape(-1, *x.shape[1:]).index_select(0, slots))
    capacity = packed.entries["keys"].shape[0]
    assert sum(packed.row_capacities(2)) == capacity > sum(packed.lengths)  # each segment's room, no more


@pytest.mark.parametrize("steps", [1, 2])
def test_a_packed_step_attends_as_the_padded_layout_with_its_mask(steps: int) -> None:
    """Each query over its own KV head's filled slots only (room not filled yet after one step, none after two)."""
    held, dense, packed = ragged(heads=2, dim=8)
    grown, expected = decode_steps(held, dense, packed, steps)
    query = torch.randn(2, 6, 1, 8)  # three query heads per KV head
    rows = attention_rows(query, expected["keys"], 0.3, grown)
    output, log_z = packed.attend(query, 0.3, log_partition=True)
    torch.testing.assert_close(output, attend(rows, expected["values"]), rtol=1e-6, atol=1e-6)
    expected_log_z = attention_logits(query, expected["keys"], 0.3, grown).logsumexp(dim=-1)  # what NC reads
    torch.testing.assert_close(log_z, expected_log_z, rtol=1e-6, atol=1e-6)
    assert packed.attend(query, 0.3)[1] is None


def counted(counts: list[list[int]], n: int = 8, dim: int = 8, seed: int = 0) -> PackedEntries:
    """Packed entries whose row ``b``, head ``h`` holds its first ``counts[b][h]`` columns of ``n``."""
    generator = torch.Generator().manual_seed(seed)
    held = torch.tensor([[[column < count for column in range(n)] for count in row] for row in counts])
    batch, heads = held.shape[:2]
    keys, values = torch.randn(2, batch * heads * n, dim, generator=generator)
    slots = held_slots(held, n)
    positions = torch.arange(n).repeat(batch * heads)
    entries = {"keys": keys[slots], "values": values[slots], "positions": positions[slots]}
    return PackedEntries(held, entries, [max(row) for row in counts])


def padded(packed: PackedEntries, name: str) -> torch.Tensor:
    """Entry ``name`` of ``packed`` in the padded layout of :attr:`PackedEntries.held` (zeros elsewhere)."""
    held, real = packed.held, packed.real()[name]
    dense = real.new_zeros(held.numel(), *real.shape[1:])
    dense[held_slots(held, held.shape[-1])] = real
    return dense.view(*held.shape, *real.shape[1:])


@pytest.mark.parametrize(
    ("rooms", "page"), [([16, 16, 16], 16), ([20, 17], 32), ([40, 20], 32), ([1000], 32), ([3, 1], 2), ([1], 1)]
)
def test_a_page_is_the_least_power_of_two_from_the_mean_room_up_to_32(rooms: list[int], page: int) -> None:
    assert page_size(rooms) == page


@pytest.mark.parametrize("room", [2, 8, 20])
def test_a_decode_step_makes_segments_whole_pages_and_attends_them_page_by_page(room: int) -> None:
    """Each segment's capacity is its entries and room rounded up to whole pages, so every
    segment starts a page; a step attends each query over its own KV head's entries only (pages
    of room alone included: ``room`` 8 and 20 leave some) and gives the ``log Z`` NC reads."""
    packed = counted([[5, 3], [4, 3], [2, 6]])
    new = {name: torch.randn(3, 2, 1, *x.shape[1:]) for name, x in packed.entries.items() if name != "positions"}
    new["positions"] = torch.full((3, 2, 1), 50)
    packed.append(new, lambda length: length + room)
    page = page_size([room] * 6)
    assert all(start % page == 0 for start in packed.starts) and packed.capacity % page == 0
    assert packed.capacity <= sum(packed.lengths) - 6 + 6 * (room + page - 1)  # less than a page more room
    query = torch.randn(3, 6, 1, 8)
    held, keys = packed.held, padded(packed, "keys")
    output, log_z = packed.attend(query, 0.3, log_partition=True)
    rows = attention_rows(query, keys, 0.3, held)
    torch.testing.assert_close(output, attend(rows, padded(packed, "values")), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(log_z, attention_logits(query, keys, 0.3, held).logsumexp(-1), rtol=1e-6, atol=1e-6)


def test_a_chunk_appended_to_packed_segments_attends_as_the_padded_layout_with_a_causal_mask() -> None:
    """A prompt chunk's ``q`` entries land at columns ``ends[b] .. ends[b] + q`` of the padded layout (where
    the padded path appends them), the segments with room for exactly the chunk; each query attends every
    earlier entry of its KV head and the chunk's own up to itself, as the padded path's mask allows."""
    held, dense, packed = ragged(heads=2, dim=8)
    batch, heads, n, dim = dense["keys"].shape
    q = 4
    new = {"keys": torch.randn(batch, heads, q, dim), "values": torch.randn(batch, heads, q, dim)}
    new["positions"] = (100 + torch.arange(q)).expand(batch, heads, q)
    packed.append(new, lambda length: length + q)
    grown = torch.zeros(batch, heads, n + q, dtype=torch.bool)
    grown[..., :n] = held
    expected = {name: torch.cat([x, x.new_zeros(batch, heads, q, *x.shape[3:])], 2) for name, x in dense.items()}
    for row, end in enumerate((n, n - 3)):
        grown[row, :, end : end + q] = True
        for name, x in new.items():
            expected[name][row, :, end : end + q] = x[row]
    assert torch.equal(packed.held, grown)
    assert packed.capacity == sum(packed.lengths)  # room for the chunk and no more
    assert len(packed.tensors()) == 1 + len(packed.entries)  # which slots were real, the entries: no pages, no bias
    query = torch.randn(batch, 6, q, dim)  # three query heads per KV head
    visible = grown[:, :, None, :] & (expected["positions"][:, :, None, :] <= (100 + torch.arange(q))[:, None])
    logits = (query.double() @ expected["keys"].double().repeat_interleave(3, 1).transpose(-1, -2)) * 0.3
    logits = logits.masked_fill(~visible.repeat_interleave(3, 1), float("-inf"))
    reference = (logits.softmax(-1) @ expected["values"].double().repeat_interleave(3, 1)).transpose(1, 2)
    torch.testing.assert_close(packed.attend_chunk(query, 0.3).double(), reference, rtol=0, atol=1e-6)
    slots = packed.slots()  # where each held slot of the padded layout lies in the entries
    for name, x in expected.items():
        assert torch.equal(packed.entries[name][slots[grown]], x[grown])


def test_a_decode_step_after_a_chunk_makes_the_segments_whole_pages() -> None:
    """A chunk's growth leaves room for the chunk only, not pages: the next decode step moves the
    segments into whole pages even where they have room for it, and attends them."""
    packed = counted([[5, 3], [4, 3], [2, 6]])
    for q, room in ((3, 4), (1, 4)):
        new = {name: torch.randn(3, 2, q, *x.shape[1:]) for name, x in packed.entries.items() if name != "positions"}
        new["positions"] = torch.full((3, 2, q), 50)
        packed.append(new, lambda length, room=room: length + room)  # the chunk: room for 1 more after it
    assert all(start % 4 == 0 for start in packed.starts) and packed.capacity % 4 == 0
    query = torch.randn(3, 6, 1, 8)
    held, keys = packed.held, padded(packed, "keys")
    output, _ = packed.attend(query, 0.3)
    rows = attention_rows(query, keys, 0.3, held)
    torch.testing.assert_close(output, attend(rows, padded(packed, "values")), rtol=1e-6, atol=1e-6)
