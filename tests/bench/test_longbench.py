"""LongBench: official tables and metrics, fixture loading, templates and middle truncation (offline)."""

import json
import zipfile
from pathlib import Path

import pytest

from kvevict.bench import longbench
from kvevict.bench.longbench import (
    LongBenchTask,
    classification_score,
    code_sim_score,
    count_score,
    normalize_answer,
    pick,
    qa_f1_score,
    retrieval_score,
    rouge_score,
)
from kvevict.bench.task import Sample
from kvevict.generation import split_prompt

FIXTURES = Path(__file__).parent / "fixtures"
ENGLISH = [
    "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report", "qmsum",
    "multi_news", "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
]  # fmt: skip
# The runner joins context and question with "\n\n"; where the official separator differs.
SEPARATORS = {"trec": ("{context}\n{input}", "{context}\n\n{input}"), "lcc": ("{context}Next", "{context}\n\nNext")}
SEPARATORS["repobench-p"] = ("{context}{input}", "{context}\n\n{input}")


@pytest.fixture
def fixture_dir(monkeypatch) -> Path:
    folder = FIXTURES / "longbench"
    monkeypatch.setenv(longbench.DATA_DIR_ENV, str(folder))
    return folder


def sample_for(task: LongBenchTask, answers: tuple[str, ...], all_classes=None) -> Sample:
    return Sample(task.name, 0, "", "", "", answers, 32, "x", {"all_classes": all_classes})


def test_all_sixteen_english_tasks_are_registered() -> None:
    assert set(longbench.TASKS) == {f"longbench_{name}" for name in ENGLISH}
    assert all(task.source == "hub" for task in longbench.TASKS.values())
    assert longbench.TASKS["longbench_repobench-p"].metric == "code_sim_score"


def test_tables_equal_the_official_configs() -> None:
    prompts = json.loads((FIXTURES / "longbench_official" / "dataset2prompt.json").read_text())
    lengths = json.loads((FIXTURES / "longbench_official" / "dataset2maxlen.json").read_text())
    assert longbench.PROMPTS == {name: prompts[name] for name in ENGLISH}
    assert longbench.MAX_NEW_TOKENS == {name: lengths[name] for name in ENGLISH}


def test_qa_f1_normalises_case_punctuation_and_articles() -> None:
    assert normalize_answer("The  Eiffel-Tower, an icon!") == "eiffeltower icon"
    assert qa_f1_score("The Eiffel Tower!", "eiffel tower") == 1.0
    assert qa_f1_score("the big red dog", "A red dog") == pytest.approx(0.8)  # p = 2/3, r = 1
    assert qa_f1_score("Paris", "London") == 0.0
    assert qa_f1_score("the", "a") == 0.0  # nothing left after normalisation


def test_rouge_l_f_and_failures_score_zero() -> None:
    assert rouge_score("the cat sat", "the cat sat on the mat") == pytest.approx(0.75, abs=1e-6)
    assert rouge_score("", "the cat") == 0.0
    assert rouge_score("...", "the cat") == 0.0


def test_classification_with_class_names_inside_others() -> None:
    classes = ["Animal", "Animal product", "Color"]
    assert classification_score("Animal product", "Animal product", classes) == 1.0  # "Animal" is dropped
    assert classification_score("Animal product", "Animal", classes) == 0.5  # both names stand
    assert classification_score("Color", "Animal", classes) == 0.0
    # The official loop removes while iterating: "city" follows a removed match and stays.
    assert classification_score("Big city", "Big city", ["Big", "city", "Big city"]) == 0.5


def test_count_and_retrieval_scores_share_among_all_numbers() -> None:
    assert count_score("There are 3 unique paragraphs out of 5", "3") == 0.5
    assert count_score("3", "3") == 1.0
    assert count_score("three", "3") == 0.0
    assert retrieval_score("Paragraph 7", "Paragraph 7") == 1.0
    assert retrieval_score("Paragraph 7 or Paragraph 12", "Paragraph 12") == 0.5
    assert retrieval_score("I do not know", "Paragraph 7") == 0.0


def test_code_sim_reads_the_first_line_without_comments() -> None:
    prediction = "\n```python\n# add them\n    return a + b\nprint(1)"
    assert code_sim_score(prediction, "    return a + b") == 1.0
    assert code_sim_score("x = 1  // c\nabc", "abd") == 0.67  # fuzzywuzzy's integer ratio: 66.7 -> 67
    assert code_sim_score("# only a comment", "x = 1") == 0.0


def test_score_first_line_rule_and_best_reference() -> None:
    trivia = longbench.TASKS["longbench_triviaqa"]
    assert trivia.score("\nParis\nThe answer is London", sample_for(trivia, ("London", "Paris"))) == 1.0
    assert trivia.score("The answer is London\nParis", sample_for(trivia, ("Paris",))) == 0.0
    hotpot = longbench.TASKS["longbench_hotpotqa"]  # no first-line rule: the whole text counts
    assert hotpot.score("London\nParis", sample_for(hotpot, ("Paris",))) == pytest.approx(2 / 3)
    trec = longbench.TASKS["longbench_trec"]
    sample = sample_for(trec, ("Individual",), ["Individual", "City"])
    assert trec.score("Individual\nCity", sample) == 1.0


def test_fixture_rows_load_through_datasets(fixture_dir) -> None:
    for name in ENGLISH:
        rows = LongBenchTask(name).rows()
        assert len(rows) == 2 and rows[0]["dataset"] == name
        assert {"input", "context", "answers", "length", "language", "all_classes", "_id"} <= set(rows.column_names)
    assert LongBenchTask("hotpotqa", data_dir=fixture_dir).rows()[1]["answers"] == ["Claude Monet"]


@pytest.mark.parametrize("name", ENGLISH)
def test_prompt_is_the_official_template(fixture_dir, tokenizer, name: str) -> None:
    task = longbench.TASKS[f"longbench_{name}"]
    sample = task.samples(tokenizer, length=100_000, count=1)[0]
    row = LongBenchTask(name).rows()[sample.index]
    template = longbench.PROMPTS[name]
    if name in SEPARATORS:
        template = template.replace(*SEPARATORS[name])
    assert f"{sample.context}\n\n{sample.question}" == template.format(context=row["context"], input=row["input"])
    assert sample.context.endswith(row["context"]) and sample.answer_prefix == ""
    assert sample.answers == tuple(row["answers"]) and sample.max_new_tokens == longbench.MAX_NEW_TOKENS[name]
    assert sample.metadata["chat_template"] is (name not in {"trec", "triviaqa", "samsum", "lcc", "repobench-p"})


@pytest.mark.parametrize(("name", "length"), [("hotpotqa", 300), ("lcc", 301), ("passage_retrieval_en", 256)])
def test_middle_truncation_fits_length_and_keeps_both_ends(tmp_path, monkeypatch, tokenizer, name, length) -> None:
    words = " ".join(f"w{i}" for i in range(3000))
    row = {"input": "Which word comes last?", "context": f"START {words} END", "answers": ["END"], "length": 3002}
    row |= {"dataset": name, "language": "en", "all_classes": None, "_id": "long"}
    (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setenv(longbench.DATA_DIR_ENV, str(tmp_path))
    sample = longbench.TASKS[f"longbench_{name}"].samples(tokenizer, length=length, count=1)[0]
    head, tail = split_prompt(
        tokenizer, sample.context, sample.question, chat_template=sample.metadata["chat_template"]
    )
    assert length - 12 <= head.shape[-1] + tail.shape[-1] <= length
    template_head, template_rest = longbench.PROMPTS[name].split("{context}")
    assert sample.context.startswith(template_head + "START w0 w1") and sample.context.endswith("w2999 END")
    assert "w1500 " not in sample.context
    assert sample.question == template_rest.lstrip("\n").format(input=row["input"])


def test_truncation_without_chat_template_equals_pred_py(tmp_path, monkeypatch, tokenizer) -> None:
    words = " ".join(f"w{i}" for i in range(3000))
    row = {"input": "Passage: x\nQuestion: Which word comes last?\nAnswer:", "context": words, "answers": ["w2999"]}
    row |= {"length": 3000, "dataset": "triviaqa", "language": "en", "all_classes": None, "_id": "long"}
    (tmp_path / "triviaqa.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setenv(longbench.DATA_DIR_ENV, str(tmp_path))
    sample = longbench.TASKS["longbench_triviaqa"].samples(tokenizer, length=257, count=1)[0]
    ids = tokenizer(longbench.PROMPTS["triviaqa"].format(**row)).input_ids  # pred.py: the first and last 128 tokens
    official = tokenizer.decode(ids[:128], skip_special_tokens=True) + tokenizer.decode(
        ids[-128:], skip_special_tokens=True
    )
    assert f"{sample.context}\n\n{sample.question}" == official


def test_prompt_template_too_long_for_length_raises(fixture_dir, tokenizer) -> None:
    with pytest.raises(ValueError, match="exceeds 20 tokens"):
        longbench.TASKS["longbench_qasper"].samples(tokenizer, length=20, count=1)


def test_pick_is_seeded_and_in_dataset_order() -> None:
    assert pick(5, 10, seed=0) == [0, 1, 2, 3, 4]
    chosen = pick(100, 5, seed=3)
    assert chosen == sorted(chosen) and len(set(chosen)) == 5 and chosen == pick(100, 5, seed=3)
    assert chosen != pick(100, 5, seed=4)


def test_hub_download_is_extracted_and_read(tmp_path, monkeypatch) -> None:
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    archive = snapshot / "data.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.write(FIXTURES / "longbench" / "musique.jsonl", "data/musique.jsonl")
    calls = []

    def download(**kwargs) -> str:
        calls.append(kwargs)
        return str(archive)

    monkeypatch.delenv(longbench.DATA_DIR_ENV, raising=False)
    monkeypatch.setattr(longbench, "hf_hub_download", download)
    task = LongBenchTask("musique")
    assert task.rows()[0]["answers"] == ["London"] and task.rows()[1]["answers"] == ["Hawaii"]  # extracted once
    assert calls[0] == {"repo_id": "THUDM/LongBench", "filename": "data.zip", "repo_type": "dataset"}
    assert sorted(path.name for path in snapshot.iterdir()) == ["data", "data.zip"]
