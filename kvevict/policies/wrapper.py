"""Policies that wrap another policy (DESIGN §1.6: wrappers compose).

A wrapper is registered under a prefix and built by name as ``"<prefix>+<inner>"``
(e.g. ``make_policy("moment-nc+h2o", order=0, sinks=2)``: the parameters named in
``own_params`` go to the wrapper, the others to the inner policy). Every hook goes to the
inner policy unless the wrapper overrides it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from kvevict.policies.base import Phase, Policy, Requirements, Signals

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvevict.cache import EvictionLayer


class PolicyWrapper(Policy):
    """Base class of wrappers: delegates everything to ``inner``."""

    prefix: ClassVar[str]
    own_params: ClassVar[tuple[str, ...]] = ()
    """Parameters of ``make_policy("<prefix>+<inner>", ...)`` that belong to the wrapper."""

    def __init__(self, inner: Policy):
        if not isinstance(inner, Policy):
            raise TypeError(f"{self.prefix} wraps a kvevict Policy, got {type(inner).__name__}")
        self.inner = inner
        self.name = f"{self.prefix}+{inner.name}"

    def __getattr__(self, attr: str) -> object:
        # Only reached for attributes the wrapper lacks: the inner policy's sinks, window, regime...
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def params(self) -> dict[str, object]:
        return {"base": self.inner.name, **self.inner.params()}

    @property
    def corrects_output(self) -> bool:
        return self.inner.corrects_output

    def evicts_in(self, phase: Phase) -> bool:
        return self.inner.evicts_in(phase)

    def recent_window(self, budget: int) -> int:
        return self.inner.recent_window(budget)

    def min_budget(self, budget: int) -> int:
        return self.inner.min_budget(budget)

    def check_budget(self, budget: int) -> None:
        self.inner.check_budget(budget)

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

    def select(self, layer: EvictionLayer, signals: Signals, budget: int) -> torch.Tensor:
        return self.inner.select(layer, signals, budget)

    def on_evict(self, layer: EvictionLayer, evicted: torch.Tensor) -> None:
        self.inner.on_evict(layer, evicted)

    def correct_output(
        self, layer: EvictionLayer, query: torch.Tensor, output: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        return self.inner.correct_output(layer, query, output, scaling)
