"""The frontier in bytes: each setting of a ``kvevict bench`` run (policy, budget or keep, storage)
as its score against its resident bytes, both as shares of the full, unquantized cache's, and
the settings no other beats on both (``kvevict report DIR --frontier PNG``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvevict.bench.report import AVERAGE, ReportRow, markdown_table
from kvevict.figures import pyplot, save_figure

KEEPS_SCORE = 95.0
"""The share of the full cache's score a setting must keep to be named the cheapest (``%``)."""


def saving(policy: str) -> str:
    """What a setting (the report's policy label, ``fastkvzip (int4)``) saves bytes by: evicting
    entries, pruning key channels (ThinK), storing entries in fewer bits, or several of these."""
    base = policy.split(" (")[0]
    parts = [] if base in ("full", "think", "think+full") else ["eviction"]
    parts += ["channels"] if base.startswith("think") else []
    parts += ["quantization"] if "(int" in policy else []
    return " + ".join(parts)


@dataclass(frozen=True)
class Setting:
    """One setting over the run's tasks: its name as the report shows it, what it saves by,
    its score and resident bytes as % of the full unquantized cache's."""

    label: str
    axis: str
    score: float
    bytes: float


def settings(rows: list[ReportRow]) -> list[Setting]:
    """The settings of ``rows`` (:func:`~kvevict.bench.report.summarize`'s; their ``average`` over
    tasks when there are several tasks), each against the unquantized ``full`` row."""
    tasks = {row.task for row in rows}
    task = AVERAGE if AVERAGE in tasks else next(iter(tasks), None)
    chosen = [row for row in rows if row.task == task]
    full = next((row for row in chosen if row.policy == "full"), None)
    if full is None or not full.score or not full.kv_mib:
        raise ValueError("the frontier needs the full, unquantized cache in the run: add full to --policies")
    found = []
    for row in chosen:
        if row is full:
            continue
        label = row.policy if row.budget is None and row.keep is None else f"{row.policy} @ {row.budget_label}"
        found.append(Setting(label, saving(row.policy), 100 * row.score / full.score, 100 * row.kv_mib / full.kv_mib))
    return sorted(found, key=lambda setting: (setting.bytes, -setting.score))


def pareto(found: list[Setting]) -> list[Setting]:
    """The settings no other holds fewer bytes at a score as high (nor as few at a higher one), by bytes."""
    front, best = [], float("-inf")
    for setting in sorted(found, key=lambda s: (s.bytes, -s.score)):
        if setting.score > best:
            front.append(setting)
            best = setting.score
    return front


def cheapest(found: list[Setting], keeps: float = KEEPS_SCORE) -> Setting | None:
    """The setting of fewest bytes whose score is at least ``keeps`` % of the full cache's (None: none is)."""
    return next((setting for setting in pareto(found) if setting.score >= keeps), None)


def format_frontier(found: list[Setting], keeps: float = KEEPS_SCORE) -> str:
    """A Markdown table of the settings by bytes (frontier ones starred), then the cheapest that keeps ``keeps`` %."""
    front = set(pareto(found))
    rows = [
        [
            f"{'★ ' if setting in front else ''}{setting.label}",
            setting.axis,
            f"{setting.score:.1f}",
            f"{setting.bytes:.1f}",
        ]
        for setting in found
    ]
    table = markdown_table(["setting", "saves by", "score, % of full", "resident bytes, % of full"], rows)
    best = cheapest(found, keeps)
    if best is None:
        verdict = f"no setting keeps {keeps:g} % of the full cache's score"
    else:
        verdict = (
            f"cheapest setting keeping ≥ {keeps:g} % of the score: {best.label} "
            f"({best.score:.1f} %, 1/{100 / best.bytes:.1f} of the full cache's bytes)"
        )
    return f"{table}\n\n{verdict}"


def plot_frontier(found: list[Setting], path: str | Path, keeps: float = KEEPS_SCORE) -> Path:
    """Score against resident bytes (log scale), a color per axis of saving, the frontier as a line."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7.5, 4.8))
    for index, kind in enumerate(sorted({setting.axis for setting in found})):
        points = [setting for setting in found if setting.axis == kind]
        color = plt.get_cmap("tab10")(index % 10)
        axis.scatter([p.bytes for p in points], [p.score for p in points], color=color, label=kind, zorder=3)
    for setting in found:
        axis.annotate(
            setting.label, (setting.bytes, setting.score), fontsize=6, xytext=(3, 2), textcoords="offset points"
        )
    front = pareto(found)
    axis.plot([s.bytes for s in front], [s.score for s in front], color="black", linewidth=1, label="frontier")
    axis.axhline(keeps, color="grey", linestyle=":", linewidth=1, label=f"{keeps:g} % of full")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("resident KV bytes, % of the full fp cache (log)")
    axis.set_ylabel("score, % of the full cache's")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="lower right")
    return save_figure(figure, path)
