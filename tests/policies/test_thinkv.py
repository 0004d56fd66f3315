import math
from types import SimpleNamespace

import pytest
import torch

import kvevict
from kvevict.batching import left_padded
from kvevict.policies.base import Ranking
from kvevict.policies.h2o import ACCUMULATED
from kvevict.policies.selection import select_by_tiers, within_group_rank
from kvevict.policies.thinkv import ENTROPY, QUOTA, attention_entropy, classify_by_thirds, drop_one_by_quotas
from tests.conftest import greedy, kept_indices, prompt, tiny_model


def test_entropy_is_averaged_over_query_heads() -> None:
    rows = torch.tensor([[[0.5, 0.5], [1.0, 0.0]]])
    assert attention_entropy(rows).tolist() == pytest.approx([math.log(2) / 2])


def test_segments_are_classified_by_thirds() -> None:
    assert classify_by_thirds(torch.tensor([1.0])) == ["R"]
    assert classify_by_thirds(torch.tensor([3.0, 1.0, 2.0])) == ["T", "E", "R"]


def fake_layer(policy, values: list[float], classes: dict[int, str], hidden=None):
    """A decode step (one new token) at budget 8."""
    n = len(values)
    layer = SimpleNamespace(
        positions=torch.arange(n)[None, None],
        seen=n,
        num_new=1,
        budget=8,
        state={},
        valid=None,
        head_lengths=lambda: torch.tensor([[n]]),
        layer_idx=0,
        owner=SimpleNamespace(shared={}, eviction_layers=[SimpleNamespace(layer_idx=0)], hidden=hidden),
    )
    policy.scorer.state(layer)[ACCUMULATED] = torch.tensor([[values]])
    quotas = [policy.selector.quotas[classes[s]] if s in classes else -1 for s in range(max(classes) + 1)]
    policy.selector.shared(layer.owner)[QUOTA] = torch.tensor([quotas])
    return layer


@pytest.mark.parametrize("policy", ["thinkv", "segment-hs"])
def test_recent_then_unclassified_then_quotas_then_the_rest(policy: str) -> None:
    values = [4.0, 1.0, 3.0, 2.0, 1.0, 5.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0]
    hidden = SimpleNamespace(lookup=lambda positions, end=None: torch.tensor(values)[positions])
    thinkv = kvevict.make_policy(policy, segment=4, quotas={"R": 2, "E": 1, "T": 0})
    layer = fake_layer(thinkv, values if policy == "thinkv" else [0.0] * 12, {0: "R", 1: "E"}, hidden)
    # recent min(128, 8 // 4) = 10, 11; segment 2 unclassified: 8, 9; R keeps 0 and 2, E keeps 5;
    # the last slot goes to the best of the rest (1, 3, 4, 6, 7), ties to the more recent: 7
    assert kept_indices(thinkv.select(layer, None, 8)) == [[[0, 2, 5, 7, 8, 9, 10, 11]]]


def test_thinkv_classifies_segments_once_every_entropy_layer_saw_them() -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy("thinkv", segment=16), budget=40)
    greedy(model, prompt(30), cache, new_tokens=40)
    shared = cache.policy.selector.shared(cache)
    quotas = shared[QUOTA][0].tolist()  # 69 tokens seen: segments 0-3 complete, 4 (64-68) not yet
    assert set(quotas[:4]) <= {64, 32, 8} and set(quotas[4:]) == {-1} and shared[ENTROPY].classified.tolist() == [4]
    assert cache.layer_lengths() == [40, 40]


def test_dropping_one_entry_without_sorting_drops_what_the_ranking_drops() -> None:
    generator = torch.Generator().manual_seed(0)
    shortcut = 0
    for trial in range(400):
        rows, heads, n, segment = 1 + trial % 3, 1 + trial % 2, 3 + trial % 37, 1 + trial % 5
        draw = [torch.randperm(n + 10, generator=generator)[:n] for _ in range(rows * heads)]
        positions = torch.stack(draw).view(rows, heads, n)
        groups = positions // segment
        table = torch.randint(-1, 4, (rows, int(groups.max()) + 1), generator=generator)
        quota = table.gather(1, groups.flatten(1)).view_as(groups)
        if trial % 2:  # many ties
            values = torch.randint(0, 6, (rows, heads, n), generator=generator).float()
        else:
            values = torch.rand(rows, heads, n, generator=generator)
        protected = positions >= positions.max() + 1 - trial % 5
        counts = torch.where(torch.rand(rows, heads, generator=generator) < 0.2, n, n - 1)
        in_quota = within_group_rank(groups, values, positions) < quota
        tiers = torch.where(protected, 3, torch.where(quota < 0, 2, torch.where(in_quota, 1, 0)))
        keep = drop_one_by_quotas(groups, quota, values, positions, Ranking(values, protected, counts))
        if keep is not None:  # None: a tie it leaves to the sort
            shortcut += 1
            assert torch.equal(keep, select_by_tiers(tiers, values, counts, None, positions)), trial
    assert shortcut > 200  # most: the ties it leaves are among the many of the tied half


def kept_positions(cache: kvevict.EvictionCache, row: int) -> list[list[list[int]]]:
    return [[sorted(head.tolist()) for head in layer.positions[row]] for layer in cache.eviction_layers]


def test_rows_in_lockstep_keep_what_each_keeps_alone() -> None:
    model = tiny_model()
    prompts = [prompt(length, seed=seed) for seed, length in enumerate((40, 57, 33))]
    tokens = prompt(3 * 30, seed=9).view(3, 30)

    def run(ids: torch.Tensor, mask: torch.Tensor, steps: torch.Tensor) -> tuple[kvevict.EvictionCache, list]:
        policy = kvevict.make_policy("thinkv", segment=8, quotas={"R": 4, "E": 2, "T": 1})
        cache = kvevict.EvictionCache(model, policy, budget=24)
        kept = []
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, past_key_values=cache)
            for step in range(steps.shape[1]):
                mask = torch.cat([mask, mask[:, -1:]], dim=1)
                model(input_ids=steps[:, step : step + 1], attention_mask=mask, past_key_values=cache)
                kept.append([kept_positions(cache, row) for row in range(ids.shape[0])])
        return cache, kept

    batch, kept = run(*left_padded(prompts), tokens)
    assert [view.rows for view in batch.eviction_layers[0].views()] == [slice(0, 3)]  # one view: rows in lockstep
    for row, ids in enumerate(prompts):  # each row completes its segments at other steps (8 | seen)
        _, alone = run(ids, torch.ones_like(ids), tokens[row : row + 1])
        assert [step[row] for step in kept] == [step[0] for step in alone]


def test_bad_quotas_are_refused() -> None:
    with pytest.raises(ValueError, match="thinkv: parameter 'quotas' expects a mapping with an integer >= 0 for each"):
        kvevict.make_policy("thinkv", quotas={"R": 1})
