"""Documents for compress-once-ask-many: one context per document, one question per needle."""

from __future__ import annotations

import pytest

from kvevict.bench.documents import ManyNeedles, documents, score


def test_each_document_asks_for_each_of_its_needles_alone(tokenizer) -> None:
    grouped = documents(tokenizer, length=400, count=2, questions=3, seed=1)
    assert [len(samples) for samples in grouped] == [3, 3]
    for samples in grouped:
        assert len({sample.context for sample in samples}) == 1 and len({s.context_id for s in samples}) == 1
        for sample in samples:
            (key,) = sample.metadata["keys"]
            (value,) = sample.answers
            assert f"One of the special magic numbers for {key} is: {value}." in sample.context
            assert sample.question == f"What is the special magic number for {key} mentioned in the provided text?"
            assert score(f"The number is {value}.", sample) == 1.0 and score("none", sample) == 0.0
    assert grouped[0][0].context != grouped[1][0].context
    assert documents(tokenizer, length=400, count=2, questions=3, seed=1) == grouped  # deterministic


def test_questions_per_document_are_checked() -> None:
    with pytest.raises(ValueError, match="questions per document must be a positive integer"):
        ManyNeedles(0)
