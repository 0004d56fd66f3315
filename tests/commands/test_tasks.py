"""``kvevict tasks`` (kvevict.commands.tasks): every benchmark task with its source and metric."""

from kvevict.cli import main


def test_tasks_lists_the_offline_and_hub_suites(capsys) -> None:
    assert main(["tasks"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["niah_single_1"] == ["offline", "string_match_all"]
    assert rows["longbench_hotpotqa"][0] == "hub" and rows["gsm8k"][0] == "hub"
    assert rows["longgen"] == ["offline", "fidelity_top1"]
    assert len(rows) == 11 + 1 + 16 + 3
