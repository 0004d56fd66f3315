"""Selection rules of the decode-time policies (kvevict.policies.selection): the prompt and
recent window kept, a chunked prompt's chunks bounded by the budget, lexicographic selection
by tiers, and the entries taken in position order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvevict
from kvevict.policies.selection import (
    PromptAndWindow,
    check_prompt_chunk,
    in_position_order,
    position_order,
    select_by_tiers,
    within_group_rank,
)
from tests.conftest import greedy, kept_indices, prompt, tiny_model
from tests.policies.test_epikv import HIDDEN


def test_rank_within_groups_and_selection_by_tiers() -> None:
    groups, values = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([1.0, 2.0, 5.0, 3.0, 4.0])
    assert within_group_rank(groups, values).tolist() == [1, 0, 0, 2, 1]
    tiers, values = torch.tensor([[[0, 1, 1, 2]]]), torch.tensor([[[9.0, 1.0, 2.0, 0.0]]])
    assert kept_indices(select_by_tiers(tiers, values, torch.tensor([[2]]))) == [[[2, 3]]]
    # padding (valid false) comes last, whatever its tier
    padded = select_by_tiers(tiers, values, torch.tensor([[2]]), torch.tensor([[[True, True, True, False]]]))
    assert kept_indices(padded) == [[[1, 2]]]


def test_ties_within_a_group_rank_the_earlier_entry_first() -> None:
    groups, values = torch.tensor([[0, 0, 0, 1]]), torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    assert within_group_rank(groups, values).tolist() == [[0, 1, 2, 0]]  # by index
    positions = torch.tensor([[2, 0, 1, 3]])  # slots reused: index 1 holds the oldest entry
    assert within_group_rank(groups, values, positions).tolist() == [[2, 0, 1, 0]]


def test_ties_in_selection_by_tiers_keep_the_more_recent_entries() -> None:
    tiers, values, counts = torch.zeros(1, 1, 4, dtype=torch.long), torch.ones(1, 1, 4), torch.tensor([[2]])
    assert kept_indices(select_by_tiers(tiers, values, counts)) == [[[2, 3]]]  # the higher indices
    positions = torch.tensor([[[3, 0, 2, 1]]])
    assert kept_indices(select_by_tiers(tiers, values, counts, positions=positions)) == [[[0, 2]]]
    # each head its own count
    two_heads = select_by_tiers(tiers.expand(1, 2, 4), values.expand(1, 2, 4), torch.tensor([[1, 3]]))
    assert kept_indices(two_heads) == [[[3], [1, 2, 3]]]


def test_position_order_puts_entries_that_are_not_real_last() -> None:
    positions = torch.tensor([[[5, 1, 3, 0]]])
    assert position_order(positions).tolist() == [[[3, 1, 2, 0]]]
    real = torch.tensor([[[True, False, True, True]]])  # a stale position in padding
    assert position_order(positions, real).tolist() == [[[3, 2, 0, 1]]]


def test_a_transform_in_position_order_is_put_back_in_storage_order() -> None:
    scores = torch.tensor([[[10.0, 20.0, 30.0]]])
    positions = torch.tensor([[[2, 0, 1]]])  # in position order: 20, 30, 10
    running = in_position_order(lambda x: x.cumsum(-1), scores, position_order(positions))
    assert running.tolist() == [[[60.0, 20.0, 50.0]]]
    assert in_position_order(lambda x: x.cumsum(-1), scores, None).tolist() == [[[10.0, 30.0, 60.0]]]


def test_the_recent_window_defaults_to_a_quarter_of_the_budget_up_to_128() -> None:
    assert PromptAndWindow(None).recent_window(40) == 10 and PromptAndWindow(None).recent_window(1024) == 128
    assert PromptAndWindow(8).recent_window(40) == 8


def test_the_prompt_is_kept_while_it_fits_beside_the_recent_window() -> None:
    protector = PromptAndWindow(None)  # window 10 at budget 40
    assert protector.keeps_prompt(30, 40) is True and protector.keeps_prompt(31, 40) is False
    per_row = protector.keeps_prompt(torch.tensor([[[30]], [[31]]]), 40)
    assert per_row.flatten().tolist() == [True, False]


def decode_view(prompt_length: int | torch.Tensor, rows: int = 1) -> SimpleNamespace:
    """A decode step's view of 12 entries (positions 0..11, storage order reversed) at budget 8."""
    return SimpleNamespace(
        positions=torch.arange(11, -1, -1).expand(rows, 1, 12),
        seen=12,
        prompt_length=prompt_length,
        num_new=1,
        passes=2,
        phase=lambda: "decode",
    )


def test_the_prompt_and_the_recent_window_are_protected() -> None:
    protector = PromptAndWindow(2)
    # positions 11, 10 (the window) and 3, 2, 1, 0 (the prompt) lie at these slots
    assert kept_indices(protector.protected(decode_view(4), 8)) == [[[0, 1, 8, 9, 10, 11]]]
    assert kept_indices(protector.protected(decode_view(7), 8)) == [[[0, 1]]]  # 7 + 2 > 8: the window only
    per_row = protector.protected(decode_view(torch.tensor([[[4]], [[7]]]), rows=2), 8)
    assert kept_indices(per_row) == [[[0, 1, 8, 9, 10, 11]], [[0, 1]]]


def chunk_view(num_new: int, passes: int, phase: str) -> SimpleNamespace:
    return SimpleNamespace(num_new=num_new, passes=passes, phase=lambda: phase, policy=SimpleNamespace(name="epikv"))


def test_a_later_prompt_chunk_larger_than_the_budget_is_refused_saying_what_to_do() -> None:
    with pytest.raises(ValueError) as refused:
        check_prompt_chunk(chunk_view(9, 2, "prefill"), 8)
    message = str(refused.value)
    assert message.startswith("epikv holds the first pass of a prompt whole and evicts each later chunk")
    assert message.endswith(
        "got a chunk of 9 tokens at budget 8; use prefill_chunk_size (--prefill-chunk) <= 8, or prefill the "
        "prompt in one pass"
    )
    # the first pass, a chunk within the budget, and a decode pass of several tokens are not chunks to bound
    for view in (chunk_view(9, 1, "prefill"), chunk_view(8, 2, "prefill"), chunk_view(9, 2, "decode")):
        check_prompt_chunk(view, 8)


@pytest.mark.parametrize("policy", [*HIDDEN, "kv-key-var"])
def test_a_prompt_chunk_larger_than_the_budget_is_refused(policy: str) -> None:
    model = tiny_model()
    cache = kvevict.EvictionCache(model, kvevict.make_policy(policy), budget=40)
    with pytest.raises(ValueError, match=r"takes chunks of at most the budget: got a chunk of 48 tokens at budget 40"):
        greedy(model, prompt(128), cache, new_tokens=1, chunk=48)
