"""What a gates file records of how its gates were judged: a bench run's scores, per task and keep, beside the
full cache's, on the same samples (``kvevict train-gates --judged RESULTS``).

The shipped gates carry the scores of the needle families their training data never held
(:data:`kvevict.bench.needles.HELD_OUT`) and RULER's own phrasing, so a user reads in the file itself what the
gates keep at a quarter and a tenth of the cache (docs/fastkvzip.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from safetensors import safe_open

from kvevict.bench.report import policy_label, sample_scores
from kvevict.gates import load_gates, save_gates

KEY = "held_out_scores"
"""The metadata entry holding the judgement (a JSON object)."""

SETTINGS = ("interval", "query_aware")
"""Run settings a judged policy's label names where a row has them, besides its quantization."""


def judgement(rows: Iterable[dict[str, Any]], policy: str) -> dict[str, Any]:
    """Mean scores (in %) of ``policy`` at each keep and of ``full``, per task, on the samples both ran; and
    ``policy``'s mean over every task as a share (%) of the full cache's, per keep; the prompts' lengths.

    Settings are told apart as ``kvevict report`` labels them: ``policy`` names the unquantized, context-only runs
    (``"fastkvzip (int4)"`` the int4 ones), and ``full`` is always the unquantized full cache, so a results file that
    also holds quantized or query-aware runs of the same policy is not merged into one setting."""
    rows = [row for row in rows if policy_label(row, SETTINGS) in (policy, "full")]
    scores = sample_scores(rows, SETTINGS)
    full = scores.pop(("full", None), {})
    if not full or not scores:
        raise ValueError(f"the results hold no samples of both 'full' and {policy!r}; bench them together")
    keeps = sorted((keep for _, keep in scores), reverse=True)
    samples = sorted(set(full).intersection(*scores.values()))
    if not samples:
        raise ValueError(f"'full' and {policy!r} ran no sample in common; bench them together")

    def mean(found: dict[tuple[str, int], float], task: str | None = None) -> float:
        chosen = [found[sample] for sample in samples if task in (None, sample[0])]
        return round(100 * sum(chosen) / len(chosen), 1)

    tasks = sorted({task for task, _ in samples})
    lengths = sorted({row["length"] for row in rows if row["policy"] != "full"})
    return {
        "policy": policy,
        "lengths": lengths,
        "samples": len(samples),
        "tasks": {
            task: {"full": mean(full, task)} | {str(k): mean(scores[policy, k], task) for k in keeps} for task in tasks
        },
        "share_of_full": {
            str(k): round(
                100 * sum(scores[policy, k][s] for s in samples) / max(sum(full[s] for s in samples), 1e-9), 1
            )
            for k in keeps
        },
    }


def record(gates: Path, results: Iterable[Path], policy: str = "fastkvzip") -> dict[str, Any]:
    """Write the :func:`judgement` of ``policy`` in ``results`` (bench JSON lines) into the gates file's metadata
    (its tensors and other entries unchanged); returns it."""
    rows = [json.loads(line) for path in results for line in Path(path).read_text().splitlines() if line.strip()]
    judged = judgement(rows, policy)
    with safe_open(str(gates), "pt") as opened:
        metadata = opened.metadata() or {}
    save_gates(gates, load_gates(gates), metadata | {KEY: json.dumps(judged, sort_keys=True)})
    return judged


__all__ = ["KEY", "judgement", "record"]
