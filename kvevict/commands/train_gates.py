"""``kvevict train-gates``: train Fast KVzip's gates for a model (:mod:`kvevict.gates.train`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvevict.bench.options import comma_separated
from kvevict.commands.common import BENCH
from kvevict.gates.train import DATA, TEACHERS, TrainConfig


def add_parser(commands: argparse._SubParsersAction) -> None:
    """``kvevict train-gates``."""
    parser = commands.add_parser(
        "train-gates",
        help="train Fast KVzip gates for a model (distilled from kvzip, on CPU)",
        description="Train Fast KVzip's gates for MODEL by distilling kvevict's kvzip scores; resumable.",
    )
    parser.add_argument("--model", required=True, help="smollm2, gemma3, a hub id or a local directory")
    parser.add_argument("--out", required=True, type=Path, help="folder for the data cache, checkpoint and gates")
    parser.add_argument(
        "--text", nargs="*", type=Path, default=[], help="text files to train on (default: offline data)"
    )
    defaults = TrainConfig(model="")
    parser.add_argument(
        "--length",
        type=comma_separated(int),
        default=defaults.length,
        help="tokens per context; several, comma-separated (1024,2048): the contexts take them in turn "
        f"(default: {','.join(map(str, defaults.length))})",
    )
    for key in ("count", "tokens", "top", "steps", "batch", "dim", "sinks", "rank", "seed"):
        parser.add_argument(f"--{key}", type=int, default=getattr(defaults, key))
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes collecting the contexts' data, one thread each (default 1; the same gates for any number)",
    )
    parser.add_argument(
        "--order",
        type=float,
        default=defaults.order,
        help=f"weight of a pairwise ranking term in the training loss (default: {defaults.order:g}; 0: BCE alone)",
    )
    parser.add_argument(
        "--listwise",
        type=float,
        default=defaults.listwise,
        help=f"weight of a listwise ranking term (each head's top entries first) in the training loss "
        f"(default: {defaults.listwise:g})",
    )
    parser.add_argument(
        "--data",
        choices=DATA,
        default=defaults.data,
        help="offline contexts: RULER's (default), varied needle families over four haystacks, the same in "
        "hundreds of phrasings (phrased), with 30 %% of them naming the value before its key "
        "(phrased-both-orders), or with contexts of six and eight keys too (phrased-dense)",
    )
    parser.add_argument(
        "--teacher",
        choices=TEACHERS,
        default=defaults.teacher,
        help=f"the scores the gates learn: kvzip+'s (kvzip[plus=true]), kvzip's, what every needle's answer reads "
        f"(answers; --data varied or phrased), or the larger of kvzip+'s and that (default: {defaults.teacher})",
    )
    parser.add_argument(
        "--judged",
        nargs="+",
        type=Path,
        default=[],
        metavar="RESULTS",
        help="instead of training, record in DIR's gates file how they were judged: the scores of --judged-policy "
        "and of full in these bench results.jsonl files, per task and keep",
    )
    parser.add_argument(
        "--judged-policy",
        default="fastkvzip",
        help="the setting in --judged's results that ran the gates, as kvevict report labels it (default: "
        "fastkvzip, its unquantized context-only runs; 'fastkvzip (int4)' its int4 ones)",
    )
    parser.set_defaults(run=run, extra=BENCH)


def run(args: argparse.Namespace) -> int:
    from kvevict.gates.train import SINKS, build
    from kvevict.models import load_model

    if args.judged:
        return judge(args)

    fields = (
        "count",
        "length",
        "tokens",
        "top",
        "steps",
        "batch",
        "dim",
        "sinks",
        "rank",
        "seed",
        "lr",
        "order",
        "listwise",
        "data",
        "teacher",
    )
    config = TrainConfig(model=args.model, **{key: getattr(args, key) for key in fields})
    if (
        min(config.length) <= SINKS + 1
        or config.tokens < 1
        or config.top < 0
        or config.order < 0
        or config.listwise < 0
        or config.count < 2
        or config.steps < 1
        or args.workers < 1
    ):
        raise ValueError(
            "--length must exceed 5, --tokens, --steps and --workers be >= 1, "
            "--top, --order and --listwise >= 0 and --count >= 2 (one is held out)"
        )
    torch.manual_seed(config.seed)
    torch.set_num_threads(1)  # the same arithmetic on every run: the same gates for a seed
    model, tokenizer = load_model(config.model)
    path = build(model, tokenizer, config, args.out, args.text, workers=args.workers)
    print(f"wrote {path}")
    return 0


def judge(args: argparse.Namespace) -> int:
    """``--judged``: the bench results' scores recorded in ``--out``'s gates file (:mod:`kvevict.gates.judged`)."""
    from transformers import AutoConfig

    from kvevict.gates import model_key
    from kvevict.gates.judged import record
    from kvevict.models import checkpoint_of

    config = AutoConfig.from_pretrained(checkpoint_of(args.model)).get_text_config(decoder=True)
    path = args.out / f"{model_key(config)}.safetensors"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: train the gates into --out first, or give the --out holding them")
    judged = record(path, args.judged, args.judged_policy)
    shares = [
        f"{share} %" + (" of full's score" if not i else "") + f" at keep {keep}"
        for i, (keep, share) in enumerate(judged["share_of_full"].items())
    ]
    print(f"recorded in {path}: {args.judged_policy} on {judged['samples']} samples keeps {', '.join(shares)}")
    return 0
