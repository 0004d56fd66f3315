"""Left-padded batches of prompts (a leaf module: the cache's policies and the helpers share it)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def left_padded(prompts: Sequence[torch.Tensor], pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts ``[1, n_i]`` as one batch padded on the left (``tokenizer.padding_side = "left"``):
    ``(input_ids, attention_mask)`` ``[B, max n_i]``; every row ends with its last real token."""
    width = max(ids.shape[-1] for ids in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt.shape[-1]:
            ids[row, -prompt.shape[-1] :] = prompt[0]
            mask[row, -prompt.shape[-1] :] = 1
    return ids, mask


def pad_to_multiple(
    ids: torch.Tensor, mask: torch.Tensor, multiple: int, pad_token_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch ``(input_ids, attention_mask)`` with padding columns put before it, so
    that its width is a multiple of ``multiple``. Chunked prefill cuts a batch every ``multiple``
    columns from its first one; at such a width every row's cuts then lie at the same distances
    from its end whatever the batch (a row gets the same chunks alone as beside longer rows)."""
    extra = -ids.shape[-1] % multiple
    return (
        torch.cat([ids.new_full((ids.shape[0], extra), pad_token_id), ids], dim=-1),
        torch.cat([mask.new_zeros(mask.shape[0], extra), mask], dim=-1),
    )


def padded_positions(mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions of a left-padded batch as ``generate`` derives them: each row's real tokens count from 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)
