"""LayerStorage: the one owner of a layer's tensors, whose version every replacement bumps."""

import torch

from kvevict.storage import LayerStorage


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


def test_kept_key_channels_are_held_narrow_and_read_back_at_their_places() -> None:
    storage = filled(dim=4)
    keys = storage.keys.clone()
    channels = torch.tensor([[[0, 2], [1, 3]], [[2, 3], [0, 1]]])  # [B, Hkv, k]: each head its own
    kept = torch.zeros_like(keys[:, :, :1], dtype=torch.bool).squeeze(2).scatter_(-1, channels, True)
    whole = torch.zeros(2, 2, 5, dtype=torch.bool)
    whole[0, 1, 4] = whole[1, 0, 3] = whole[1, 0, 1] = True  # entries appended after the pruning: every channel
    pruned = keys * (kept[:, :, None] | torch.nn.functional.pad(whole, (0, keys.shape[2] - 5))[..., None])
    storage.keys.copy_(pruned)
    storage.keep_channels(channels, whole)
    assert storage.keys.shape[-1] == 2 and storage.pruned.rest.shape == (2, 2, 2, 2)
    assert torch.equal(storage.dense("keys", torch.zeros(2, dtype=torch.long), 5), pruned[:, :, :5])
    storage.widen_keys()
    assert storage.pruned is None and torch.equal(storage.keys, pruned)
