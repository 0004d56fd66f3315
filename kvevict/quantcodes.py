"""The containers of a quantized layer's codes (:mod:`kvevict.quant` makes and reads them): a
rectangle of codes with its groups' scales and zero points (:class:`QuantizedTensor`), and, for a
layer whose heads hold different numbers of entries, the same packed to its real entries only
(:class:`PackedCodes`, and :class:`PackedTail` for the full-precision tail), so that the layer's
bytes follow its entries, not its longest head."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedTensor:
    """Packed codes and their groups' scales and zero points."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scale, self.zero]


@dataclass
class PackedCodes:
    """A :class:`QuantizedTensor` ``[B, H, q, ...]`` of a layer whose heads hold different numbers
    of entries (a head-wise or pooled budget), packed: only the codes of real entries (``held``
    ``[B, H, q]``) and the scales and zero points of groups holding one, so that the layer's bytes
    follow its entries, not its longest head. ``per``: entries per scale group along the columns
    (the key group; 1 for values)."""

    held: torch.Tensor
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    per: int

    @classmethod
    def of(cls, quantized: QuantizedTensor, held: torch.Tensor, per: int) -> PackedCodes:
        groups = cls.groups_of(held, per)
        return cls(held, quantized.codes[held], quantized.scale[groups], quantized.zero[groups], per)

    @staticmethod
    def groups_of(held: torch.Tensor, per: int) -> torch.Tensor:
        """``[B, H, q / per]``: the scale groups holding a real entry."""
        return held if per == 1 else held.view(*held.shape[:2], -1, per).any(dim=-1)

    def unpacked(self, entries: torch.Tensor | None = None) -> QuantizedTensor:
        """The rectangle back (zeros where no real entry is: padding, masked out of attention);
        ``entries``: ``held``'s flat indices when already found (:func:`rectangles`)."""
        groups = self.groups_of(self.held, self.per)
        entries = _flat_index(self.held) if entries is None else entries
        grouped = entries if groups is self.held else _flat_index(groups)
        return QuantizedTensor(
            _scattered(self.codes, self.held.shape, entries),
            _scattered(self.scale, groups.shape, grouped),
            _scattered(self.zero, groups.shape, grouped),
        )

    def tensors(self) -> list[torch.Tensor]:
        return [self.held, self.codes, self.scale, self.zero]


@dataclass
class PackedTail:
    """Full-precision entries ``[B, H, L, d]`` of heads with different numbers of real ones,
    packed: only the real entries' rows (``held`` ``[B, H, L]``)."""

    held: torch.Tensor
    rows: torch.Tensor

    def unpacked(self, entries: torch.Tensor | None = None) -> torch.Tensor:
        return _scattered(self.rows, self.held.shape, _flat_index(self.held) if entries is None else entries)

    def tensors(self) -> list[torch.Tensor]:
        return [self.held, self.rows]


def _flat_index(held: torch.Tensor) -> torch.Tensor:
    """The flat indices of ``held``'s true elements, in order."""
    return held.flatten().nonzero().squeeze(1)


def _scattered(rows: torch.Tensor, shape: torch.Size, index: torch.Tensor) -> torch.Tensor:
    """A zero tensor ``[*shape, *rows.shape[1:]]`` holding ``rows`` at the flat ``index`` (one
    indexed copy, where a boolean mask would find the indices again for every tensor)."""
    full = rows.new_zeros(shape.numel(), *rows.shape[1:])
    return full.index_copy_(0, index, rows).view(*shape, *rows.shape[1:])


Held = QuantizedTensor | PackedCodes | torch.Tensor | PackedTail


def rectangle(held: Held) -> QuantizedTensor | torch.Tensor:
    """Codes or full-precision entries as a rectangle ``[B, H, q, ...]``, unpacked if packed."""
    return held.unpacked() if isinstance(held, (PackedCodes, PackedTail)) else held


def rectangles(keys: Held, values: Held) -> tuple[QuantizedTensor | torch.Tensor, QuantizedTensor | torch.Tensor]:
    """A layer's keys and values as rectangles (:func:`rectangle`); packed to one ``held`` mask, as
    :mod:`kvevict.quant` packs them, its indices are found once for both (a decode step unpacks
    every layer)."""
    packed = (PackedCodes, PackedTail)
    if isinstance(keys, packed) and isinstance(values, packed) and keys.held is values.held:
        entries = _flat_index(keys.held)
        return keys.unpacked(entries), values.unpacked(entries)
    return rectangle(keys), rectangle(values)
