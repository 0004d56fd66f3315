"""Needle families beyond RULER's (kvevict.bench.needles): what the gates train on, and the held-out ones."""

import random

import pytest

from kvevict.bench.needles import (
    GENERATED,
    GENERATED_BOTH_ORDERS,
    HELD_OUT,
    INTROS,
    PHRASED,
    PHRASED_BOTH_ORDERS,
    PHRASINGS,
    SYNONYMS,
    TASKS,
    TRAINING,
    Family,
    draw_value,
    haystack_lines,
    needle_builder,
)


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


def test_the_many_phrasings_hold_none_of_the_held_out_ones_nor_rulers() -> None:
    held_out = {PHRASINGS[index] for index in HELD_OUT.phrasings}
    assert len(set(GENERATED)) == len(GENERATED) > 150 and not held_out & set(GENERATED)
    assert not set(PHRASED.haystacks) & set(HELD_OUT.haystacks) and not set(PHRASED.kinds) & set(HELD_OUT.kinds)
    assert not any("special magic" in template for template in GENERATED)
    assert all(template.count("{key}") == template.count("{value}") == 1 for template in GENERATED)


def test_three_in_ten_phrasings_in_both_orders_name_the_value_first_and_none_held_out() -> None:
    held_out = {PHRASINGS[index] for index in HELD_OUT.phrasings}
    added = GENERATED_BOTH_ORDERS[len(GENERATED) :]
    assert GENERATED_BOTH_ORDERS[: len(GENERATED)] == GENERATED and len(set(GENERATED_BOTH_ORDERS)) == 270
    assert all(template.index("{value}") < template.index("{key}") for template in added)
    value_first = [t for t in GENERATED_BOTH_ORDERS if t.index("{value}") < t.index("{key}")]
    assert len(value_first) == len(GENERATED_BOTH_ORDERS) * 3 // 10 and not held_out & set(added)
    assert PHRASED_BOTH_ORDERS.phrasings == GENERATED_BOTH_ORDERS and PHRASED_BOTH_ORDERS.kinds == PHRASED.kinds


def test_a_phrased_family_names_its_values_by_a_synonym_after_one_of_the_introductions() -> None:
    rng = random.Random(5)
    families = [PHRASED.draw(rng) for _ in range(40)]
    assert all(family.noun in SYNONYMS[family.kind] and family.phrasing in GENERATED for family in families)
    assert {family.intro for family in families} == set(range(len(INTROS)))
    family = Family("noise", "hex", "{key} = {value}", keys=2, noun="hash", intro=1)
    prompt = needle_builder(family, random.Random(0))(8, random.Random(1))
    assert prompt.context.startswith(haystack_lines("noise", 1, rng)[0])  # intro 1 is none
    assert f"{prompt.question.split(' for ')[1].split(' in ')[0]} = {prompt.answers[0]}" in prompt.context
    assert prompt.question.startswith("What is the hash for ")


def test_the_added_value_formats() -> None:
    rng = random.Random(0)
    for value in (draw_value("hex", rng) for _ in range(5)):
        assert len(value) == 8 and int(value, 16) >= 0
    serial = draw_value("serials", rng)
    assert len(serial) == 10 and serial.isalnum() and serial.upper() == serial


@pytest.mark.parametrize("haystack", ["essay", "noise", "code", "lists", "dialogue"])
def test_each_haystack_gives_as_many_units_as_asked_the_same_for_a_seed(haystack: str) -> None:
    lines = haystack_lines(haystack, 12, random.Random(3))
    assert len(lines) == 12 and lines == haystack_lines(haystack, 12, random.Random(3))
    if haystack == "dialogue":
        assert lines[0].startswith("Maria: ") and lines[1].startswith("Tom: ")
    if haystack == "lists":
        assert all(line.startswith("- ") and line.endswith(" in stock") for line in lines)


@pytest.mark.parametrize("haystack", ["essay", "dialogue"])
def test_an_essay_window_of_long_sentences_still_gives_every_sentence_asked(haystack: str) -> None:
    # seed 2 starts where 60 words hold fewer than 2 sentences; a 3-key family's smallest haystack failed there
    assert len(haystack_lines(haystack, 2, random.Random(2))) == 2
    assert [len(haystack_lines(haystack, 3, random.Random(seed))) for seed in (2, 8, 40, 94)] == [3] * 4


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
