"""``kvevict compress``: compress a document once into a file that ``kvevict ask`` answers from."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvevict.commands.common import Subcommands, budget_args, load_model_from, model_args, quant_args, quant_options


def add_parser(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "compress",
        help="compress a document's KV cache once and save it (answer it later with `kvevict ask`)",
        description="Prefill a text file as a context on its own (context-only: no question is known yet), compress "
        "its KV cache under a policy (a query-agnostic one such as kvzip or fastkvzip keeps what any question "
        "needs), and save the compressed cache (safetensors, with the model's identity) for `kvevict ask`.",
    )
    parser.add_argument("file", type=Path, help="the document: a UTF-8 text file ('-': standard input)")
    parser.add_argument("--policy", default="kvzip", help="policy name, parameters in brackets (default: kvzip)")
    budget_args(parser)
    quant_args(parser)
    parser.add_argument("--out", type=Path, required=True, help="where to write the compressed cache (e.g. doc.kv)")
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prefill the document this many tokens at a time (bounded memory; policies that score chunks only)",
    )
    model_args(parser)
    parser.set_defaults(run=run, extra=None)


def read_document(path: Path) -> str:
    """The document's text (``-``: standard input); an unreadable or empty file is refused."""
    if str(path) == "-":
        text = sys.stdin.read()
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise OSError(f"cannot read the document {str(path)!r}: {error}") from None
    if not text.strip():
        raise ValueError(f"the document {str(path)!r} is empty")
    return text


def run(args: argparse.Namespace) -> int:
    from kvevict import Budget, EvictionCache, make_policy
    from kvevict.generation import check_chunk, prefill, split_prompt

    policy = make_policy(args.policy)  # bad input fails before the model loads
    storage = quant_options(args)
    if args.budget is None and args.keep is None and policy.method.evicts:
        raise ValueError("give --keep (a fraction of the document) or --budget (tokens per KV head)")
    if args.budget is not None:
        Budget(args.budget, args.keep)
        policy.check_budget(args.budget)
    check_chunk(args.prefill_chunk)
    text = read_document(args.file)
    model, tokenizer = load_model_from(args)
    context = split_prompt(tokenizer, text)[0]
    cache = EvictionCache(model, policy, budget=args.budget, keep=args.keep, interval=args.interval, **storage)
    prefill(model, context, cache, chunk=args.prefill_chunk, progress=True)
    path = cache.save(args.out)
    full = context.shape[-1] * sum(cache.column_bytes())
    print(
        f"{args.file}: {context.shape[-1]} tokens compressed by {args.policy} ({cache.budget}): {cache.kept()}; "
        f"resident KV {cache.kv_bytes() / 2**20:.2f} MiB (uncompressed ~{full / 2**20:.2f} MiB); saved to {path} "
        f"({path.stat().st_size / 2**20:.2f} MiB)"
    )
    return 0
