"""``kvevict bench quant`` on the tiny model: the runs it plans, the bytes it counts, the rows
it reports (its timings are never asserted)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvevict
from kvevict.bench import quantized
from kvevict.bench.quantized import QuantRun, cache_bytes, measure, plan
from tests.conftest import prompt, tiny_model


def test_plans_full_quantized_the_peer_at_its_bits_then_each_policy_with_and_without() -> None:
    runs = plan(["snapkv"], 0.25, ("int8", "int4"), peer=True)
    assert [run.label for run in runs] == [
        "kvevict full int8",
        "kvevict full int4",
        "QuantizedCache quanto int4",  # quanto has no int8
        "kvevict snapkv keep 0.25 unquantized",
        "kvevict snapkv keep 0.25 int8",
        "kvevict snapkv keep 0.25 int4",
    ]
    assert not any(run.peer for run in plan(["snapkv"], 0.25, ("int4",), peer=False))


def test_counts_what_each_cache_holds() -> None:
    model = tiny_model()
    dynamic, evicting = DynamicCache(), kvevict.EvictionCache(model, "snapkv", keep=0.5, quant="int4", quant_group=8)
    with torch.no_grad():
        for cache in (dynamic, evicting):
            model(input_ids=prompt(64), past_key_values=cache)
    assert cache_bytes(dynamic) == sum(x.numel() * 4 for layer in dynamic.layers for x in (layer.keys, layer.values))
    assert cache_bytes(evicting) == evicting.kv_bytes()


def test_reports_fidelity_bytes_and_a_paired_step_ratio_per_run() -> None:
    model = tiny_model()
    runs = [QuantRun(quant="int8"), QuantRun("snapkv", 0.5), QuantRun("snapkv", 0.5, "int2")]
    rows = measure(model, [prompt(80)], runs, new_tokens=4, group=8, residual=8)
    assert [row["run"] for row in rows] == [run.label for run in runs]
    assert all(0 <= row["top1"] <= 1 and row["kl"] >= 0 and row["step_ratio"] > 0 for row in rows)
    assert rows[2]["kv_mib"] < rows[1]["kv_mib"] and rows[2]["mean_kv_mib"] < rows[1]["mean_kv_mib"]
    assert "decode step / DynamicCache" in quantized.format_table(rows)


def test_the_peer_is_transformers_quantized_cache() -> None:
    pytest.importorskip("optimum.quanto")
    model = tiny_model()
    rows = measure(model, [prompt(80)], [QuantRun(quant="int4", peer=True)], new_tokens=3, group=8, residual=8)
    assert rows[0]["run"] == "QuantizedCache quanto int4" and rows[0]["kv_mib"] > 0


@pytest.mark.parametrize("quant", ["int4", "int2"])
def test_full_quantized_holds_no_more_than_the_peer_at_the_same_residual(quant: str) -> None:
    """Over a whole flush cycle (8 decode steps, residual 8) both hold each of 0 .. 7 entries at full
    precision once (quanto from 0 after the 83-token prompt, kvevict from 83 mod 8 = 3)."""
    pytest.importorskip("optimum.quanto")
    model = tiny_model()
    runs = [QuantRun(quant=quant), QuantRun(quant=quant, peer=True)]
    mine, peer = measure(model, [prompt(83)], runs, new_tokens=9, group=8, residual=8)
    assert mine["mean_kv_mib"] <= peer["mean_kv_mib"]


def test_a_run_whose_policy_refuses_a_prompt_is_left_out_of_that_prompt() -> None:
    """keep 0.25 of a 40-token prompt is a budget of 10, below snapkv's window of 32."""
    model = tiny_model()
    runs = [QuantRun(quant="int4"), QuantRun("snapkv", 0.25, "int4")]
    rows = measure(model, [prompt(40)], runs, new_tokens=3, group=8, residual=8)
    assert [(row["run"], row["prompts"]) for row in rows] == [("kvevict full int4", 1)]
