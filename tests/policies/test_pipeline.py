"""How a policy's stages share a cache (namespaces) and how one policy object serves many caches
and models (issue 13): no state carried over, user-set parameters never overwritten."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

import kvevict
from kvevict.policies.h2o import H2O
from kvevict.policies.lazyeviction import ALPHA_LLAMA, ALPHA_QWEN
from tests.conftest import build_policy, greedy, prompt, tiny_model

BUDGET = 40
STATEFUL = ["random", "h2o", "momentkv", "lazyeviction", "thinkv", "rkv", "critical+adakv+snapkv", "moment-nc+tova"]


@pytest.fixture(scope="module")
def models(one_thread):
    return {"llama": tiny_model("llama"), "qwen2": tiny_model("qwen2", seed=1)}


def kept(model, policy) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    cache = kvevict.EvictionCache(model, policy, budget=BUDGET, interval=2)
    greedy(model, prompt(64), cache, new_tokens=6)
    return [(layer.positions, layer.valid) for layer in cache.eviction_layers]


def same(first, second) -> bool:
    return all(
        torch.equal(a, b) and (u is None and v is None or u is not None and v is not None and torch.equal(u, v))
        for (a, u), (b, v) in zip(first, second)
    )


@pytest.mark.parametrize("name", STATEFUL)
def test_one_policy_object_serves_caches_and_models_in_turn_like_a_fresh_one(name: str, models) -> None:
    reused = build_policy(name)
    for model in (models["llama"], models["qwen2"], models["llama"]):
        assert same(kept(model, reused), kept(model, build_policy(name)))


def test_a_seeded_random_policy_draws_the_same_on_every_new_cache(models) -> None:
    policy = kvevict.make_policy("random", seed=3)
    first, second = kept(models["llama"], policy), kept(models["llama"], policy)
    assert same(first, second)
    assert not same(first, kept(models["llama"], kvevict.make_policy("random", seed=4)))


def test_bind_fills_only_the_parameters_left_unset(models) -> None:
    unset, given = kvevict.make_policy("lazyeviction"), kvevict.make_policy("lazyeviction", alpha=0.01)
    for policy, llama, qwen in ((unset, ALPHA_LLAMA, ALPHA_QWEN), (given, 0.01, 0.01)):
        caches = [kvevict.EvictionCache(models[arch], policy, budget=BUDGET) for arch in ("llama", "qwen2", "llama")]
        assert [cache.policy.method.alpha for cache in caches] == [llama, qwen, llama]
    assert unset.method.alpha is None and given.method.alpha == 0.01  # the objects passed are left as they are
    # in place, re-binding to another config recomputes exactly the unset parameters
    unset.bind(Qwen2Config())
    assert unset.method.alpha == ALPHA_QWEN
    unset.bind(LlamaConfig())
    assert unset.method.alpha == ALPHA_LLAMA
    given.bind(Qwen2Config())
    assert given.method.alpha == 0.01
    layers = kvevict.make_policy("epikv", layers=(0, 1))
    scaled = kvevict.make_policy("epikv")
    for depth in (32, 16):
        for policy in (layers, scaled):
            policy.bind(LlamaConfig(num_hidden_layers=depth))
        assert layers.hidden_layers(depth) == (0, 1)
        assert scaled.hidden_layers(depth) == {32: (10, 21), 16: (5, 11)}[depth]


def test_every_stage_keeps_its_state_under_its_own_namespace(models) -> None:
    model = models["llama"]
    cache = kvevict.EvictionCache(model, "critical+h2o", budget=BUDGET)
    greedy(model, prompt(64), cache, new_tokens=2)
    assert set(cache.layers[0].state) == {"h2o/attention", "critical/value_norm"}
    # two moment statistics (MomentKV's MI, moment-nc's NC) in one policy do not collide
    policy = kvevict.make_policy("moment-nc+momentkv[nc=false,moment-nc.order=0]")
    cache = kvevict.EvictionCache(model, policy, budget=BUDGET)
    greedy(model, prompt(64), cache, new_tokens=2)
    memo = cache.layers[0].memo
    assert set(memo) == {"moments/moments", "moments#2/moments"}
    assert memo["moments/moments"].centered is not None and memo["moments#2/moments"].centered is None


def test_params_rebuild_the_same_policy() -> None:
    for name in [*kvevict.list_policies(), "moment-nc+adakv+h2o", "critical+pyramidkv+momentkv[mi=false]"]:
        policy = build_policy(name)
        params = policy.params()
        if "headkv" in params:  # a mapping profile is recorded as a placeholder
            params["headkv"] = {**params["headkv"], "profile": build_policy(name).named[0].profile}
        rebuilt = kvevict.make_policy(policy.name, **params)
        assert (rebuilt.name, rebuilt.params()) == (policy.name, policy.params())


def test_streamingllm_scores_are_declared_distinct_and_scores_that_tie_are_not() -> None:
    """Positions are unique per head, so StreamingLLM's lowest needs no tie-breaking."""
    assert kvevict.make_policy("streamingllm").distinct_scores
    assert not any(kvevict.make_policy(name).distinct_scores for name in ("h2o", "tova", "knorm", "epikv"))


def test_a_policy_stacks_layers_when_its_drop_time_stages_declare_it() -> None:
    """Stacking the layers' evictions needs a scorer and a protector that read nothing of a
    layer itself, under uniform top-k: declared by each class, never inherited."""
    stacked = ("h2o", "tova", "streamingllm", "lazyeviction", "epikv", "hs-variance", "band-adaptive", "raas")
    stacked += ("moment-nc+h2o",)  # its corrector reads no per-token state; its statistics are told each layer's
    assert all(kvevict.make_policy(name).stacks_layers for name in stacked)
    # a shared generator, keys, scores standardised per layer, another allocator or selector
    refused = ("random", "knorm", "attn-x-hs", "adakv+h2o", "critical+h2o", "thinkv", "segment-hs")
    assert not any(kvevict.make_policy(name).stacks_layers for name in refused)

    class Inherited(H2O):
        name = "h2o-subclass"

    assert not kvevict.Policy(Inherited()).stacks_layers


def test_a_policy_stacks_only_its_evictions_when_its_selection_reads_nothing_of_a_layer() -> None:
    """Per-token hooks that read a layer (its index for the entropy, its values' norms) keep
    observing layer by layer; the eviction stacks when the scorer, the protector and the selector
    read nothing of a layer itself, under uniform counts."""
    evictions_only = ("thinkv", "segment-hs", "critical+h2o")
    assert all(kvevict.make_policy(name).stacks_evictions for name in evictions_only)
    assert not any(kvevict.make_policy(name).stacks_layers for name in evictions_only)
    assert kvevict.make_policy("h2o").stacks_evictions  # (and its hooks too)
    # keys in the score, another allocator, a selector that reads keys, a pool across layers
    refused = ("knorm", "adakv+h2o", "critical+adakv+h2o", "momentkv[allocation=uniform]", "kvzip")
    assert not any(kvevict.make_policy(name).stacks_evictions for name in refused)
