"""What every registered policy must satisfy (DESIGN §1.2): exactness and the reference
(for policies that correct their attention output, the reference includes the correction:
see ``reference_logits``)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvevict
from tests.conftest import (
    assert_next_logits_match_reference,
    build_policy,
    greedy,
    greedy_batch,
    left_padded,
    padded_positions,
    prompt,
    resident_storages,
    tiny_model,
)

POLICIES = [
    *kvevict.list_policies(),
    "moment-nc+snapkv",
    "moment-nc+adakv+snapkv",
    "global+knorm",
    "kvzip[plus=true]",
    "kvzip[per_layer=true]",
    "kvzip[precision=bf16]",
    "kvzip[repeat=shuffled]",
    "chunk+keydiff",
    "chunk+snapkv[chunk.reuse=2]",
    "rerotate+streamingllm",
    "rerotate+adakv+snapkv",
    "think+adakv+snapkv",
]
EVICTING = [name for name in POLICIES if build_policy(name).method.evicts]  # (not full, nor ThinK over it)


def rewrites_keys(policy: str) -> bool:
    """Whether ``policy`` changes the keys it keeps on purpose (rerotate, ThinK: their own tests say how)."""
    return any(stage.rewrites_keys for stage in build_policy(policy).stages)


PROMPT = 96
BUDGET = 40


@pytest.mark.parametrize(
    "policy", [name for name in POLICIES if not name.startswith("think")]
)  # (channels: test_think)
def test_budget_at_least_length_is_identical_to_no_eviction(policy: str, attn: str) -> None:
    model = tiny_model(attn=attn)
    ids = prompt(PROMPT)
    expected, expected_logits = greedy(model, ids, DynamicCache())
    budget = None if policy == "full" else PROMPT + 16
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=budget)
    sequences, logits = greedy(model, ids, cache, new_tokens=8)
    assert torch.equal(sequences, expected)
    assert torch.equal(logits, expected_logits)
    assert cache.layer_lengths() == [PROMPT + 7] * 2  # nothing was evicted


@pytest.mark.parametrize("interval", [1, 3])
@pytest.mark.parametrize("policy", EVICTING)
def test_eviction_matches_attention_over_the_retained_entries(policy: str, attn: str, interval: int) -> None:
    model = tiny_model(attn=attn)
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=BUDGET, interval=interval)
    sequences, _ = greedy(model, prompt(PROMPT), cache, new_tokens=7)
    held = sum(int(layer.head_lengths().sum()) for layer in cache.eviction_layers)
    # evicted for real: layers × KV heads × (budget + new tokens), + 1 per head for HeadKV's rounding;
    # DuoAttention's retrieval heads (one per layer for the tiny models) keep everything
    bound = 2 * (BUDGET + 6 + 1) + 2 * (PROMPT + 6) if policy == "duoattention" else 2 * 2 * (BUDGET + 6 + 1)
    assert held <= bound
    token = sequences[:, -1:]
    assert_next_logits_match_reference(model, cache, token)


@pytest.mark.parametrize(  # the second, no padding at all: the rows are in lockstep from the prompt on, so a
    "lengths",  # batched policy's stages (and a deferred prefill eviction, global+'s pool) see every row at once
    [(BUDGET + 8, BUDGET + 24, BUDGET + 15), (BUDGET + 20,) * 3],
    ids=["padded", "no-padding"],
)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_left_padded_batch_gives_each_row_what_it_gets_alone(
    policy: str, attn: str, lengths: tuple[int, ...]
) -> None:
    model = tiny_model(attn=attn)
    prompts = [prompt(length, seed=seed) for seed, length in enumerate(lengths)]
    ids, mask = left_padded(prompts)
    budget = None if policy == "full" else BUDGET
    batch_cache = kvevict.EvictionCache(model, build_policy(policy), budget=budget)
    batch_tokens, batch_logits = greedy_batch(model, ids, mask, batch_cache, 7)
    for row, ids_alone in enumerate(prompts):
        alone = kvevict.EvictionCache(model, build_policy(policy), budget=budget)
        tokens, logits = greedy(model, ids_alone, alone, new_tokens=7)
        assert torch.equal(batch_tokens[row], tokens[0, ids_alone.shape[1] :])
        torch.testing.assert_close(batch_logits[row], logits[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("policy", POLICIES)
def test_questions_padded_after_compressed_contexts_give_each_row_what_it_gets_alone(policy: str) -> None:
    """Padding in a later pass: contexts of different lengths compressed as one left-padded
    batch, then questions of different lengths (left-padded after them) and greedy answers."""
    model = tiny_model()
    contexts = [prompt(length, seed=seed) for seed, length in enumerate((BUDGET + 8, BUDGET + 24, BUDGET + 15))]
    questions = [prompt(length, seed=10 + seed) for seed, length in enumerate((9, 3, 14))]
    budget = None if policy == "full" else BUDGET

    def run(rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        cache = kvevict.EvictionCache(model, build_policy(policy), budget=budget)
        context_ids, context_mask = left_padded([contexts[row] for row in rows])
        with torch.no_grad():
            model(
                context_ids,
                attention_mask=context_mask,
                position_ids=padded_positions(context_mask),
                past_key_values=cache,
            )
        cache.end_prompt()  # the questions are decoded, not compressed with the contexts
        question_ids, question_mask = left_padded([questions[row] for row in rows])
        ids, mask = torch.cat([context_ids, question_ids], -1), torch.cat([context_mask, question_mask], -1)
        return greedy_batch(model, ids, mask, cache, 5)

    if kvevict.EvictionCache(model, build_policy(policy), budget=budget).hidden is not None:
        with pytest.raises(ValueError, match="reads hidden states by column"):
            run([0, 1, 2])
        return
    tokens, logits = run([0, 1, 2])
    for row in range(3):
        expected, expected_logits = run([row])
        assert torch.equal(tokens[row], expected[0])
        torch.testing.assert_close(logits[row], expected_logits[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("policy", EVICTING)
def test_absolute_positions_survive_eviction(policy: str) -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=BUDGET)
    sequences, _ = greedy(model, prompt(PROMPT), cache, new_tokens=6)
    full = DynamicCache()
    with torch.no_grad():
        model(input_ids=sequences[:, :-1], past_key_values=full)
    for idx, (layer, reference) in enumerate(zip(cache.layers, full.layers)):
        assert layer.get_seq_length() == sequences.shape[1] - 1
        positions = layer.positions
        valid = layer.valid if layer.valid is not None else torch.ones_like(positions, dtype=torch.bool)
        for head, held in zip(positions[0], valid[0]):  # unique per head (padding aside), not sorted
            assert len(set(head[held].tolist())) == int(held.sum())
        # Layer 0 keys depend only on token and position; deeper keys of decode tokens also
        # depend on earlier evictions, so only the prompt entries (prefilled in full) compare.
        comparable = valid & (positions < PROMPT) if idx else valid  # free slots of ragged heads are no entries
        sides = [(layer.keys, reference.keys), (layer.values, reference.values)]
        if rewrites_keys(policy):  # moves or prunes the kept keys on purpose: test_rerotate.py, test_think.py
            sides = sides[1:]
        for mine, full_states in sides:
            index = positions.clamp(min=0)[..., None].expand(-1, -1, -1, full_states.shape[-1])
            expected = full_states.gather(2, index)
            torch.testing.assert_close(mine[comparable], expected[comparable], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("policy", EVICTING)
def test_half_precision_generation_stays_finite(policy: str, dtype: torch.dtype) -> None:
    model = tiny_model(dtype=dtype)
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=BUDGET)
    _, logits = greedy(model, prompt(PROMPT), cache, new_tokens=6)
    assert torch.isfinite(logits).all()
    assert all(
        value.dtype in (torch.float32, torch.int32, torch.int64)
        for layer in cache.layers
        for value in layer.state.values()
    )


def _decode(model, cache, first: torch.Tensor, steps: int, mode) -> torch.Tensor:
    """``steps`` greedy decode steps after the prefill logits ``first``, each under ``mode()``."""
    logits = [first]
    for _ in range(steps):
        with mode():
            token = logits[-1].argmax(-1, keepdim=True)
            logits.append(model(input_ids=token, past_key_values=cache).logits[:, -1].clone())
    return torch.stack(logits)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_cache_filled_in_one_grad_mode_goes_on_in_the_other(policy: str) -> None:
    """Tensors a cache (or its policy) made under ``inference_mode`` are written under
    ``no_grad`` later, and the reverse: no error, and the logits of a cache that stayed in one
    (``kvevict.generation.prefill`` fills under ``inference_mode``, and a user decodes on)."""
    model = tiny_model()
    ids = prompt(PROMPT)
    budget = None if policy == "full" else BUDGET
    results = []
    modes = [
        (torch.no_grad, torch.no_grad),
        (torch.inference_mode, torch.no_grad),
        (torch.no_grad, torch.inference_mode),
    ]
    for fill, go_on in modes:
        cache = kvevict.EvictionCache(model, build_policy(policy), budget=budget)
        with fill():
            first = model(input_ids=ids, past_key_values=cache).logits[:, -1].clone()
        results.append(_decode(model, cache, first, 6, go_on))
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=0, atol=0)


def held_entry_bytes(cache: kvevict.EvictionCache) -> tuple[int, int]:
    """(bytes of every per-entry tensor for the real entries, the same for one entry of each
    row and KV head of every layer): what resident bytes must follow."""
    real = slot = 0
    for layer in cache.eviction_layers:
        storage = layer.storage
        tensors = [*(storage.packed.entries.values() if storage.packed else storage.entries().values())]
        per_entry = sum(x[(0,) * (1 if storage.packed else 3)].numel() * x.element_size() for x in tensors)
        real += int(layer.head_lengths().sum()) * per_entry
        slot += layer.head_lengths().numel() * per_entry
    return real, slot


@pytest.mark.parametrize("policy", EVICTING)
@pytest.mark.parametrize("batch", [1, 3])
def test_resident_bytes_follow_the_retained_entries(policy: str, batch: int) -> None:
    """What is evicted is freed: walking every tensor storage reachable from the cache finds
    what ``kv_bytes()`` reports (give or take the policy's own small bookkeeping), and that is
    the retained entries plus bounded room: ≤ 1.25 × theirs + one interval and a partial block
    of 16 entries per row and KV head, after the prefill and after decode steps; rows of a
    left-padded batch keeping different numbers pay for their own entries only."""
    model = tiny_model()
    prompts = [prompt(length, seed=seed) for seed, length in enumerate((PROMPT, PROMPT - 30, PROMPT - 11)[:batch])]
    ids, mask = left_padded(prompts)
    interval = 3
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=BUDGET, interval=interval)
    forward = {"input_ids": ids, "attention_mask": mask, "position_ids": padded_positions(mask)}
    with torch.no_grad():
        logits = model(**forward, past_key_values=cache)
        cache.end_prompt()
        checks = []
        for step in range(7):
            checks.append((resident_storages(cache), cache.kv_bytes(), held_entry_bytes(cache)))
            mask = torch.cat([mask, mask[:, -1:]], dim=1)
            token = logits.logits[:, -1].argmax(-1, keepdim=True)
            logits = model(
                input_ids=token, attention_mask=mask, position_ids=cache.next_positions(), past_key_values=cache
            )
    weights = [x for gate in getattr(cache.hooks, "gates", ()) for x in gate.values()]  # Fast KVzip's gates
    weight_bytes = sum(x.untyped_storage().nbytes() for x in weights)  # are the model's, like its weights
    for walked, reported, (real, slot) in checks:
        bookkeeping = sum(walked.values()) - reported - weight_bytes
        assert 0 <= bookkeeping <= max(4096, reported // 4), (policy, bookkeeping, reported)
        assert reported <= 1.25 * real + (interval + 16) * slot + 1024, (policy, reported, real, slot)


@pytest.mark.parametrize("policy", ["kvzip", "adakv+snapkv", "headkv", "global+snapkv", "critical+adakv+snapkv"])
def test_heads_of_different_lengths_pay_for_their_own_entries(policy: str) -> None:
    """Head-wise budgets: between passes each head holds its own entries only, not its
    layer's longest (resident within 1.10 × the real entries' bytes); rows of a batch under
    ``keep=`` (each its own budget) likewise pay for their own entries."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, build_policy(policy), keep=0.5)
    prompts = [prompt(length, seed=seed) for seed, length in enumerate((2 * PROMPT, PROMPT + 20))]
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=padded_positions(mask), past_key_values=cache)
    lengths = torch.stack([layer.head_lengths() for layer in cache.eviction_layers])
    assert lengths.unique().numel() > 2  # heads and rows keep different numbers
    real, _ = held_entry_bytes(cache)
    assert cache.kv_bytes() <= 1.10 * real
    assert sum(resident_storages(cache).values()) <= 1.10 * real + 4096  # and that is what a walk finds
