"""The ``kvevict`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

EXIT_USAGE = 2


def _budget_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--budget", type=int, help="retained tokens per KV head per layer")
    group.add_argument("--keep", type=float, help="fraction of the prompt to retain (prefill), in (0, 1]")
    parser.add_argument("--interval", type=int, default=1, help="decode-time eviction every N steps (default: 1)")


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="'smollm2' (embedded, offline), a hub id or a local path")
    parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16 or auto")
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda (default: where the model loads)")
    parser.add_argument("--attn", default=None, help="base attention kernel: sdpa (default), eager, flash_attention_2")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvevict", description="KV-cache eviction for Hugging Face transformers.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    commands.add_parser("policies", help="list the eviction policies", description="List every registered policy.")

    generate = commands.add_parser(
        "generate",
        help="answer a prompt with a compressed cache",
        description="Compress the prompt under a policy, then decode greedily (decode-time policies keep evicting).",
    )
    generate.add_argument("prompt", help="the prompt text, or '-' to read it from standard input")
    generate.add_argument("--policy", default="full", help="policy name (see `kvevict policies`; default: full)")
    _budget_args(generate)
    generate.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    _model_args(generate)

    demo = commands.add_parser(
        "demo",
        help="needle retrieval under every baseline at two budgets",
        description="Answer a ~2k-token needle-in-a-haystack prompt under each baseline and print a table.",
    )
    demo.add_argument("--model", default="smollm2", help="model to load (default: the embedded smollm2)")
    demo.add_argument("--length", type=int, default=2048, help="prompt length in tokens (default: 2048)")
    demo.add_argument("--budgets", default="256,1024", help="comma-separated budgets (default: 256,1024)")
    demo.add_argument(
        "--context-only",
        action="store_true",
        help="compress the context before the question is seen (default: query-aware)",
    )
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvevict")
    except PackageNotFoundError:
        return "unknown"


def _policies() -> int:
    from kvevict.policies import describe_policies

    rows = describe_policies()
    width = max(len(name) for name, _ in rows)
    for name, summary in rows:
        print(f"{name.ljust(width)}  {summary}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kvevict import Budget, EvictionCache, answer, load_model, make_policy

    policy = make_policy(args.policy)  # bad input fails before the model loads
    if args.budget is not None:
        Budget(args.budget, args.keep)
        policy.check_budget(args.budget)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn)
    cache = EvictionCache(model, policy, budget=args.budget, keep=args.keep, interval=args.interval)
    print(answer(model, tokenizer, prompt, max_new_tokens=args.max_new_tokens, cache=cache))
    lengths = cache.layer_lengths()
    print(
        f"[{args.policy}, {cache.budget}] tokens seen {cache.get_seq_length()}, retained {max(lengths)} per KV head, "
        f"KV {cache.kv_bytes() / 2**20:.2f} MiB",
        file=sys.stderr,
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvevict.demo import format_table, run_demo

    budgets = tuple(int(value) for value in args.budgets.split(","))
    rows = run_demo(args.model, length=args.length, budgets=budgets, query_aware=not args.context_only)
    print(format_table(rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"policies": lambda: _policies(), "generate": lambda: _generate(args), "demo": lambda: _demo(args)}
    try:
        return handlers[args.command]()
    except (ValueError, FileNotFoundError) as err:
        print(f"kvevict {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
