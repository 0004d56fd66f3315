"""What policies may read: the signals of one attention pass, computed on demand.

This is a leaf module (DESIGN §1.3, §1.6): it imports neither the cache nor the policies,
so the import graph is ``cache → attention → signals ← policies``. A policy declares the
:class:`Requirements` of a pass; :func:`compute_signals` computes exactly those from the
layer's retained keys and values and the pass's queries, in fp32, per query head, and never
an n×n matrix (column sums are summed over query chunks). Every grouped-query logit of the
package is computed by :func:`attention_logits`.

The probabilities are those the model's kernel used (DESIGN §1.2): a :class:`LogitSpec`
carries what differs between families — the logit scale (``1/√d``, Gemma's
``query_pre_attn_scalar``, Granite's ``attention_multiplier``), Gemma 2's logit soft-capping
and gpt-oss's learned per-head sinks in the softmax denominator — and a sliding-window
layer's rows hide the keys its window hides (:func:`window_mask`). QK-norm (Qwen3, OLMo 2,
Gemma 3) needs nothing here: the model normalises queries and keys before the kernel, so
the queries and keys handed over are already normed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import torch

Phase = Literal["prefill", "decode"]
Regime = Literal["prefill", "decode", "both"]
GroupReduce = Literal["mean", "max"]

COLUMN_SUM_CHUNK = 256
"""Queries per chunk when summing attention columns: memory is ``chunk × n`` per head."""
VALUE_NORM_CHUNK = 4096
"""Values times query heads per chunk when projecting by W_O: memory ``chunk × hidden``."""


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
    output_projection: bool = False
    """The attention module's output projection ``W_O`` ``[hidden, Hq·d]``, as the model holds it
    (nothing computed: a stage that reads values through it does so when it needs them)."""

    @property
    def any(self) -> bool:
        return (
            self.last_query_attention
            or self.window > 0
            or self.column_sums
            or self.value_norms
            or self.output_projection
        )

    def __or__(self, other: Requirements) -> Requirements:
        """Everything either side asks for (stages add their signals to each other's)."""
        return Requirements(
            last_query_attention=self.last_query_attention or other.last_query_attention,
            window=max(self.window, other.window),
            column_sums=self.column_sums or other.column_sums,
            value_norms=self.value_norms or other.value_norms,
            output_projection=self.output_projection or other.output_projection,
        )


NOTHING = Requirements()


@dataclass(frozen=True, eq=False)
class LogitSpec:
    """How the attention kernel turns ``q·k`` into probabilities, from its keyword arguments.

    ``p_j = exp(l_j) / (Σ_k exp(l_k) + exp(s_h))`` with ``l = softcap·tanh(q·k·scaling / softcap)``
    (plain ``q·k·scaling`` without soft-capping) and the sink term only where the model has
    learned sinks ``s_h`` per query head (gpt-oss: the rows then sum to less than one).
    """

    scaling: float
    softcap: float | None = None
    """Attention logit soft-capping (Gemma 2's ``attn_logit_softcapping``), or None."""
    sinks: torch.Tensor | None = None
    """Learned per-query-head sink logits ``[Hq]`` (gpt-oss's ``s_aux``), or None."""

    @property
    def plain(self) -> bool:
        """A plain scaled softmax (what MomentKV's correction assumes)."""
        return self.softcap is None and self.sinks is None


def as_spec(scaling: float | LogitSpec) -> LogitSpec:
    """A :class:`LogitSpec` from a spec or a bare logit scale (a plain softmax)."""
    return scaling if isinstance(scaling, LogitSpec) else LogitSpec(float(scaling))


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
    output_projection: torch.Tensor | None = None
    spec: LogitSpec | None = None
    """The kernel's full logit recipe (soft-capping, sinks), of which ``scaling`` is the scale."""

    @classmethod
    def stacked(cls, many: Sequence[Signals]) -> Signals:
        """The signals of several layers' passes as one batch: each per-row tensor
        concatenated along the batch (dim 0) in the order given; the phase, the number of new
        entries and the logit recipe are the first's (:class:`~kvevict.rows.LayerStack`
        stacks only passes of one step, and stackable stages read no logit recipe)."""
        first = many[0]
        tensors = {
            name: torch.cat([getattr(signals, name) for signals in many])
            for name in STACKED_FIELDS
            if getattr(first, name) is not None
        }
        return replace(first, **tensors)

    def of_row(self, index: int) -> Signals:
        """The signals of batch row ``index`` alone (each per-row tensor's ``[index : index + 1]``,
        no copy): what a view of that row sees, from the signals of a view of rows in lockstep."""
        tensors = {
            name: value[index : index + 1] for name in STACKED_FIELDS if (value := getattr(self, name)) is not None
        }
        return replace(self, **tensors)


STACKED_FIELDS = ("query", "last_query_attention", "window_attention", "column_sums", "value_norms")
"""The fields of :class:`Signals` that hold one entry per batch row."""


class RetainedEntries(Protocol):
    """What :func:`compute_signals` reads of a cache layer (kept structural, so this module
    needs no import of the cache)."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor | None
    new_columns: torch.Tensor | None
    """Each row's columns of the pass's entries, or None: the last ones (read with :func:`new_entries`)."""
    positions: torch.Tensor
    """Absolute position of each entry, ``[B, Hkv, n]``."""
    seen: int
    """Tokens seen so far (the pass's queries are the last ``q`` of them)."""
    window: int | None
    """Sliding window of the layer (a query at ``p`` sees keys at ``> p − window``), or None."""


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


def window_mask(key_positions: torch.Tensor, query_positions: torch.Tensor, window: int) -> torch.Tensor:
    """``[B, Hkv, r, n]``: which keys (at ``key_positions`` ``[B, Hkv, n]``) lie inside the
    sliding window of each query (at ``query_positions`` ``[r]``, or ``[B, 1, r]`` per row):
    ``key > query − window``, transformers' sliding-window rule. Causality is not part of it.
    Built from positions, not indices, because a layer that evicted holds a non-contiguous set of positions."""
    return key_positions[:, :, None, :] > (query_positions - window)[..., None]


@dataclass(frozen=True)
class SlidingWindow:
    """The sliding window of one pass: the layer's key positions and the pass's queries'."""

    size: int
    key_positions: torch.Tensor
    """``[B, Hkv, n]``."""
    query_positions: torch.Tensor
    """``[q]``: the pass's queries, in order."""

    @classmethod
    def of(cls, layer: RetainedEntries, num_queries: int) -> SlidingWindow | None:
        """The window of a pass of ``num_queries`` queries through ``layer`` (None: a full layer)."""
        if getattr(layer, "window", None) is None:
            return None
        device = layer.positions.device
        queries = torch.arange(layer.seen - num_queries, layer.seen, device=device)
        return cls(layer.window, layer.positions, queries)

    def visible(self, start: int, stop: int, num_keys: int | None = None) -> torch.Tensor:
        """``[B, Hkv, stop - start, num_keys]``: the keys queries ``start..stop`` may see by the window."""
        return window_mask(self.key_positions[..., :num_keys], self.query_positions[start:stop], self.size)


def as_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32: itself when it is (a decode step's small tensors spare the dispatch of a no-op cast)."""
    return x if x.dtype == torch.float32 else x.float()


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast to ``dtype``: itself when it is already."""
    return x if x.dtype == dtype else x.to(dtype)


def attention_logits(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float | LogitSpec,
    valid: torch.Tensor | None = None,
    *,
    causal: bool = True,
    visible: torch.Tensor | None = None,
    products: torch.dtype | None = None,
) -> torch.Tensor:
    """Attention logits (fp32) of ``r`` queries over ``n`` keys, ``-inf`` where a query may
    not look. The one grouped-query logits helper of kvevict.

    ``query`` is ``[B, Hq, r, d]``; ``keys`` is ``[B, Hkv, n, d]``; query head ``h`` uses KV
    head ``h // (Hq / Hkv)`` (GQA, as ``repeat_kv``, without materialising the repeat).
    With ``causal`` the queries sit at the end of the key sequence: row ``i`` sees keys
    ``0 .. n - r + i``; without it every query sees every key (queries that come after all
    the keys). ``valid`` ``[B, Hkv, n]`` hides padding (head-wise budgets); ``visible``
    ``[B, Hkv, r, n]`` hides what else a query may not see (a sliding window, see
    :class:`SlidingWindow`). ``scaling`` is the logit scale or a :class:`LogitSpec`
    (soft-capping is applied here; sinks only enter the softmax, see :func:`softmax_rows`).
    ``products``: the dtype the query–key product takes (bf16: KVzip's ``precision``), its
    result then read in fp32; None: fp32. Returns ``[B, Hq, r, n]``.
    """
    spec = as_spec(scaling)
    b, hq, r, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    dtype = torch.float32 if products is None else products
    # one batched product over (row, KV head): flattening those two dims of the storage's
    # strided views makes no copy, and bmm takes fewer dispatches than a 4-D matmul
    grouped = as_dtype(query, dtype).reshape(b * hkv, (hq // hkv) * r, d)
    logits = as_float32(torch.bmm(grouped, as_dtype(keys, dtype).flatten(0, 1).transpose(1, 2)))
    logits = logits.view(b, hq, r, n).mul_(spec.scaling)
    if spec.softcap is not None:  # Gemma 2: the kernel caps the scaled logits before masking
        logits = torch.tanh(logits / spec.softcap) * spec.softcap
    if visible is not None:
        logits = logits.masked_fill(~visible.repeat_interleave(hq // hkv, dim=1), float("-inf"))
    if causal and r > 1:  # only the pass's own keys can lie ahead of a query: mask those columns, in place
        logits[..., n - r :].masked_fill_(~causal_mask(r, r, query.device), float("-inf"))
    if valid is not None:
        logits = logits.masked_fill(~heads_mask(valid, hq)[:, :, None, :], float("-inf"))
    return logits


def softmax_rows(logits: torch.Tensor, scaling: float | LogitSpec) -> torch.Tensor:
    """Softmax of logits ``[B, Hq, r, n]`` over the keys; with learned sinks (gpt-oss) each
    head's sink adds ``exp(s_h)`` to the denominator, as the kernel does (it then drops the
    sink's own probability)."""
    sinks = as_spec(scaling).sinks
    if sinks is None:
        return logits.softmax(dim=-1)
    sink = sinks.detach().float().reshape(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    return (logits - torch.cat([logits, sink], dim=-1).logsumexp(dim=-1, keepdim=True)).exp()


def softmax_log_partition(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``log Z`` of each row of ``logits`` ``[..., n]`` whose softmax is ``probs``: the largest
    probability is ``exp(max logit − log Z)``, so ``log Z = max logit − log(max probability)``,
    with no second ``exp`` over the row. ``[...]`` fp32."""
    return logits.amax(dim=-1).sub_(probs.amax(dim=-1).log_())


def attention_rows(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float | LogitSpec,
    valid: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
    products: torch.dtype | None = None,
) -> torch.Tensor:
    """Attention probabilities (fp32) of the last ``r`` queries over ``n`` keys, as the
    kernel computed them, ``[B, Hq, r, n]`` (see :func:`attention_logits`)."""
    return softmax_rows(attention_logits(query, keys, scaling, valid, visible=visible, products=products), scaling)


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
    scaling: float | LogitSpec,
    valid: torch.Tensor | None = None,
    chunk: int = COLUMN_SUM_CHUNK,
    window: SlidingWindow | None = None,
) -> torch.Tensor:
    """Attention received by each key from every query of the pass, ``[B, Hq, n]`` fp32,
    computed ``chunk`` queries at a time (memory ``chunk × n`` per head)."""
    if query.shape[-2] <= chunk and window is None:  # one chunk (a decode step): no running total
        return attention_rows(query, keys, scaling, valid).sum(dim=2)
    total = query.new_zeros(*query.shape[:2], keys.shape[-2], dtype=torch.float32)
    for start, stop, rows, visible_keys, visible_valid in query_chunks(query, keys, valid, chunk):
        n = visible_keys.shape[-2]
        visible = None if window is None else window.visible(start, stop, n)
        total[..., :n] += attention_rows(rows, visible_keys, scaling, visible_valid, visible).sum(dim=2)
    return total


def projected_value_norms(
    values: torch.Tensor, o_proj: torch.Tensor, num_query_heads: int, *, ord: int = 1, per_query_head: bool = False
) -> torch.Tensor:
    """``‖v W_O^h‖`` of each value, ``[B, Hkv, m]`` (or ``[B, Hq, m]``) fp32.

    ``values`` is ``[B, Hkv, m, d]``; ``o_proj`` is the output projection's weight
    ``[hidden, Hq·d]``. Query head ``h`` projects its KV head's values by its own slice
    ``W_O[:, h·d:(h+1)·d]``; the norm (``ord``: 1 for CriticalKV, 2 for KVzip+) is over the
    hidden dimension. By default the result is averaged over the query heads of each KV
    head; ``per_query_head`` keeps one row per query head. Every query head at once, by one
    batched product over the heads' slices as they lie in the weight (no copy of it), for
    ``VALUE_NORM_CHUNK / Hq`` values at a time: never more than ``VALUE_NORM_CHUNK × hidden``
    products held (a decode step's few values: one product, not one per head).
    """
    b, hkv, m, d = values.shape
    group = num_query_heads // hkv
    hidden = o_proj.shape[0]
    heads = o_proj.float().view(hidden, num_query_heads, d).permute(1, 2, 0)  # [Hq, d, hidden]: head h's W_Oᵀ
    rows = values.float().transpose(0, 1).reshape(hkv, 1, b * m, d)
    rows = rows.expand(hkv, group, b * m, d).reshape(num_query_heads, b * m, d)  # each query head's KV head
    norms = values.new_empty(num_query_heads, b * m, dtype=torch.float32)
    chunk = max(1, VALUE_NORM_CHUNK // num_query_heads)
    for start in range(0, b * m, chunk):
        products = torch.bmm(rows[:, start : start + chunk], heads)
        norms[:, start : start + chunk] = torch.linalg.vector_norm(products, ord=ord, dim=-1)
    norms = norms.view(num_query_heads, b, m).transpose(0, 1)
    return norms if per_query_head else group_reduce(norms, hkv)


def compute_signals(
    requirements: Requirements,
    layer: RetainedEntries,
    phase: Phase,
    query: torch.Tensor,
    scaling: float | LogitSpec,
    module: torch.nn.Module | None = None,
    last_row: torch.Tensor | None = None,
) -> Signals:
    """Compute exactly the signals in ``requirements`` for one pass of one layer, with the
    kernel's logit recipe ``scaling`` (a scale or a :class:`LogitSpec`) and, on a
    sliding-window layer, the window's mask. ``last_row``: the probabilities ``[B, Hq, 1, n]``
    of a single-query pass, already computed (the pass attended by them), read instead of
    computed again."""
    spec = as_spec(scaling)
    num_new = query.shape[-2]
    signals = Signals(phase=phase, num_new=num_new, query=query, scaling=spec.scaling, spec=spec)
    if not requirements.any:  # most decode steps of most policies
        return signals
    keys, valid = layer.keys, layer.valid
    sliding = SlidingWindow.of(layer, num_new)

    def rows(r: int) -> torch.Tensor:  # the last r queries' rows
        visible = None if sliding is None else sliding.visible(num_new - r, num_new)
        return attention_rows(query[:, :, -r:], keys, spec, valid, visible)

    if requirements.last_query_attention:
        signals.last_query_attention = (rows(1) if last_row is None else last_row)[:, :, 0]
    if requirements.window:
        signals.window_attention = rows(min(requirements.window, num_new))
    if requirements.column_sums:  # of one query given: its row
        signals.column_sums = (
            column_sums(query, keys, spec, valid, window=sliding) if last_row is None else last_row[:, :, 0]
        )
    if requirements.value_norms or requirements.output_projection:
        if module is None or not hasattr(module, "o_proj"):
            raise ValueError("value norms need the attention module's output projection (o_proj)")
        signals.output_projection = module.o_proj.weight if requirements.output_projection else None
    if requirements.value_norms:
        new_values = new_entries(layer.values, num_new, layer.new_columns)
        signals.value_norms = projected_value_norms(new_values, module.o_proj.weight, query.shape[1])
    return signals


# -- where a pass's appended entries lie in a view ---------------------------------------------------
# Usually each row's last ``num_new`` columns; in a view of rows in lockstep whose heads keep
# different numbers of entries (head-wise budgets), a row whose longest head is shorter than
# another row's ends before column ``n``, so the view gives each row's columns of them
# (``EntryView.new_columns`` ``[B, num_new]``). Pure functions of tensors, kept in this leaf module.
def _appended_index(columns: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``columns`` ``[B, m]`` as a gather index into ``x`` ``[B, H, n, ...]`` along dim 2."""
    b, m = columns.shape
    index = columns.view(b, 1, m, *([1] * (x.dim() - 3)))
    return index.expand(b, x.shape[1], m, *x.shape[3:])


def new_entries(x: torch.Tensor, num_new: int, columns: torch.Tensor | None = None) -> torch.Tensor:
    """The appended entries of ``x`` ``[B, H, n, ...]`` → ``[B, H, num_new, ...]``: its last
    ``num_new`` columns, or each row's ``columns`` ``[B, num_new]``."""
    if columns is None:
        return x[:, :, x.shape[2] - num_new :]
    return x.gather(2, _appended_index(columns, x))


def kept_after(evicted: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Mask ``[B, H, n]`` of the entries a layer still holds once ``evicted`` go (``valid``: its padding mask)."""
    return ~evicted if valid is None else valid & ~evicted


def write_new_entries(x: torch.Tensor, value: torch.Tensor, columns: torch.Tensor | None = None) -> None:
    """Write ``value`` ``[B, H, num_new, ...]`` into the appended entries of ``x`` (in place)."""
    if columns is None:
        x[:, :, x.shape[2] - value.shape[2] :] = value
    else:
        x.scatter_(2, _appended_index(columns, x), value.to(x.dtype))


def row_lengths(length: int, rows: int, columns: torch.Tensor | None = None) -> list[int]:
    """Each row's columns in use (its length alone): the view's ``length``, or one past each
    row's last appended entry."""
    return [length] * rows if columns is None else (columns[:, -1] + 1).tolist()
