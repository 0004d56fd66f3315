import dataclasses
import gc
import weakref

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import kvevict
from kvevict.packedpass import NOTHING_EXPOSED
from kvevict.policies.h2o import ACCUMULATED, H2O
from kvevict.rows import LayerStack
from kvevict.storage import Columns, capacity_bound
from tests.conftest import COMMON, build_policy, greedy, prompt, reference_logits, tiny_model
from tests.policies.test_contract import POLICIES


def test_seq_length_counts_seen_tokens_and_mask_sizes_the_retained() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "streamingllm", budget=40)
    with torch.no_grad():
        model(input_ids=prompt(96), past_key_values=cache)
    assert cache.get_seq_length() == 96
    assert cache.get_mask_sizes(query_length=1, layer_idx=0) == (41, 56)
    assert cache.get_mask_sizes(query_length=5, layer_idx=1) == (45, 56)


def test_retained_bytes_shrink_to_the_budget() -> None:
    model = tiny_model()
    full, evicting = kvevict.EvictionCache(model, "full"), kvevict.EvictionCache(model, "snapkv", budget=40)
    with torch.no_grad():
        model(input_ids=prompt(160), past_key_values=full)
        model(input_ids=prompt(160), past_key_values=evicting)
    per_token = 2 * 2 * 2 * 16 * 4  # layers × (K, V) × KV heads × head_dim × fp32 bytes
    resident = per_token + 2 * 2 * 8  # + each entry's int64 position, per layer and KV head
    assert (full.retained_bytes(), full.kv_bytes()) == (160 * per_token, 160 * resident)
    # the prompt's storage is given back once compressed: the entries and one column of room (interval 1)
    assert (evicting.retained_bytes(), evicting.kv_bytes()) == (40 * per_token, 41 * resident)
    assert all(layer.keys.shape == (1, 2, 40, 16) for layer in evicting.layers)  # physically smaller


def test_policy_state_stays_aligned_with_entries() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "h2o", budget=1000)
    with torch.no_grad():
        model(input_ids=prompt(60), past_key_values=cache)
    layer = cache.layers[0]
    state = cache.policy.scorer.state(layer)
    keys, scores = layer.keys.clone(), state[ACCUMULATED].clone()
    keep = torch.tensor([[[0, 5, 7], [1, 2, 59]]])
    layer.keep(torch.zeros(1, 2, 60, dtype=torch.bool).scatter(2, keep, True))
    keep = torch.tensor([[[0, 5, 7], [59, 1, 2]]])  # a kept entry keeps its slot; dropped slots refill from the end
    assert layer.positions.tolist() == keep.tolist()
    assert torch.equal(state[ACCUMULATED], scores.gather(2, keep))
    assert torch.equal(layer.keys, keys.gather(2, keep[..., None].expand(-1, -1, -1, 16)))


def test_each_kv_head_keeps_its_own_tokens() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "knorm", budget=40)
    with torch.no_grad():
        model(input_ids=prompt(96), past_key_values=cache)
    assert any(not torch.equal(layer.positions[0, 0], layer.positions[0, 1]) for layer in cache.layers)


@pytest.mark.parametrize(("interval", "expected"), [(1, [40] * 8), (4, [41, 42, 43, 40, 41, 42, 43, 40])])
def test_decode_eviction_runs_every_interval_steps(interval: int, expected: list[int]) -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "h2o", budget=40, interval=interval)
    lengths = []
    with torch.no_grad():
        model(input_ids=prompt(96), past_key_values=cache)
        assert cache.layer_lengths() == [40, 40]
        for token in range(8):
            model(input_ids=torch.tensor([[token + 3]]), past_key_values=cache)
            lengths.append(cache.layer_lengths()[0])
    assert lengths == expected
    assert cache.decode_peak() == 40 + interval  # appended before the eviction that follows


def test_keep_fraction_resolves_against_the_prompt() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "snapkv", keep=0.5)
    with torch.no_grad():
        model(input_ids=prompt(100), past_key_values=cache)
    assert cache.layer_lengths() == [50, 50]


def test_keep_below_the_window_is_a_clear_error() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "snapkv", keep=0.1)
    with pytest.raises(ValueError, match=r"budget 10 is smaller than snapkv's .* = 32"):
        model(input_ids=prompt(100), past_key_values=cache)


def test_keep_is_checked_for_decode_time_policies_too() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("streamingllm", sinks=8, regime="decode"), keep=0.05)
    with pytest.raises(ValueError, match=r"budget 5 is smaller than streamingllm's sinks \(8\)"):
        model(input_ids=prompt(100), past_key_values=cache)


def test_sliding_window_layers_keep_their_own_window() -> None:
    torch.manual_seed(0)
    config = Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=16, layer_types=["sliding_attention", "full_attention"]
    )
    model = Qwen2ForCausalLM(config).eval()
    cache = kvevict.EvictionCache(model, "streamingllm", budget=40)
    assert [layer.is_sliding for layer in cache.layers] == [True, False]
    sequences, _ = greedy(model, prompt(96), cache, new_tokens=4)
    assert cache.layer_lengths() == [15, 40]  # the sliding layer holds its window (as transformers' own layer)
    with torch.no_grad():
        logits = model(input_ids=sequences[:, -1:], past_key_values=cache).logits[:, -1]
    assert torch.isfinite(logits).all()


def test_bytes_and_lengths_cover_every_layer_type_of_a_hybrid_model() -> None:
    """Qwen2 with ``use_sliding_window`` and ``max_window_layers`` below the depth mixes
    full-attention and sliding layers; every byte and length report covers both kinds."""
    torch.manual_seed(0)
    config = Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    model = Qwen2ForCausalLM(config).eval()
    cache = kvevict.EvictionCache(model, "h2o", budget=40)
    assert {layer.is_sliding for layer in cache.layers} == {True, False}
    greedy(model, prompt(96), cache, new_tokens=4)
    lengths = cache.layer_lengths()
    full = [i for i, layer in enumerate(cache.layers) if not layer.is_sliding]
    assert all(lengths[i] == 40 for i in full)  # the full-attention layers shrink to the budget
    per_entry = 2 * 2 * 16 * 4  # (K, V) × KV heads × head_dim × fp32 bytes
    slot = per_entry + 2 * (8 + 4)  # + each KV head's int64 position and H2O's fp32 state
    capacities = [layer.storage.capacity for layer in cache.eviction_layers]
    assert cache.layer_bytes() == [(c * slot, n * per_entry) for c, n in zip(capacities, lengths)]
    assert all(n <= c <= n + 1 for c, n in zip(capacities, lengths))  # the entries and one column of room
    assert isinstance(cache.kv_bytes(), int) and cache.kv_bytes() == sum(capacities) * slot


def test_cache_cannot_be_cropped() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "h2o", budget=40)
    with torch.no_grad():
        model(input_ids=prompt(20), past_key_values=cache)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(-2)


def test_reset_clears_positions_and_state() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "h2o", budget=40)
    greedy(model, prompt(96), cache, new_tokens=3)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.layers[0].state == {}
    sequences, _ = greedy(model, prompt(96), cache, new_tokens=3)
    expected = reference_logits(model, cache, sequences[:, -1:])
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=sequences[:, -1:], past_key_values=cache).logits[:, -1], expected, rtol=0, atol=1e-5
        )


@pytest.mark.parametrize("policy", ["random", "epikv", "thinkv", "lazyeviction", "kvzip"])
def test_a_reset_cache_gives_what_a_fresh_one_gives(policy: str) -> None:
    """Everything of the sequences held goes: the layers, the policy's shared data (random's
    seeded generator, ThinKV's entropies) and the recorded hidden states (EpiKV's frozen scores)."""
    model = tiny_model()
    used = kvevict.EvictionCache(model, policy, budget=24)
    greedy(model, prompt(64, seed=5), used, new_tokens=4)
    used.reset()
    fresh = kvevict.EvictionCache(model, policy, budget=24)
    (reused, reused_logits), (expected, expected_logits) = (
        greedy(model, prompt(48), cache, new_tokens=6) for cache in (used, fresh)
    )
    assert torch.equal(reused, expected)
    torch.testing.assert_close(reused_logits, expected_logits, rtol=0, atol=0)
    assert all(torch.equal(a.positions, b.positions) for a, b in zip(used.layers, fresh.layers))
    if fresh.hidden is not None:
        assert used.hidden.scored == fresh.hidden.scored
        torch.testing.assert_close(used.hidden.scores, fresh.hidden.scores, rtol=0, atol=0)


def assert_same_storage(cache: kvevict.EvictionCache, expected: kvevict.EvictionCache, length: int) -> None:
    """Every layer of ``cache`` holds ``length`` entries laid out as ``expected``'s: keys,
    values, positions and the policy's state."""
    for ours, theirs in zip(cache.eviction_layers, expected.eviction_layers):
        assert ours.length == theirs.length == length
        for name in ("keys", "values", "positions"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name))
        assert ours.state.keys() == theirs.state.keys()
        for key in ours.state:  # (a NaN marks a CriticalKV norm not computed yet)
            torch.testing.assert_close(ours.state[key], theirs.state[key], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    "policy", ["h2o", "streamingllm", "tova", "lazyeviction", "epikv", "critical+h2o", "thinkv", "segment-hs"]
)
@pytest.mark.parametrize(("batch", "arch"), [(1, "llama"), (3, "llama"), (1, "llama-mqa")])
def test_a_decode_step_that_drops_one_entry_per_head_lays_storage_out_as_the_general_path(
    policy: str, batch: int, arch: str
) -> None:
    """The one-drop eviction (the dropped entries found by one minimum, or read off a keep
    mask; one scatter per storage tensor) leaves every tensor exactly as the general keep path
    does: the entry of the last column takes the dropped one's slot. One row of one KV head
    makes the moved column a contiguous piece of the storage it is scattered into."""
    model = tiny_model(arch)
    fast, general = (kvevict.EvictionCache(model, policy, budget=24, interval=1) for _ in range(2))
    general.policy.drop_lowest = lambda *args: None  # force the keep mask ...
    for layer in general.eviction_layers:
        layer._drop_one = lambda keep: False  # ... and the general path
    found = []
    drop_lowest = fast.policy.drop_lowest
    fast.policy.drop_lowest = lambda *args: found.append(drop_lowest(*args)) or found[-1]
    ids = prompt(20).repeat(batch, 1) + torch.arange(batch)[:, None]
    with torch.no_grad():
        for cache in (fast, general):
            model(input_ids=ids, past_key_values=cache)
            for step in range(12):
                model(input_ids=torch.full((batch, 1), step + 5), past_key_values=cache)
    # top-k drops each head's minimum; CriticalKV's and ThinKV's selectors find their one entry too
    assert all(slots is not None for slots in found)
    # each layer's rows at each step: one minimum per layer, or one for the layers stacked
    assert sum(len(slots) for slots in found) == (20 + 12 - 24) * len(fast.eviction_layers) * batch
    assert_same_storage(fast, general, 24)


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


def test_a_decode_step_reuses_the_views_of_storage_until_a_tensor_is_replaced() -> None:
    """At interval 1 a step appends (one more column) and evicts (one less): the layer's views
    of both column counts are kept, not made again, while its storage tensors are the same."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "streamingllm", budget=24, interval=1)
    greedy(model, prompt(40), cache, new_tokens=3)
    layer = cache.eviction_layers[1]
    exposed = (layer.keys, layer.values, layer.positions)
    with torch.no_grad():
        model(input_ids=prompt(1), past_key_values=cache)
        assert all(now is before for now, before in zip((layer.keys, layer.values, layer.positions), exposed))
        layer.storage.reserve(
            layer.n, layer.storage.capacity + 8
        )  # new tensors: views of the old ones must not be kept
        model(input_ids=prompt(1, seed=1), past_key_values=cache)
    assert int(layer.positions.max()) == 43  # the last step's entry (40 + 2 + 2 tokens seen) is in the new tensors
    for view, storage in (
        (layer.keys, layer.storage.keys),
        (layer.values, layer.storage.values),
        (layer.positions, layer.storage.positions),
    ):
        assert view.data_ptr() == storage.data_ptr() and view.shape[2] == 24


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


def forward_hooks(model: torch.nn.Module) -> int:
    return sum(len(module._forward_hooks) for module in model.modules())


def forward_pre_hooks(model: torch.nn.Module) -> int:
    return sum(len(module._forward_pre_hooks) for module in model.modules())


@pytest.mark.parametrize("policy", ["full", "h2o", "epikv", "kvzip", "snapkv", "moment-nc+h2o", "fastkvzip"])
def test_a_dropped_cache_is_freed_at_once_without_the_garbage_collector(policy: str) -> None:
    """No reference cycle runs through a cache: with the cyclic collector paused, ``del cache``
    frees its storage and removes its hooks from the model (a plain DynamicCache is freed so)."""
    model = tiny_model()
    budget = None if policy == "full" else 40
    gc.collect()
    gc.disable()
    try:
        before = forward_hooks(model) + forward_pre_hooks(model)
        cache = kvevict.EvictionCache(model, build_policy(policy), budget=budget)
        greedy(model, prompt(60), cache, new_tokens=4)
        assert forward_hooks(model) + forward_pre_hooks(model) > before
        keys = [weakref.ref(layer.storage.keys) for layer in cache.eviction_layers]
        dropped = weakref.ref(cache)
        del cache
        assert dropped() is None
        assert all(key() is None for key in keys)
        assert forward_hooks(model) + forward_pre_hooks(model) == before
    finally:
        gc.enable()


def test_long_decoding_keeps_a_bounded_number_of_views_and_reallocations() -> None:
    """O(1) work per decode step: a layer keeps views of at most two column counts however long
    it decodes, and the hidden-state recorder's series grow geometrically (a few reallocations
    over hundreds of steps, not one per step)."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "epikv", budget=10_000)  # grows: every step appends a column
    recorder = cache.hidden
    buffers: set[int] = set()
    with torch.no_grad():
        logits = model(input_ids=prompt(20), past_key_values=cache).logits[:, -1]
        for _ in range(300):
            logits = model(input_ids=logits.argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1]
            buffers.add(recorder._series[recorder.layers[0]].buffer.data_ptr())
    views = [obj for obj in gc.get_objects() if isinstance(obj, Columns) and obj is not NOTHING_EXPOSED]
    assert len(views) <= 2 * len(cache.eviction_layers)
    assert len(buffers) <= 4  # 64 → 128 → 256 → 512 columns for 320 tokens
    assert recorder.scored == 320


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("interval", [None, 5])
def test_a_row_never_holds_more_than_its_ceiling(policy: str, interval: int | None) -> None:
    """What a scheduler reserves for a row (``row_ceiling``) bounds what every head of it holds
    while it decodes: a decode-time policy its budget and interval (the prompt's entries until
    its first eviction), any other policy its entries plus the new tokens; and the storage's
    resident bytes stay within the capacity bound of that ceiling."""
    model = tiny_model()
    cache = kvevict.EvictionCache(
        model, build_policy(policy), budget=None if policy == "full" else 40, interval=interval
    )
    new_tokens = 23
    with torch.no_grad():
        logits = model(input_ids=prompt(72), past_key_values=cache).logits
        cache.end_prompt()
        ceilings = cache.row_ceiling(0, new_tokens)  # per layer
        ceiling = max(ceilings)
        room = max(cache.sequences[0].interval, 1)
        bound = sum(capacity_bound(c, room) * size for c, size in zip(ceilings, cache.column_bytes()))
        for step in range(new_tokens):
            if step == 11:  # halfway, the ceiling of what is left is no higher in any layer
                assert all(a <= b for a, b in zip(cache.row_ceiling(0, new_tokens - step), ceilings))
            logits = model(input_ids=logits[:, -1:].argmax(-1), past_key_values=cache).logits
            assert cache.kv_bytes() <= bound
    assert all(layer.decode_peak <= c for layer, c in zip(cache.eviction_layers, ceilings))
    if cache.policy.evicts_in("decode"):
        assert ceiling <= 40 + room + (72 if cache.policy.regime == "decode" else 0)
    else:
        assert ceiling == cache.decode_peak() == max(layer.rows[0].width for layer in cache.eviction_layers)
