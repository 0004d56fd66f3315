"""The benchmarks' clock: on CUDA it waits for the queued kernels before it reads the time."""

from __future__ import annotations

import torch

from kvevict.bench.clock import now


def test_on_the_cpu_it_is_the_performance_counter() -> None:
    first = now(torch.device("cpu"))
    assert now(torch.device("cpu")) >= first


def test_on_cuda_it_synchronizes_that_device_first(monkeypatch) -> None:
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    now(torch.device("cuda:1"))
    assert synchronized == [torch.device("cuda:1")]
