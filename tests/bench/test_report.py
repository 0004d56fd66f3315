from pathlib import Path

from kvevict.bench.report import ReportRow, format_report, plot_report, sample_scores, summarize
from kvevict.bench.store import ResultStore

RUN = Path(__file__).parent / "data" / "report_run"


def rows_by_key():
    return {(row.task, row.policy, row.budget_label): row for row in summarize(ResultStore(RUN))}


def test_means_share_of_full_and_fidelity_on_the_fixture_run() -> None:
    rows = rows_by_key()
    assert rows[("vt", "full", "all")].score == 100.0
    assert rows[("niah_single_1", "full", "all")].score == 75.0
    vt = rows[("vt", "h2o", "64")]
    assert (vt.samples, vt.score, vt.percent_of_full, vt.kv_mib) == (2, 50.0, 50.0, 4.0)
    assert vt.fidelity == {"top1": 0.75, "kl": 0.1, "ppl": 2.0}
    niah = rows[("niah_single_1", "h2o", "64")]
    assert niah.score == 37.5 and niah.percent_of_full == 50.0
    assert rows[("niah_single_1", "snapkv", "64")].percent_of_full == 100.0


def test_average_rows_cover_settings_every_task_has() -> None:
    rows = rows_by_key()
    average = rows[("average", "h2o", "64")]
    assert average.score == (50.0 + 37.5) / 2 and average.samples == 4
    assert average.percent_of_full == 100 * 43.75 / 87.5
    assert ("average", "h2o", "128") not in rows and ("average", "snapkv", "64") not in rows


def test_table_lists_task_policy_budget_and_share() -> None:
    lines = format_report(summarize(ResultStore(RUN))).splitlines()
    assert lines[0].split() == [
        "task",
        "policy",
        "budget",
        "n",
        "score",
        "%",
        "full",
        "KV",
        "MiB",
        "top-1",
        "KL",
        "ppl",
    ]
    assert "niah_single_1  full    all     2  75.0   100%" in lines[2]
    assert any(line.split()[:6] == ["vt", "h2o", "64", "2", "50.0", "50%"] for line in lines)


def test_plot_writes_a_png(tmp_path) -> None:
    path = plot_report(summarize(ResultStore(RUN)), tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_real_bytes_appear_only_where_heads_were_padded(tmp_path) -> None:
    store = ResultStore(tmp_path)
    base = {"task": "vt", "index": 0, "budget": 64, "keep": None, "score": 1.0, "kv_bytes_final": 4 * 2**20}
    store.append({**base, "policy": "snapkv", "kv_bytes_real_final": 4 * 2**20})
    store.append({**base, "policy": "adakv+snapkv", "kv_bytes_final": 5 * 2**20, "kv_bytes_real_final": 4 * 2**20})
    rows = {row.policy: row for row in summarize(store) if row.task == "vt"}
    assert (rows["adakv+snapkv"].kv_mib, rows["adakv+snapkv"].real_mib) == (5.0, 4.0)
    lines = format_report(summarize(store)).splitlines()
    assert "real MiB" in lines[0]
    assert any(line.split()[:2] == ["vt", "adakv+snapkv"] and line.split()[-1] == "4.00" for line in lines)


def test_an_interval_or_query_awareness_is_a_separate_row_where_runs_mix(tmp_path) -> None:
    store = ResultStore(tmp_path)
    base = {"task": "longgen", "policy": "tova", "budget": 64, "keep": None, "kv_bytes_final": 2**20}
    for seed in (0, 1):  # seeds pool
        store.append({**base, "index": 0, "seed": seed, "score": 0.5 + seed / 4})
    store.append({**base, "index": 0, "seed": 0, "interval": 32, "score": 1.0})
    store.append({**base, "index": 0, "seed": 0, "query_aware": True, "score": 0.0})
    store.append({**base, "index": 0, "seed": 0, "query_aware": True, "policy": "full", "budget": None, "score": 1.0})
    rows = {row.policy: (row.samples, row.score) for row in summarize(store)}
    assert rows == {
        "full": (1, 100.0),  # the reference whatever the run's settings
        "tova": (2, 62.5),
        "tova (interval 32)": (1, 100.0),
        "tova (query-aware)": (1, 0.0),
    }
    uniform = [record for record in store if record.get("query_aware")]  # a run that is all query-aware
    assert {row.policy for row in summarize(uniform)} == {"full", "tova"}


def test_a_keep_is_labelled_as_given_not_rounded_to_a_whole_percent() -> None:
    labels = [ReportRow("t", "p", None, keep, 1, 0.0, 0.0, {}).budget_label for keep in (0.125, 0.1, 0.15, None)]
    assert labels == ["12.5%", "10%", "15%", "all"]


def test_sample_scores_key_settings_by_label_and_keep_and_skip_unscored_rows() -> None:
    def row(policy: str, keep: float | None, index: int, score: float | None, **settings) -> dict:
        return {"policy": policy, "keep": keep, "task": "t", "index": index, "score": score, **settings}

    rows = [
        row("full", None, 0, 1.0),
        row("full", None, 1, None),  # a failed sample: no score to pool
        row("fastkvzip", 0.1, 0, 0.5),
        row("fastkvzip", 0.1, 0, 0.25, quant="int4"),
        row("fastkvzip", 0.1, 0, 0.0, query_aware=True),
    ]
    assert sample_scores(rows) == {
        ("full", None): {("t", 0): 1.0},
        ("fastkvzip", 0.1): {("t", 0): 0.0},  # query-awareness not shown: the later row of the same setting wins
        ("fastkvzip (int4)", 0.1): {("t", 0): 0.25},
    }
    assert sample_scores(rows, ("query_aware",))["fastkvzip (query-aware)", 0.1] == {("t", 0): 0.0}
    assert sample_scores(rows, ("query_aware",))["fastkvzip", 0.1] == {("t", 0): 0.5}
