import pytest

import kvevict
from kvevict.cli import main


def test_policies_lists_name_and_summary(capsys) -> None:
    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    prefixes = [f"{prefix}+<policy>" for prefix in kvevict.policies.PREFIXES]
    assert [line.split()[0] for line in lines] == kvevict.list_policies() + prefixes
    assert all(len(line.split()) > 2 for line in lines)


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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--policy", "h2oo", "--budget", "64", "hi"], "unknown policy 'h2oo'; known policies: full"),
        (["generate", "-", "hi", "-"], "'-' (read the prompt from standard input) can stand for one prompt only"),
        (["generate", "--policy", "snapkv", "--budget", "8", "hi"], "budget 8 is smaller than snapkv's"),
        (["generate", "--policy", "h2o[window=8", "--budget", "64", "hi"], "bad policy spec 'h2o[window=8'"),
        (["generate", "--policy", "h2o[window=80]", "--budget", "64", "hi"], "smaller than h2o's sinks (4) + recent"),
        (["analyze", "perturbation", "--policies", "snapkv", "--budget", "64"], "takes two or more policies"),
        (["analyze", "perturbation", "--policies", "snapkv,critical+snapkvv", "--budget", "64"], "unknown policy"),
        (["analyze", "perturbation", "--policies", "snapkv,critical+snapkv", "--budget", "16"], "smaller than"),
        (["analyze", "retention", "vt"], "give a needle task (niah_*)"),
        (["analyze", "retention", "niah_single_1", "--policy", "global+h2o"], "use regime=prefill"),
        (
            ["generate", "--policy", "snapkv[window=abc]", "--budget", "64", "hi"],
            "kvevict generate: error: snapkv: parameter 'window' expects an integer >= 1, got 'abc'",
        ),
        (
            ["bench", "niah_single_1", "--policies", "h2o,snapkv[window=abc]", "--budgets", "64", "--out", "unused"],
            "kvevict bench: error: snapkv: parameter 'window' expects an integer >= 1, got 'abc'",
        ),
        (
            ["generate", "--policy", "adakv+critical+lagkv", "--budget", "64", "hi"],
            "critical and lagkv's own lagkv-quotas are both selectors",
        ),
        (
            ["generate", "--model", "/no/such/dir", "hi"],
            "model path '/no/such/dir' does not exist; a model (--model) is 'smollm2' (the embedded",
        ),
    ],
)
def test_bad_input_exits_2_with_a_message_before_loading(argv, message: str, capsys) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_model_directory_without_a_config_or_a_file_is_refused(tmp_path, capsys) -> None:
    assert main(["generate", "--model", str(tmp_path), "hi"]) == 2
    assert "has no config.json; a model (--model) is 'smollm2'" in capsys.readouterr().err
    (tmp_path / "model.gguf").write_text("")
    assert main(["generate", "--model", str(tmp_path / "model.gguf"), "hi"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_budget_and_keep_are_exclusive(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--budget", "64", "--keep", "0.5", "hi"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_on_the_embedded_model(capsys) -> None:
    assert (
        main(
            [
                "generate",
                "--model",
                "smollm2",
                "--policy",
                "streamingllm",
                "--budget",
                "16",
                "--max-new-tokens",
                "8",
                "Name a color.",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "[streamingllm, budget=16]" in captured.err and "retained 16 per KV head" in captured.err


@pytest.mark.slow
def test_generate_answers_several_prompts_as_one_batch_in_order(capsys) -> None:
    options = ["--model", "smollm2", "--policy", "h2o", "--budget", "16", "--max-new-tokens", "6"]
    prompts = ["Name a color.", "What is the capital of France? Answer in one word."]
    assert main(["generate", *options, *prompts]) == 0
    batched = capsys.readouterr().out.splitlines()
    alone = []
    for text in prompts:
        assert main(["generate", *options, text]) == 0
        alone.append(capsys.readouterr().out.strip())
    assert batched == [f"[{i}] {reply}" for i, reply in enumerate(alone, start=1)]


def test_tasks_lists_the_offline_and_hub_suites(capsys) -> None:
    assert main(["tasks"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["niah_single_1"] == ["offline", "string_match_all"]
    assert rows["longbench_hotpotqa"][0] == "hub" and rows["gsm8k"][0] == "hub"
    assert rows["longgen"] == ["offline", "fidelity_top1"]
    assert len(rows) == 11 + 1 + 16 + 3


def test_report_prints_the_table_and_plots(tmp_path, capsys) -> None:
    from pathlib import Path

    run = Path(__file__).parent / "bench" / "data" / "report_run"
    assert main(["report", str(run), "--plot", str(tmp_path / "p.png")]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0].split()[:3] == ["task", "policy", "budget"]
    assert (tmp_path / "p.png").is_file() and "plot:" in captured.err


def test_report_on_a_missing_run_exits_2(tmp_path, capsys) -> None:
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "has no results.jsonl" in capsys.readouterr().err


def test_bench_refuses_unknown_tasks_before_loading(tmp_path, capsys) -> None:
    assert main(["bench", "niah_single_9", "--out", str(tmp_path)]) == 2
    assert "unknown task 'niah_single_9'; known tasks: niah_single_1" in capsys.readouterr().err
