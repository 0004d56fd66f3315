"""The registry of benchmark tasks (kvevict.bench.tasks): every family's tasks by name, and an
unknown name refused listing the known ones."""

from __future__ import annotations

import pytest

from kvevict.bench import longbench, longgen, maths, needles, ruler
from kvevict.bench.tasks import all_tasks, get_task

FAMILIES = (ruler, needles, longgen, longbench, maths)


def test_every_familys_tasks_are_registered_under_their_own_names() -> None:
    tasks = all_tasks()
    assert len(tasks) == sum(len(family.TASKS) for family in FAMILIES) == 11 + 4 + 1 + 16 + 3  # no name taken twice
    for family in FAMILIES:
        assert all(tasks[name] is task for name, task in family.TASKS.items())
    assert all(task.name == name and task.source in ("offline", "hub") and task.metric for name, task in tasks.items())
    assert list(tasks)[:2] == ["niah_single_1", "niah_single_2"]  # the offline suite first, as `kvevict tasks` lists


def test_a_task_is_found_by_name() -> None:
    assert get_task("gsm8k") is maths.TASKS["gsm8k"] and get_task("longgen") is longgen.TASKS["longgen"]


def test_an_unknown_task_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(ValueError) as refused:
        get_task("niah_single_9")
    assert str(refused.value) == f"unknown task 'niah_single_9'; known tasks: {', '.join(all_tasks())}"
    assert str(refused.value).startswith("unknown task 'niah_single_9'; known tasks: niah_single_1, niah_single_2,")
