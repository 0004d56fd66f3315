"""The runner end to end: a tiny random model behind the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from kvevict.bench import runner as runner_module
from kvevict.bench import tasks as tasks_module
from kvevict.bench.runner import BenchConfig, BenchRunner, Setting
from kvevict.bench.store import ResultStore
from kvevict.bench.task import Sample, Task
from tests.conftest import tiny_model

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
    "tau",
]


class SharedContextTask(Task):
    """Three questions: two about one context, one about another."""

    name = "shared_fixture"
    source = "offline"
    metric = "contains"

    def samples(self, tokenizer, *, length, count, seed=0):
        contexts = {"a": " ".join(WORDS * 8), "b": " ".join(reversed(WORDS * 8))}
        layout = [("a", "first"), ("a", "second"), ("b", "third")][:count]
        return [
            Sample(self.name, i, contexts[cid], f"Which is the {q} word?", "It is", (WORDS[i],), 6, cid)
            for i, (cid, q) in enumerate(layout)
        ]

    def score(self, prediction, sample):
        return float(sample.answers[0] in prediction)


@pytest.fixture
def model(tokenizer):
    return tiny_model(vocab=len(tokenizer))


@pytest.fixture(autouse=True)
def fixture_task(monkeypatch):
    monkeypatch.setattr(tasks_module, "all_tasks", lambda: {"shared_fixture": SharedContextTask()})


def config(**overrides) -> BenchConfig:
    values = {
        "tasks": ("shared_fixture",),
        "policies": ("full", "h2o", "snapkv"),
        "budgets": (40, 64),
        "samples": 3,
        "length": 256,
    }
    return BenchConfig(**{**values, **overrides})


def test_one_line_per_sample_and_setting_with_the_configuration(tmp_path, model, tokenizer) -> None:
    store = BenchRunner(config(), tmp_path, model, tokenizer).run(progress=False)
    records = list(store)
    assert len(records) == 3 * (1 + 2 * 2)
    # per context group, every setting in turn (full first); the two questions on context "a" go together
    assert [(r["context_id"], r["policy"], r["budget"]) for r in records[:4]] == [
        ("a", "full", None),
        ("a", "full", None),
        ("a", "h2o", 40),
        ("a", "h2o", 40),
    ]
    first = records[0]
    for field in (
        "task",
        "index",
        "length",
        "seed",
        "model",
        "policy_params",
        "budget",
        "interval",
        "query_aware",
        "score",
        "prediction",
        "kv_bytes_prefill",
        "kv_bytes_final",
        "prefill_s",
        "decode_s",
        "metric",
        "answers",
    ):
        assert field in first
    by = {(r["index"], r["policy"], r["budget"]): r for r in records}
    assert (
        by[(0, "h2o", 40)]["kv_bytes_final"]
        < by[(0, "h2o", 64)]["kv_bytes_final"]
        < by[(0, "full", None)]["kv_bytes_final"]
    )
    assert by[(0, "h2o", 40)]["retained_tokens"] == 40
    assert by[(0, "h2o", 40)]["policy_params"] == {"sinks": 4, "window": None, "regime": "both", "group": "mean"}


def test_prompts_sharing_a_context_are_prefilled_once(tmp_path, model, tokenizer, monkeypatch) -> None:
    calls = []
    original = runner_module.prefill
    monkeypatch.setattr(
        runner_module, "prefill", lambda m, ids, *rest: calls.append(ids.shape[-1]) or original(m, ids, *rest)
    )
    store = BenchRunner(config(), tmp_path, model, tokenizer).run(progress=False)
    assert len(calls) == 2 * 5  # two contexts × five settings, not three samples × five
    assert {r["shared_prefill"] for r in store if r["context_id"] == "a"} == {2}


def test_resume_after_a_crash_redoes_nothing_finished(tmp_path, model, tokenizer, monkeypatch) -> None:
    appended = []
    original_append = ResultStore.append

    def crash_on_the_seventh(self, record):
        if len(appended) == 6:
            raise KeyboardInterrupt
        appended.append(record)
        original_append(self, record)

    monkeypatch.setattr(ResultStore, "append", crash_on_the_seventh)
    with pytest.raises(KeyboardInterrupt):
        BenchRunner(config(), tmp_path, model, tokenizer).run(progress=False)
    monkeypatch.setattr(ResultStore, "append", original_append)
    assert len(ResultStore(tmp_path)) == 6

    generated = []
    original = runner_module.continue_greedy
    monkeypatch.setattr(runner_module, "continue_greedy", lambda *a: generated.append(1) or original(*a))
    store = BenchRunner(config(), tmp_path, model, tokenizer).run(progress=False)
    assert len(generated) == 15 - 6 and len(store) == 15
    assert len({(r["index"], r["policy"], r["budget"]) for r in store}) == 15


def test_fidelity_replays_the_full_answer_even_after_a_resume(tmp_path, model, tokenizer) -> None:
    BenchRunner(config(policies=("full",)), tmp_path, model, tokenizer).run(progress=False)
    store = BenchRunner(config(budgets=(40, 1000), fidelity=True), tmp_path, model, tokenizer).run(progress=False)
    by = {(r["index"], r["policy"], r["budget"]): r for r in store}
    assert by[(0, "full", None)]["fidelity"] is None
    loose, tight = by[(0, "h2o", 1000)]["fidelity"], by[(0, "h2o", 40)]["fidelity"]
    assert loose["top1"] == 1.0 and loose["kl"] < 1e-6 and loose["tokens"] == by[(0, "full", None)]["new_tokens"]
    assert tight["kl"] > loose["kl"]


def test_the_full_reference_is_shared_by_every_eviction_interval(tmp_path, model, tokenizer) -> None:
    BenchRunner(config(policies=("h2o",), budgets=(40,), fidelity=True), tmp_path, model, tokenizer).run(progress=False)
    store = BenchRunner(
        config(policies=("h2o",), budgets=(40,), fidelity=True, interval=4), tmp_path, model, tokenizer
    ).run(progress=False)
    settings = [(r["policy"], r["interval"]) for r in store if r["index"] == 0]
    assert len(settings) == 3 and set(settings) == {("full", None), ("h2o", None), ("h2o", 4)}


def test_query_aware_compresses_the_question_too(tmp_path, model, tokenizer) -> None:
    store = BenchRunner(config(policies=("snapkv",), budgets=(40,), query_aware=True), tmp_path, model, tokenizer).run(
        progress=False
    )
    for record in store:
        assert record["query_aware"] and record["shared_prefill"] == 1
        # resident: 40 entries and a column of room per KV head, each key, value and int64 position
        assert record["kv_bytes_prefill"] == 2 * 2 * 41 * (2 * 16 * 4 + 8)
        assert record["kv_bytes_prefill_by_layer"] == [[2 * 41 * (2 * 16 * 4 + 8), 2 * 2 * 16 * 4 * 40]] * 2


def test_prefill_chunk_bounds_the_cache_and_is_recorded(tmp_path, model, tokenizer) -> None:
    chunked = config(policies=("full", "snapkv"), budgets=(40,), prefill_chunk=32)
    records = list(BenchRunner(chunked, tmp_path, model, tokenizer).run(progress=False))
    assert {r["prefill_chunk"] for r in records} == {32}
    for record in records:
        if record["policy"] == "snapkv":
            assert record["peak_tokens"] <= 40 + 32 < record["context_tokens"]
        else:
            assert record["peak_tokens"] == record["prompt_tokens"] + record["new_tokens"] - 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tasks": ("nope",)}, "unknown task 'nope'; known tasks: shared_fixture"),
        ({"budgets": (), "keeps": ()}, "policies h2o, snapkv need --budgets or --keep"),
        ({"keeps": (0.5,)}, "either budgets .* or keep fractions"),
        ({"budgets": (16,)}, "budget 16 is smaller than snapkv's"),
        ({"policies": ("h2oo",)}, "unknown policy 'h2oo'"),
        ({"samples": 0}, "samples and length must be positive"),
        ({"prefill_chunk": 0}, "prefill chunk must be a positive number"),
        ({"policies": ("kvzip",), "prefill_chunk": 32}, "cannot compress a prompt chunk by chunk"),
    ],
)
def test_bad_configurations_are_refused_before_any_work(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        config(**overrides)


def test_fidelity_scored_long_generation_replays_and_reports_peak_memory(tmp_path, tokenizer, monkeypatch) -> None:
    from kvevict.bench.longgen import LongGeneration

    monkeypatch.setattr(tasks_module, "all_tasks", lambda: {"longgen": LongGeneration()})
    model = tiny_model(vocab=len(tokenizer))
    run = BenchConfig(
        tasks=("longgen",),
        policies=("h2o", "lazyeviction", "lazyeviction[window=8]"),
        budgets=(64,),
        samples=1,
        max_new_tokens=120,
    )
    # full is the reference
    assert [setting.policy for setting in run.settings] == ["full", "h2o", "lazyeviction", "lazyeviction[window=8]"]
    records = {r["policy"]: r for r in BenchRunner(run, tmp_path, model, tokenizer).run(progress=False)}
    assert records["full"]["score"] == 1.0 and records["full"]["new_tokens"] == 120
    ids = records["full"]["prediction_ids"]
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    assert len(grams) == len(set(grams))  # no repeated 4-gram: the reference does not loop
    assert records["lazyeviction[window=8]"]["policy_params"]["window"] == 8
    for policy, interval in (("h2o", 1), ("lazyeviction", 16), ("lazyeviction[window=8]", 8)):
        record = records[policy]
        assert record["prediction"] is None and record["score"] == record["fidelity"]["top1"]
        # the prompt's last chunk is appended in one pass before its eviction; then budget + interval
        peak = max(64 + interval, record["prompt_tokens"])
        assert record["fidelity"]["tokens"] == 120 and record["decode_peak_tokens"] == peak
        assert record["retained_tokens"] <= peak


@pytest.mark.parametrize("query_aware", [False, True])
def test_batches_give_the_results_of_one_by_one(tmp_path, model, tokenizer, query_aware: bool) -> None:
    settings = {"policies": ("full", "h2o", "snapkv"), "budgets": (40,), "query_aware": query_aware}
    alone = {
        (r["index"], r["policy"]): r
        for r in BenchRunner(config(**settings), tmp_path / "one", model, tokenizer).run(progress=False)
    }
    store = BenchRunner(config(**settings, batch_size=2), tmp_path / "two", model, tokenizer).run(progress=False)
    records = list(store)
    assert len(records) == len(alone) == 3 * 3
    assert {r["batch_size"] for r in records} == {2, 1}  # three samples: a batch of two, then one
    timing = ("prefill_s", "decode_s", "finished_at", "shared_prefill", "batch_size")
    for record in records:
        expected = alone[(record["index"], record["policy"])]
        assert {k: v for k, v in record.items() if k not in timing} == {
            k: v for k, v in expected.items() if k not in timing
        }


def test_a_batched_run_resumes_without_redoing_a_finished_sample(tmp_path, model, tokenizer, monkeypatch) -> None:
    BenchRunner(config(policies=("full",)), tmp_path, model, tokenizer).run(progress=False)
    rows = []
    original = runner_module.compress
    monkeypatch.setattr(runner_module, "compress", lambda *a, **k: rows.append(len(a[2])) or original(*a, **k))
    store = BenchRunner(config(batch_size=3), tmp_path, model, tokenizer).run(progress=False)
    assert len(store) == 15 and sum(rows) == 15 - 3  # full was done: only the four eviction settings ran
    assert rows == [3, 3, 3, 3]


def test_batch_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="batch size must be an integer >= 1, got 0"):
        config(batch_size=0)


def test_each_quant_option_runs_every_setting_and_the_full_precision_full_cache_stays_the_reference() -> None:
    settings = config(policies=("full", "snapkv"), budgets=(40,), quants=(None, "int4")).settings
    assert settings == [
        Setting("full"),
        Setting("full", quant="int4"),
        Setting("snapkv", budget=40),
        Setting("snapkv", budget=40, quant="int4"),
    ]
    assert [setting.reference for setting in settings] == [True, False, False, False]
    assert config(policies=("snapkv",), budgets=(40,), quants=("int2",)).settings == [
        Setting("snapkv", budget=40, quant="int2")
    ]


def test_a_policy_that_never_evicts_runs_once_without_a_budget() -> None:
    settings = config(policies=("full", "think", "snapkv"), budgets=(40, 64)).settings
    assert settings[:2] == [Setting("full"), Setting("think")]  # ThinK over the full cache: channels, not tokens
    assert config(policies=("think",), budgets=(), keeps=()).settings == [Setting("think")]


def test_the_quant_group_and_residual_reach_the_quantized_caches_and_their_records(
    tmp_path, model, tokenizer, monkeypatch
) -> None:
    caches = []
    original = runner_module.UnitRunner._cache
    monkeypatch.setattr(
        runner_module.UnitRunner, "_cache", lambda self, setting: caches.append(original(self, setting)) or caches[-1]
    )
    settings = config(
        policies=("full", "snapkv"), budgets=(40,), samples=1, quants=(None, "int4"), quant_group=8, residual=16
    )
    records = list(BenchRunner(settings, tmp_path, model, tokenizer).run(progress=False))
    assert {(c.quant.group, c.quant.residual) for c in caches if c.quant is not None} == {(8, 16)}
    by_quant = {r["quant"]: (r["quant_group"], r["residual"]) for r in records}
    assert by_quant == {None: (None, None), "int4": (8, 16)}  # part of each result's key: a rerun with others redoes it


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"quants": ("int4",), "residual": -1}, "residual must be an integer >= 0"),
        ({"quants": ("int4",), "quant_group": 0}, "quant group must be an integer >= 1"),
        ({"residual": 16}, "needs quantized settings"),
        ({"policies": ("think+snapkv",), "quants": (None, "int4")}, "think\\+snapkv rewrites the kept keys"),
    ],
)
def test_bad_quant_options_are_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config(**overrides)
