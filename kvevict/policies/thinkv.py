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

from kvevict.policies.base import Ranking, Scorer, Selector, SinksAndWindow, Stage, Stages
from kvevict.policies.epikv import EpiKV
from kvevict.policies.h2o import GROUP, RECENT_WINDOW, CumulativeAttention
from kvevict.policies.params import Param, declare, integer, is_integer
from kvevict.policies.selection import select_by_tiers, within_group_rank
from kvevict.signals import Phase, Regime, Requirements, Signals

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvevict.views import EntryView

SEGMENT = 128
QUOTAS = {"E": 32, "R": 64, "T": 8}
CLASSES = ("E", "R", "T")
"""Classes by increasing attention entropy (thirds)."""
ENTROPY_LAYERS = 4
ENTROPY = "entropy"
SEGMENTS = "segments"
SEGMENT_ENTROPY = "segment_entropy"


def attention_entropy(rows: torch.Tensor) -> torch.Tensor:
    """Entropy of attention rows ``[B, Hq, n]`` averaged over the query heads → ``[B]``."""
    return torch.special.entr(rows.float()).sum(dim=-1).mean(dim=1)


def classify_by_thirds(entropies: torch.Tensor) -> list[str]:
    """Class of each segment by the tertiles of ``entropies`` ``[m]``: below the first → E,
    above the second → T, else R (a single segment is R)."""
    low, high = torch.quantile(entropies.double(), torch.tensor([1 / 3, 2 / 3], dtype=torch.double))
    return ["E" if e < low else "T" if e > high else "R" for e in entropies.double().tolist()]


QUOTAS_PARAM = Param(
    QUOTAS,
    "a mapping with an integer >= 0 for each of R, E, T",
    lambda v: isinstance(v, dict) and set(v) == set(CLASSES) and all(is_integer(q) and q >= 0 for q in v.values()),
    convert=dict,
)
SEGMENT_PARAMS = declare(
    segment=integer(SEGMENT, low=1),
    quotas=QUOTAS_PARAM,
    entropy_layers=integer(ENTROPY_LAYERS, low=1),
)


class SegmentQuotas(Selector):
    """ThinKV's selection (see the module docstring): the recent window first (the protected
    entries), then segments not classified yet, then each classified segment's quota of its
    entries ranked best by ``scorer``'s score, then the rest, up to each head's count. Reads
    the last query's attention of every pass for the entropy that classifies the segments."""

    name = "thinkv-quotas"

    def __init__(self, scorer: Scorer, segment: int, quotas: dict[str, int], entropy_layers: int):
        super().__init__()
        self.scorer = scorer
        """The method's scorer: its own scores, recent entries included, rank within a segment."""
        self.segment, self.quotas, self.entropy_layers = segment, quotas, entropy_layers
        self._first_entropy_layer = 0

    def bind(self, config: PretrainedConfig) -> None:
        self._first_entropy_layer = max(0, config.num_hidden_layers - self.entropy_layers)

    def requirements(self, phase: Phase, evicting: bool, regime: Regime) -> Requirements:
        return Requirements(last_query_attention=True)

    def observe(self, layer: EntryView, signals: Signals) -> None:
        if layer.layer_idx >= self._first_entropy_layer:
            entropy = attention_entropy(signals.last_query_attention)[0].item()
            sums = self.shared(layer.owner).setdefault(ENTROPY, {})
            for position in range(layer.seen - signals.num_new, layer.seen):
                total, count = sums.get(position, (0.0, 0))
                sums[position] = (total + entropy, count + 1)

    def segment_classes(self, layer: EntryView) -> dict[int, str]:
        """Classes of the segments complete in every entropy layer (classified once, frozen)."""
        shared = self.shared(layer.owner)
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

    def keep(self, layer: EntryView, signals: Signals, ranking: Ranking) -> torch.Tensor:
        classes = self.segment_classes(layer)
        segment = torch.div(layer.positions, self.segment, rounding_mode="floor")
        quota = torch.tensor(
            [self.quotas[classes[s]] if s in classes else -1 for s in range(int(segment.max()) + 1)],
            device=segment.device,
        )[segment]
        values = self.scorer.score(layer, signals).float()
        if layer.valid is not None:  # padding ranks below every real entry of its segment
            values = values.masked_fill(~layer.valid, float("-inf"))
        in_quota = within_group_rank(segment, values, layer.positions) < quota
        tiers = torch.where(quota < 0, 2, torch.where(in_quota, 1, 0))
        tiers = torch.where(ranking.protected, 3, tiers)
        return select_by_tiers(tiers, values, ranking.counts, layer.valid, layer.positions)


def segment_stages(method: ThinKV | SegmentHS) -> Stages:
    """The stages of the segment methods: the method's score, the recent window, the quotas."""
    return Stages(
        scorer=method,
        protector=SinksAndWindow(0, method.window),
        selector=SegmentQuotas(method, method.segment, method.quotas, method.entropy_layers),
    )


class ThinKV(CumulativeAttention):
    """ThinKV (attention-requiring, decode): thought segments classified R/E/T by attention
    entropy, per-segment quotas R 64 / E 32 / T 8 ranked by cumulative attention, recent
    ``min(128, K/4)`` kept (see the module docstring for the exact rules).

    Stages: cumulative attention (H2O's, GQA ``group``) as the scorer, the recent window as the
    protector, :class:`SegmentQuotas` as the selector (any allocator may set the counts).

    Args:
        segment: segment length (128). quotas: ``{"R": 64, "E": 32, "T": 8}``.
        entropy_layers: the last layers whose entropy classifies (4).
        window: recent tokens kept (None: ``min(128, budget // 4)``).
    """

    name = "thinkv"
    summary = "segments classified R/E/T by attention entropy; per-segment quotas 64/32/8 by attention (ThinKV)"
    regimes = ("decode",)
    PARAMS = declare(window=RECENT_WINDOW, group=GROUP, **SEGMENT_PARAMS)

    def stages(self) -> Stages:
        return segment_stages(self)

    def clash_advice(self, stage: Stage) -> str:
        return f"{self.name} selects by its own segment quotas: use it alone or under an allocator"


class SegmentHS(EpiKV):
    """Segment-HS, seed 000's segment hybrid: ThinKV's segments, classes and quotas, with the
    entries of a segment ranked by the EpiKV score ``z_A − z_B`` instead of attention
    (attention is still read for the entropy that classifies the segments).

    Args: as :class:`ThinKV`, plus ``layers``/``rolling`` of :class:`~kvevict.policies.epikv.EpiKV`.
    """

    name = "segment-hs"
    summary = "ThinKV segments and quotas, entries ranked by the EpiKV hidden-state score (hybrid)"
    PARAMS = declare(**EpiKV.PARAMS, **SEGMENT_PARAMS)

    stages = segment_stages
    clash_advice = ThinKV.clash_advice
