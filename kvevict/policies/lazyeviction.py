"""LazyEviction (seed 001: "Lagged KV Eviction with Attention Pattern Observation for
Efficient Long Reasoning"), with DESIGN §3's exact formulas from the authors' code."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvevict.policies.base import Method, SinksAndWindow, Stages, window_size
from kvevict.policies.params import declare, integer, number
from kvevict.signals import NOTHING, Phase, Regime, Requirements, Signals, group_reduce

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvevict.views import EntryView

TIMESTAMP = "timestamp"
MRI = "mri"
ALPHA_LLAMA, ALPHA_QWEN = 5e-4, 1e-4
WINDOW_CAP = 32
"""Default ``W``: ``min(32, budget // 4)``."""


def track_recurrence(
    timestamp: torch.Tensor,
    mri: torch.Tensor,
    attention: torch.Tensor,
    step: int,
    alpha: float,
    *,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrence Interval Tracking at decode step ``step`` (int32 state, ``[B, Hkv, n]``).

    Where the current query's attention reaches ``alpha`` the timestamp becomes ``step`` and
    the Maximum Recurrence Interval grows to the gap since the previous timestamp:
    ``old = TS; TS[A ≥ α] = t; MRI = max(MRI, TS − old)`` (the gap is 0 where not attended).
    ``in_place``: into ``timestamp`` and ``mri``.
    """
    attended = attention >= alpha
    gap = (step - timestamp).mul_(attended)  # int32; 0 where not attended
    if in_place:
        return timestamp.masked_fill_(attended, step), torch.maximum(mri, gap, out=mri)
    return timestamp.masked_fill(attended, step), torch.maximum(mri, gap)


def mri_scores(timestamp: torch.Tensor, mri: torch.Tensor, step: int) -> torch.Tensor:
    """The MRI-centric importance ``H1 + H2`` (fp32): with ``Δ = t − TS``,
    ``H1 = 2σ(−1 − Δ/(MRI + 1e-5))`` (likely to recur within the next window) and
    ``H2 = 2σ(1 − MRI)``, 0 where ``MRI = 0`` (short recurrence intervals first)."""
    # integer differences are exact, and 2σ(a) + 2σ(b) = 2(σ(a) + σ(b)) exactly: the formula
    # above, in fewer operations (this runs at every eviction of every layer)
    h1 = torch.sigmoid(-1 - (step - timestamp) / (mri + 1e-5))
    h2 = torch.sigmoid(1 - mri).masked_fill_(mri == 0, 0)
    return h1.add_(h2).mul_(2)


class LazyEviction(Method):
    """LazyEviction: lagged eviction every ``W`` decode steps by recurrence patterns.

    Per KV head (query-head attention reduced by max over the group), every decode step
    updates each entry's timestamp and Maximum Recurrence Interval from the current
    query's attention (:func:`track_recurrence`; new tokens start at ``TS = t − 1``,
    prompt tokens at 0, ``MRI = 0``). When the cache exceeds the budget ``C`` at a step
    ``t`` with ``t mod W = 0``, it keeps the last ``W`` tokens plus the top ``C − W`` by
    :func:`mri_scores`, so the cache lives between ``C`` and ``C + W``.

    Defaults: ``alpha`` 5e-4 for Llama-family models, 1e-4 for Qwen (the paper's); ``window``
    (``W``) = ``min(32, budget // 4)``. The paper sets ``W`` to the 80th percentile of the
    MRI observed on a few samples (25–52 tokens for its models): measure it for a model with
    ``kvevict analyze recurrence`` and pass ``window=``. The budget-scaled default keeps
    ``W`` well inside small budgets (16 at 64).

    ``alpha`` is a threshold on attention probabilities, so it depends on the model and on
    how many entries share the attention (the budget); the paper tunes it per model (its
    Table 10, for budgets of thousands of tokens). For SmolLM2-135M at budgets 128–256,
    ``alpha=2e-3`` was tuned on ``longgen`` seed 0 and confirmed on seed 1's disjoint
    topics (see docs/policies.md); 5e-4 lies below uniform attention there and saturates the score.
    """

    name = "lazyeviction"
    stackable = True
    summary = "lagged eviction every W steps by maximum recurrence interval (seed 001)"
    batched = True
    regimes = ("decode", "both")
    PARAMS = declare(
        window=integer(None, low=1, unset="min(32, budget // 4)"),
        alpha=number(None, 0, 1, open_low=True, open_high=True, unset="5e-4 for Llama, 1e-4 for Qwen models"),
    )

    def model_defaults(self, config: PretrainedConfig) -> dict[str, object]:
        return {"alpha": ALPHA_QWEN if config.model_type.startswith("qwen") else ALPHA_LLAMA}

    def stages(self) -> Stages:
        return Stages(scorer=self, protector=SinksAndWindow(0, self.window, cap=WINDOW_CAP))

    def default_interval(self, budget: int) -> int:
        return window_size(self.window, budget, cap=WINDOW_CAP)

    def requirements(self, phase: Phase, evicting: bool, regime: Regime) -> Requirements:
        return Requirements(last_query_attention=True) if phase == "decode" else NOTHING

    def new_tokens(self, layer: EntryView, num_new: int) -> dict[str, torch.Tensor]:
        b, h = layer.positions.shape[:2]
        device = layer.positions.device
        if layer.phase() == "prefill":  # prompt tokens
            timestamp = torch.zeros(num_new, dtype=torch.int32, device=device)
        else:  # a token fed at decode step t was produced at step t - 1
            last = layer.decode_step
            timestamp = torch.arange(last - num_new, last, dtype=torch.int32, device=device)
        zeros = torch.zeros((), dtype=torch.int32, device=device)  # written into the layer's state, broadcast
        return {TIMESTAMP: timestamp.expand(b, h, num_new), MRI: zeros.expand(b, h, num_new)}

    def observe(self, layer: EntryView, signals: Signals) -> None:
        if signals.phase != "decode":
            return
        if self.alpha is None:
            raise RuntimeError("lazyeviction is not bound to a model (alpha unset): use it through an EvictionCache")
        state = self.state(layer)
        attention = group_reduce(signals.last_query_attention, layer.num_kv_heads, "max")
        track_recurrence(state[TIMESTAMP], state[MRI], attention, layer.decode_step, self.alpha, in_place=True)

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        state = self.state(layer)
        return mri_scores(state[TIMESTAMP], state[MRI], layer.decode_step)
