"""``make demo``: a small offline suite on the embedded SmolLM2, its report and its plot."""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvevict.bench.report import format_report, plot_report, summarize
from kvevict.bench.runner import BenchConfig, BenchRunner

DEMO = BenchConfig(
    tasks=("niah_single_2", "niah_single_3", "niah_multivalue"),  # SmolLM2 solves these at 2k
    policies=("full", "streamingllm", "tova", "h2o", "snapkv"),
    budgets=(256, 1024),
    length=2048,
    samples=2,
    max_new_tokens=64,  # the longest answer (4 seven-digit values) is ~40 tokens
    query_aware=True,  # the question ends the compressed prompt, so SnapKV's window sees it
    fidelity=True,
)


def run_demo(
    out: Path,
    config: BenchConfig = DEMO,
    model: PreTrainedModel | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> None:
    """Run (or resume) ``config`` into ``out``, print the report, write ``out/report.png``."""
    store = BenchRunner(config, out, model, tokenizer).run()
    rows = summarize(store)
    print(format_report(rows))
    print(f"results: {store.path}\nplot: {plot_report(rows, out / 'report.png')}", file=sys.stderr)
