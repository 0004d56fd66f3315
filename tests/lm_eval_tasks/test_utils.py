"""The offline lm-eval tasks' documents (kvevict/lm_eval_tasks/utils.py): each task's JSON lines,
read beside its YAML without the network, as its test split (the tasks run: tests/test_lm_eval.py)."""

from __future__ import annotations

import json
import re

from kvevict.lm_eval import TASKS
from kvevict.lm_eval_tasks.utils import documents


def test_the_json_lines_of_a_file_are_the_test_split_in_order() -> None:
    lines = (TASKS / "niah_short.jsonl").read_text().splitlines()
    split = documents("niah_short.jsonl", metadata={"version": 1.0})  # the task's metadata is passed and unused
    assert list(split) == ["test"] and split["test"].num_rows == len(lines) == 8
    assert split["test"].to_list() == [json.loads(line) for line in lines]


def test_every_task_reads_its_documents_from_a_file_beside_it() -> None:
    yamls = sorted(TASKS.glob("*.yaml"))
    assert len(yamls) == 4
    for yaml in yamls:
        text = yaml.read_text()
        assert "custom_dataset: !function utils.documents" in text, yaml.name
        file = re.search(r"^  file: (\S+)$", text, re.MULTILINE).group(1)
        assert documents(file)["test"].num_rows > 0, yaml.name
