"""Fixtures of the policy tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tiny-model passes on one thread (tiny matrices: ~10x faster than two
    threads on a busy machine), restoring the thread count afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
