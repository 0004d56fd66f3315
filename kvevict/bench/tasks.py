"""The registry of benchmark tasks: every family's ``TASKS`` by name (the interface a task
implements is :mod:`kvevict.bench.task`)."""

from __future__ import annotations

from kvevict.bench import longbench, longgen, maths, needles, ruler
from kvevict.bench.task import Task


def all_tasks() -> dict[str, Task]:
    """Every registered task by name."""
    return {**ruler.TASKS, **needles.TASKS, **longgen.TASKS, **longbench.TASKS, **maths.TASKS}


def get_task(name: str) -> Task:
    tasks = all_tasks()
    if name not in tasks:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(tasks)}")
    return tasks[name]
