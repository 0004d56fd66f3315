"""The benchmarks' wall clock, read after the device has run what was queued on it.

CUDA runs kernels asynchronously: a time read right after a model call would count their launch, not their
work. On the CPU this is ``time.perf_counter()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def now(device: torch.device) -> float:
    """Seconds (``time.perf_counter()``) once ``device`` has finished the work queued on it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def seconds(device: torch.device, run: Callable[..., object], *args: object, **kwargs: object) -> float:
    """Seconds ``run(*args, **kwargs)`` takes, the work it queues on ``device`` included."""
    start = now(device)
    run(*args, **kwargs)
    return now(device) - start
