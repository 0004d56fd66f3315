"""The containers of a quantized layer's codes (kvevict.quantcodes): packed to the real entries
and back, by hand."""

from __future__ import annotations

import torch

from kvevict.quantcodes import PackedCodes, PackedTail, QuantizedTensor, rectangle, rectangles


def test_packed_codes_hold_the_real_entries_and_the_groups_holding_one_and_come_back_with_zeros() -> None:
    held = torch.tensor([[[True, True, True, False], [True, False, False, False]]])  # [1, 2 heads, 4]
    codes = torch.arange(16, dtype=torch.uint8).view(1, 2, 4, 2) + 1
    scale = torch.tensor([[[[[1.0]], [[2.0]]], [[[3.0]], [[4.0]]]]])  # keys: groups of 2 entries, [1, 2, 2, 1, 1]
    packed = PackedCodes.of(QuantizedTensor(codes, scale, -scale), held, per=2)
    assert packed.codes.tolist() == [[1, 2], [3, 4], [5, 6], [9, 10]]  # 4 real entries, not 8
    assert packed.scale.flatten().tolist() == [1.0, 2.0, 3.0]  # head 1's second group holds none
    back = rectangle(packed)
    assert back.codes[held].tolist() == codes[held].tolist() and not back.codes[~held].any()
    assert back.scale.flatten().tolist() == [1.0, 2.0, 3.0, 0.0] and back.zero.flatten().tolist() == [
        -1.0,
        -2.0,
        -3.0,
        0.0,
    ]


def test_a_packed_tail_holds_its_real_rows() -> None:
    held = torch.tensor([[[False, True], [True, True]]])
    rows = torch.arange(8, dtype=torch.float32).view(1, 2, 2, 2)
    tail = PackedTail(held, rows[held])
    assert tail.rows.shape == (3, 2) and sum(x.numel() for x in tail.tensors()) == 4 + 6
    assert torch.equal(rectangle(tail), rows.masked_fill(~held[..., None], 0))
    assert rectangle(rows) is rows


def test_keys_and_values_packed_to_one_mask_come_back_as_each_alone() -> None:
    held = torch.tensor([[[True, True, True, False], [True, False, False, False]]])
    codes = torch.arange(16, dtype=torch.uint8).view(1, 2, 4, 2) + 1
    key_scale = torch.tensor([[[[[1.0]], [[2.0]]], [[[3.0]], [[4.0]]]]])  # groups of 2 entries
    value_scale = torch.arange(8, dtype=torch.float32).view(1, 2, 4, 1, 1) + 1  # one per entry
    keys = PackedCodes.of(QuantizedTensor(codes, key_scale, -key_scale), held, per=2)
    values = PackedCodes.of(QuantizedTensor(codes + 1, value_scale, value_scale), held, per=1)
    other = PackedCodes.of(QuantizedTensor(codes + 1, value_scale, value_scale), held.clone(), per=1)
    tails = PackedTail(held, torch.ones(4, 3)), PackedTail(held, torch.zeros(4, 3))
    for first, second in ((keys, values), (keys, other), tails, (keys, codes)):
        together = rectangles(first, second)
        for joint, alone in zip(together, (rectangle(first), rectangle(second)), strict=True):
            for a, b in zip(*(x.tensors() if isinstance(x, QuantizedTensor) else [x] for x in (joint, alone))):
                assert torch.equal(a, b)
