"""``kvevict analyze recurrence``: the Maximum Recurrence Interval distribution of
LazyEviction (seed 001, Sec. 3, Fig. 3(c)) and the observation window ``W`` it suggests.

A full-cache greedy generation per prompt runs under an :class:`~kvevict.cache.EvictionCache`
with :class:`~kvevict.policies.lazyeviction.LazyEviction` and a budget it never reaches, so
the timestamps ``TS`` and MRIs are tracked exactly as LazyEviction tracks them (per KV head,
attention max over the GQA group, ``A ≥ α``; ``α`` = the model family's default unless
given) and nothing is ever evicted.

Population: every ``(layer, KV head, token)`` entry the cache holds at the end, prompt and
decode tokens alike. The whole chat-templated prompt but its last token is prefilled; that
token is the query of decode step ``t = 1`` (timestamps start at 0 either way). The last
generated token is never fed back, so it is not in the cache.

The paper reads ``W`` off Fig. 3(c) as "80% tokens' MRI are less than W": here the suggested
``W`` is the 80th percentile of MRI over the *recurring* entries (MRI ≥ 1, attended at
least once after they entered the cache). Percentiles are observed values (``inverted_cdf``:
the smallest MRI ``v`` with at least ``p``% of the population ``≤ v``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvevict.bench.report import text_table
from kvevict.figures import pyplot, save_figure

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from kvevict.cache import EvictionCache

PERCENTILES = (50, 80, 90, 95, 99)
W_PERCENTILE = 80
NEVER_EVICT = 2**62
"""A budget no cache reaches: LazyEviction tracks TS/MRI but never evicts."""

BUILTIN = "builtin"
BUILTIN_PROMPTS = (
    (
        "A baker makes 12 loaves of bread every hour and works for 7 hours. She sells each loaf for $3 and "
        "gives away 9 loaves. How much money does she make? Reason step by step, then give the final answer."
    ),
    (
        "Tom has twice as many marbles as Anna. Anna has 5 more marbles than Ben, and Ben has 8 marbles. How many "
        "marbles do the three of them have together? Think step by step before answering."
    ),
    (
        "A train leaves at 9:40 and travels 210 km at 70 km per hour, then stops for 25 minutes and travels another "
        "90 km at 60 km per hour. At what time does it arrive? Explain your reasoning step by step."
    ),
    (
        "A rectangle has a perimeter of 46 cm and its length is 5 cm more than its width. What is its area? Solve it "
        "step by step and check your answer."
    ),
    (
        "A shop sells pencils in packs of 6 for $2 and single pencils for $0.40 each. What is the cheapest way to buy "
        "exactly 20 pencils, and how much does it cost? Reason step by step."
    ),
    (
        "The sum of three consecutive even numbers is 78. What are the numbers? Show each step of your reasoning and "
        "verify the result."
    ),
    (
        "A tank holds 480 litres. One pipe fills it in 8 hours and another drains it in 12 hours. Starting empty with "
        "both pipes open, how long until the tank is full? Work through it step by step."
    ),
    (
        "In a class of 30 students, 18 play football, 12 play chess and 5 play both. How many students play neither? "
        "Think carefully, step by step, and give the final number."
    ),
)
"""Short reasoning prompts for an offline run (written for kvevict)."""

JSONL_FIELDS = ("prompt", "question", "problem")
TASK_LENGTH = 2048
"""Prompt length asked of generated (RULER-style) tasks; hub math tasks ignore it."""


# -- prompt sets --------------------------------------------------------------------------
def _task_names() -> list[str]:
    from kvevict.bench.tasks import all_tasks

    return list(all_tasks())


def _prompt_set_kind(spec: str) -> str:
    """``"builtin"``, ``"txt"``, ``"jsonl"`` or ``"task"``; raises for anything else."""
    if spec == BUILTIN:
        return BUILTIN
    suffix = Path(spec).suffix.lower()
    if suffix in (".txt", ".jsonl"):
        if not Path(spec).is_file():
            raise FileNotFoundError(f"prompt file {spec} does not exist")
        return suffix[1:]
    tasks = _task_names()
    if spec in tasks:
        return "task"
    raise ValueError(
        f"unknown prompt set {spec!r}; use {BUILTIN!r} ({len(BUILTIN_PROMPTS)} short reasoning prompts), a .txt file "
        f"(prompts separated by blank lines), a .jsonl file (field {', '.join(JSONL_FIELDS)}) or a task: "
        f"{', '.join(tasks)}"
    )


def check_prompt_set(spec: str) -> None:
    """Fail early (before any model loads) on an unknown prompt set or a missing file."""
    _prompt_set_kind(spec)


def read_txt_prompts(path: str | Path) -> list[str]:
    """One prompt per block of a text file, blocks separated by blank lines."""
    blocks, current = [], []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            current.append(line.rstrip())
        elif current:
            blocks.append("\n".join(current))
            current = []
    if current:
        blocks.append("\n".join(current))
    return blocks


def read_jsonl_prompts(path: str | Path) -> list[str]:
    """The ``prompt`` (else ``question``, else ``problem``) field of each JSON line."""
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON ({err})") from err
        found = [row[name] for name in JSONL_FIELDS if isinstance(row, dict) and isinstance(row.get(name), str)]
        if not found:
            raise ValueError(f"{path}:{number}: no string field {' / '.join(JSONL_FIELDS)}")
        prompts.append(found[0])
    return prompts


def load_prompts(spec: str, count: int, tokenizer: PreTrainedTokenizerBase | None = None) -> list[str]:
    """The first ``count`` prompts of a prompt set: ``builtin``, a ``.txt`` or ``.jsonl`` path,
    or a task of :func:`kvevict.bench.tasks.all_tasks` (hub tasks need the hub, or their
    local data folder; the prompt is the sample's context and question)."""
    if count < 1:
        raise ValueError(f"samples must be >= 1, got {count}")
    kind = _prompt_set_kind(spec)
    if kind == BUILTIN:
        prompts = list(BUILTIN_PROMPTS)
    elif kind == "txt":
        prompts = read_txt_prompts(spec)
    elif kind == "jsonl":
        prompts = read_jsonl_prompts(spec)
    else:
        prompts = _task_prompts(spec, count, tokenizer)
    if not prompts:
        raise ValueError(f"prompt set {spec!r} holds no prompts")
    return prompts[:count]


def _task_prompts(name: str, count: int, tokenizer: PreTrainedTokenizerBase | None) -> list[str]:
    from kvevict.bench.tasks import get_task
    from kvevict.generation import CONTEXT_QUESTION_SEPARATOR

    task = get_task(name)
    try:
        samples = task.samples(tokenizer, length=TASK_LENGTH, count=count)
    except Exception as err:  # datasets raises many kinds when the hub is unreachable
        where = " (it loads from the Hugging Face hub, which needs internet)" if task.source == "hub" else ""
        raise ValueError(
            f"could not load the samples of task {name!r}{where}: {type(err).__name__}: {err}. "
            f"Offline, use {BUILTIN!r} or a .txt/.jsonl file of prompts"
        ) from err
    return [s.context + (CONTEXT_QUESTION_SEPARATOR + s.question if s.question else "") for s in samples]


# -- the distribution ---------------------------------------------------------------------
@dataclass
class MRISummary:
    """The MRI distribution of a population of cache entries (paper Fig. 3(c))."""

    tokens: int
    """Entries counted (all (layer, KV head, token) entries)."""
    recurring: int
    """Entries with MRI ≥ 1 (attended at least once after they entered the cache)."""
    share_mri_gt_0: float
    share_mri_gt_1: float
    """Share of all entries with MRI > 1 (the paper's "importance recurrence")."""
    max_mri: int
    percentiles_recurring: dict[int, int]
    """MRI percentiles over the recurring entries (MRI ≥ 1)."""
    percentiles_all: dict[int, int]
    """MRI percentiles over all entries (MRI = 0 included)."""
    suggested_window: int | None
    """The 80th percentile over recurring entries (None when nothing recurs)."""


def _percentiles(values: np.ndarray) -> dict[int, int]:
    if values.size == 0:
        return {}
    found = np.percentile(values, PERCENTILES, method="inverted_cdf")
    return {p: int(v) for p, v in zip(PERCENTILES, found)}


def mri_summary(mri_values: np.ndarray | Sequence[int] | torch.Tensor) -> MRISummary:
    """Shares and percentiles of a flat collection of MRI values (any shape, flattened)."""
    if isinstance(mri_values, torch.Tensor):
        mri_values = mri_values.detach().cpu().numpy()
    values = np.asarray(mri_values, dtype=np.int64).reshape(-1)
    if values.size == 0:
        raise ValueError("no MRI values to summarise")
    recurring = values[values >= 1]
    by_recurring = _percentiles(recurring)
    return MRISummary(
        tokens=int(values.size),
        recurring=int(recurring.size),
        share_mri_gt_0=float((values > 0).mean()),
        share_mri_gt_1=float((values > 1).mean()),
        max_mri=int(values.max()),
        percentiles_recurring=by_recurring,
        percentiles_all=_percentiles(values),
        suggested_window=by_recurring.get(W_PERCENTILE),
    )


# -- running a model ----------------------------------------------------------------------
def recurrence_cache(model: PreTrainedModel, alpha: float | None = None) -> EvictionCache:
    """A LazyEviction cache that tracks TS/MRI but never evicts (α: the family default)."""
    from kvevict.cache import EvictionCache
    from kvevict.policies.lazyeviction import LazyEviction

    return EvictionCache(model, LazyEviction(alpha=alpha), budget=NEVER_EVICT)


def layer_mri(cache: EvictionCache) -> list[np.ndarray]:
    """The MRI of every retained entry, ``[Hkv, n]`` int per layer (batch 1)."""
    from kvevict.policies.lazyeviction import MRI

    lazy = cache.policy.method
    return [lazy.state(layer)[MRI][0].cpu().numpy() for layer in cache.eviction_layers]


def track_generation(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    ids: torch.Tensor,
    max_new_tokens: int,
    cache: EvictionCache,
) -> torch.Tensor:
    """Greedy generation after ``ids`` ``[1, n]``: all but its last token are prefilled, that
    token is the query of decode step 1. Returns the new token ids; ``cache`` holds TS/MRI."""
    from kvevict.generation import continue_greedy, prefill

    if ids.shape[-1] < 2:
        raise ValueError("the prompt must be at least 2 tokens long")
    prefill(model, ids[:, :-1], cache)
    return continue_greedy(model, tokenizer, ids, cache, max_new_tokens)


@dataclass
class RecurrenceRun:
    """MRIs of a set of prompts, with what produced them."""

    model: str
    prompt_set: str
    alpha: float
    max_new_tokens: int
    prompt_tokens: list[int] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    layers: list[list[np.ndarray]] = field(default_factory=list)
    """Per layer, the flat MRI arrays of every prompt."""

    def add(self, prompt_tokens: int, new_tokens: int, mri: list[np.ndarray]) -> None:
        self.prompt_tokens.append(prompt_tokens)
        self.new_tokens.append(new_tokens)
        if not self.layers:
            self.layers = [[] for _ in mri]
        for store, values in zip(self.layers, mri):
            store.append(values.reshape(-1))

    def values(self, layer: int | None = None) -> np.ndarray:
        """Flat MRI of every entry (of one layer, or of all)."""
        stores = self.layers if layer is None else [self.layers[layer]]
        return np.concatenate([value for store in stores for value in store])


def run_recurrence(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 512,
    alpha: float | None = None,
    model_name: str = "",
    prompt_set: str = "",
    progress: bool = True,
) -> RecurrenceRun:
    """One full-cache greedy generation per prompt (chat template applied) under MRI tracking."""
    from tqdm import tqdm

    from kvevict.generation import split_prompt

    if max_new_tokens < 1:
        raise ValueError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
    run: RecurrenceRun | None = None
    for text in tqdm(prompts, desc="recurrence", unit="prompt", disable=not progress):
        cache = recurrence_cache(model, alpha)
        if run is None:
            run = RecurrenceRun(model_name, prompt_set, cache.policy.method.alpha, max_new_tokens)
        head, tail = split_prompt(tokenizer, text)
        ids = torch.cat([head, tail], dim=-1)
        new = track_generation(model, tokenizer, ids, max_new_tokens, cache)
        run.add(ids.shape[-1], int(new.shape[-1]), layer_mri(cache))
    if run is None:
        raise ValueError("no prompts to run")
    return run


# -- reporting ----------------------------------------------------------------------------
POPULATION = (
    "every (layer, KV head, token) entry retained at the end of generation: prompt and decode tokens "
    "(the last generated token is never fed back); nothing is evicted"
)


def summarize_run(run: RecurrenceRun) -> dict[str, Any]:
    """The JSON summary: settings, overall and per-layer distributions, and MRI counts."""
    overall = mri_summary(run.values())
    counts = np.bincount(run.values())
    return {
        "model": run.model,
        "prompt_set": run.prompt_set,
        "prompts": len(run.prompt_tokens),
        "alpha": run.alpha,
        "max_new_tokens": run.max_new_tokens,
        "prompt_tokens": run.prompt_tokens,
        "new_tokens": run.new_tokens,
        "population": POPULATION,
        "percentile_method": "inverted_cdf (smallest observed MRI v with >= p% of the population <= v)",
        "suggested_window_rule": f"{W_PERCENTILE}th percentile of MRI over recurring entries (MRI >= 1)",
        "overall": asdict(overall),
        "layers": [asdict(mri_summary(run.values(i))) for i in range(len(run.layers))],
        "mri_counts": {str(value): int(count) for value, count in enumerate(counts) if count},
    }


def format_summary(summary: MRISummary, layers: Sequence[MRISummary] = (), title: str = "") -> str:
    """A plain-text report: shares, percentiles for both populations, the suggested W and an
    optional per-layer table."""
    lines = [title] if title else []
    lines += [
        f"entries (layer x KV head x token): {summary.tokens}",
        f"recurring (MRI >= 1):              {summary.recurring}",
        f"share MRI > 0 (recurring):         {summary.share_mri_gt_0:.1%}",
        f"share MRI > 1:                     {summary.share_mri_gt_1:.1%}",
        f"max MRI:                           {summary.max_mri}",
        "",
    ]
    header = ["population", *(f"p{p}" for p in PERCENTILES)]
    rows = [
        ["recurring (MRI>=1)", *_cells(summary.percentiles_recurring)],
        ["all entries", *_cells(summary.percentiles_all)],
    ]
    lines += text_table(header, rows)
    window = summary.suggested_window
    lines += [
        "",
        (
            f"suggested W = {window if window is not None else '-'} "
            f"(p{W_PERCENTILE} of MRI over recurring entries: {W_PERCENTILE}% of them recur within W steps)"
        ),
    ]
    if layers:
        header = ["layer", "entries", "MRI>1", *(f"p{p}" for p in PERCENTILES)]
        rows = [
            [str(i), str(s.tokens), f"{s.share_mri_gt_1:.1%}", *_cells(s.percentiles_recurring)]
            for i, s in enumerate(layers)
        ]
        lines += ["", "per layer (percentiles over recurring entries):", *text_table(header, rows)]
    return "\n".join(lines)


def _cells(percentiles: dict[int, int]) -> list[str]:
    return [str(percentiles[p]) if p in percentiles else "-" for p in PERCENTILES]


def plot_histogram(mri_values: np.ndarray, path: str | Path, window: int | None = None, title: str = "") -> Path:
    """Histogram of MRI over all entries (log-scale counts), a dashed line at ``window``."""
    plt = pyplot()

    values = np.asarray(mri_values, dtype=np.int64).reshape(-1)
    top = int(values.max()) if values.size else 0
    width = max(1, -(-(top + 1) // 200))  # at most ~200 bins of whole MRI values
    edges = np.arange(0, top + width + 1, width) - 0.5
    figure, axis = plt.subplots(figsize=(6.4, 3.8))
    axis.hist(values, bins=edges, log=True, color="tab:blue", alpha=0.8)
    if window is not None:
        axis.axvline(window, color="tab:red", linestyle="--", linewidth=1.2, label=f"suggested W = {window}")
        axis.legend(frameon=False)
    axis.set_xlabel("maximum recurrence interval (decode steps)")
    axis.set_ylabel("entries (log)")
    axis.set_title(title or "MRI distribution")
    axis.grid(alpha=0.3)
    return save_figure(figure, path)


def write_summary(summary: dict[str, Any], directory: str | Path) -> Path:
    """Write ``summary`` to ``DIRECTORY/recurrence.json``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "recurrence.json"
    path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return path
