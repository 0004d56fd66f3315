"""Continuous batching: a sequence compressed alone is spliced into a running batch (and
finished rows removed); every row goes on exactly as it would alone."""

from __future__ import annotations

import pytest
import torch

import kvevict
from kvevict.generation import prefill
from tests.conftest import left_padded, prompt, tiny_model

BUDGET = 40
STEPS = 4


def alone(
    model, ids: torch.Tensor, policy: str, steps: int, budget: int = BUDGET, chunk: int | None = 16
) -> tuple[kvevict.EvictionCache, list[torch.Tensor]]:
    """A batch-1 cache holding ``ids`` (compressed in chunks of ``chunk``, None: in one pass) and
    the logits of ``steps`` greedy steps after it."""
    cache = kvevict.EvictionCache(model, policy, budget=budget)
    logits = [prefill(model, ids, cache, chunk=chunk)]
    with torch.no_grad():
        for _ in range(steps):
            token = logits[-1].argmax(-1, keepdim=True)
            logits.append(model(input_ids=token, past_key_values=cache).logits[:, -1])
    return cache, logits


def batch_step(model, cache: kvevict.EvictionCache, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, position_ids=cache.next_positions(), past_key_values=cache).logits[:, -1]


@pytest.mark.parametrize(
    "policy",
    ["snapkv", "h2o", "tova", "adakv+snapkv", "lazyeviction", "streamingllm", "think+snapkv"]
    + ["epikv", "band-adaptive", "hs-variance", "attn-x-hs", "segment-hs"],  # hidden-state statistics per row
)
def test_spliced_rows_go_on_exactly_as_alone(policy: str) -> None:
    model = tiny_model()
    prompts = [prompt(n, seed=seed) for seed, n in enumerate((90, 75, 101))]
    references = [alone(model, ids, policy, 2 * STEPS)[1] for ids in prompts]
    batch, logits = alone(model, prompts[0], policy, STEPS)  # row 0 decoded STEPS tokens on its own
    rows = {0: (0, STEPS)}  # batch row -> (prompt, logits produced so far)
    newcomer = kvevict.EvictionCache(model, policy, budget=BUDGET)
    first = prefill(model, prompts[1], newcomer, chunk=16)
    batch.splice(1, newcomer)  # appended as a new row
    last = torch.cat([logits[-1], first])
    rows[1] = (1, 0)
    for _ in range(STEPS):
        last = batch_step(model, batch, last.argmax(-1, keepdim=True))
        for row, (index, done) in rows.items():
            torch.testing.assert_close(last[row], references[index][done + 1][0], rtol=0, atol=1e-5)
            rows[row] = (index, done + 1)
    replacement = kvevict.EvictionCache(model, policy, budget=BUDGET)
    first = prefill(model, prompts[2], replacement, chunk=16)
    batch.splice(0, replacement)  # row 0 finished: the newcomer takes its slot
    rows[0] = (2, 0)
    last = torch.cat([first, last[1:]])
    for step in range(STEPS):
        if step == 1:  # row 1 finished: dropped, row 0 goes on alone
            batch.remove_rows([1])
            last, rows = last[:1], {0: rows[0]}
        last = batch_step(model, batch, last.argmax(-1, keepdim=True))
        for row, (index, done) in rows.items():
            torch.testing.assert_close(last[row], references[index][done + 1][0], rtol=0, atol=1e-5)
            rows[row] = (index, done + 1)


@pytest.mark.parametrize("policy", ["snapkv", "adakv+snapkv", "h2o", "hs-variance"])
def test_rows_of_a_batch_are_spliced_one_by_one_each_as_alone(policy: str) -> None:
    """Rows prefilled together (a left-padded batch) join a running batch row by row, in any
    order; each goes on exactly as alone, and the batch they came from keeps what it holds."""
    model = tiny_model()
    prompts = [prompt(n, seed=seed) for seed, n in enumerate((90, 75, 101))]
    references = [alone(model, ids, policy, STEPS, chunk=None)[1] for ids in prompts]  # (padding moves chunks)
    batch, logits = alone(model, prompts[0], policy, 0, chunk=None)
    started = kvevict.EvictionCache(model, policy, budget=BUDGET)
    ids, mask = left_padded(prompts[1:])
    first = prefill(model, ids, started, mask)
    batch.splice(1, started, 1)  # the second prompt of the batch first
    batch.splice(2, started, 0)
    last, rows = torch.cat([logits[0], first[1:], first[:1]]), (0, 2, 1)
    theirs = first
    for done in range(STEPS):
        last = batch_step(model, batch, last.argmax(-1, keepdim=True))
        theirs = batch_step(model, started, theirs.argmax(-1, keepdim=True))
        for row, index in enumerate(rows):
            torch.testing.assert_close(last[row], references[index][done + 1][0], rtol=0, atol=1e-5)
        for row, index in enumerate((1, 2)):
            torch.testing.assert_close(theirs[row], references[index][done + 1][0], rtol=0, atol=1e-5)


def test_splice_refuses_what_cannot_join_the_batch() -> None:
    model = tiny_model()
    batch, _ = alone(model, prompt(40), "snapkv", 1)
    other, _ = alone(model, prompt(40, seed=1), "h2o", 1)
    with pytest.raises(ValueError, match="rows of a batch share the policy and the budget"):
        batch.splice(1, other)
    same, _ = alone(model, prompt(40, seed=1), "snapkv", 1)
    with pytest.raises(ValueError, match="out of range"):
        batch.splice(3, same)
    with pytest.raises(ValueError, match="leaving at least one"):
        batch.remove_rows([0])
    with pytest.raises(ValueError, match="source row 1 is out of range: the source cache has rows 0 .. 0"):
        batch.splice(1, same, 1)
    with pytest.raises(ValueError, match="needs both caches to hold a prefilled sequence"):
        batch.splice(1, kvevict.EvictionCache(model, "snapkv", budget=BUDGET))


@pytest.mark.parametrize("policy", ["epikv", "band-adaptive", "hs-variance", "attn-x-hs", "segment-hs"])
def test_rows_scored_by_hidden_states_join_and_leave_with_their_statistics(policy: str) -> None:
    """Short prompts and a small budget, so that decode tokens are evicted by their hidden-state
    scores (beyond the recent window): a row spliced into a batch decoding at another position,
    and the batch after a row left, go on exactly as alone."""
    model, budget, steps = tiny_model(), 24, 12
    prompts = [prompt(n, seed=seed) for seed, n in enumerate((8, 6, 10))]
    references = [alone(model, ids, policy, 3 * steps, budget)[1] for ids in prompts]
    batch, logits = alone(model, prompts[0], policy, steps, budget)
    newcomer = kvevict.EvictionCache(model, policy, budget=budget)
    first = prefill(model, prompts[1], newcomer, chunk=16)
    batch.splice(1, newcomer)
    last, done = torch.cat([logits[-1], first]), [steps, 0]
    for _ in range(steps):
        last = batch_step(model, batch, last.argmax(-1, keepdim=True))
        done = [d + 1 for d in done]
        for row, index in enumerate((0, 1)):
            torch.testing.assert_close(last[row], references[index][done[row]][0], rtol=0, atol=1e-5)
    assert min(batch.layer_lengths()) == budget  # decode tokens were evicted by their scores
    batch.remove_rows([0])
    last = last[1:]
    for _ in range(steps):
        last = batch_step(model, batch, last.argmax(-1, keepdim=True))
        done[1] += 1
        torch.testing.assert_close(last[0], references[1][done[1]][0], rtol=0, atol=1e-5)
