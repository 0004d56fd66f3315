"""The contract (DESIGN §1.2) on every tested decoder family (kvevict.models.TESTED_MODEL_TYPES):
tiny random models of each, with the kernels transformers allows for it, over a set of
policies that covers every kind of signal (window rows, last-query rows, column sums, value
norms, hidden states) and every selection path (top-k, head-wise, two-stage, lagged)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

import kvevict
from kvevict.models import TESTED_MODEL_TYPES
from kvevict.signals import Requirements, compute_signals
from tests.conftest import (
    CONFIGS,
    assert_next_logits_match_reference,
    build_policy,
    capture_passes,
    greedy,
    kernels,
    prompt,
    reference_logits,
    tiny_model,
)

FAMILIES = [
    "llama",
    "mistral",
    "mistral_sliding",
    "qwen2",
    "qwen2_hybrid",
    "qwen3",
    "qwen3_moe",
    "phi3",
    "gemma2",
    "gemma3",
    "olmo2",
    "granite",
    "gpt_oss",
]
CASES = [(arch, attn) for arch in FAMILIES for attn in kernels(arch)]
MASK_POLICIES = ["snapkv", "h2o", "adakv+snapkv"]
"""Run under every allowed kernel: prefill-only, every decode step, head-wise padding masks."""
POLICIES = [
    "tova",
    "streamingllm",
    "critical+snapkv",
    "lazyeviction",
    "epikv",
    "expected-attention",
    "rerotate+streamingllm",
]
"""Run under one kernel per family: the kernel's mask path is the same as above."""
EVICTION_CASES = [(arch, attn, policy) for arch, attn in CASES for policy in MASK_POLICIES] + [
    (arch, kernels(arch)[0], policy) for arch in FAMILIES for policy in POLICIES
]
PROMPT, BUDGET, NEW = 96, 40, 7


def test_every_tested_family_is_in_the_suite() -> None:
    covered = {CONFIGS[arch]().get_text_config(decoder=True).model_type for arch in FAMILIES}
    assert covered == set(TESTED_MODEL_TYPES)


@pytest.fixture(scope="module")
def models() -> dict[tuple[str, str], torch.nn.Module]:
    return {}


def family_model(models: dict, arch: str, attn: str) -> torch.nn.Module:
    if (arch, attn) not in models:
        models[arch, attn] = tiny_model(arch, attn=attn)
    return models[arch, attn]


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
@pytest.mark.parametrize(("arch", "attn"), CASES)
def test_ample_budget_is_identical_to_no_eviction(models, arch: str, attn: str, policy: str) -> None:
    model = family_model(models, arch, attn)
    ids = prompt(PROMPT)
    expected, expected_logits = greedy(model, ids, DynamicCache(config=model.config))
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=PROMPT + 16)
    sequences, logits = greedy(model, ids, cache)
    assert torch.equal(sequences, expected) and torch.equal(logits, expected_logits)


@pytest.mark.parametrize(("arch", "attn", "policy"), EVICTION_CASES)
def test_eviction_matches_attention_over_the_retained_entries(models, arch: str, attn: str, policy: str) -> None:
    model = family_model(models, arch, attn)
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=BUDGET, interval=1)
    sequences, _ = greedy(model, prompt(PROMPT), cache, new_tokens=NEW)
    seen = cache.get_seq_length()
    for layer in cache.eviction_layers:
        held = layer.head_lengths()
        cap = BUDGET if layer.window is None else min(layer.window - 1, BUDGET)
        # per head on average (head-wise budgets move entries between heads); prefill-only
        # policies grow by the decoded tokens
        assert int(held.sum()) <= held.numel() * (cap + NEW)
        assert int(held.max()) < PROMPT  # every layer shrank below the prompt
        if layer.window is not None:  # nothing outside the window is ever kept
            real = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
            assert bool((layer.positions[real] > seen - layer.window).all())
    assert isinstance(cache.kv_bytes(), int) and cache.kv_bytes() > 0
    token = sequences[:, -1:]
    assert_next_logits_match_reference(model, cache, token)


def pass_entries(layer, captured: dict, num_queries: int) -> SimpleNamespace:
    """What ``compute_signals`` reads of ``layer``, as it was during a captured pass."""
    return SimpleNamespace(
        keys=captured["keys"],
        values=captured["values"],
        valid=None,
        positions=captured["positions"],
        seen=int(captured["positions"].max()) + 1,
        window=layer.window,
    )


@pytest.mark.parametrize("arch", FAMILIES)
def test_signals_are_the_probabilities_the_kernel_used(models, arch: str) -> None:
    """The eager kernel returns its attention probabilities: the signals computed for the
    policies equal them — soft-capping, custom scaling, learned sinks and sliding windows
    included — at prefill and for a multi-query pass over evicted, non-contiguous entries."""
    model = family_model(models, arch, "eager")
    cache = kvevict.EvictionCache(model, "snapkv", budget=BUDGET)
    passes = [capture_passes(layer) for layer in cache.layers]
    ids = prompt(PROMPT + 5)
    with torch.no_grad():
        outputs = [
            model(input_ids=chunk, past_key_values=cache, output_attentions=True).attentions
            for chunk in (ids[:, :PROMPT], ids[:, PROMPT:])
        ]
    for layer, captured in zip(cache.layers, passes):
        for step, attentions in zip(captured, outputs):
            queries = step["query"].shape[-2]
            signals = compute_signals(
                Requirements(window=queries), pass_entries(layer, step, queries), "prefill", step["query"], step["spec"]
            )
            torch.testing.assert_close(signals.window_attention, attentions[layer.layer_idx].float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
@pytest.mark.parametrize(
    ("arch", "attn"), [case for case in CASES if case[0] in ("mistral_sliding", "gemma2", "gpt_oss")]
)
def test_a_multi_token_pass_after_eviction_matches_the_reference(models, arch: str, attn: str, policy: str) -> None:
    """A pass of several queries over a sliding layer that evicted: its mask is built from
    positions (the retained entries are not contiguous) and matches the reference."""
    model = family_model(models, arch, attn)
    cache = kvevict.EvictionCache(model, policy, budget=BUDGET)
    ids = prompt(PROMPT + 6)
    with torch.no_grad():
        model(input_ids=ids[:, :PROMPT], past_key_values=cache)
        expected = reference_logits(model, cache, ids[:, PROMPT:])
        logits = model(input_ids=ids[:, PROMPT:], past_key_values=cache).logits[:, -1]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
