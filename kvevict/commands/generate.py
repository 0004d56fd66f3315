"""``kvevict generate``: answer prompts with a compressed cache."""

from __future__ import annotations

import argparse
import sys

from kvevict.commands.common import Subcommands, budget_args, load_model_from, model_args, quant_args, quant_options


def add_parser(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "generate",
        help="answer prompts with a compressed cache",
        description="Compress the prompt under a policy, then decode greedily (decode-time policies keep evicting). "
        "Several prompts are answered as one left-padded batch, each row evicted on its own (each gets what it gets "
        "alone); their answers are printed in order, each as '[i] answer'.",
    )
    parser.add_argument(
        "prompt",
        nargs="+",
        help="the prompt text, or '-' to read it from standard input; several prompts: generated as one batch",
    )
    parser.add_argument(
        "--policy",
        default="full",
        help="policy name (see `kvevict policies`; default: full), parameters in brackets: "
        "lazyeviction[window=22], critical+snapkv[critical.alpha=0]",
    )
    budget_args(parser)
    quant_args(parser)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    model_args(parser)
    parser.set_defaults(run=run, extra=None)


def run(args: argparse.Namespace) -> int:
    from kvevict import Budget, EvictionCache, answer, make_policy

    policy = make_policy(args.policy)  # bad input fails before the model loads
    storage = quant_options(args)
    if args.budget is not None:
        Budget(args.budget, args.keep)
        policy.check_budget(args.budget)
    if args.prompt.count("-") > 1:
        raise ValueError("'-' (read the prompt from standard input) can stand for one prompt only")
    prompts = [sys.stdin.read() if prompt == "-" else prompt for prompt in args.prompt]
    model, tokenizer = load_model_from(args)
    cache = EvictionCache(model, policy, budget=args.budget, keep=args.keep, interval=args.interval, **storage)
    replies = answer(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens, cache=cache)
    for i, reply in enumerate(replies, start=1):
        print(reply if len(replies) == 1 else f"[{i}] {reply}")
    print(
        f"[{args.policy}, {cache.budget}] tokens seen {cache.get_seq_length()}, {cache.kept()}, "
        f"KV {cache.kv_bytes() / 2**20:.2f} MiB",
        file=sys.stderr,
    )
    return 0
