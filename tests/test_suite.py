"""The suite's own set-up: ``make test``'s two workers keep each ``xdist_group`` on one of them."""

import os

import pytest


@pytest.mark.xdist_group("gemma3")
def test_a_grouped_test_carries_its_group_to_the_scheduler(request: pytest.FixtureRequest) -> None:
    """pytest-xdist groups by a suffix it writes into the test's id; a pytest where that write is lost (9.2) runs the
    Gemma-3 tests on both workers, each converting the model, and the Ray cluster tests side by side."""
    if "PYTEST_XDIST_WORKER" not in os.environ or not request.config.getvalue("loadgroup"):
        pytest.skip("not under `pytest -n N --dist loadgroup` (make test)")
    assert request.node.nodeid.endswith("@gemma3")
