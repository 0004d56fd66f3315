"""No behaviour change elsewhere (issue 13): every policy keeps exactly the entries it kept
before the stage redesign, on fixed tiny inputs (see tests/policies/golden.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import tiny_model
from tests.policies.golden import GOLDEN, kept_entries

EXPECTED: dict[str, object] = json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is ~10x faster on a busy machine
    yield tiny_model()
    torch.set_num_threads(threads)


CHANGED_ON_PURPOSE: dict[str, str] = {}
"""Spellings whose kept entries changed on purpose, with the reason."""


def recorded(name: str, model) -> object:
    """What ``name`` keeps now, or its error as the golden file records one."""
    try:
        return kept_entries(name, model)
    except Exception as err:  # noqa: BLE001 - compared with the recorded error
        return f"{type(err).__name__}: {err}"


@pytest.mark.parametrize("name", [name for name in EXPECTED if name not in CHANGED_ON_PURPOSE])
def test_kept_entries_are_unchanged(name: str, model) -> None:
    assert recorded(name, model) == EXPECTED[name]
