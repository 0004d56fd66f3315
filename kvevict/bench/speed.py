"""``kvevict bench decode-speed``: the cost of a decode step under eviction.

A decode step under an eviction policy is timed against a step of a full transformers
``DynamicCache`` holding the same number of entries (``entries`` per KV head): the eviction
cache is prefilled with a longer prompt and evicts to ``entries``, then every step appends
one entry and evicts at the policy's own default interval (R-KV: its buffer; most policies:
every step), or every ``interval`` steps when given; the full cache is prefilled with ``entries`` tokens
and cropped back after every step. Steps are measured in pairs, a full-cache step right
before each policy step, ``steps`` pairs per policy in turns (round robin, ``repeats``
times): on a shared machine the load of other processes drifts over seconds, so each
policy is compared with full-cache steps taken under the same load. The median step time of
each is reported, and the ratio is the median of the pairs' ratios (:func:`paired_ratio`):
unlike the ratio of the two medians, it compares each step only with its own pair.
A benchmark, never a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from kvevict.bench.options import comma_separated
from kvevict.cache import EvictionCache
from kvevict.compat import with_cache
from kvevict.policies import split_names

POLICIES = ("streamingllm", "epikv", "tova", "h2o", "lazyeviction", "snapkv")


def _step_seconds(model: PreTrainedModel, cache: object, token: torch.Tensor) -> float:
    """Seconds of one single-token pass through ``cache``."""
    start = time.perf_counter()
    model(input_ids=token, **with_cache(cache), use_cache=True)
    return time.perf_counter() - start


def paired_ratio(times: Sequence[float], full_times: Sequence[float]) -> float:
    """The median of ``times[i] / full_times[i]`` over the pairs ``i`` (steps taken back to back)."""
    if len(times) != len(full_times) or not times:
        raise ValueError(f"paired steps needed: got {len(times)} steps against {len(full_times)} full-cache steps")
    return statistics.median(step / full for step, full in zip(times, full_times))


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
) -> list[dict[str, object]]:
    """Rows ``{batch, policy, ms, full_ms, ratio}``: median step time under each policy, of the
    full-cache steps paired with its steps, and the median ratio of a pair (:func:`paired_ratio`).
    ``interval``: every policy evicts every ``interval`` steps; None, at its own default."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for batch in batch_sizes:
        ids = torch.randint(min(100, vocab // 2), vocab, (batch, entries + 64), generator=generator).to(model.device)
        token = ids[:, -1:]
        caches: dict[str, EvictionCache] = {}
        with torch.inference_mode():
            for name in policies:
                caches[name] = EvictionCache(model, name, budget=entries, interval=interval, quant=quant)
                model(input_ids=ids, **with_cache(caches[name]), use_cache=True)
            full = DynamicCache()
            model(input_ids=ids[:, :entries], **with_cache(full), use_cache=True)
            times: dict[str, list[float]] = {name: [] for name in policies}
            full_times: dict[str, list[float]] = {name: [] for name in policies}
            for _ in range(repeats):
                for name in policies:
                    for _ in range(steps):
                        full_times[name].append(_step_seconds(model, full, token))
                        full.crop(-1)  # back to `entries`
                        times[name].append(_step_seconds(model, caches[name], token))
        for name in policies:
            ms, full_ms = (1e3 * statistics.median(values[name]) for values in (times, full_times))
            ratio = paired_ratio(times[name], full_times[name])
            label = name if quant is None else f"{name} ({quant})"
            rows.append({"batch": batch, "policy": label, "ms": ms, "full_ms": full_ms, "ratio": ratio})
        for cache in caches.values():
            cache.close()
    return rows


def format_table(rows: list[dict[str, object]]) -> str:
    lines = ["| policy | batch | ms / step | full DynamicCache ms / step | ratio |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['policy']} | {row['batch']} | {row['ms']:.1f} | {row['full_ms']:.1f} | {row['ratio']:.2f}x |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvevict bench decode-speed",
        description="Time a decode step under eviction against a full DynamicCache holding the same entries.",
    )
    parser.add_argument("--model", default="smollm2", help="model name or path (default: the embedded smollm2)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
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
    model, _ = load_model(args.model)
    rows = measure(
        model,
        split_names(args.policies),
        entries=args.entries,
        batch_sizes=args.batch_sizes,
        steps=args.steps,
        repeats=args.repeats,
        quant=args.quant,
        interval=args.interval,
    )
    print(format_table(rows))
    return 0
