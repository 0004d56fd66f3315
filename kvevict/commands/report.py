"""``kvevict report``: summarise a results directory written by ``kvevict bench``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvevict.commands.common import BENCH, Subcommands


def add_parser(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "report",
        help="summarise a results directory",
        description="Mean score per task × policy × budget, % of full; with --frontier, score against resident bytes.",
    )
    parser.add_argument("directory", type=Path, help="a directory written by `kvevict bench`")
    parser.add_argument("--plot", type=Path, default=None, help="also draw score vs budget into this PNG")
    parser.add_argument(
        "--frontier",
        type=Path,
        default=None,
        help="also print every setting's score against its resident bytes, the cheapest keeping 95 %% of the "
        "score, and draw them into this PNG",
    )
    parser.set_defaults(run=run, extra=BENCH)


def run(args: argparse.Namespace) -> int:
    from kvevict.bench.report import format_report, plot_report, summarize
    from kvevict.bench.store import ResultStore

    if not (args.directory / "results.jsonl").is_file():
        raise FileNotFoundError(
            f"{args.directory} has no results.jsonl; run `kvevict bench ... --out {args.directory}`"
        )
    rows = summarize(ResultStore(args.directory))
    print(format_report(rows))
    if args.plot:
        print(f"plot: {plot_report(rows, args.plot)}", file=sys.stderr)
    if args.frontier:
        from kvevict.bench.frontier import format_frontier, plot_frontier, settings

        found = settings(rows)
        print(f"\n{format_frontier(found)}")
        print(f"plot: {plot_frontier(found, args.frontier)}", file=sys.stderr)
    return 0
