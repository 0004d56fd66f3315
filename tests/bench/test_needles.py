"""Needle families beyond RULER's (kvevict.bench.needles): what the gates train on, and the held-out ones."""

import random

import pytest

from kvevict.bench.needles import HELD_OUT, PHRASINGS, TASKS, TRAINING, Family, haystack_lines, needle_builder


def test_no_training_family_has_a_held_out_haystack_kind_or_phrasing() -> None:
    assert not set(TRAINING.haystacks) & set(HELD_OUT.haystacks)
    assert not set(TRAINING.kinds) & set(HELD_OUT.kinds)
    assert not set(TRAINING.phrasings) & set(HELD_OUT.phrasings)
    for task in TASKS.values():  # each registered task has something no training context has
        family = task.family
        assert (
            family.haystack in HELD_OUT.haystacks
            or family.kind in HELD_OUT.kinds
            or family.phrasing in HELD_OUT.phrasings
        )


@pytest.mark.parametrize("haystack", ["essay", "noise", "code", "lists", "dialogue"])
def test_each_haystack_gives_as_many_units_as_asked_the_same_for_a_seed(haystack: str) -> None:
    lines = haystack_lines(haystack, 12, random.Random(3))
    assert len(lines) == 12 and lines == haystack_lines(haystack, 12, random.Random(3))
    if haystack == "dialogue":
        assert lines[0].startswith("Maria: ") and lines[1].startswith("Tom: ")
    if haystack == "lists":
        assert all(line.startswith("- ") and line.endswith(" in stock") for line in lines)


def test_a_context_holds_every_needle_and_asks_for_every_value_of_one_key() -> None:
    build = needle_builder(Family("lists", "codes", 5, keys=2, values=3), random.Random(0))
    prompt = build(30, random.Random(1))
    assert len(prompt.answers) == 3 and all(prompt.context.count(value) == 1 for value in prompt.answers)
    phrased = PHRASINGS[5].split("{")[0]
    assert prompt.context.count(phrased) == 6  # two keys, three values each
    assert prompt.question.startswith("What are all the codes for ") and prompt.answer_prefix.endswith("are:")


def test_held_out_tasks_fit_the_length_and_their_answers_are_in_the_context(tokenizer) -> None:
    for task in TASKS.values():
        (sample,) = task.samples(tokenizer, length=512, count=1)
        assert 400 < sample.metadata["tokens"] <= 600
        assert all(answer in sample.context for answer in sample.answers)
        assert task.score(" ".join(sample.answers), sample) == 1.0
