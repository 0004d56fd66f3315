"""Documents with several questions each, for *compress once, ask many times*.

A document is a RULER needle haystack (``niah_single_1``'s: noise lines, numbers as values)
holding ``questions`` needles under distinct keys; question ``i`` asks for the value of key
``i`` alone, with RULER's single-value wording, and is scored by RULER's ``string_match_all``.
Every question of a document shares its context (:attr:`~kvevict.bench.task.Sample.context_id`),
which is what a compressed cache is reused for.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from kvevict.bench.ruler import NIAH_ANSWER_PREFIX, NIAH_TEMPLATE, NiahSingle1, singular, template_parts
from kvevict.bench.task import Sample


class ManyNeedles(NiahSingle1):
    """``niah_single_1`` with ``questions`` needles, every one of them queried."""

    name = "niah_many_questions"

    def __init__(self, questions: int):
        if isinstance(questions, bool) or not isinstance(questions, int) or questions < 1:
            raise ValueError(f"questions per document must be a positive integer, got {questions!r}")
        self.num_queries = questions


def documents(
    tokenizer: PreTrainedTokenizerBase, *, length: int, count: int, questions: int, seed: int = 0
) -> list[list[Sample]]:
    """``count`` documents of about ``length`` tokens, each as its ``questions`` samples (one per needle)."""
    task = ManyNeedles(questions)
    single = singular(NIAH_TEMPLATE), singular(NIAH_ANSWER_PREFIX)
    grouped = []
    for sample in task.samples(tokenizer, length=length, count=count, seed=seed):
        keys, values = sample.metadata["keys"], sample.answers
        asked = []
        for i, (key, value) in enumerate(zip(keys, values, strict=True)):
            _, question, prefix = template_parts(*single, type_needle_v=task.value_type[:-1], query=key)
            asked.append(
                Sample(
                    task=task.name,
                    index=sample.index * questions + i,
                    context=sample.context,
                    question=question,
                    answer_prefix=prefix,
                    answers=(value,),
                    max_new_tokens=task.tokens_to_generate,
                    context_id=sample.context_id,
                    metadata={**sample.metadata, "keys": [key]},
                )
            )
        grouped.append(asked)
    return grouped


def score(prediction: str, sample: Sample) -> float:
    """RULER's score of one answer (every reference string must appear)."""
    return NiahSingle1().score(prediction, sample)
