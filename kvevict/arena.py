"""The storage of several layers as one tensor per kind (:class:`LayerArena`), so that the end of a
pass moves the entries of a stack of layers by one operation per kind.

Owns: the arena's tensors, whose slices are the layers' storage while they stay in it. Must not
touch: what a layer holds or when it evicts (:mod:`kvevict.storage`, :mod:`kvevict.passes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvevict.storage import LayerStorage, move_last_into


class StoredLayer(Protocol):
    """What an arena needs of a layer: its storage, the columns in use, and a way to expose them anew."""

    storage: LayerStorage
    n: int

    def refresh(self) -> None: ...


class LayerArena:
    """The storage of several layers as one tensor per kind ``[L, B, Hkv, capacity, ...]``
    (keys, values, positions, each per-token state entry), each layer's own storage the view
    of its slice.

    Why: at the end of a pass the layers of a stack write the new entries' state, are
    observed and refill their evicted slots together, by one operation per kind rather than
    one per layer (on a CPU each operation costs microseconds of dispatch, more than moving
    one entry). A layer that replaces a storage tensor (growing it, a general eviction that
    compacts it, a batch change) bumps its version and so just leaves the arena
    (:meth:`holds`); its stack then runs layer by layer until its layers move into a new arena.

    Moving layers in costs one copy of their storage, one kind at a time (each layer's old
    tensor is freed as it moves): the memory briefly holds one kind twice."""

    def __init__(self, layers: Sequence[StoredLayer]):
        self.layers = tuple(layers)
        storages = [layer.storage for layer in layers]
        self.capacity = max(storage.capacity for storage in storages)
        self.keys = self._adopt(storages, "keys")
        self.values = self._adopt(storages, "values")
        self.positions = self._adopt(storages, "positions")
        self.state = {name: self._adopt(storages, "state", name) for name in storages[0].state}
        for layer, storage in zip(layers, storages):
            storage.capacity = self.capacity
            storage.replaced()
            layer.refresh()  # the old tensors' views go with them
        self._versions = [storage.version for storage in storages]

    def _adopt(self, storages: list[LayerStorage], kind: str, name: str | None = None) -> torch.Tensor:
        """One kind of storage of every layer, as slices of one new tensor (of the largest capacity)."""

        def get(storage: LayerStorage) -> torch.Tensor:
            return getattr(storage, kind) if name is None else storage.state[name]

        like = get(storages[0])
        block = like.new_zeros(len(storages), *like.shape[:2], self.capacity, *like.shape[3:])
        for i, storage in enumerate(storages):
            old = get(storage)
            block[i].narrow(2, 0, old.shape[2]).copy_(old)
            if name is None:
                setattr(storage, kind, block[i])
            else:
                storage.state[name] = block[i]
        return block

    @staticmethod
    def fits(layers: Sequence[StoredLayer]) -> bool:
        """Whether ``layers`` (more than one, every entry real) hold storage of one layout (capacities may differ)."""
        first = layers[0]

        def layout(layer: StoredLayer) -> list[tuple[object, ...]]:
            entries = layer.storage.entries().items()
            return [(name, x.shape[:2], x.shape[3:], x.dtype, x.device) for name, x in entries]

        return len(layers) > 1 and all(
            layer.storage.valid is None and layer.n == first.n and layout(layer) == layout(first) for layer in layers
        )

    def holds(self, layers: Sequence[StoredLayer]) -> bool:
        """Whether the storage of ``layers`` is (still) this arena's: no tensor of theirs replaced since."""
        return tuple(layers) == self.layers and [layer.storage.version for layer in layers] == self._versions

    @staticmethod
    def stacked(block: torch.Tensor, n: int) -> torch.Tensor:
        """``block`` ``[L, B, ...]``'s first ``n`` entries with the layers' rows stacked:
        ``[L·B, Hkv, n, ...]`` (a view)."""
        return block.narrow(3, 0, n).flatten(0, 1)

    def write_new(self, length: int, num_new: int, values: dict[str, torch.Tensor]) -> None:
        """The new entries' state ``{name: [L·B, Hkv, num_new, ...]}`` into every layer's columns
        ``length - num_new .. length``."""
        for name, value in values.items():
            block = self.state[name]
            new = block.narrow(3, length - num_new, num_new)
            new.copy_(value.reshape(*block.shape[:3], *value.shape[2:]))

    def write_back(self, length: int, replaced: dict[str, torch.Tensor]) -> None:
        """Copy the state entries a stage replaced (``[L·B, Hkv, length, ...]``) into the layers."""
        for name, value in replaced.items():
            self.stacked(self.state[name], length).copy_(value)

    def fill(self, slots: torch.Tensor, last: int) -> None:
        """Drop entry ``slots`` ``[L·B, Hkv]`` of every head of every layer: the entry of column
        ``last`` takes its slot (:meth:`LayerStorage.move_last_into`, for all layers at once)."""
        blocks = [self.keys, self.values, self.positions, *self.state.values()]
        move_last_into(blocks, slots.view(*self.keys.shape[:3]), last)
