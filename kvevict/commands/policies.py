"""``kvevict policies``: list the registered eviction policies."""

from __future__ import annotations

import argparse

from kvevict.commands.common import Subcommands


def add_parser(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "policies", help="list the eviction policies", description="List every registered policy."
    )
    parser.set_defaults(run=run, extra=None)


def run(args: argparse.Namespace) -> int:
    from kvevict.policies import describe_policies

    rows = describe_policies()
    width = max(len(name) for name, _ in rows)
    for name, summary in rows:
        print(f"{name.ljust(width)}  {summary}")
    return 0
