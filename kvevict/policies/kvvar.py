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
state, gathered with the entries); the history they need lives in the layer's ``memo``, per
row, as tensors of the same shape in every row (a fixed-length history, Lag-KV's ranges), so
the rows of a batch in lockstep run each hook once over all of them, each row getting bit for
bit what it gets alone (issue 37).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from kvevict.policies.base import Method, Ranking, Selector, SinksAndWindow, Stage, Stages
from kvevict.policies.epikv import EPSILON, ROLLING, rolling_mean
from kvevict.policies.params import RECENT_WINDOW, declare, integer
from kvevict.policies.selection import PromptKeeping, position_order, select_by_tiers, within_group_rank
from kvevict.signals import Signals, new_entries

if TYPE_CHECKING:
    from kvevict.views import EntryView

SCORE = "score"
HISTORY = "history"
RANGES = "ranges"
LAG = 128


def head_variance(x: torch.Tensor) -> torch.Tensor:
    """Population variance over the head dimension, ``[B, H, n, d]`` → ``[B, H, n]`` fp32."""
    return x.float().var(dim=-1, correction=0)


def min_max_normalize(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """``(x − low) / (high − low + ε)`` per channel."""
    return (x - low) / (high - low + EPSILON)


class RollingKVStatistic(PromptKeeping):
    """Base of the decode-time KV-vector policies: a raw per-token statistic of the new
    entries, smoothed by a trailing rolling mean, frozen as per-token state.

    The history of the rolling mean is each row's last ``rolling − 1`` raw values, ``[B, H,
    rolling − 1]`` in ``memo``, zeros standing in for values before the row's first token (a
    row that has seen fewer tokens holds fewer real ones): every row keeps the same shape, so
    rows in lockstep run at once (:attr:`~kvevict.policies.base.Stage.batched`), and the window
    of a token counts only the real values, ``min(p + 1, rolling)`` at position ``p``
    (:func:`~kvevict.policies.epikv.rolling_mean` with ``end``): the means of the row alone."""

    PARAMS = declare(rolling=integer(ROLLING, low=1), window=RECENT_WINDOW)

    def raw(self, layer: EntryView, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The statistic of the new entries ``[B, H, n, d]`` → ``[B, H, n]`` fp32."""
        raise NotImplementedError

    def new_tokens(self, layer: EntryView, num_new: int) -> dict[str, torch.Tensor]:
        memo = self.memo(layer)
        keys, values = (new_entries(x, num_new, layer.new_columns) for x in (layer.keys, layer.values))
        raw = self.raw(layer, keys, values)
        history = memo.get(HISTORY)
        if history is None:
            history = raw.new_zeros(*raw.shape[:2], self.rolling - 1)
        series = torch.cat([history, raw], dim=-1)
        history = series[..., num_new:]
        memo[HISTORY] = history.clone() if num_new > 1 else history  # a view would keep the whole pass alive
        return {SCORE: rolling_mean(series, self.rolling, end=layer.seen)[..., -num_new:]}

    def score(self, layer: EntryView, signals: Signals) -> torch.Tensor:
        return self.state(layer)[SCORE]


class KVKeyVariance(RollingKVStatistic):
    """KV-key var: rolling mean (64) of the variance of the key over the head dimension."""

    name = "kv-key-var"
    summary = "keep prompt + recent; rank decode tokens by rolling-mean key variance (EpiKV KV family)"
    batched = True

    def raw(self, layer: EntryView, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return head_variance(keys)


class KVValueVariance(RollingKVStatistic):
    """KV-val var: rolling mean (64) of the variance of the value over the head dimension."""

    name = "kv-val-var"
    summary = "keep prompt + recent; rank decode tokens by rolling-mean value variance (EpiKV KV family)"
    batched = True

    def raw(self, layer: EntryView, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return head_variance(values)


def empty_ranges(x: torch.Tensor) -> torch.Tensor:
    """The ranges :func:`lag_normalize` starts from, for entries ``x`` ``[B, H, n, d]``: no chunk seen yet."""
    inf = torch.full((x.shape[0], 1, x.shape[1], x.shape[3]), float("inf"), device=x.device)
    return torch.cat([inf, -inf, inf, -inf], dim=1)


def lag_segments(first: int | torch.Tensor, n: int, lag: int) -> list[tuple[int, int]]:
    """The pass's entries ``0 .. n`` cut wherever a row's position (``first + i``; ``first``
    an int or ``[B, 1, 1]`` per row) starts a chunk of ``lag``: within a segment every row's
    entries lie in one chunk of its own."""
    firsts = [first] if isinstance(first, int) else [] if n == 1 else first.flatten().tolist()
    cuts = {0, n, *(cut for start in firsts for cut in range(-start % lag, n, lag))}
    return list(itertools.pairwise(sorted(cuts)))


def _either(condition: bool | torch.Tensor, if_true: torch.Tensor, if_false: torch.Tensor) -> torch.Tensor:
    """``if_true`` where ``condition`` (a bool, or per row ``[B, 1, ...]``) holds, else ``if_false``."""
    if isinstance(condition, bool):
        return if_true if condition else if_false
    return torch.where(condition, if_true, if_false)


def _emptied(condition: bool | torch.Tensor, running: torch.Tensor, fill: float) -> torch.Tensor:
    """``running`` with the rows where ``condition`` holds (a bool, or ``[B, 1, 1]``) set to ``fill``."""
    if isinstance(condition, bool):
        return torch.full_like(running, fill) if condition else running
    return running.masked_fill(condition, fill)


def lag_normalize(
    x: torch.Tensor, first: int | torch.Tensor, lag: int, ranges: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal lag normalisation (seed 000 §3.3, LagKV made causal) of the entries at positions
    ``first, first + 1, ...`` (``x`` ``[B, H, n, d]``; ``first`` an int, or ``[B, 1, 1]`` per
    row): chunk ``c`` (positions ``c·lag ..``) is normalised per channel by the min-max range of
    chunk ``c − 1``; chunk 0, which has no predecessor, by its own running range up to the
    token.

    ``ranges`` ``[B, 4, H, d]`` fp32, what the previous call returned (None: the first call, at
    position 0): per channel, the range of the last complete chunk (low, high; read only once a
    chunk is complete) and of the current chunk so far (low, high; ``+inf``, ``−inf`` while it
    is empty, so taking the minimum or maximum with them changes nothing). One tensor with the
    rows along dim 0, so rows in lockstep read them stacked
    (:class:`~kvevict.rows.StackedRows`) at the cost of one concatenation.

    Returns the normalised entries (fp32) and the ranges after them. Minima and maxima are
    exact, so any cut of the entries into calls, or of a call into segments, gives the same
    result bit for bit."""
    x = x.float()
    previous_low, previous_high, running_low, running_high = (empty_ranges(x) if ranges is None else ranges).unbind(1)
    parts = []
    for start, stop in lag_segments(first, x.shape[2], lag):
        part, position = x[:, :, start:stop], first + start
        one = stop - start == 1  # a decode step: the running extremes of one entry are itself
        low = torch.minimum(part if one else part.cummin(dim=2).values, running_low[:, :, None])
        high = torch.maximum(part if one else part.cummax(dim=2).values, running_high[:, :, None])
        after = position >= lag  # a complete chunk precedes the segment: it is the reference
        after = after if isinstance(after, bool) else after[..., None]  # [B, 1, 1, 1] per row
        reference_low = _either(after, previous_low[:, :, None], low)
        parts.append(min_max_normalize(part, reference_low, _either(after, previous_high[:, :, None], high)))
        running_low, running_high = low[:, :, -1], high[:, :, -1]
        complete = (position + stop - start) % lag == 0  # the chunk is complete: it becomes the reference
        previous_low = _either(complete, running_low, previous_low)
        previous_high = _either(complete, running_high, previous_high)
        running_low = _emptied(complete, running_low, float("inf"))
        running_high = _emptied(complete, running_high, float("-inf"))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    # stacked: copies, where views would keep the segments' cumulative extremes alive
    return out, torch.stack([previous_low, previous_high, running_low, running_high], dim=1)


class LagKVDecode(RollingKVStatistic):
    """Lag-KV (decode, causal; seed 000 §3.3): keys and values normalised by the previous
    chunk's per-channel range (:func:`lag_normalize`, keys and values side by side as one
    vector of channels), score = rolling mean (64) of ``var(k̂) + var(v̂)``. The ranges are kept
    per row in ``memo``.

    Args:
        lag: chunk length (128, as LagKV).
    """

    name = "lag-kv"
    summary = "keep prompt + recent; rank by rolling variance of K,V normalised by the previous chunk's range"
    batched = True

    PARAMS = declare(lag=integer(LAG, low=1), **RollingKVStatistic.PARAMS)

    def raw(self, layer: EntryView, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        memo, (b, h, n, d) = self.memo(layer), keys.shape
        normalized, memo[RANGES] = lag_normalize(
            torch.cat([keys, values], dim=-1), layer.seen - n, self.lag, memo.get(RANGES)
        )
        return head_variance(normalized.view(b, h, n, 2, d)).sum(dim=-1)  # var(k̂) + var(v̂)


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
