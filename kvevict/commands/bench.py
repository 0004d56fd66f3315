"""``kvevict bench``: run tasks × policies × budgets into a results directory; and
``kvevict bench memory|throughput|decode-speed|prefill-speed|quant|vllm``, benchmarks with
parsers of their own."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from kvevict.bench.options import comma_separated, quant_list
from kvevict.commands.common import BENCH, Subcommands, guarded, model_args, names, quant_args

SUBCOMMANDS = {
    "memory": "memory",
    "throughput": "throughput",
    "decode-speed": "speed",
    "prefill-speed": "prefill_speed",
    "quant": "quantized",
    "vllm": "served",
}
"""``kvevict bench NAME ...``: subcommands with parsers of their own, by the module of
:mod:`kvevict.bench` that runs them (its ``main(argv)``)."""
SUBCOMMAND_EXTRAS = {"vllm": "vllm-cpu"}
"""The extra a subcommand needs when it is not ``bench`` (``kvevict bench vllm`` runs in vLLM's environment)."""


def is_subcommand(argv: Sequence[str]) -> bool:
    """Whether ``argv`` (after ``kvevict``) runs a subcommand: it stands where the sweep's
    positional task list does, so the dispatcher routes it before parsing."""
    return argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in SUBCOMMANDS


def run_subcommand(argv: Sequence[str]) -> int:
    """Run ``kvevict bench NAME ARGS...`` (``argv`` after ``kvevict``)."""
    name = argv[1]

    def run() -> int:
        return importlib.import_module(f"kvevict.bench.{SUBCOMMANDS[name]}").main(argv[2:])

    return guarded(f"kvevict bench {name}", run, SUBCOMMAND_EXTRAS.get(name, BENCH))


def add_parser(commands: Subcommands) -> None:
    bench = commands.add_parser(
        "bench",
        help="run tasks × policies × budgets into a results directory",
        description="Run every task × policy × budget; one JSON line per sample in OUT/results.jsonl. "
        "Resumable: finished samples are skipped when the same command runs again. "
        "`kvevict bench memory --help`: the prefill peak-memory microbenchmark; "
        "`kvevict bench decode-speed --help`: the cost of a decode step under eviction; "
        "`kvevict bench prefill-speed --help`: the cost of compressing a prompt against a plain prefill; "
        "`kvevict bench throughput --help`: sequences served per second under a KV memory cap; "
        "`kvevict bench quant --help`: quantized storage against transformers' QuantizedCache.",
    )
    bench.add_argument("tasks", type=names, help="comma-separated task names (see `kvevict tasks`)")
    bench.add_argument(
        "--policies",
        type=names,
        default=("full",),
        help="comma-separated policies (default: full); parameters in brackets: h2o,lazyeviction[window=22]",
    )
    budgets = bench.add_mutually_exclusive_group()
    budgets.add_argument(
        "--budgets", type=comma_separated(int), default=(), help="comma-separated budgets, tokens per KV head per layer"
    )
    budgets.add_argument(
        "--keep", type=comma_separated(float), default=(), help="comma-separated fractions of the prompt to keep"
    )
    bench.add_argument("--length", type=int, default=2048, help="prompt length in tokens (default: 2048)")
    bench.add_argument("--samples", type=int, default=4, help="samples per task (default: 4)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the generated samples (default: 0)")
    bench.add_argument("--out", type=Path, required=True, help="results directory (created; resumed if it exists)")
    bench.add_argument("--query-aware", action="store_true", help="compress context + question (default: context only)")
    bench.add_argument(
        "--interval", type=int, default=None, help="decode-time eviction every N steps (default: the policy's)"
    )
    bench.add_argument(
        "--fidelity", action="store_true", help="also replay the full cache's answer: top-1, KL, perplexity"
    )
    bench.add_argument("--max-new-tokens", type=int, default=None, help="override every task's generation length")
    bench.add_argument(
        "--quant",
        type=quant_list,
        default=(),
        help="run every setting with each quantized storage, e.g. none,int8,int4,int2 (none: full precision; "
        "full also runs quantized when listed; the full-precision full cache stays the reference)",
    )
    quant_args(bench, several=True)
    bench.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="C",
        help="compress each prompt C tokens per pass: at most budget + C entries per KV head (default: one pass)",
    )
    bench.add_argument(
        "--batch-size",
        type=int,
        default=1,
        metavar="N",
        help="run N samples (of one task and setting) as one left-padded batch, each evicted on its own: the same "
        "results as one by one (default: 1); fidelity replays stay one at a time",
    )
    model_args(bench)
    cluster = bench.add_argument_group(
        "Ray cluster",
        "Spread the sweep over Ray actors, each loading the model once; the same results, resumable as "
        "ever. Needs pip install 'kvevict[ray]'. Exit status 1 if a unit of work failed.",
    )
    cluster.add_argument(
        "--workers", type=int, default=None, metavar="N", help="run on N Ray workers (default: in this process)"
    )
    cluster.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="join this running cluster (ray start --head prints it; 'auto': this node's); default: start a local "
        "cluster for the sweep and stop it afterwards",
    )
    cluster.add_argument(
        "--gpus-per-worker",
        type=float,
        default=0.0,
        metavar="G",
        help="GPUs per worker, fractions share one (default: 0); with GPUs the model loads on cuda",
    )
    cluster.add_argument(
        "--cpus-per-worker", type=float, default=1.0, metavar="C", help="CPUs and torch threads per worker (default: 1)"
    )
    bench.set_defaults(run=run, extra=BENCH)


def run(args: argparse.Namespace) -> int:
    from kvevict.bench.report import format_report, summarize
    from kvevict.bench.runner import BenchConfig, BenchRunner

    config = BenchConfig(
        tasks=args.tasks,
        model=args.model,
        policies=args.policies,
        budgets=args.budgets,
        keeps=args.keep,
        length=args.length,
        samples=args.samples,
        seed=args.seed,
        query_aware=args.query_aware,
        interval=args.interval,
        fidelity=args.fidelity,
        max_new_tokens=args.max_new_tokens,
        prefill_chunk=args.prefill_chunk,
        batch_size=args.batch_size,
        quants=args.quant,
        quant_group=args.quant_group,
        residual=args.residual,
        dtype=args.dtype,
        device=args.device,
        attn=args.attn,
    )
    if args.workers is None:
        if args.ray_address is not None:
            raise ValueError("--ray-address needs --workers")
        store, failed = BenchRunner(config, args.out).run(), []
    else:
        from kvevict.bench.cluster import ClusterConfig, run_sweep

        cluster = ClusterConfig(args.workers, args.ray_address, args.gpus_per_worker, args.cpus_per_worker)
        sweep = run_sweep(config, args.out, cluster)
        store, failed = sweep.store, sweep.failed
    print(format_report(summarize(store)))
    print(f"results: {store.path}", file=sys.stderr)
    for failure in failed:
        print(f"kvevict bench: failed: {failure.describe()}", file=sys.stderr)
    if failed:
        print(f"kvevict bench: {len(failed)} units failed; run the same command to retry them", file=sys.stderr)
    return 1 if failed else 0
