import re
import sys
import tomllib
from pathlib import Path

import pytest

from kvevict.cli import main
from kvevict.commands.common import EXTRAS, missing_modules

BENCH_COMMANDS = {
    "tasks": ["tasks"],
    "report": ["report", "unused"],
    "demo": ["demo", "--out", "unused"],
    "bench": ["bench", "niah_single_1", "--out", "unused"],
    "bench decode-speed": ["bench", "decode-speed"],
    "analyze": ["analyze", "heads", "--out", "unused.json"],
}
"""Commands that need ``kvevict[bench]``, by the name their messages start with."""


def test_an_installed_extra_misses_nothing() -> None:
    assert missing_modules("bench") == [] and missing_modules(None) == []


@pytest.mark.parametrize("module", ["matplotlib", "datasets"])
@pytest.mark.parametrize("command", BENCH_COMMANDS)
def test_a_command_without_its_extra_exits_2_naming_it(command, module, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what an install without kvevict[bench] finds
    assert missing_modules("bench") == [module]
    assert main(BENCH_COMMANDS[command]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        (
            f"kvevict {command}: error: this command needs the bench extra ({module} not installed): "
            "pip install 'kvevict[bench]'"
        )
    ]


def test_the_core_commands_need_no_extra(monkeypatch, capsys) -> None:
    for module in EXTRAS["bench"]:
        monkeypatch.setitem(sys.modules, module, None)
    assert main(["policies"]) == 0 and "snapkv" in capsys.readouterr().out
    assert main(["generate", "--policy", "h2oo", "--budget", "64", "hi"]) == 2  # refused as bad input, not extra
    assert "unknown policy 'h2oo'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--help"])  # help needs no extra either
    assert exit_info.value.code == 0


def test_the_extras_modules_are_what_pyproject_declares() -> None:
    """``EXTRAS`` names the import names of the ``bench`` extra's distributions, and none of
    them is a core dependency (a library install pulls no benchmark stack)."""
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0].replace("-", "_") for requirement in requirements}

    bench = names(project["optional-dependencies"]["bench"])
    assert set(EXTRAS["bench"]) <= bench
    assert not bench & names(project["dependencies"])


def test_budget_and_keep_are_exclusive(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--budget", "64", "--keep", "0.5", "hi"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
