"""``kvevict report``: mean score per task × policy × budget, as % of the full cache, and a
score-vs-budget plot."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvevict.figures import pyplot, save_figure

AVERAGE = "average"
FIDELITY_FIELDS = ("top1", "kl", "ppl")


@dataclass
class ReportRow:
    task: str
    policy: str
    budget: int | None
    keep: float | None
    samples: int
    score: float
    """Mean score × 100."""
    kv_mib: float
    """Mean KV allocated at the end of generation, MiB."""
    fidelity: dict[str, float]
    real_mib: float | None = None
    """Mean KV of real entries, MiB: below ``kv_mib`` where head-wise budgets pad heads."""
    peak_tokens: int = 0
    """Most entries a KV head held while decoding (budget + interval for lagged eviction)."""
    percent_of_full: float | None = None
    kept_share: float | None = None
    """Mean share of a full cache's entries kept at the end (None: records from before it was stored)."""

    @property
    def budget_label(self) -> str:
        if self.budget is not None:
            return str(self.budget)
        return f"{100 * self.keep:g}%" if self.keep is not None else "all"  # 12.5%, not 12%

    @property
    def x(self) -> float | None:
        """Where the row sits on the plot's budget axis."""
        return self.budget if self.budget is not None else self.keep


def policy_label(record: dict[str, Any], shown: Collection[str] = ()) -> str:
    """The policy as the report shows it: its spec, plus the ``shown`` run settings where the
    record has them (not for ``full``: the reference, whatever the run's settings)."""
    label = record["policy"]
    if record.get("quant"):  # quantized storage, the full cache's too (only the unquantized one is the reference)
        label += f" ({record['quant']})"
    if record["policy"] != "full":
        if "interval" in shown and record.get("interval"):
            label += f" (interval {record['interval']})"
        if "query_aware" in shown and record.get("query_aware"):
            label += " (query-aware)"
    return label


def sample_scores(
    records: Iterable[dict[str, Any]], shown: Collection[str] = ()
) -> dict[tuple[str, float | None], dict[tuple[str, int], float]]:
    """Each setting's score per sample: keyed by the policy as :func:`policy_label` names it (with the ``shown`` run
    settings) and its keep, then by the sample's task and index. Records without a score are left out."""
    scores: dict[tuple[str, float | None], dict[tuple[str, int], float]] = defaultdict(dict)
    for record in records:
        if record.get("score") is not None:
            scores[policy_label(record, shown), record.get("keep")][record["task"], record["index"]] = record["score"]
    return dict(scores)


def summarize(records: Iterable[dict[str, Any]]) -> list[ReportRow]:
    """Rows per (task, setting, budget), then an ``average`` over tasks for every setting
    present in each task; each with its score as a share of ``full`` on the same tasks.
    Samples of every seed are pooled; an eviction interval or query-aware compression is
    named in the policy column where the records mix runs with and without it."""
    records = list(records)
    evicting = [record for record in records if record["policy"] != "full"]
    shown = {
        field for field in ("interval", "query_aware") if len({record.get(field) or None for record in evicting}) > 1
    }
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        groups[(record["task"], policy_label(record, shown), record.get("budget"), record.get("keep"))].append(record)
    rows = [_row(key, members) for key, members in sorted(groups.items(), key=lambda item: _order(item[0]))]
    tasks = sorted({row.task for row in rows})
    if len(tasks) > 1:
        rows += _averages(rows, tasks)
    full = {row.task: row.score for row in rows if row.policy == "full"}
    for row in rows:
        if full.get(row.task):
            row.percent_of_full = 100 * row.score / full[row.task]
    return rows


def _order(key: tuple) -> tuple:
    task, policy, budget, keep = key
    return (task, policy != "full", budget if budget is not None else -1, keep if keep is not None else -1, policy)


def _row(key: tuple, members: list[dict[str, Any]]) -> ReportRow:
    task, policy, budget, keep = key
    fidelity = [member["fidelity"] for member in members if member.get("fidelity")]
    return ReportRow(
        task=task,
        policy=policy,
        budget=budget,
        keep=keep,
        samples=len(members),
        score=100 * statistics.fmean(member["score"] for member in members),
        kv_mib=statistics.fmean(member["kv_bytes_final"] for member in members) / 2**20,
        real_mib=statistics.fmean(member.get("kv_bytes_real_final", member["kv_bytes_final"]) for member in members)
        / 2**20,
        fidelity=_mean_fidelity(fidelity),
        peak_tokens=max(member.get("decode_peak_tokens", 0) for member in members),
        kept_share=_mean_of(member.get("kept_share") for member in members),
    )


def _mean_of(values: Iterable[float | None]) -> float | None:
    """The mean of ``values``, or None if any is missing."""
    values = list(values)
    return None if not values or any(value is None for value in values) else statistics.fmean(values)


def _mean_fidelity(items: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each fidelity field over ``items`` (empty when there are none)."""
    return {name: statistics.fmean(item[name] for item in items) for name in FIDELITY_FIELDS} if items else {}


def _averages(rows: list[ReportRow], tasks: list[str]) -> list[ReportRow]:
    by_setting: dict[tuple, list[ReportRow]] = defaultdict(list)
    for row in rows:
        by_setting[(row.policy, row.budget, row.keep)].append(row)
    averages = []
    for (policy, budget, keep), members in by_setting.items():
        if len(members) != len(tasks):  # average only over settings every task has
            continue
        fidelity = [member.fidelity for member in members if member.fidelity]
        averages.append(
            ReportRow(
                task=AVERAGE,
                policy=policy,
                budget=budget,
                keep=keep,
                samples=sum(member.samples for member in members),
                score=statistics.fmean(member.score for member in members),
                kv_mib=statistics.fmean(member.kv_mib for member in members),
                real_mib=statistics.fmean(member.real_mib for member in members),
                fidelity=_mean_fidelity(fidelity) if len(fidelity) == len(members) else {},
                peak_tokens=max(member.peak_tokens for member in members),
                kept_share=_mean_of(member.kept_share for member in members),
            )
        )
    return averages


def format_report(rows: list[ReportRow]) -> str:
    """A plain-text table (fidelity columns appear when the run measured them)."""
    with_fidelity = any(row.fidelity for row in rows)
    with_peak = any(row.peak_tokens for row in rows)
    with_padding = any(row.real_mib is not None and row.real_mib < row.kv_mib - 5e-3 for row in rows)
    with_kept = any(row.kept_share is not None for row in rows)
    header = ["task", "policy", "budget", "n", "score", "% full"] + (["kept"] if with_kept else []) + ["KV MiB"]
    header += ["real MiB"] if with_padding else []
    header += ["peak tok"] if with_peak else []
    header += ["top-1", "KL", "ppl"] if with_fidelity else []
    table = []
    for row in rows:
        cells = [
            row.task,
            row.policy,
            row.budget_label,
            str(row.samples),
            f"{row.score:.1f}",
            "-" if row.percent_of_full is None else f"{row.percent_of_full:.0f}%",
            *([kept_cell(row.kept_share)] if with_kept else []),
            f"{row.kv_mib:.2f}",
        ]
        if with_padding:
            cells.append(f"{row.real_mib:.2f}")
        if with_peak:
            cells.append(str(row.peak_tokens) if row.peak_tokens else "-")
        if with_fidelity:
            f = row.fidelity
            cells += [f"{f['top1']:.3f}", f"{f['kl']:.4f}", f"{f['ppl']:.3f}"] if f else ["-", "-", "-"]
        table.append(cells)
    return "\n".join(text_table(header, table))


def kept_cell(share: float | None) -> str:
    """A kept share as a table cell: ``10.4%``, or ``-`` where it was not recorded."""
    return "-" if share is None else f"{100 * share:.1f}%"


def text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Lines of a left-aligned plain-text table: header, a rule, then the rows."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]

    def render(cells: list[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    return [render(header), render(["-" * width for width in widths]), *map(render, rows)]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table: the header, its rule, then the rows (cells as given)."""
    render = lambda cells: "| " + " | ".join(cells) + " |"
    return "\n".join([render(header), "|" + "---|" * len(header), *map(render, rows)])


def markdown_records(records: Iterable[dict[str, Any]], columns: dict[str, str]) -> str:
    """Records as a Markdown table: one column per ``{header: cell template}``, each cell the
    template formatted with the record's fields (``"{ratio:.2f}x"``)."""
    return markdown_table(list(columns), [[cell.format(**record) for cell in columns.values()] for record in records])


def plot_report(rows: list[ReportRow], path: str | Path) -> Path:
    """Score vs budget, one line per policy and one panel per task (``full`` dashed)."""
    plt = pyplot()

    tasks = sorted({row.task for row in rows}, key=lambda task: (task == AVERAGE, task))
    columns = min(3, len(tasks))
    lines = -(-len(tasks) // columns)
    figure, axes = plt.subplots(lines, columns, figsize=(4.2 * columns, 3.4 * lines), squeeze=False)
    uses_keep = any(row.keep is not None for row in rows)
    policies = sorted({row.policy for row in rows if row.policy != "full"})
    styles = {policy: _line_style(plt, i, len(policies)) for i, policy in enumerate(policies)}  # same in every panel
    for axis, task in zip(axes.flat, tasks):
        task_rows = [row for row in rows if row.task == task]
        for policy in policies:
            points = sorted((row.x, row.score) for row in task_rows if row.policy == policy and row.x is not None)
            if points:
                axis.plot(*zip(*points), label=policy, **styles[policy])
        for row in task_rows:
            if row.policy == "full":
                axis.axhline(row.score, color="black", linestyle="--", linewidth=1, label="full")
        axis.set_title(task)
        axis.set_xlabel("keep (fraction of prompt)" if uses_keep else "budget (tokens per KV head)")
        axis.set_ylabel("score")
        axis.set_ylim(-3, 103)
        if not uses_keep:
            axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(tasks) :]:
        axis.set_visible(False)
    legend = {label: handle for axis in axes.flat for handle, label in zip(*axis.get_legend_handles_labels())}
    per_row = max(1, min(len(legend), 2 * columns))  # every policy named: as many legend rows as that takes
    legend_rows = -(-len(legend) // per_row)
    figure.set_figheight(figure.get_figheight() + 0.3 * legend_rows)
    figure.legend(legend.values(), legend.keys(), loc="lower center", ncol=per_row, frameon=False, fontsize=8)
    return save_figure(figure, path, rect=(0, 0.3 * legend_rows / figure.get_figheight() + 0.02, 1, 1))


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
LINESTYLES = ("-", "--", "-.", ":")


def _line_style(plt: Any, index: int, count: int) -> dict[str, Any]:
    """A policy's line: its own color, marker and dash, and a marker that shrinks with the
    index, so lines that coincide (several policies scoring 0) stay visible one inside another."""
    return {
        "color": plt.get_cmap("tab10")(index % 10),
        "marker": MARKERS[index % len(MARKERS)],
        "linestyle": LINESTYLES[index % len(LINESTYLES)],
        "markersize": 4 + 6 * (count - index) / max(count, 1),
        "markerfacecolor": "none" if index % 2 else None,
    }
