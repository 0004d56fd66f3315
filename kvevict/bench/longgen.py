"""Long greedy generations for decode-time eviction, scored by fidelity (no labels).

``longgen`` asks for a long essay on a seeded topic and lets the model write ``1024`` new tokens
greedily, without repeating a 4-gram or ending early (the decode-time benchmark of
LazyEviction-style methods, offline): the full cache's generation is replayed under each policy,
token by token, evicting as generation would, and each sample's score is its top-1 agreement with
the full cache (KL and perplexity are recorded too). The prompt is short on purpose (tens of tokens,
like a reasoning problem): ``length`` is not used; the memory at stake is the generated text's.
"""

from __future__ import annotations

import random

from transformers import PreTrainedTokenizerBase

from kvevict.bench.task import Sample, Task

TOPICS = (
    # seed 0
    "the history of the printing press",
    "how bridges are designed to carry heavy loads",
    "the water cycle and its effect on climate",
    "why startups fail and how founders can avoid it",
    "the invention of the telescope and what it changed in astronomy",
    "how a compiler turns source code into machine code",
    "the role of bees in agriculture",
    "the causes and consequences of the industrial revolution",
    # seed 1
    "how vaccines train the immune system",
    "the rise and fall of the Roman Empire",
    "how electricity reaches a home from a power plant",
    "why cities grow where they do",
    "the discovery of penicillin and the antibiotics that followed",
    "how a search engine ranks web pages",
    "the life cycle of a star",
    "how interest rates affect an economy",
    # seed 2
    "the domestication of the horse",
    "how glaciers shape mountains and valleys",
    "the invention of writing and early alphabets",
    "how airplanes stay in the air",
    "the spread of coffee around the world",
    "how an operating system schedules programs",
    "the causes of the French Revolution",
    "how forests recover after a wildfire",
)
TOPICS_PER_SEED = 8
"""Seeds draw from disjoint sets of topics (seed ``s`` from set ``s mod 3``), so a parameter
tuned on one seed's samples can be checked on another's."""
INSTRUCTION = (
    "Write a long, detailed essay about {topic}. Reason step by step through its causes, mechanisms and "
    "consequences, give concrete examples, and do not stop early."
)
NEW_TOKENS = 1024
GENERATION = {"no_repeat_ngram_size": 4, "min_new_tokens": NEW_TOKENS}
"""Small models loop on long greedy essays (SmolLM2-135M repeats 9 sentences over 1024
tokens, which every policy then "predicts" perfectly) or stop early; banning repeated
4-grams and end-of-text before 1024 tokens keeps the greedy text long, informative and
still deterministic."""


class LongGeneration(Task):
    """An essay prompt and 1024 new tokens, scored by top-1 agreement with the full cache."""

    name = "longgen"
    source = "offline"
    metric = "fidelity_top1"
    scored_by_fidelity = True

    def samples(self, tokenizer: PreTrainedTokenizerBase, *, length: int, count: int, seed: int = 0) -> list[Sample]:
        start = (seed % (len(TOPICS) // TOPICS_PER_SEED)) * TOPICS_PER_SEED
        pool = TOPICS[start : start + TOPICS_PER_SEED]
        topics = random.Random(seed).sample(pool, k=min(count, len(pool)))
        return [
            Sample(
                self.name,
                i,
                INSTRUCTION.format(topic=topic),
                "",
                "",
                (),
                NEW_TOKENS,
                f"{self.name}-{seed}-{i}",
                {"generation": GENERATION},
            )
            for i, topic in enumerate(topics)
        ]


TASKS: dict[str, Task] = {task.name: task for task in (LongGeneration(),)}
