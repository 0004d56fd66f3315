"""``kvevict bench vllm`` (kvevict.bench.served) on a tiny random Llama: vLLM alone and the
plug-in under one pool, a record per run in the results directory, the table and the plot; a
rerun serves nothing again."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from kvevict.bench import served
from kvevict.cli import main

ARGS = ["--prompts", "3", "--prompt-tokens", "40", "--new-tokens", "48", "--pool-sequences", "2", "--enforce-eager"]


def test_the_plug_in_and_vllm_alone_are_served_under_one_pool_and_recorded(tiny_llama_dir, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["bench", "vllm", "--model", str(tiny_llama_dir), *ARGS, "--policies", "tova", "--budgets", "32"]
    assert main([*argv, "--interval", "8", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["policy"], r["budget"]) for r in records] == [("full", None), ("tova", 32)]
    full, tova = records
    pool = full["pool_blocks"]
    assert pool == 2 * 3 + 1 - 1  # two sequences of 88 tokens in blocks of 32, and a spare, less the null block
    # vLLM admits all three (their prompts fit) and preempts as they grow; the plug-in's three fit evicting
    assert full["preempted"] > 0 and tova["most_running"] == 3 and tova["preempted"] == 0
    assert all(used <= pool for _, used, _ in full["blocks"] + tova["blocks"])
    assert full["tokens"] == tova["tokens"] == 3 * 48
    assert 0.0 <= tova["top1"] <= 1.0 and tova["kl"] >= 0.0
    assert tova["itl_p50"] <= tova["itl_p95"]
    printed = capsys.readouterr().out
    assert "vs vLLM" in printed and "tova" in printed
    assert (out / "vllm.png").exists() == served.plot(records, tmp_path / "again.png")


def test_a_rerun_serves_nothing_it_has(tiny_llama_dir, tmp_path, monkeypatch) -> None:
    out = tmp_path / "run"
    argv = ["bench", "vllm", "--model", str(tiny_llama_dir), *ARGS, "--policies", "streamingllm", "--budgets", "32"]
    assert main([*argv, "--no-fidelity", "--out", str(out)]) == 0

    def refuse(*args, **kwargs):
        raise AssertionError("served again")

    monkeypatch.setattr(served, "run_engine", refuse)
    assert main([*argv, "--no-fidelity", "--out", str(out)]) == 0
    assert len((out / "results.jsonl").read_text().splitlines()) == 2


def test_bad_input_is_refused_in_one_line(capsys) -> None:
    assert main(["bench", "vllm", "--block-size", "48"]) == 2
    assert capsys.readouterr().err == (
        "kvevict bench vllm: error: --block-size must be a multiple of 32 (vLLM's CPU kernels), got 48\n"
    )
