import math
from types import SimpleNamespace

import pytest
import torch

import kvevict
from kvevict.policies.h2o import ACCUMULATED
from kvevict.policies.selection import select_by_tiers, within_group_rank
from kvevict.policies.thinkv import ENTROPY, SEGMENTS, attention_entropy, classify_by_thirds
from tests.conftest import greedy, kept_indices, prompt, tiny_model


def test_entropy_is_averaged_over_query_heads() -> None:
    rows = torch.tensor([[[0.5, 0.5], [1.0, 0.0]]])
    assert attention_entropy(rows).tolist() == pytest.approx([math.log(2) / 2])


def test_segments_are_classified_by_thirds() -> None:
    assert classify_by_thirds(torch.tensor([1.0])) == ["R"]
    assert classify_by_thirds(torch.tensor([3.0, 1.0, 2.0])) == ["T", "E", "R"]


def test_rank_within_groups_and_selection_by_tiers() -> None:
    groups, values = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([1.0, 2.0, 5.0, 3.0, 4.0])
    assert within_group_rank(groups, values).tolist() == [1, 0, 0, 2, 1]
    tiers, values = torch.tensor([[[0, 1, 1, 2]]]), torch.tensor([[[9.0, 1.0, 2.0, 0.0]]])
    assert kept_indices(select_by_tiers(tiers, values, torch.tensor([[2]]))) == [[[2, 3]]]
    # padding (valid false) comes last, whatever its tier
    padded = select_by_tiers(tiers, values, torch.tensor([[2]]), torch.tensor([[[True, True, True, False]]]))
    assert kept_indices(padded) == [[[1, 2]]]


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
    policy.selector.shared(layer.owner).update({SEGMENTS: dict(classes), ENTROPY: {}})
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
    classes = shared[SEGMENTS]
    assert sorted(classes) == [0, 1, 2, 3] and set(classes.values()) <= {"R", "E", "T"}  # 69 tokens seen
    assert min(shared[ENTROPY]) == 64  # classified segments drop their per-token entropies
    assert cache.layer_lengths() == [40, 40]


def test_bad_quotas_are_refused() -> None:
    with pytest.raises(ValueError, match="thinkv: parameter 'quotas' expects a mapping with an integer >= 0 for each"):
        kvevict.make_policy("thinkv", quotas={"R": 1})
