"""ThinKV (Ramachandran et al., 2026, "ThinKV: Thought-Adaptive KV Cache Compression for
Efficient Reasoning Models") as specified by DESIGN §3, and seed 000's Segment-HS hybrid.

* The sequence is cut into segments of 128 absolute positions.
* Every token gets the entropy of the attention of its own query: the last query's row,
  mean over the query heads, mean over the last 4 layers (a prompt, processed in one pass,
  gets the entropy of its last query for all its tokens). Shared by every layer through the
  cache (``cache.shared``).
* A segment is classified once all its tokens passed those layers, then frozen: by the
  thirds (tertiles) of the mean entropies of every segment classified so far, the lowest
  third is E (execution, sparse attention), the middle R (reasoning), the highest T
  (transition). Quotas per segment: R 64, E 32, T 8, ranked within the segment by cumulative
  attention (H2O's, GQA mean).
* Recent ``min(128, K/4)`` kept; segments not classified yet (ThinKV's refresh window) come
  next, then the in-quota entries, then the rest. Unlike ThinKV, which may retain fewer than
  ``K``, the budget is filled from the out-of-quota entries by the same ranking, so every KV
  head holds the same number of entries.

Segment-HS ranks entries inside the segments by the EpiKV score instead of attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvevict.policies.epikv import EpiKV
from kvevict.policies.h2o import ACCUMULATED, H2O
from kvevict.policies.selection import select_by_tiers, within_group_rank
from kvevict.signals import Phase, Regime, Requirements, Signals

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvevict.cache import EvictionLayer

SEGMENT = 128
QUOTAS = {"E": 32, "R": 64, "T": 8}
CLASSES = ("E", "R", "T")
"""Classes by increasing attention entropy (thirds)."""
ENTROPY_LAYERS = 4
ENTROPY = "thinkv_entropy"
SEGMENTS = "thinkv_segments"
SEGMENT_ENTROPY = "thinkv_segment_entropy"


def attention_entropy(rows: torch.Tensor) -> torch.Tensor:
    """Entropy of attention rows ``[B, Hq, n]`` averaged over the query heads → ``[B]``."""
    return torch.special.entr(rows.float()).sum(dim=-1).mean(dim=1)


def classify_by_thirds(entropies: torch.Tensor) -> list[str]:
    """Class of each segment by the tertiles of ``entropies`` ``[m]``: below the first → E,
    above the second → T, else R (a single segment is R)."""
    low, high = torch.quantile(entropies.double(), torch.tensor([1 / 3, 2 / 3], dtype=torch.double))
    return ["E" if e < low else "T" if e > high else "R" for e in entropies.double().tolist()]


class ThinKV(H2O):
    """ThinKV (attention-requiring, decode): thought segments classified R/E/T by attention
    entropy, per-segment quotas R 64 / E 32 / T 8 ranked by cumulative attention, recent
    ``min(128, K/4)`` kept (see the module docstring for the exact rules).

    Args:
        segment: segment length (128). quotas: ``{"R": 64, "E": 32, "T": 8}``.
        entropy_layers: the last layers whose entropy classifies (4).
        window: recent tokens kept (None: ``min(128, budget // 4)``).
    """

    name = "thinkv"
    summary = "segments classified R/E/T by attention entropy; per-segment quotas 64/32/8 by attention (ThinKV)"
    regimes = ("decode",)

    def __init__(
        self,
        *,
        segment: int = SEGMENT,
        quotas: dict[str, int] | None = None,
        entropy_layers: int = ENTROPY_LAYERS,
        window: int | None = None,
        regime: Regime | None = None,
    ):
        quotas = dict(QUOTAS if quotas is None else quotas)
        if set(quotas) != set(CLASSES) or any(not isinstance(v, int) or v < 0 for v in quotas.values()):
            raise ValueError(f"{self.name}: quotas must give an integer >= 0 for each of R, E, T, got {quotas!r}")
        for label, value in (("segment", segment), ("entropy_layers", entropy_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {label} must be an integer >= 1, got {value!r}")
        super().__init__(sinks=0, window=window, regime=regime)
        self.segment = segment
        self.quotas = quotas
        self.entropy_layers = entropy_layers
        self._first_entropy_layer = 0

    def bind(self, config: PretrainedConfig) -> None:
        self._first_entropy_layer = max(0, config.num_hidden_layers - self.entropy_layers)

    def requirements(self, phase: Phase, evicting: bool) -> Requirements:
        return Requirements(column_sums=True, last_query_attention=True)

    def observe(self, layer: EvictionLayer, signals: Signals) -> None:
        super().observe(layer, signals)
        if layer.layer_idx >= self._first_entropy_layer:
            entropy = attention_entropy(signals.last_query_attention)[0].item()
            sums = layer.owner.shared.setdefault(ENTROPY, {})
            for position in range(layer.seen - signals.num_new, layer.seen):
                total, count = sums.get(position, (0.0, 0))
                sums[position] = (total + entropy, count + 1)

    def segment_classes(self, layer: EvictionLayer) -> dict[int, str]:
        """Classes of the segments complete in every entropy layer (classified once, frozen)."""
        shared = layer.owner.shared
        sums: dict[int, tuple[float, int]] = shared.setdefault(ENTROPY, {})
        classes: dict[int, str] = shared.setdefault(SEGMENTS, {})
        means: list[float] = shared.setdefault(SEGMENT_ENTROPY, [])
        needed = sum(1 for other in layer.owner.eviction_layers if other.layer_idx >= self._first_entropy_layer)
        while True:
            index = len(classes)
            members = range(index * self.segment, (index + 1) * self.segment)
            if any(sums.get(p, (0.0, 0))[1] < needed for p in members):
                return classes
            means.append(sum(sums[p][0] / sums[p][1] for p in members) / self.segment)
            classes[index] = classify_by_thirds(torch.tensor(means))[-1]
            for p in members:  # classified: the per-token entropies are no longer needed
                del sums[p]

    def rank_values(self, layer: EvictionLayer) -> torch.Tensor:
        """What ranks the entries inside a segment (higher kept): cumulative attention."""
        return layer.state[ACCUMULATED]

    def select(self, layer: EvictionLayer, signals: Signals, budget: int) -> torch.Tensor:
        classes = self.segment_classes(layer)
        values = self.rank_values(layer).float()
        segment = torch.div(layer.positions, self.segment, rounding_mode="floor")
        quota = torch.tensor(
            [self.quotas[classes[s]] if s in classes else -1 for s in range(int(segment.max()) + 1)],
            device=segment.device,
        )[segment]
        in_quota = within_group_rank(segment, values) < quota
        tiers = torch.where(quota < 0, 2, torch.where(in_quota, 1, 0))
        tiers = torch.where(layer.positions >= layer.seen - self.recent_window(budget), 3, tiers)
        return select_by_tiers(tiers, values, budget)


class SegmentHS(ThinKV):
    """Segment-HS, seed 000's segment hybrid: ThinKV's segments, classes and quotas, with the
    entries of a segment ranked by the EpiKV score ``z_A − z_B`` instead of attention
    (attention is still read for the entropy that classifies the segments).

    Args: as :class:`ThinKV`, plus ``layers``/``rolling`` of :class:`~kvevict.policies.epikv.EpiKV`.
    """

    name = "segment-hs"
    summary = "ThinKV segments and quotas, entries ranked by the EpiKV hidden-state score (hybrid)"

    def __init__(self, *, layers: tuple[int, int] | None = None, rolling: int = 64, **thinkv: object):
        super().__init__(**thinkv)
        self._epikv = EpiKV(layers=layers, rolling=rolling)
        self.layers = layers
        self.rolling = rolling

    @property
    def hidden_context(self) -> int:
        return self._epikv.hidden_context

    def bind(self, config: PretrainedConfig) -> None:
        super().bind(config)
        self._epikv.bind(config)

    def hidden_layers(self, num_layers: int) -> tuple[int, ...]:
        return self._epikv.hidden_layers(num_layers)

    def hidden_scores(self, changes: dict[int, torch.Tensor]) -> torch.Tensor:
        return self._epikv.hidden_scores(changes)

    def rank_values(self, layer: EvictionLayer) -> torch.Tensor:
        return layer.owner.hidden.lookup(layer.positions)
