"""What policies may read: the signals of one attention pass, computed on demand.

This is a leaf module (DESIGN §1.3, §1.6): it imports neither the cache nor the policies,
so the import graph is ``cache → attention → signals ← policies``. A policy declares the
:class:`Requirements` of a pass; :func:`compute_signals` computes exactly those from the
layer's retained keys and values and the pass's queries, in fp32, per query head, and never
an n×n matrix (column sums are summed over query chunks). Every grouped-query logit of the
package is computed by :func:`attention_logits`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

Phase = Literal["prefill", "decode"]
Regime = Literal["prefill", "decode", "both"]
GroupReduce = Literal["mean", "max"]

COLUMN_SUM_CHUNK = 256
"""Queries per chunk when summing attention columns: memory is ``chunk × n`` per head."""
VALUE_NORM_CHUNK = 4096
"""Values per chunk when projecting by W_O: memory ``chunk × hidden`` for one query head."""


@dataclass(frozen=True)
class Requirements:
    """Signals a policy asks the attention path to compute for one forward pass.

    Every attention signal is post-softmax, in fp32, per *query* head, over the keys
    retained before the pass plus the keys of the pass, and never an n×n matrix.
    """

    last_query_attention: bool = False
    """Attention row of the last query of the pass, ``[B, Hq, n]``."""
    window: int = 0
    """Attention rows of the last ``window`` queries of the pass (causal inside the
    window), ``[B, Hq, window, n]``."""
    column_sums: bool = False
    """Attention received by each key, summed over every query of the pass (computed in
    query chunks), ``[B, Hq, n]``."""
    value_norms: bool = False
    """``‖v W_O‖₁`` of the pass's new values, per KV head (mean over its query heads),
    ``[B, Hkv, num_new]``."""

    @property
    def any(self) -> bool:
        return self.last_query_attention or self.window > 0 or self.column_sums or self.value_norms

    def __or__(self, other: Requirements) -> Requirements:
        """Everything either side asks for (stages add their signals to each other's)."""
        return Requirements(
            last_query_attention=self.last_query_attention or other.last_query_attention,
            window=max(self.window, other.window),
            column_sums=self.column_sums or other.column_sums,
            value_norms=self.value_norms or other.value_norms,
        )


NOTHING = Requirements()


@dataclass
class Signals:
    """What the attention path computed for one layer and one forward pass."""

    phase: Phase
    num_new: int
    """Entries appended by this pass (the last ``num_new`` of the layer)."""
    query: torch.Tensor
    """Post-RoPE queries of the pass, ``[B, Hq, q, d]`` (model dtype)."""
    scaling: float
    """The attention's logit scale (``1/√d`` for most models)."""
    last_query_attention: torch.Tensor | None = None
    window_attention: torch.Tensor | None = None
    column_sums: torch.Tensor | None = None
    value_norms: torch.Tensor | None = None


class RetainedEntries(Protocol):
    """What :func:`compute_signals` reads of a cache layer (kept structural, so this module
    needs no import of the cache)."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor | None


def group_reduce(x: torch.Tensor, num_kv_heads: int, how: GroupReduce = "mean") -> torch.Tensor:
    """Reduce a query-head signal ``[B, Hq, ...]`` to KV heads ``[B, Hkv, ...]`` (GQA)."""
    b, hq = x.shape[:2]
    grouped = x.reshape(b, num_kv_heads, hq // num_kv_heads, *x.shape[2:])
    return grouped.amax(dim=2) if how == "max" else grouped.mean(dim=2)


def causal_mask(q: int, n: int, device: torch.device) -> torch.Tensor:
    """``[q, n]``: the last ``q`` of ``n`` entries are the queries, each sees itself and before."""
    rows = torch.arange(q, device=device)[:, None] + (n - q)
    return torch.arange(n, device=device)[None, :] <= rows


def heads_mask(valid: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    """A KV-head mask ``[B, Hkv, n]`` for the query heads ``[B, Hq, n]`` (GQA groups)."""
    return valid.repeat_interleave(num_query_heads // valid.shape[1], dim=1)


def attention_logits(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    valid: torch.Tensor | None = None,
    *,
    causal: bool = True,
) -> torch.Tensor:
    """Scaled attention logits (fp32) of ``r`` queries over ``n`` keys, ``-inf`` where a
    query may not look. The one grouped-query logits helper of kvevict.

    ``query`` is ``[B, Hq, r, d]``; ``keys`` is ``[B, Hkv, n, d]``; query head ``h`` uses KV
    head ``h // (Hq / Hkv)`` (GQA, as ``repeat_kv``, without materialising the repeat).
    With ``causal`` the queries sit at the end of the key sequence: row ``i`` sees keys
    ``0 .. n - r + i``; without it every query sees every key (queries that come after all
    the keys). ``valid`` ``[B, Hkv, n]`` hides padding (head-wise budgets). Returns
    ``[B, Hq, r, n]``.
    """
    b, hq, r, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    grouped = query.float().reshape(b, hkv, (hq // hkv) * r, d)
    logits = (grouped @ keys.float().transpose(-1, -2)).reshape(b, hq, r, n) * scaling
    if causal and r > 1:
        logits = logits.masked_fill(~causal_mask(r, n, query.device), float("-inf"))
    if valid is not None:
        logits = logits.masked_fill(~heads_mask(valid, hq)[:, :, None, :], float("-inf"))
    return logits


def attention_rows(
    query: torch.Tensor, keys: torch.Tensor, scaling: float, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Post-softmax attention (fp32) of the last ``r`` queries over ``n`` keys,
    ``[B, Hq, r, n]`` (see :func:`attention_logits`)."""
    return attention_logits(query, keys, scaling, valid).softmax(dim=-1)


def query_chunks(
    query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None, chunk: int
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """The pass's queries ``chunk`` at a time, each with the keys it may see: yields
    ``(start, stop, queries, visible keys, their validity)`` (memory ``chunk × n`` per head)."""
    q, n = query.shape[-2], keys.shape[-2]
    for start in range(0, q, chunk):
        stop = min(start + chunk, q)
        visible = n - q + stop  # queries start..stop sit at key positions n - q + start ..
        yield (
            start,
            stop,
            query[:, :, start:stop],
            keys[:, :, :visible],
            None if valid is None else valid[..., :visible],
        )


def column_sums(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    valid: torch.Tensor | None = None,
    chunk: int = COLUMN_SUM_CHUNK,
) -> torch.Tensor:
    """Attention received by each key from every query of the pass, ``[B, Hq, n]`` fp32,
    computed ``chunk`` queries at a time (memory ``chunk × n`` per head)."""
    total = query.new_zeros(*query.shape[:2], keys.shape[-2], dtype=torch.float32)
    for _, _, rows, visible_keys, visible_valid in query_chunks(query, keys, valid, chunk):
        total[..., : visible_keys.shape[-2]] += attention_rows(rows, visible_keys, scaling, visible_valid).sum(dim=2)
    return total


def projected_value_norms(
    values: torch.Tensor, o_proj: torch.Tensor, num_query_heads: int, *, ord: int = 1, per_query_head: bool = False
) -> torch.Tensor:
    """``‖v W_O^h‖`` of each value, ``[B, Hkv, m]`` (or ``[B, Hq, m]``) fp32.

    ``values`` is ``[B, Hkv, m, d]``; ``o_proj`` is the output projection's weight
    ``[hidden, Hq·d]``. Query head ``h`` projects its KV head's values by its own slice
    ``W_O[:, h·d:(h+1)·d]``; the norm (``ord``: 1 for CriticalKV, 2 for KVzip+) is over the
    hidden dimension. By default the result is averaged over the query heads of each KV
    head; ``per_query_head`` keeps one row per query head. One query head and
    ``VALUE_NORM_CHUNK`` values at a time, never ``m × hidden`` for all heads at once.
    """
    b, hkv, m, d = values.shape
    group = num_query_heads // hkv
    norms = values.new_zeros(b, num_query_heads, m, dtype=torch.float32)
    for head in range(num_query_heads):
        slice_t = o_proj[:, head * d : (head + 1) * d].float().T  # [d, hidden]
        for start in range(0, m, VALUE_NORM_CHUNK):
            chunk = values[:, head // group, start : start + VALUE_NORM_CHUNK].float()
            norms[:, head, start : start + VALUE_NORM_CHUNK] = (chunk @ slice_t).norm(p=ord, dim=-1)
    return norms if per_query_head else group_reduce(norms, hkv)


def compute_signals(
    requirements: Requirements,
    layer: RetainedEntries,
    phase: Phase,
    query: torch.Tensor,
    scaling: float,
    module: torch.nn.Module | None = None,
) -> Signals:
    """Compute exactly the signals in ``requirements`` for one pass of one layer."""
    keys, valid, num_new = layer.keys, layer.valid, query.shape[-2]
    signals = Signals(phase=phase, num_new=num_new, query=query, scaling=scaling)
    if requirements.last_query_attention:
        signals.last_query_attention = attention_rows(query[:, :, -1:], keys, scaling, valid)[:, :, 0]
    if requirements.window:
        window = min(requirements.window, query.shape[-2])
        signals.window_attention = attention_rows(query[:, :, -window:], keys, scaling, valid)
    if requirements.column_sums:
        signals.column_sums = column_sums(query, keys, scaling, valid)
    if requirements.value_norms:
        if module is None or not hasattr(module, "o_proj"):
            raise ValueError("value norms need the attention module's output projection (o_proj)")
        new_values = layer.values[:, :, -num_new:]
        signals.value_norms = projected_value_norms(new_values, module.o_proj.weight, query.shape[1])
    return signals
