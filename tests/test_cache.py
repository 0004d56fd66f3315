import gc
import weakref

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import kvevict
from kvevict.policies.h2o import ACCUMULATED
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
    gc.collect()  # views other tests left alive are not this cache's: held here, then left out of the count
    earlier = [obj for obj in gc.get_objects() if isinstance(obj, Columns)]
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "epikv", budget=10_000)  # grows: every step appends a column
    recorder = cache.hidden
    buffers: set[int] = set()
    with torch.no_grad():
        logits = model(input_ids=prompt(20), past_key_values=cache).logits[:, -1]
        for _ in range(300):
            logits = model(input_ids=logits.argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1]
            buffers.add(recorder._series[recorder.layers[0]].buffer.data_ptr())
    gc.collect()
    seen_before = {id(obj) for obj in earlier}
    views = [obj for obj in gc.get_objects() if isinstance(obj, Columns) and id(obj) not in seen_before]
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
    keeps_all = [cache.policy.allocator.keeps_all(layer.layer_idx) for layer in cache.eviction_layers]
    if cache.policy.evicts_in("decode") and not any(keeps_all):
        assert ceiling <= 40 + room + (72 if cache.policy.regime == "decode" else 0)
    elif cache.policy.evicts_in("decode"):  # DuoAttention: its retrieval heads keep every entry, the others 40
        assert ceilings == [72 + new_tokens if keeps else 40 + room for keeps in keeps_all]
    else:
        assert ceiling == cache.decode_peak() == max(layer.rows[0].width for layer in cache.eviction_layers)


def test_layer_lengths_and_kept_entries_of_a_ragged_cache() -> None:
    """A head-wise budget keeps different numbers per KV head: ``layer_lengths()`` is the longest
    head, ``per="mean"`` and ``per="total"`` what the heads hold, ``kept()`` the whole cache."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "adakv+snapkv", budget=40)
    with torch.no_grad():
        model(input_ids=prompt(80), past_key_values=cache)
    held = [layer.head_lengths()[0].tolist() for layer in cache.eviction_layers]  # [layers][KV heads]
    assert any(len(set(heads)) > 1 for heads in held)  # ragged
    assert cache.layer_lengths() == [max(heads) for heads in held]
    assert cache.layer_lengths(per="total") == [sum(heads) for heads in held]
    assert cache.layer_lengths(per="mean") == [sum(heads) / len(heads) for heads in held]
    kept = cache.kept()
    assert kept == kvevict.cache.KeptEntries(
        entries=sum(map(sum, held)),
        full=80 * 2 * 2,  # 80 tokens, 2 KV heads, 2 layers
        heads=4,
        longest=max(map(max, held)),
        shortest=min(map(min, held)),
    )
    assert kept.share == sum(map(sum, held)) / 320 and kept.mean == sum(map(sum, held)) / 4
    assert str(kept) == (
        f"kept {100 * kept.share:.1f}% of the entries (mean {kept.mean:.1f} per KV head, "
        f"longest {kept.longest}, shortest {kept.shortest})"
    )
    memory = cache.row_memory(0)
    assert memory["kept_share"] == kept.share and memory["retained_mean"] == kept.mean
    with pytest.raises(ValueError, match="per is 'longest', 'mean' or 'total'"):
        cache.layer_lengths(per="max")


def test_kept_entries_of_a_uniform_cache_say_one_length() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "snapkv", budget=40)
    assert str(cache.kept()) == "kept 100.0% of the entries (0 per KV head)"  # nothing seen yet
    with torch.no_grad():
        model(input_ids=prompt(80), past_key_values=cache)
    assert cache.layer_lengths(per="mean") == [40.0, 40.0] and cache.layer_lengths(per="total") == [80, 80]
    assert str(cache.kept()) == "kept 50.0% of the entries (40 per KV head)"
