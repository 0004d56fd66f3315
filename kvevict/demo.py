"""``make demo``: what kvevict is for, in three short acts on the embedded SmolLM2.

1. *Compress a document once, ask later*: context-only RULER needle tasks at two keep
   fractions, the full cache beside two baselines, the seeds' prefill methods and the best
   query-agnostic policy.
2. *Evict while generating*: a long greedy essay under a small budget, each decode-time method
   scored by its agreement with the full cache's tokens (top-1, KL).
3. *The payoff*: KV memory per sequence and end-to-end throughput under one memory cap, the
   full cache against act 1's best policy.

Every act writes its results under ``out`` (resumable: a rerun reuses what finished) and a plot;
the closing recommendation is computed from the numbers just measured.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvevict.bench.report import AVERAGE, ReportRow, plot_report, summarize, text_table
from kvevict.bench.runner import BenchConfig, BenchRunner
from kvevict.bench.throughput import Setting, ThroughputConfig, format_table, run_throughput, task_prompts
from kvevict.figures import pyplot, save_figure
from kvevict.models import load_model


@dataclass(frozen=True)
class DemoPlan:
    """The three acts' runs. ``payoff.policies`` is replaced by act 1's best policy at run time."""

    compress: BenchConfig
    generate: BenchConfig
    payoff: ThroughputConfig


DEMO = DemoPlan(
    compress=BenchConfig(
        tasks=("niah_single_1",),  # SmolLM2 answers it from the full cache, context-only, at 2k
        policies=(
            "full",
            "streamingllm",
            "snapkv",
            "critical+adakv+snapkv",  # CriticalKV (seed 004) over AdaKV
            "momentkv[mi=false]",  # MomentKV (seed 003) with NC; its MI loop costs ~8x a prefill on this CPU
            "kvzip",  # the best query-agnostic policy (docs/policies.md, "Query-agnostic compression")
        ),
        keeps=(0.25, 0.10),
        length=2048,
        samples=2,
        batch_size=2,
    ),
    generate=BenchConfig(
        tasks=("longgen",),
        policies=(
            "full",
            "tova",
            "h2o",
            "lazyeviction[alpha=0.002]",  # LazyEviction (seed 002), α calibrated for SmolLM2 (README)
            "epikv",  # EpiKV (seed 001)
            "rkv",
            "moment-nc+h2o",  # MomentKV's normalization-corrected inference (seed 003) over H2O
        ),
        budgets=(128,),
        samples=1,
        max_new_tokens=128,
    ),
    payoff=ThroughputConfig(
        model="smollm2",
        task="niah_single_1",
        prompts=3,
        length=2048,
        new_tokens=32,
        memory_cap_mib=256,  # the full cache of one 2k-token SmolLM2 sequence is ~92 MiB
    ),
)


def run_demo(
    out: Path,
    plan: DemoPlan = DEMO,
    model: PreTrainedModel | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> str:
    """Run (or resume) the three acts into ``out``; print each act's table and the closing
    recommendation, write the plots; return the recommendation."""
    if model is None or tokenizer is None:
        model, tokenizer = load_model(plan.compress.model)
    act1 = _rows(BenchRunner(plan.compress, out / "compress", model, tokenizer).run())
    _show(
        "Act 1 · Compress a document once, ask later",
        f"context-only {', '.join(plan.compress.tasks)}, {plan.compress.length} tokens, "
        f"{plan.compress.samples} samples; score = exact answers",
        _quality_table(act1, "score"),
        plot_report(act1, out / "compress.png"),
    )
    act2 = _rows(BenchRunner(plan.generate, out / "generate", model, tokenizer).run())
    _show(
        "Act 2 · Evict while generating",
        f"{plan.generate.max_new_tokens} greedy tokens of an essay per sample; top-1 and KL against the full cache",
        _quality_table(act2, "top-1"),
        _plot_bars(act2, out / "generate.png"),
    )
    best_prefill, best_decode = _best(act1), _best(act2)
    payoff = plan.payoff
    runs = [Setting(best_prefill.policy, budget=best_prefill.budget, keep=best_prefill.keep)]
    act3 = run_throughput(model, task_prompts(payoff, tokenizer), payoff, runs, out / "payoff")
    _show(
        "Act 3 · The payoff",
        "the full cache against act 1's best policy, continuous batching under one KV memory cap",
        format_table(act3).splitlines(),
        _plot_payoff(act3, out / "payoff.png"),
    )
    recommendation = _recommend(act1, best_prefill, act2, best_decode, act3)
    print(recommendation)
    return recommendation


def _rows(records) -> list[ReportRow]:
    """The act's rows averaged over its tasks (the task column would only repeat itself)."""
    rows = summarize(records)
    averaged = [row for row in rows if row.task == AVERAGE]
    return averaged or rows


def _show(title: str, subtitle: str, table: list[str], plot: Path) -> None:
    print(f"\n{title}\n{subtitle}\n")
    print("\n".join(table))
    print(f"plot: {plot}", file=sys.stderr)


def _quality_table(rows: list[ReportRow], quality: str) -> list[str]:
    header = ["policy", "setting", quality, "% of full", "KV MiB"]
    if quality == "top-1":
        header.insert(3, "KL")
    table = []
    for row in rows:
        cells = [row.policy, row.budget_label]
        if quality == "top-1":
            top1, kl = (row.fidelity["top1"], row.fidelity["kl"]) if row.fidelity else (1.0, 0.0)
            cells += [f"{100 * top1:.1f}", f"{kl:.3f}"]
        else:
            cells.append(f"{row.score:.1f}")
        cells += [_percent(row.percent_of_full), f"{row.kv_mib:.1f}"]
        table.append(cells)
    return text_table(header, table)


def _best(rows: list[ReportRow]) -> ReportRow:
    """The evicting row with the highest quality; among equals the one holding least memory."""
    evicting = [row for row in rows if row.policy != "full"]
    return max(evicting, key=lambda row: (round(row.score, 6), -row.kv_mib))


def _plot_bars(rows: list[ReportRow], path: Path) -> Path:
    """Top-1 agreement per policy, full cache as a line at 100 %."""
    plt = pyplot()
    evicting = [row for row in rows if row.policy != "full"]
    figure, axis = plt.subplots(figsize=(7, 3.6))
    axis.bar([row.policy for row in evicting], [row.score for row in evicting], color="tab:blue")
    axis.axhline(100, color="black", linestyle="--", linewidth=1, label="full cache")
    axis.set_ylabel("top-1 agreement with the full cache (%)")
    axis.set_ylim(min([row.score for row in evicting], default=0) - 10, 102)
    axis.tick_params(axis="x", rotation=25)
    axis.legend(frameon=False)
    return save_figure(figure, path)


def _plot_payoff(records: list[dict], path: Path) -> Path:
    """Two bar charts: peak KV memory per sequence served at once, and end-to-end tokens/s."""
    plt = pyplot()
    labels = [_setting_label(record) for record in records]
    per_sequence = [record["peak_kv_bytes"] / max(record["max_batch"], 1) / 2**20 for record in records]
    figure, (memory, speed) = plt.subplots(1, 2, figsize=(9, 3.6))
    colors = ["grey"] + ["tab:green"] * (len(records) - 1)
    memory.bar(labels, per_sequence, color=colors)
    memory.set(ylabel="peak KV MiB / max batch (prefill included)", title=f"cap {records[0]['memory_cap_mib']:g} MiB")
    speed.bar(labels, [record["tokens_per_s"] for record in records], color=colors)
    speed.set(ylabel="tokens / s, end to end", title="throughput")
    for axis, values in ((memory, per_sequence), (speed, [record["tokens_per_s"] for record in records])):
        for x, value in enumerate(values):
            axis.annotate(f"{value:.1f}", (x, value), ha="center", va="bottom")
    return save_figure(figure, path)


def _setting_label(record: dict) -> str:
    if record["policy"] == "full":
        return "full"
    size = f"budget {record['budget']}" if record["budget"] is not None else f"keep {record['keep']:g}"
    return f"{record['policy']}\n{size}"


def _percent(value: float | None) -> str:
    """A share of the full cache's score; "-" where the full cache scored nothing to share."""
    return "-" if value is None else f"{value:.0f}%"


def _recommend(
    act1: list[ReportRow], best_prefill: ReportRow, act2: list[ReportRow], best_decode: ReportRow, act3: list[dict]
) -> str:
    """The closing advice, every figure in it read from the three acts' results."""
    full1 = next(row for row in act1 if row.policy == "full")
    full2 = next(row for row in act2 if row.policy == "full")
    full3 = next(record for record in act3 if record["policy"] == "full")
    best3 = next(record for record in act3 if record["policy"] != "full")
    speedup = best3["tokens_per_s"] / full3["tokens_per_s"]
    return (
        "\nRecommendation (from the numbers above)\n"
        f"- compress a document once, ask later: {best_prefill.policy} at keep {best_prefill.budget_label} keeps "
        f"{_percent(best_prefill.percent_of_full)} of the full cache's score in "
        f"{full1.kv_mib / best_prefill.kv_mib:.1f}x less KV memory; under a {full3['memory_cap_mib']:g} MiB cap it "
        f"runs {best3['max_batch']} sequences at once instead of {full3['max_batch']}, "
        f"{speedup:.2f}x the full cache's tokens/s"
        + (" (its compression costs more than the batching saves here)" if speedup < 1 else "")
        + ".\n"
        f"- evict while generating: {best_decode.policy} at budget {best_decode.budget_label} agrees with the full "
        f"cache on {best_decode.score:.1f}% of tokens (KL {best_decode.fidelity.get('kl', 0):.3f}) in "
        f"{full2.kv_mib / best_decode.kv_mib:.1f}x less KV memory."
    )
