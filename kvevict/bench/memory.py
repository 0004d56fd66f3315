"""``kvevict bench memory``: peak memory of one prefill pass vs context length (seed 000, Fig. 1).

Three paths over the same model and the same random prompt of each length:

* ``eager-attentions``: the eager kernel with ``output_attentions=True``, what reading attention
  weights costs (every layer's ``H × n × n`` map is materialised and returned);
* ``attention-free``: kvevict's path for the EpiKV family: the SDPA kernel, an
  :class:`~kvevict.cache.EvictionCache` under ``epikv`` whose hooks read the hidden states;
* ``attention-requiring``: kvevict's path for attention scorers: SDPA plus ``h2o``'s column sums
  computed in query chunks (``chunk × n`` per head, never ``n × n``).

Both kvevict paths keep the whole prompt (decode-time eviction), so they differ only by what
scoring costs during the pass. Three more paths prefill in chunks with eviction (DESIGN §1.10):

* ``chunked-snapkv``, ``chunked-h2o`` (attention-requiring) and ``chunked-epikv``
  (attention-free): the prompt goes in ``--chunk`` tokens per pass, each chunk attends to the
  retained entries plus itself and the cache evicts back to ``--budget`` (SnapKV scores each
  chunk by its last window queries, H2O by chunked column sums, EpiKV by its frozen
  hidden-state scores, the chunk's own counting as kept until scored), so the cache never
  holds more than ``budget + chunk`` entries per KV head and peak memory stops growing with
  the context (only the token ids and the per-token scalars of the scores do).
  ``chunked-epikv`` holds the first chunk whole, as it would a whole prompt, so it takes
  ``--chunk`` ≤ ``--budget`` (:class:`~kvevict.policies.selection.PromptKeeping`).
  ``chunked-fastkvzip`` (named only, not run by default: it needs the model's gates) is the
  default ``fastkvzip``, each chunk scored by the gates as it passes (attention-free), its one
  budget pooled over every layer and head allocated after each chunk (docs/fastkvzip.md, round
  8), each head holding the prompt's last 512 tokens on top of it until the last chunk (its
  ``prompt_window``: round 13); on a CPU each chunk's pass over a ragged layer stays packed and no
  head is capped (a head costs its own entries: round 9), on a GPU the pool gives a head at most
  ``4·budget`` entries (the prompt window on top, and the chunk during a pass).
  ``chunked-fastkvzip-per-layer`` (named only) is ``fastkvzip[per_layer=true]``: at most ``budget + 480
  + chunk`` per KV head before the last chunk (the prompt window's 512 over the 32-token window;
  SnapKV: ``budget + chunk``).

Every pass computes the logits of the last token only (``logits_to_keep=1``, as ``generate``
does at prefill), so the vocabulary-sized logits of every position do not mask the difference.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` above the memory in use before the
pass. On CPU, :class:`LiveTensorBytes` — a ``TorchDispatchMode`` that adds the bytes of every
tensor storage an operator creates during the pass and subtracts them when the last tensor on
that storage is freed; the peak of that sum is reported. It counts what the pass allocates
(activations, attention maps, the cache), not the weights already loaded, nor the private
workspaces inside fused kernels.

A length is not run for a path when the previous lengths predict it over ``--memory-cap``
(peak grows at most quadratically: ``peak(n) ≤ peak(m)·(n/m)²``), and a path stops after its
first measured peak over the cap. The longest feasible length per path is the longest measured
one under the cap, and an extrapolation from a fit ``a + b·n + c·n²`` over the measured points
(``c·n²`` through the longest point when fewer than 3 were measured).
Results go to ``OUT/memory.jsonl`` one line per (path, length) as soon as measured; a rerun
skips what is there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import PreTrainedModel

from kvevict.bench.options import comma_separated, device_option
from kvevict.bench.report import text_table
from kvevict.compat import with_cache
from kvevict.figures import pyplot, save_figure

DEFAULT_PATHS = (
    "eager-attentions",
    "attention-free",
    "attention-requiring",
    "chunked-snapkv",
    "chunked-h2o",
    "chunked-epikv",
)
PATHS = (*DEFAULT_PATHS, "chunked-fastkvzip", "chunked-fastkvzip-per-layer")
"""Every path; the ``chunked-fastkvzip`` ones only when named (they need the model's gates)."""
CHUNKED = {
    "chunked-snapkv": "snapkv",
    "chunked-h2o": "h2o",
    "chunked-epikv": "epikv",
    "chunked-fastkvzip": "fastkvzip",
    "chunked-fastkvzip-per-layer": "fastkvzip[per_layer=true]",
}
"""Chunked paths and the policy each evicts under."""
BUDGET, CHUNK = 256, 256
"""Default budget (entries per KV head) and prefill chunk of the chunked paths."""
RESULTS_FILE = "memory.jsonl"
MIB = 2**20


class LiveTensorBytes(TorchDispatchMode):
    """Tracks the bytes of tensor storages created inside the mode and still alive; ``peak``
    is the most held at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tensors: dict[int, list[int]] = {}  # storage address → [bytes, live tensors]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        address, size = storage.data_ptr(), storage.nbytes()
        if size == 0:
            return
        entry = self._tensors.get(address)
        if entry is None:
            entry = self._tensors[address] = [size, 0]
            self.live += size
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        weakref.finalize(tensor, self._release, address)

    def _release(self, address: int) -> None:
        entry = self._tensors.get(address)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._tensors[address]
            self.live -= entry[0]


@dataclass
class MemoryResult:
    model: str
    path: str
    length: int
    peak_bytes: int
    seconds: float
    device: str
    measure: str
    budget: int | None = None
    chunk: int | None = None
    """Budget and prefill chunk of a chunked path (None for the others)."""
    peak_tokens: int | None = None
    """Chunked paths: the most entries one KV head held during the prefill."""

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / MIB


def _use_kernel(model: PreTrainedModel, kernel: str) -> None:
    if model.config._attn_implementation != kernel:
        model.set_attn_implementation(kernel)


@torch.inference_mode()
def _run_path(model: PreTrainedModel, path: str, ids: torch.Tensor, budget: int, chunk: int) -> int | None:
    """One prefill pass of ``ids`` on ``path``; a chunked path returns the most entries a KV head held."""
    from kvevict.cache import EvictionCache
    from kvevict.generation import prefill
    from kvevict.policies import make_policy

    if path == "eager-attentions":
        _use_kernel(model, "eager")
        output = model(input_ids=ids, output_attentions=True, use_cache=False, logits_to_keep=1)
        assert output.attentions is not None and output.attentions[0].shape[-1] == ids.shape[-1]
        return None
    _use_kernel(model, "sdpa")
    if path in CHUNKED:
        with EvictionCache(model, CHUNKED[path], budget=budget) as cache:
            prefill(model, ids, cache, chunk=chunk)
            return cache.peak_entries()
    # both keep the whole prompt, so they differ only by what scoring costs during the pass
    policy = make_policy("epikv") if path == "attention-free" else make_policy("h2o", regime="decode")
    with EvictionCache(model, policy, budget=ids.shape[-1]) as cache:
        model(input_ids=ids, **with_cache(cache), use_cache=True, logits_to_keep=1)
    return None


class Peak(NamedTuple):
    """What :func:`measure_peak` measured of one pass."""

    bytes: int
    seconds: float
    measure: str
    tokens: int | None
    """Chunked paths: the most entries one KV head held."""


def measure_peak(
    model: PreTrainedModel, path: str, length: int, seed: int = 0, budget: int = BUDGET, chunk: int = CHUNK
) -> Peak:
    """Peak bytes of one prefill pass of ``length`` tokens on ``path``, its seconds, the
    measure used and (chunked paths) the most entries a KV head held."""
    if path not in PATHS:
        raise ValueError(f"unknown memory path {path!r}; known paths: {', '.join(PATHS)}")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=generator).to(model.device)
    start = time.perf_counter()
    if model.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        tokens = _run_path(model, path, ids, budget, chunk)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        return Peak(peak, time.perf_counter() - start, "cuda.max_memory_allocated", tokens)
    with LiveTensorBytes() as tracker:
        tokens = _run_path(model, path, ids, budget, chunk)
    return Peak(tracker.peak, time.perf_counter() - start, "live tensor bytes (TorchDispatchMode)", tokens)


def predicted_over_cap(measured: Sequence[tuple[int, int]], length: int, cap_bytes: int) -> bool:
    """Whether the quadratic bound from the longest measured point puts ``length`` over the cap."""
    if not measured:
        return False
    last_length, last_peak = max(measured)
    return last_peak * (length / last_length) ** 2 > cap_bytes


def longest_feasible(measured: Sequence[tuple[int, int]], cap_bytes: int) -> tuple[int | None, int | None]:
    """(longest measured length under the cap, extrapolated longest length from a fit
    ``a + b·n + c·n²`` — from ``c·n²`` through the longest point with fewer than 3 points;
    None when the fit never reaches the cap)."""
    within = [length for length, peak in measured if peak <= cap_bytes]
    longest = max(within) if within else None
    if not measured:
        return longest, None
    if len(measured) < 3:  # too few points to fit: quadratic growth from the longest one
        length, peak = max(measured)
        return longest, int(length * math.sqrt(cap_bytes / peak))
    lengths, peaks = (np.array(v, dtype=float) for v in zip(*sorted(measured)))
    c, b, a = np.polyfit(lengths, peaks, 2)
    roots = [r.real for r in np.roots([c, b, a - cap_bytes]) if abs(r.imag) < 1e-9 and r.real > 0]
    return longest, (int(min(roots)) if roots else None)


class MemoryStore:
    """``OUT/memory.jsonl``: one line per (model, path, length), flushed at once."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / RESULTS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.results = [MemoryResult(**json.loads(line)) for line in self._lines()]

    def _lines(self) -> list[str]:
        if not self.path.exists():
            return []
        return [line for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip().endswith("}")]

    def get(self, model: str, path: str, length: int, budget: int | None, chunk: int | None) -> MemoryResult | None:
        key = (model, path, length, budget, chunk)
        return next((r for r in self.results if (r.model, r.path, r.length, r.budget, r.chunk) == key), None)

    def add(self, result: MemoryResult) -> None:
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(asdict(result)) + "\n")
            out.flush()
            os.fsync(out.fileno())
        self.results.append(result)


def check_sizes(paths: Sequence[str], budget: int, chunk: int) -> None:
    """Refuse a budget or chunk the chunked ``paths`` cannot run with."""
    from kvevict.policies import make_policy

    if budget < 1 or chunk < 1:
        raise ValueError(f"--budget and --chunk must be positive, got {budget} and {chunk}")
    whole_first = [path for path in paths if path in CHUNKED and not make_policy(CHUNKED[path]).evicts_in("prefill")]
    if whole_first and chunk > budget:
        raise ValueError(
            f"{', '.join(whole_first)} holds the first chunk whole and evicts each later one back to the budget, so "
            f"it takes --chunk <= --budget: got --chunk {chunk} and --budget {budget}"
        )


def run_memory(
    model: PreTrainedModel,
    model_name: str,
    lengths: Sequence[int],
    out: str | Path,
    cap_bytes: int,
    paths: Sequence[str] = DEFAULT_PATHS,
    progress: bool = True,
    budget: int = BUDGET,
    chunk: int = CHUNK,
) -> dict[str, Any]:
    """Measure every path at every length (shortest first) into ``out``; returns the summary."""
    from tqdm import tqdm

    check_sizes(paths, budget, chunk)
    store = MemoryStore(out)
    skipped: dict[str, list[int]] = {path: [] for path in paths}
    jobs = [(path, length) for path in paths for length in sorted(lengths)]
    sizes = {path: (budget, chunk) if path in CHUNKED else (None, None) for path in paths}
    for path, length in tqdm(jobs, desc="bench memory", unit="pass", disable=not progress):
        if store.get(model_name, path, length, *sizes[path]) is not None:
            continue
        measured = [
            (r.length, r.peak_bytes)
            for r in store.results
            if (r.model, r.path, r.budget, r.chunk) == (model_name, path, *sizes[path])
        ]
        if (
            skipped[path]
            or any(peak > cap_bytes for _, peak in measured)
            or predicted_over_cap(measured, length, cap_bytes)
        ):
            skipped[path].append(length)
            continue
        peak = measure_peak(model, path, length, budget=budget, chunk=chunk)
        result = MemoryResult(
            model_name, path, length, peak.bytes, round(peak.seconds, 3), str(model.device), peak.measure
        )
        result.budget, result.chunk = sizes[path]
        result.peak_tokens = peak.tokens
        store.add(result)
    current = [r for r in store.results if (r.budget, r.chunk) == sizes.get(r.path, (None, None))]
    return summarize(current, model_name, lengths, cap_bytes, skipped)


def summarize(
    results: Sequence[MemoryResult],
    model_name: str,
    lengths: Sequence[int],
    cap_bytes: int,
    skipped: dict[str, list[int]],
) -> dict[str, Any]:
    rows = sorted(
        (r for r in results if r.model == model_name and r.length in lengths), key=lambda r: (r.length, r.path)
    )
    feasible = {}
    for path, not_run in skipped.items():
        measured = [(r.length, r.peak_bytes) for r in rows if r.path == path]
        longest, extrapolated = longest_feasible(measured, cap_bytes)
        feasible[path] = {"longest_measured": longest, "extrapolated": extrapolated, "not_run": not_run}
    return {"model": model_name, "cap_bytes": cap_bytes, "results": [asdict(r) for r in rows], "feasible": feasible}


def format_summary(summary: dict[str, Any]) -> str:
    paths = list(summary["feasible"])
    peaks = {(r["path"], r["length"]): r["peak_bytes"] / MIB for r in summary["results"]}
    lengths = sorted({length for _, length in peaks} | {n for f in summary["feasible"].values() for n in f["not_run"]})
    rows = [[str(n), *(f"{peaks[(p, n)]:.1f}" if (p, n) in peaks else "over cap" for p in paths)] for n in lengths]
    table = text_table(["length", *(f"{p} MiB" for p in paths)], rows)
    cap = summary["cap_bytes"] / MIB
    lines = [f"peak memory of one prefill pass, {summary['model']} (cap {cap:.0f} MiB)", *table, ""]
    for path, info in summary["feasible"].items():
        guess = info["extrapolated"]
        held = [f"{r['peak_tokens']} at {r['length']}" for r in summary["results"] if r["path"] == path]
        lines.append(
            f"{path}: longest measured under the cap {info['longest_measured']}, "
            f"extrapolated {'-' if guess is None else f'~{guess}'} tokens"
            + (f"; most entries a KV head held: {', '.join(held)}" if path in CHUNKED and held else "")
        )
    return "\n".join(lines)


def plot_summary(summary: dict[str, Any], path: str | Path) -> Path:
    plt = pyplot()

    figure, axes = plt.subplots(figsize=(6, 4))
    for name in summary["feasible"]:
        points = sorted((r["length"], r["peak_bytes"] / MIB) for r in summary["results"] if r["path"] == name)
        if points:
            axes.plot(*zip(*points), marker="o", label=name)
    axes.axhline(summary["cap_bytes"] / MIB, color="grey", linestyle="--", label="memory cap")
    axes.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="peak memory (MiB)")
    axes.set_title(f"one prefill pass, {summary['model']}")
    axes.legend()
    return save_figure(figure, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvevict bench memory",
        description="Peak memory of one prefill pass per context length: eager with output_attentions against "
        "kvevict's attention-free (epikv) and attention-requiring (h2o column sums) paths (EpiKV, Fig. 1), and "
        "chunked prefill with eviction (snapkv, h2o, epikv, fastkvzip: at most budget + chunk entries per KV head). "
        "Results in OUT/memory.jsonl (resumable), table printed, plot in OUT/memory.png.",
    )
    parser.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' or 'gemma3' (embedded, offline; gemma3: `make gemma3`), a hub id or a local path",
    )
    parser.add_argument(
        "--lengths", type=comma_separated(int, low=2), default=(512, 1024, 2048, 4096), help="comma-separated lengths"
    )
    parser.add_argument("--memory-cap", type=float, default=4096, help="memory cap in MiB (default: 4096)")
    parser.add_argument(
        "--paths",
        type=_paths,
        default=DEFAULT_PATHS,
        help=f"comma-separated subset of {', '.join(PATHS)} (default: all but chunked-fastkvzip)",
    )
    parser.add_argument("--budget", type=int, default=BUDGET, help=f"chunked paths: entries per KV head ({BUDGET})")
    parser.add_argument(
        "--chunk",
        type=int,
        default=CHUNK,
        help=f"chunked paths: prefill chunk in tokens ({CHUNK}; chunked-epikv: <= --budget)",
    )
    parser.add_argument("--out", type=Path, default=Path("results/memory"), help="results directory")
    parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    device_option(parser)
    return parser


def _paths(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [n for n in names if n not in PATHS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown paths {unknown}; known paths: {', '.join(PATHS)}")
    return names


def main(argv: Sequence[str]) -> int:
    from kvevict.models import load_model

    args = build_parser().parse_args(argv)
    if not math.isfinite(args.memory_cap) or args.memory_cap <= 0:
        raise ValueError(f"--memory-cap must be a positive number of MiB, got {args.memory_cap}")
    check_sizes(args.paths, args.budget, args.chunk)
    model, _ = load_model(args.model, dtype=args.dtype, device=args.device, attn_implementation="sdpa")
    summary = run_memory(
        model, args.model, args.lengths, args.out, int(args.memory_cap * MIB), args.paths, True, args.budget, args.chunk
    )
    print(format_summary(summary))
    (args.out / "memory.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    print(f"results: {args.out / RESULTS_FILE}\nplot: {plot_summary(summary, args.out / 'memory.png')}", flush=True)
    return 0
