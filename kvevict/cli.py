"""The ``kvevict`` command line: the top-level parser, built from the command modules of
:mod:`kvevict.commands` (one per command), and the dispatch to their handlers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvevict.commands import (
    analyze,
    ask,
    bench,
    calibrate_qfilters,
    compress,
    demo,
    generate,
    lm_eval,
    policies,
    report,
    tasks,
    train_duoattention,
    train_gates,
)
from kvevict.commands.common import guarded

COMMANDS = (
    policies,
    generate,
    compress,
    ask,
    tasks,
    bench,
    report,
    demo,
    analyze,
    train_gates,
    calibrate_qfilters,
    train_duoattention,
    lm_eval,
)
"""The command modules, in the order ``kvevict --help`` lists them; each has
``add_parser(commands)`` (see :mod:`kvevict.commands`)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvevict", description="KV-cache eviction for Hugging Face transformers.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvevict")
    except PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if bench.is_subcommand(argv):  # beside bench's positional tasks
        return bench.run_subcommand(argv)
    if lm_eval.is_command(argv):  # lm-eval's own arguments, which its parser reads
        return lm_eval.run_passthrough(argv[1:])
    args = build_parser().parse_args(argv)
    return guarded(f"kvevict {args.command}", lambda: args.run(args), args.extra)


if __name__ == "__main__":
    sys.exit(main())
