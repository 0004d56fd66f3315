"""ThinK (``think``, ``think+<policy>``): query-driven pruning of key channels, freed for real."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import kvevict
from kvevict.generation import prefill
from kvevict.policies.think import channel_scores, channels_to_keep, kept_channels
from tests.conftest import (
    assert_next_logits_match_reference,
    build_policy,
    capture_passes,
    greedy,
    prompt,
    resident_storages,
    tiny_model,
)

PROMPT = 96
HEAD_DIM = 16  # the tiny models'
KEPT = 10  # 16 − ⌊0.4·16⌋


def test_a_channel_scores_the_norms_of_its_query_and_key_columns() -> None:
    # one KV head, two query heads (its GQA group) of one window query each, two keys, two channels
    queries = torch.tensor([[[[3.0, 0.0]], [[4.0, 1.0]]]])  # [B=1, Hq=2, w=1, d=2]
    keys = torch.tensor([[[[1.0, 2.0], [0.0, 2.0]]]])  # [B=1, Hkv=1, n=2, d=2]
    scores = channel_scores(queries, keys, None)
    # channel 0: ‖(3, 4)‖ · ‖(1, 0)‖ = 5 · 1; channel 1: ‖(0, 1)‖ · ‖(2, 2)‖ = 1 · √8
    assert scores.tolist() == [[[5.0, pytest.approx(math.sqrt(8))]]]
    held = torch.tensor([[[True, False]]])  # the second key is padding: it takes no part
    assert channel_scores(queries, keys, held).tolist() == [[[5.0, 2.0]]]


def test_each_head_keeps_its_best_channels_and_ties_go_to_the_earlier() -> None:
    scores = torch.tensor([[[1.0, 3.0, 3.0, 0.5], [2.0, 2.0, 2.0, 2.0]]])
    assert kept_channels(scores, 2).tolist() == [[[False, True, True, False], [True, True, False, False]]]


@pytest.mark.parametrize(
    ("head_dim", "ratio", "kept"), [(64, 0.4, 39), (64, 0.5, 32), (16, 0.4, 10), (128, 0.4, 77), (64, 0.3, 45)]
)
def test_the_pruned_channels_are_the_floor_of_the_ratio(head_dim: int, ratio: float, kept: int) -> None:
    assert channels_to_keep(head_dim, ratio) == kept


def test_a_ratio_of_zero_is_bit_identical_to_the_policy_without_think() -> None:
    model = tiny_model()
    ids = prompt(PROMPT)
    for name, plain, budget in (("think[ratio=0]", "full", None), ("think+snapkv[think.ratio=0]", "snapkv", 40)):
        expected = greedy(model, ids, kvevict.EvictionCache(model, build_policy(plain), budget=budget))
        got = greedy(model, ids, kvevict.EvictionCache(model, build_policy(name), budget=budget))
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), name


@pytest.mark.parametrize("policy", ["think", "think+snapkv", "think+adakv+snapkv", "think+keydiff"])
def test_every_key_held_is_zero_exactly_at_its_heads_pruned_channels(policy: str) -> None:
    model = tiny_model()
    budget = None if policy == "think" else 40
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=budget)
    sequences, _ = greedy(model, prompt(PROMPT), cache, new_tokens=6)
    full = DynamicCache()
    with torch.no_grad():
        model(input_ids=sequences[:, :-1], past_key_values=full)
    for layer, reference in zip(cache.eviction_layers, full.layers):
        kept = layer.rows[0].channels  # [Hkv, d]
        assert kept.sum(dim=-1).tolist() == [KEPT] * kept.shape[0]
        valid = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
        index = layer.positions.clamp(min=0)[..., None].expand(-1, -1, -1, HEAD_DIM)
        prompt_entry = (layer.positions < PROMPT)[..., None]  # pruned; the decoded keep every channel
        expected = reference.keys.gather(2, index) * (kept[None, :, None] | ~prompt_entry)
        if layer.layer_idx == 0:  # (deeper keys of decoded tokens depend on the pruning before them)
            torch.testing.assert_close(layer.keys[valid], expected[valid], rtol=0, atol=1e-6)
        pruned = ~kept[None, :, None].expand_as(layer.keys) & prompt_entry & valid[..., None]
        assert bool((layer.keys[pruned] == 0).all()) and bool(layer.keys[~prompt_entry.expand_as(pruned)].ne(0).any())
    assert_next_logits_match_reference(model, cache, sequences[:, -1:])  # attention over the kept channels


@pytest.mark.parametrize("policy", ["think+snapkv", "think+streamingllm", "think"])
def test_the_channels_are_scored_over_the_prompt_entries_the_token_policy_keeps(policy: str) -> None:
    """As kvpress's ``ComposedPress([press, ThinKPress])``: the window's queries against the keys kept."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=None if policy == "think" else 40)
    layer = cache.eviction_layers[0]
    passes = capture_passes(layer)
    greedy(model, prompt(PROMPT), cache, new_tokens=1)
    prompt_pass = passes[0]
    kept = layer.positions[0]  # [Hkv, m]: the prompt's entries the layer holds (no decode step ran)
    keys = prompt_pass["keys"][0].gather(1, kept[..., None].expand(-1, -1, HEAD_DIM))
    expected = kept_channels(channel_scores(prompt_pass["query"][:, :, -32:], keys[None], None), KEPT)[0]
    assert torch.equal(layer.rows[0].channels, expected)


@pytest.mark.parametrize("new_tokens", [1, 5])
def test_the_pruned_channels_are_freed(new_tokens: int) -> None:
    """After the prompt the keys' pruned channels are gone; the 4 keys decoded since keep theirs."""
    model = tiny_model()
    ids = prompt(PROMPT)
    full = kvevict.EvictionCache(model, "full")
    think = kvevict.EvictionCache(model, "think")
    greedy(model, ids, full, new_tokens=new_tokens)
    greedy(model, ids, think, new_tokens=new_tokens)
    pruned_keys, tables = 0, 0
    for theirs, ours in zip(full.eviction_layers, think.eviction_layers):
        assert ours.storage.keys.shape[:3] == theirs.storage.keys.shape[:3]  # the same entries and room
        assert ours.storage.keys.shape[-1] == KEPT and ours.keys.shape[-1] == HEAD_DIM  # held narrow, read whole
        keys = theirs.storage.keys
        pruned_keys += keys.numel() // HEAD_DIM * (HEAD_DIM - KEPT) * keys.element_size()
        pruned = ours.storage.pruned
        assert pruned.held.sum(-1).tolist() == [[new_tokens - 1] * 2]  # the decoded entries keep every channel
        tables += sum(x.numel() * x.element_size() for x in [*pruned.tensors(), ours.rows[0].channels])
    freed = sum(resident_storages(full).values()) - sum(resident_storages(think).values())
    assert freed == pruned_keys - tables


def test_a_prompt_in_chunks_whose_length_the_cache_knows_is_pruned_as_a_whole() -> None:
    model = tiny_model()
    ids = prompt(PROMPT)
    whole = kvevict.EvictionCache(model, "think")
    chunked = kvevict.EvictionCache(model, "think")
    expected = prefill(model, ids, whole)
    logits = prefill(model, ids, chunked, chunk=16)  # (ThinK's window reaches back into the chunks before)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    for ours, theirs in zip(chunked.eviction_layers, whole.eviction_layers):
        assert torch.equal(ours.rows[0].channels, theirs.rows[0].channels)


def test_think_is_refused_over_a_quantized_cache_and_for_a_ratio_of_one() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="^think rewrites the kept keys, which a quantized cache holds as codes"):
        kvevict.EvictionCache(model, "think+snapkv", budget=40, quant="int4", quant_group=8)
    with pytest.raises(ValueError, match="ratio"):
        build_policy("think[ratio=1]")
    assert build_policy("think").name == "think+full"  # ThinK over the full cache: no budget needed
