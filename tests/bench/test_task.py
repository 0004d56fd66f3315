"""The task interface (kvevict.bench.task): a sample's identity leaves its metadata out, a task
without reference answers refuses to score, and a task must say how it makes its samples."""

from __future__ import annotations

import dataclasses

import pytest

from kvevict.bench.longgen import LongGeneration
from kvevict.bench.task import Sample, Task


def sample(**changes: object) -> Sample:
    fields = {"task": "t", "index": 0, "context": "c", "question": "q?", "answer_prefix": "A:", "answers": ("1",)}
    return Sample(**{**fields, "max_new_tokens": 8, "context_id": "t/0", **changes})


def test_samples_compare_and_hash_without_their_metadata() -> None:
    first, second = sample(metadata={"tokens": 10}), sample(metadata={"tokens": 11})
    assert first == second and hash(first) == hash(second)
    assert sample() != sample(answers=("2",)) and sample() != sample(context_id="t/1")
    assert sample().metadata == {} and sample().metadata is not sample().metadata  # one dict per sample


def test_a_sample_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample().context = "other"  # type: ignore[misc]


class Generated(Task):
    name = "generated"
    source = "offline"
    metric = "fidelity_top1"

    def samples(self, tokenizer, *, length: int, count: int, seed: int = 0) -> list[Sample]:
        return [sample(index=i) for i in range(count)]


def test_a_task_without_reference_answers_refuses_to_score_naming_itself() -> None:
    assert not Generated.scored_by_fidelity and LongGeneration.scored_by_fidelity
    for task, name in ((Generated(), "generated"), (LongGeneration(), "longgen")):
        with pytest.raises(TypeError, match=rf"^task '{name}' has no reference answers: it is scored by fidelity$"):
            task.score("an answer", sample())


def test_a_task_must_say_how_it_makes_its_samples() -> None:
    class Unfinished(Task):
        name = "unfinished"

    with pytest.raises(TypeError, match="abstract method 'samples'|abstract method samples"):
        Unfinished()  # type: ignore[abstract]
    assert [s.index for s in Generated().samples(None, length=64, count=3)] == [0, 1, 2]
