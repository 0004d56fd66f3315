"""RaaS (Hu et al., 2025, "Efficient Long-Decoding Inference with Reasoning-Aware
Attention Sparsity"), as specified by DESIGN §3."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvevict.budgets import capped_share
from kvevict.policies.base import Method, Protector, Stages
from kvevict.policies.params import declare, integer, number
from kvevict.signals import NOTHING, Phase, Regime, Requirements, Signals, group_reduce

if TYPE_CHECKING:
    from kvevict.views import EntryView

TIMESTAMP = "timestamp"
PROMPT_TIMESTAMP = -1
"""Initial timestamp of prompt entries: older than any decode step (the prefill pass is step 0)."""


def raas_update(
    timestamp: torch.Tensor,
    attention: torch.Tensor,
    step: int,
    reference: torch.Tensor | None = None,
    alpha: float | None = None,
) -> torch.Tensor:
    """RaaS's timestamp refresh at decode step ``step`` (int32 state, ``[B, Hkv, n]``).

    ``attention`` is the current query's attention reduced to KV heads (``[B, Hkv, n]``).
    An entry is *attended* when its attention is ``≥ alpha`` if ``alpha`` is given, else
    ``≥`` the median of the attention of the ``reference`` entries (``[B, Hkv, n]`` bool,
    default: all entries) of the same KV head — the usual median, i.e. the mean of the two
    middle values for an even count. Attended entries get ``TS = step``; others keep theirs.
    """
    attention = attention.float()
    if alpha is not None:
        attended = attention >= alpha
    else:
        attended = attention >= reference_median(attention, reference)  # NaN median (no reference) marks nothing
    return torch.where(attended, torch.full_like(timestamp, step), timestamp)


def reference_median(values: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
    """The median of each head's ``reference`` values (``[B, H, n]``, default: all; NaN values
    left out) → ``[B, H, 1]``, NaN for a head with none: bit for bit
    ``torch.nanquantile(values with non-reference entries NaN, 0.5, dim=-1, keepdim=True)``,
    found by two selections (``kthvalue``) instead of nanquantile's sort.

    A head with ``k`` reference values has its lower middle value at index ``m = (k - 1) // 2``
    of its sorted reference values. The selection index must be one number for every head, so
    each head moves ``M - m`` of its other entries to −inf (``M``: the largest ``m``) and the
    rest to +inf: index ``M`` of every head is then its lower middle value and ``M + 1`` its
    upper one (there are ``n - k ≥ M - m`` other entries, since ``k ≤ n``). Like nanquantile,
    the two middle values are interpolated by ``lerp`` with weight ``(k - 1) / 2 - m`` (0.5
    for an even ``k``, else 0 with the upper value equal to the lower), and a head with no
    reference value interpolates between infinities, which gives NaN."""
    present = ~values.isnan()
    reference = present if reference is None else reference & present
    count = reference.sum(dim=-1, keepdim=True)
    lower = (count - 1).clamp(min=0) // 2
    rank = int(lower.max())
    sunk = (~reference).cumsum(dim=-1) <= rank - lower  # the first M - m other entries go to -inf
    inf = torch.tensor(float("inf"), dtype=values.dtype, device=values.device)
    placed = torch.where(reference, values, torch.where(sunk, -inf, inf))
    below = placed.kthvalue(rank + 1, dim=-1, keepdim=True).values
    even = count % 2 == 0
    if rank + 2 > values.shape[-1]:  # no head has an even count of two or more
        above = below
    else:
        above = torch.where(even, placed.kthvalue(rank + 2, dim=-1, keepdim=True).values, below)
    return torch.lerp(below, above, even * torch.tensor(0.5, dtype=values.dtype, device=values.device))


class RaaS(Method):
    """RaaS: keep the prompt, evict the decode token whose last "useful" step is oldest.

    DESIGN §3: every entry carries an int32 timestamp. A decode token starts at its own
    step ``t`` (the first decode token is ``t = 1``; prompt entries start at −1). At each
    decode step the current query's attention, reduced over the GQA group by **max**,
    refreshes the timestamps (:func:`raas_update`): entries with attention ≥ the median of
    the decode tokens' attention (or ≥ ``alpha`` when given) get ``TS = t``. Over budget
    the entry with the oldest timestamp is evicted (score = timestamp, higher kept; ties go
    to the more recent position). Evicts every step (interval 1) by default.

    Prompt rule: RaaS keeps the prompt whole, which only works when it leaves room for
    generation. Here the prompt entries are protected when ``prompt_length + reserve ≤
    budget`` (``reserve`` = decode slots guaranteed, default ``min(128, budget // 4)``);
    otherwise (long prompts, small budgets) prompt entries are scored by timestamp like the
    decode tokens, so every budget ≥ 1 works. Timestamps of prompt entries are refreshed by
    the same rule either way.

    Regimes: ``"decode"`` (default) or ``"both"``: with ``"both"`` a prompt over budget is
    compressed at prefill, the prefill pass counting as step 0: its last query marks the
    entries at or above the median of the prompt's attention (or ``alpha``) with
    ``TS = 0``, the rest keep −1, and the newest entries win ties.
    """

    name = "raas"
    batched = True
    stackable = True  # its hooks read the layer's positions, state, attention and row counters only
    summary = "keep the prompt; evict the token attended (>= median) longest ago (RaaS)"
    regimes = ("decode", "both")

    PARAMS = declare(
        alpha=number(None, 0, 1, open_low=True, open_high=True, unset="the median of the decode tokens' attention"),
        reserve=integer(None, low=1, unset="min(128, budget // 4)"),
    )

    def stages(self) -> Stages:
        return Stages(scorer=self, protector=PromptWhileRoom(self.reserve))

    def requirements(self, phase: Phase, evicting: bool, regime: Regime) -> Requirements:
        # timestamps are refreshed at every decode step, evicting or not
        if phase == "decode" or evicting:
            return Requirements(last_query_attention=True)
        return NOTHING

    def new_tokens(self, layer: EntryView, num_new: int) -> dict[str, torch.Tensor]:
        b, h = layer.positions.shape[:2]
        device = layer.positions.device
        if layer.phase() == "prefill":
            timestamp = torch.full((num_new,), PROMPT_TIMESTAMP, dtype=torch.int32, device=device)
        else:  # decode tokens are numbered 1, 2, ... after the prompt
            last = layer.decode_step
            timestamp = torch.arange(last - num_new + 1, last + 1, dtype=torch.int32, device=device)
        return {TIMESTAMP: timestamp.expand(b, h, num_new).contiguous()}

    def observe(self, layer: EntryView, signals: Signals) -> None:
        if signals.last_query_attention is None:
            return
        attention = group_reduce(signals.last_query_attention.float(), layer.num_kv_heads, "max")
        if signals.phase == "decode":
            step, reference = layer.decode_step, layer.positions >= layer.prompt_length
            if layer.valid is not None:  # padding of head-wise budgets is no decode token
                reference = reference & layer.valid
        else:  # prefill compression ("both"): step 0, the prompt's own attention is the reference
            step, reference = 0, None
        state = self.state(layer)
        state[TIMESTAMP] = raas_update(state[TIMESTAMP], attention, step, reference, self.alpha)

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        """``TS·(seen + 1) + position`` in float64 (exact): the timestamp orders, the
        position breaks ties in favour of the more recent entry."""
        return self.state(layer)[TIMESTAMP].double() * (layer.seen + 1) + layer.positions.double()


class PromptWhileRoom(Protector):
    """RaaS's protection: at decode, the whole prompt, while it leaves ``reserve`` slots
    (default ``min(128, budget // 4)``, at least 1) for decode tokens."""

    name = "prompt-while-room"
    batched = True
    stackable = True

    def __init__(self, reserve: int | None):
        super().__init__()
        self.reserve = reserve

    def decode_reserve(self, budget: int) -> int:
        """Slots left for decode tokens before the prompt is protected."""
        return max(1, capped_share(budget)) if self.reserve is None else self.reserve

    def keeps_prompt(self, prompt_length: int | torch.Tensor, budget: int) -> bool | torch.Tensor:
        """Whether the prompt is protected whole at this budget (per row for ``[B, 1, 1]`` lengths)."""
        return prompt_length + self.decode_reserve(budget) <= budget

    def protected(self, layer: EntryView, budget: int) -> torch.Tensor:
        if layer.phase() != "decode":
            return torch.zeros_like(layer.positions, dtype=torch.bool)
        return (layer.positions < layer.prompt_length) & self.keeps_prompt(layer.prompt_length, budget)
