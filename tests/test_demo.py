"""The demo's plan end to end on a tiny random model behind the real SmolLM2 tokenizer: the
same code path as ``make demo``, at sizes that run in seconds."""

import dataclasses

import pytest

from kvevict.demo import DEMO, run_demo
from kvevict.storage import capacity_bound
from tests.bench.test_throughput import full_column_bytes, rows_bound
from tests.conftest import tiny_model


def test_the_plan_covers_the_three_acts_the_seeds_and_both_keeps() -> None:
    compress, generate = DEMO.compress, DEMO.generate
    assert not compress.query_aware and compress.keeps == (0.25, 0.10) and compress.length == 2048
    assert {"critical+adakv+snapkv", "momentkv", "kvzip"} <= set(compress.policies)
    assert generate.tasks == ("longgen",) and generate.budgets == (128,)
    assert {"lazyeviction[alpha=0.002]", "epikv", "rkv", "moment-nc+h2o"} <= set(generate.policies)
    assert DEMO.long.workload == "longgen" and DEMO.ask.workload == "ask" and DEMO.ask.questions == 8
    final = 60 + DEMO.long.new_tokens  # longgen's prompts are ~60 tokens
    assert DEMO.long_budget <= final / 4  # a budget of at most a quarter of the final length


@pytest.fixture
def small_plan(tokenizer):
    model = tiny_model(vocab=len(tokenizer))
    compress = dataclasses.replace(
        DEMO.compress, model="tiny", policies=("full", "streamingllm", "snapkv"), keeps=(0.5, 0.25), length=160
    )
    generate = dataclasses.replace(DEMO.generate, model="tiny", policies=("full", "h2o", "tova"), budgets=(24,))
    generate = dataclasses.replace(generate, max_new_tokens=12)
    # room for two full sequences' resident KV (a third one's prefill beside them): eviction admits more
    cap = (rows_bound(model, 2, 100) + capacity_bound(70, 0) * sum(full_column_bytes(model))) / 2**20
    long = dataclasses.replace(DEMO.long, model="tiny", prompts=4, new_tokens=30, memory_cap_mib=cap)
    ask = dataclasses.replace(DEMO.ask, model="tiny", prompts=2, length=200, new_tokens=4, questions=3)
    return dataclasses.replace(DEMO, compress=compress, generate=generate, long=long, long_budget=16, ask=ask), model


def test_the_demo_prints_three_tables_plots_and_a_recommendation(small_plan, tokenizer, tmp_path, capsys) -> None:
    plan, model = small_plan
    recommendation = run_demo(tmp_path, plan, model, tokenizer)
    out = capsys.readouterr().out
    for title in (
        "Act 1 · Compress a document once, ask later",
        "Act 2 · Evict while generating",
        "Act 3 · The payoff: long generations",
        "Act 3 · The payoff: compress once, ask many times",
    ):
        assert title in out
    assert "Recommendation (from the numbers above)" in out and recommendation in out
    best_decode = recommendation.splitlines()[2].split()[3]  # "- long generations: <policy> agrees ..."
    best_prefill = recommendation.splitlines()[3].split()[7]  # "- compress ... later: <policy> at keep ..."
    assert best_decode in ("h2o", "tova") and best_prefill in ("streamingllm", "snapkv")
    assert best_decode in out.split("Act 3")[1].split("compress once")[0]  # act 3 serves act 2's best policy
    assert best_prefill in out.split("compress once, ask many")[1]  # and act 1's
    for name in ("compress.png", "generate.png", "payoff-long.png", "payoff-ask.png"):
        assert (tmp_path / name).stat().st_size > 5_000
    # resumable and deterministic: a rerun reuses every result and prints the same tables
    results = sorted(path.read_text() for path in tmp_path.rglob("*.jsonl"))
    assert run_demo(tmp_path, plan, model, tokenizer) == recommendation
    assert sorted(path.read_text() for path in tmp_path.rglob("*.jsonl")) == results
    assert capsys.readouterr().out == out
