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

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn.functional import pad

from kvevict.policies.base import Ranking, Scorer, Selector, SinksAndWindow, Stage, Stages
from kvevict.policies.epikv import EpiKV
from kvevict.policies.h2o import GROUP, CumulativeAttention
from kvevict.policies.params import RECENT_WINDOW, Param, declare, integer, is_integer
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
QUOTA = "quota"


def attention_entropy(rows: torch.Tensor) -> torch.Tensor:
    """Entropy of attention rows ``[B, Hq, n]`` averaged over the query heads → ``[B]``."""
    return torch.special.entr(rows.float()).sum(dim=-1).mean(dim=1)


def classify_by_thirds(entropies: torch.Tensor) -> list[str]:
    """Class of each segment by the tertiles of ``entropies`` ``[m]``: below the first → E,
    above the second → T, else R (a single segment is R)."""
    low, high = torch.quantile(entropies.double(), torch.tensor([1 / 3, 2 / 3], dtype=torch.double))
    return ["E" if e < low else "T" if e > high else "R" for e in entropies.double().tolist()]


def drop_one_by_quotas(
    segment: torch.Tensor, quota: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, ranking: Ranking
) -> torch.Tensor | None:
    """The keep mask of an eviction that drops at most one entry per head (a decode step):
    :func:`first_out_by_quotas`'s entry dropped in each head over its count. None when more
    than one entry is over a count, or that entry needs the sort."""
    drop = (values.shape[-1] - ranking.counts).clamp(min=0)
    if int(drop.max()) != 1:
        return None
    slot = first_out_by_quotas(segment, quota, values, positions, ranking.protected)
    if slot is None:
        return None
    return torch.ones_like(ranking.protected).scatter_(-1, slot[..., None], drop[..., None] == 0)


def first_out_by_quotas(
    segment: torch.Tensor, quota: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, protected: torch.Tensor
) -> torch.Tensor | None:
    """The entry ``[B, Hkv]`` of each head that :func:`within_group_rank` and
    :func:`select_by_tiers` drop first (tiers: protected 3, not classified 2, in quota 1, out
    of quota 0; then the lower value, then the earlier position goes first), found without
    sorting. None when a value is NaN, or for a tie this shortcut cannot order (then the
    caller sorts).

    Why it is the same entry. In each classified segment ``s`` take ``a_s``, its candidate
    (not protected) with the lowest value, the earliest of those tied. Every out-of-quota
    candidate of ``s`` is at or after ``a_s`` in the dropping order, so if ``s`` has any,
    ``a_s`` is the first of them to go, and ``a_s`` is out of quota iff its rank in ``s`` (the
    entries before it by value, descending, then position) reaches the quota. If ``a_s`` is in
    quota and no other entry of ``s`` ties its value, every other candidate ranks before it,
    so in quota too (a tie is left to the sort). Labelling only these ``a_s`` tier 0 and the
    other classified candidates tier 1 therefore drops what the full ranking drops."""
    if bool(values.isnan().any()):
        return None
    inf = torch.tensor(float("inf"), device=values.device)
    candidate = ~protected & (quota >= 0)
    bins = int(segment.max()) + 1
    per_segment = quota.new_zeros(*segment.shape[:-1], bins)
    lowest = per_segment.float().fill_(float("inf"))
    lowest = lowest.scatter_reduce(-1, segment, torch.where(candidate, values, inf), "amin")
    lowest_value = lowest.gather(-1, segment)
    at_lowest = candidate & (values == lowest_value)
    last = torch.iinfo(torch.long).max
    earliest = per_segment.fill_(last).scatter_reduce(-1, segment, positions.masked_fill(~at_lowest, last), "amin")
    earliest_position = earliest.gather(-1, segment)
    first_to_go = at_lowest & (positions == earliest_position)  # a_s, one per segment with a candidate
    tied = values == lowest_value
    before = (values > lowest_value) | (tied & (positions < earliest_position))
    rank = torch.zeros_like(earliest).scatter_add_(-1, segment, before.long()).gather(-1, segment)
    ties = torch.zeros_like(earliest).scatter_add_(-1, segment, tied.long()).gather(-1, segment)
    out_of_quota = rank >= quota
    if bool((first_to_go & ~out_of_quota & (ties > 1)).any()):
        return None
    tiers = torch.where(protected, 3, torch.where(quota < 0, 2, torch.where(first_to_go & out_of_quota, 0, 1)))
    lowest_tier = tiers == tiers.amin(dim=-1, keepdim=True)
    value = torch.where(lowest_tier, values, inf).amin(dim=-1, keepdim=True)
    going = lowest_tier & (values == value)
    return positions.masked_fill(~going, last).argmin(dim=-1)


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


@dataclass
class EntropySums:
    """ThinKV's entropy bookkeeping of a row (rows along dim 0, so rows in lockstep read it
    stacked, :class:`~kvevict.rows.StackedRows`). A token's entropy is the mean over the
    entropy layers of its pass's entropy (one value per layer for every token of a pass), a
    segment's the mean of its tokens', summed in position order as each pass leaves the last
    entropy layer (the same floating-point sums, in the same order, as per token)."""

    layers: torch.Tensor
    """``[B]`` float64: the current pass's entropy summed over the entropy layers it passed."""
    tokens: torch.Tensor
    """``[B, S]`` float64: per segment, its tokens' mean entropies summed so far."""
    means: torch.Tensor
    """``[B, S]`` float32: the mean entropy of each classified segment."""
    classified: torch.Tensor
    """``[B]`` int64: segments classified (the first ones: a segment completes after the earlier)."""

    @staticmethod
    def empty(rows: int, segments: int, device: torch.device) -> EntropySums:
        zeros = torch.zeros(rows, segments, dtype=torch.float64, device=device)
        return EntropySums(
            torch.zeros(rows, dtype=torch.float64, device=device),
            zeros,
            zeros.float(),
            torch.zeros(rows, dtype=torch.long, device=device),
        )

    def grown(self, segments: int) -> EntropySums:
        """The same sums with room for ``segments`` segments."""
        more = segments - self.tokens.shape[1]
        return EntropySums(self.layers, pad(self.tokens, (0, more)), pad(self.means, (0, more)), self.classified)


class SegmentQuotas(Selector):
    """ThinKV's selection (see the module docstring): the recent window first (the protected
    entries), then segments not classified yet, then each classified segment's quota of its
    entries ranked best by ``scorer``'s score, then the rest, up to each head's count. Reads
    the last query's attention of every pass for the entropy that classifies the segments.

    Per row it keeps :class:`EntropySums` and each segment's quota (``[B, S]``, -1 while not
    classified), with room for the model's context (``max_position_embeddings``), grown
    when a row outgrows it (rows then run in lockstep only if they grew alike)."""

    name = "thinkv-quotas"
    batched = True
    stacks = True  # keep and drop_one read positions, the scorer's scores and the per-row quota table

    def __init__(self, scorer: Scorer, segment: int, quotas: dict[str, int], entropy_layers: int):
        super().__init__()
        self.scorer = scorer
        """The method's scorer: its own scores, recent entries included, rank within a segment."""
        self.segment, self.quotas, self.entropy_layers = segment, quotas, entropy_layers
        self._first_entropy_layer = 0
        self._context = 0

    def bind(self, config: PretrainedConfig) -> None:
        self._first_entropy_layer = max(0, config.num_hidden_layers - self.entropy_layers)
        self._context = getattr(config, "max_position_embeddings", 0) or 0

    def requirements(self, phase: Phase, evicting: bool, regime: Regime) -> Requirements:
        return Requirements(last_query_attention=True)

    def observe(self, layer: EntryView, signals: Signals) -> None:
        if layer.layer_idx < self._first_entropy_layer:
            return
        entropy_layers = [
            other.layer_idx for other in layer.owner.eviction_layers if other.layer_idx >= self._first_entropy_layer
        ]
        shared = self.shared(layer.owner)
        sums: EntropySums | None = shared.get(ENTROPY)
        if sums is None:
            rows, device = layer.positions.shape[0], layer.positions.device
            sums = EntropySums.empty(rows, -(-self._context // self.segment), device)
            shared[QUOTA] = torch.full((rows, sums.tokens.shape[1]), -1, dtype=torch.long, device=device)
        entropy = attention_entropy(signals.last_query_attention).double()
        sums.layers = entropy if layer.layer_idx == entropy_layers[0] else sums.layers + entropy
        if layer.layer_idx == entropy_layers[-1]:  # the pass's tokens have every layer's entropy
            sums = self.room(shared, sums, layer.seen)
            self.add_tokens(sums, sums.layers / len(entropy_layers), layer.seen, layer.num_new)
            self.classify(shared, sums, layer.seen, layer.num_new)
        shared[ENTROPY] = sums

    def room(self, shared: MutableMapping, sums: EntropySums, seen: int | torch.Tensor) -> EntropySums:
        """``sums`` (and the quotas) with room for the segment of every position before ``seen``."""
        held, needed = sums.tokens.shape[1], -(-int(torch.as_tensor(seen).max()) // self.segment)
        if needed <= held:
            return sums
        segments = max(needed, 2 * held)
        shared[QUOTA] = pad(shared[QUOTA], (0, segments - held), value=-1)
        return sums.grown(segments)

    def add_tokens(self, sums: EntropySums, mean: torch.Tensor, seen: int | torch.Tensor, num_new: int) -> None:
        """Add the pass's ``num_new`` tokens, each of entropy ``mean`` ``[B]``, to their
        segments' sums, one by one in position order (never in place: the sums may have been
        made under ``inference_mode``, and this pass may run outside it)."""
        ends = torch.as_tensor(seen, device=mean.device).reshape(-1).expand(mean.shape[0])
        if num_new == 1:  # a decode step: one token per row, one sum each
            segment = torch.div(ends - 1, self.segment, rounding_mode="floor")
            sums.tokens = sums.tokens.scatter_add(1, segment[:, None], mean[:, None])
            return
        tokens = sums.tokens.clone()
        for row, (end, value) in enumerate(zip(ends.tolist(), mean.tolist(), strict=True)):  # a prompt or chunk
            for segment in range((end - num_new) // self.segment, -(-end // self.segment)):
                total = float(tokens[row, segment])
                for _ in range(max(end - num_new, segment * self.segment), min(end, (segment + 1) * self.segment)):
                    total += value
                tokens[row, segment] = total
        sums.tokens = tokens

    def classify(self, shared: MutableMapping, sums: EntropySums, seen: int | torch.Tensor, num_new: int) -> None:
        """Classify the segments the pass completed (every token in every entropy layer):
        by the thirds of the means of every segment classified so far, then frozen."""
        seen = torch.as_tensor(seen).reshape(-1)
        if not bool((seen // self.segment > (seen - num_new) // self.segment).any()):
            return  # usually: no segment completed (one check per pass, in its last entropy layer)
        quota, means = shared[QUOTA].clone(), sums.means.clone()
        complete = (seen // self.segment).expand(sums.classified.shape[0]).tolist()
        for row, (done, count) in enumerate(zip(complete, sums.classified.tolist(), strict=True)):
            for index in range(count, done):
                means[row, index] = sums.tokens[row, index] / self.segment
                quota[row, index] = self.quotas[classify_by_thirds(means[row, : index + 1])[-1]]
        sums.means = means
        sums.classified = torch.tensor(complete, device=sums.classified.device).maximum(sums.classified)
        shared[QUOTA] = quota

    def segment_quotas(self, layer: EntryView, segment: torch.Tensor) -> torch.Tensor:
        """The quota of each entry's segment ``[B, Hkv, n]`` (-1: not classified yet)."""
        table = self.shared(layer.owner).get(QUOTA)
        if table is None:
            return torch.full_like(segment, -1)
        table = pad(table, (0, 1), value=-1)  # the segments past the table are not classified
        if segment.shape[0] != table.shape[0]:  # a LayerStack: the batch's rows once per layer, layer after layer
            table = table.repeat(segment.shape[0] // table.shape[0], 1)
        index = segment.clamp(min=0, max=table.shape[1] - 1).flatten(1)
        return table.gather(1, index).view_as(segment)

    def keep(self, layer: EntryView, signals: Signals, ranking: Ranking) -> torch.Tensor:
        segment = torch.div(layer.positions, self.segment, rounding_mode="floor")
        quota = self.segment_quotas(layer, segment)
        values = self.scorer.score(layer, signals).float()
        if layer.valid is None:
            keep = drop_one_by_quotas(segment, quota, values, layer.positions, ranking)
            if keep is not None:
                return keep
        if layer.valid is not None:  # padding ranks below every real entry of its segment
            values = values.masked_fill(~layer.valid, float("-inf"))
        in_quota = within_group_rank(segment, values, layer.positions) < quota
        tiers = torch.where(quota < 0, 2, torch.where(in_quota, 1, 0))
        tiers = torch.where(ranking.protected, 3, tiers)
        return select_by_tiers(tiers, values, ranking.counts, layer.valid, layer.positions)

    def drop_one(self, layer: EntryView, signals: Signals, ranking: Ranking) -> torch.Tensor | None:
        segment = torch.div(layer.positions, self.segment, rounding_mode="floor")
        values = self.scorer.score(layer, signals).float()
        return first_out_by_quotas(
            segment, self.segment_quotas(layer, segment), values, layer.positions, ranking.protected
        )


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
    batched = True
    stackable = True  # its hooks are cumulative attention's (H2O's): the state it accumulated
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
    batched = True
    stackable = True  # its hooks are EpiKV's: the frozen hidden-state scores
    summary = "ThinKV segments and quotas, entries ranked by the EpiKV hidden-state score (hybrid)"
    PARAMS = declare(**EpiKV.PARAMS, **SEGMENT_PARAMS)

    stages = segment_stages
    clash_advice = ThinKV.clash_advice
