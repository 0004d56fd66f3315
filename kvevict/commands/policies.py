"""``kvevict policies``: list the registered eviction policies."""

from __future__ import annotations

import argparse

from kvevict.commands.common import Subcommands


def add_parser(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "policies",
        help="list the eviction policies",
        description="List every registered policy, with kvpress's name for the ones it also has.",
    )
    parser.set_defaults(run=run, extra=None)


def run(args: argparse.Namespace) -> int:
    from kvevict.policies import KVPRESS, describe_policies

    rows = describe_policies()
    width = max(len(name) for name, _ in rows)
    for name, summary in rows:
        kvpress = f"  (kvpress: {KVPRESS[name]})" if name in KVPRESS else ""
        print(f"{name.ljust(width)}  {summary}{kvpress}")
    return 0
