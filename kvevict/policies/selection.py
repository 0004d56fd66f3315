"""Selection rules shared by the EpiKV paper's decode-time policies (seed 000, App. D).

* :class:`PromptKeeping` (with its :class:`PromptAndWindow` protector): the prompt is kept
  whole and the recent ``min(128, K/4)`` tokens are kept; the rest of the budget ``K`` goes to
  the top decode tokens by score. A prompt prefilled in chunks is evicted at each chunk after
  the first (kvevict's extension for bounded memory, see :class:`PromptKeeping`).
* :func:`within_group_rank` and :func:`select_by_tiers`: lexicographic selection (a tier
  first, then a value), used by the per-chunk (LagKV) and per-segment (ThinKV) quotas.
* :func:`position_order` and :func:`in_position_order`: the entries in position order (the
  cache refills evicted slots, so storage order is not position order), for the rules that
  read neighbours or chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvevict.policies.base import Method, Protector, Stages, keep_top, window_size
from kvevict.policies.params import RECENT_WINDOW, declare
from kvevict.signals import Regime

if TYPE_CHECKING:
    from kvevict.views import EntryView


class PromptKeeping(Method):
    """Decode-time base: prompt kept, recent ``min(128, K/4)`` kept, top decode tokens by score.

    Like RaaS, the prompt is protected only while it leaves room for the recent window
    (``prompt + recent ≤ K``); a longer prompt is scored like the decode tokens, so every
    budget works.

    Chunked prefill (an extension; the papers prefill in one pass, DESIGN §1.10): a prompt
    prefilled in one pass is held whole until the first decode step, as the papers do, but at
    every later chunk of a chunked prompt the cache evicts back to ``K`` by the same rule, since
    the earlier chunks are scored by then: the prompt so far no longer fits beside the recent
    window, so its tokens are ranked by the method's score. Tokens whose score does not exist
    yet (the chunk in flight, at layers before its score is known) count as ``+inf`` (kept).
    The first pass is never evicted (it may be the whole prompt), so a later chunk must hold at
    most ``K`` tokens (else refused, :func:`check_prompt_chunk`), and the cache then holds at
    most ``K + C`` entries per head.

    Args:
        window: recent tokens kept (None: ``min(128, budget // 4)``).
        regime: ``"decode"`` (the only one: these scores are made while generating).
    """

    regimes: tuple[Regime, ...] = ("decode",)
    evicts_later_chunks = True
    PARAMS = declare(window=RECENT_WINDOW)

    def stages(self) -> Stages:
        return Stages(scorer=self, protector=PromptAndWindow(self.window))


def check_prompt_chunk(layer: EntryView, budget: int) -> None:
    """Refuse an eviction of a prompt chunk (after the first) of more than ``budget`` tokens
    under a :class:`PromptKeeping` method: the first pass was held whole, so only a chunk that
    fits the budget keeps a head within ``budget + chunk`` entries; and a hidden-state score
    of a chunk is known only past its layers (the chunk counts as ``+inf`` before them), so a
    larger chunk could not be ranked."""
    if layer.num_new > budget and layer.passes > 1 and layer.phase() == "prefill":
        name = layer.policy.name
        raise ValueError(
            f"{name} holds the first pass of a prompt whole and evicts each later chunk back to the budget, keeping "
            f"the chunk's tokens it has not scored yet, so a prompt prefilled in chunks takes chunks of at most the "
            f"budget: got a chunk of {layer.num_new} tokens at budget {budget}; use prefill_chunk_size "
            f"(--prefill-chunk) <= {budget}, or prefill the prompt in one pass"
        )


class PromptAndWindow(Protector):
    """The recent window (``window`` tokens; None: ``min(128, budget // 4)``) and, while it
    fits beside the window, the whole prompt."""

    name = "prompt-and-window"
    batched = True
    stackable = True

    def __init__(self, window: int | None):
        super().__init__()
        self.window = window

    def recent_window(self, budget: int) -> int:
        return window_size(self.window, budget)

    def keeps_prompt(self, prompt_length: int | torch.Tensor, budget: int) -> bool | torch.Tensor:
        """Whether the prompt is protected whole at this budget (per row for ``[B, 1, 1]`` lengths)."""
        return prompt_length + self.recent_window(budget) <= budget

    def protected(self, layer: EntryView, budget: int) -> torch.Tensor:
        check_prompt_chunk(layer, budget)
        positions = layer.positions
        recent = positions >= layer.seen - self.recent_window(budget)
        keeps_prompt = self.keeps_prompt(layer.prompt_length, budget)
        if keeps_prompt is False:  # the usual decode step: a prompt longer than the budget is ranked
            return recent
        return recent | ((positions < layer.prompt_length) & keeps_prompt)


def within_group_rank(
    groups: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Rank of each entry among the entries of its group by ``values`` (0 = highest), along
    the last dimension; ties keep the earlier entry first: the one at the lower ``positions``
    (storage reuses slots, so the index says nothing of age), else the lower index. ``groups``
    is an integer tensor."""
    if positions is not None:
        order = positions.argsort(dim=-1, stable=True)
        rank = within_group_rank(groups.gather(-1, order), values.gather(-1, order))
        return torch.empty_like(rank).scatter_(-1, order, rank)
    n = values.shape[-1]
    by_value = values.argsort(dim=-1, descending=True, stable=True)
    by_group = groups.gather(-1, by_value).argsort(dim=-1, stable=True)
    order = by_value.gather(-1, by_group)  # grouped, highest value first inside a group
    sorted_groups = groups.gather(-1, order)
    index = torch.arange(n, device=values.device).expand_as(sorted_groups)
    starts = sorted_groups != torch.nn.functional.pad(sorted_groups[..., :-1], (1, 0), value=-1)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return torch.empty_like(order).scatter_(-1, order, index - first)


def select_by_tiers(
    tiers: torch.Tensor,
    values: torch.Tensor,
    counts: torch.Tensor,
    valid: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keep mask ``[B, H, n]`` of the ``counts[b, h]`` entries of each head with the highest
    tier, ties broken by the highest value (then the more recent entry: the higher
    ``positions``, else the higher index); padding (``valid`` false) comes last."""
    if positions is not None:
        order = positions.argsort(dim=-1, stable=True)
        gathered = None if valid is None else valid.gather(-1, order)
        keep = select_by_tiers(tiers.gather(-1, order), values.gather(-1, order), counts, gathered)
        return torch.empty_like(keep).scatter_(-1, order, keep)
    n = values.shape[-1]
    value_rank = values.float().argsort(dim=-1, stable=True).argsort(dim=-1)
    if valid is not None:
        tiers = tiers.masked_fill(~valid, -1)
    key = tiers.double() * n + value_rank.double()
    return keep_top(key, counts)


def position_order(positions: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """The storage indices ``[B, H, m]`` of the entries in position order, the entries that are
    not ``real`` last (padding of head-wise budgets holds stale positions)."""
    if real is not None:
        positions = positions.masked_fill(~real, torch.iinfo(positions.dtype).max)
    return positions.argsort(dim=-1, stable=True)


def in_position_order(
    transform: Callable[[torch.Tensor], torch.Tensor], scores: torch.Tensor, order: torch.Tensor | None
) -> torch.Tensor:
    """``transform`` (pooling over neighbours, chunk means) of ``scores`` ``[..., n]`` laid out
    in position order (``order`` from :func:`position_order`; None: already in it), its result
    put back in storage order."""
    if order is None:
        return transform(scores)
    ordered = transform(scores.gather(-1, order))
    return torch.empty_like(ordered).scatter_(-1, order, ordered)
