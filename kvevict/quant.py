"""Quantized KV storage between passes (KIVI: Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric
2bit Quantization for KV Cache").

KIVI's recipe, per KV head: **keys** are quantized *per channel*, in groups of ``group``
tokens (each channel of a group of tokens shares a scale and a zero point: key outliers sit in
fixed channels); **values** are quantized *per token*, in groups of ``group`` channels; the
most recent tokens stay at full precision until ``residual`` of them are there, and are then
quantized together (whole groups). Each group is quantized asymmetrically to ``b`` bits (KIVI §3, eq. 1)::

    z = min X,   s = (max X − min X) / (2^b − 1),   Q(X) = round((X − z) / s),   X̂ = Q(X)·s + z

so every dequantized element is within ``s / 2`` of the original (:func:`quantize_groups`).
Codes are packed ``8 / b`` to a byte along the channels, in planes (:func:`pack`).

Owns: the options (:class:`QuantConfig`), the pure quantize/dequantize/pack functions, and a
layer's quantized entries between passes (:class:`QuantizedEntries`: codes, scales and zero
points of the older entries, the full-precision residual). Must not touch: which entries a
layer holds (:mod:`kvevict.layer`, :mod:`kvevict.driver`) or its other tensors
(:mod:`kvevict.storage` calls :func:`compress` and :meth:`QuantizedEntries.restore`).

Layout (docs/quant.md): the groups follow each row's storage columns from the row's first
column (row-relative, so a row of a batch is grouped exactly as alone); a row of ``w`` entries
quantizes its first ``q = F · ⌊w / F⌋`` columns, ``F = group · max(1, ⌊residual / group⌋)``
(KIVI's flush: the full-precision tail grows to ``F − 1`` entries and is quantized whole when
it reaches ``F``), and keeps the rest at full precision. Eviction works on the dequantized
entries during a pass (a dropped entry's slot refilled from the last column, a spliced row,
...); the pass's end quantizes the layer anew from what it then holds, so codes and scales
always describe exactly the entries held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from kvevict.quantcodes import PackedCodes, PackedTail, QuantizedTensor, rectangle, rectangles

BITS = {"int8": 8, "int4": 4, "int2": 2}
"""The ``quant=`` options and their bits per code."""
DEFAULT_GROUP = 32
"""KIVI's group size (tokens per key group, channels per value group)."""


@dataclass(frozen=True)
class QuantConfig:
    """``bits`` per code; ``group``: tokens per key group (per channel) and channels per value
    group (per token); ``residual``: most recent entries of each row held at full precision until
    they are quantized together (fewer than ``max(residual, group)``: :func:`quantized_columns`)."""

    bits: int
    group: int = DEFAULT_GROUP
    residual: int = 32

    @property
    def flush(self) -> int:
        """Entries the full-precision residual reaches when it is quantized whole (:func:`quantized_columns`)."""
        return self.group * max(1, self.residual // self.group)

    def coded_bytes(self, head_dim: int, itemsize: int) -> int:
        """Bytes one entry of one KV head takes as codes: its key's and value's packed codes, and
        its share of scales and zero points (``itemsize`` bytes each): per key channel one pair a
        group of tokens, per value one pair a group of channels (``4·d/group`` in all)."""
        return 2 * head_dim * self.bits // 8 + 4 * (head_dim // self.group) * itemsize

    def options(self) -> dict[str, object]:
        """The ``EvictionCache`` arguments that make this configuration."""
        return {"quant": f"int{self.bits}", "quant_group": self.group, "residual": self.residual}

    @classmethod
    def make(cls, quant: str | None, group: int | None, residual: int | None, head_dim: int) -> QuantConfig | None:
        """The options of ``EvictionCache(quant=..., quant_group=..., residual=...)`` checked
        against the model's head dimension (None: no quantization; ``group`` None: 32, or the
        head dimension where smaller; ``residual`` None: 32)."""
        if quant is None:
            return None
        group = min(DEFAULT_GROUP, head_dim) if group is None else group
        residual = cls.residual if residual is None else residual
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
    """``codes`` ``[..., d]`` (uint8, each < 2^bits) packed ``8 / bits`` to a byte: ``[..., w]``,
    ``w = d·bits/8``, in planes: byte ``j`` holds the codes of channels ``j, j + w, j + 2w, ...``,
    channel ``j + i·w`` in bits ``i·bits .. (i+1)·bits``. Planes, not neighbouring channels, share a
    byte so that :func:`unpack_into` writes each plane as one contiguous block of channels."""
    per = 8 // bits
    if per == 1:
        return codes
    planes = codes.unflatten(-1, (per, codes.shape[-1] // per))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device).view(per, 1)
    return (planes << shifts).sum(dim=-2, dtype=torch.uint8)


def unpack_into(packed: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """The codes :func:`pack` packed, written into ``out`` ``[..., d]`` (any dtype holding them):
    a shift and a mask by a scalar per plane."""
    per = 8 // bits
    if per == 1:
        return out.copy_(packed)
    width, mask = packed.shape[-1], 2**bits - 1
    for plane in range(per):  # each plane's last operation writes it into place, cast to out's dtype
        block = out[..., plane * width : (plane + 1) * width]
        if plane == 0:
            torch.bitwise_and(packed, mask, out=block)
        elif plane == per - 1:
            torch.bitwise_right_shift(packed, plane * bits, out=block)
        else:
            torch.bitwise_and(packed >> plane * bits, mask, out=block)
    return out


def quantize_groups(
    x: torch.Tensor, dim: int, bits: int, held: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric ``bits``-bit quantization of ``x`` in groups along ``dim`` (each slice along
    ``dim`` is one group): ``(codes, scale, zero)``, the codes uint8 shaped as ``x``, ``scale``
    and ``zero`` with ``dim`` reduced to size 1 (broadcasting over their group), in ``dtype``
    (default ``x``'s). Elements where ``held`` (broadcastable to ``x``) is false take no part in
    their group's range (their codes are clamped); a group holding none gets scale 0 and zero point 0. Each held element
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
    return codes, scale, zero


def quantize_keys(keys: torch.Tensor, bits: int, group: int, held: torch.Tensor | None) -> QuantizedTensor:
    """Keys ``[B, H, q, d]`` (``q`` a multiple of ``group``) per channel, in groups of ``group``
    tokens: scale and zero ``[B, H, q / group, 1, d]``; ``held`` ``[B, H, q]`` the real entries."""
    b, h, q, d = keys.shape
    grouped = keys.view(b, h, q // group, group, d)
    mask = None if held is None else held.view(b, h, q // group, group, 1)
    codes, scale, zero = quantize_groups(grouped, 3, bits, mask)
    return QuantizedTensor(pack(codes.view(b, h, q, d), bits), scale, zero)


def dequantize_keys(
    quantized: QuantizedTensor, bits: int, group: int, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The keys :func:`quantize_keys` quantized, ``[B, H, q, d]`` in ``dtype`` (into ``out`` when given)."""
    b, h, q, w = quantized.codes.shape
    d = w * 8 // bits
    return _affine(quantized, bits, (b, h, q // group, group, d), dtype, out)


def _affine(
    quantized: QuantizedTensor,
    bits: int,
    groups: tuple[int, ...],
    dtype: torch.dtype,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """``codes · scale + zero`` (KIVI eq. 1) of ``quantized``'s codes ``[B, H, q, d]`` viewed as
    ``groups`` (``[B, H, q / G, G, d]`` for keys, ``[B, H, q, d / G, G]`` for values: the scale
    and zero point, held with that dimension of size 1, broadcast along it), into ``out`` (new when None):
    unpacked straight into ``out`` and scaled in place where ``dtype`` is float32, else
    computed in float32 and rounded once."""
    b, h, q, w = quantized.codes.shape
    shape = (b, h, q, w * 8 // bits)
    out = quantized.codes.new_empty(shape, dtype=dtype) if out is None else out
    codes = out if dtype == torch.float32 else torch.empty(shape, device=out.device)
    grouped = unpack_into(quantized.codes, bits, codes).view(groups)
    scale, zero = quantized.scale, quantized.zero
    if scale.dtype != torch.float32:
        scale, zero = scale.float(), zero.float()
    if scale.shape[-1] == 1:  # (values: broadcast along the innermost dimension, where addcmul is 4x slower here)
        grouped.mul_(scale).add_(zero)
    else:
        torch.addcmul(zero, grouped, scale, out=grouped)
    if codes is not out:
        out.copy_(codes)
    return out


def quantize_values(values: torch.Tensor, bits: int, group: int) -> QuantizedTensor:
    """Values ``[B, H, q, d]`` per token, in groups of ``group`` channels: scale and zero
    ``[B, H, q, d / group, 1]``."""
    b, h, q, d = values.shape
    codes, scale, zero = quantize_groups(values.view(b, h, q, d // group, group), 4, bits)
    return QuantizedTensor(pack(codes.view(b, h, q, d), bits), scale, zero)


def dequantize_values(
    quantized: QuantizedTensor, bits: int, group: int, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The values :func:`quantize_values` quantized, ``[B, H, q, d]`` in ``dtype`` (into ``out`` when given)."""
    b, h, q, w = quantized.codes.shape
    d = w * 8 // bits
    return _affine(quantized, bits, (b, h, q, d // group, group), dtype, out)


def quantized_columns(width: int, config: QuantConfig) -> int:
    """Leading entries of a row of ``width`` entries that are quantized (KIVI's flush, as
    transformers' ``QuantizedCache``): the full-precision tail grows one entry a step and is
    quantized whole once it reaches ``F = group · max(1, ⌊residual / group⌋)`` entries, so
    ``width mod F`` entries stay at full precision: at most ``residual − 1`` when ``residual``
    ≥ ``group`` (a multiple of it: exactly ``0 .. residual − 1``), at most ``group − 1`` below
    (a key group needs ``group`` tokens)."""
    return config.flush * (width // config.flush)


@dataclass(frozen=True)
class CompactPositions:
    """A layer's entry positions ``[B, H, n]`` between passes, in as few bytes as hold them
    exactly: ``first`` (one int a row, metadata like the rows' starts, no tensor) when column
    ``c`` of every head of row ``b`` holds ``first[b] + c`` (nothing evicted or moved: no table
    at all), else ``table`` in the narrowest signed integer type holding every position (int16
    below 2^15, int32 below 2^31, else int64)."""

    shape: tuple[int, int, int]
    device: torch.device
    first: list[int] | None
    table: torch.Tensor | None

    @classmethod
    def of(cls, positions: torch.Tensor, guess: list[int] | None = None) -> CompactPositions:
        """``positions`` held compactly; ``guess``: the rows' first positions if they are likely
        consecutive (a layer's last ``first``: checked, and read from ``positions`` if wrong)."""
        b, h, n = positions.shape
        shape, device = (b, h, n), positions.device
        if guess is not None and len(guess) == b and torch.equal(positions, _consecutive(guess, h, n, device)):
            return cls(shape, device, guess, None)
        first = positions[:, 0, 0].tolist()
        if first != guess and torch.equal(positions, _consecutive(first, h, n, device)):
            return cls(shape, device, first, None)
        low, high = (int(x) for x in positions.aminmax())
        for dtype in (torch.int16, torch.int32):
            if torch.iinfo(dtype).min <= low and high <= torch.iinfo(dtype).max:
                return cls(shape, device, None, positions.to(dtype))
        return cls(shape, device, None, positions.clone())

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.table is None else [self.table]

    def restore(self, columns: int) -> torch.Tensor:
        """The positions ``[B, H, columns]`` int64 (``columns`` ≥ ``n``; past ``n``, room a pass
        writes its new entries' positions into: what it holds there is unspecified, as in dense storage)."""
        b, h, n = self.shape
        if self.first is not None:
            return _consecutive(self.first, h, columns, self.device).clone(memory_format=torch.contiguous_format)
        out = torch.empty(b, h, columns, dtype=torch.long, device=self.device)
        out[:, :, :n] = self.table
        return out


_CONSECUTIVE: dict[tuple[tuple[int, ...], int, int, torch.device], torch.Tensor] = {}
"""The last few :func:`_consecutive` tables: every layer of a decode step holds the same positions
(the same first positions, heads and columns), so one table serves them all. Read only."""


def _consecutive(first: list[int], heads: int, columns: int, device: torch.device) -> torch.Tensor:
    """``[B, heads, columns]`` (expanded over heads; read only): row ``b``'s column ``c`` holds ``first[b] + c``."""
    key = (tuple(first), heads, columns, device)
    table = _CONSECUTIVE.get(key)
    if table is None:
        lines = torch.arange(columns, device=device) + torch.tensor(first, device=device).view(-1, 1)
        table = lines.view(len(first), 1, columns).expand(len(first), heads, columns)
        if len(_CONSECUTIVE) == 4:  # a decode step uses two (its entries before and after it appends)
            del _CONSECUTIVE[next(iter(_CONSECUTIVE))]
        _CONSECUTIVE[key] = table
    return table


@dataclass
class QuantizedEntries:
    """A layer's keys and values between passes: row ``b``'s storage columns ``starts[b] ..
    starts[b] + counts[b]`` as codes (row-relative columns ``0 .. counts[b]`` of ``keys`` and
    ``values``), its next ``widths[b] − counts[b]`` columns (fewer than :attr:`QuantConfig.flush`)
    at full precision (row-relative columns of ``residual_keys`` and ``residual_values``), and the
    ``n`` columns' positions (:class:`CompactPositions`; they also say which entry each code is,
    so that the next pass's end requantizes only what changed: :meth:`reusable`)."""

    config: QuantConfig
    keys: QuantizedTensor | PackedCodes
    values: QuantizedTensor | PackedCodes
    starts: list[int]
    counts: list[int]
    widths: list[int]
    residual_keys: torch.Tensor | PackedTail
    residual_values: torch.Tensor | PackedTail
    n: int
    positions: CompactPositions

    def tensors(self) -> list[torch.Tensor]:
        return [
            *self.keys.tensors(),
            *self.values.tensors(),
            *_tensors(self.residual_keys),
            *_tensors(self.residual_values),
            *self.positions.tensors(),
        ]

    def reusable(self, valid: torch.Tensor | None) -> ReusableCodes:
        """These codes as a pass begins, with which of them are real (``valid`` ``[B, H, n]``, the
        layer's validity now, or None: all), for the pass's end to keep those still in place."""
        held = None
        if valid is not None or not _aligned(self.starts, self.counts):
            real = valid
            if real is None:
                real = torch.ones(self.positions.shape, dtype=torch.bool, device=self.positions.device)
            held = _row_relative(real, self.starts, self.counts, False)
        return ReusableCodes(self, held)

    @cached_property
    def _layout(self) -> tuple[bool, list[int], list[int], bool]:
        """Whether every row's codes fill the same columns; where each row's full-precision
        residual starts and how long it is; whether codes and residuals fill every column before
        :attr:`n` (no left padding, no row ending early)."""
        aligned = _aligned(self.starts, self.counts)
        tails = [start + count for start, count in zip(self.starts, self.counts)]
        lengths = [width - count for width, count in zip(self.widths, self.counts)]
        covered = aligned and self.starts[0] == 0 and _aligned(tails, lengths) and tails[0] + lengths[0] == self.n
        return aligned, tails, lengths, covered

    def restore(self, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H, columns, d]`` (``columns`` ≥ :attr:`n`): the quantized entries
        dequantized, the residual as held, zeros in every column before :attr:`n` outside the
        rows' entries (a left-padded row's padding, columns past a row's end: masked out of
        attention, so they must be finite). Past :attr:`n`: room a pass appends into, unspecified."""
        bits, group = self.config.bits, self.config.group
        aligned, tails, lengths, covered = self._layout
        dense = []
        for residual, codes, dequantize in zip(
            rectangles(self.residual_keys, self.residual_values),
            rectangles(self.keys, self.values),
            (dequantize_keys, dequantize_values),
            strict=True,
        ):
            dtype = residual.dtype
            out = residual.new_empty(*residual.shape[:2], columns, residual.shape[-1])
            if not covered:  # some column before n holds no entry
                out.zero_()
            if aligned:  # straight into place
                dequantize(codes, bits, group, dtype, out.narrow(2, self.starts[0], self.counts[0]))
            else:
                _place(out, dequantize(codes, bits, group, dtype), self.starts, self.counts)
            if residual.shape[2]:
                _place(out, residual, tails, lengths)
            dense.append(out)
        return dense[0], dense[1]


@dataclass
class ReusableCodes:
    """During a pass, a layer's codes from before it (``entries``) and which of them were real
    (``held``, row-relative ``[B, H, q]``; None: all)."""

    entries: QuantizedEntries
    held: torch.Tensor | None

    def tensors(self) -> list[torch.Tensor]:
        return self.entries.tensors() + ([] if self.held is None else [self.held])

    def positions(self) -> torch.Tensor:
        """``[B, H, q]``: the position of each code's entry (row-relative columns; −1 past a row's codes)."""
        entries = self.entries
        return _row_relative(entries.positions.restore(entries.n), entries.starts, entries.counts, -1)


def _tensors(held: torch.Tensor | PackedTail) -> list[torch.Tensor]:
    return held.tensors() if isinstance(held, PackedTail) else [held]


def _aligned(starts: Sequence[int], counts: Sequence[int]) -> bool:
    return len(set(starts)) == 1 and len(set(counts)) == 1


def _row_relative(x: torch.Tensor, starts: Sequence[int], counts: Sequence[int], fill: float = 0) -> torch.Tensor:
    """Row ``b``'s columns ``starts[b] .. starts[b] + counts[b]`` of ``x`` ``[B, H, n, ...]`` from
    column 0, ``[B, H, max(counts), ...]`` (``fill`` past a row's count): a view when aligned."""
    longest = max(counts)
    if _aligned(starts, counts):
        return x.narrow(2, starts[0], longest)
    out = x.new_full((*x.shape[:2], longest, *x.shape[3:]), fill)
    for row, (start, count) in enumerate(zip(starts, counts)):
        out[row, :, :count] = x[row, :, start : start + count]
    return out


def _place(out: torch.Tensor, rel: torch.Tensor, starts: Sequence[int], counts: Sequence[int]) -> None:
    """Row ``b``'s row-relative columns ``0 .. counts[b]`` of ``rel`` into columns ``starts[b] ..
    starts[b] + counts[b]`` of ``out`` (the inverse of :func:`_row_relative`)."""
    if _aligned(starts, counts):
        out.narrow(2, starts[0], counts[0]).copy_(rel)
        return
    for row, (start, count) in enumerate(zip(starts, counts)):
        out[row, :, start : start + count] = rel[row, :, :count]


def _reusable(
    previous: ReusableCodes | None,
    positions: torch.Tensor,
    held: torch.Tensor,
    compact: CompactPositions,
    starts: Sequence[int],
) -> torch.Tensor:
    """``[B, H, q]`` (row-relative columns): whether ``previous``'s code of that column is still
    the entry held there (same position, same validity; a row that moved to column 0 keeps its
    row-relative columns). ``compact``: the layer's positions now, rows starting at ``starts``."""
    reuse = torch.zeros(held.shape, dtype=torch.bool, device=held.device)
    if previous is None or previous.entries.positions.shape[:2] != positions.shape[:2]:
        return reuse
    old = previous.entries
    common = min(max(old.counts), positions.shape[2])
    if old.positions.first is not None and old.positions.first == compact.first and old.starts == list(starts):
        same = torch.ones(*held.shape[:2], common, dtype=torch.bool, device=held.device)  # nothing moved
    else:
        same = previous.positions()[:, :, :common] == positions[:, :, :common]
    if previous.held is not None:
        same &= previous.held[:, :, :common] == held[:, :, :common]
    elif not bool(held[:, :, :common].all()):
        same &= held[:, :, :common]
    for row, count in enumerate(previous.entries.counts):
        same[row, :, count:] = False
    reuse[:, :, :common] = same
    return reuse


def compress(
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None,
    positions: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    config: QuantConfig,
    previous: ReusableCodes | None = None,
) -> QuantizedEntries:
    """Quantize a layer's ``keys``/``values`` ``[B, H, n, d]`` at ``positions`` whose row ``b``
    holds columns ``spans[b] = (start, width)`` (``valid`` ``[B, H, n]``: which are real; None:
    all), leaving each row's last entries past :func:`quantized_columns` at full precision.

    Codes of ``previous`` (this layer's codes as its pass began) whose entry is still in place are
    kept as they are; only key groups with a new or moved entry, and new or moved values, are
    quantized (from the pass's dequantized or new entries). What a row gets depends on that
    row alone, so a row of a batch is quantized exactly as alone."""
    n = keys.shape[2]
    starts = [start for start, _ in spans]
    counts = [quantized_columns(width, config) for _, width in spans]
    mask = None
    if valid is not None or not _aligned(starts, counts):
        real = torch.ones(positions.shape, dtype=torch.bool, device=keys.device) if valid is None else valid
        mask = _row_relative(real, starts, counts, False)
    compact = CompactPositions.of(positions, None if previous is None else previous.entries.positions.first)
    before = None if previous is None else previous.entries
    quantized_keys: QuantizedTensor | PackedCodes
    quantized_values: QuantizedTensor | PackedCodes
    if before is not None and _unmoved(previous, compact, starts, counts, mask is not None):
        quantized_keys, quantized_values = before.keys, before.values
    else:
        rel_positions = _row_relative(positions, starts, counts, -1)
        held = torch.ones(rel_positions.shape, dtype=torch.bool, device=keys.device) if mask is None else mask
        reuse = _reusable(previous, rel_positions, held, compact, starts)
        if before is not None and before.counts == counts and bool(reuse.all()):  # every code in place
            quantized_keys, quantized_values = before.keys, before.values  # (as held: packed or not)
        else:
            rel_keys, rel_values = _row_relative(keys, starts, counts), _row_relative(values, starts, counts)
            previous_keys, previous_values = (None, None) if before is None else rectangles(before.keys, before.values)
            quantized_keys = _changed_keys(rel_keys, mask, reuse, previous_keys, config)
            quantized_values = _changed_values(rel_values, reuse, previous_values, config)
    widths = [width for _, width in spans]
    tails = [start + count for start, count in zip(starts, counts)]
    lengths = [width - count for width, count in zip(widths, counts)]
    quantized_keys = _packed(quantized_keys, mask, config.group)
    quantized_values = _packed(quantized_values, mask, 1)
    residual_keys, residual_values = _row_relative(keys, tails, lengths), _row_relative(values, tails, lengths)
    tail = None if valid is None or not max(lengths) else _row_relative(valid, tails, lengths, False)
    if tail is not None and not bool(tail.all()):  # the real entries' rows only (indexing copies them)
        residual_keys, residual_values = PackedTail(tail, residual_keys[tail]), PackedTail(tail, residual_values[tail])
    else:  # (a view of the pass's storage when aligned: copied, the storage is set aside)
        residual_keys, residual_values = residual_keys.clone(), residual_values.clone()
    return QuantizedEntries(
        config=config,
        keys=quantized_keys,
        values=quantized_values,
        starts=starts,
        counts=counts,
        widths=widths,
        residual_keys=residual_keys,
        residual_values=residual_values,
        n=n,
        positions=compact,
    )


def _packed(codes: QuantizedTensor | PackedCodes, held: torch.Tensor | None, per: int) -> QuantizedTensor | PackedCodes:
    """``codes`` packed to the real entries ``held`` marks (heads of different lengths: their bytes,
    not the longest's), or the rectangle where every entry is real; codes already packed to the
    same entries are kept as they are (a decode step that only grew the tail)."""
    if held is None or bool(held.all()):
        return rectangle(codes)
    if isinstance(codes, PackedCodes) and torch.equal(codes.held, held):
        return codes
    return PackedCodes.of(rectangle(codes), held, per)


def _unmoved(
    previous: ReusableCodes | None,
    compact: CompactPositions,
    starts: Sequence[int],
    counts: Sequence[int],
    masked: bool,
) -> bool:
    """Whether each of ``previous``'s codes is still the entry held in its column, known without a
    tensor: every entry real, then and now, the rows' codes over the same columns, and each row's
    positions consecutive from the same first (nothing evicted, moved or added among them)."""
    if previous is None or previous.held is not None or masked:
        return False
    old = previous.entries
    return (
        old.counts == list(counts)
        and old.starts == list(starts)
        and old.positions.first is not None
        and old.positions.first == compact.first
    )


def _changed_keys(
    keys: torch.Tensor,
    held: torch.Tensor | None,
    reuse: torch.Tensor,
    previous: QuantizedTensor | None,
    config: QuantConfig,
) -> QuantizedTensor:
    """:func:`quantize_keys` of ``keys`` ``[B, H, q, d]``, but groups whose every entry ``reuse``
    keep ``previous``'s codes: only the others are quantized."""
    b, h, q, d = keys.shape
    bits, group = config.bits, config.group
    kept = reuse.view(b, h, q // group, group).all(dim=-1)
    if previous is None or not bool(kept.any()):
        return quantize_keys(keys, bits, group, held)
    out = _grown(previous, q, group)
    index = (~kept).nonzero(as_tuple=True)
    if index[0].numel():
        mask = None if held is None else held.view(b, h, q // group, group)[index][..., None]
        codes, scale, zero = quantize_groups(keys.reshape(b, h, q // group, group, d)[index], 1, bits, mask)
        out.codes.view(b, h, q // group, group, -1)[index] = pack(codes, bits)
        out.scale[index], out.zero[index] = scale, zero
    return out


def _changed_values(
    values: torch.Tensor, reuse: torch.Tensor, previous: QuantizedTensor | None, config: QuantConfig
) -> QuantizedTensor:
    """:func:`quantize_values` of ``values`` ``[B, H, q, d]``, but entries ``reuse`` keep ``previous``'s codes."""
    bits, group, d = config.bits, config.group, values.shape[-1]
    if previous is None or not bool(reuse.any()):
        return quantize_values(values, bits, group)
    out = _grown(previous, values.shape[2], 1)
    index = (~reuse).nonzero(as_tuple=True)
    if index[0].numel():
        codes, scale, zero = quantize_groups(values[index].view(-1, d // group, group), 2, bits)
        out.codes[index] = pack(codes.view(-1, d), bits)
        out.scale[index], out.zero[index] = scale, zero
    return out


def _grown(previous: QuantizedTensor, columns: int, per: int) -> QuantizedTensor:
    """New tensors for ``columns`` entries (scales and zero points: one per ``per`` entries along
    dim 2) holding ``previous``'s as far as they go, zeros past them."""
    out = []
    for x, width in ((previous.codes, columns), (previous.scale, columns // per), (previous.zero, columns // per)):
        fresh = x.new_zeros(*x.shape[:2], width, *x.shape[3:])
        keep = min(width, x.shape[2])
        fresh[:, :, :keep] = x[:, :, :keep]
        out.append(fresh)
    return QuantizedTensor(*out)
