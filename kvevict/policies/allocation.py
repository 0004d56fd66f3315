"""Budget allocators as policy wrappers: ``adakv+X``, ``pyramidkv+X``, ``headkv+X``.

Each wraps any scoring policy ``X`` and changes only how many entries each KV head keeps
(:meth:`~kvevict.policies.base.Policy.allocate`); the scores, protected entries and
per-token state stay ``X``'s. Heads that keep different numbers are padded to the longest
head of their layer with a validity mask (``EvictionLayer.valid``), so attention and
later selections see exactly the real entries; ``EvictionCache.layer_bytes()`` reports
the bytes allocated and the bytes of real entries per layer. The allocation math is in
:mod:`kvevict.budgets`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvevict.budgets import adakv_counts, global_counts, headkv_capacities, load_head_profile, pyramid_budgets
from kvevict.policies.base import Policy, Wrapper, innermost, selects_by_top_scores

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvevict.cache import EvictionLayer


ALLOCATORS = ("adakv", "pyramidkv", "headkv", "global")


def check_one_allocator(prefix: str, inner: Policy) -> None:
    """Refuse a second budget allocator in one composition: only one of them could decide."""
    while isinstance(inner, Wrapper):
        if inner.prefix in ALLOCATORS:
            raise ValueError(
                f"{prefix}+{inner.name}: two budget allocators ({prefix} and {inner.prefix}) in one policy; "
                f"keep one of {', '.join(ALLOCATORS)}"
            )
        inner = inner.inner


def _protected_count(scores: torch.Tensor) -> int:
    """Entries a head must keep (sinks + recent window), as the scores mark them (+inf)."""
    return int(torch.isposinf(scores).sum(dim=-1).max())


class AdaKV(Wrapper):
    """AdaKV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
    Allocation"): within each layer, the heads share ``H × budget`` entries by the top
    scores of all heads flattened; each head keeps at least ``⌊safeguard·B'⌋`` of its own
    (``B' = budget − window``, ``safeguard = 0.2``, DESIGN §3)."""

    prefix = "adakv"
    summary = "head-adaptive budgets within each layer (AdaKV, safeguard 0.2) over any scorer"

    def __init__(self, inner: Policy, *, safeguard: float = 0.2):
        check_one_allocator("adakv", inner)
        if not 0 <= safeguard <= 1:
            raise ValueError(
                f"adakv: safeguard must be in [0, 1] (share of a head's budget it always keeps), got {safeguard}"
            )
        super().__init__(inner)
        self.safeguard = safeguard

    def allocate(self, layer: EvictionLayer, scores: torch.Tensor, budget: int) -> torch.Tensor:
        return adakv_counts(scores, budget, self.safeguard)


class PyramidKV(Wrapper):
    """PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on
    Pyramidal Information Funneling"): per-layer budgets decreasing linearly with depth
    (``β = 20``, DESIGN §3), each head of a layer keeping its layer's budget. ``pyramidkv``
    alone is ``pyramidkv+snapkv``."""

    prefix = "pyramidkv"
    summary = "per-layer budgets shrinking with depth (PyramidKV, β = 20); alone: over snapkv"

    def __init__(self, inner: Policy, *, beta: int = 20):
        check_one_allocator("pyramidkv", inner)
        if beta < 1:
            raise ValueError(f"pyramidkv: beta must be >= 1, got {beta}")
        super().__init__(inner)
        self.beta = beta
        self._num_layers = 0

    def bind(self, config: PretrainedConfig) -> None:
        super().bind(config)
        self._num_layers = config.num_hidden_layers

    def layer_budget(self, layer: EvictionLayer, scores: torch.Tensor, budget: int) -> int:
        window = _protected_count(scores)
        schedule = pyramid_budgets(budget, window, layer.length, self._num_layers, self.beta)
        return schedule[layer.layer_idx]

    def allocate(self, layer: EvictionLayer, scores: torch.Tensor, budget: int) -> torch.Tensor:
        return layer.head_lengths().clamp(max=max(self.layer_budget(layer, scores, budget), 0))


PROFILES = "profiles"
"""Package directory of bundled head profiles (one JSON per model, see ``kvevict analyze heads``)."""


def model_fingerprint(config: PretrainedConfig) -> dict[str, object]:
    """What identifies a model's attention layout for a head profile."""
    return {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
    }


def bundled_profile(config: PretrainedConfig) -> Path | None:
    """The bundled head profile computed for this model, if any."""
    fingerprint = model_fingerprint(config)
    directory = resources.files("kvevict").joinpath(PROFILES)
    if not directory.is_dir():
        return None
    for entry in directory.iterdir():
        if entry.name.endswith(".json") and json.loads(entry.read_text()).get("model") == fingerprint:
            return Path(str(entry))
    return None


class HeadKV(Wrapper):
    """HeadKV (Fu et al., 2024, "Not All Heads Matter: A Head-Level KV Cache Compression
    Method"): per-head budgets across the whole model from an offline head-importance
    profile, ``cap = round(s·⌊B/β⌋·L·H + (B − ⌊B/β⌋))`` with ``β = 1.01`` (DESIGN §3).

    ``profile``: a JSON file or mapping ``"layer-head"`` → scores (retrieval-head style,
    computed by ``kvevict analyze heads``); default: the profile bundled for the model
    (SmolLM2-135M-Instruct ships one). A head never keeps fewer than its protected entries.
    ``headkv`` alone is ``headkv+snapkv``.
    """

    prefix = "headkv"
    summary = "per-head budgets from an offline retrieval-head profile (HeadKV, β = 1.01); alone: over snapkv"

    def __init__(
        self, inner: Policy, *, profile: str | Path | Mapping[str, Sequence[float]] | None = None, beta: float = 1.01
    ):
        check_one_allocator("headkv", inner)
        if beta <= 1:
            raise ValueError(
                f"headkv: beta must be > 1 (share of the budget pooled across heads is 1/beta), got {beta}"
            )
        super().__init__(inner)
        self.profile = profile
        self.beta = beta
        self._importance: torch.Tensor | None = None

    def params(self) -> dict[str, object]:
        params = super().params()
        if isinstance(self.profile, Mapping):
            params["profile"] = "<mapping>"
        elif self.profile is not None:
            params["profile"] = str(self.profile)
        return params

    def bind(self, config: PretrainedConfig) -> None:
        super().bind(config)
        profile = self.profile if self.profile is not None else bundled_profile(config)
        if profile is None:
            raise ValueError(
                "headkv needs a head profile for this model: compute one with `kvevict analyze heads --model M "
                "--out profile.json` and pass make_policy('headkv', headkv={'profile': 'profile.json'})"
            )
        self._importance = load_head_profile(
            profile, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
        )

    def allocate(self, layer: EvictionLayer, scores: torch.Tensor, budget: int) -> torch.Tensor:
        if self._importance is None:
            raise RuntimeError("headkv is not bound to a model: use it through an EvictionCache")
        capacity = headkv_capacities(self._importance, budget, self.beta)[layer.layer_idx].to(scores.device)
        protected = torch.isposinf(scores).sum(dim=-1)
        return torch.minimum(torch.maximum(capacity, protected), layer.head_lengths())


GLOBAL_COUNTS = "global_counts"
"""``layer.memo`` key: the entries each head of the layer keeps under a shared budget."""


def standardize(scores: torch.Tensor) -> torch.Tensor:
    """A layer's selection scores on a common scale: the free (finite) scores minus their
    mean over the layer, over their standard deviation; protected and padding untouched."""
    free = torch.isfinite(scores)
    values = scores.masked_fill(~free, 0.0).double()
    count = free.sum(dim=(1, 2), keepdim=True).clamp(min=1)
    mean = values.sum(dim=(1, 2), keepdim=True) / count
    spread = (((values - mean) * free).pow(2).sum(dim=(1, 2), keepdim=True) / count).sqrt().clamp(min=1e-12)
    return torch.where(free, (values - mean) / spread, scores.double()).to(scores.dtype)


def allocates_across_layers(
    layers: list[EvictionLayer], scores: list[torch.Tensor], safeguard: float, comparable: bool
) -> None:
    """Store in each layer's memo what its heads keep under one pool ``L·H·B`` (:func:`global_counts`)."""
    ranked = scores if comparable else [standardize(layer_scores) for layer_scores in scores]
    budget = layers[0].budget
    for layer, counts in zip(layers, global_counts(ranked, budget, safeguard)):
        layer.memo[GLOBAL_COUNTS] = counts


class GlobalBudget(Wrapper):
    """One budget shared by every layer and KV head (``global+X``, DESIGN §3): the pool
    ``L·H·B`` goes to the top entries of all layers and heads ranked together by ``X``'s
    scores, each head keeping at least ``⌊safeguard·B'⌋`` (AdaKV's safeguard, ``0.2``;
    ``B'`` = budget − its protected entries). Prefill only: the layers defer their eviction
    until the prefill forward has scored every layer, then all evict at once.

    Comparability: scorers whose scores are attention probabilities (``snapkv``, ``tova``,
    ``h2o``, ``kvzip``, ``expected-attention``: ``comparable_scores``) are ranked as they
    are. Any other scorer (``knorm``'s ``−‖k‖``, positions, variances) is first standardised
    per layer (its free scores' mean 0 and standard deviation 1 over the layer's heads), so a
    layer gains budget where its score distribution has a heavier upper tail, not because its
    scores have another unit. A scorer whose selection is not a top-k by score (LagKV's per-
    chunk quotas, ThinKV, MomentKV) is refused.
    """

    prefix = "global"
    summary = "one budget pool over all layers and heads ranked by the scorer (floor 0.2·B per head; prefill)"
    deferred_prefill = True

    def __init__(self, inner: Policy, *, safeguard: float = 0.2):
        check_one_allocator("global", inner)
        if not 0 <= safeguard <= 1:
            raise ValueError(
                f"global: safeguard must be in [0, 1] (share of a head's budget it always keeps), got {safeguard}"
            )
        if inner.regime != "prefill":
            raise ValueError(
                f"global+{inner.name}: a budget shared across layers is allocated once, at prefill; "
                f"{inner.name} is set to regime {inner.regime!r} (use regime=prefill)"
            )
        if not selects_by_top_scores(inner):
            raise ValueError(
                f"global+{inner.name}: {innermost(inner).name} selects by its own rule, not by top scores, so its scores cannot "
                "be ranked across layers; use a scorer (snapkv, knorm, kvzip, expected-attention, ...)"
            )
        super().__init__(inner)
        self.safeguard = safeguard

    def allocate_layers(self, layers: list[EvictionLayer], scores: list[torch.Tensor]) -> None:
        allocates_across_layers(layers, scores, self.safeguard, self.comparable_scores)

    def allocate(self, layer: EvictionLayer, scores: torch.Tensor, budget: int) -> torch.Tensor:
        return layer.memo.pop(GLOBAL_COUNTS)
