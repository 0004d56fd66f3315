"""The layer's views (issue 37): rows in lockstep, head-wise ragged ones included, run a
batched policy's hooks at once and keep exactly what each row keeps alone."""

from __future__ import annotations

import pytest
import torch

import kvevict
from kvevict.layer import EvictionLayer
from kvevict.rows import RowView
from tests.conftest import build_policy, greedy, greedy_batch, head_positions, left_padded, prompt, tiny_model

LENGTHS = (30, 50, 41)
BUDGET = 20
HEAD_WISE = ("headkv", "adakv+snapkv", "critical+adakv+snapkv", "momentkv", "momentkv[regime=both]")
"""Heads keep different numbers of entries: HeadKV the same per row, AdaKV's differ by row."""


@pytest.mark.parametrize("policy", [*HEAD_WISE, "pyramidkv", "random", "random[regime=both]"])
def test_rows_in_lockstep_keep_what_each_keeps_alone(policy: str, monkeypatch) -> None:
    """After the first eviction the rows of a left-padded batch (prompts of different lengths)
    start at column 0, so every later decode step runs in one view, also when their heads
    keep different numbers of entries (the view carries the validity mask) and when the rows'
    longest heads differ (AdaKV: each row's new entry in its own column); ``random`` draws
    each row from its own generator. A policy with nothing to do while decoding makes no
    view then: its steps leave the ragged layers packed (:mod:`kvevict.packed`). Each row
    keeps, head by head, the positions it keeps alone, and generates the same tokens."""
    model = tiny_model()
    prompts = [prompt(length, seed=seed) for seed, length in enumerate(LENGTHS)]
    ids, mask = left_padded(prompts)
    made: list[list[RowView]] = []
    views = EvictionLayer.views

    passes: list[int] = []

    def recorded(layer: EvictionLayer) -> list[RowView]:
        made.append(views(layer))
        passes.append(layer.passes)
        return made[-1]

    monkeypatch.setattr(EvictionLayer, "views", recorded)
    cache = kvevict.EvictionCache(model, build_policy(policy, window=8), budget=BUDGET)
    tokens, _ = greedy_batch(model, ids, mask, cache, 6)
    monkeypatch.undo()
    ragged = all(layer.storage.packed is not None for layer in cache.eviction_layers)
    if ragged and not cache.policy.evicts_in("decode"):
        assert set(passes) == {1}  # views in the prompt only
        assert all(layer.storage.packed.appended == 5 for layer in cache.eviction_layers)
    else:
        together = [pass_views[0] for pass_views in made if len(pass_views) == 1]
        assert together  # the decode steps after the first eviction ran in lockstep
        if policy in HEAD_WISE:
            assert any(view.valid is not None for view in together)
        if "adakv" in policy or "momentkv" in policy:
            assert any(view.new_columns is not None for view in together)
    for row, alone_ids in enumerate(prompts):
        alone = kvevict.EvictionCache(model, build_policy(policy, window=8), budget=BUDGET)
        expected, _ = greedy(model, alone_ids, alone, new_tokens=6)
        assert torch.equal(tokens[row], expected[0, alone_ids.shape[1] :])
        for layer, alone_layer in zip(cache.eviction_layers, alone.eviction_layers, strict=True):
            assert head_positions(layer, row) == head_positions(alone_layer, 0)
