"""Keys held at fewer channels between passes (ThinK's pruned key channels, freed).

Owns: the narrow form of a layer's keys (:class:`PrunedKeys`): each head's kept channels, and the
other channels of the entries that keep every channel (appended after the prompt was pruned, as
ThinK prunes only the prompt's keys). Must not touch: which entries a layer holds, or when it is
pruned (:mod:`kvevict.layer`, :mod:`kvevict.policies.think`); :mod:`kvevict.storage` calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def complement(channels: torch.Tensor, dim: int) -> torch.Tensor:
    """``[B, H, dim − k]``: the channels of each head not in ``channels`` ``[B, H, k]``, ascending."""
    kept = torch.zeros(*channels.shape[:2], dim, dtype=torch.bool, device=channels.device)
    kept.scatter_(-1, channels, True)
    return (~kept).nonzero()[:, -1].view(*channels.shape[:2], dim - channels.shape[-1]).clone()


def _along(index: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``index`` ``[B, H, k]`` (channels) for ``rows`` entries of each head: ``[B, H, rows, k]``."""
    return index[:, :, None, :].expand(*index.shape[:2], rows, width)


@dataclass
class PrunedKeys:
    """What a layer's keys keep besides their narrow form ``[B, H, n, k]`` (the storage's keys):
    ``channels`` ``[B, H, k]`` each head kept, the ``dim``-wide keys' other channels of the entries
    at ``columns`` ``[B, H, m]`` (where ``held``) as ``rest`` ``[B, H, m, dim − k]``."""

    channels: torch.Tensor
    dim: int
    columns: torch.Tensor
    held: torch.Tensor
    rest: torch.Tensor

    @classmethod
    def narrow(cls, keys: torch.Tensor, channels: torch.Tensor, whole: torch.Tensor) -> tuple[torch.Tensor, PrunedKeys]:
        """``keys`` ``[B, H, c, d]`` at the channels ``channels``, and what restores every channel of the
        entries where ``whole`` ``[B, H, n]`` (``n ≤ c``; the others' pruned channels are zero)."""
        dim, others = keys.shape[-1], complement(channels, keys.shape[-1])
        counts = whole.sum(dim=-1)
        m = int(counts.max()) if counts.numel() else 0
        columns = whole.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :m].clone()  # whole first
        held = torch.arange(m, device=keys.device) < counts[..., None]
        chosen = keys.gather(2, columns[..., None].expand(*columns.shape, dim))
        rest = chosen.gather(3, _along(others, m, dim - channels.shape[-1])) * held[..., None]
        narrow = keys.gather(3, _along(channels, keys.shape[2], channels.shape[-1]))
        return narrow, cls(channels, dim, columns, held, rest)

    def tensors(self) -> list[torch.Tensor]:
        return [self.channels, self.columns, self.held, self.rest]

    def widen(self, narrow: torch.Tensor) -> torch.Tensor:
        """Narrow keys ``[B, H, c, k]`` (``c`` covering every column of :attr:`columns`) back at ``dim``
        channels: the pruned channels zero, but the whole entries' from :attr:`rest`."""
        b, h, c, k = narrow.shape
        wide = narrow.new_zeros(b, h, c, self.dim).scatter_(3, _along(self.channels, c, k), narrow)
        m = self.columns.shape[-1]
        if m:  # (a column past a head's whole entries gets its own zeros back: its pruned channels are zero)
            index = self.columns[..., None].expand(b, h, m, self.dim)
            chosen = wide.gather(2, index)
            others = complement(self.channels, self.dim)
            chosen.scatter_(3, _along(others, m, self.dim - k), self.rest)
            wide.scatter_(2, index, chosen)
        return wide
