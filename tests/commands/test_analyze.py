"""``kvevict analyze ANALYSIS`` (kvevict.commands.analyze): help, and bad input refused before a
model loads, naming what was wrong (each analysis's own work: tests/analysis/)."""

import pytest

import kvevict
from kvevict.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["analyze", "perturbation", "--policies", "snapkv", "--budget", "64"], "takes two or more policies"),
        (["analyze", "perturbation", "--policies", "snapkv,critical+snapkvv", "--budget", "64"], "unknown policy"),
        (["analyze", "perturbation", "--policies", "snapkv,critical+snapkv", "--budget", "16"], "smaller than"),
        (["analyze", "retention", "vt"], "give a needle task (niah_*)"),
        (["analyze", "retention", "niah_single_1", "--policy", "global+h2o"], "use regime=prefill"),
    ],
)
def test_bad_input_exits_2_with_a_message_before_loading(argv, message: str, capsys) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["analyze", "--help"], ["analyze", "recurrence", "--help"]])
def test_analyze_help(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0 and f"usage: kvevict {' '.join(argv[:-1])}" in capsys.readouterr().out


def test_analyze_needs_an_analysis(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze"])
    assert exit_info.value.code == 2 and "ANALYSIS" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt-set", "nope"], "unknown prompt set 'nope'"),
        (["--prompt-set", "missing.jsonl"], "prompt file missing.jsonl does not exist"),
        (["--alpha", "2"], "parameter 'alpha' expects a number in (0, 1)"),
        (["--samples", "0"], "--samples and --max-new-tokens must be >= 1"),
        (["--max-new-tokens", "0"], "--samples and --max-new-tokens must be >= 1"),
    ],
)
def test_bad_input_exits_2_before_loading(argv, message: str, capsys, monkeypatch) -> None:
    monkeypatch.setattr(kvevict, "load_model", lambda *a, **k: pytest.fail("the model should not load"))
    assert main(["analyze", "recurrence", *argv]) == 2
    err = capsys.readouterr().err
    assert "kvevict analyze: error:" in err and message in err


def test_cli_refuses_bad_input_before_loading_a_model(capsys) -> None:
    assert main(["analyze", "directional", "--policy", "nope", "--budget", "64"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
    assert main(["analyze", "directional", "--policy", "snapkv", "--budget", "8"]) == 2
    assert "budget 8 is smaller than snapkv's" in capsys.readouterr().err


def test_importance_command_refuses_bad_input(capsys) -> None:
    assert main(["analyze", "importance", "--samples", "0"]) == 2
    assert "--samples must be >= 1" in capsys.readouterr().err
