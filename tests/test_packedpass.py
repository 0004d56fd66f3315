"""Passes that leave a ragged layer packed (kvevict.packedpass): decode steps and, under one budget
pooled across layers, prompt chunks append and attend where the entries lie, and leave exactly
the layout, entries and logits the padded path gives."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvevict
from kvevict.packedpass import chunks_stay_packed
from tests.conftest import build_policy, left_padded, padded_positions, prompt, tiny_model


@pytest.mark.parametrize(
    ("policy", "stays"),
    [
        ("fastkvzip", True),
        ("global+knorm", True),
        ("global+snapkv", False),  # reads the chunk's attention
        ("global+streamingllm[regime=prefill]", True),
        ("global+h2o[regime=prefill]", False),  # observes every pass (its column sums)
        ("knorm", False),  # no pool across layers: evicts each layer as the chunk passes it
        ("kvzip", False),  # its pool is scored by a repeat pass after the whole prompt, not chunk by chunk
    ],
)
def test_chunks_stay_packed_under_a_pool_that_reads_nothing_of_the_pass(policy: str, stays: bool) -> None:
    assert chunks_stay_packed(build_policy(policy)) is stays


def decode(model, cache, ids, mask, steps: int, padded_path: bool, padding_step: int | None = None):
    """``steps`` greedy decode steps after the prompt; with ``padded_path`` every ragged layer is
    unpacked before each step (so the step takes the padded path); ``padding_step``: that step
    is padding for row 1. Returns the per-step logits ``[B, steps, V]``."""
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=padded_positions(mask), past_key_values=cache)
        for step in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            column = torch.ones(mask.shape[0], 1, dtype=mask.dtype)
            if step == padding_step:
                column[1] = 0
            mask = torch.cat([mask, column], dim=1)
            if padded_path:
                for layer in cache.eviction_layers:
                    layer.unpack()
            positions = mask.sum(dim=1, keepdim=True) - 1 if isinstance(cache, DynamicCache) else cache.next_positions()
            out = model(input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=cache)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize(
    "policy", ["adakv+snapkv[window=8]", "kvzip", "headkv[window=8]", "fastkvzip[window=8]", "momentkv[window=8]"]
)
@pytest.mark.parametrize("padding_step", [None, 2])
def test_packed_decode_steps_leave_what_the_padded_path_leaves(policy: str, padding_step: int | None) -> None:
    """The same decode steps of a left-padded batch, left packed or taken through padded storage:
    the same entries in the same layout (positions bit for bit), the same logits (MomentKV's
    NC correcting the output from the ``log Z`` the packed step computes); a step that is padding
    for a row is spread into padded storage first (``leave_packed_pass``), as the padded path."""
    model = tiny_model()
    ids, mask = left_padded([prompt(length, seed=seed) for seed, length in enumerate((30, 50, 41))])
    results = []
    for padded_path in (False, True):
        cache = kvevict.EvictionCache(model, build_policy(policy), keep=0.5)
        logits = decode(model, cache, ids, mask, 6, padded_path, padding_step)
        layers = cache.eviction_layers
        appended = [layer.storage.packed.appended for layer in layers]
        assert appended == [0 if padded_path else 6 - 3 * (padding_step is not None)] * len(layers)
        results.append((logits, [(layer.keys, layer.values, layer.positions, layer.valid) for layer in layers]))
    (packed_logits, packed_layers), (padded_logits, padded_layers) = results
    torch.testing.assert_close(packed_logits, padded_logits, rtol=0, atol=1e-5)
    for (*packed_kv, positions, valid), (*padded_kv, expected_positions, expected_valid) in zip(
        packed_layers, padded_layers, strict=True
    ):
        assert torch.equal(positions, expected_positions) and torch.equal(valid, expected_valid)
        for mine, theirs in zip(packed_kv, padded_kv, strict=True):  # (from the hidden states of either path)
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def test_a_ragged_layer_that_never_evicted_decodes_through_the_models_kernel() -> None:
    """Rows of a left-padded batch hold different numbers of entries before any eviction too:
    such a layer packs between passes, but decodes through the model's own kernel (ample
    budget: bit for bit what no eviction gives)."""
    model = tiny_model()
    ids, mask = left_padded([prompt(length, seed=seed) for seed, length in enumerate((30, 50, 41))])
    expected = decode(model, DynamicCache(), ids, mask, 4, padded_path=False)
    cache = kvevict.EvictionCache(model, build_policy("snapkv"), budget=100)
    assert torch.equal(decode(model, cache, ids, mask, 4, padded_path=False), expected)
    assert all(layer.storage.packed.appended == 0 for layer in cache.eviction_layers)  # each step unpacked


def chunks(model, cache, ids, chunk: int, padded_path: bool, during=None):
    """``ids`` fed ``chunk`` tokens per pass; with ``padded_path`` every ragged layer is unpacked before
    each pass (so it takes the padded path); ``during(cache)`` runs once every layer attended a pass,
    before its pooled eviction. Returns the logits of every token ``[1, n, V]``."""
    hook = model.model.norm.register_forward_hook(lambda *_: during(cache)) if during else None
    logits = []
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            if padded_path:
                for layer in cache.eviction_layers:
                    layer.unpack()
            logits.append(model(input_ids=ids[:, start : start + chunk], past_key_values=cache).logits)
    if hook is not None:
        hook.remove()
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("policy", ["fastkvzip[window=8,prompt_window=24]", "global+knorm"])
def test_prompt_chunks_over_packed_layers_stay_packed_and_leave_what_the_padded_path_leaves(policy: str) -> None:
    """A 160-token prompt fed 16 tokens per pass at budget 40 (``fastkvzip`` holding a prompt window of 24
    beside its 8-token window), under one budget pooled across layers and no cap: each chunk's pass over
    a ragged layer stays packed (no layer padded to its longest head: its storage holds each head's
    retained entries and the chunk's, nothing else, and the pass keeps no chunk queries for the eviction),
    attends as the padded path does (logits of every token within 1e-5), and the pooled eviction, run
    from the packed entries, keeps the same entries in the same layout (positions bit for bit)."""
    model = tiny_model()
    ids = prompt(160)
    results, packed_passes, uneven = [], [], []

    def during(cache: kvevict.EvictionCache) -> None:
        layers = [layer for layer in cache.eviction_layers if layer.packed_pass]
        for layer in layers:
            packed = layer.storage.packed
            assert layer.storage.keys.numel() == layer.storage.values.numel() == 0  # nothing padded
            assert packed.capacity == sum(packed.lengths) == int(layer.head_lengths().sum())  # held + the chunk
            uneven.append(sum(packed.lengths) < len(packed.lengths) * max(packed.lengths))  # padding would cost more
        assert all(signals.query.untyped_storage().nbytes() == 0 for _, signals in cache.deferred)  # no queries kept
        packed_passes.append(len(layers))

    for padded_path in (False, True):
        cache = kvevict.EvictionCache(model, build_policy(policy), budget=40, prompt_length=160)
        logits = chunks(model, cache, ids, 16, padded_path, None if padded_path else during)
        layers = cache.eviction_layers
        results.append((logits, [(layer.keys, layer.values, layer.positions, layer.valid) for layer in layers]))
    assert sum(packed_passes) > len(packed_passes) and max(packed_passes) == 2 and all(uneven)  # every layer
    (packed_logits, packed_layers), (padded_logits, padded_layers) = results
    torch.testing.assert_close(packed_logits, padded_logits, rtol=0, atol=1e-5)
    for (*packed_kv, positions, valid), (*padded_kv, expected_positions, expected_valid) in zip(
        packed_layers, padded_layers, strict=True
    ):
        assert torch.equal(positions, expected_positions)
        assert (valid is None and expected_valid is None) or torch.equal(valid, expected_valid)
        for mine, theirs in zip(packed_kv, padded_kv, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def test_chunks_of_a_policy_that_reads_attention_take_the_padded_path() -> None:
    """``global+snapkv`` scores by the chunk's attention over the padded layout: its chunks unpack the
    layers (the cap still bounds the longest head), and the pass keeps its queries only for the stages
    that read them."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, build_policy("global+snapkv"), budget=40, prompt_length=160)
    packed = []
    chunks(model, cache, prompt(160), 16, False, lambda c: packed.append(any(x.packed_pass for x in c.eviction_layers)))
    assert not any(packed)
    assert cache.policy.allocator.head_cap(cache.policy, model.device, chunked=True) == 4
    assert build_policy("fastkvzip").allocator.head_cap(build_policy("fastkvzip"), model.device, chunked=True) == 0
