"""Math tasks: answer extraction, GSM8K references, math-verify equivalence, fixture loading (offline)."""

from pathlib import Path

import datasets
import pytest

from kvevict.bench import maths
from kvevict.bench.maths import INSTRUCTION, equivalent, gsm8k_reference, last_boxed, last_number
from kvevict.bench.task import Sample

FIXTURES = Path(__file__).parent / "fixtures" / "math"


@pytest.fixture
def fixture_dir(monkeypatch) -> Path:
    monkeypatch.setenv(maths.DATA_DIR_ENV, str(FIXTURES))
    return FIXTURES


def sample_for(name: str, answer: str) -> Sample:
    return Sample(name, 0, "problem", "", "", (answer,), 4096, f"{name}/0")


def test_the_three_tasks_are_registered() -> None:
    assert set(maths.TASKS) == {"math500", "gsm8k", "aime2024"}
    assert all(task.source == "hub" and task.metric == "math_verify" for task in maths.TASKS.values())


def test_last_boxed_with_nested_braces() -> None:
    assert last_boxed(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"first \boxed{3}, then \boxed{\sqrt{x^{2}}} finally") == r"\sqrt{x^{2}}"
    assert last_boxed(r"\fbox{42}") == "42" and last_boxed(r"\boxed {7}") == "7"
    assert last_boxed("the answer is 5") is None
    assert last_boxed(r"\boxed{3} and then \boxed{\frac{1}{2}") is None  # the last one never closes


def test_gsm8k_reference_and_last_number() -> None:
    assert gsm8k_reference("9 * 2 = <<9*2=18>>18 dollars.\n#### 18") == "18"
    assert gsm8k_reference("It makes <<40*40=1600>>1,600.\n#### 1,600") == "1600"
    assert last_number("She has 1,250 apples, then -3.5 of them") == "-3.5"
    assert last_number("She earns 1,250 dollars.") == "1250" and last_number("none") is None


def test_math_verify_equivalences() -> None:
    assert equivalent(r"\frac{1}{2}", "0.5") and equivalent("0.5", r"\dfrac{1}{2}")
    assert equivalent(r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})")
    assert equivalent("10", r"\sqrt{100}") and equivalent(r"\text{(C)}", "C")
    assert not equivalent(r"\frac{1}{2}", r"\frac{1}{3}") and not equivalent("2", "3")


def test_unparseable_answers_fall_back_to_strings_and_never_raise(monkeypatch) -> None:
    assert not equivalent(r"\frac{1}{2}", r"}{\frac{{") and not equivalent("5", "")

    def broken(*args, **kwargs):
        raise RuntimeError("parser failure")

    monkeypatch.setattr(maths, "parse", broken)
    assert equivalent(r"\dfrac{1}{2}", r"$\frac{1}{2}$ .") and not equivalent("1", "2")


def test_scores() -> None:
    math500, gsm8k = maths.TASKS["math500"], maths.TASKS["gsm8k"]
    assert math500.score(r"Thus the answer is $\boxed{\dfrac{1}{2}}$.", sample_for("math500", r"\frac{1}{2}")) == 1.0
    assert math500.score("The answer is 1/2.", sample_for("math500", r"\frac{1}{2}")) == 0.0  # nothing boxed
    assert math500.score(r"\boxed{2} no, \boxed{3}", sample_for("math500", "2")) == 0.0  # the last box counts
    assert gsm8k.score("She makes 9 * 2 = 18 dollars", sample_for("gsm8k", "18")) == 1.0  # last number
    assert gsm8k.score(r"So \boxed{1,600}. Check: 40 * 40", sample_for("gsm8k", "1600")) == 1.0
    assert gsm8k.score("", sample_for("gsm8k", "18")) == 0.0


def test_fixtures_load_through_datasets(fixture_dir, tokenizer) -> None:
    expected = {"math500": r"\frac{1}{2}", "gsm8k": "1600", "aime2024": "1001"}
    for name, task in maths.TASKS.items():
        samples = task.samples(tokenizer, length=1, count=5)  # length is ignored
        assert [sample.index for sample in samples] == [0, 1] and samples[1].answers == (expected[name],)
        assert samples[1].context.endswith(INSTRUCTION) and samples[1].question == samples[1].answer_prefix == ""
        assert samples[0].max_new_tokens == 4096 and samples[0].context_id != samples[1].context_id
    math500 = maths.TASKS["math500"].samples(tokenizer, length=0, count=5)[1]
    prompt = (
        "What is the value of $\\frac{3}{6}$?\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    assert math500.context == prompt


def test_hub_datasets_are_requested(monkeypatch) -> None:
    calls = []

    def load_dataset(repo, config, split):
        calls.append((repo, config, split))
        return datasets.Dataset.from_list([{"problem": "1+1?", "question": "1+1?", "answer": "#### 2"}])

    monkeypatch.delenv(maths.DATA_DIR_ENV, raising=False)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    for task in maths.TASKS.values():
        task.rows()
    assert calls == [
        ("HuggingFaceH4/MATH-500", None, "test"),
        ("openai/gsm8k", "main", "test"),
        ("HuggingFaceH4/aime_2024", None, "train"),
    ]
