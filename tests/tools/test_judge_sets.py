"""tools/judge_sets.py: the eight needle sets the gates are judged on, and their pooled share of the full cache's
answers (docs/fastkvzip.md, round 33)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvevict.bench.needles import GENERATED_BOTH_ORDERS, PHRASINGS
from kvevict.bench.tasks import all_tasks

spec = importlib.util.spec_from_file_location("judge_sets", Path(__file__).parents[2] / "tools" / "judge_sets.py")
judge_sets = importlib.util.module_from_spec(spec)
sys.modules["judge_sets"] = judge_sets  # its dataclass looks its module up
spec.loader.exec_module(judge_sets)


def test_the_sets_hold_216_samples_in_phrasings_no_training_context_has_and_are_not_registered_on_import() -> None:
    tasks = [task for judged in judge_sets.SETS.values() for task in judged.tasks]
    samples = sum(
        judged.samples * (len(judged.tasks) or len(judge_sets.JUDGING)) for judged in judge_sets.SETS.values()
    )
    assert samples == 216 and len({task.name for task in tasks}) == len(tasks)
    templates = {task.family.template for task in tasks}
    assert len(templates) == 14 and not templates & (set(GENERATED_BOTH_ORDERS) | set(PHRASINGS))
    registered = all_tasks()
    assert not any(task.name in registered for task in tasks)
    assert all(name in registered for name in judge_sets.JUDGING)


def test_the_eighth_set_hides_eight_needles_in_every_context() -> None:
    assert [task.family.keys * task.family.values for task in judge_sets.SETS["eighth"].tasks] == [8] * 6
    assert all(task.family.keys * task.family.values <= 4 for name, judged in judge_sets.SETS.items()
               if name != "eighth" for task in judged.tasks)  # fmt: skip


def test_bench_args_register_a_sets_tasks_with_its_seed_and_samples(monkeypatch, tmp_path) -> None:
    registered: dict = {}
    monkeypatch.setattr(judge_sets, "TASKS", registered)
    args = judge_sets.bench_args("sixth", tmp_path, ["--policies", "full"])
    assert args[:2] == ["bench", ",".join(registered)] and len(registered) == 6
    assert args[2:] == ["--length", "2048", "--samples", "4", "--seed", "19", "--keep", "0.25,0.1",
                        "--out", str(tmp_path / "sixth"), "--policies", "full"]  # fmt: skip
    assert judge_sets.bench_args("judging", tmp_path)[1] == ",".join(judge_sets.JUDGING)


def _rows(policy, keep, scores, quant=None):
    return [
        {"policy": policy, "keep": keep, "quant": quant, "task": "t", "index": i, "score": s}
        for i, s in enumerate(scores)
    ]


def test_answers_count_only_the_samples_every_setting_ran() -> None:
    rows = _rows("full", None, [1.0, 0.5, 1.0]) + _rows("fastkvzip", 0.1, [1.0, 0.0])
    assert judge_sets.answers(rows) == {("full", None): 1.5, ("fastkvzip", 0.1): 1.0}


def test_answers_of_chosen_policies_count_the_samples_those_ran_not_the_others() -> None:
    rows = _rows("full", None, [1.0, 0.5, 1.0]) + _rows("fastkvzip", 0.1, [1.0, 0.0]) + _rows("kvzip", 0.1, [0, 1, 1])
    assert judge_sets.answers(rows, ["kvzip"]) == {("full", None): 2.5, ("kvzip", 0.1): 2.0}


def test_answers_keep_a_quantized_setting_apart_from_the_full_precision_one() -> None:
    rows = (
        _rows("full", None, [1.0, 1.0])
        + _rows("fastkvzip", 0.1, [1.0, 1.0])
        + _rows("fastkvzip", 0.1, [0.0, 1.0], "int4")
    )
    assert judge_sets.answers(rows) == {("full", None): 2.0, ("fastkvzip", 0.1): 2.0, ("fastkvzip (int4)", 0.1): 1.0}


def test_pool_sums_the_sets_and_shares_against_the_full_caches_answers(tmp_path) -> None:
    for name, full, kept in (("sixth", [1.0, 1.0], [1.0, 0.0]), ("seventh", [1.0, 0.0], [1.0, 0.0])):
        (tmp_path / name).mkdir()
        rows = _rows("full", None, full) + _rows("fastkvzip", 0.1, kept)
        (tmp_path / name / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    table = judge_sets.pool(tmp_path).splitlines()
    assert table[1:] == [
        "sixth | 1.00 | 2.00",
        "seventh | 1.00 | 1.00",
        "pooled (2 sets), % of full | 66.7 % | 100.0 %",
    ]


def test_an_unknown_set_or_a_folder_without_results_is_refused_in_one_line(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        judge_sets.main(["run", "sixth,ninth", "--out", str(tmp_path)])
    assert "unknown set 'ninth'; use 'all' or some of judging," in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no results under") as error:
        judge_sets.main(["pool", str(tmp_path)])
    assert "\n" not in str(error.value)
    (tmp_path / "sixth").mkdir()
    rows = _rows("full", None, [1.0]) + _rows("fastkvzip", 0.1, [1.0])
    (tmp_path / "sixth" / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(SystemExit, match=r"no results of 'kvzip\[a=1,b=2\]' under .*; found fastkvzip, full$"):
        judge_sets.main(["pool", str(tmp_path), "--policies", "fastkvzip,kvzip[a=1,b=2]"])
