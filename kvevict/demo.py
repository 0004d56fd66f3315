"""``make demo``: what kvevict is for, in three short acts on the embedded SmolLM2.

1. *Compress a document once, ask later*: context-only RULER needle tasks at two keep
   fractions, the full cache beside two baselines, the seeds' prefill methods and the best
   query-agnostic policy.
2. *Evict while generating*: a long greedy essay under a small budget, each decode-time method
   scored by its agreement with the full cache's tokens (top-1, KL).
3. *The payoff*, under one cap on resident KV memory, with continuous batching admitting
   each sequence by its ceiling: long generations (act 2's best decode-time policy at a
   budget of a quarter of the final length against the full cache), and documents
   compressed once and asked many questions (act 1's best policy against the full cache
   with prefix reuse).

Every act writes its results under ``out`` (resumable: a rerun reuses what finished) and a plot;
the closing recommendation is computed from the numbers just measured.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvevict.bench.report import AVERAGE, ReportRow, kept_cell, plot_report, summarize, text_table
from kvevict.bench.runner import BenchConfig, BenchRunner
from kvevict.bench.throughput import (
    Setting,
    ThroughputConfig,
    ask_documents,
    format_table,
    plot,
    run_throughput,
    task_prompts,
)
from kvevict.figures import pyplot, save_figure
from kvevict.models import load_model


@dataclass(frozen=True)
class DemoPlan:
    """The three acts' runs. Act 3 serves act 2's best policy at ``long_budget`` (``long``) and
    act 1's best at its keep (``ask``), each against the full cache."""

    compress: BenchConfig
    generate: BenchConfig
    long: ThroughputConfig
    long_budget: int
    ask: ThroughputConfig


DEMO = DemoPlan(
    compress=BenchConfig(
        tasks=("niah_single_1",),  # SmolLM2 answers it from the full cache, context-only, at 2k
        policies=(
            "full",
            "streamingllm",
            "snapkv",
            "critical+adakv+snapkv",  # CriticalKV (seed 004) over AdaKV
            "momentkv",  # MomentKV (seed 003): MI (by a quarter of the evicted set per update) and NC
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
    long=ThroughputConfig(
        model="smollm2",
        task="longgen",
        prompts=8,
        length=64,  # longgen's prompts are short (~60 tokens) whatever this says
        new_tokens=320,
        memory_cap_mib=56,  # two full-cache SmolLM2 sequences of ~380 tokens (~46 KiB per token), not three
        workload="longgen",
    ),
    long_budget=88,  # under a quarter of the final length (~60 + 320 tokens)
    ask=ThroughputConfig(
        model="smollm2",
        task="niah_single_1",
        prompts=2,
        length=2048,
        new_tokens=16,
        memory_cap_mib=320,  # a 2k-token document's full cache is ~92 MiB: itself and two copies
        workload="ask",
        questions=8,
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
    long = _payoff(
        "long generations",
        f"act 2's best policy at budget {plan.long_budget} against the full cache, {plan.long.prompts} essays of "
        f"{plan.long.new_tokens} tokens under {plan.long.memory_cap_mib:g} MiB of resident KV",
        (model, tokenizer, task_prompts(plan.long, tokenizer), plan.long),
        Setting(best_decode.policy, budget=plan.long_budget),
        out / "payoff-long",
    )
    ask = _payoff(
        "compress once, ask many times",
        f"act 1's best policy against the full cache with prefix reuse, {plan.ask.prompts} documents of "
        f"{plan.ask.length} tokens, {plan.ask.questions} questions each, under {plan.ask.memory_cap_mib:g} MiB",
        (model, tokenizer, ask_documents(plan.ask, tokenizer), plan.ask),
        Setting(best_prefill.policy, keep=best_prefill.keep),
        out / "payoff-ask",
    )
    recommendation = _recommend(act1, best_prefill, act2, best_decode, long, ask)
    print(recommendation)
    return recommendation


def _payoff(workload: str, subtitle: str, served: tuple, setting: Setting, out: Path) -> list[dict]:
    """One workload of act 3 (``served``: model, tokenizer, its inputs and configuration): the
    full cache against ``setting``; prints its table, plots it to ``out.png``."""
    model, tokenizer, inputs, config = served
    records = run_throughput(model, inputs, config, [setting], out, tokenizer=tokenizer)
    _show(
        f"Act 3 · The payoff: {workload}",
        subtitle,
        format_table(records).splitlines(),
        plot(records, out.with_suffix(".png")),
    )
    return records


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
    header = ["policy", "setting", quality, "% of full", "kept", "KV MiB"]
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
        cells += [_percent(row.percent_of_full), kept_cell(row.kept_share), f"{row.kv_mib:.1f}"]
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


def _percent(value: float | None) -> str:
    """A share of the full cache's score; "-" where the full cache scored nothing to share."""
    return "-" if value is None else f"{value:.0f}%"


def _recommend(
    act1: list[ReportRow],
    best_prefill: ReportRow,
    act2: list[ReportRow],
    best_decode: ReportRow,
    long: list[dict],
    ask: list[dict],
) -> str:
    """The closing advice, every figure in it read from the three acts' results."""
    full1 = next(row for row in act1 if row.policy == "full")
    full2 = next(row for row in act2 if row.policy == "full")
    long_full, long_best = (next(r for r in long if (r["policy"] == "full") == full) for full in (True, False))
    ask_full, ask_best = (next(r for r in ask if (r["policy"] == "full") == full) for full in (True, False))
    long_ratio = long_best["tokens_per_s"] / long_full["tokens_per_s"]
    ask_ratio = ask_best["answers_per_s"] / ask_full["answers_per_s"]
    ask_share = _percent(100 * ask_best["score"] / ask_full["score"] if ask_full["score"] else None)
    return (
        "\nRecommendation (from the numbers above)\n"
        f"- long generations: {best_decode.policy} agrees with the full cache on {best_decode.score:.1f}% of "
        f"tokens at budget {best_decode.budget_label} (KL {best_decode.fidelity.get('kl', 0):.3f}), in "
        f"{full2.kv_mib / best_decode.kv_mib:.1f}x less KV memory; at budget {long_best['budget']} under a "
        f"{long_full['memory_cap_mib']:g} MiB cap it runs {long_best['max_batch']} sequences at once instead of "
        f"{long_full['max_batch']}: {long_ratio:.2f}x the full cache's tokens/s, teacher-forced top-1 "
        f"{100 * long_best.get('teacher_forced_top1', long_best['quality']):.1f}%"
        + (" (the batching it buys does not pay for its eviction here)" if long_ratio < 1 else "")
        + ".\n"
        f"- compress a document once, ask later: {best_prefill.policy} at keep {best_prefill.budget_label} keeps "
        f"{_percent(best_prefill.percent_of_full)} of the full cache's score in "
        f"{full1.kv_mib / best_prefill.kv_mib:.1f}x less KV memory; asked {ask_best['questions']} questions per "
        f"document under a {ask_full['memory_cap_mib']:g} MiB cap it answers {ask_ratio:.2f}x as many per second "
        f"as the full cache with prefix reuse ({ask_best['answers_per_s']:.2f} against "
        f"{ask_full['answers_per_s']:.2f}), scoring {ask_share} of its score"
        + (" (its compression costs more than the batching saves here)" if ask_ratio < 1 else "")
        + "."
    )
