"""The policy interface shared by every eviction method.

A policy is a small object with three jobs (DESIGN §1.6):

1. declare the signals it needs in each phase (:meth:`Policy.requirements`), so the
   attention path computes only those;
2. keep its per-token state aligned with the cache (:meth:`Policy.new_tokens` gives
   the initial state of appended entries, :meth:`Policy.observe` updates it; the cache
   layer gathers every state tensor with the entries on eviction);
3. score the retained entries (:meth:`Policy.score`, higher = keep) and select the ones
   to keep (:meth:`Policy.select`, by default: protected sinks and recent window, then
   the top scores).

Adding a method is one subclass with a ``name`` and a ``summary``, registered in
:mod:`kvevict.policies`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from kvevict.budgets import descending_ranks
from kvevict.signals import NOTHING, Phase, Regime, Requirements, Signals

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvevict.cache import EvictionCache, EvictionLayer


class Policy:
    """Base class of eviction policies.

    Subclasses set ``name``, ``summary`` and ``regimes`` (the first is the default regime),
    and override :meth:`score` (and :meth:`requirements`, :meth:`new_tokens`,
    :meth:`observe` when they keep state or read attention).

    Args:
        sinks: first tokens always kept.
        window: most recent tokens always kept.
        regime: when the policy evicts: ``"prefill"`` (compress the prompt once),
            ``"decode"`` (while generating) or ``"both"``.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    regimes: ClassVar[tuple[Regime, ...]] = ("both", "prefill", "decode")
    corrects_output: bool = False
    """True when :meth:`correct_output` changes the attention output (MomentKV's NC): the
    reference is then attention over the retained entries *plus* that correction."""
    comparable_scores: ClassVar[bool] = False
    """True when the scores mean the same thing in every layer (attention probabilities),
    so one budget can be ranked across layers (``global+``); see
    :class:`~kvevict.policies.allocation.GlobalBudget` for what is done otherwise."""
    deferred_prefill: ClassVar[bool] = False
    """True when prefill eviction waits until the whole prefill forward has run (every
    layer scored): the layers :meth:`defer` instead of evicting, then the cache calls
    :meth:`rescore_deferred`, :meth:`allocate_layers` and :meth:`select_from_scores` once,
    after the model's decoder returns (a forward hook, see ``EvictionCache``)."""

    def __init__(self, *, sinks: int = 0, window: int = 0, regime: Regime | None = None):
        if sinks < 0 or window < 0:
            raise ValueError(f"{self.name}: sinks and window must be >= 0, got sinks={sinks}, window={window}")
        regime = regime or self.regimes[0]
        if regime not in self.regimes:
            raise ValueError(f"{self.name}: regime {regime!r} is not supported; allowed: {', '.join(self.regimes)}")
        self.sinks = sinks
        self.window = window
        self.regime: Regime = regime

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({params})"

    def params(self) -> dict[str, object]:
        """The configuration of this policy (recorded with benchmark results)."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    # -- phases and budgets -------------------------------------------------------
    def evicts_in(self, phase: Phase) -> bool:
        return self.regime == "both" or self.regime == phase

    def recent_window(self, budget: int) -> int:
        """Recent tokens protected at this budget (a fixed window by default)."""
        return self.window

    def min_budget(self, budget: int) -> int:
        """Smallest budget this policy can honour: its sinks plus its recent window."""
        return self.sinks + self.recent_window(budget)

    def check_budget(self, budget: int) -> None:
        need = self.min_budget(budget)
        if budget < need:
            raise ValueError(
                f"budget {budget} is smaller than {self.name}'s sinks ({self.sinks}) + recent window "
                f"({self.recent_window(budget)}) = {need}; use a budget >= {need} or make_policy({self.name!r}, "
                "sinks=..., window=...) with smaller values"
            )

    def default_interval(self, budget: int) -> int | None:
        """The decode-time eviction interval this method prescribes (None: every step),
        used when the cache is given no ``interval``."""
        return None

    def bind(self, config: PretrainedConfig) -> None:
        """Adapt model-dependent defaults to the decoder's config (called once per cache)."""

    # -- hidden states (the EpiKV family; see kvevict.hidden) -----------------------
    hidden_context: int = 0
    """Earlier tokens the hidden-state score of a token depends on (e.g. a rolling window − 1)."""

    def hidden_layers(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers whose outputs the policy reads; the cache hooks only these (none by default)."""
        return ()

    def hidden_scores(self, changes: dict[int, torch.Tensor]) -> torch.Tensor:
        """Per-token scores ``[B, m]`` of ``m`` consecutive tokens from their hidden-state changes
        ``{layer: [B, m]}``; the first ``hidden_context`` tokens are only history. Computed once
        per token, then frozen (read them with ``layer.owner.hidden.lookup(layer.positions)``)."""
        raise NotImplementedError(f"{self.name} reads no hidden states")

    # -- the hooks a method overrides ----------------------------------------------
    def requirements(self, phase: Phase, evicting: bool) -> Requirements:
        """Signals needed for a pass in ``phase`` (``evicting``: this pass ends with an
        eviction); nothing by default."""
        return NOTHING

    def new_tokens(self, layer: EvictionLayer, num_new: int) -> dict[str, torch.Tensor]:
        """Initial per-token state ``{name: [B, Hkv, num_new, ...]}`` of appended entries."""
        return {}

    def observe(self, layer: EvictionLayer, signals: Signals) -> None:
        """Update per-token state from the signals of a pass (after attention)."""

    def score(self, layer: EvictionLayer, signals: Signals) -> torch.Tensor:
        """Importance of each retained entry, ``[B, Hkv, n]``; higher is kept first."""
        raise NotImplementedError

    def protected(self, layer: EvictionLayer, budget: int) -> torch.Tensor:
        """Entries that must survive: the sinks and the recent window, ``[B, Hkv, n]`` bool."""
        pos = layer.positions
        return (pos < self.sinks) | (pos >= layer.seen - self.recent_window(budget))

    def on_evict(self, layer: EvictionLayer, evicted: torch.Tensor) -> None:
        """Called with the entries about to be dropped, ``[B, Hkv, n]`` bool, while the layer
        still holds them (e.g. to summarise them, as MomentKV does)."""

    def correct_output(
        self, layer: EvictionLayer, query: torch.Tensor, output: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """The kernel's attention output ``[B, q, Hq, d]`` of a pass, corrected before the
        layer evicts (unchanged by default)."""
        return output

    def selection_scores(self, layer: EvictionLayer, signals: Signals, budget: int) -> torch.Tensor:
        """:meth:`score` with protected entries at ``+inf`` and padding (entries a head does
        not hold, see ``EvictionLayer.valid``) at ``-inf``; fp32 (fp64 kept where a policy
        needs its exactness)."""
        scores = self.score(layer, signals)
        scores = scores if scores.dtype == torch.float64 else scores.float()
        scores = scores.masked_fill(self.protected(layer, budget), float("inf"))
        return scores if layer.valid is None else scores.masked_fill(~layer.valid, float("-inf"))

    def allocate(self, layer: EvictionLayer, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """Entries each KV head keeps, ``[B, Hkv]`` int64: ``budget`` each (or all it holds).
        Budget allocators (AdaKV, PyramidKV, HeadKV) override this through a wrapper."""
        return layer.head_lengths().clamp(max=budget)

    def select(self, layer: EvictionLayer, signals: Signals, budget: int) -> torch.Tensor:
        """The entries to keep, ``[B, Hkv, n]`` bool: per head, the top-scoring ones up to
        the head's allocation (protected entries first)."""
        return self.select_from_scores(layer, self.selection_scores(layer, signals, budget), budget)

    def select_from_scores(self, layer: EvictionLayer, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """:meth:`select` once the selection scores are known (also the last step of a
        deferred prefill eviction)."""
        return keep_top(scores, self.allocate(layer, scores, budget))

    # -- deferred prefill eviction (KVzip's repeat pass, budgets shared across layers) ----
    def defer(self, layer: EvictionLayer, signals: Signals, budget: int) -> None:
        """At prefill, with :attr:`deferred_prefill`: keep what eviction will need once every
        layer has run (by default the selection scores, in ``layer.memo[DEFERRED]``)."""
        layer.memo[DEFERRED] = self.selection_scores(layer, signals, budget)

    def rescore_deferred(self, cache: EvictionCache, decoder: torch.nn.Module, input_ids: torch.Tensor | None) -> None:
        """After the prefill forward, before eviction: a policy that scores with extra model
        passes (KVzip) runs them here and leaves each layer's selection scores in
        ``layer.memo[DEFERRED]``. Nothing by default."""

    def allocate_layers(self, layers: list[EvictionLayer], scores: list[torch.Tensor]) -> None:
        """Deferred prefill: decide the entries of every layer together (a budget shared
        across layers) and leave what :meth:`allocate` then returns per layer in its memo.
        Nothing by default (each layer allocates on its own)."""


def innermost(policy: Policy) -> Policy:
    """The scoring policy at the core of a composition (``critical+adakv+snapkv`` → snapkv)."""
    while isinstance(policy, Wrapper):
        policy = policy.inner
    return policy


def selects_by_top_scores(policy: Policy) -> bool:
    """Whether a composition keeps each head's top scores (no rule-based ``select`` of its own)."""
    return type(innermost(policy)).select is Policy.select


DEFERRED = "deferred_scores"
"""``layer.memo`` key of the selection scores a deferred prefill eviction will use."""


def keep_top(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mask ``[B, H, n]`` of the ``counts[b, h]`` highest scores of each head (ties: the
    earlier entry)."""
    return descending_ranks(scores) < counts[..., None]


class Wrapper(Policy):
    """A policy built around another one (``prefix+inner``): every hook is delegated to
    ``inner``; subclasses override the ones they change. Wrappers nest, so
    ``critical+adakv+snapkv`` is ``Critical(Allocated(SnapKV(), AdaKV()))``. :meth:`select`
    is not delegated: the generic one uses the wrapper's own ``selection_scores`` and
    ``allocate``, so an allocator wrapped anywhere in the chain takes effect."""

    prefix: ClassVar[str]

    def __init__(self, inner: Policy):
        self.inner = inner

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.prefix}+{self.inner.name}"

    @property
    def sinks(self) -> int:  # type: ignore[override]
        return self.inner.sinks

    @property
    def window(self) -> int:  # type: ignore[override]
        return self.inner.window

    @property
    def regime(self) -> Regime:  # type: ignore[override]
        return self.inner.regime

    @property
    def corrects_output(self) -> bool:  # type: ignore[override]
        return self.inner.corrects_output

    @property
    def hidden_context(self) -> int:  # type: ignore[override]
        return self.inner.hidden_context

    @property
    def comparable_scores(self) -> bool:  # type: ignore[override]
        return self.inner.comparable_scores

    @property
    def deferred_prefill(self) -> bool:  # type: ignore[override]
        return self.inner.deferred_prefill

    def hidden_layers(self, num_layers: int) -> tuple[int, ...]:
        return self.inner.hidden_layers(num_layers)

    def hidden_scores(self, changes: dict[int, torch.Tensor]) -> torch.Tensor:
        return self.inner.hidden_scores(changes)

    def params(self) -> dict[str, object]:
        own = {k: v for k, v in vars(self).items() if not k.startswith("_") and k != "inner"}
        return {**own, "inner": {"policy": self.inner.name, **self.inner.params()}}

    def evicts_in(self, phase: Phase) -> bool:
        return self.inner.evicts_in(phase)

    def recent_window(self, budget: int) -> int:
        return self.inner.recent_window(budget)

    def min_budget(self, budget: int) -> int:
        return self.inner.min_budget(budget)

    def default_interval(self, budget: int) -> int | None:
        return self.inner.default_interval(budget)

    def bind(self, config: PretrainedConfig) -> None:
        self.inner.bind(config)

    def requirements(self, phase: Phase, evicting: bool) -> Requirements:
        return self.inner.requirements(phase, evicting)

    def new_tokens(self, layer: EvictionLayer, num_new: int) -> dict[str, torch.Tensor]:
        return self.inner.new_tokens(layer, num_new)

    def observe(self, layer: EvictionLayer, signals: Signals) -> None:
        self.inner.observe(layer, signals)

    def score(self, layer: EvictionLayer, signals: Signals) -> torch.Tensor:
        return self.inner.score(layer, signals)

    def protected(self, layer: EvictionLayer, budget: int) -> torch.Tensor:
        return self.inner.protected(layer, budget)

    def selection_scores(self, layer: EvictionLayer, signals: Signals, budget: int) -> torch.Tensor:
        return self.inner.selection_scores(layer, signals, budget)

    def allocate(self, layer: EvictionLayer, scores: torch.Tensor, budget: int) -> torch.Tensor:
        return self.inner.allocate(layer, scores, budget)

    def on_evict(self, layer: EvictionLayer, evicted: torch.Tensor) -> None:
        self.inner.on_evict(layer, evicted)

    def defer(self, layer: EvictionLayer, signals: Signals, budget: int) -> None:
        self.inner.defer(layer, signals, budget)

    def rescore_deferred(self, cache: EvictionCache, decoder: torch.nn.Module, input_ids: torch.Tensor | None) -> None:
        self.inner.rescore_deferred(cache, decoder, input_ids)

    def allocate_layers(self, layers: list[EvictionLayer], scores: list[torch.Tensor]) -> None:
        self.inner.allocate_layers(layers, scores)

    def correct_output(
        self, layer: EvictionLayer, query: torch.Tensor, output: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        return self.inner.correct_output(layer, query, output, scaling)
