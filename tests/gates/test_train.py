"""Training Fast KVzip's gates (kvevict.gates.train) on a tiny model: KVzip's scores as
targets, a lower distillation loss on held-out contexts, determinism and resumption."""

from __future__ import annotations

import pytest
import torch

from kvevict.gates import initial_gates, shape_of
from kvevict.gates.train import TrainConfig, collect, distillation_loss, train
from tests.conftest import prompt, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:kvzip. no tokenizer")  # tiny models: the bare-context repeat


@pytest.fixture(scope="module")
def data():
    """Features and KVzip targets of six 64-token contexts of the tiny model (32 positions each)."""
    model = tiny_model()
    positions = torch.arange(4, 64, 2)
    found = [collect(model, prompt(64, seed=seed), positions) for seed in range(6)]
    features, targets = zip(*found)
    return model.config, torch.cat(features[:5], 1), torch.cat(targets[:5], 2), features[5], targets[5]


def test_the_targets_are_kvzip_scores_per_layer_head_and_token(data) -> None:
    config, features, targets, _, _ = data
    assert features.shape == (config.num_hidden_layers, 5 * 30, config.hidden_size)
    assert targets.shape == (config.num_hidden_layers, config.num_key_value_heads, 5 * 30)
    assert bool(((targets >= 0) & (targets <= 1)).all()) and float(targets.max()) > 0


def test_training_lowers_the_distillation_loss_on_held_out_contexts(data) -> None:
    config, features, targets, held_features, held_targets = data
    run = TrainConfig(model="tiny", steps=80, batch=64, lr=1e-2)
    gates = train(features, targets, run, shape_of(config), progress=False)
    before = distillation_loss(initial_gates(shape_of(config), run.seed), held_features, held_targets)
    after = distillation_loss(gates, held_features, held_targets)
    assert float(after) < 0.9 * float(before)


def test_training_is_deterministic_and_resumes_to_the_same_gates(data, tmp_path) -> None:
    config, features, targets, _, _ = data
    run = TrainConfig(model="tiny", steps=60, batch=64, lr=1e-2)
    whole = train(features, targets, run, shape_of(config), progress=False)
    again = train(features, targets, run, shape_of(config), progress=False)
    checkpoint = tmp_path / "checkpoint.pt"
    train(
        features, targets, TrainConfig(model="tiny", steps=50, batch=64, lr=1e-2), shape_of(config), checkpoint, False
    )
    resumed = train(features, targets, run, shape_of(config), checkpoint, progress=False)
    for mine, twin, rest in zip(whole, again, resumed):
        assert all(torch.equal(mine[part], twin[part]) and torch.equal(mine[part], rest[part]) for part in mine)
