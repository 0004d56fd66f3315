"""The ``kvevict`` command line (kvevict.cli): the parser every command adds itself to (each command's
own tests: tests/commands/)."""

import pytest

from kvevict.cli import main


@pytest.mark.parametrize(
    "command",
    [
        "generate",
        "compress",
        "ask",
        "policies",
        "demo",
        "tasks",
        "bench",
        "report",
        "analyze heads",
        "analyze perturbation",
        "analyze retention",
        "train-gates",
    ],
)
def test_help_for_every_command(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command.split(), "--help"])
    assert exit_info.value.code == 0 and f"usage: kvevict {command}" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--help"]])
def test_help_everywhere(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0 and "usage: kvevict" in capsys.readouterr().out
