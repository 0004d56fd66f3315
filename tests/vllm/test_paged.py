"""The paged cache's side of the plug-in without vLLM: a block layout found by probing a layer's
cache update, and requests in lockstep evicted as one batch exactly as each alone (the same
kept entries and positions, the same state, the same bytes in their blocks)."""

from __future__ import annotations

import copy

import pytest
import torch

from kvevict.vllm.config import EvictionSettings
from kvevict.vllm.paged import BlockLayout, RequestEntries, RowPass, lockstep, observe_and_evict

HEADS, QUERY_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCKS = 2, 4, 8, 4, 40


def write_natural(key, value, cache, slots) -> None:
    """A cache update laying each block out ``[Hkv, block_size, 2·d]``, keys then values."""
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    cache[blocks, :, offsets, :HEAD_DIM] = key
    cache[blocks, :, offsets, HEAD_DIM:] = value


def write_transposed(key, value, cache, slots) -> None:
    """Keys stored ``[d, block_size]`` per head, as vLLM's CPU ``vec`` kernels store them."""
    view = cache.view(cache.shape[0], HEADS, -1)
    for token, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, BLOCK_SIZE)
        keys = view[block, :, : BLOCK_SIZE * HEAD_DIM].view(HEADS, HEAD_DIM, BLOCK_SIZE)
        keys[:, :, offset] = key[token]
        view[block, :, BLOCK_SIZE * HEAD_DIM :].view(HEADS, BLOCK_SIZE, HEAD_DIM)[:, offset] = value[token]


SCRAMBLED = torch.randperm(HEADS * BLOCK_SIZE * 2 * HEAD_DIM, generator=torch.Generator().manual_seed(0))


def write_scrambled(key, value, cache, slots) -> None:
    """A layout no strided view reads: a block's natural layout, its elements shuffled."""
    natural = torch.zeros(1, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    view = cache.view(cache.shape[0], -1)
    for token, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, BLOCK_SIZE)
        natural.copy_(view[block, SCRAMBLED.argsort()].view_as(natural))
        write_natural(key[token : token + 1], value[token : token + 1], natural, torch.tensor([offset]))
        view[block] = natural.view(-1)[SCRAMBLED]


def gather(layout: BlockLayout, cache: torch.Tensor, blocks: torch.Tensor, length: int):
    """Requests' first ``length`` keys and values, ``[B, Hkv, length, d]`` each, as the policy reads them."""
    raw = layout.blocks_of(cache, blocks, length)
    return layout.in_order(raw, "keys", length), layout.in_order(raw, "values", length)


def empty_cache() -> torch.Tensor:
    return torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)


@pytest.mark.parametrize("write", [write_natural, write_transposed, write_scrambled])
def test_the_probed_layout_gathers_and_moves_what_was_written(write) -> None:
    cache = empty_cache()
    layout = BlockLayout.probe(write, cache)
    strided = layout.strides["keys"] is not None and layout.strides["values"] is not None
    assert strided == (write is not write_scrambled)  # a strided view where one exists, else an index
    keys, values = torch.randn(10, HEADS, HEAD_DIM), torch.randn(10, HEADS, HEAD_DIM)
    blocks = torch.tensor([[7, 2, 30], [5, 9, 11]])
    for row in range(2):
        slots = blocks[row, torch.arange(10) // BLOCK_SIZE] * BLOCK_SIZE + torch.arange(10) % BLOCK_SIZE
        write(keys + row, values - row, cache, slots)
    got_keys, got_values = gather(layout, cache, blocks, 10)
    for row in range(2):
        assert torch.equal(got_keys[row], (keys + row).transpose(0, 1))
        assert torch.equal(got_values[row], (values - row).transpose(0, 1))
    # entry 9 of head 1 of request 1 over entry 0; entry 5 of head 0 of request 0 over entry 2
    layout.move(cache, blocks, torch.tensor([1, 0]), torch.tensor([1, 0]), torch.tensor([9, 5]), torch.tensor([0, 2]))
    moved_keys, moved_values = gather(layout, cache, blocks, 10)
    assert torch.equal(moved_keys[1, 1, 0], keys[9, 1] + 1) and torch.equal(moved_values[0, 0, 2], values[5, 0])
    assert torch.equal(moved_keys[1, 0], got_keys[1, 0]) and torch.equal(moved_keys[0, 1], got_keys[0, 1])


def requests(policy: str, prompts: list[int], budget: int, interval: int) -> list[RequestEntries]:
    settings = EvictionSettings.parse({"policy": policy, "budget": budget, "interval": interval})
    return [RequestEntries(settings.schedule(length), settings.make_policy(), 10_000) for length in prompts]


def run_pass(entries: list[RequestEntries], cache, layout, blocks, new: dict[int, int], batched: bool, seed: int):
    """One pass of ``new[row]`` tokens per request over two layers: write them, then observe
    and evict, the requests in lockstep together (``batched``) or one by one."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for row, request in enumerate(entries):
        done = request.tokens
        request.tokens, request.passes = done + new[row], request.passes + 1
        held = request.schedule.held(done)
        step = RowPass(
            request, row, 0, new[row], held, done + new[row], request.passes, request.schedule.held(done + new[row])
        )
        steps.append(step)
    groups = lockstep(steps, 0) if batched else [[step] for step in steps]
    for layer_idx, layer_cache in enumerate(cache):
        for step in steps:
            keys = torch.randn(step.num_new, HEADS, HEAD_DIM, generator=generator)
            slots = torch.arange(step.held, step.held + step.num_new)
            slots = blocks[step.row, slots // BLOCK_SIZE] * BLOCK_SIZE + slots % BLOCK_SIZE
            write_transposed(keys, keys.flip(-1), layer_cache, slots)
        queries = {step.row: torch.randn(1, QUERY_HEADS, step.num_new, HEAD_DIM, generator=generator) for step in steps}
        for group in groups:
            query = torch.cat([queries[step.row] for step in group])
            observe_and_evict(group, layer_idx, layer_cache, layout, blocks[[s.row for s in group]], query, 0.3)
    return groups


@pytest.mark.parametrize("policy", ["h2o", "tova", "streamingllm", "snapkv[window=4]"])
def test_requests_in_lockstep_evict_as_one_batch_exactly_as_each_alone(policy: str) -> None:
    """Three requests, prompts of 13, 17 and 9 tokens (different ``seen``): after the prompts
    (SnapKV and StreamingLLM evict two of them to the budget), 14 decode steps evict every 4."""
    prompts, budget, interval = [13, 17, 9], 10, 4
    blocks = torch.tensor([[3, 4, 5, 6, 7, 8], [12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25]])
    layout = BlockLayout.probe(write_transposed, empty_cache())
    hosts = {}
    for batched in (False, True):
        entries = requests(policy, prompts, budget, interval)
        cache = [empty_cache(), empty_cache()]
        sizes = [
            max(len(group) for group in run_pass(entries, cache, layout, blocks, dict(enumerate(prompts)), batched, 0))
        ]
        for step in range(14):
            groups = run_pass(entries, cache, layout, blocks, dict.fromkeys(range(3), 1), batched, step + 1)
            sizes.append(max(len(group) for group in groups))
        hosts[batched] = entries, cache, sizes
    (alone, alone_cache, _), (together, together_cache, sizes) = hosts[False], hosts[True]
    assert max(sizes) > 1, "no requests ran in lockstep"
    for one, other in zip(alone, together):
        assert one.kept_positions(2, HEADS) == other.kept_positions(2, HEADS)
        for layer in one.layers:
            assert one.layers[layer].state.keys() == other.layers[layer].state.keys()
            for name, value in one.layers[layer].state.items():
                assert torch.equal(value, other.layers[layer].state[name]), name
    for layer, layer_cache in enumerate(alone_cache):
        for row, request in enumerate(alone):
            held = request.schedule.held(request.tokens)
            assert torch.equal(
                *(gather(layout, c, blocks[row : row + 1], held)[0] for c in (layer_cache, together_cache[layer]))
            )


def test_requests_at_different_steps_or_under_a_policy_that_is_not_batched_run_alone() -> None:
    entries = requests("tova", [13, 13, 13], 10, 4)
    steps = [RowPass(request, row, 0, 1, 12, 14, 2, 12) for row, request in enumerate(entries)]
    assert [len(group) for group in lockstep(steps, 0)] == [3]
    late = copy.copy(steps[2].__dict__)
    late.update(held=11, tokens=13)
    assert sorted(len(group) for group in lockstep([*steps[:2], RowPass(**late)], 0)) == [1, 2]
    for request in entries:  # a policy whose stages do not all treat rows independently
        request.owner.policy.__dict__["batched"] = False
    assert [len(group) for group in lockstep(steps, 0)] == [1, 1, 1]
