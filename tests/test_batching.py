"""Left-padded batches (kvevict.batching): every row ends with its last real token, padding
columns go before a batch, and each row's RoPE positions count its real tokens from 0."""

from __future__ import annotations

import torch

from kvevict.batching import left_padded, pad_to_multiple, padded_positions

PAD = 9


def test_prompts_are_padded_on_the_left_to_the_longest() -> None:
    prompts = [torch.tensor([[5, 6, 7]]), torch.tensor([[8]]), torch.zeros(1, 0, dtype=torch.long)]
    ids, mask = left_padded(prompts, pad_token_id=PAD)
    assert ids.tolist() == [[5, 6, 7], [PAD, PAD, 8], [PAD, PAD, PAD]]  # an empty prompt is all padding
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long


def test_one_prompt_is_its_own_batch_with_nothing_masked() -> None:
    ids, mask = left_padded([torch.tensor([[3, 1, 4]])])
    assert ids.tolist() == [[3, 1, 4]] and mask.tolist() == [[1, 1, 1]]


def test_padding_columns_go_before_the_batch_up_to_the_next_multiple() -> None:
    ids, mask = left_padded([torch.tensor([[5, 6, 7]]), torch.tensor([[8]])], pad_token_id=PAD)
    wide_ids, wide_mask = pad_to_multiple(ids, mask, 4, pad_token_id=PAD)
    assert wide_ids.tolist() == [[PAD, 5, 6, 7], [PAD, PAD, PAD, 8]]
    assert wide_mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    wider_ids, wider_mask = pad_to_multiple(ids, mask, 5, pad_token_id=PAD)
    assert wider_ids.shape == wider_mask.shape == (2, 5) and wider_ids[:, :2].eq(PAD).all()
    assert not wider_mask[:, :2].any() and torch.equal(wider_ids[:, 2:], ids)


def test_a_width_already_a_multiple_is_left_as_it_is() -> None:
    ids, mask = left_padded([torch.tensor([[5, 6, 7, 1]]), torch.tensor([[8, 2]])])
    for multiple in (1, 2, 4):
        same_ids, same_mask = pad_to_multiple(ids, mask, multiple)
        assert torch.equal(same_ids, ids) and torch.equal(same_mask, mask)


def test_each_rows_positions_count_its_real_tokens_from_zero() -> None:
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]])
    # padding takes position 0 (what generate gives it; the mask hides it anyway)
    assert padded_positions(mask).tolist() == [[0, 1, 2, 3], [0, 0, 1, 2], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert padded_positions(mask.bool()).tolist() == padded_positions(mask).tolist()
