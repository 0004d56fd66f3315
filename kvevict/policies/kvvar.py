"""The KV-vector family of EpiKV (seed 000, §3.3) and LagKV (Liang et al., 2025, "LagKV:
Lag-Relative Information of the KV Cache Tells Which Tokens Are Important"; DESIGN §3).

All of them read only the cached keys and values (post-RoPE keys; the paper finds pre- vs
post-RoPE statistics make no difference), never attention:

* ``kv-key-var`` / ``kv-val-var`` (decode): the variance of a token's key / value vector
  over the head dimension, rolling mean over the trailing 64 tokens, per KV head.
* ``lag-kv`` (decode, causal): each key and value is min-max normalised per channel by the
  range of the *previous* complete chunk of ``lag`` tokens, then the variances are summed and
  smoothed the same way.
* ``lagkv`` (prefill, the original): chunks of ``lag`` tokens after the sinks, normalised by
  the *next* chunk's range; score = softmax within the chunk of the std over the head
  dimension, keys plus values; the top fraction of every chunk is kept.

Decode scores are computed once, when the token enters the cache, and frozen (per-token
state, gathered with the entries); the history they need lives in the layer's ``memo``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvevict.policies.base import Method, Ranking, Selector, SinksAndWindow, Stage, Stages
from kvevict.policies.epikv import EPSILON, ROLLING, rolling_mean
from kvevict.policies.h2o import RECENT_WINDOW
from kvevict.policies.params import declare, integer
from kvevict.policies.selection import PromptKeeping, position_order, select_by_tiers, within_group_rank
from kvevict.signals import Signals

if TYPE_CHECKING:
    from kvevict.views import EntryView

SCORE = "score"
HISTORY = "history"
LAG = 128


def head_variance(x: torch.Tensor) -> torch.Tensor:
    """Population variance over the head dimension, ``[B, H, n, d]`` → ``[B, H, n]`` fp32."""
    return x.float().var(dim=-1, correction=0)


def min_max_normalize(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """``(x − low) / (high − low + ε)`` per channel."""
    return (x - low) / (high - low + EPSILON)


class RollingKVStatistic(PromptKeeping):
    """Base of the decode-time KV-vector policies: a raw per-token statistic of the new
    entries, smoothed by a trailing rolling mean, frozen as per-token state."""

    PARAMS = declare(rolling=integer(ROLLING, low=1), window=RECENT_WINDOW)

    def raw(self, layer: EntryView, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The statistic of the new entries ``[B, H, n, d]`` → ``[B, H, n]`` fp32."""
        raise NotImplementedError

    def new_tokens(self, layer: EntryView, num_new: int) -> dict[str, torch.Tensor]:
        memo = self.memo(layer)
        raw = self.raw(layer, layer.keys[:, :, -num_new:], layer.values[:, :, -num_new:])
        history = memo.get(HISTORY)
        series = raw if history is None else torch.cat([history, raw], dim=-1)
        memo[HISTORY] = series[..., series.shape[-1] - min(series.shape[-1], self.rolling - 1) :].clone()
        return {SCORE: rolling_mean(series, self.rolling)[..., -num_new:]}

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        return self.state(layer)[SCORE]


class KVKeyVariance(RollingKVStatistic):
    """KV-key var: rolling mean (64) of the variance of the key over the head dimension."""

    name = "kv-key-var"
    summary = "keep prompt + recent; rank decode tokens by rolling-mean key variance (EpiKV KV family)"

    def raw(self, layer: EntryView, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return head_variance(keys)


class KVValueVariance(RollingKVStatistic):
    """KV-val var: rolling mean (64) of the variance of the value over the head dimension."""

    name = "kv-val-var"
    summary = "keep prompt + recent; rank decode tokens by rolling-mean value variance (EpiKV KV family)"

    def raw(self, layer: EntryView, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return head_variance(values)


def lag_normalize(x: torch.Tensor, first: int, lag: int, ranges: dict[str, torch.Tensor]) -> torch.Tensor:
    """Causal lag normalisation of the entries at positions ``first, first + 1, ...``
    (``x`` ``[B, H, n, d]``): chunk ``c`` (positions ``c·lag ..``) is normalised per channel by
    the min-max range of chunk ``c − 1``; chunk 0, which has no predecessor, by its own running
    range up to the token. ``ranges`` carries ``previous_low/high`` (the last complete chunk)
    and ``running_low/high`` (the current one) between calls and is updated in place."""
    x = x.float()
    out = torch.empty_like(x)
    start = 0
    while start < x.shape[2]:
        position = first + start
        stop = min(x.shape[2], start + lag - position % lag)  # the end of this chunk in the pass
        part = x[:, :, start:stop]
        low, high = part.cummin(dim=2).values, part.cummax(dim=2).values
        if "running_low" in ranges:
            low = torch.minimum(low, ranges["running_low"][:, :, None])
            high = torch.maximum(high, ranges["running_high"][:, :, None])
        if "previous_low" in ranges:
            out[:, :, start:stop] = min_max_normalize(
                part, ranges["previous_low"][:, :, None], ranges["previous_high"][:, :, None]
            )
        else:
            out[:, :, start:stop] = min_max_normalize(part, low, high)
        # copies, not views: a view would keep the whole pass's cumulative extremes alive
        ranges["running_low"], ranges["running_high"] = low[:, :, -1].clone(), high[:, :, -1].clone()
        if (first + stop) % lag == 0:  # the chunk is complete: it becomes the reference
            ranges["previous_low"], ranges["previous_high"] = ranges.pop("running_low"), ranges.pop("running_high")
        start = stop
    return out


class LagKVDecode(RollingKVStatistic):
    """Lag-KV (decode, causal; seed 000 §3.3): keys and values normalised by the previous
    chunk's per-channel range (:func:`lag_normalize`), score = rolling mean (64) of
    ``var(k̂) + var(v̂)``.

    Args:
        lag: chunk length (128, as LagKV).
    """

    name = "lag-kv"
    summary = "keep prompt + recent; rank by rolling variance of K,V normalised by the previous chunk's range"

    PARAMS = declare(lag=integer(LAG, low=1), **RollingKVStatistic.PARAMS)

    def raw(self, layer: EntryView, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        first = layer.seen - keys.shape[2]
        parts = [
            head_variance(lag_normalize(x, first, self.lag, self.memo(layer).setdefault(name, {})))
            for name, x in (("lag_keys", keys), ("lag_values", values))
        ]
        return parts[0] + parts[1]


def lagkv_chunk_scores(x: torch.Tensor, lag: int) -> torch.Tensor:
    """LagKV's score of the chunks ``[B, H, m·lag, d]`` but the last: each chunk normalised
    by the next chunk's range, std over the head dimension, softmax within the chunk →
    ``[B, H, (m − 1)·lag]``."""
    b, h, n, d = x.shape
    chunks = x.float().reshape(b, h, n // lag, lag, d)
    reference = chunks[:, :, 1:]
    low, high = reference.amin(dim=3, keepdim=True), reference.amax(dim=3, keepdim=True)
    spread = min_max_normalize(chunks[:, :, :-1], low, high).std(dim=-1)
    return spread.softmax(dim=-1).reshape(b, h, -1)


class LagKV(Method):
    """LagKV (prefill; Liang et al., 2025): the prompt after ``sinks`` is cut into chunks of
    ``lag`` tokens; every chunk that has a successor is scored by
    :func:`lagkv_chunk_scores` (keys plus values) and keeps the same share of its entries
    (its top ranks, round-robin over chunks until each head's count is full). Sinks are kept,
    and the tail (the last full chunk, the reference of the one before, plus the partial
    chunk) is kept next, most recent first, as it cannot be scored.

    Stages: no scorer (the ranks are per chunk and do not compare across heads, so ``adakv``
    cannot be named over it; ``pyramidkv`` and ``headkv`` can), the sinks as the protector,
    :class:`ChunkQuotas` as the selector.

    Args:
        lag: chunk length (128). sinks: first tokens kept (4).
    """

    name = "lagkv"
    summary = "prefill: per-chunk top share by std of K,V normalised by the next chunk's range (LagKV)"
    regimes = ("prefill",)
    PARAMS = declare(lag=integer(LAG, low=1), sinks=integer(4))

    def stages(self) -> Stages:
        return Stages(scorer=None, protector=SinksAndWindow(self.sinks), selector=ChunkQuotas(self.lag, self.sinks))

    def clash_advice(self, stage: Stage) -> str:
        return "lagkv selects by its own chunk quotas: use it alone or under pyramidkv or headkv"


class ChunkQuotas(Selector):
    """LagKV's selection: sinks, then the unscored tail (most recent first), then the chunks'
    entries round-robin by their rank inside the chunk (the score breaks ties). Chunks are
    runs of ``lag`` entries in position order (:func:`position_order`: after an eviction the
    cache refills slots, so storage order is not position order)."""

    name = "lagkv-quotas"

    def __init__(self, lag: int, sinks: int):
        super().__init__()
        self.lag, self.sinks = lag, sinks

    def keep(self, layer: EntryView, signals: Signals, ranking: Ranking) -> torch.Tensor:
        order = position_order(layer.positions, layer.valid)
        keys, values = (x.gather(2, order[..., None].expand_as(x)) for x in (layer.keys, layer.values))
        valid = None if layer.valid is None else layer.valid.gather(-1, order)
        kept = self.keep_in_order(keys, values, valid, ranking.counts)
        return torch.empty_like(kept).scatter_(-1, order, kept)

    def keep_in_order(
        self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None, counts: torch.Tensor
    ) -> torch.Tensor:
        """The keep mask of entries stored in position order (``keys``/``values`` ``[B, H, n, d]``)."""
        n = keys.shape[2]
        chunks = max(0, (n - self.sinks) // self.lag)
        end = self.sinks + max(0, chunks - 1) * self.lag  # scored entries: sinks .. end
        positions = torch.arange(n, device=keys.device).expand(keys.shape[:3])
        tiers = torch.where(positions < self.sinks, 3, 2).expand_as(positions).clone()
        ranks = positions.float() / n  # the tail: most recent first
        if chunks >= 2:
            span = slice(self.sinks, self.sinks + chunks * self.lag)
            score = lagkv_chunk_scores(keys[:, :, span], self.lag) + lagkv_chunk_scores(values[:, :, span], self.lag)
            chunk = (positions[..., self.sinks : end] - self.sinks) // self.lag
            tiers[..., self.sinks : end] = 1
            # round-robin over chunks: rank inside the chunk first, the score breaks ties (< 1)
            ranks[..., self.sinks : end] = -within_group_rank(chunk, score).float() + score / 4
        return select_by_tiers(tiers, ranks, counts, valid)
