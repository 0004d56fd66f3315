"""``kvevict bench vllm``: vLLM alone against vLLM with the kvevict plug-in, under one KV pool.

Run from the vLLM environment (``make vllm``). The workload is long generation: ``--prompts``
essay prompts of ``--prompt-tokens`` tokens, each generating exactly ``--new-tokens`` greedy
tokens, all submitted at once to an engine whose KV pool holds ``--pool-sequences`` full-length
sequences (blocks of ``--block-size``). Each run (``full``, vLLM alone; then each policy at each
budget) builds its engine, warms it up, and steps it by hand in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the scheduler's pool can be read at every step).
vLLM alone runs in its own default mode, which compiles the model (``--enforce-eager``: eagerly,
as the plug-in runs). Each run measures:

- tokens/s over the whole run, the most requests running at once, and the requests preempted;
- time to first token and inter-token latency (p50, p95) over the requests;
- KV blocks in use after every step (plotted against time beside tokens/s);
- teacher-forced top-1 agreement and KL against the full cache: vLLM alone's sequences fed
  through kvevict's own cache under the same policy (:func:`~kvevict.bench.fidelity.teacher_forced`;
  the plug-in keeps the same entries, ``tests/vllm/test_engine.py``).

Each finished run is one line of ``OUT/results.jsonl`` (a rerun skips it), then the table and
the plot. A benchmark, never a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvevict.bench.options import comma_separated
from kvevict.bench.report import text_table
from kvevict.bench.store import ResultStore

WORKLOAD = "longgen"


def prompts_of(tokenizer: Any, count: int, tokens: int) -> list[list[int]]:
    """``count`` prompts of ``tokens`` tokens, each from another stretch of the offline essays."""
    from kvevict.bench.haystack import essays

    text = essays()
    prompts = []
    for index in range(count):
        ids = tokenizer(text[3000 * index : 3000 * index + 8 * tokens]).input_ids[:tokens]
        if len(ids) < tokens:
            raise ValueError(f"the essays hold too little text for {count} prompts of {tokens} tokens")
        prompts.append(ids)
    return prompts


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's arguments, the same for every run: a pool of ``--pool-sequences`` full-length sequences."""
    final = args.prompt_tokens + args.new_tokens
    blocks = args.pool_sequences * -(-final // args.block_size) + 1
    return {
        "dtype": "float32",
        "block_size": args.block_size,
        "num_gpu_blocks_override": blocks,
        "max_model_len": final + args.block_size,
        "gpu_memory_utilization": args.memory_utilization,
        "max_num_seqs": args.prompts,
        "seed": 0,
    }


def serve(llm: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Submit every prompt at once and step the engine to the end; what the run measured."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    total_blocks = pool.num_gpu_blocks - 1  # one block is vLLM's null block
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for index, ids in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": ids}, params)
    seen: dict[str, list[float]] = {}
    sequences: dict[str, list[int]] = {}
    series, most_running, preempted = [], 0, set()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - start
        running = core.scheduler.running
        most_running = max(most_running, len(running))
        preempted |= {request.request_id for request in running if request.num_preemptions}
        series.append((round(now, 4), total_blocks - pool.get_num_free_blocks(), len(running)))
        for output in outputs:
            times = seen.setdefault(output.request_id, [])
            times.extend([now] * (len(output.outputs[0].token_ids) - len(times)))
            if output.finished:
                sequences[output.request_id] = list(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    tokens = sum(len(tokens) for tokens in sequences.values())
    gaps = [later - earlier for times in seen.values() for earlier, later in itertools.pairwise(times)]
    firsts = [times[0] for times in seen.values()]
    return {
        "seconds": elapsed,
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "most_running": most_running,
        "preempted": len(preempted),
        "ttft_p50": statistics.median(firsts),
        "itl_p50": statistics.median(gaps),
        "itl_p95": statistics.quantiles(gaps, n=20)[-1] if len(gaps) > 1 else gaps[0],
        "blocks": series,
        "pool_blocks": total_blocks,
        "sequences": [sequences[str(index)] for index in range(len(prompts))],
    }


def run_engine(model: str, policy: str, budget: int | None, args: argparse.Namespace, prompts: list[list[int]]):
    """One run: its engine built, warmed up, stepped to the end, shut down."""
    import vllm

    import kvevict.vllm

    settings = engine_args(args)
    if policy == "full":  # vLLM's own mode (it compiles the model) unless --enforce-eager, as the plug-in runs
        llm = vllm.LLM(model=model, enforce_eager=args.enforce_eager, **kvevict.vllm.ENGINE_FLAGS, **settings)
    else:
        llm = kvevict.vllm.LLM(model, policy, budget=budget, interval=args.interval, **settings)
    try:
        llm.generate([{"prompt_token_ids": prompts[0][:8]}], vllm.SamplingParams(max_tokens=4), use_tqdm=False)
        return serve(llm, prompts, args.new_tokens)
    finally:
        llm.llm_engine.engine_core.shutdown()


def fidelity(model_dir: str, policy: str, budget: int, interval: int, prompts, sequences) -> tuple[float, float]:
    """Teacher-forced top-1 and mean KL of ``policy`` against the full cache along ``sequences``."""
    import torch

    import kvevict
    from kvevict.bench.fidelity import teacher_forced

    model, _ = kvevict.load_model(model_dir)
    rows = teacher_forced(
        model,
        [torch.tensor([ids]) for ids in prompts],
        sequences,
        lambda: kvevict.EvictionCache(model, policy, budget=budget, interval=interval),
        progress=True,
    )
    return sum(row[0] for row in rows) / len(rows), sum(row[1] for row in rows) / len(rows)


def table(records: list[dict[str, Any]]) -> list[str]:
    full = next((r for r in records if r["policy"] == "full"), None)
    header = ["policy", "budget", "tokens/s", "vs vLLM", "running", "preempted", "TTFT p50", "ITL p50", "ITL p95"]
    header += ["top-1", "KL"]
    rows = []
    for record in records:
        ratio = f"{record['tokens_per_s'] / full['tokens_per_s']:.2f}x" if full else "-"
        rows.append(
            [
                record["policy"],
                str(record["budget"] or "-"),
                f"{record['tokens_per_s']:.1f}",
                ratio,
                str(record["most_running"]),
                str(record["preempted"]),
                f"{record['ttft_p50']:.2f} s",
                f"{1000 * record['itl_p50']:.0f} ms",
                f"{1000 * record['itl_p95']:.0f} ms",
                "-" if record.get("top1") is None else f"{100 * record['top1']:.2f}%",
                "-" if record.get("kl") is None else f"{record['kl']:.4f}",
            ]
        )
    return text_table(header, rows)


def plot(records: list[dict[str, Any]], path: Path) -> bool:
    """Blocks in use against time per run, and tokens/s per run; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (blocks, speed) = plt.subplots(1, 2, figsize=(11, 4))
    labels = []
    for record in records:
        label = record["policy"] if record["budget"] is None else f"{record['policy']} @ {record['budget']}"
        labels.append(label)
        times, used, _ = zip(*record["blocks"])
        blocks.plot(times, used, label=label)
    blocks.axhline(records[0]["pool_blocks"], color="grey", linestyle=":", label="pool")
    blocks.set(xlabel="seconds", ylabel="KV blocks in use", title="the pool over the run")
    blocks.legend()
    speed.bar(labels, [record["tokens_per_s"] for record in records], color="tab:blue")
    speed.set(ylabel="tokens/s", title="throughput under the same pool")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvevict bench vllm",
        description="vLLM alone against vLLM with the kvevict plug-in under one KV pool (run in the vLLM "
        "environment); resumable.",
    )
    parser.add_argument("--model", default="smollm2", help="smollm2 (default) or a local model directory")
    parser.add_argument("--policies", type=comma_separated(str), default=["tova"], help="(default: tova)")
    parser.add_argument("--budgets", type=comma_separated(int), default=[224], help="(default: 224)")
    parser.add_argument("--interval", type=int, default=16, help="decode steps between evictions (default: 16)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--pool-sequences", type=int, default=2, help="full-length sequences the pool holds")
    parser.add_argument("--block-size", type=int, default=32, help="(default: 32, the CPU kernels' smallest)")
    parser.add_argument("--memory-utilization", type=float, default=0.3, help="vLLM's gpu_memory_utilization")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run vLLM alone eagerly, as the plug-in runs (default: vLLM's own mode, which compiles the model)",
    )
    parser.add_argument("--no-fidelity", action="store_true", help="skip the teacher-forced comparison")
    parser.add_argument("--out", type=Path, default=Path("results/vllm"))
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    if min(args.prompts, args.prompt_tokens, args.new_tokens, args.pool_sequences, args.interval) < 1:
        raise ValueError("--prompts, --prompt-tokens, --new-tokens, --pool-sequences and --interval must be >= 1")
    if args.block_size % 32:
        raise ValueError(f"--block-size must be a multiple of 32 (vLLM's CPU kernels), got {args.block_size}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the pool is read at every step
    from transformers import AutoTokenizer

    from kvevict.models import smollm2_checkpoint

    model = str(smollm2_checkpoint()) if args.model == "smollm2" else args.model
    prompts = prompts_of(AutoTokenizer.from_pretrained(model), args.prompts, args.prompt_tokens)
    store = ResultStore(args.out)
    task = f"vllm-{WORKLOAD}-{args.prompts}x{args.prompt_tokens}-pool{args.pool_sequences}x{args.block_size}"
    runs = [("full", None), *((policy, budget) for policy in args.policies for budget in args.budgets)]
    records = []
    for policy, budget in runs:
        identity = {
            "task": task,
            "policy": policy,
            "budget": budget,
            "interval": None if policy == "full" else args.interval,
            "model": args.model,
            "max_new_tokens": args.new_tokens,
        }
        if identity in store:
            records.append(store.get(identity))
            continue
        print(f"{policy}" + (f" at budget {budget}" if budget else "") + ": serving ...", flush=True)
        record = {**identity, **run_engine(model, policy, budget, args, prompts)}
        full = next((r for r in records if r["policy"] == "full"), None)
        if policy != "full" and full is not None and not args.no_fidelity:
            record["top1"], record["kl"] = fidelity(model, policy, budget, args.interval, prompts, full["sequences"])
        store.append(record)
        records.append(record)
    print("\n".join(table(records)))
    if plot(records, args.out / "vllm.png"):
        print(f"plot: {args.out / 'vllm.png'}")
    return 0
