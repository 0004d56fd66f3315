"""Fast KVzip (kvevict.policies.fastkvzip) and its gates (kvevict.gates)."""

from __future__ import annotations

import math

import pytest
import torch

import kvevict
from kvevict.gates import (
    gate_scores,
    hook_attention_inputs,
    initial_gates,
    load_gates,
    model_key,
    save_gates,
    shape_of,
    stored,
)
from kvevict.generation import prefill
from tests.conftest import (
    assert_next_logits_match_reference,
    build_policy,
    greedy,
    kept_positions,
    prompt,
    tiny_model,
)


def hand_gate() -> dict[str, torch.Tensor]:
    """One KV head, a group of 2, d' = 2, rank 2 over D = 2, two sinks."""
    return {
        "down": torch.eye(2),
        "q_proj": torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0]]),
        "q_bias": torch.tensor([1.0, 0.0, 0.0, 0.0]),
        "k_proj": torch.tensor([[1.0, 0.0], [0.0, 0.0]]),
        "q_norm": torch.ones(2),
        "k_norm": torch.ones(2),
        "sinks": torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]),
        "bias": torch.tensor([[0.5, -0.5]]),
    }


def test_the_gate_forward_matches_a_hand_computation() -> None:
    hidden = torch.tensor([[[3.0, 4.0]]])  # one token
    # x = h; group 0: q = RMSNorm([3+1, 4]) = [4, 4]/4; group 1: q = RMSNorm([4, 3]); k = RMSNorm([3, 0])
    q0 = [4 / 4, 4 / 4]
    q1 = [4 / math.sqrt(12.5), 3 / math.sqrt(12.5)]
    k = [3 / math.sqrt(4.5), 0.0]
    r = 1 / math.sqrt(2)

    def keep(q: list[float], bias: float) -> float:
        logit = (k[0] * q[0] + k[1] * q[1]) * r + bias
        sinks = [q[0] * r, q[1] * r]  # the sink keys are the unit vectors
        return 1 / (1 + sum(math.exp(s - logit) for s in sinks))

    expected = (keep(q0, 0.5) + keep(q1, -0.5)) / 2
    scores = gate_scores(hidden, hand_gate())
    assert scores.shape == (1, 1, 1)
    assert scores.item() == pytest.approx(expected, abs=1e-5)


def test_saved_gates_load_bit_identically(tmp_path) -> None:
    config = tiny_model().config
    gates = stored(initial_gates(shape_of(config), seed=3))
    path = tmp_path / f"{model_key(config)}.safetensors"
    save_gates(path, gates, {"seed": "3"})
    loaded = load_gates(path)
    assert len(loaded) == len(gates)
    for mine, theirs in zip(gates, loaded):
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[part], theirs[part]) for part in mine)


def test_the_same_gates_and_metadata_give_the_same_file(tmp_path) -> None:
    """safetensors writes the metadata in a hash map's order (it changes between writes and
    processes): the gates file sorts it, so a training run's file is reproducible byte for byte."""
    from safetensors import safe_open

    gates = stored(initial_gates(shape_of(tiny_model().config), seed=3))
    metadata = {f"key{index}": f"value {index} é" for index in range(40)}
    files = [tmp_path / f"{copy}.safetensors" for copy in range(4)]
    for path in files:
        save_gates(path, gates, dict(reversed(metadata.items())) if path.stem == "1" else metadata)
    assert len({path.read_bytes() for path in files}) == 1
    with safe_open(files[0], "pt") as opened:
        assert opened.metadata() == metadata


def test_a_model_without_gates_is_refused_saying_how_to_train_them() -> None:
    with pytest.raises(ValueError, match="no gates for model llama-.*kvevict train-gates --model"):
        kvevict.EvictionCache(tiny_model(), "fastkvzip", budget=40)


def test_a_gates_file_of_another_model_is_refused(tmp_path) -> None:
    other = tiny_model(arch="llama").config
    gates = initial_gates(shape_of(other))[:1]  # one layer: not this model's
    path = tmp_path / "one-layer.safetensors"
    save_gates(path, gates, {})
    with pytest.raises(ValueError, match="are for .* this model has"):
        kvevict.EvictionCache(tiny_model(), kvevict.make_policy("fastkvzip", gates=str(path)), budget=40)


def test_each_entry_is_scored_by_its_layers_gate_on_the_attention_input(one_thread) -> None:
    model = tiny_model()
    ids = prompt(64)
    inputs: dict[int, torch.Tensor] = {}

    def remember(index: int, hidden: torch.Tensor, cache: object) -> None:
        inputs.setdefault(index, hidden)

    handles = hook_attention_inputs(model, remember)
    cache = kvevict.EvictionCache(model, build_policy("fastkvzip[per_layer=true]"), budget=200)  # nothing evicted
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    for handle in handles:
        handle.remove()
    gates = initial_gates(shape_of(model.config))
    for layer in cache.eviction_layers:
        expected = gate_scores(inputs[layer.layer_idx], gates[layer.layer_idx])
        torch.testing.assert_close(layer.state["fastkvzip/score"], expected)


@pytest.mark.parametrize(
    "name", ["fastkvzip", "fastkvzip[per_layer=true]", "adakv+fastkvzip", "global+fastkvzip", "pyramidkv+fastkvzip"]
)
def test_the_prompt_is_compressed_at_prefill_under_any_allocator(name: str, one_thread) -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, build_policy(name), budget=40)
    with torch.no_grad():
        model(input_ids=prompt(96), past_key_values=cache)
    held = sum(int(layer.head_lengths().sum()) for layer in cache.eviction_layers)
    assert held <= 2 * 2 * 40 + 2  # a pooled budget: the whole pool, (rounding) at most one more per layer
    assert max(cache.layer_lengths()) < 96


@pytest.mark.parametrize("regime", ["decode", "both"])
def test_decode_regimes_evict_while_decoding_every_interval(regime: str, one_thread) -> None:
    """Batched decode-time gating (the paper's every 128 tokens): the cache grows by up to an
    interval past its budget, then is evicted back to it."""
    assert build_policy("fastkvzip[regime=both]").default_interval(512) == 128  # the paper's
    assert build_policy("fastkvzip[regime=decode]").default_interval(40) == 20  # min(128, budget // 2)
    assert build_policy("fastkvzip").default_interval(512) is None  # prefill only: no room kept past the budget
    model = tiny_model()
    cache = kvevict.EvictionCache(model, build_policy(f"fastkvzip[regime={regime},interval=8]"), budget=40)
    lengths = []
    with torch.no_grad():
        logits = model(input_ids=prompt(30), past_key_values=cache).logits
        for _ in range(26):
            logits = model(input_ids=logits[:, -1:].argmax(-1), past_key_values=cache).logits
            lengths.append(max(cache.layer_lengths()))
    assert max(lengths) == 40 + 8 - 1 and min(lengths[10:]) == 40  # over the budget between evictions only
    assert lengths.count(40) >= 2  # evicted back to the budget at least twice


def test_a_decode_regime_cannot_pool_one_budget_across_layers() -> None:
    with pytest.raises(ValueError, match="regime=prefill"):
        build_policy("global+fastkvzip[regime=both]")


@pytest.mark.slow
def test_the_packaged_gates_keep_the_needle_snapkv_loses_on_smollm2(smollm2) -> None:
    """Context-only compression of an offline RULER sample (the question comes after it): the
    SmolLM2 gates shipped with the package keep the needle at keep 0.10, SnapKV's window does not."""
    from kvevict.bench.tasks import get_task

    model, tokenizer = smollm2
    task = get_task("niah_single_1")
    sample = task.samples(tokenizer, length=1024, count=1, seed=0)[0]

    def score(policy: str) -> float:
        text = kvevict.answer(
            model,
            tokenizer,
            sample.context,
            sample.question,
            answer_prefix=sample.answer_prefix,
            policy=policy,
            keep=0.1,
            max_new_tokens=sample.max_new_tokens,
        )
        return task.score(text, sample)

    assert score("fastkvzip") == 1.0
    assert score("snapkv") == 0.0


@pytest.mark.slow
@pytest.mark.xdist_group("gemma3")
def test_the_packaged_gemma3_gates_load_and_compress_a_context(gemma3) -> None:
    """Gemma-3-270M's packaged gates fit it, and a context-only compression runs on them: the
    gates score the sliding-window layers too, and a context longer than the window keeps at
    most the pooled budget of every layer (a sliding layer at most its window)."""
    from kvevict.bench.tasks import get_task
    from kvevict.gates import packaged_path

    model, tokenizer = gemma3
    assert packaged_path(model.config.get_text_config(decoder=True)).is_file()
    sample = get_task("niah_single_1").samples(tokenizer, length=1024, count=1, seed=0)[0]
    ids = torch.tensor([tokenizer.encode(sample.context)])
    cache = kvevict.EvictionCache(model, "fastkvzip", keep=0.1)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    layers = cache.eviction_layers
    scores = [layer.state["fastkvzip/score"] for layer in layers]
    assert all(bool(((score >= 0) & (score <= 1)).all()) for score in scores)
    budget = layers[0].rows[0].budget
    held = sum(int(layer.head_lengths().sum()) for layer in layers)
    assert budget < ids.shape[-1] // 8 and held <= len(
        layers
    ) * model.config.get_text_config().num_key_value_heads * budget + len(layers)
    assert max(cache.layer_lengths()) < ids.shape[-1]
    cache.close()


@pytest.mark.parametrize(
    ("name", "chunk"), [("fastkvzip", None), ("fastkvzip[per_layer=true]", 32), ("fastkvzip[regime=both]", None)]
)
def test_the_gates_score_only_what_may_be_evicted(name: str, chunk: int | None, one_thread) -> None:
    """The prompt (each chunk of it too) is scored; a decode step only under a regime that evicts
    while decoding: at prefill regime no decode token's score is ever read, so none is computed."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, build_policy(name), budget=200, prompt_length=None if chunk is None else 96)
    hooks = cache.hooks
    with torch.no_grad():
        ids = prompt(96)
        for start in range(0, 96, chunk or 96):
            logits = model(input_ids=ids[:, start : start + (chunk or 96)], past_key_values=cache).logits
            assert all(scores is not None for scores in hooks.latest.values())
        model(input_ids=logits[:, -1:].argmax(-1), past_key_values=cache)
    decoded = [scores is not None for scores in hooks.latest.values()]
    assert decoded == ["regime=both" in name] * len(cache.eviction_layers)


def test_a_prompt_fed_in_chunks_holds_its_prompt_window_until_the_last_chunk(one_thread) -> None:
    """Budget 40, a 160-token prompt fed 16 tokens per pass, ``prompt_window=24`` over the 8-token window: after
    every chunk but the last, each head holds its last 24 tokens beside the pool L·H·40, whose scored part
    (40 − 4 sinks − 8 recent a head) goes to the entries older than them: L·H·(40 − 8 + 24) in all. The last
    chunk's eviction leaves the pool alone, with the 8-token window, and the next token attends to exactly what
    is kept."""
    model = tiny_model()
    ids = prompt(161)
    policy = build_policy("fastkvzip", window=8, prompt_window=24)
    cache = kvevict.EvictionCache(model, policy, budget=40, prompt_length=160)
    with torch.no_grad():
        for end in range(16, 161, 16):
            model(input_ids=ids[:, end - 16 : end], past_key_values=cache)
            window = 24 if end < 160 else 8
            held = kept_positions(cache)
            assert all(set(range(max(0, end - window), end)) <= set(head) for layer in held for head in layer)
            total = sum(len(head) for layer in held for head in layer)
            assert total == 2 * 2 * (40 if end == 160 else min(end, 40 - 8 + 24))
    assert not all(set(range(160 - 24, 160)) <= set(head) for layer in held for head in layer)  # the wide window went
    assert_next_logits_match_reference(model, cache, ids[:, -1:])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliding layers, whose window the pool counts
def test_a_prompt_window_as_long_as_the_prompt_keeps_what_one_pass_keeps(arch: str, one_thread) -> None:
    """Until the last chunk nothing is evicted, so every hidden state is one pass's, and the last chunk's pooled
    eviction chooses what one pass's does: the same entries, the same next token."""
    model = tiny_model(arch)
    ids = prompt(128)
    kept, logits = [], []
    for chunk in (None, 16):
        cache = kvevict.EvictionCache(model, build_policy("fastkvzip", window=8, prompt_window=128), budget=40)
        with torch.no_grad():
            logits.append(prefill(model, ids, cache, chunk=chunk))
        kept.append(kept_positions(cache))
    assert kept[0] == kept[1] and sum(len(head) for layer in kept[0] for head in layer) < 2 * 2 * 128
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)


def test_without_the_prompts_length_no_chunk_is_known_to_be_the_last_and_the_window_stays(one_thread) -> None:
    """``generate(..., prefill_chunk_size=C)`` does not tell the cache where the prompt ends: ``prompt_window``
    then changes nothing, and the budget holds after every chunk."""
    model = tiny_model()
    ids = prompt(160)
    held = []
    for name in ("fastkvzip", "fastkvzip[prompt_window=24]"):
        cache = kvevict.EvictionCache(model, build_policy(name, window=8), budget=40)
        greedy(model, ids, cache, new_tokens=2, chunk=16)
        held.append(kept_positions(cache))
    assert held[0] == held[1]
