"""The frontier in bytes (kvevict.bench.frontier): each setting's score against its resident bytes."""

import pytest

from kvevict.bench.frontier import cheapest, format_frontier, pareto, plot_frontier, saving, settings
from kvevict.bench.report import AVERAGE, summarize


def record(policy: str, score: float, kv_bytes: int, task: str = "t", keep=None, quant=None) -> dict:
    return {
        "task": task, "index": 0, "policy": policy, "budget": None, "keep": keep, "quant": quant,
        "score": score, "kv_bytes_final": kv_bytes, "fidelity": None,
    }  # fmt: skip


RUN = [
    record("full", 1.0, 1000),
    record("full", 1.0, 300, quant="int4"),
    record("snapkv", 1.0, 250, keep=0.25),
    record("snapkv", 0.5, 100, keep=0.1),
    record("snapkv", 0.96, 70, keep=0.25, quant="int4"),
    record("snapkv", 0.9, 120, keep=0.1, quant="int8"),  # dominated: more bytes, a lower score than 70's
    record("think+snapkv", 0.97, 200, keep=0.25),
]


def test_each_setting_is_its_score_and_bytes_as_shares_of_the_full_unquantized_cache() -> None:
    found = {setting.label: setting for setting in settings(summarize(RUN))}
    assert found["full (int4)"].score == 100 and found["full (int4)"].bytes == 30
    assert (found["snapkv (int4) @ 25%"].score, found["snapkv (int4) @ 25%"].bytes) == (pytest.approx(96), 7)
    assert [found[label].axis for label in ("full (int4)", "snapkv @ 10%", "snapkv (int4) @ 25%")] == [
        "quantization",
        "eviction",
        "eviction + quantization",
    ]
    assert found["think+snapkv @ 25%"].axis == "eviction + channels" and saving("think") == "channels"


def test_the_frontier_keeps_the_settings_nothing_beats_and_names_the_cheapest_that_keeps_95_percent() -> None:
    found = settings(summarize(RUN))
    assert [setting.label for setting in pareto(found)] == ["snapkv (int4) @ 25%", "think+snapkv @ 25%", "snapkv @ 25%"]
    assert cheapest(found).label == "snapkv (int4) @ 25%"
    assert cheapest(found, keeps=99).label == "snapkv @ 25%"  # (full (int4): as high, more bytes)
    text = format_frontier(found)
    assert "★ snapkv (int4) @ 25%" in text and "★ snapkv (int8)" not in text
    assert text.endswith("snapkv (int4) @ 25% (96.0 %, 1/14.3 of the full cache's bytes)")


def test_several_tasks_are_averaged_and_a_run_without_the_full_cache_is_refused(tmp_path) -> None:
    run = RUN + [{**r, "task": "u", "score": r["score"] / 2} for r in RUN]
    rows = summarize(run)
    assert {row.task for row in rows} >= {AVERAGE}
    assert len(settings(rows)) == len(RUN) - 1
    with pytest.raises(ValueError, match="needs the full, unquantized cache"):
        settings(summarize([r for r in RUN if r["policy"] != "full" or r["quant"]]))
    assert plot_frontier(settings(rows), tmp_path / "f.png").is_file()
