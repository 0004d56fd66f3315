"""Budget allocators: ``adakv+X``, ``pyramidkv+X``, ``headkv+X``.

Each is the allocator stage of a policy: it changes only how many entries each KV head
keeps (:meth:`~kvevict.policies.base.Allocator.counts`); the scores, the protected entries,
the per-token state and the selection (top-k, CriticalKV, MomentKV's MI loop, ThinKV's and
LagKV's quotas: every selector takes per-head counts) stay ``X``'s. Heads that keep
different numbers are padded to the longest head of their layer with a validity mask
(``EvictionLayer.valid``), so attention and later selections see exactly the real entries;
``EvictionCache.layer_bytes()`` reports the bytes allocated and the bytes of real entries
per layer. The allocation math is in :mod:`kvevict.budgets`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvevict.budgets import adakv_counts, headkv_capacities, load_head_profile, pyramid_budgets
from kvevict.policies.base import Allocator
from kvevict.policies.params import Param, declare, integer, number

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvevict.cache import EvictionLayer
    from kvevict.policies.pipeline import Policy


class AdaKV(Allocator):
    """AdaKV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
    Allocation"): within each layer, the heads share ``H × budget`` entries by the top
    scores of all heads flattened; each head keeps at least ``⌊safeguard·B'⌋`` of its own
    (``B' = budget − window``, ``safeguard = 0.2``, DESIGN §3). Needs a scorer whose scores
    compare across heads."""

    name = "adakv"
    summary = "head-adaptive budgets within each layer (AdaKV, safeguard 0.2) over any scorer"
    PARAMS = declare(safeguard=number(0.2, 0, 1))

    def check(self, policy: Policy) -> None:
        if policy.scorer is None:
            raise ValueError(
                "adakv shares each layer's budget across heads by comparing their scores, and "
                f"{policy.method.name} has no score (it selects by its own quotas); over {policy.method.name} "
                "use pyramidkv or headkv"
            )

    def counts(
        self, layer: EvictionLayer, scores: torch.Tensor | None, protected: torch.Tensor, budget: int
    ) -> torch.Tensor:
        return adakv_counts(scores, budget, self.safeguard)


class PyramidKV(Allocator):
    """PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on
    Pyramidal Information Funneling"): per-layer budgets decreasing linearly with depth
    (``β = 20``, DESIGN §3), each head of a layer keeping its layer's budget. ``pyramidkv``
    alone is ``pyramidkv+snapkv``."""

    name = "pyramidkv"
    summary = "per-layer budgets shrinking with depth (PyramidKV, β = 20); alone: over snapkv"
    PARAMS = declare(beta=integer(20, low=1))

    def __init__(self, **params: object):
        super().__init__(**params)
        self._num_layers = 0

    def bind(self, config: PretrainedConfig) -> None:
        super().bind(config)
        self._num_layers = config.num_hidden_layers

    def counts(
        self, layer: EvictionLayer, scores: torch.Tensor | None, protected: torch.Tensor, budget: int
    ) -> torch.Tensor:
        window = int(protected.sum(dim=-1).max())  # entries a head must keep (sinks + recent window)
        schedule = pyramid_budgets(budget, window, layer.length, self._num_layers, self.beta)
        return layer.head_lengths().clamp(max=max(schedule[layer.layer_idx], 0))


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


PROFILE = Param(
    None,
    "a JSON file (path) or a mapping 'layer-head' -> scores",
    lambda v: isinstance(v, (str, Path, Mapping)),
    "the profile bundled for the model",
)


class HeadKV(Allocator):
    """HeadKV (Fu et al., 2024, "Not All Heads Matter: A Head-Level KV Cache Compression
    Method"): per-head budgets across the whole model from an offline head-importance
    profile, ``cap = round(s·⌊B/β⌋·L·H + (B − ⌊B/β⌋))`` with ``β = 1.01`` (DESIGN §3).

    ``profile``: a JSON file or mapping ``"layer-head"`` → scores (retrieval-head style,
    computed by ``kvevict analyze heads``); default: the profile bundled for the model
    (SmolLM2-135M-Instruct ships one). A head never keeps fewer than its protected entries.
    ``headkv`` alone is ``headkv+snapkv``.
    """

    name = "headkv"
    summary = "per-head budgets from an offline retrieval-head profile (HeadKV, β = 1.01); alone: over snapkv"
    PARAMS = declare(profile=PROFILE, beta=number(1.01, 1, open_low=True))

    def __init__(self, **params: object):
        super().__init__(**params)
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

    def counts(
        self, layer: EvictionLayer, scores: torch.Tensor | None, protected: torch.Tensor, budget: int
    ) -> torch.Tensor:
        if self._importance is None:
            raise RuntimeError("headkv is not bound to a model: use it through an EvictionCache")
        capacity = headkv_capacities(self._importance, budget, self.beta)[layer.layer_idx].to(protected.device)
        return torch.minimum(torch.maximum(capacity, protected.sum(dim=-1)), layer.head_lengths())
