"""The gates' training losses (kvevict.gates.losses), by hand and by their properties."""

from __future__ import annotations

import math

import torch

from kvevict.gates import gate_scores, initial_gates, shape_of
from kvevict.gates.losses import PAIRED, distillation_loss, listwise_loss, ordering_loss
from tests.conftest import tiny_model


def test_the_ordering_loss_is_the_pairs_cross_entropy_by_hand() -> None:
    """One head, two tokens: gate logits (0, 1), KVzip's (1, 0); the four ordered pairs (two of a token with
    itself, target 1/2) by hand; a second head holding a NaN target keeps only its one valid token's pair."""
    half = torch.tensor(0.5)
    one = torch.sigmoid(torch.tensor(1.0))
    predicted = torch.stack([torch.stack([half, one]), torch.stack([half, one])])
    target = torch.stack([torch.stack([one, half]), torch.tensor([float("nan"), 0.5])])
    swapped = -(one * torch.log(torch.sigmoid(torch.tensor(-1.0))) + (1 - one) * torch.log(one))
    wanted = (2 * torch.log(torch.tensor(2.0)) + 2 * swapped) / 4
    loss = ordering_loss(predicted, target)
    assert torch.allclose(loss, torch.stack([wanted, torch.log(torch.tensor(2.0))]), atol=1e-5)


def test_the_ordering_loss_ignores_a_shift_of_the_logits_and_is_least_at_kvzips_order() -> None:
    target = torch.tensor([[0.01, 0.2, 0.05, 0.6, 0.002]])
    shifted = torch.sigmoid(target.logit() + 1.5)
    assert torch.allclose(ordering_loss(shifted, target), ordering_loss(target, target), atol=1e-5)
    assert float(ordering_loss(target.flip(-1), target)[0]) > float(ordering_loss(target, target)[0]) + 0.1


def test_the_listwise_loss_is_the_cross_entropy_of_mass_shares_and_softmax_by_hand() -> None:
    """One head, three tokens: gate logits (0, 1, 2), KVzip's targets (0.3, 0.1, 0); a second head whose one
    valid token (the other NaN) carries all the mass; a third whose tokens carry none."""
    predicted = torch.sigmoid(torch.tensor([[0.0, 1.0, 2.0], [0.5, 1.0, 3.0], [0.0, 1.0, 2.0]]))
    target = torch.tensor([[0.3, 0.1, 0.0], [0.2, float("nan"), 0.0], [0.0, 0.0, 0.0]])
    total = math.log(1 + math.e + math.e**2)
    first = -(0.75 * (0.0 - total) + 0.25 * (1.0 - total))
    second = -(0.5 - math.log(math.exp(0.5) + math.exp(3.0)))  # the NaN token is not in the softmax
    loss = listwise_loss(predicted, target)
    torch.testing.assert_close(loss, torch.tensor([first, second, 0.0]), atol=1e-5, rtol=0)


def test_the_listwise_loss_ignores_a_shift_of_the_logits_and_is_least_ranking_the_mass_first() -> None:
    target = torch.tensor([[0.01, 0.2, 0.05, 0.6, 0.002]])
    shifted = torch.sigmoid(target.logit() + 1.5)
    assert torch.allclose(listwise_loss(shifted, target), listwise_loss(target, target), atol=1e-5)
    assert float(listwise_loss(target.flip(-1), target)[0]) > float(listwise_loss(target, target)[0]) + 0.1


def test_the_training_loss_adds_the_weighted_ordering_and_listwise_losses_per_layer() -> None:
    config = tiny_model().config
    generator = torch.Generator().manual_seed(0)
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    features = torch.randn(layers, 200, config.hidden_size, generator=generator).half()
    targets = torch.rand(layers, heads, 200, generator=generator) ** 4
    gates = initial_gates(shape_of(config))
    bce = distillation_loss(gates, features, targets)
    predicted = [
        gate_scores(features[layer][None].float(), gate)[0].clamp(1e-6, 1 - 1e-6) for layer, gate in enumerate(gates)
    ]
    order = torch.stack(
        [
            ordering_loss(p[:, :PAIRED], targets[layer, :, :PAIRED].clamp(0, 1)).sum()
            for layer, p in enumerate(predicted)
        ]
    )
    listed = torch.stack([listwise_loss(p, targets[layer].clamp(0, 1)).sum() for layer, p in enumerate(predicted)])
    assert torch.allclose(distillation_loss(gates, features, targets, 0.5), bce + 0.5 * order.mean(), atol=1e-5)
    both = distillation_loss(gates, features, targets, 0.5, 0.25)
    assert torch.allclose(both, bce + 0.5 * order.mean() + 0.25 * listed.mean(), atol=1e-5)
