"""``kvevict ask``: answer questions from a compressed document that ``kvevict compress`` saved."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

from kvevict.commands.common import Subcommands


def add_parser(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "ask",
        help="answer questions from a saved compressed document (`kvevict compress`)",
        description="Load a cache `kvevict compress` saved, into the model it was saved from (its identity is "
        "checked), and answer each question greedily from a copy of it: the document is never prefilled again.",
    )
    parser.add_argument("cache", type=Path, help="the saved, compressed document (e.g. doc.kv)")
    parser.add_argument("question", nargs="+", help="one or more questions about the document")
    parser.add_argument("--answer-prefix", default="", help="text the answer starts with (default: none)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per answer (default: 64)")
    parser.add_argument(
        "--model",
        default=None,
        help="the model to load (default: the one the cache was saved from, when kvevict.load_model loaded it)",
    )
    parser.add_argument("--dtype", default=None, help="the dtype the cache was saved with (default: the model's)")
    parser.set_defaults(run=run, extra=None)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    import kvevict
    from kvevict.generation import greedy_after, question_ids, stop_tokens_of
    from kvevict.persist import read_file, source_of

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be a positive number of tokens, got {args.max_new_tokens}")
    source = args.model or source_of(read_file(args.cache, tensors=False)[0])
    if source is None:
        raise ValueError(f"{args.cache} does not say which model it was saved from: give --model")
    model, tokenizer = kvevict.load_model(source, dtype=args.dtype)
    saved = kvevict.EvictionCache.load(args.cache, model)
    stop = stop_tokens_of(model)
    questions = tqdm(args.question, desc="questions", unit="question", disable=len(args.question) < 2)
    for i, question in enumerate(questions, start=1):
        cache = copy.deepcopy(saved) if i < len(args.question) else saved
        ids = question_ids(tokenizer, question, args.answer_prefix)
        reply = tokenizer.decode(greedy_after(model, cache, ids, args.max_new_tokens, stop), skip_special_tokens=True)
        print(reply.strip() if len(args.question) == 1 else f"[{i}] {reply.strip()}", flush=True)
    return 0
