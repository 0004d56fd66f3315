"""``kvevict demo`` (kvevict.commands.demo): the demo run into its results directory (the demo
itself: tests/test_demo.py)."""

from __future__ import annotations

from pathlib import Path

from kvevict.cli import main


def test_the_demo_runs_into_the_directory_given(monkeypatch, tmp_path) -> None:
    ran: list[Path] = []
    monkeypatch.setattr("kvevict.demo.run_demo", ran.append)
    assert main(["demo", "--out", str(tmp_path / "demo")]) == 0
    assert ran == [tmp_path / "demo"]


def test_the_demo_runs_into_results_demo_by_default(monkeypatch) -> None:
    ran: list[Path] = []
    monkeypatch.setattr("kvevict.demo.run_demo", ran.append)
    assert main(["demo"]) == 0
    assert ran == [Path("results/demo")]
