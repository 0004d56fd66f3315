"""``kvevict demo``: a small offline suite on the embedded model, with its report and plot."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvevict.commands.common import BENCH, Subcommands


def add_parser(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "demo",
        help="a small offline suite on the embedded model, with its report and plot",
        description="Run a few RULER-style tasks on the embedded SmolLM2 for full and several baselines at two "
        "budgets, print the report and write the plot.",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("results/demo"), help="results directory (default: results/demo)"
    )
    parser.set_defaults(run=run, extra=BENCH)


def run(args: argparse.Namespace) -> int:
    from kvevict.demo import run_demo

    run_demo(args.out)
    return 0
