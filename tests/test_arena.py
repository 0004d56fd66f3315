"""LayerArena: several layers' storage as one tensor per kind, held until a layer replaces a tensor."""

import torch

from kvevict.arena import LayerArena
from tests.test_storage import filled


def test_an_arena_holds_its_layers_until_one_replaces_a_tensor() -> None:
    class Layer:
        def __init__(self) -> None:
            self.storage, self.n, self.refreshed = filled(), 5, 0

        def refresh(self) -> None:
            self.refreshed += 1

    layers = [Layer(), Layer()]
    before = [layer.storage.keys[:, :, :5].clone() for layer in layers]
    arena = LayerArena(layers)
    assert all(layer.refreshed == 1 for layer in layers)  # their views are of the arena now
    assert arena.holds(layers)
    for layer, keys in zip(layers, before):
        assert torch.equal(layer.storage.keys[:, :, :5], keys)
        assert layer.storage.keys.untyped_storage().data_ptr() == arena.keys.untyped_storage().data_ptr()
    layers[1].storage.reserve(5, 40)
    assert not arena.holds(layers)
