"""The losses Fast KVzip's gates are trained with (:mod:`kvevict.gates.train`): binary cross-entropy against the
teacher's scores (the reference's loss; Kim, Han, Yun 2026, arXiv 2601.17668, §3), a pairwise ranking term
(docs/fastkvzip.md, round 10) and a listwise one (round 32). Pure functions of the gates' scores and the targets."""

from __future__ import annotations

import torch

from kvevict.gates import gate_scores

PAIRED = 128
"""Tokens of a batch whose pairs the ranking term (``TrainConfig.order``) compares, the batch's first (drawn at random):
all pairs of 512 made a training step 3.5 times as slow."""


def distillation_loss(
    gates: list[dict[str, torch.Tensor]],
    features: torch.Tensor,
    targets: torch.Tensor,
    order: float = 0.0,
    listwise: float = 0.0,
) -> torch.Tensor:
    """Binary cross-entropy between each layer's gate scores on ``features`` ``[L, m, D]`` and
    KVzip's ``targets`` ``[L, Hkv, m]``, summed over heads, averaged over tokens and layers; with ``order``, plus
    ``order`` times each layer's :func:`ordering_loss` of its first ``PAIRED`` tokens, and with ``listwise``, plus
    ``listwise`` times its :func:`listwise_loss` of all ``m``, each summed over heads (the training loss; held-out
    losses are BCE alone)."""
    losses = []
    for layer, gate in enumerate(gates):
        predicted = gate_scores(features[layer][None].float(), gate)[0].clamp(1e-6, 1 - 1e-6)
        target = targets[layer].clamp(0, 1)
        held = ~target.isnan()  # a sliding layer's targets exist only for what it held (its window)
        if bool(held.all()):
            loss = torch.nn.functional.binary_cross_entropy(predicted, target, reduction="none").mean(-1)
        else:
            loss = torch.nn.functional.binary_cross_entropy(predicted, target.nan_to_num(0.0), reduction="none")
            loss = loss.masked_fill(~held, 0.0).sum(-1) / held.sum(-1).clamp(min=1)
        paired = ordering_loss(predicted[:, :PAIRED], target[:, :PAIRED]).sum() if order else 0.0
        listed = listwise_loss(predicted, target).sum() if listwise else 0.0
        losses.append(loss.sum() + order * paired + listwise * listed)
    return torch.stack(losses).mean()


def ordering_loss(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per head ``[Hkv]``: the mean over ordered pairs ``(i, j)`` of tokens of the cross-entropy between the gate's
    odds that ``i`` outranks ``j``, ``σ(z_i − z_j)``, and KVzip's, ``σ(y_i − y_j)`` (``z``, ``y`` the logits of
    ``predicted`` and ``target`` ``[Hkv, m]``, in ``(0, 1)``; NaN targets, out of a sliding window, take no part).
    Its minimum is where the gate's logits equal KVzip's up to a shift per head, as BCE's is at equality, but every
    pair counts alike: mostly the many small scores whose order decides which ordinary tokens a budget keeps."""
    logits = predicted.logit()
    wanted = target.clamp(1e-6, 1 - 1e-6).logit()
    pairs = torch.nn.functional.binary_cross_entropy_with_logits(
        logits[:, :, None] - logits[:, None, :],
        torch.sigmoid(wanted[:, :, None] - wanted[:, None, :]).nan_to_num(0.5),
        reduction="none",
    )
    held = ~target.isnan()
    both = (held[:, :, None] & held[:, None, :]).float()
    return (pairs * both).sum((1, 2)) / both.sum((1, 2)).clamp(min=1)


def listwise_loss(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per head ``[Hkv]``: the cross-entropy between each token's share of the head's target mass over the ``m``
    tokens, ``y_i / Σ_j y_j``, and the softmax of the gate's logits ``z`` over them (ListNet's top-one
    probabilities, Cao et al. 2007, eq. 5): least where that softmax equals the shares (``z = log y`` up to a shift
    per head), so ranked by mass, and dominated by the few tokens that carry most of it. NaN targets (out of a
    sliding window) take no part; a head whose tokens carry no mass adds 0."""
    held = ~target.isnan()
    mass = target.nan_to_num(0.0).clamp(min=0.0)
    share = mass / mass.sum(-1, keepdim=True).clamp(min=1e-12)
    chances = torch.log_softmax(predicted.logit().masked_fill(~held, float("-inf")), -1)
    return -(share * chances.masked_fill(~held, 0.0)).sum(-1)


__all__ = ["PAIRED", "distillation_loss", "listwise_loss", "ordering_loss"]
