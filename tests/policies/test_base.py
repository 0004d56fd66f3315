"""The stages a policy is assembled from (kvevict.policies.base): parameters checked when a
stage is built, namespaced storage, the default protector, allocator and selector, a
method's regimes, and the hooks' defaults."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

import kvevict
from kvevict.budgets import descending_ranks
from kvevict.policies.base import (
    Method,
    Namespaced,
    Scorer,
    SinksAndWindow,
    Uniform,
    keep_top,
    lowest_slots,
    window_size,
)
from kvevict.policies.h2o import H2O
from kvevict.policies.params import choice, declare, integer
from tests.conftest import greedy, kept_indices, prompt, tiny_model


class Windowed(Scorer):
    """A scorer with two parameters, one of which the model sets when the user leaves it unset."""

    name = "windowed"
    PARAMS = declare(window=integer(8, low=1), mode=choice("a", "a", "b"))

    def model_defaults(self, config) -> dict[str, object]:
        return {"window": config.num_hidden_layers}


def test_a_stage_takes_its_defaults_and_remembers_what_the_user_gave() -> None:
    stage = Windowed()
    assert stage.params() == {"window": 8, "mode": "a"} and repr(stage) == "Windowed(window=8, mode='a')"
    assert not stage.given("window")
    assert Windowed(window=None).params() == stage.params() and not Windowed(window=None).given("window")
    given = Windowed(window=4, mode="b")
    assert given.params() == {"window": 4, "mode": "b"} and given.given("window") and given.given("mode")


def test_a_stage_refuses_unknown_and_bad_parameters_naming_itself() -> None:
    with pytest.raises(ValueError, match=r"^windowed: unknown parameter 'windw'; its parameters: window, mode$"):
        Windowed(windw=4)
    with pytest.raises(ValueError, match=r"^top-k: unknown parameter 'k'; its parameters: none$"):
        kvevict.policies.base.TopK(k=3)
    with pytest.raises(ValueError, match=r"^windowed: parameter 'mode' expects one of 'a', 'b', got 'c'$"):
        Windowed(mode="c")


def test_bind_fills_only_what_the_user_left_unset() -> None:
    unset, given = Windowed(), Windowed(window=4)
    for stage in (unset, given):
        stage.bind(LlamaConfig(num_hidden_layers=3))
    assert unset.window == 3 and given.window == 4
    unset.bind(LlamaConfig(num_hidden_layers=5))
    assert unset.window == 5


def test_a_stage_reads_and_writes_only_its_own_namespace_of_a_store() -> None:
    holder = SimpleNamespace(state={"other/x": 1})
    mine = Namespaced(holder, "state", "windowed")
    mine["a"] = 2
    assert holder.state == {"other/x": 1, "windowed/a": 2}
    assert list(mine) == ["a"] and len(mine) == 1 and mine["a"] == 2 and "x" not in mine
    holder.state = {"windowed/b": 3, "windowed#2/b": 4}  # the layer replaced its state (an eviction)
    assert dict(mine) == {"b": 3}
    del mine["b"]
    assert holder.state == {"windowed#2/b": 4}
    with pytest.raises(KeyError):
        mine["b"]


def test_the_recent_window_is_given_or_a_capped_quarter_of_the_budget() -> None:
    assert window_size(None, 40) == 10 and window_size(None, 1000) == 128 and window_size(None, 1000, cap=32) == 32
    assert window_size(0, 40) == 0 and window_size(7, 40) == 7


@pytest.mark.parametrize(
    ("sinks", "window", "protected"),
    [(2, 3, [0, 1, 7, 8, 9]), (2, 0, [0, 1]), (0, 3, [7, 8, 9]), (2, None, [0, 1, 8, 9])],
)
def test_sinks_and_the_recent_window_are_protected(sinks: int, window: int | None, protected: list[int]) -> None:
    layer = SimpleNamespace(positions=torch.arange(10)[None, None], seen=10, prompt_continues=False)
    protector = SinksAndWindow(sinks, window)
    assert kept_indices(protector.protected(layer, 8)) == [[protected]]  # None: min(128, 8 // 4) = 2
    assert protector.min_budget(8) == len(protected)
    assert protector.prompt_slack(8) == 0


def test_while_more_of_a_chunked_prompt_comes_the_prompt_window_is_held_on_top_of_the_selection() -> None:
    protector = SinksAndWindow(2, 3, prompt_window=6)
    positions = torch.tensor([[[-2, -1, 0, 1, 4, 5, 6, 7, 8, 9]]])  # two padding slots (negative positions)
    valid = positions >= 0
    later_chunk = SimpleNamespace(positions=positions, valid=valid, seen=10, prompt_continues=True)
    last_chunk = SimpleNamespace(positions=positions, valid=valid, seen=10, prompt_continues=False)
    assert kept_indices(protector.held_for_prompt(later_chunk)) == [[[4, 5, 6, 7, 8, 9]]]
    assert protector.held_for_prompt(last_chunk) is None
    assert kept_indices(protector.protected(later_chunk, 8)) == kept_indices(protector.protected(last_chunk, 8))
    assert protector.prompt_slack(8) == 6 - 3 and protector.min_budget(8) == 2 + 3  # the budget holds sinks + window
    assert SinksAndWindow(2, 8, prompt_window=6).prompt_slack(8) == 0  # no wider than the window: nothing on top


def test_uniform_counts_are_the_budget_or_what_a_head_holds() -> None:
    layer = SimpleNamespace(head_lengths=lambda: torch.tensor([[3, 12], [8, 9]]))
    assert Uniform().counts(layer, None, torch.zeros(1), 8).tolist() == [[3, 8], [8, 8]]


class DecodeFirst(Method):
    name = "decode-first"
    regimes = ("decode", "both")


class LaterChunks(DecodeFirst):
    name = "later-chunks"
    evicts_later_chunks = True


def test_a_method_evicts_in_its_regime_the_first_by_default() -> None:
    assert DecodeFirst().regime == "decode" and list(DecodeFirst.PARAMS) == ["regime"]
    assert DecodeFirst().evicts_in("decode") and not DecodeFirst().evicts_in("prefill")
    assert not DecodeFirst().evicts_in("prefill", later_chunk=True)
    assert DecodeFirst(regime="both").evicts_in("prefill")
    assert LaterChunks().evicts_in("prefill", later_chunk=True) and not LaterChunks().evicts_in("prefill")
    with pytest.raises(ValueError, match=r"^decode-first: parameter 'regime' expects one of 'decode', 'both', got"):
        DecodeFirst(regime="prefill")
    method = DecodeFirst()
    assert method.stages().scorer is method and method.stages().protector.min_budget(40) == 0
    assert H2O(window=6).stages().protector.min_budget(40) == 4 + 6  # a method's sinks and window protect


def test_keep_top_drops_the_lowest_and_the_latest_of_ties_as_a_stable_sort_does() -> None:
    """keep_top finds a few dropped entries by topk: the same entries as ranking all of them."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = 1 + trial % 37
        scores = torch.randint(0, 4, (2, 3, n), generator=generator).double()
        scores[scores == 3] = float("inf")  # protected
        scores[scores == 0] = float("-inf")  # padding
        counts = (n - torch.randint(0, n // 4 + 2, (2, 3), generator=generator)).clamp(min=0)
        assert torch.equal(keep_top(scores, counts), descending_ranks(scores) < counts[..., None])
    for trial in range(100):  # one drop per head at most (a decode step): found by a minimum, not topk
        n = 2 + trial % 19
        scores = torch.randint(0, 3, (2, 3, n), generator=generator).float()
        if trial % 10 == 0:
            scores[0, 0, trial % n] = float("nan")
        counts = n - torch.randint(0, 2, (2, 3), generator=generator)
        assert torch.equal(keep_top(scores, counts), descending_ranks(scores) < counts[..., None])
    ties = torch.tensor([[[1.0, 0.0, 1.0, 0.0, 1.0, 2.0, 0.0, 2.0]]])
    assert keep_top(ties, torch.tensor([[6]])).tolist() == [[[True, True, True, False, True, True, False, True]]]


def test_lowest_slots_is_the_entry_a_stable_sort_ranks_last() -> None:
    """Per head, the lowest score, the latest of those tied with it (what keeping all but one
    by the stable descending sort drops); None when a score is NaN."""
    ties = torch.tensor(
        [[[1.0, 0.0, 1.0, 0.0, 1.0, 2.0, 0.0, 2.0], [float("inf"), 3.0, -1.0, 5.0, -1.0, 9.0, 0.0, 7.0]]]
    )
    assert lowest_slots(ties).tolist() == [[6, 4]]
    generator = torch.Generator().manual_seed(1)
    for trial in range(100):
        scores = torch.randint(0, 3, (2, 3, 2 + trial % 19), generator=generator).float()
        dropped = ~(descending_ranks(scores) < scores.shape[-1] - 1)
        assert torch.equal(lowest_slots(scores), dropped.to(torch.uint8).argmax(dim=-1))
    ties[0, 1, 3] = float("nan")
    assert lowest_slots(ties) is None
    distinct = torch.tensor([[[7.0, 3.0, float("inf"), 5.0], [float("inf"), 9.0, 8.0, 10.0]]])
    assert lowest_slots(distinct, distinct=True).tolist() == lowest_slots(distinct).tolist() == [[1, 2]]


class EvictionWatcher(H2O):
    """H2O that records what it is told is evicted (by the mask: it does not read slots itself)."""

    name = "h2o-watcher"

    def __init__(self, **params: object):
        super().__init__(**params)
        self.told: list[torch.Tensor] = []

    def on_evict(self, layer, evicted: torch.Tensor) -> None:
        self.told.append(torch.where(evicted, layer.positions, -1))  # the positions evicted, -1 elsewhere


def test_a_stage_that_watches_evictions_is_told_each_one_entry_drop_by_its_mask() -> None:
    """A decode step drops one entry per head by its slot; a stage that only reads masks gets
    that entry's mask (``Stage.on_evict_one``'s default), before the slot is refilled."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.Policy(EvictionWatcher()), budget=24, interval=1)
    watcher = cache.policy.scorer
    greedy(model, prompt(40), cache, new_tokens=3)
    watcher.told.clear()
    kept = [layer.positions.clone() for layer in cache.eviction_layers]
    with torch.no_grad():
        model(input_ids=prompt(1), past_key_values=cache)
    assert len(watcher.told) == len(cache.eviction_layers)  # one drop per layer, one entry per head
    for before, layer, told in zip(kept, cache.eviction_layers, watcher.told):
        assert bool(((told >= 0).sum(dim=-1) == 1).all())
        gone = told.amax(dim=-1)  # [B, Hkv]: the one position each head was told of
        assert torch.isin(gone, before).all() and not torch.isin(gone, layer.positions).any()
