import dataclasses

import pytest

from kvevict.demo import DEMO, run_demo


def test_demo_runs_full_and_several_baselines_at_two_budgets() -> None:
    assert DEMO.settings[0].policy == "full"
    assert len(DEMO.budgets) == 2 and len([p for p in DEMO.policies if p != "full"]) >= 3
    assert all(DEMO.length == 2048 for _ in DEMO.tasks)


@pytest.mark.slow
def test_a_small_demo_prints_the_report_and_writes_the_plot(smollm2, tmp_path, capsys) -> None:
    model, tokenizer = smollm2
    small = dataclasses.replace(
        DEMO,
        tasks=("niah_single_1",),
        policies=("full", "streamingllm"),
        budgets=(64,),
        length=256,
        samples=1,
        fidelity=True,
    )
    run_demo(tmp_path, small, model, tokenizer)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["task", "policy", "budget"]
    assert out[2].split()[:3] == ["niah_single_1", "full", "all"] and out[3].split()[:3] == [
        "niah_single_1",
        "streamingllm",
        "64",
    ]
    assert (tmp_path / "report.png").stat().st_size > 10_000 and (tmp_path / "results.jsonl").is_file()
