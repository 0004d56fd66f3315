"""The demo's plan end to end on a tiny random model behind the real SmolLM2 tokenizer: the
same code path as ``make demo``, at sizes that run in seconds."""

import dataclasses

import pytest

from kvevict.bench.throughput import token_bytes
from kvevict.demo import DEMO, run_demo
from tests.conftest import tiny_model


def test_the_plan_covers_the_three_acts_the_seeds_and_both_keeps() -> None:
    compress, generate = DEMO.compress, DEMO.generate
    assert not compress.query_aware and compress.keeps == (0.25, 0.10) and compress.length == 2048
    assert {"critical+adakv+snapkv", "momentkv[mi=false]", "kvzip"} <= set(compress.policies)
    assert generate.tasks == ("longgen",) and generate.budgets == (128,)
    assert {"lazyeviction[alpha=0.002]", "epikv", "rkv", "moment-nc+h2o"} <= set(generate.policies)
    assert DEMO.payoff.memory_cap_mib > 0


@pytest.fixture
def small_plan(tokenizer):
    model = tiny_model(vocab=len(tokenizer))
    compress = dataclasses.replace(
        DEMO.compress, model="tiny", policies=("full", "streamingllm", "snapkv"), keeps=(0.5, 0.25), length=160
    )
    generate = dataclasses.replace(DEMO.generate, model="tiny", policies=("full", "h2o", "tova"), budgets=(24,))
    generate = dataclasses.replace(generate, max_new_tokens=12)
    # room for two full sequences' KV: eviction admits more of them at once
    cap = 2 * 200 * token_bytes(model) / 2**20
    payoff = dataclasses.replace(DEMO.payoff, model="tiny", prompts=3, length=160, new_tokens=4, memory_cap_mib=cap)
    return dataclasses.replace(DEMO, compress=compress, generate=generate, payoff=payoff), model


def test_the_demo_prints_three_tables_plots_and_a_recommendation(small_plan, tokenizer, tmp_path, capsys) -> None:
    plan, model = small_plan
    recommendation = run_demo(tmp_path, plan, model, tokenizer)
    out = capsys.readouterr().out
    for title in (
        "Act 1 · Compress a document once, ask later",
        "Act 2 · Evict while generating",
        "Act 3 · The payoff",
    ):
        assert title in out
    assert "Recommendation (from the numbers above)" in out and recommendation in out
    best_prefill = recommendation.splitlines()[2].split()[7]  # "- compress ... later: <policy> at keep ..."
    assert best_prefill in ("streamingllm", "snapkv")
    assert best_prefill in out.split("Act 3")[1]  # act 3 serves act 1's best policy
    for name in ("compress.png", "generate.png", "payoff.png"):
        assert (tmp_path / name).stat().st_size > 5_000
    # resumable and deterministic: a rerun reuses every result and prints the same tables
    results = sorted(path.read_text() for path in tmp_path.rglob("*.jsonl"))
    assert run_demo(tmp_path, plan, model, tokenizer) == recommendation
    assert sorted(path.read_text() for path in tmp_path.rglob("*.jsonl")) == results
    assert capsys.readouterr().out == out
