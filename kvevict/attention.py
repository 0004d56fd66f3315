"""The attention path: kvevict's registered attention function and the signals it computes.

For every base kernel (``sdpa``, ``eager``, ``flash_attention_*``) kvevict registers
``kvevict_<base>`` with transformers' ``AttentionInterface`` (and the base's mask builder
with ``AttentionMaskInterface``). The wrapper calls the model's own kernel unchanged; only
when the keys it receives come straight from an :class:`~kvevict.cache.EvictionLayer`
does it (1) size the mask to that layer's actual key length, (2) after the kernel ran,
compute the signals the policy asked for — the last query's attention row, the window
queries' rows, or column sums computed in query chunks, never an n×n matrix — and
(3) hand them to the layer, which lets the policy observe and evict.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

if TYPE_CHECKING:
    from kvevict.cache import EvictionLayer
    from kvevict.policies.base import Phase, Requirements, Signals

PREFIX = "kvevict_"
BASE_KERNELS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
COLUMN_SUM_CHUNK = 256
"""Queries per chunk when summing attention columns: memory is ``chunk × n`` per head."""

_pending = threading.local()


def mark_pending(layer: EvictionLayer, keys: torch.Tensor) -> None:
    """Record that ``keys`` (just returned by ``layer.update``) are about to be attended."""
    _pending.entry = (layer, keys)


def _take_pending(keys: torch.Tensor) -> EvictionLayer | None:
    entry = getattr(_pending, "entry", None)
    _pending.entry = None
    if entry is not None and entry[1] is keys:
        return entry[0]
    return None


def base_kernel(base: str, module: torch.nn.Module) -> Callable:
    """The model's own kernel: ``eager`` lives in each modeling file, others in the registry."""
    if base == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[base]


def _make_attention(base: str) -> Callable:
    def kvevict_attention(module, query, key, value, attention_mask, **kwargs):
        kernel = base_kernel(base, module)
        layer = _take_pending(key)
        if layer is None:  # not an eviction cache: pure pass-through
            return kernel(module, query, key, value, attention_mask, **kwargs)
        attention_mask = _layer_mask(base, attention_mask, query, key, layer.valid)
        output, weights = kernel(module, query, key, value, attention_mask, **kwargs)
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        output = layer.policy.correct_output(layer, query, output, scaling)  # before this pass evicts
        layer.after_attention(query, scaling, module)
        return output, weights

    kvevict_attention.__name__ = f"{PREFIX}{base}"
    return kvevict_attention


def _layer_mask(
    base: str, mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, valid: torch.Tensor | None
) -> torch.Tensor | None:
    """The mask for an eviction layer: every retained entry is visible, the pass's own
    entries are causal, and padding (``valid`` false, head-wise budgets) is hidden per
    head. Reuses the model's mask when it already fits this layer."""
    q, n = query.shape[-2], key.shape[-2]
    if valid is not None:
        if base.startswith("flash"):
            raise ValueError(
                "head-wise budgets (adakv, headkv, ...) need a per-head mask, which flash attention kernels do not "
                "take; load the model with attn_implementation='sdpa' or 'eager'"
            )
        allowed = _causal(q, n, query.device) & _heads_mask(valid, query.shape[1])[:, :, None, :]
    elif q == 1 or base.startswith("flash"):  # flash aligns causality bottom-right by itself
        return None if mask is None or mask.shape[-1] != n else mask
    elif mask is not None and mask.shape[-1] == n:
        return mask
    elif mask is None and n == q:
        return None
    else:
        allowed = _causal(q, n, query.device)[None, None]
    if base == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~allowed, torch.finfo(query.dtype).min
    )


def _causal(q: int, n: int, device: torch.device) -> torch.Tensor:
    """``[q, n]``: the last ``q`` of ``n`` entries are the queries, each sees itself and before."""
    rows = torch.arange(q, device=device)[:, None] + (n - q)
    return torch.arange(n, device=device)[None, :] <= rows


def _heads_mask(valid: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    """A KV-head mask ``[B, Hkv, n]`` for the query heads ``[B, Hq, n]`` (GQA groups)."""
    return valid.repeat_interleave(num_query_heads // valid.shape[1], dim=1)


def install(model: PreTrainedModel) -> None:
    """Switch ``model`` to kvevict's wrapper of its current attention kernel."""
    current = model.config._attn_implementation
    if current.startswith(PREFIX):
        return
    if current not in BASE_KERNELS:
        raise ValueError(
            f"attention implementation {current!r} is not supported; kvevict wraps: {', '.join(BASE_KERNELS)}"
        )
    model.set_attn_implementation(PREFIX + current)


def _register() -> None:
    for base in BASE_KERNELS:
        AttentionInterface.register(PREFIX + base, _make_attention(base))
        AttentionMaskInterface.register(PREFIX + base, ALL_MASK_ATTENTION_FUNCTIONS[base])


_register()


# -- signals ----------------------------------------------------------------------------
def attention_logits(
    query: torch.Tensor, keys: torch.Tensor, scaling: float, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Scaled attention logits (fp32) of the last ``r`` queries over ``n`` keys, ``-inf``
    where a query may not look.

    ``query`` is ``[B, Hq, r, d]`` and sits at the end of the key sequence: row ``i`` sees
    keys ``0 .. n - r + i`` (causal). ``keys`` is ``[B, Hkv, n, d]``; query head ``h``
    uses KV head ``h // (Hq / Hkv)`` (GQA, as ``repeat_kv``). ``valid`` ``[B, Hkv, n]``
    hides the padding of head-wise budgets. Returns ``[B, Hq, r, n]``.
    """
    b, hq, r, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    grouped = query.float().reshape(b, hkv, (hq // hkv) * r, d)
    logits = (grouped @ keys.float().transpose(-1, -2)).reshape(b, hq, r, n) * scaling
    if r > 1:
        logits = logits.masked_fill(~_causal(r, n, query.device), float("-inf"))
    if valid is not None:
        logits = logits.masked_fill(~_heads_mask(valid, hq)[:, :, None, :], float("-inf"))
    return logits


def attention_rows(
    query: torch.Tensor, keys: torch.Tensor, scaling: float, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Post-softmax attention (fp32) of the last ``r`` queries over ``n`` keys,
    ``[B, Hq, r, n]`` (see :func:`attention_logits`)."""
    return attention_logits(query, keys, scaling, valid).softmax(dim=-1)


def query_chunks(query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None, chunk: int):
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


VALUE_NORM_CHUNK = 4096
"""Values per chunk when projecting by W_O: memory ``chunk × hidden`` for one query head."""


def projected_value_norms(values: torch.Tensor, o_proj: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    """CriticalKV's ``‖v W_O‖₁`` per KV head, ``[B, Hkv, m]`` fp32.

    ``values`` is ``[B, Hkv, m, d]``; ``o_proj`` is the output projection's weight
    ``[hidden, Hq·d]``. Query head ``h`` projects its KV head's values by its own slice
    ``W_O[:, h·d:(h+1)·d]``; the L1 norm is over the hidden dimension and the result is
    averaged over the query heads of each KV head. One query head and ``VALUE_NORM_CHUNK``
    values at a time, never ``m × hidden`` for all heads at once.
    """
    b, hkv, m, d = values.shape
    group = num_query_heads // hkv
    norms = values.new_zeros(b, hkv, m, dtype=torch.float32)
    for head in range(num_query_heads):
        slice_t = o_proj[:, head * d : (head + 1) * d].float().T  # [d, hidden]
        for start in range(0, m, VALUE_NORM_CHUNK):
            chunk = values[:, head // group, start : start + VALUE_NORM_CHUNK].float()
            norms[:, head // group, start : start + VALUE_NORM_CHUNK] += (chunk @ slice_t).abs().sum(dim=-1)
    return norms / group


def compute_signals(
    requirements: Requirements,
    layer: EvictionLayer,
    phase: Phase,
    query: torch.Tensor,
    scaling: float,
    module: torch.nn.Module | None = None,
) -> Signals:
    """Compute exactly the signals in ``requirements`` for one pass of one layer."""
    keys, valid, num_new = layer.keys, layer.valid, query.shape[-2]
    from kvevict.policies.base import Signals  # the policies build on this module's signals: no import cycle

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
