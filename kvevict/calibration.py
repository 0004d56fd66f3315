"""Offline calibration of Q-Filters (:mod:`kvevict.policies.qfilters`): run a model on text,
read every attention layer's queries as its attention kernel receives them (after RoPE), and
keep one direction per layer and KV head.

The queries are read through a registered attention function (transformers'
``AttentionInterface``) that records them and calls the model's own ``sdpa`` kernel, so the
model's classes are untouched.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvevict.policies.allocation import model_fingerprint
from kvevict.policies.qfilters import qfilter_directions

RECORDING = "kvevict_record_queries"
"""The attention function :func:`record_queries` runs the model with."""
_recorded: dict[int, list[torch.Tensor]] | None = None


def _recording_attention(module: torch.nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if _recorded is not None:
        _recorded.setdefault(module.layer_idx, []).append(query.detach().float())
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, *args, **kwargs)


AttentionInterface.register(RECORDING, _recording_attention)


def record_queries(model: Any, contexts: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every attention layer's queries over ``contexts`` (``[1, n]`` token ids each), as the
    kernel receives them: ``{layer: [Hq, tokens, d]}`` fp32, the contexts' tokens concatenated."""
    global _recorded
    previous = model.config._attn_implementation
    model.set_attn_implementation(RECORDING)
    _recorded = {}
    try:
        with torch.no_grad():
            for ids in contexts:
                model(input_ids=ids.to(model.device), use_cache=False)
        return {layer: torch.cat([q[0] for q in queries], dim=1) for layer, queries in sorted(_recorded.items())}
    finally:
        _recorded = None
        model.set_attn_implementation(previous)


def qfilters(model: Any, contexts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The Q-Filters of ``model`` from ``contexts``: ``[layers, Hkv, d]``, each KV head's direction
    from the queries of its query heads (:func:`~kvevict.policies.qfilters.qfilter_directions`)."""
    config = model.config.get_text_config()
    kv_heads = config.num_key_value_heads
    directions = []
    for queries in record_queries(model, contexts).values():
        heads, tokens, dim = queries.shape
        groups = queries.view(kv_heads, heads // kv_heads * tokens, dim)
        directions.append(torch.stack([qfilter_directions(group) for group in groups]))
    return torch.stack(directions)


def save_qfilters(path: Path, config: Any, filters: torch.Tensor, source: str) -> None:
    """Write ``filters`` for the model of ``config`` (its fingerprint picks them when the model loads)."""
    record = {"model": model_fingerprint(config), "source": source, "filters": filters.tolist()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
