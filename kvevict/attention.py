"""The attention path: kvevict's registered attention function and the signals it computes.

For every base kernel (``sdpa``, ``eager``, ``flash_attention_*``) kvevict registers
``kvevict_<base>`` with transformers' ``AttentionInterface`` (and the base's mask builder
with ``AttentionMaskInterface``). The wrapper calls the model's own kernel unchanged; only
when the keys it receives come straight from an :class:`~kvevict.layer.EvictionLayer`
does it (1) size the mask to that layer's actual key length, (2) after the kernel ran,
compute the signals the policy asked for — the last query's attention row, the window
queries' rows, or column sums computed in query chunks, never an n×n matrix — and
(3) hand them to the layer, which lets the policy observe and evict.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvevict.rows import real_columns
from kvevict.signals import LogitSpec, as_dtype, as_float32, heads_mask, window_mask


class AttendedLayer(Protocol):
    """What the attention path reads of an eviction layer (:class:`~kvevict.layer.EvictionLayer`),
    kept structural so that this module imports no layer."""

    layer_idx: int
    keys: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None
    compacted: bool
    window: int | None
    packed_pass: bool

    @property
    def policy(self) -> Any: ...
    @property
    def length(self) -> int: ...
    @property
    def padded(self) -> bool: ...
    def query_positions(self, q: int) -> torch.Tensor: ...
    def begin_pass(self, attention_mask: torch.Tensor | None) -> None: ...
    def decode_row(self, query: torch.Tensor, spec: LogitSpec) -> torch.Tensor | None: ...
    def side_attention(self, query: torch.Tensor, spec: LogitSpec, module: torch.nn.Module) -> torch.Tensor | None: ...
    def correct_output(self, query: torch.Tensor, output: torch.Tensor, scaling: float) -> torch.Tensor: ...
    def after_attention(
        self, query: torch.Tensor, scaling: LogitSpec, module: torch.nn.Module, row: torch.Tensor | None
    ) -> None: ...
    def attended(self) -> None: ...
    def leave_packed_pass(self) -> tuple[torch.Tensor, torch.Tensor]: ...
    def attend_packed(self, query: torch.Tensor, scaling: float) -> torch.Tensor: ...


PREFIX = "kvevict_"
BASE_KERNELS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
ROW_KERNELS = ("sdpa", "eager")
"""Kernels whose decode step kvevict may replace by attending with the probabilities the
policy reads (:meth:`~kvevict.driver.PolicyDriver.decode_row`); flash kernels keep their own."""
_pending = threading.local()


def mark_pending(layer: AttendedLayer, keys: torch.Tensor) -> None:
    """Record that ``keys`` (just returned by ``layer.update``) are about to be attended."""
    _pending.entry = (layer, keys)


def _take_pending(module: torch.nn.Module, keys: torch.Tensor) -> AttendedLayer | None:
    """The eviction layer whose ``update`` produced ``keys``, or None for any other cache.

    The layer is matched by the attention module's ``layer_idx``; if its keys reach the
    kernel as another tensor (copied, cast, re-laid out by code between ``update`` and the
    kernel), the layer could no longer tell which entries were attended, so this raises
    rather than let eviction silently stop.
    """
    entry = getattr(_pending, "entry", None)
    _pending.entry = None
    if entry is None:
        return None
    layer, pending_keys = entry
    if keys is pending_keys:
        return layer
    if getattr(module, "layer_idx", None) == layer.layer_idx:
        raise RuntimeError(
            f"the keys of eviction layer {layer.layer_idx} reached the attention kernel altered "
            f"(shape {tuple(keys.shape)}, expected the tensor of shape {tuple(pending_keys.shape)} returned by the "
            "cache): something between the cache update and the kernel copied or transformed them, so kvevict "
            "cannot evict this layer exactly; use an attention implementation that passes the cache's keys through"
        )
    return None


def base_kernel(base: str, module: torch.nn.Module) -> Callable:
    """The model's own kernel: ``eager`` lives in each modeling file, others in the registry."""
    if base == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[base]


def kernel_spec(query: torch.Tensor, kwargs: dict) -> LogitSpec:
    """The logit recipe the model handed its kernel: ``scaling`` (default ``1/√d``), Gemma 2's
    ``softcap`` and gpt-oss's learned sinks ``s_aux``, so the signals are the probabilities the
    kernel used."""
    scaling = kwargs.get("scaling")
    return LogitSpec(
        scaling=query.shape[-1] ** -0.5 if scaling is None else float(scaling),
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
    )


def attend(row: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The attention output ``[B, 1, Hq, d]`` (the kernel's layout, the values' dtype) of one
    query whose probabilities ``row`` ``[B, Hq, 1, n]`` (fp32) are given, over ``values``
    ``[B, Hkv, n, d]`` (query head ``h`` reads KV head ``h // (Hq / Hkv)``), summed in fp32."""
    b, hq, _, n = row.shape
    hkv = values.shape[1]
    output = torch.bmm(row.reshape(b * hkv, hq // hkv, n), as_float32(values).flatten(0, 1))
    return as_dtype(output.view(b, 1, hq, -1), values.dtype)


def _make_attention(base: str) -> Callable:
    def kvevict_attention(module, query, key, value, attention_mask, **kwargs):
        layer = _take_pending(module, key)
        if layer is None:  # not an eviction cache: pure pass-through
            return base_kernel(base, module)(module, query, key, value, attention_mask, **kwargs)
        spec = kernel_spec(query, kwargs)
        if layer.packed_pass and not _attends_packed(base, module, spec, attention_mask, query.shape):
            key, value = layer.leave_packed_pass()
        layer.begin_pass(attention_mask)
        if layer.packed_pass:  # the entries as they lie (a prompt chunk's part for the policy follows there)
            return layer.attend_packed(query, spec.scaling), None
        row = None if base not in ROW_KERNELS or module.training else layer.decode_row(query, spec)
        side = layer.side_attention(query, spec, module)  # a policy's own scoring pass (KVzip's) may attend itself
        if side is not None:
            output, weights = side, None
        elif row is None:
            attention_mask = _layer_mask(base, attention_mask, query, layer)
            output, weights = base_kernel(base, module)(module, query, key, value, attention_mask, **kwargs)
        else:  # the policy reads this very row: attend by it rather than compute it twice
            output, weights = attend(row, value), row.to(query.dtype) if base == "eager" else None
        if layer.policy.corrects_output:
            output = layer.correct_output(query, output, spec.scaling)  # before this pass evicts
        layer.after_attention(query, spec, module, row)
        layer.attended()  # a quantized layer back to codes (kvevict.quant): one layer dequantized at a time
        return output, weights

    kvevict_attention.__name__ = f"{PREFIX}{base}"
    return kvevict_attention


def _attends_packed(
    base: str, module: torch.nn.Module, spec: LogitSpec, mask: torch.Tensor | None, shape: torch.Size
) -> bool:
    """Whether a pass that left its layer packed (a decode step, a prompt chunk: ``shape`` is its
    queries' ``[B, Hq, q, d]``) may attend the packed entries
    (:meth:`~kvevict.packedpass.PackedPasses.attend_packed`): a kernel kvevict may stand in for,
    not training (no dropout), plain scaled logits (no soft cap, no learned sinks), and a real
    token in every column of every row (a padding query sees only its own column)."""
    return (
        base in ROW_KERNELS
        and not module.training
        and spec.softcap is None
        and spec.sinks is None
        and real_columns(mask, shape[2], shape[0]) is None
    )


def check_flash(base: str, ragged: bool) -> None:
    """Flash kernels take no per-entry mask: refuse a layer whose rows or heads are ragged."""
    if base.startswith("flash") and ragged:
        raise ValueError(
            f"{base} cannot mask entries per row or per head, which this cache needs (left-padded prompts of "
            "different lengths, or rows/heads keeping different numbers of entries: keep=, adakv, headkv, ...); "
            "load the model with attn_implementation='sdpa' or 'eager', or use flash with one prompt (or prompts "
            "of equal length) and a uniform budget"
        )


def _layer_mask(base: str, mask: torch.Tensor | None, query: torch.Tensor, layer: AttendedLayer) -> torch.Tensor | None:
    """The mask of an eviction layer's pass, from the layer itself: an entry is visible to a
    query when it is real (``valid``), not after the query's position and, on a sliding-window
    layer, inside the query's window (:func:`~kvevict.signals.window_mask`); each query also
    sees itself (so a padding query attends to something). Entries are not stored in
    position order (eviction refills slots), so nothing is derived from the index order.
    Until the first eviction the storage is the model's own layout and the model's mask
    (sliding or not) is reused as is (bit-identical to no eviction). A single query needs no
    window: the layer drops every entry that left it after each pass."""
    q, n = query.shape[-2], layer.length
    valid = layer.valid
    check_flash(base, valid is not None)
    if not layer.compacted and (
        mask is not None
        and mask.shape[-1] == n
        and (valid is None or q == 1)
        or mask is None
        and valid is None
        and q in (1, n)
    ):  # (a pass of several queries over a row's left padding: the model's mask may not know it)
        return mask
    if base.startswith("flash"):  # uniform rows: new entries at the end, causal bottom-right
        if layer.window is not None and q > 1:
            raise ValueError(
                "a pass of several queries over a sliding-window layer that evicted needs a mask built from "
                f"positions, which {base} does not take; load the model with attn_implementation='sdpa' or 'eager'"
            )
        return None
    if q == 1 and not layer.padded:
        if valid is None:
            return None
        allowed = heads_mask(valid, query.shape[1])[:, :, None, :]
    else:
        positions = layer.positions[:, :, None, :]  # [B, Hkv, 1, n]
        queries = layer.query_positions(q)
        allowed = positions <= queries
        if layer.window is not None:
            allowed &= window_mask(layer.positions, queries[..., 0], layer.window)
        if valid is not None:
            # a padding query (negative position) sees its own column; a real one only real entries
            # (an unused column may hold a stale position equal to a real query's)
            allowed &= valid[:, :, None, :] | ((positions == queries) & (queries < 0))
        allowed = allowed.repeat_interleave(query.shape[1] // allowed.shape[1], dim=1)
    if base == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~allowed, torch.finfo(query.dtype).min
    )


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
