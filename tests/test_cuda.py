"""The contract on a GPU (skipped without one): every registered policy, a left-padded batch
against each row alone, and the same tokens as on the CPU (run on an H100 this round, see
docs/batching.md)."""

from __future__ import annotations

import pytest
import torch

import kvevict
from tests.conftest import build_policy, greedy_batch, left_padded, prompt, tiny_model

LENGTHS = (60, 100, 81)
CASES = [(name, None) for name in kvevict.list_policies()] + [
    (name, "int4") for name in ("full", "snapkv", "tova", "rkv")
]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def tokens(model, policy: str, quant: str | None, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    cache = kvevict.EvictionCache(model, build_policy(policy), budget=40, quant=quant)
    device = next(model.parameters()).device
    return greedy_batch(model, ids.to(device), mask.to(device), cache, 8)[0].cpu()


@pytest.mark.parametrize(("policy", "quant"), CASES)
def test_a_batch_on_the_gpu_gives_each_row_what_it_gets_alone_and_what_the_cpu_gives(
    policy: str, quant: str | None
) -> None:
    prompts = [prompt(length, seed=seed) for seed, length in enumerate(LENGTHS)]
    ids, mask = left_padded(prompts)
    gpu, cpu = tiny_model().cuda(), tiny_model()
    with torch.no_grad():
        batch = tokens(gpu, policy, quant, ids, mask)
        assert torch.equal(batch, tokens(cpu, policy, quant, ids, mask))
        for row, alone in enumerate(prompts):
            assert torch.equal(batch[row], tokens(gpu, policy, quant, alone, torch.ones_like(alone))[0])
