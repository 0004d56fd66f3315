"""Batched eviction (issue 14): rows of a left-padded batch are evicted on their own."""

from __future__ import annotations

import pytest
import torch

import kvevict
from kvevict.attention import check_flash
from tests.conftest import build_policy, greedy, greedy_batch, left_padded, padded_positions, prompt, tiny_model

LENGTHS = (30, 50, 41)


def small(policy: str):
    """``policy`` with a recent window that fits the small budgets here (SnapKV's default is 32)."""
    return build_policy(policy, **({"window": 8} if "snapkv" in policy else {}))


def batch() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    prompts = [prompt(length, seed=seed) for seed, length in enumerate(LENGTHS)]
    return (prompts, *left_padded(prompts))


@pytest.mark.parametrize("policy", ["h2o", "tova", "adakv+snapkv"])
def test_keep_resolves_per_row(policy: str) -> None:
    model = tiny_model()
    prompts, ids, mask = batch()
    cache = kvevict.EvictionCache(model, small(policy), keep=0.5)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    for layer in cache.eviction_layers:
        assert layer.budget.flatten().tolist() == [15, 25, 21]  # ceil(0.5 × own prompt), padding excluded
        assert layer.prompt_length.flatten().tolist() == list(LENGTHS)
        held = layer.head_lengths()
        if policy == "adakv+snapkv":  # head-wise: each row's heads share the row's budget
            assert held.sum(dim=1).tolist() == [2 * 15, 2 * 25, 2 * 21]
        else:
            assert held.tolist() == [[15, 15], [25, 25], [21, 21]]
    tokens, _ = greedy_batch(model, ids, mask, kvevict.EvictionCache(model, small(policy), keep=0.5), 4)
    for row, alone in enumerate(prompts):
        single = kvevict.EvictionCache(model, small(policy), keep=0.5)
        expected, _ = greedy(model, alone, single, new_tokens=4)
        assert torch.equal(tokens[row], expected[0, alone.shape[1] :])


def test_padding_never_survives_the_first_eviction_and_positions_are_each_rows_own() -> None:
    model = tiny_model()
    _, ids, mask = batch()
    cache = kvevict.EvictionCache(model, "h2o", budget=20)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    for layer in cache.eviction_layers:
        assert layer.valid is None  # every row keeps 20 real entries: no padding, no mask
        assert bool((layer.positions >= 0).all())
        for row, length in enumerate(LENGTHS):
            assert int(layer.positions[row].max()) <= length - 1
            assert length - 1 in layer.positions[row, 0].tolist()  # the recent window is by position
        assert layer.seen.flatten().tolist() == list(LENGTHS)


@pytest.mark.parametrize(
    ("policy", "together"),
    [("h2o", True), ("epikv", True), ("rkv", True), ("moment-nc+h2o", True), ("raas", True), ("thinkv", True)]
    + [("segment-hs", True), ("attn-x-hs", True), ("expected-attention", False)],
)
def test_rows_in_lockstep_run_through_a_batched_policy_at_once(policy: str, together: bool) -> None:
    """Once every row holds the same storage columns under one budget, a batched policy's hooks
    see all rows at once (per-row prompt lengths as [B, 1, 1]); others still see one row at a time."""
    model = tiny_model()
    _, ids, mask = batch()
    cache = kvevict.EvictionCache(model, policy, budget=20, interval=1)
    with torch.no_grad():  # a prompt and a decode step: every row evicted to the budget (epikv evicts at decode)
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        model(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], dim=1), past_key_values=cache)
    views = cache.eviction_layers[0].views()
    assert [view.rows for view in views] == ([slice(0, 3)] if together else [slice(i, i + 1) for i in range(3)])
    if together:
        assert views[0].prompt_length.flatten().tolist() == list(LENGTHS)


def test_padding_is_masked_and_not_counted_before_any_eviction() -> None:
    model = tiny_model()
    _, ids, mask = batch()
    cache = kvevict.EvictionCache(model, "h2o", budget=64)  # above every prompt: nothing evicted
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    layer = cache.eviction_layers[0]
    assert layer.valid is not None and layer.valid.sum(dim=-1)[:, 0].tolist() == list(LENGTHS)
    kv = 2 * layer.keys.shape[-1] * layer.keys.element_size()  # per entry and KV head
    extra = 8 + 4  # its int64 position and H2O's fp32 accumulated attention
    layers, heads, width = len(cache.eviction_layers), 2, max(LENGTHS)
    # between passes a ragged layer holds its real entries only, and which padded slots they fill
    assert cache.row_bytes() == [
        (layers * heads * (n * (kv + extra) + width), layers * heads * n * kv) for n in LENGTHS
    ]
    assert cache.kv_bytes() == sum(resident for resident, _ in cache.row_bytes())
    assert cache.kv_bytes() < sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.eviction_layers)


def test_rows_keeping_different_numbers_share_padded_storage() -> None:
    model = tiny_model()
    _, ids, mask = batch()
    cache = kvevict.EvictionCache(model, "h2o", keep=0.5)
    greedy_batch(model, ids, mask, cache, 3)
    layer = cache.eviction_layers[0]
    assert layer.length == 25  # the longest row
    assert layer.head_lengths()[:, 0].tolist() == [15, 25, 21]
    assert layer.valid is not None and layer.valid.sum(dim=-1).tolist() == [[15, 15], [25, 25], [21, 21]]
    kv, extra = 2 * layer.keys.shape[-1] * layer.keys.element_size(), 8 + 4  # + position, H2O's state
    assert layer.row_bytes() == [(2 * (n * (kv + extra) + 25), 2 * n * kv) for n in (15, 25, 21)]


def test_right_padding_is_refused() -> None:
    model = tiny_model()
    ids, mask = left_padded([prompt(10), prompt(14)])
    ids, mask = ids.flip(-1), mask.flip(-1)
    cache = kvevict.EvictionCache(model, "h2o", budget=8)
    with pytest.raises(ValueError, match="right padding.*padding_side = 'left'"), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)


def test_beam_search_is_refused() -> None:
    model = tiny_model()
    ids = prompt(20)
    cache = kvevict.EvictionCache(model, "h2o", budget=8)
    with pytest.raises(ValueError, match="beam search.*num_beams=1"):
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, num_beams=2, max_new_tokens=3)


def test_flash_kernels_refuse_ragged_rows() -> None:
    with pytest.raises(ValueError, match="flash_attention_2 cannot mask.*'sdpa' or 'eager'"):
        check_flash("flash_attention_2", ragged=True)
    check_flash("flash_attention_2", ragged=False)  # uniform rows: nothing to mask
    check_flash("sdpa", ragged=True)


def test_rows_that_stop_early_do_not_disturb_the_others() -> None:
    model = tiny_model()
    prompts, ids, mask = batch()
    alone, _ = greedy(model, prompts[1], kvevict.EvictionCache(model, "tova", budget=20), new_tokens=6)
    stop = int(alone[0, prompts[1].shape[1]])  # row 1 ends at its first token; the others go on
    out = model.generate(
        ids,
        attention_mask=mask,
        past_key_values=kvevict.EvictionCache(model, "tova", budget=20),
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=stop,
        pad_token_id=0,
    )
    for row in (0, 2):
        single, _ = greedy(model, prompts[row], kvevict.EvictionCache(model, "tova", budget=20), new_tokens=6)
        expected = single[0, prompts[row].shape[1] :]
        got = out[row, ids.shape[1] :]
        cut = (expected == stop).nonzero()
        end = int(cut[0]) + 1 if len(cut) else len(expected)
        assert torch.equal(got[:end], expected[:end])


def contexts_then_questions(
    model, policy: str, contexts: list[torch.Tensor], questions: list[torch.Tensor], budget: int
) -> tuple[kvevict.EvictionCache, torch.Tensor, torch.Tensor]:
    """Contexts (left-padded) compressed in one pass, then questions (left-padded after them,
    padding in the middle of each row) fed in a second pass and answered greedily."""
    cache = kvevict.EvictionCache(model, small(policy), budget=budget)
    context_ids, context_mask = left_padded(contexts)
    with torch.no_grad():
        model(
            input_ids=context_ids,
            attention_mask=context_mask,
            position_ids=padded_positions(context_mask),
            past_key_values=cache,
        )
    question_ids, question_mask = left_padded(questions)
    ids, mask = torch.cat([context_ids, question_ids], dim=1), torch.cat([context_mask, question_mask], dim=1)
    return (cache, *greedy_batch(model, ids, mask, cache, 5))


@pytest.mark.parametrize(
    ("arch", "policy"),
    [
        ("llama", "snapkv"),
        ("llama", "h2o"),
        ("llama", "streamingllm"),
        ("llama", "tova"),
        ("llama", "adakv+snapkv"),
        ("llama", "moment-nc+snapkv"),
        ("qwen2_hybrid", "h2o"),
    ],
)
def test_padding_in_a_later_pass_gives_each_row_what_it_gets_alone(arch: str, policy: str, attn: str) -> None:
    model = tiny_model(arch, attn=attn)
    contexts = [prompt(length, seed=seed) for seed, length in enumerate(LENGTHS)]
    questions = [prompt(length, seed=10 + seed) for seed, length in enumerate((9, 4, 13))]
    cache, tokens, logits = contexts_then_questions(model, policy, contexts, questions, budget=20)
    for layer in cache.eviction_layers:  # each row's real tokens only, at consecutive positions
        assert layer.seen.flatten().tolist() == [c.shape[1] + q.shape[1] + 4 for c, q in zip(contexts, questions)]
        held = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
        assert bool((layer.positions[held] >= 0).all())
    for row, (context, question) in enumerate(zip(contexts, questions)):
        _, expected, expected_logits = contexts_then_questions(model, policy, [context], [question], budget=20)
        assert torch.equal(tokens[row], expected[0])
        torch.testing.assert_close(logits[row], expected_logits[0], rtol=0, atol=1e-4)


def test_a_chunk_that_is_all_padding_for_a_row_is_skipped_by_it() -> None:
    model = tiny_model()
    prompts = [prompt(12, seed=1), prompt(40, seed=2)]
    ids, mask = left_padded(prompts)
    cache = kvevict.EvictionCache(model, "h2o", budget=64)
    positions = padded_positions(mask)
    with torch.no_grad():
        for start in range(0, ids.shape[1] - 1, 16):  # the short row's first chunk is all padding
            chunk = slice(start, min(start + 16, ids.shape[1] - 1))
            model(
                input_ids=ids[:, chunk],
                attention_mask=mask[:, : chunk.stop],
                position_ids=positions[:, chunk],
                past_key_values=cache,
            )
    for layer in cache.eviction_layers:
        assert layer.seen.flatten().tolist() == [11, 39]
        assert layer.prompt_length.flatten().tolist() == [11, 39]  # passes of several tokens continue the prompt
        assert layer.head_lengths()[:, 0].tolist() == [11, 39]
    per_entry = 2 * layer.keys.shape[-1] * layer.keys.element_size()
    assert [real for _, real in cache.row_bytes()] == [2 * 2 * n * per_entry for n in (11, 39)]
    tokens, logits = greedy_batch(model, ids, mask, cache, 4)
    for row, alone in enumerate(prompts):
        expected, expected_logits = greedy(model, alone, kvevict.EvictionCache(model, "h2o", budget=64), new_tokens=4)
        assert torch.equal(tokens[row], expected[0, alone.shape[1] :])
        torch.testing.assert_close(logits[row], expected_logits[0], rtol=0, atol=1e-4)


def test_policies_reading_hidden_states_refuse_padding_after_the_first_pass() -> None:
    model = tiny_model()
    contexts = [prompt(length, seed=seed) for seed, length in enumerate(LENGTHS)]
    with pytest.raises(ValueError, match="reads hidden states by column.*left of the first pass"):
        contexts_then_questions(model, "epikv", contexts, [prompt(3), prompt(5), prompt(4)], budget=20)


@pytest.mark.parametrize("arch", ["llama", "qwen2_hybrid"])
@pytest.mark.parametrize("policy", ["kvzip[chunk=16]", "kvzip[chunk=16,plus=true]", "global+snapkv"])
def test_deferred_prefill_evicts_each_row_as_alone(arch: str, policy: str) -> None:
    """KVzip repeats each row's own prompt (in chunks: rows of different lengths have different
    numbers of them, a row without one is all padding) and the global budget is shared across
    the layers of each row on its own."""
    model = tiny_model(arch)
    prompts, ids, mask = batch()
    tokens, logits = greedy_batch(model, ids, mask, kvevict.EvictionCache(model, small(policy), budget=20), 5)
    for row, alone in enumerate(prompts):
        expected, expected_logits = greedy(model, alone, kvevict.EvictionCache(model, small(policy), budget=20), 5)
        assert torch.equal(tokens[row], expected[0, alone.shape[1] :])
        torch.testing.assert_close(logits[row], expected_logits[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("policy", ["full", "snapkv", "h2o"])
def test_a_pass_of_several_tokens_by_positions_alone_gives_each_row_what_it_gets_alone(policy: str) -> None:
    """After a left-padded prompt, a pass of several tokens per row given only their positions
    (no attention mask: continuous batching's way) does not let a row see its left padding."""
    model = tiny_model()
    prompts = [prompt(n, seed=seed) for seed, n in enumerate((70, 58))]
    ids, mask = left_padded(prompts)
    tokens = torch.randint(5, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    budget = None if policy == "full" else 48

    def cache() -> kvevict.EvictionCache:
        return kvevict.EvictionCache(model, build_policy(policy), budget=budget)

    with torch.no_grad():
        batch = cache()
        model(input_ids=ids, attention_mask=mask, position_ids=padded_positions(mask), past_key_values=batch)
        batch.end_prompt()
        positions = batch.next_positions() + torch.arange(6)
        logits = model(input_ids=tokens, position_ids=positions, past_key_values=batch).logits
        for row, alone_ids in enumerate(prompts):
            alone = cache()
            model(input_ids=alone_ids, past_key_values=alone)
            alone.end_prompt()
            expected = model(input_ids=tokens[row : row + 1], past_key_values=alone).logits
            torch.testing.assert_close(logits[row], expected[0], rtol=0, atol=1e-5)
