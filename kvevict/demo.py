"""``make demo``: needle retrieval on the embedded model under every baseline at two budgets."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tqdm import tqdm

from kvevict.bench.haystack import needle_sample
from kvevict.cache import EvictionCache
from kvevict.generation import answer
from kvevict.models import load_model

BASELINES = ("random", "knorm", "streamingllm", "tova", "h2o", "snapkv")


@dataclass
class DemoRow:
    policy: str
    budget: int | None
    kv_bytes: int
    answer: str
    correct: bool
    seconds: float


def run_demo(
    model_name: str = "smollm2",
    length: int = 2048,
    budgets: tuple[int, ...] = (256, 1024),
    policies: tuple[str, ...] = BASELINES,
    max_new_tokens: int = 16,
    query_aware: bool = True,
) -> list[DemoRow]:
    """Answer one needle prompt under ``full`` and each policy at each budget. Query-aware by
    default (the question ends the compressed prompt, as in SnapKV's evaluation)."""
    model, tokenizer = load_model(model_name)
    sample = needle_sample(tokenizer, length)
    runs = [("full", None)] + [(policy, budget) for budget in budgets for policy in policies]
    rows = []
    for policy, budget in tqdm(runs, desc="needle demo", unit="run"):
        cache = EvictionCache(model, policy, budget=budget)
        start = time.perf_counter()
        text = answer(
            model,
            tokenizer,
            sample.context,
            sample.question,
            answer_prefix=sample.answer_prefix,
            max_new_tokens=max_new_tokens,
            query_aware=query_aware,
            cache=cache,
        )
        rows.append(DemoRow(policy, budget, cache.kv_bytes(), text, sample.answer in text, time.perf_counter() - start))
    return rows


def format_table(rows: list[DemoRow]) -> str:
    """A plain-text table: policy, budget, retained KV bytes (and % of full), answer, correct?"""
    full_bytes = next((row.kv_bytes for row in rows if row.policy == "full"), 0)
    header = ("policy", "budget", "retained KV", "% full", "answer", "correct?", "s")
    lines = [
        (
            row.policy,
            "all" if row.budget is None else str(row.budget),
            f"{row.kv_bytes / 2**20:.2f} MiB",
            f"{100 * row.kv_bytes / full_bytes:.0f}%" if full_bytes else "-",
            (row.answer[:40] + "…") if len(row.answer) > 40 else row.answer,
            "yes" if row.correct else "no",
            f"{row.seconds:.1f}",
        )
        for row in rows
    ]
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *lines)]

    def render(cells) -> str:
        return "  ".join(str(cell).ljust(width) for cell, width in zip(cells, widths)).rstrip()

    return "\n".join([render(header), render(["-" * w for w in widths]), *map(render, lines)])
