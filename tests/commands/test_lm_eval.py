"""``kvevict lm-eval ARGS`` (kvevict.commands.lm_eval): lm-eval's own command line with kvevict's
model, its arguments passed through; refused in one line without the extra or with bad model args."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from kvevict.cli import main as cli_main
from kvevict.commands.lm_eval import is_command

SHORT = "kvevict_niah_short"
needs_lm_eval = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None,
    reason="the lm-eval extra is not installed: pip install 'kvevict[lm-eval]'",
)
pytestmark = pytest.mark.usefixtures("hub_offline")


@pytest.mark.parametrize(
    ("argv", "passed_through"),
    [
        (["lm-eval", "--tasks", SHORT], True),
        (["lm-eval"], True),
        (["lm_eval"], False),
        ([], False),
        (["generate", "lm-eval"], False),
    ],
)
def test_only_lm_eval_first_is_passed_through(argv: list[str], passed_through: bool) -> None:
    assert is_command(argv) is passed_through


def test_without_the_extra_it_exits_2_naming_it(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what an install without kvevict[lm-eval] finds
    assert cli_main(["lm-eval", "--model_args", "pretrained=smollm2", "--tasks", SHORT]) == 2
    assert capsys.readouterr().err == (
        "kvevict lm-eval: error: this command needs the lm-eval extra (lm_eval not installed): "
        "pip install 'kvevict[lm-eval]'\n"
    )


@needs_lm_eval
@pytest.mark.parametrize(
    ("model_args", "message"),
    [
        (["pretrained=smollm2,colour=red"], "unknown model arg colour; allowed: pretrained, tokenizer, policy,"),
        (
            ["pretrained=smollm2", "policy=snapkv"],
            "policy 'snapkv' needs model arg budget= (tokens) or keep= (fraction)",
        ),
        (["policy=snapkv,budget=0"], "model arg budget must be an integer >= 1, got 0"),
        (["policy=snapkv,budget"], "argument --model_args: expected `key=value`, got 'budget'"),
    ],
)
def test_the_command_line_refuses_bad_model_args_in_one_line(model_args: list[str], message: str, capsys) -> None:
    """Before lm-eval looks its tasks up (this one does not exist) or loads the model."""
    assert cli_main(["lm-eval", "--model_args", *model_args, "--tasks", "no_such_task"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"kvevict lm-eval: error: {message}") and error.count("\n") == 1


@needs_lm_eval
def test_another_model_is_refused_in_one_line(capsys) -> None:
    assert cli_main(["lm-eval", "--model", "hf", "--tasks", SHORT]) == 2
    assert capsys.readouterr().err == "kvevict lm-eval: error: the model is kvevict (got --model hf)\n"


@needs_lm_eval
@pytest.mark.slow
def test_the_command_line_runs_an_offline_task_on_the_embedded_model(capsys, tmp_path) -> None:
    argv = ["--model_args", "pretrained=smollm2,policy=snapkv[window=8],budget=48", "--tasks", SHORT, "--limit", "2"]
    assert cli_main(["lm-eval", *argv, "--output_path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # lm-eval prints the model args as given or as a dict, depending on how they were parsed
    assert "kvevict (" in out and "snapkv[window=8]" in out and "|acc" in out
