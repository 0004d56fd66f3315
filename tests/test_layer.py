"""The layer's views (issue 37): rows in lockstep, head-wise ragged ones included, run a
batched policy's hooks at once and keep exactly what each row keeps alone."""

from __future__ import annotations

import pytest
import torch

import kvevict
from kvevict.layer import EvictionLayer
from tests.conftest import build_policy, greedy, greedy_batch, left_padded, prompt, tiny_model

LENGTHS = (30, 50, 41)
BUDGET = 20


def kept_positions(layer: EvictionLayer, row: int) -> list[list[int]]:
    """Each KV head's retained positions of ``row``, sorted."""
    positions = layer.positions[row]
    valid = torch.ones_like(positions, dtype=torch.bool) if layer.valid is None else layer.valid[row]
    return [sorted(positions[head][valid[head]].tolist()) for head in range(positions.shape[0])]


@pytest.mark.parametrize(("policy", "ragged"), [("headkv", True), ("random", False)])
def test_rows_in_lockstep_keep_what_each_keeps_alone(policy: str, ragged: bool, monkeypatch) -> None:
    """HeadKV's heads keep different numbers of entries (a validity mask), the same in every
    row: after the first eviction the rows of a left-padded batch (prompts of different
    lengths) hold the same columns, so every later step runs in one view; ``random`` draws
    each row from its own generator. Either way each row keeps, head by head, the positions
    it keeps alone, and generates the same tokens."""
    model = tiny_model()
    prompts = [prompt(length, seed=seed) for seed, length in enumerate(LENGTHS)]
    ids, mask = left_padded(prompts)
    counts: list[int] = []
    views = EvictionLayer.views

    def counted(layer: EvictionLayer) -> list:
        made = views(layer)
        counts.append(len(made))
        return made

    monkeypatch.setattr(EvictionLayer, "views", counted)
    cache = kvevict.EvictionCache(model, build_policy(policy, window=8), budget=BUDGET)
    tokens, _ = greedy_batch(model, ids, mask, cache, 6)
    monkeypatch.setattr(EvictionLayer, "views", views)
    assert 1 in counts  # the decode steps after the first eviction ran in lockstep
    for layer in cache.eviction_layers:
        assert (layer.valid is not None) == ragged
        assert [view.rows for view in layer.views()] == [slice(0, len(LENGTHS))]
    for row, alone_ids in enumerate(prompts):
        alone = kvevict.EvictionCache(model, build_policy(policy, window=8), budget=BUDGET)
        expected, _ = greedy(model, alone_ids, alone, new_tokens=6)
        assert torch.equal(tokens[row], expected[0, alone_ids.shape[1] :])
        for layer, alone_layer in zip(cache.eviction_layers, alone.eviction_layers, strict=True):
            assert kept_positions(layer, row) == kept_positions(alone_layer, 0)


def test_head_wise_rows_of_different_widths_run_row_by_row() -> None:
    """AdaKV's heads keep different numbers per row, so the rows' longest heads differ: their
    new entries sit in different columns, and each row still runs alone."""
    model = tiny_model()
    ids, mask = left_padded([prompt(length, seed=seed) for seed, length in enumerate(LENGTHS)])
    cache = kvevict.EvictionCache(model, build_policy("adakv+snapkv", window=8), budget=BUDGET)
    greedy_batch(model, ids, mask, cache, 3)
    layer = cache.eviction_layers[0]
    widths = [row.width for row in layer.rows]
    assert len(set(widths)) > 1
    assert [view.rows for view in layer.views()] == [slice(i, i + 1) for i in range(len(LENGTHS))]
