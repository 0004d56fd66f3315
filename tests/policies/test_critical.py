"""CriticalKV: two-stage selection and the ‖V W_O‖₁ signal."""

from __future__ import annotations

import pytest
import torch

import kvevict
from kvevict.policies.critical import VALUE_NORM, critical_drop_one, critical_keep
from kvevict.signals import projected_value_norms
from tests.conftest import prompt, tiny_model

INF = float("inf")


def test_two_stages_by_hand() -> None:
    scores = torch.tensor([[[0.50, 0.30, 0.10, 0.06, 0.04, INF]]])
    norms = torch.tensor([[[1.0, 1.0, 1.0, 10.0, 1.0, 1.0]]])
    # budget 5 = 1 protected + 4 free: stage 1 keeps ⌊0.5·4⌋ = 2 by score (0, 1); stage 2 ranks
    # (s + 1e-4)·‖vW‖: 0.1001, 0.6001, 0.0401 -> entry 3 and entry 2
    kept = critical_keep(scores, norms, torch.tensor([[5]]), alpha=0.5)
    assert kept[0, 0].tolist() == [True, True, True, True, False, True]
    # stage 2 only: 0.5001, 0.3001, 0.1001, 0.6001 lead -> entry 2 beats... (0, 1, 3, then 2)
    assert critical_keep(scores, norms, torch.tensor([[4]]), alpha=0.0)[0, 0].tolist() == [
        True,
        True,
        False,
        True,
        False,
        True,
    ]


def test_the_one_drop_by_hand() -> None:
    """The example above with one entry over a budget of 5: stage 1 is entries 0 and 1 (and the
    protected 5), and of the rest entry 4 has the lowest bound (0.0401)."""
    scores = torch.tensor([[[0.50, 0.30, 0.10, 0.06, 0.04, INF]]])
    norms = torch.tensor([[[1.0, 1.0, 1.0, 10.0, 1.0, 1.0]]])
    assert critical_drop_one(scores, norms).tolist() == [[4]]


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("seed", range(6))
def test_the_one_drop_is_what_the_two_stages_leave_out(alpha: float, seed: int) -> None:
    """Every head keeping all but one entry: the entry :func:`critical_drop_one` finds is the one
    :func:`critical_keep` leaves out, ties in score and in bound included (coarse values)."""
    generator = torch.Generator().manual_seed(seed)
    b, h, n = 3, 4, 33
    scores = torch.randint(0, 6, (b, h, n), generator=generator).float() / 8  # many ties at stage 1's edge
    norms = torch.randint(1, 4, (b, h, n), generator=generator).float()  # and in the bounds
    scores[..., :2] = INF  # sinks
    scores[..., -5:] = INF  # the recent window
    dropped = critical_drop_one(scores, norms, alpha=alpha)
    kept = critical_keep(scores, norms, torch.full((b, h), n - 1), alpha=alpha)
    assert torch.equal(dropped, (~kept).to(torch.uint8).argmax(dim=-1)) and bool(((~kept).sum(-1) == 1).all())


def test_the_one_drop_leaves_uneven_stage_one_sizes_and_nan_to_the_two_stages() -> None:
    scores = torch.tensor([[[0.5, 0.3, 0.1, INF], [0.5, INF, INF, INF]]])
    assert critical_drop_one(scores, torch.ones_like(scores)) is None  # stage 1 holds 1 + 1 and 3 + 0
    scores = torch.tensor([[[0.5, float("nan"), 0.1, INF]]])
    assert critical_drop_one(scores, torch.ones_like(scores)) is None


def test_stage_one_entries_always_survive() -> None:
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(2, 3, 80, generator=generator)
    norms = torch.rand(2, 3, 80, generator=generator) * 100
    counts = torch.tensor([[10, 20, 30], [5, 40, 79]])
    kept = critical_keep(scores, norms, counts, alpha=0.5)
    assert torch.equal(kept.sum(dim=-1), counts)
    for b in range(2):
        for h in range(3):
            stage1 = scores[b, h].topk(int(counts[b, h]) // 2).indices
            assert kept[b, h, stage1].all()


def test_value_norms_equal_a_brute_force_projection() -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(1, 2, 7, 8, generator=generator)
    weight = torch.randn(24, 4 * 8, generator=generator)  # hidden 24, 4 query heads of 8
    expected = torch.zeros(1, 2, 7)
    for head in range(4):
        projected = values[:, head // 2] @ weight[:, head * 8 : (head + 1) * 8].T  # [1, 7, 24]
        expected[:, head // 2] += projected.abs().sum(dim=-1) / 2
    torch.testing.assert_close(projected_value_norms(values, weight, 4), expected)


@pytest.mark.parametrize("policy", ["critical+snapkv", "critical+h2o[window=4]"])
def test_every_entry_carries_its_value_norm(policy: str) -> None:
    """A prompt's entries get their norm as they enter; decode entries two at a time (half the
    recent window of 4, which protects them until then); none when nothing evicts at decode."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, policy, budget=1000)
    with torch.no_grad():
        model(input_ids=prompt(50), past_key_values=cache)
        for step in range(3):
            model(input_ids=torch.tensor([[5 + step]]), past_key_values=cache)
            for layer, block in zip(cache.eviction_layers, model.model.layers):
                expected = projected_value_norms(layer.values, block.self_attn.o_proj.weight, 4)
                norms = cache.policy.selector.state(layer)[VALUE_NORM]
                if policy == "critical+snapkv":  # prefill-only: decode entries are never evicted, no norm needed
                    assert not norms[..., 50:].any()
                    norms, expected = norms[..., :50], expected[..., :50]
                elif step % 2 == 0:  # the newest decode entry waits for the next
                    assert norms[..., -1].isnan().all()
                    norms, expected = norms[..., :-1], expected[..., :-1]
                torch.testing.assert_close(norms, expected)


def test_critical_keeps_what_the_base_score_ranks_first() -> None:
    """Against the base policy at the same budget: the stage-1 half of each head is shared."""
    model = tiny_model()
    ids = prompt(160)
    caches = {name: kvevict.EvictionCache(model, name, budget=64) for name in ("snapkv", "critical+snapkv")}
    with torch.no_grad():
        for cache in caches.values():
            model(input_ids=ids, past_key_values=cache)
    for base, critical in zip(caches["snapkv"].eviction_layers, caches["critical+snapkv"].eviction_layers):
        for head in range(2):
            shared = set(base.positions[0, head].tolist()) & set(critical.positions[0, head].tolist())
            assert len(shared) >= 32 + 16  # window + ⌊0.5·32⌋
        assert not torch.equal(base.positions, critical.positions)  # the value norms changed the rest
