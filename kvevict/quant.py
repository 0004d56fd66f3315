"""Quantized KV storage between passes (KIVI: Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric
2bit Quantization for KV Cache").

KIVI's recipe, per KV head: **keys** are quantized *per channel*, in groups of ``group``
tokens (each channel of a group of tokens shares a scale and a zero point: key outliers sit in
fixed channels); **values** are quantized *per token*, in groups of ``group`` channels; the
most recent ``residual`` tokens stay at full precision until a whole group of older tokens is
ready to be quantized. Each group is quantized asymmetrically to ``b`` bits (KIVI §3, eq. 1)::

    z = min X,   s = (max X − min X) / (2^b − 1),   Q(X) = round((X − z) / s),   X̂ = Q(X)·s + z

so every dequantized element is within ``s / 2`` of the original (:func:`quantize_groups`).
Codes are packed ``8 / b`` to a byte along the channels (:func:`pack`).

Owns: the options (:class:`QuantConfig`), the pure quantize/dequantize/pack functions, and a
layer's quantized entries between passes (:class:`QuantizedEntries`: codes, scales and zero
points of the older entries, the full-precision residual). Must not touch: which entries a
layer holds (:mod:`kvevict.layer`, :mod:`kvevict.driver`) or its other tensors
(:mod:`kvevict.storage` calls :func:`compress` and :meth:`QuantizedEntries.restore`).

Layout (docs/quant.md): the groups follow each row's storage columns from the row's first
column (row-relative, so a row of a batch is grouped exactly as alone); a row of ``w`` entries
quantizes its first ``q = group · ⌊max(0, w − residual) / group⌋`` columns and keeps the rest
at full precision. Eviction works on the dequantized entries during a pass (a dropped entry's
slot refilled from the last column, a spliced row, ...); the pass's end quantizes the layer
anew from what it then holds, so codes and scales always describe exactly the entries held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BITS = {"int8": 8, "int4": 4, "int2": 2}
"""The ``quant=`` options and their bits per code."""


@dataclass(frozen=True)
class QuantConfig:
    """``bits`` per code; ``group``: tokens per key group (per channel) and channels per value
    group (per token); ``residual``: most recent entries of each row kept at full precision."""

    bits: int
    group: int = 32
    residual: int = 32

    def options(self) -> dict[str, object]:
        """The ``EvictionCache`` arguments that make this configuration."""
        return {"quant": f"int{self.bits}", "quant_group": self.group, "residual": self.residual}

    @classmethod
    def make(cls, quant: str | None, group: int, residual: int, head_dim: int) -> QuantConfig | None:
        """The options of ``EvictionCache(quant=..., quant_group=..., residual=...)`` checked
        against the model's head dimension (None: no quantization)."""
        if quant is None:
            return None
        if quant not in BITS:
            raise ValueError(f"quant must be one of {', '.join(map(repr, BITS))} or None, got {quant!r}")
        if isinstance(group, bool) or not isinstance(group, int) or group < 1 or head_dim % group:
            raise ValueError(
                f"quant_group must be a positive integer dividing the head dimension {head_dim} "
                f"(values are quantized in groups of that many channels), got {group!r}"
            )
        if head_dim % (8 // BITS[quant]):
            raise ValueError(
                f"{quant} packs {8 // BITS[quant]} codes a byte: head dimension {head_dim} does not divide"
            )
        if isinstance(residual, bool) or not isinstance(residual, int) or residual < 0:
            raise ValueError(
                f"residual must be an integer >= 0 (recent tokens kept at full precision), got {residual!r}"
            )
        return cls(BITS[quant], group, residual)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` ``[..., d]`` (uint8, each < 2^bits) packed ``8 / bits`` to a byte: ``[..., d·bits/8]``
    (code ``i`` of a byte in bits ``i·bits .. (i+1)·bits``)."""
    per = 8 // bits
    if per == 1:
        return codes
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (codes.view(*codes.shape[:-1], -1, per) << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes :func:`pack` packed, ``[..., d]`` uint8."""
    per = 8 // bits
    if per == 1:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & (2**bits - 1)).flatten(-2)


def quantize_groups(
    x: torch.Tensor, dim: int, bits: int, held: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric ``bits``-bit quantization of ``x`` in groups along ``dim`` (each slice along
    ``dim`` is one group): ``(codes, scale, zero)``, the codes uint8 shaped as ``x``, ``scale``
    and ``zero`` with ``dim`` reduced, in ``dtype`` (default ``x``'s). Elements where ``held``
    (broadcastable to ``x``) is false take no part in their group's range (their codes are
    clamped); a group holding none gets scale 0 and zero point 0. Each held element
    dequantizes to within ``scale / 2`` of itself (KIVI eq. 1; the scale and zero point as
    stored, so rounding them to ``dtype`` is accounted for)."""
    levels = 2**bits - 1
    x32 = x.float()
    low, high = x32, x32
    if held is not None:
        low, high = x32.masked_fill(~held, torch.inf), x32.masked_fill(~held, -torch.inf)
    zero, top = low.amin(dim, keepdim=True), high.amax(dim, keepdim=True)
    empty = zero > top
    zero, top = zero.masked_fill(empty, 0), top.masked_fill(empty, 0)
    dtype = x.dtype if dtype is None else dtype
    zero = zero.to(dtype)
    scale = ((top - zero.float()) / levels).to(dtype)
    safe = torch.where(scale > 0, scale.float(), 1.0)
    codes = ((x32 - zero.float()) / safe).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale.squeeze(dim), zero.squeeze(dim)


@dataclass
class QuantizedTensor:
    """Packed codes and their groups' scales and zero points."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scale, self.zero]


def quantize_keys(keys: torch.Tensor, bits: int, group: int, held: torch.Tensor | None) -> QuantizedTensor:
    """Keys ``[B, H, q, d]`` (``q`` a multiple of ``group``) per channel, in groups of ``group``
    tokens: scale and zero ``[B, H, q / group, d]``; ``held`` ``[B, H, q]`` the real entries."""
    b, h, q, d = keys.shape
    grouped = keys.view(b, h, q // group, group, d)
    mask = None if held is None else held.view(b, h, q // group, group, 1)
    codes, scale, zero = quantize_groups(grouped, 3, bits, mask)
    return QuantizedTensor(pack(codes.view(b, h, q, d), bits), scale, zero)


def dequantize_keys(quantized: QuantizedTensor, bits: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The keys :func:`quantize_keys` quantized, ``[B, H, q, d]`` in ``dtype``."""
    codes = unpack(quantized.codes, bits)
    b, h, q, d = codes.shape
    grouped = codes.view(b, h, q // group, group, d).float()
    scale, zero = quantized.scale.float()[:, :, :, None], quantized.zero.float()[:, :, :, None]
    return (grouped * scale + zero).view(b, h, q, d).to(dtype)


def quantize_values(values: torch.Tensor, bits: int, group: int) -> QuantizedTensor:
    """Values ``[B, H, q, d]`` per token, in groups of ``group`` channels: scale and zero ``[B, H, q, d / group]``."""
    b, h, q, d = values.shape
    codes, scale, zero = quantize_groups(values.view(b, h, q, d // group, group), 4, bits)
    return QuantizedTensor(pack(codes.view(b, h, q, d), bits), scale, zero)


def dequantize_values(quantized: QuantizedTensor, bits: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The values :func:`quantize_values` quantized, ``[B, H, q, d]`` in ``dtype``."""
    codes = unpack(quantized.codes, bits)
    b, h, q, d = codes.shape
    grouped = codes.view(b, h, q, d // group, group).float()
    return (grouped * quantized.scale.float()[..., None] + quantized.zero.float()[..., None]).view(b, h, q, d).to(dtype)


def quantized_columns(width: int, config: QuantConfig) -> int:
    """Leading entries of a row of ``width`` entries that are quantized: whole groups, leaving
    at least ``residual`` (and fewer than ``residual + group``) at full precision."""
    return config.group * (max(0, width - config.residual) // config.group)


@dataclass
class QuantizedEntries:
    """A layer's keys and values between passes: row ``b``'s storage columns ``starts[b] ..
    starts[b] + counts[b]`` as codes (row-relative columns ``0 .. counts[b]`` of ``keys`` and
    ``values``), and storage columns ``residual_from .. n`` of every row at full precision."""

    config: QuantConfig
    keys: QuantizedTensor
    values: QuantizedTensor
    starts: list[int]
    counts: list[int]
    residual_from: int
    residual_keys: torch.Tensor
    residual_values: torch.Tensor
    n: int

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys.tensors(), *self.values.tensors(), self.residual_keys, self.residual_values]

    def restore(self, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H, columns, d]`` (``columns`` ≥ :attr:`n`; zeros past it): the
        quantized entries dequantized, the residual as held."""
        bits, group, dtype = self.config.bits, self.config.group, self.residual_keys.dtype
        keys, values = self.residual_keys, self.residual_values
        dense = []
        for residual, part in (
            (keys, dequantize_keys(self.keys, bits, group, dtype)),
            (values, dequantize_values(self.values, bits, group, dtype)),
        ):
            out = residual.new_zeros(*residual.shape[:2], columns, residual.shape[-1])
            out[:, :, self.residual_from : self.n] = residual
            if _aligned(self.starts, self.counts):
                out[:, :, : self.counts[0]] = part
            else:
                for row, (start, count) in enumerate(zip(self.starts, self.counts)):
                    out[row, :, start : start + count] = part[row, :, :count]
            dense.append(out)
        return dense[0], dense[1]


def _aligned(starts: Sequence[int], counts: Sequence[int]) -> bool:
    return all(start == 0 for start in starts) and len(set(counts)) == 1


def compress(
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None,
    spans: Sequence[tuple[int, int]],
    config: QuantConfig,
) -> QuantizedEntries:
    """Quantize a layer's ``keys``/``values`` ``[B, H, n, d]`` whose row ``b`` holds columns
    ``spans[b] = (start, width)`` (``valid`` ``[B, H, n]``: which are real; None: all),
    leaving each row's last :func:`quantized_columns`-complement at full precision."""
    n = keys.shape[2]
    starts = [start for start, _ in spans]
    counts = [quantized_columns(width, config) for _, width in spans]
    longest = max(counts)
    if _aligned(starts, counts):
        rel_keys, rel_values = keys[:, :, :longest], values[:, :, :longest]
        held = None if valid is None else valid[:, :, :longest]
    else:  # each row from its own first column (left padding): grouped as the row alone
        rel_keys = keys.new_zeros(*keys.shape[:2], longest, keys.shape[-1])
        rel_values = values.new_zeros(*values.shape[:2], longest, values.shape[-1])
        held = torch.zeros(rel_keys.shape[:3], dtype=torch.bool, device=keys.device)
        for row, (start, count) in enumerate(zip(starts, counts)):
            rel_keys[row, :, :count] = keys[row, :, start : start + count]
            rel_values[row, :, :count] = values[row, :, start : start + count]
            held[row, :, :count] = True if valid is None else valid[row, :, start : start + count]
    residual_from = min(start + count for start, count in zip(starts, counts))
    return QuantizedEntries(
        config=config,
        keys=quantize_keys(rel_keys, config.bits, config.group, held),
        values=quantize_values(rel_values, config.bits, config.group),
        starts=starts,
        counts=counts,
        residual_from=residual_from,
        residual_keys=keys[:, :, residual_from:n].clone(),
        residual_values=values[:, :, residual_from:n].clone(),
        n=n,
    )
