"""LayerStorage: the one owner of a layer's tensors, whose version every replacement bumps."""

import torch

from kvevict.storage import LayerArena, LayerStorage


def filled(batch: int = 2, heads: int = 2, n: int = 5, dim: int = 4) -> LayerStorage:
    storage = LayerStorage()
    keys = torch.randn(batch, heads, n, dim)
    storage.initialize(keys, keys)
    storage.reserve(0, n)
    storage.keys[:, :, :n] = keys
    storage.values[:, :, :n] = -keys
    storage.positions[:, :, :n] = torch.arange(n)
    return storage


def test_every_replacement_bumps_the_version_and_drops_the_views() -> None:
    storage = filled()
    columns = storage.columns(5)
    assert storage.columns(5) is columns  # kept while nothing is replaced
    for replace in (
        lambda: storage.reserve(5, storage.capacity + 1),
        lambda: storage.ensure_valid([(0, 5), (1, 5)]),
        lambda: storage.add_state("score", torch.zeros(2, 2, 1)),
        lambda: storage.gather(torch.arange(3).expand(2, 2, 3), 4),
        lambda: storage.set_valid(torch.ones(2, 2, 3, dtype=torch.bool)),
        lambda: storage.set_valid(None),
        lambda: storage.select_rows(torch.tensor([1, 0])),
    ):
        version = storage.version
        replace()
        assert storage.version > version
        assert storage.columns(columns.n) is not columns
        columns = storage.columns(3)


def test_in_place_moves_keep_the_version() -> None:
    storage = filled()
    version = storage.version
    storage.move_last_into(torch.zeros(2, 2, dtype=torch.long), 4)
    assert storage.version == version
    assert torch.equal(storage.positions[:, :, 0], torch.full((2, 2), 4))


def test_growth_is_geometric_and_keeps_the_entries() -> None:
    storage = filled(n=8)
    before = storage.keys[:, :, :8].clone()
    capacities = []
    for needed in range(9, 60):
        storage.reserve(needed - 1, needed)
        capacities.append(storage.capacity)
    assert len(set(capacities)) <= 5  # 16 columns more each time (×1.125 once larger): not one per column
    assert torch.equal(storage.keys[:, :, :8], before)


def test_a_gather_keeps_the_chosen_entries_in_tensors_of_the_new_capacity() -> None:
    storage = filled()
    source = torch.tensor([4, 0, 2]).expand(2, 2, 3)
    storage.gather(source, capacity=5)
    assert storage.capacity == 5 and storage.keys.shape[2] == 5
    assert torch.equal(storage.positions[:, :, :3], source)


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
