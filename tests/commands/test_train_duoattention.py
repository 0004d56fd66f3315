"""``kvevict train-duoattention`` (kvevict.commands.train_duoattention): the settings refused before a
model loads (the optimisation itself: tests/test_headroles.py)."""

from __future__ import annotations

import pytest

from kvevict.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--sinks, --recent, --passkeys, --passkey-words and --steps must be >= 1"),
        (["--recent", "0"], "--sinks, --recent, --passkeys, --passkey-words and --steps must be >= 1"),
        (["--length", "128"], "--length (128) must exceed --sinks + --recent (128)"),
    ],
)
def test_bad_settings_are_refused_in_one_line_before_a_model_loads(
    argv, message, monkeypatch, tmp_path, capsys
) -> None:
    monkeypatch.setattr("kvevict.models.load_model", lambda *a, **k: pytest.fail("the model should not load"))
    assert main(["train-duoattention", "--model", "smollm2", "--out", str(tmp_path / "roles.json"), *argv]) == 2
    assert capsys.readouterr().err == f"kvevict train-duoattention: error: {message}\n"
