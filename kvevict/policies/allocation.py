"""Budget allocators: ``adakv+X``, ``pyramidkv+X``, ``headkv+X``, ``global+X``.

Each is the allocator stage of a policy: it changes only how many entries each KV head
keeps (:meth:`~kvevict.policies.base.Allocator.counts`); the scores, the protected entries,
the per-token state and the selection (top-k, CriticalKV, MomentKV's MI loop, ThinKV's and
LagKV's quotas: every selector takes per-head counts) stay ``X``'s. Heads that keep
different numbers are padded to the longest head of their layer with a validity mask
(``EntryView.valid``), so attention and later selections see exactly the real entries;
``EvictionCache.layer_bytes()`` reports the bytes allocated and the bytes of real entries
per layer. The allocation math is in :mod:`kvevict.budgets`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvevict.budgets import adakv_counts, global_counts, headkv_capacities, load_head_profile, pyramid_budgets
from kvevict.packedpass import chunks_stay_packed
from kvevict.policies.base import Allocator, Assembly
from kvevict.policies.params import Param, declare, integer, is_number, number
from kvevict.signals import row_lengths

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvevict.views import EntryView


class AdaKV(Allocator):
    """AdaKV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
    Allocation"): within each layer, the heads share ``H × budget`` entries by the top
    scores of all heads flattened; each head keeps at least ``⌊safeguard·B'⌋`` of its own
    (``B' = budget − window``, ``safeguard = 0.2``, DESIGN §3). Needs a scorer whose scores
    compare across heads."""

    name = "adakv"
    batched = True
    summary = "head-adaptive budgets within each layer (AdaKV, safeguard 0.2) over any scorer"
    PARAMS = declare(safeguard=number(0.2, 0, 1))

    def check(self, policy: Assembly) -> None:
        if policy.scorer is None:
            raise ValueError(
                "adakv shares each layer's budget across heads by comparing their scores, and "
                f"{policy.method.name} has no score (it selects by its own quotas); over {policy.method.name} "
                "use pyramidkv or headkv"
            )

    def counts(
        self, layer: EntryView, scores: torch.Tensor | None, protected: torch.Tensor, budget: int
    ) -> torch.Tensor:
        return adakv_counts(scores, budget, self.safeguard)


class PyramidKV(Allocator):
    """PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on
    Pyramidal Information Funneling"): per-layer budgets decreasing linearly with depth
    (``β = 20``, DESIGN §3), each head of a layer keeping its layer's budget. ``pyramidkv``
    alone is ``pyramidkv+snapkv``."""

    name = "pyramidkv"
    batched = True
    summary = "per-layer budgets shrinking with depth (PyramidKV, β = 20); alone: over snapkv"
    PARAMS = declare(beta=integer(20, low=1))

    def __init__(self, **params: object):
        super().__init__(**params)
        self._num_layers = 0

    def bind(self, config: PretrainedConfig) -> None:
        super().bind(config)
        self._num_layers = config.num_hidden_layers

    def counts(
        self, layer: EntryView, scores: torch.Tensor | None, protected: torch.Tensor, budget: int
    ) -> torch.Tensor:
        windows = protected.sum(dim=-1).amax(dim=-1).tolist()  # entries a head of each row must keep
        lengths = row_lengths(layer.length, len(windows), layer.new_columns)
        kept = [
            max(pyramid_budgets(budget, window, length, self._num_layers, self.beta)[layer.layer_idx], 0)
            for window, length in zip(windows, lengths, strict=True)
        ]
        return layer.head_lengths().clamp(max=torch.tensor(kept, device=protected.device)[:, None])


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


def bundled_profile(config: PretrainedConfig, folder: str = PROFILES) -> Path | None:
    """The file bundled in the package's ``folder`` for this model, if any: a JSON whose
    ``"model"`` is the model's fingerprint (head profiles; Q-Filters, :mod:`kvevict.policies.qfilters`)."""
    fingerprint = model_fingerprint(config)
    directory = resources.files("kvevict").joinpath(folder)
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
    batched = True
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
        self, layer: EntryView, scores: torch.Tensor | None, protected: torch.Tensor, budget: int
    ) -> torch.Tensor:
        if self._importance is None:
            raise RuntimeError("headkv is not bound to a model: use it through an EvictionCache")
        capacity = headkv_capacities(self._importance, budget, self.beta)[layer.layer_idx].to(protected.device)
        return torch.minimum(torch.maximum(capacity, protected.sum(dim=-1)), layer.head_lengths())


CHUNK_CAP = 4.0
"""``global``'s default ``cap`` where a prompt chunk's pass pads each layer to its longest head
(on a GPU, or under a policy whose chunks do not stay packed): a head keeps at most ``4·B``
entries after each pooled eviction (docs/fastkvzip.md, round 8). Where every chunk's pass stays
packed (:func:`~kvevict.packedpass.chunks_stay_packed`, on a CPU) a head costs only its own
entries, and the default is no cap (round 9)."""


def reach(layer: EntryView) -> int:
    """Entries each head of ``layer`` (one row) would hold with no eviction: the tokens it has
    seen, or on a sliding layer the ``window − 1`` that a later query still sees."""
    seen = int(layer.seen)
    return seen if layer.window is None else min(seen, layer.window - 1)


def standardize(scores: torch.Tensor) -> torch.Tensor:
    """A layer's selection scores on a common scale: the free (finite) scores minus their
    mean over the layer, over their standard deviation; protected and padding untouched."""
    free = torch.isfinite(scores)
    values = scores.masked_fill(~free, 0.0).double()
    count = free.sum(dim=(1, 2), keepdim=True).clamp(min=1)
    mean = values.sum(dim=(1, 2), keepdim=True) / count
    spread = (((values - mean) * free).pow(2).sum(dim=(1, 2), keepdim=True) / count).sqrt().clamp(min=1e-12)
    return torch.where(free, (values - mean) / spread, scores.double()).to(scores.dtype)


class GlobalBudget(Allocator):
    """One budget shared by every layer and KV head (``global+X``, DESIGN §3): the pool
    ``L·H·B`` (what every head would keep under its own budget: a sliding layer whose window
    is shorter than ``B`` brings its window, and joins the pool all the same) goes to the top
    entries of all layers and heads ranked together by ``X``'s scores, each head keeping at
    least ``⌊safeguard·B'⌋`` (AdaKV's safeguard, ``0.2``; ``B'`` = budget − its protected
    entries). Prefill only: the layers defer their eviction until the prefill forward has
    scored every layer, then all evict at once. KVzip brings this allocator itself with
    ``safeguard = 0`` (the paper's global bottom-k), and so does ``fastkvzip``.

    A prompt fed in chunks (docs/fastkvzip.md, round 8) is pooled after every chunk that
    takes it over the budget: once the chunk has passed every layer, all layers evict at once,
    each head's retained and new entries ranked together, each head bringing to the pool what
    it would hold alone (``min(B, tokens seen)``, a sliding layer its window), so the pool stays
    ``L·H·B``. Where a chunk's pass pads each layer to its longest head, a head keeps at most
    ``⌈cap·B⌉`` entries at those later chunks (``cap = 4``), so that head cannot grow with the
    context: a pass holds at most ``⌈cap·B⌉ + chunk`` columns per layer. Where the passes stay
    packed (:func:`~kvevict.packedpass.chunks_stay_packed`, on a CPU: round 9) a head costs its
    own entries only, and there is no cap unless one is given. A ``cap`` given caps every pooled
    eviction, a one-pass prompt's included. Re-ranking after each
    chunk chooses what one allocation at the end would, for scores that are per-token state
    (Fast KVzip's gates, ``knorm``) up to the hidden states earlier evictions moved; an
    attention scorer (``snapkv``) scores every retained and new entry with the chunk's own
    window, as chunked SnapKV does in each layer, so each pooled eviction still ranks
    scores of one pass. KVzip's pool (a repeat pass over the whole prompt) refuses chunks.

    Comparability: scorers whose scores are attention probabilities (``snapkv``, ``tova``,
    ``h2o``, ``kvzip``, ``expected-attention``: ``comparable_scores``) are ranked as they
    are. Any other scorer (``knorm``'s ``−‖k‖``, positions, variances) is first standardised
    per layer (its free scores' mean 0 and standard deviation 1 over the layer's heads), so a
    layer gains budget where its score distribution has a heavier upper tail, not because its
    scores have another unit. A method that selects by its own rule rather than top scores
    (LagKV's per-chunk quotas, ThinKV, MomentKV's MI loop) is refused.
    """

    name = "global"
    batched = True
    summary = (
        "one budget pool over all layers and heads ranked by the scorer "
        "(floor 0.2·B per head; prefill; padded chunks: a head ≤ 4·B)"
    )
    PARAMS = declare(
        safeguard=number(0.2, 0, 1),
        cap=Param(
            None,
            "a number >= 1, or 0 (no cap)",
            lambda v: is_number(v) and (v == 0 or v >= 1),
            "none in one pass, nor where a chunk's pass stays packed, else 4 (a value given caps every pass)",
            float,
        ),
    )
    across_layers = True

    def check(self, policy: Assembly) -> None:
        method = policy.method.name
        if not policy.selects_by_top_scores:
            raise ValueError(
                f"global ranks scores across layers, and {method} selects by its own rule, not by top scores; "
                "use a scorer (snapkv, knorm, kvzip, expected-attention, ...)"
            )
        if policy.regime != "prefill":
            raise ValueError(
                f"a budget shared across layers is allocated once, at prefill; {method} is set to regime "
                f"{policy.regime!r} (use regime=prefill)"
            )

    def allocate_layers(self, layers: list[EntryView], scores: list[torch.Tensor], comparable: bool) -> None:
        """Store in each layer's memo what its heads keep under one pool ``L·H·B`` (:func:`global_counts`);
        at a later chunk of a prompt fed in chunks, each head brings what it would hold alone
        (:func:`reach`) and keeps at most ``⌈cap·B⌉`` entries."""
        ranked = scores if comparable else [standardize(layer_scores) for layer_scores in scores]
        budget = layers[0].budget
        # a pass of the prompt after its first (the layers were pooled before), or a first chunk some of whose
        # entries the selection leaves out (Policy.selection_scores): each head brings what it would hold alone
        chunked = layers[0].passes > 1 or layers[0].prompt_continues
        reaches = [reach(layer) for layer in layers] if chunked else None
        cap = self.head_cap(layers[0].policy, layers[0].device, chunked)
        cap = math.ceil(cap * budget) if cap else None
        for layer, counts in zip(layers, global_counts(ranked, budget, self.safeguard, reaches, cap)):
            self.memo(layer)["counts"] = counts

    def head_cap(self, policy: Assembly, device: torch.device, chunked: bool) -> float:
        """Budgets one head keeps at most (0: none): :attr:`cap` when given, at every pass; unset,
        none in one pass, and at a later chunk none where the chunks' passes stay packed
        (:func:`~kvevict.packedpass.chunks_stay_packed`, on a CPU: a head that keeps its whole
        context costs its own entries), else :data:`CHUNK_CAP` (each pass pads every layer to its
        longest head)."""
        if self.cap is not None:
            return self.cap
        if not chunked:
            return 0.0
        return 0.0 if device.type == "cpu" and chunks_stay_packed(policy) else CHUNK_CAP

    def counts(
        self, layer: EntryView, scores: torch.Tensor | None, protected: torch.Tensor, budget: int
    ) -> torch.Tensor:
        return self.memo(layer).pop("counts")
