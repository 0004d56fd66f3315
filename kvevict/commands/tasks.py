"""``kvevict tasks``: list the benchmark tasks."""

from __future__ import annotations

import argparse

from kvevict.commands.common import BENCH, Subcommands


def add_parser(commands: Subcommands) -> None:
    parser = commands.add_parser("tasks", help="list the benchmark tasks", description="List every benchmark task.")
    parser.set_defaults(run=run, extra=BENCH)


def run(args: argparse.Namespace) -> int:
    from kvevict.bench.tasks import all_tasks

    tasks = all_tasks()
    width = max(map(len, tasks))
    for name, task in tasks.items():
        print(f"{name.ljust(width)}  {task.source:7}  {task.metric}")
    return 0
