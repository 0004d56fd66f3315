"""The policy driver (kvevict.driver): a selection carried out on storage. A decode step that drops
one entry per head (by its minimum, or read off a keep mask) lays storage out exactly as the
general keep path, which refills each head's dropped slots from the end of it."""

from __future__ import annotations

import pytest
import torch

import kvevict
from kvevict.driver import refill_sources
from tests.conftest import assert_same_storage, prompt, tiny_model


def test_dropped_slots_are_refilled_in_order_by_the_kept_entries_beyond_the_count() -> None:
    """Head (0, 0) keeps slots 0, 2, 4 and 5 of 6: slots 0 and 2 stay, 4 and 5 (beyond its count,
    4) fill its holes 1 and 3 in order; head (0, 1) keeps slots 1 and 2: slot 2 fills hole 0.
    Slots from the count on keep their own column (unused once the storage is cut to the count)."""
    relative = torch.tensor([[[True, False, True, False, True, True], [False, True, True, False, False, False]]])
    counts = relative.sum(dim=-1)
    prefix = torch.arange(6) < counts[..., None]
    holes, movers = (prefix & ~relative).nonzero(), (~prefix & relative).nonzero()
    source = refill_sources(6, counts, holes, movers)
    assert source.tolist() == [[[0, 4, 2, 5, 4, 5], [2, 1, 2, 3, 4, 5]]]
    assert counts.tolist() == [[4, 2]]


def test_a_head_that_drops_nothing_keeps_every_slot() -> None:
    nothing = torch.zeros(0, 3, dtype=torch.long)
    assert refill_sources(4, torch.tensor([[4]]), nothing, nothing).tolist() == [[[0, 1, 2, 3]]]


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
