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


def padded_positions(mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions of a left-padded batch as ``generate`` derives them: each row's real tokens count from 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)
