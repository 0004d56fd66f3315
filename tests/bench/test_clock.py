"""The benchmarks' clock: on CUDA it waits for the queued kernels before it reads the time."""

from __future__ import annotations

import torch

from kvevict.bench import clock
from kvevict.bench.clock import now


def test_on_the_cpu_it_is_the_performance_counter() -> None:
    first = now(torch.device("cpu"))
    assert now(torch.device("cpu")) >= first


def test_on_cuda_it_synchronizes_that_device_first(monkeypatch) -> None:
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    now(torch.device("cuda:1"))
    assert synchronized == [torch.device("cuda:1")]


def test_a_call_is_timed_from_a_synchronized_start_to_a_synchronized_end(monkeypatch) -> None:
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("synchronize"))
    ticks = iter([10.0, 12.5])
    monkeypatch.setattr(clock.time, "perf_counter", lambda: next(ticks))
    took = clock.seconds(torch.device("cuda"), lambda *args, **kwargs: events.append(("run", args, kwargs)), 1, k=2)
    assert took == 2.5 and events == ["synchronize", ("run", (1,), {"k": 2}), "synchronize"]
