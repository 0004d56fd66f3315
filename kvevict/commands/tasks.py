"""``kvevict tasks``: list the benchmark tasks, or write their samples' token ids for another tool."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvevict.commands.common import BENCH, Subcommands


def add_parser(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "tasks",
        help="list the benchmark tasks, or export their samples",
        description="List every benchmark task; with --export, write the samples `kvevict bench` would run "
        "(the compressed context's and the rest's token ids, the answers, the metric) as JSON lines, so another "
        "library can run exactly those prompts.",
    )
    parser.add_argument("tasks", nargs="?", default=None, help="with --export: comma-separated task names")
    parser.add_argument("--export", type=Path, default=None, help="a JSON-lines file to write the samples into")
    parser.add_argument("--length", type=int, default=2048, help="prompt length in tokens (default: 2048)")
    parser.add_argument("--samples", type=int, default=4, help="samples per task (default: 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated samples (default: 0)")
    parser.add_argument("--model", default="smollm2", help="whose tokenizer fits the lengths (default: smollm2)")
    parser.add_argument(
        "--query-aware",
        action="store_true",
        help="the compressed part is the whole prompt but its last token, as `kvevict bench --query-aware` compresses",
    )
    parser.set_defaults(run=run, extra=BENCH)


def run(args: argparse.Namespace) -> int:
    from kvevict.bench.tasks import all_tasks, get_task

    if args.export is None:
        tasks = all_tasks()
        width = max(map(len, tasks))
        for name, task in tasks.items():
            print(f"{name.ljust(width)}  {task.source:7}  {task.metric}")
        return 0
    if not args.tasks:
        raise ValueError("--export needs the tasks to export, e.g. `kvevict tasks niah_single_1 --export FILE`")
    if args.length < 1 or args.samples < 1:
        raise ValueError(f"--length and --samples must be positive, got {args.length} and {args.samples}")
    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    tasks = [get_task(name) for name in names]  # an unknown name fails before the tokenizer loads
    from transformers import AutoTokenizer

    from kvevict.bench.runner import PromptIds
    from kvevict.models import checkpoint_of

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_of(args.model))
    args.export.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with args.export.open("w", encoding="utf-8") as out:
        for task in tasks:
            for sample in task.samples(tokenizer, length=args.length, count=args.samples, seed=args.seed):
                prompt = PromptIds.of(tokenizer, sample)
                split = prompt.ids.shape[-1] - 1 if args.query_aware else prompt.head.shape[-1]
                record = {
                    "task": sample.task,
                    "index": sample.index,
                    "length": args.length,
                    "seed": args.seed,
                    "model": args.model,
                    "query_aware": args.query_aware,
                    "context_ids": prompt.ids[0, :split].tolist(),
                    "rest_ids": prompt.ids[0, split:].tolist(),
                    "answers": list(sample.answers),
                    "metric": task.metric,
                    "max_new_tokens": sample.max_new_tokens,
                }
                out.write(json.dumps(record) + "\n")
                written += 1
    print(f"{written} samples: {args.export}", file=sys.stderr)
    return 0
