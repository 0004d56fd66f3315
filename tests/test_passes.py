"""Passes through an eviction cache (kvevict.passes): a decode step's eviction waits for the end
of the pass, the layers' pending evictions end stacked over one arena where the policy allows,
a steady decode step skips the checks the last one made; each gives exactly what evicting
inside every layer, layer by layer, with every check, gives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvevict
from kvevict.policies.h2o import ACCUMULATED, H2O
from kvevict.rows import LayerStack
from tests.conftest import assert_same_storage, greedy, prompt, tiny_model


def generate_with_and_without(
    switch: str, arch: str, policy: str | kvevict.Policy, batch: int, interval: int | None = 1, new_tokens: int = 6
):
    """Greedy generations of ``batch`` different prompts under ``policy`` on a cache as it
    comes, then on one with the boolean attribute ``switch`` off (``ends_passes``,
    ``stacks_pending``, ``steady_steps``): ``((tokens, logits) of each, (the two caches))``."""
    model = tiny_model(arch)
    ids = torch.cat([prompt(40, seed=seed) for seed in range(batch)])
    default, switched_off = (kvevict.EvictionCache(model, policy, budget=24, interval=interval) for _ in range(2))
    setattr(switched_off, switch, False)
    runs = [greedy(model, ids, cache, new_tokens=new_tokens) for cache in (default, switched_off)]
    return runs, (default, switched_off)


@pytest.mark.parametrize(
    "policy", ["h2o", "tova", "streamingllm", "lazyeviction", "random[regime=both]", "critical+h2o", "moment-nc+h2o"]
)
@pytest.mark.parametrize("batch", [1, 3])
def test_a_decode_eviction_at_the_end_of_the_pass_keeps_what_one_inside_the_layer_keeps(
    policy: str, batch: int
) -> None:
    """Nothing reads a layer between its attention and the next pass (MomentKV's NC corrects
    the output from its statistics alone), so running a decode step's state, observation and
    eviction when the pass ends changes nothing but when they run."""
    # without ends_passes each layer evicts inside its attention: what a closed cache does
    ((tokens, logits), (expected_tokens, expected_logits)), (at_end, in_layer) = generate_with_and_without(
        "ends_passes", "llama", policy, batch
    )
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    for ours, theirs in zip(at_end.eviction_layers, in_layer.eviction_layers):
        assert torch.equal(ours.positions, theirs.positions) and ours.length == 24


@pytest.mark.parametrize(
    ("policy", "interval"),
    [("h2o", 1), ("tova", 1), ("streamingllm", 1), ("epikv", 1), ("lazyeviction", None), ("h2o", 4)],
)
@pytest.mark.parametrize("batch", [1, 3])
def test_a_steady_decode_step_keeps_what_a_checked_one_keeps(policy: str, interval: int | None, batch: int) -> None:
    """A decode step like the last one skips the checks that one made: the same tokens,
    logits and entries as checking every step, at every interval (a step that needs more
    room than the storage has is checked again)."""
    ((tokens, logits), (expected_tokens, expected_logits)), (steady, checked) = generate_with_and_without(
        "steady_steps", "llama", policy, batch, interval=interval, new_tokens=12
    )
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    for ours, theirs in zip(steady.eviction_layers, checked.eviction_layers):
        assert torch.equal(ours.positions, theirs.positions)
        assert ours._steady is not None and theirs._steady is None  # the path each took at the last step


def test_a_steady_decode_step_after_inference_mode_leaves_it() -> None:
    """Storage made under ``inference_mode`` is copied into ordinary tensors before a step
    outside it writes into it, steady or not: no error, and what a cache filled outside it gives."""
    model = tiny_model()
    caches = [kvevict.EvictionCache(model, "streamingllm", budget=24, interval=1) for _ in range(2)]
    logits = []
    for cache, mode in zip(caches, (torch.inference_mode, torch.no_grad)):
        with mode():
            model(input_ids=prompt(40), past_key_values=cache)
            for step in range(3):
                model(input_ids=torch.full((1, 1), step + 5), past_key_values=cache)
        with torch.no_grad():
            logits.append(model(input_ids=torch.full((1, 1), 9), past_key_values=cache).logits)
    assert not caches[0].eviction_layers[0].keys.is_inference()
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


@pytest.fixture
def scored(monkeypatch) -> list[type]:
    """The type of every layer (or stack of layers) a policy finds the lowest entries of."""
    found = []
    drop_lowest = kvevict.Policy.drop_lowest
    monkeypatch.setattr(
        kvevict.Policy, "drop_lowest", lambda self, layer, *a: found.append(type(layer)) or drop_lowest(self, layer, *a)
    )
    return found


@pytest.mark.parametrize(
    "policy",
    [
        "h2o",
        "tova",
        "streamingllm",
        "lazyeviction",
        "epikv",
        "band-adaptive",
        "raas",
        "critical+h2o",
        "thinkv",
        "segment-hs",
        "moment-nc+h2o",
    ],
)
@pytest.mark.parametrize("batch", [1, 3])
def test_layers_evicted_as_one_batch_keep_what_each_keeps_alone(policy: str, batch: int, scored: list) -> None:
    """A stackable policy scores every layer's decode-step eviction at once (one minimum over
    the layers' rows; CriticalKV's and ThinKV's selectors stack the eviction only, each layer
    observing its own pass first; MomentKV's statistics are told each layer's evicted entries):
    each layer keeps the same entries, state, memo and all, as on its own."""
    if policy in ("thinkv", "segment-hs"):  # segments short enough to be classified and their quotas bind
        policy = kvevict.make_policy(policy, segment=8, quotas={"R": 4, "E": 2, "T": 1})
    ((tokens, logits), (expected_tokens, expected_logits)), (stacked, alone) = generate_with_and_without(
        "stacks_pending", "llama", policy, batch
    )
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    assert_same_storage(stacked, alone, 24)
    for ours, theirs in zip(stacked.eviction_layers, alone.eviction_layers):  # MomentKV's statistics, say
        assert_same_memo(ours.rows[0].memo, theirs.rows[0].memo)
    # the 5 decode steps after the first token: the first evicts layer by layer and moves the
    # layers into one arena, each later one scores them at once
    assert scored.count(LayerStack) == 4


def assert_same_memo(ours: dict, theirs: dict) -> None:
    """The same keys, and tensors (or dataclasses of tensors) equal bit for bit."""
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        if dataclasses.is_dataclass(value):
            for field in dataclasses.fields(value):
                mine, other = getattr(value, field.name), getattr(theirs[key], field.name)
                assert (mine is None and other is None) or torch.equal(mine, other), (key, field.name)
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, theirs[key]), key


@pytest.mark.parametrize("policy", ["h2o", "lazyeviction", "raas"])
def test_layers_stacked_between_evictions_observe_what_each_observes_alone(policy: str, scored: list) -> None:
    """At an interval of 4 most steps only write the new entries' state and observe (one
    batch for all layers), and every 4th also evicts: the same entries and state as alone."""
    ((tokens, logits), (expected_tokens, expected_logits)), (stacked, alone) = generate_with_and_without(
        "stacks_pending", "llama", policy, 2, interval=4, new_tokens=14
    )
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    assert_same_storage(stacked, alone, alone.eviction_layers[0].length)
    assert LayerStack in scored


def shares_one_arena(cache: kvevict.EvictionCache) -> bool:
    """Whether every layer's keys, values, positions and state lie in one tensor per kind."""
    layers = cache.eviction_layers
    return all(
        len({layer.storage.entries()[name].untyped_storage().data_ptr() for layer in layers}) == 1
        for name in layers[0].storage.entries()
    )


def test_layers_that_stack_are_stored_in_one_arena_which_a_layer_may_leave() -> None:
    """After a decode step the layers that stacked share one tensor per storage kind. A layer
    that replaces its storage (here: it grows) leaves it; that step ends layer by layer, the
    next arena takes the layers in again, and nothing held changes."""
    model = tiny_model()
    ids = prompt(40)
    caches = stacked, alone = [kvevict.EvictionCache(model, "h2o", budget=24, interval=1) for _ in range(2)]
    alone.stacks_pending = False
    for cache in caches:
        greedy(model, ids, cache, new_tokens=3)
    assert shares_one_arena(stacked) and not shares_one_arena(alone)
    for cache in caches:
        layer = cache.eviction_layers[1]
        layer.storage.reserve(layer.n, layer.storage.capacity + 8)
    assert not shares_one_arena(stacked)
    with torch.no_grad():
        for step in range(3):
            outputs = [model(input_ids=prompt(1, seed=step), past_key_values=cache).logits for cache in caches]
            torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    assert shares_one_arena(stacked) and len(stacked._arenas) == 1
    assert_same_storage(stacked, alone, 24)


class LateState(H2O):
    """H2O that starts keeping one more state entry in the middle of decoding."""

    stackable = True

    def new_tokens(self, layer, num_new: int) -> dict[str, torch.Tensor]:
        state = super().new_tokens(layer, num_new)
        if layer.phase() == "decode" and layer.decode_step >= 4:
            state["late"] = torch.ones_like(state[ACCUMULATED])
        return state


def test_a_state_entry_new_to_stacked_layers_is_made_by_each_layer(scored: list) -> None:
    """A stackable stage whose new state entry no layer holds yet: that step ends layer by
    layer (each makes the entry), later steps stack again with the entry in the arena."""
    ((tokens, logits), (expected_tokens, expected_logits)), (stacked, alone) = generate_with_and_without(
        "stacks_pending", "llama", kvevict.Policy(LateState()), 1, new_tokens=8
    )
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    assert_same_storage(stacked, alone, 24)
    assert "h2o/late" in stacked.eviction_layers[0].state and shares_one_arena(stacked)
    # 7 decode steps: the first and the one that makes the new entry end layer by layer
    assert scored.count(LayerStack) == 5


@pytest.mark.parametrize("policy", ["h2o", "lazyeviction"])
def test_layers_that_do_not_stack_are_evicted_on_their_own(policy: str, scored: list) -> None:
    """A hybrid model's sliding and full layers differ in window: each is a group of its own,
    evicted by itself, with what every layer keeps unchanged."""
    ((tokens, logits), (expected_tokens, expected_logits)), (stacked, alone) = generate_with_and_without(
        "stacks_pending", "gemma3", policy, 1
    )
    assert LayerStack not in scored and scored
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    for ours, theirs in zip(stacked.eviction_layers, alone.eviction_layers):
        assert torch.equal(ours.positions, theirs.positions)


def test_a_stack_that_is_not_a_one_drop_eviction_falls_back_to_each_layer(monkeypatch) -> None:
    """When the stacked minimum is not the eviction (a NaN score, say: drop_lowest answers
    None), each layer evicts on its own, exactly as without stacking."""
    drop_lowest = kvevict.Policy.drop_lowest
    monkeypatch.setattr(
        kvevict.Policy,
        "drop_lowest",
        lambda self, layer, *a: None if isinstance(layer, LayerStack) else drop_lowest(self, layer, *a),
    )
    ((tokens, logits), (expected_tokens, expected_logits)), (stacked, _) = generate_with_and_without(
        "stacks_pending", "llama", "h2o", 2
    )
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    assert [layer.length for layer in stacked.eviction_layers] == [24, 24]


def test_a_decode_eviction_waits_for_the_end_of_the_pass() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "h2o", budget=24, interval=1)
    greedy(model, prompt(40), cache, new_tokens=2)
    during = []
    last = model.model.layers[-1]
    handle = last.register_forward_hook(lambda *args: during.append(cache.layer_lengths()))
    try:
        with torch.no_grad():
            model(input_ids=prompt(1), past_key_values=cache)
    finally:
        handle.remove()
    assert during == [[25, 25]]  # every layer attended over the new entry, none evicted yet
    assert cache.layer_lengths() == [24, 24] and not cache.pending


def test_a_pass_that_raises_leaves_its_evictions_to_the_next_pass() -> None:
    """A decode pass interrupted after the first layer: that layer's eviction runs when the
    next pass reaches it, so the next step is still exact."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "h2o", budget=24, interval=1)
    greedy(model, prompt(40), cache, new_tokens=2)

    def fail(*args: object) -> None:
        raise RuntimeError("interrupted")

    handle = model.model.layers[1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="interrupted"), torch.no_grad():
            model(input_ids=prompt(1), past_key_values=cache)
    finally:
        handle.remove()
    assert cache.layer_lengths()[0] == 25 and cache.pending  # layer 0 attended, its eviction waits
    with torch.no_grad():
        model(input_ids=prompt(1, seed=2), past_key_values=cache)
    assert cache.layer_lengths() == [24, 24]


def test_a_closed_cache_evicts_inside_each_layer() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "h2o", budget=24, interval=1)
    cache.close()
    greedy(model, prompt(40), cache, new_tokens=3)
    assert cache.layer_lengths() == [24, 24] and not cache.pending
