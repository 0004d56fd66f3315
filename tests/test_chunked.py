"""Chunked prefill (DESIGN §1.10): each chunk attends to the retained entries plus itself,
then the cache evicts back to its budget."""

from __future__ import annotations

import math

import pytest
import torch

import kvevict
from kvevict.generation import prefill
from tests.conftest import build_policy, greedy, greedy_batch, left_padded, prompt, tiny_model
from tests.policies.test_contract import POLICIES

PROMPT = 128
CHUNK = 16
BUDGET = 40
LENGTHS = (BUDGET + 30, BUDGET + 40, BUDGET + 33)  # left padding < CHUNK: every row has real tokens in chunk 1


def chunked_greedy(model, ids, cache, chunk: int, new_tokens: int = 8, mask=None):
    return greedy(model, ids, cache, new_tokens, mask, chunk)


def refuses_chunks(cache: kvevict.EvictionCache):
    """A policy that repeats the whole prompt under one pool across layers (KVzip's default) refuses a chunked
    prompt; a pool over scores each pass computes (``fastkvzip``, ``global+X``) is allocated chunk by chunk."""
    return pytest.raises(ValueError, match="cannot compress a prompt chunk by chunk")


UNCHANGED_AT_AMPLE_BUDGET = [name for name in POLICIES if not name.startswith("think")]
"""ThinK prunes key channels whatever the budget, at the end of every chunk it cannot tell from the prompt's last
(transformers' chunks do not say the prompt's length): test_think checks chunks whose length the cache is told."""


@pytest.mark.parametrize("policy", UNCHANGED_AT_AMPLE_BUDGET)
def test_chunked_prefill_at_ample_budget_is_unchunked_prefill(policy: str) -> None:
    model = tiny_model()
    ids = prompt(PROMPT)
    budget = None if policy == "full" else PROMPT + 16
    expected, expected_logits = greedy(model, ids, kvevict.EvictionCache(model, build_policy(policy), budget=budget))
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=budget)
    if cache.policy.deferred_prefill and not cache.policy.rescores_chunks:
        with refuses_chunks(cache):
            chunked_greedy(model, ids, cache, CHUNK)
        return
    sequences, logits = chunked_greedy(model, ids, cache, CHUNK)
    assert torch.equal(sequences, expected)
    assert torch.equal(logits, expected_logits)
    assert cache.peak_entries() == PROMPT + 7


@pytest.mark.parametrize("policy", UNCHANGED_AT_AMPLE_BUDGET)
def test_chunked_prefill_of_a_left_padded_batch_at_ample_budget_is_unchunked(policy: str) -> None:
    model = tiny_model()
    ids, mask = left_padded([prompt(length, seed=seed) for seed, length in enumerate(LENGTHS)])
    budget = None if policy == "full" else max(LENGTHS) + 16
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=budget)
    if cache.policy.method.deferred_prefill:  # KVzip's repeat: refused batched in any case
        return
    expected = greedy_batch(model, ids, mask, kvevict.EvictionCache(model, build_policy(policy), budget=budget), 6)
    sequences, logits = chunked_greedy(model, ids, cache, CHUNK, new_tokens=6, mask=mask)
    assert torch.equal(sequences[:, ids.shape[1] :], expected[0])
    assert torch.equal(logits, expected[1])


PREFILL_EVICTING = [  # chunk by chunk: prefill-time policies, and decode-time ones that evict later chunks
    name for name in POLICIES if name != "full" and kvevict.make_policy(name).evicts_in("prefill", later_chunk=True)
]


@pytest.mark.parametrize("policy", PREFILL_EVICTING)
def test_chunked_prefill_holds_at_most_budget_plus_chunk(policy: str) -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=BUDGET)
    if cache.policy.deferred_prefill and not cache.policy.rescores_chunks:
        with refuses_chunks(cache):
            chunked_greedy(model, prompt(PROMPT), cache, CHUNK, new_tokens=2)
        return
    chunked_greedy(model, prompt(PROMPT), cache, CHUNK, new_tokens=1)
    if cache.policy.allocator.name == "uniform":  # chunked KVzip: its repeat of the chunk too, while it runs
        assert cache.peak_entries() <= BUDGET + CHUNK + (CHUNK if cache.policy.method.deferred_prefill else 0)
    elif cache.policy.method.name == "duoattention":  # streaming heads hold BUDGET, retrieval heads everything
        held = [layer.head_lengths()[0] for layer in cache.eviction_layers]
        assert [heads.tolist() for heads in held] == [[PROMPT, BUDGET], [BUDGET, PROMPT]]
    else:  # head- or layer-wise budgets: BUDGET per head on average (HeadKV rounds up to one more), a chunk on top
        held = [layer.head_lengths() for layer in cache.eviction_layers]
        assert sum(int(heads.sum()) for heads in held) <= sum(heads.numel() for heads in held) * (BUDGET + 1)
        if cache.policy.allocator.across_layers:  # one pool, chunk by chunk: a head holds at most cap·B between passes
            cap = (
                cache.policy.allocator.head_cap(cache.policy, model.device, chunked=True) or PROMPT / BUDGET
            )  # 0: none
            assert cache.peak_entries() <= math.ceil(cap * BUDGET) + CHUNK
        else:
            assert cache.peak_entries() <= max(int(heads.max()) for heads in held) + CHUNK
    whole = kvevict.EvictionCache(model, build_policy(policy), budget=BUDGET)
    greedy(model, prompt(PROMPT), whole, new_tokens=2)
    # one pass: the whole prompt exists before the first eviction (a decode-time one: with the first new token)
    repeat = PROMPT if whole.policy.method.deferred_prefill else 0  # KVzip's repeat of the prompt, while it runs
    keeps_all = any(whole.policy.allocator.keeps_all(layer.layer_idx) for layer in whole.eviction_layers)
    grows = not whole.policy.evicts_in("prefill") or keeps_all  # to the first new token: a retrieval head keeps it
    assert whole.peak_entries() == PROMPT + grows + repeat


@pytest.mark.parametrize(
    "lengths",
    # the second: a short row's first chunks are only padding; the third: none, the rows in lockstep throughout
    [LENGTHS, (BUDGET + 10, PROMPT, BUDGET + 30), (BUDGET + 30,) * 3],
    ids=["padding-in-the-first-chunk", "chunks-of-padding-only", "no-padding"],
)
@pytest.mark.parametrize(  # fastkvzip's prompt window (512) outlasts these prompts: a narrower one evicts chunks
    "policy",
    [name for name in PREFILL_EVICTING if not kvevict.make_policy(name).method.deferred_prefill]
    + ["fastkvzip[window=8,prompt_window=16]"],
)
def test_chunked_prefill_of_a_left_padded_batch_gives_each_row_what_it_gets_alone(
    policy: str, lengths: tuple[int, ...]
) -> None:
    model = tiny_model()
    prompts = [prompt(length, seed=seed) for seed, length in enumerate(lengths)]
    ids, mask = left_padded(prompts)
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=BUDGET, prompt_length=ids.shape[1])
    if cache.hidden is not None and max(lengths) - min(lengths) >= CHUNK:  # EpiKV's family reads hidden states
        with pytest.raises(ValueError, match="padding only on the left of the first pass"):  # by column
            chunked_greedy(model, ids, cache, CHUNK, new_tokens=1, mask=mask)
        return
    batch_tokens, batch_logits = chunked_greedy(model, ids, cache, CHUNK, new_tokens=6, mask=mask)
    for row, alone_ids in enumerate(prompts):
        pad = (ids.shape[1] - alone_ids.shape[1]) % CHUNK  # chunks of padding only: the row has not started
        alone = kvevict.EvictionCache(model, build_policy(policy), budget=BUDGET, prompt_length=alone_ids.shape[1])
        with torch.no_grad():  # the row's first chunk lost its padding columns: the same chunk boundaries
            model(input_ids=alone_ids[:, : CHUNK - pad], past_key_values=alone)
        tokens, logits = chunked_greedy(model, alone_ids, alone, CHUNK, new_tokens=6)
        assert torch.equal(batch_tokens[row, ids.shape[1] :], tokens[0, alone_ids.shape[1] :])
        torch.testing.assert_close(batch_logits[row], logits[0], rtol=0, atol=1e-4)


def test_keep_with_chunks_needs_the_whole_prompt_length() -> None:
    model = tiny_model()
    ids = prompt(PROMPT)
    with pytest.raises(ValueError, match="keep= is a fraction of the whole prompt"):  # refused at the second chunk
        chunked_greedy(model, ids, kvevict.EvictionCache(model, "snapkv", keep=0.5), PROMPT // 2, new_tokens=1)
    cache = kvevict.EvictionCache(model, "snapkv", keep=0.5, prompt_length=PROMPT)
    chunked_greedy(model, ids, cache, CHUNK, new_tokens=1)
    assert cache.layer_lengths() == [PROMPT // 2] * 2
    assert cache.peak_entries() <= PROMPT // 2 + CHUNK


def test_prefill_helper_chunks_and_ends_the_prompt() -> None:
    model = tiny_model()
    ids = prompt(PROMPT)
    cache = kvevict.EvictionCache(model, "snapkv", keep=0.5)
    prefill(model, ids[:, :112], cache, chunk=CHUNK)  # keep= resolves against the prompt given to prefill
    assert cache.layer_lengths() == [56] * 2
    assert cache.peak_entries() <= 56 + CHUNK
    with torch.no_grad():  # after the prompt: a question of several tokens is decoded, not compressed
        model(input_ids=ids[:, 112:], past_key_values=cache)
    assert cache.layer_lengths() == [56 + 16] * 2
    with pytest.raises(ValueError, match="prefill chunk must be a positive number"):
        prefill(model, ids, kvevict.EvictionCache(model, "snapkv", budget=40), chunk=0)


def test_prompt_length_is_checked() -> None:
    with pytest.raises(ValueError, match="prompt_length must be a positive number"):
        kvevict.EvictionCache(tiny_model(), "snapkv", budget=40, prompt_length=0)
