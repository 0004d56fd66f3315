"""``kvevict bench decode-speed``: the cost of a decode step under eviction.

A decode step under an eviction policy is timed against a step of a full transformers
``DynamicCache`` holding the same number of entries (``entries`` per KV head): the eviction
cache is prefilled with a longer prompt and evicts to ``entries``, then every step appends
one entry and evicts at the policy's own default interval (R-KV: its buffer; most policies:
every step), or every ``interval`` steps when given; the full cache is prefilled with ``entries``
tokens and cropped back after every step (a policy that evicts nothing, such as ``full``, is
paired with a full cache given the same prompt, both growing a step at a time: the same entries
at every step). Steps are measured in pairs, a full-cache step right before each policy step,
``steps`` pairs per policy in turns (round robin, ``repeats`` times): on a shared machine the
load of other processes drifts over seconds, so each policy is compared with full-cache steps taken under the same load.

A policy that evicts every ``W`` steps pays for an eviction once per ``W`` steps, so its
steps are taken in whole intervals (a turn is at least one interval long, a multiple of it)
and compared interval by interval: the ratio of an interval's step times to its paired
full-cache steps, amortized over the interval, eviction included; the median over the
intervals is reported (:func:`paired_ratio`; for ``W = 1`` the median of the pairs'
ratios: unlike the ratio of two medians, it compares each step only with its own pair).
The command prints a table per batch size as soon as that batch size is measured, so a run
stopped later keeps it. A benchmark, never a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from kvevict.bench.clock import seconds
from kvevict.bench.options import comma_separated, device_option
from kvevict.bench.report import markdown_records
from kvevict.cache import EvictionCache
from kvevict.compat import with_cache
from kvevict.policies import make_policy, split_names

POLICIES = ("streamingllm", "epikv", "tova", "h2o", "lazyeviction", "snapkv")


def _step_seconds(model: PreTrainedModel, cache: object, token: torch.Tensor) -> float:
    """Seconds of one single-token pass through ``cache``."""
    return seconds(model.device, model, input_ids=token, **with_cache(cache), use_cache=True)


def _evicts(cache: EvictionCache) -> bool:
    """Whether ``cache``'s prefill left it holding fewer entries than it was given."""
    return cache.layers[0].n < cache.get_seq_length()


def _grown_alongside(model: PreTrainedModel, ids: torch.Tensor) -> DynamicCache:
    """A full cache holding ``ids``, as a policy that evicts nothing holds them (both then grow a step at a time)."""
    cache = DynamicCache()
    model(input_ids=ids, **with_cache(cache), use_cache=True)
    return cache


def blocks(times: Sequence[float], block: int) -> list[float]:
    """The sums of ``times`` over consecutive blocks of ``block`` steps (whole blocks only)."""
    return [sum(times[start : start + block]) for start in range(0, len(times) - block + 1, block)]


def paired_ratio(times: Sequence[float], full_times: Sequence[float], block: int = 1) -> float:
    """The median over consecutive blocks of ``block`` pairs (steps taken back to back; a block
    is one eviction interval) of the block's ``Σ times / Σ full_times``; with ``block=1`` the
    median of the pairs' ratios."""
    if len(times) != len(full_times) or len(times) < block:
        raise ValueError(f"paired steps needed: got {len(times)} steps against {len(full_times)} full-cache steps")
    return statistics.median(step / full for step, full in zip(blocks(times, block), blocks(full_times, block)))


def measure(
    model: PreTrainedModel,
    policies: Sequence[str] = POLICIES,
    *,
    entries: int = 512,
    batch_sizes: Sequence[int] = (1, 8),
    steps: int = 8,
    repeats: int = 5,
    seed: int = 0,
    quant: str | None = None,
    interval: int | None = None,
    progress: bool = True,
) -> list[dict[str, object]]:
    """Rows ``{batch, policy, interval, ms, full_ms, ratio}``: the median over eviction intervals
    of the mean step time under each policy, of the full-cache steps paired with its steps, and
    of the interval's ratio (:func:`paired_ratio`). ``interval``: every policy evicts every
    ``interval`` steps; None, at its own default. A turn takes ``steps`` pairs, rounded up to
    whole intervals. ``progress``: a bar over each batch size's prefills and turns."""
    from tqdm import tqdm

    vocab = model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(seed)
    rows = []
    bar = tqdm(total=len(batch_sizes) * len(policies) * (1 + repeats), desc="bench decode-speed", disable=not progress)
    for batch in batch_sizes:
        ids = torch.randint(min(100, vocab // 2), vocab, (batch, entries + 64), generator=generator).to(model.device)
        token = ids[:, -1:]
        caches: dict[str, EvictionCache] = {}
        with torch.inference_mode():
            for name in policies:
                caches[name] = EvictionCache(model, name, budget=entries, interval=interval, quant=quant)
                model(input_ids=ids, **with_cache(caches[name]), use_cache=True)
                bar.update()
            full = DynamicCache()
            model(input_ids=ids[:, :entries], **with_cache(full), use_cache=True)
            paired = {name: full if _evicts(caches[name]) else _grown_alongside(model, ids) for name in policies}
            every = {name: caches[name].sequences[0].interval for name in policies}
            times: dict[str, list[float]] = {name: [] for name in policies}
            full_times: dict[str, list[float]] = {name: [] for name in policies}
            for _ in range(repeats):
                for name in policies:
                    for _ in range(-(-steps // every[name]) * every[name]):
                        full_times[name].append(_step_seconds(model, paired[name], token))
                        if paired[name] is full:
                            full.crop(-1)  # back to `entries`
                        times[name].append(_step_seconds(model, caches[name], token))
                    bar.update()
        for name in policies:
            block = every[name]
            ms, full_ms = (
                1e3 * statistics.median(blocks(values[name], block)) / block for values in (times, full_times)
            )
            ratio = paired_ratio(times[name], full_times[name], block)
            label = name if quant is None else f"{name} ({quant})"
            rows.append(
                {"batch": batch, "policy": label, "interval": block, "ms": ms, "full_ms": full_ms, "ratio": ratio}
            )
        for cache in caches.values():
            cache.close()
    bar.close()
    return rows


def format_table(rows: list[dict[str, object]]) -> str:
    return markdown_records(
        rows,
        {
            "policy": "{policy}",
            "batch": "{batch}",
            "interval": "{interval}",
            "ms / step": "{ms:.1f}",
            "full DynamicCache ms / step": "{full_ms:.1f}",
            "ratio": "{ratio:.2f}x",
        },
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvevict bench decode-speed",
        description="Time a decode step under eviction against a full DynamicCache holding the same entries.",
    )
    parser.add_argument("--model", default="smollm2", help="model name or path (default: the embedded smollm2)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    device_option(parser)
    parser.add_argument("--entries", type=int, default=512, help="entries held per KV head (default 512)")
    parser.add_argument(
        "--batch-sizes",
        type=comma_separated(int, low=1),
        default=(1, 8),
        help="comma-separated batch sizes (default 1,8)",
    )
    parser.add_argument("--steps", type=int, default=8, help="paired decode steps per policy and round (default 8)")
    parser.add_argument(
        "--interval",
        type=int,
        default=None,
        help="evict every INTERVAL steps (default: each policy's own default interval)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="rounds of paired steps over the policies (default 5)")
    parser.add_argument(
        "--quant", choices=("int8", "int4", "int2"), default=None, help="quantized storage (kvevict.quant)"
    )
    return parser


def main(argv: Sequence[str]) -> int:
    from kvevict.models import load_model

    args = build_parser().parse_args(argv)
    if args.entries < 1 or args.steps < 1 or args.repeats < 1 or (args.interval is not None and args.interval < 1):
        raise ValueError("--entries, --steps, --repeats and --interval must be >= 1")
    policies = split_names(args.policies)
    for name in policies:
        make_policy(name)  # an unknown policy fails before the model loads
    model, _ = load_model(args.model, device=args.device)
    # a table per batch size as soon as it is measured: an interrupted run keeps the ones it finished
    for index, batch in enumerate(args.batch_sizes):
        if index:
            print(flush=True)
        rows = measure(
            model,
            policies,
            entries=args.entries,
            batch_sizes=(batch,),
            steps=args.steps,
            repeats=args.repeats,
            quant=args.quant,
            interval=args.interval,
        )
        print(format_table(rows), flush=True)
    return 0
