"""``kvevict tasks`` (kvevict.commands.tasks): the task list, and the samples exported for another library."""

import json

from kvevict.bench.runner import PromptIds
from kvevict.bench.tasks import get_task
from kvevict.cli import main


def test_tasks_are_listed_with_their_source_and_metric(capsys) -> None:
    assert main(["tasks"]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == ["niah_single_1", "offline", "string_match_all"]


def test_exported_samples_are_the_prompts_bench_runs(tmp_path, smollm2) -> None:
    _, tokenizer = smollm2
    out = tmp_path / "samples.jsonl"
    assert main(["tasks", "niah_single_1,vt", "--length", "256", "--samples", "2", "--export", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["task"], r["index"]) for r in records] == [
        ("niah_single_1", 0),
        ("niah_single_1", 1),
        ("vt", 0),
        ("vt", 1),
    ]
    sample = get_task("vt").samples(tokenizer, length=256, count=2)[1]
    prompt = PromptIds.of(tokenizer, sample)
    assert records[3]["context_ids"] == prompt.head[0].tolist()
    assert records[3]["context_ids"] + records[3]["rest_ids"] == prompt.ids[0].tolist()
    assert records[3]["answers"] == list(sample.answers) and records[3]["metric"] == "string_match_all"
    aware = tmp_path / "aware.jsonl"
    assert main(["tasks", "vt", "--length", "256", "--samples", "2", "--export", str(aware), "--query-aware"]) == 0
    record = [json.loads(line) for line in aware.read_text().splitlines()][1]
    assert record["query_aware"] and record["rest_ids"] == prompt.ids[0, -1:].tolist()  # all but the last compressed


def test_an_export_without_tasks_is_refused(refused, tmp_path) -> None:
    assert "--export needs the tasks to export" in refused(["tasks", "--export", str(tmp_path / "x.jsonl")])
