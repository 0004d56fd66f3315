"""A gates file's record of how it was judged (kvevict.gates.judged): scores by hand, the file's tensors and
other metadata untouched."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from kvevict.gates import initial_gates, load_gates, save_gates, shape_of
from kvevict.gates.judged import KEY, judgement, record
from tests.conftest import tiny_model


def row(policy: str, task: str, index: int, score: float, keep: float | None = None) -> dict:
    return {"policy": policy, "task": task, "index": index, "score": score, "keep": keep, "length": 2048}


ROWS = [
    row("full", "a", 0, 1.0),
    row("full", "a", 1, 1.0),
    row("full", "b", 0, 0.5),
    row("fastkvzip", "a", 0, 1.0, 0.25),
    row("fastkvzip", "a", 1, 1.0, 0.25),
    row("fastkvzip", "b", 0, 0.5, 0.25),
    row("fastkvzip", "a", 0, 1.0, 0.1),
    row("fastkvzip", "a", 1, 0.0, 0.1),
    row("fastkvzip", "b", 0, 0.25, 0.1),
    row("snapkv", "a", 0, 0.0, 0.1),
]


def test_the_judgement_by_hand() -> None:
    """Keep 0.10: (1 + 0 + 0.25) / (1 + 1 + 0.5) = 50 % of the full cache's score; per task, the means."""
    judged = judgement(ROWS, "fastkvzip")
    assert judged == {
        "policy": "fastkvzip",
        "lengths": [2048],
        "samples": 3,
        "tasks": {"a": {"full": 100.0, "0.25": 100.0, "0.1": 50.0}, "b": {"full": 50.0, "0.25": 50.0, "0.1": 25.0}},
        "share_of_full": {"0.25": 100.0, "0.1": 50.0},
    }


def test_only_the_samples_every_setting_ran_count() -> None:
    judged = judgement([*ROWS, row("full", "c", 0, 1.0), row("fastkvzip", "c", 1, 1.0, 0.1)], "fastkvzip")
    assert judged["samples"] == 3 and "c" not in judged["tasks"]


@pytest.mark.parametrize("rows", [[r for r in ROWS if r["policy"] != "full"], ROWS[:3]])
def test_results_without_both_settings_are_refused_in_one_line(rows) -> None:
    with pytest.raises(ValueError, match="hold no samples of both 'full' and 'fastkvzip'") as error:
        judgement(rows, "fastkvzip")
    assert "\n" not in str(error.value)


def test_recording_writes_the_judgement_and_keeps_the_gates_and_the_recipe(tmp_path) -> None:
    gates_path, results = tmp_path / "gates.safetensors", tmp_path / "results.jsonl"
    gates = initial_gates(shape_of(tiny_model().config), seed=3)
    save_gates(gates_path, gates, {"teacher": "answers", "count": "64"})
    results.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    judged = record(gates_path, [results])
    with safe_open(str(gates_path), "pt") as opened:
        metadata = opened.metadata()
    assert json.loads(metadata.pop(KEY)) == judged == judgement(ROWS, "fastkvzip")
    assert metadata == {"teacher": "answers", "count": "64"}
    for mine, saved in zip(gates, load_gates(gates_path)):
        assert all(torch.equal(mine[part].half().float(), saved[part]) for part in mine)


def test_results_whose_settings_share_no_sample_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="'full' and 'fastkvzip' ran no sample in common; bench them together"):
        judgement([row("full", "a", 0, 1.0), row("fastkvzip", "b", 1, 1.0, 0.1)], "fastkvzip")


def test_quantized_and_query_aware_runs_of_the_policy_are_settings_of_their_own() -> None:
    def int4(record: dict) -> dict:
        return record | {"quant": "int4", "score": 0.0}

    others = [int4(r) for r in ROWS] + [r | {"query_aware": True, "score": 0.0} for r in ROWS if r["policy"] != "full"]
    assert judgement([*ROWS, *others], "fastkvzip") == judgement(ROWS, "fastkvzip")
    quantized = judgement([*ROWS, *others], "fastkvzip (int4)")
    assert quantized["policy"] == "fastkvzip (int4)" and quantized["samples"] == 3
    assert quantized["tasks"]["a"] == {"full": 100.0, "0.25": 0.0, "0.1": 0.0}  # against the unquantized full cache
