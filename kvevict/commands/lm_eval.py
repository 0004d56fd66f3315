"""``kvevict lm-eval ARGS``: lm-evaluation-harness's own command line with ``--model kvevict``
(:mod:`kvevict.lm_eval`); its arguments are lm-eval's, so they bypass kvevict's parser."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from kvevict.commands.common import guarded

LM_EVAL = "lm-eval"


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Listed in ``kvevict --help``; ``kvevict lm-eval ...`` itself never reaches this parser
    (:func:`run_passthrough`)."""
    parser = commands.add_parser(
        LM_EVAL,
        help="evaluate a policy on lm-evaluation-harness tasks (`kvevict lm-eval --help`)",
        description="lm-eval's own command line with --model kvevict: kvevict lm-eval --model_args "
        "pretrained=smollm2,policy=snapkv,budget=64 --tasks kvevict. Needs pip install 'kvevict[lm-eval]'.",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="lm-eval's arguments")
    parser.set_defaults(run=lambda args: run_passthrough(args.args), extra=LM_EVAL)


def is_command(argv: Sequence[str]) -> bool:
    return list(argv[:1]) == [LM_EVAL]


def run_passthrough(argv: Sequence[str]) -> int:
    """Hand ``argv`` (what follows ``lm-eval``) to lm-eval's own parser, as kvevict's model."""
    return guarded(f"kvevict {LM_EVAL}", lambda: importlib.import_module("kvevict.lm_eval").main(argv), LM_EVAL)
