import math
import re
from collections import Counter

import numpy as np
import pytest

from kvevict.bench import ruler
from kvevict.bench.ruler import TASKS, fit_size, postprocess, string_match_all, string_match_part
from kvevict.bench.task import Sample
from kvevict.bench.tasks import all_tasks

LENGTHS = (1024, 4096)
NAMES = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)


@pytest.fixture(scope="module")
def generated(tokenizer) -> dict[tuple[str, int], list[Sample]]:
    """Two samples of every task at every tested length, generated once."""
    return {
        (name, length): TASKS[name].samples(tokenizer, length=length, count=2) for name in NAMES for length in LENGTHS
    }


def prompt_tokens(tokenizer, sample: Sample) -> int:
    text = f"{sample.context}\n\n{sample.question} {sample.answer_prefix}"
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_the_eleven_synthetic_tasks_are_registered() -> None:
    assert tuple(TASKS) == NAMES
    assert all(all_tasks()[name] is TASKS[name] for name in NAMES)
    assert {task.metric for task in TASKS.values()} == {"string_match_all"}  # as in RULER
    assert {task.source for task in TASKS.values()} == {"offline"}


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("name", NAMES)
def test_prompt_fits_the_length_and_holds_its_answers(tokenizer, generated, name: str, length: int) -> None:
    samples = generated[name, length]
    for index, sample in enumerate(samples):
        tokens = prompt_tokens(tokenizer, sample)
        assert abs(tokens - length) <= 0.05 * length
        assert sample.metadata["tokens"] == tokens
        assert sample.answers and all(answer in sample.context for answer in sample.answers)
        assert sample.task == name and sample.index == index
        assert sample.question == sample.question.strip() and sample.answer_prefix == sample.answer_prefix.lstrip()
        expected_tokens = {"vt": 30, "cwe": 120, "fwe": 50}.get(name, 128)
        assert sample.max_new_tokens == expected_tokens
    assert len({sample.context_id for sample in samples}) == len(samples)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("name", [name for name in NAMES if name.startswith("niah")])
def test_niah_needles_hold_the_queried_values(generated, name: str, length: int) -> None:
    for sample in generated[name, length]:
        keys = sample.metadata["keys"]
        assert all(key in sample.question and key in sample.answer_prefix for key in keys)
        values = re.findall(r"One of the special magic \w+ for (.+?) is: (\S+)\.", sample.context)
        queried = [value for key, value in values if key in keys]
        assert sorted(queried) == sorted(sample.answers)
        kinds = {"niah_single_3": "uuids", "niah_multikey_3": "uuids"}
        assert f"special magic {kinds.get(name, 'numbers')} for" in sample.context


@pytest.mark.parametrize("length", LENGTHS)
def test_vt_answers_are_the_chain_to_the_queried_value(generated, length: int) -> None:
    for sample in generated["vt", length]:
        task = sample.context.rsplit("hidden in the following text.\n\n", 1)[1]
        value = re.search(r"the value (\d+) in", sample.question).group(1)
        edges = dict(re.findall(r"^VAR (\w+) = (?:VAR )?(\w+) ?$", task, flags=re.MULTILINE))
        chain = [name for name, source in edges.items() if source == value]
        while follow := [name for name, source in edges.items() if source == chain[-1]]:
            chain += follow
        assert tuple(chain) == sample.answers and len(chain) == 5
        examples = 2 if length >= ruler.EXAMPLE_MIN_LENGTH else 1  # RULER's in-context example first
        assert sample.context.count("Memorize and track the chain(s)") == examples


@pytest.mark.parametrize("length", LENGTHS)
def test_cwe_answers_are_the_most_common_words_of_the_list(generated, length: int) -> None:
    for sample in generated["cwe", length]:
        listed = sample.context.rsplit("Memorize the ones that appear most often.\n", 1)[1]
        entries = re.split(r"(?:^| )(\d+)\. ", listed)[1:]
        numbers, words = entries[0::2], entries[1::2]
        assert numbers == [str(i + 1) for i in range(len(words))]
        counts = Counter(words).most_common()
        assert {word for word, _ in counts[:10]} == set(sample.answers)
        common, uncommon = (6, 1) if length < 4096 else (30, 3)  # RULER's two regimes
        assert counts[9][1] == common and counts[10][1] == uncommon


@pytest.mark.parametrize("length", LENGTHS)
def test_fwe_answers_are_the_most_frequent_coded_words(generated, length: int) -> None:
    for sample in generated["fwe", length]:
        counts = Counter(sample.context.rsplit("three most frequently appeared coded words. ", 1)[1].split(" "))
        assert counts.most_common(1)[0][0] == "..."
        del counts["..."]
        assert tuple(word for word, _ in counts.most_common(3)) == sample.answers
        assert all(re.fullmatch(r"[a-z]{6}", word) for word in counts)


def test_essay_needle_sits_at_its_depth(generated) -> None:
    for sample in generated["niah_single_2", 4096]:
        (depth,) = sample.metadata["depths"]
        assert depth in ruler.DEPTHS
        position = sample.context.index(f"is: {sample.answers[0]}.") / len(sample.context)
        assert abs(position - depth / 100) < 0.05


def test_samples_are_seeded(tokenizer) -> None:
    for name in ("niah_multikey_2", "vt", "cwe", "fwe", "niah_single_3"):
        task = TASKS[name]
        first = task.samples(tokenizer, length=1024, count=2, seed=5)
        again = task.samples(tokenizer, length=1024, count=2, seed=5)
        assert first == again and [s.metadata for s in first] == [s.metadata for s in again]
        other = task.samples(tokenizer, length=1024, count=2, seed=6)
        assert {s.context for s in first}.isdisjoint(s.context for s in other)
        assert {s.answers for s in first}.isdisjoint(s.answers for s in other)
        assert first[0].answers != first[1].answers


def test_a_4k_sample_tokenizes_its_prompt_a_handful_of_times(tokenizer, monkeypatch) -> None:
    """The length search interpolates on token counts (fit_size), so fitting a 4k prompt takes
    a handful of tokenizations, never a scan over haystack sizes."""
    texts = []
    tokens = ruler._tokens
    monkeypatch.setattr(ruler, "_tokens", lambda tokenizer, text: texts.append(text) or tokens(tokenizer, text))
    for name in ("niah_single_2", "niah_multikey_3", "cwe"):
        texts.clear()
        TASKS[name].samples(tokenizer, length=4096, count=1, seed=11)
        assert 0 < len(texts) <= 12


# --- RULER's templates, verified against scripts/data/synthetic/constants.py -----------------


def test_templates_are_rulers() -> None:
    assert ruler.NIAH_TEMPLATE == (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
        "{type_needle_v} for {query} mentioned in the provided text?"
    )
    assert (
        ruler.NIAH_ANSWER_PREFIX == " The special magic {type_needle_v} for {query} mentioned in the provided text are"
    )
    assert ruler.CWE_ANSWER_PREFIX == " Answer: The top 10 words that appear most often in the list are:"
    assert ruler.VT_ANSWER_PREFIX == (
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assigned the value {query}, they are: "
    )
    assert ruler.NOISE == "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    assert ruler.DEPTHS == tuple(np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int).tolist())


def test_single_value_niah_reads_as_ruler_words_it(generated) -> None:
    sample = generated["niah_single_1", 1024][0]
    (key,) = sample.metadata["keys"]
    assert sample.context.startswith(
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\nThe grass is green."
    )
    assert sample.question == f"What is the special magic number for {key} mentioned in the provided text?"
    assert sample.answer_prefix == f"The special magic number for {key} mentioned in the provided text is"
    assert f"\nOne of the special magic numbers for {key} is: {sample.answers[0]}.\n" in sample.context


def test_multi_value_niah_and_the_other_tasks_read_as_ruler(generated) -> None:
    sample = generated["niah_multiquery", 1024][0]
    keys = sample.metadata["keys"]
    assert sample.question == (
        f"What are all the special magic numbers for {keys[0]}, {keys[1]}, {keys[2]}, and {keys[3]} "
        "mentioned in the provided text?"
    )
    assert sample.context.startswith("Some special magic numbers are hidden within the following text.")
    cwe = generated["cwe", 4096][0]
    assert cwe.question == "Question: What are the 10 most common words in the above list?"
    assert cwe.answer_prefix == "Answer: The top 10 words that appear most often in the list are:"
    assert "in the above list? Answer: The top 10 words that appear most often in the list are: 1. " in cwe.context
    fwe = generated["fwe", 1024][0]
    assert fwe.context.startswith(
        "Read the following coded text and track the frequency of each coded word. "
        "Find the three most frequently appeared coded words. "
    )
    assert fwe.question == (
        "Question: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?"
    )
    vt = generated["vt", 1024][0]
    value = vt.question.split("the value ")[1].split(" ")[0]
    assert vt.answer_prefix == (
        "Answer: According to the chain(s) of variable assignment in the text above, "
        f"5 variables are assigned the value {value}, they are: "
    )


# --- metrics ------------------------------------------------------------------------------------


def test_string_match_all_counts_each_reference() -> None:
    assert string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert string_match_all("The numbers are 1234567 and 765.", ["1234567", "7654321"]) == 0.5
    assert string_match_all("only one of four: ABC", ["abc", "def", "ghi", "jkl"]) == 0.25
    assert string_match_all("Quick-Fox and LAZY-dog", ["quick-fox", "lazy-DOG"]) == 1.0  # case-insensitive
    assert string_match_all("", ["1234567"]) == 0.0
    assert string_match_all("   \n", ["1234567"]) == 0.0


def test_string_match_part_needs_any_reference() -> None:
    assert string_match_part("It is Paris, France.", ["paris", "Lyon"]) == 1.0
    assert string_match_part("It is Marseille.", ["paris", "Lyon"]) == 0.0
    assert string_match_part("", ["paris"]) == 0.0


def test_predictions_are_post_processed_as_ruler() -> None:
    # strip, every character \x00-\x1f becomes a newline, strip again; \x7f is kept
    assert postprocess("\t ab\x00cd\x1f\n") == "ab\ncd"
    assert postprocess("a\x7fb") == "a\x7fb"
    assert string_match_all("ab\x00cd", ["ab\ncd"]) == 1.0
    assert string_match_all("12\x0034", ["1234"]) == 0.0
    assert string_match_part("x\ty", ["X\nY"]) == 1.0
    with pytest.raises(ValueError):
        string_match_all("anything", [])


def test_task_scores_its_sample(generated) -> None:
    sample = generated["niah_multivalue", 1024][0]
    task = TASKS["niah_multivalue"]
    assert task.score(" ".join(sample.answers), sample) == 1.0
    assert task.score(f"{sample.answers[0]}, {sample.answers[2]}", sample) == 0.5
    assert task.score("I don't know", sample) == 0.0


# --- fitting ------------------------------------------------------------------------------------


def test_fit_size_takes_the_longest_prompt_within_the_target() -> None:
    calls: list[int] = []

    def tokens(size: int) -> int:
        calls.append(size)
        return 40 + 3 * size

    assert fit_size(tokens, 4096, low=1) == (4096 - 40) // 3
    assert len(calls) < 12


def test_fit_size_overshoots_only_for_coarse_units() -> None:
    assert fit_size(lambda size: 50 * size, 1024, low=1) == 20  # 1000: 2.3% short, kept
    assert fit_size(lambda size: 50 * size, 1040, low=1) == 21  # 1000 is 3.8% short, 1050 nearer
    assert fit_size(lambda size: 50 * size, 1070, low=1) == 21  # 1050 within 2.5%
    assert fit_size(lambda size: 50 * size, 30, low=1) == 1  # the smallest size when nothing fits
    assert fit_size(lambda size: 10 * size, 1000, low=1, high=99) == 99
    with pytest.raises(ValueError, match="runs out"):
        fit_size(lambda size: 10 * size, 1000, low=1, high=50)


def test_zeta() -> None:
    assert ruler.zeta(2.0) == pytest.approx(math.pi**2 / 6, rel=1e-12)
    assert ruler.zeta(3.0) == pytest.approx(1.2020569031595942, rel=1e-12)
