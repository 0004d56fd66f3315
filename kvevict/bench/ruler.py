"""RULER's synthetic tasks (NVIDIA/RULER, arXiv 2404.06654), generated offline and fitted to a
tokenizer at a requested length.

The eleven tasks of RULER's ``scripts/synthetic.yaml`` (all but the QA ones): eight
needle-in-a-haystack variants, variable tracking (``vt``), common words extraction (``cwe``)
and frequent words extraction (``fwe``), with RULER's templates and answer prefixes
(``scripts/data/synthetic/constants.py``), task parameters, generators and metrics
(``scripts/eval/synthetic/constants.py``, with the prediction post-processing of
``scripts/eval/evaluate.py``).

Prompt layout. RULER's prompt is ``template.format(context=haystack, ...) + answer_prefix``
and every template reads ``{before}{context}\\n{question}``. Here ``Sample.context`` is
``before + haystack`` (for ``vt`` and ``cwe`` preceded by RULER's in-context example),
``Sample.question`` is the question without the newline, and ``Sample.answer_prefix`` is
RULER's answer prefix without its leading space. The runner renders
``context + "\\n\\n" + question`` as the user turn and continues the assistant turn from the
answer prefix; the length fitted is that of ``context + "\\n\\n" + question + " " +
answer_prefix`` (no chat template, no special tokens).

Differences from RULER, all deliberate:

- The question follows the context after ``"\n\n"`` (the runner's separator), not ``"\n"``.
- The prompt itself is fitted to ``length`` (RULER fits prompt + ``tokens_to_generate``), and
  when one haystack unit is so many tokens that the longest prompt not over ``length`` falls
  more than 2.5% short, one more unit is taken if that lands nearer (see :func:`fit_size`).
- The search probes by interpolation on the nearly linear token counts instead of plain
  bisection, and each sample is reproducible from ``(task, seed, index)`` through its own
  ``random.Random`` (RULER reseeds global state and reuses fixed-seed shuffles).
- Sentences come from :func:`kvevict.bench.text.split_sentences`, not nltk; the essays are
  :func:`kvevict.bench.haystack.essays`; empty haystack pieces are not joined in (RULER leaves
  double spaces when two needles share a depth).
- Keys, distractor keys and variable names within a sample are distinct (RULER can repeat them);
  word keys pair a random adjective with a random noun (RULER draws from their 6M-pair product).
- Below :data:`EXAMPLE_MIN_LENGTH` tokens ``vt`` and ``cwe`` leave out RULER's in-context
  example, which alone takes 300 to 500 tokens (RULER evaluates from 4k tokens).
- ``cwe`` raises past its ~8k-word vocabulary (about 100k tokens), where RULER falls back on a
  second word list.
"""

from __future__ import annotations

import math
import random
import re
import string
import uuid
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from itertools import cycle, islice, pairwise
from typing import Any, ClassVar, Literal

from transformers import PreTrainedTokenizerBase
from wonderwords.random_word import _get_words_from_text_file

from kvevict.bench.haystack import essays
from kvevict.bench.task import Sample, Task
from kvevict.bench.text import split_sentences

# RULER's templates and answer prefixes, verbatim (scripts/data/synthetic/constants.py).
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assigned the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. {context}\n"
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

# Haystacks and needles (scripts/data/synthetic/niah.py, variable_tracking.py).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = tuple(round(100 * i / 39) for i in range(40))
"""RULER's needle depths in percent: ``np.round(np.linspace(0, 100, num=40))``."""

SLACK = 0.025
"""How far short of the target a prompt may fall before :func:`fit_size` considers overshooting."""
EXAMPLE_MIN_LENGTH = 1024
"""The shortest prompt in which ``vt`` and ``cwe`` include their in-context example."""

Haystack = Literal["noise", "essay", "needle"]
Kind = Literal["words", "numbers", "uuids"]


# --- metrics (scripts/eval/synthetic/constants.py, scripts/eval/evaluate.py) ----------------


def postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: strip, turn control characters into newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of ``references`` found, case-insensitively, in the post-processed prediction."""
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    text = postprocess(prediction).lower()
    return sum(reference.lower() in text for reference in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1 if any of ``references`` is found, case-insensitively, in the post-processed prediction."""
    if not references:
        raise ValueError("string_match_part needs at least one reference")
    text = postprocess(prediction).lower()
    return float(any(reference.lower() in text for reference in references))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


# --- fitting -----------------------------------------------------------------------------------


def fit_size(
    tokens: Callable[[int], int], target: int, low: int, high: int | None = None, *, slack: float = SLACK
) -> int:
    """The haystack size in ``[low, high]`` for a prompt of ``target`` tokens, ``tokens(size)``
    being the prompt length at that size (nondecreasing, nearly linear).

    As RULER: the largest size whose prompt does not exceed ``target`` — unless that prompt is
    more than ``slack`` short and the next size lands nearer. Probes extrapolate from two
    measured sizes, then interpolate within the bracket (bisecting when that stalls), so a
    prompt is tokenized a handful of times."""
    counts: dict[int, int] = {}

    def at(size: int) -> int:
        if size not in counts:
            counts[size] = tokens(size)
        return counts[size]

    if at(low) >= target:
        return low
    fits, over = low, None  # at(fits) <= target < at(over)
    probe, width = low + 16, math.inf
    while over is None or over - fits > 1:
        if high is not None:
            probe = min(probe, high)
        if at(probe) <= target:
            fits = probe
        else:
            over = probe
        if over is None:
            if fits == high:
                if at(high) < (1 - slack) * target:
                    raise ValueError(f"the haystack runs out at {at(high)} tokens, short of {target}")
                return high
            rate = max((at(fits) - at(low)) / (fits - low), 1e-3)
            probe = fits + math.ceil(1.02 * (target - at(fits)) / rate) + 1
        elif over - fits > 1:
            stalled, width = over - fits > width / 2, over - fits
            step = (target - at(fits)) * (over - fits) / (at(over) - at(fits))
            probe = (fits + over) // 2 if stalled else min(max(fits + round(step), fits + 1), over - 1)
    short = target - at(fits)
    return over if short > slack * target and at(over) - target < short else fits


# --- shared generation -------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One generated prompt, split as :class:`Sample` wants it."""

    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """What the length is fitted on."""
        return f"{self.context}\n\n{self.question} {self.answer_prefix}"


Builder = Callable[[int, random.Random], Prompt]
"""Builds the prompt at a haystack size, drawing what depends on the size from the given RNG."""


def template_parts(template: str, answer_prefix: str, **fields: object) -> tuple[str, str, str]:
    """RULER's template cut at ``{context}``: the text before the haystack, the question (without
    the newline before it) and the answer prefix (without its leading space)."""
    before, question = template.split("{context}")
    return (
        before.format(**fields),
        question.removeprefix("\n").format(**fields),
        answer_prefix.removeprefix(" ").format(**fields),
    )


def _tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def distinct(draw: Callable[[], str], count: int, exclude: Sequence[str] = ()) -> list[str]:
    drawn: list[str] = []
    while len(drawn) < count:
        if (item := draw()) not in drawn and item not in exclude:
            drawn.append(item)
    return drawn


@cache
def wordlist(name: str) -> tuple[str, ...]:
    """A wonderwords word list (``nounlist.txt``, ``adjectivelist.txt``, ``verblist.txt``)."""
    return tuple(_get_words_from_text_file(name))


@cache
def essay_words() -> tuple[str, ...]:
    """The essays split on whitespace, as RULER's ``re.sub(r"\\s+", " ", essay).split(" ")``."""
    return tuple(essays().split())


def insert_items(sentences: list[str], items: Sequence[str], rng: random.Random) -> list[int]:
    """RULER's insertion into a line haystack: ``items`` at distinct random indexes, the first
    item at the largest; returns the sorted indexes."""
    indexes = sorted(rng.sample(range(len(sentences)), len(items)), reverse=True)
    for index, item in zip(indexes, items, strict=True):
        sentences.insert(index, item)
    return sorted(indexes)


class RulerTask(Task):
    """A RULER synthetic task: draws each sample from its own seeded RNG and fits its haystack
    size to the requested length with :func:`fit_size`."""

    source = "offline"
    tokens_to_generate: ClassVar[int]
    """RULER's ``tokens_to_generate``: the sample's ``max_new_tokens``."""

    @abstractmethod
    def _draw(self, rng: random.Random, tokenizer: PreTrainedTokenizerBase, length: int) -> Builder:
        """Draw what does not depend on the haystack size; return the builder for a size."""

    def _low(self) -> int:
        """The smallest haystack size."""
        return 1

    def _high(self) -> int | None:
        """The largest haystack size, if bounded."""
        return None

    def samples(self, tokenizer: PreTrainedTokenizerBase, *, length: int, count: int, seed: int = 0) -> list[Sample]:
        return [self._sample(tokenizer, length, seed, index) for index in range(count)]

    def _sample(self, tokenizer: PreTrainedTokenizerBase, length: int, seed: int, index: int) -> Sample:
        key = f"{self.name}-{seed}-{index}"
        build = self._draw(random.Random(key), tokenizer, length)

        def prompt(size: int) -> Prompt:
            return build(size, random.Random(f"{key}/{size}"))

        size = fit_size(lambda n: _tokens(tokenizer, prompt(n).text), length, self._low(), self._high())
        chosen = prompt(size)
        return Sample(
            task=self.name,
            index=index,
            context=chosen.context,
            question=chosen.question,
            answer_prefix=chosen.answer_prefix,
            answers=chosen.answers,
            max_new_tokens=self.tokens_to_generate,
            context_id=f"{self.name}-{length}-{seed}-{index}",
            metadata={"tokens": _tokens(tokenizer, chosen.text), "haystack_size": size, **chosen.metadata},
        )

    def score(self, prediction: str, sample: Sample) -> float:
        return METRICS[self.metric](prediction, sample.answers)


# --- needle in a haystack (scripts/data/synthetic/niah.py) --------------------------------------


def draw_kind(kind: Kind, rng: random.Random) -> str:
    """A key or value as RULER draws it: an adjective-noun pair, a 7-digit number or a UUID4."""
    if kind == "words":
        return f"{rng.choice(wordlist('adjectivelist.txt'))}-{rng.choice(wordlist('nounlist.txt'))}"
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def singular(text: str) -> str:
    """RULER's rewording of the niah template when exactly one value is asked for."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text


class Niah(RulerTask):
    """RULER's ``niah``: ``num_keys`` keys with ``num_values`` values each hidden as needles in a
    haystack of repeated noise, essays or distractor needles; the answers are the values of
    ``num_queries`` of the keys. Essay needles go at sentence boundaries at RULER's depths."""

    metric = "string_match_all"
    tokens_to_generate = 128
    haystack: ClassVar[Haystack] = "essay"
    key_type: ClassVar[Kind] = "words"
    value_type: ClassVar[Kind] = "numbers"
    num_keys: ClassVar[int] = 1
    num_values: ClassVar[int] = 1
    num_queries: ClassVar[int] = 1

    def _low(self) -> int:
        return 1 if self.haystack == "essay" else max(self.num_keys, self.num_queries) * self.num_values

    def _draw(self, rng: random.Random, tokenizer: PreTrainedTokenizerBase, length: int) -> Builder:
        keys = distinct(lambda: draw_kind(self.key_type, rng), max(self.num_keys, self.num_queries))
        values = [[draw_kind(self.value_type, rng) for _ in range(self.num_values)] for _ in keys]
        needles = [
            NEEDLE.format(type_needle_v=self.value_type, key=key, value=value)
            for key, key_values in zip(keys, values, strict=True)
            for value in key_values
        ]
        rng.shuffle(needles)
        queried = rng.sample(range(len(keys)), self.num_queries)
        answers = tuple(value for i in queried for value in values[i])
        queries = [keys[i] for i in queried]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, answer_prefix, type_needle_v = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX, self.value_type
        if len(answers) == 1:
            template, answer_prefix, type_needle_v = singular(template), singular(answer_prefix), type_needle_v[:-1]
        before, question, prefix = template_parts(template, answer_prefix, type_needle_v=type_needle_v, query=query)
        depths = sorted(rng.sample(DEPTHS, len(needles))) if self.haystack == "essay" else []

        def build(size: int, rng: random.Random) -> Prompt:
            if self.haystack == "essay":
                sentences = split_sentences(" ".join(islice(cycle(essay_words()), size)))
                cuts = [0, *(len(sentences) * depth // 100 for depth in depths), len(sentences)]
                pieces = []
                for i, (start, end) in enumerate(pairwise(cuts)):
                    pieces += [" ".join(sentences[start:end]), *needles[i : i + 1]]
                haystack = " ".join(piece for piece in pieces if piece)
                placed = depths
            else:
                if self.haystack == "noise":
                    lines = [NOISE] * size
                else:
                    lines = [
                        NEEDLE.format(
                            type_needle_v=self.value_type,
                            key=distinct(lambda: draw_kind(self.key_type, rng), 1, exclude=keys)[0],
                            value=draw_kind(self.value_type, rng),
                        )
                        for _ in range(size)
                    ]
                placed = [round(100 * index / size) for index in insert_items(lines, needles, rng)]
                haystack = "\n".join(lines)
            metadata = {"haystack": self.haystack, "depths": placed, "keys": queries}
            return Prompt(before + haystack, question, prefix, answers, metadata)

        return build


class NiahSingle1(Niah):
    name = "niah_single_1"
    haystack = "noise"


class NiahSingle2(Niah):
    name = "niah_single_2"


class NiahSingle3(Niah):
    name = "niah_single_3"
    value_type = "uuids"


class NiahMultikey1(Niah):
    name = "niah_multikey_1"
    num_keys = 4


class NiahMultikey2(Niah):
    name = "niah_multikey_2"
    haystack = "needle"


class NiahMultikey3(Niah):
    name = "niah_multikey_3"
    haystack = "needle"
    key_type = "uuids"
    value_type = "uuids"


class NiahMultivalue(Niah):
    name = "niah_multivalue"
    num_values = 4


class NiahMultiquery(Niah):
    name = "niah_multiquery"
    num_queries = 4


# --- variable tracking (scripts/data/synthetic/variable_tracking.py) ---------------------------


class VariableTracking(RulerTask):
    """RULER's ``vt`` (noise haystack): ``num_chains`` chains ``VAR A = 12345``, ``VAR B = VAR A``,
    ... of ``num_hops`` hops hidden among noise lines, after one in-context example with
    three-letter names; the answers are the names of the first chain."""

    name = "vt"
    metric = "string_match_all"
    tokens_to_generate = 30
    num_chains: ClassVar[int] = 1
    num_hops: ClassVar[int] = 4

    def _low(self) -> int:
        return self.num_hops + 1

    def _chains(self, rng: random.Random, name_length: int) -> tuple[list[list[str]], list[list[str]], str]:
        """Variable names, the chains' lines and the first chain's value."""
        names = distinct(
            lambda: "".join(rng.choices(string.ascii_uppercase, k=name_length)),
            self.num_chains * (self.num_hops + 1),
            exclude=("VAR",),
        )
        groups = [names[i : i + self.num_hops + 1] for i in range(0, len(names), self.num_hops + 1)]
        values = [str(rng.randint(10000, 99998)) for _ in groups]  # numpy's randint(10000, 99999)
        chains = [
            [f"VAR {group[0]} = {value}", *(f"VAR {b} = VAR {a} " for a, b in pairwise(group))]
            for group, value in zip(groups, values, strict=True)
        ]
        return groups, chains, values[0]

    def _haystack(self, chains: list[list[str]], size: int, rng: random.Random) -> str:
        lines = [NOISE] * size
        for chain in chains:
            positions = sorted(rng.sample(range(len(lines)), len(chain)))
            for j, position in enumerate(positions):
                lines.insert(position + j, chain[j])
        return "\n".join(lines)

    def _example(self, rng: random.Random, tokenizer: PreTrainedTokenizerBase, budget: int) -> str:
        """RULER's in-context example: the full templated task with its answer, at most
        ``budget`` tokens."""
        groups, chains, value = self._chains(rng, 3)
        seed = rng.getrandbits(64)

        def text(size: int) -> str:
            haystack = self._haystack(chains, size, random.Random(f"{seed}/{size}"))
            fields = {"query": value, "num_v": self.num_hops + 1}
            return VT_TEMPLATE.format(context=haystack, **fields) + VT_ANSWER_PREFIX.format(**fields)

        size = fit_size(lambda n: _tokens(tokenizer, text(n)), budget, self._low(), slack=0)
        return f"{text(size)} {' '.join(groups[0])}"

    def _draw(self, rng: random.Random, tokenizer: PreTrainedTokenizerBase, length: int) -> Builder:
        example = f"{self._example(rng, tokenizer, 500)}\n\n" if length >= EXAMPLE_MIN_LENGTH else ""
        groups, chains, value = self._chains(rng, 5)
        before, question, prefix = template_parts(VT_TEMPLATE, VT_ANSWER_PREFIX, query=value, num_v=self.num_hops + 1)

        def build(size: int, rng: random.Random) -> Prompt:
            context = f"{example}{before}{self._haystack(chains, size, rng)}"
            return Prompt(context, question, prefix, tuple(groups[0]), {"haystack": "noise"})

        return build


# --- common words extraction (scripts/data/synthetic/common_words_extraction.py) ----------------


@cache
def _cwe_words() -> tuple[str, ...]:
    """RULER's ``cwe`` vocabulary: the wonderwords nouns, adjectives and verbs, deduplicated."""
    return tuple(sorted({*wordlist("nounlist.txt"), *wordlist("adjectivelist.txt"), *wordlist("verblist.txt")}))


def _numbered(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


class CommonWords(RulerTask):
    """RULER's ``cwe``: a numbered list where ``num_cw`` words appear ``freq_cw`` times and the
    others ``freq_ucw`` times, after one in-context example; the answers are the common words.
    Below 4096 tokens RULER uses frequencies 6 and 1 (example: 20 words, 3 and 1), from 4096
    on ``freq_cw`` and ``freq_ucw`` (example: 40 words, 10 and 3)."""

    name = "cwe"
    metric = "string_match_all"
    tokens_to_generate = 120
    freq_cw: ClassVar[int] = 30
    freq_ucw: ClassVar[int] = 3
    num_cw: ClassVar[int] = 10

    def _low(self) -> int:
        return self.num_cw

    def _high(self) -> int:
        return len(_cwe_words())

    def _words(self, rng: random.Random, size: int, common: int, uncommon: int) -> tuple[str, list[str]]:
        """RULER's ``get_example``: the shuffled numbered list and its common words."""
        words = rng.sample(_cwe_words(), size)
        listed = words[: self.num_cw] * common + words[self.num_cw :] * uncommon
        rng.shuffle(listed)
        return _numbered(listed), words[: self.num_cw]

    def _draw(self, rng: random.Random, tokenizer: PreTrainedTokenizerBase, length: int) -> Builder:
        short, example = length < 4096, ""
        if length >= EXAMPLE_MIN_LENGTH:
            listed, common = self._words(rng, *((20, 3, 1) if short else (40, 10, 3)))
            example = f"{CWE_TEMPLATE.format(context=listed)}{CWE_ANSWER_PREFIX} {_numbered(common)}\n"
        frequencies = (6, 1) if short else (self.freq_cw, self.freq_ucw)
        before, question, prefix = template_parts(CWE_TEMPLATE, CWE_ANSWER_PREFIX)

        def build(size: int, rng: random.Random) -> Prompt:
            listed, common = self._words(rng, size, *frequencies)
            metadata = {"frequencies": frequencies}
            return Prompt(f"{example}{before}{listed}", question, prefix, tuple(common), metadata)

        return build


# --- frequent words extraction (scripts/data/synthetic/freq_words_extraction.py) ---------------


def zeta(s: float) -> float:
    """The Riemann zeta function for ``s > 1`` (Euler-Maclaurin; RULER uses scipy's)."""
    n = 64
    head = sum(k**-s for k in range(1, n))
    return (
        head + n ** (1 - s) / (s - 1) + n**-s / 2 + s * n ** (-s - 1) / 12 - s * (s + 1) * (s + 2) * n ** (-s - 3) / 720
    )


class FrequentWords(RulerTask):
    """RULER's ``fwe``: a text of random ``coded_wordlen``-letter words whose counts follow a
    zeta distribution of exponent ``alpha`` over a vocabulary of ``length // 50`` words, the
    most frequent being ``...`` (noise); the answers are the next three."""

    name = "fwe"
    metric = "string_match_all"
    tokens_to_generate = 50
    alpha: ClassVar[float] = 2.0
    coded_wordlen: ClassVar[int] = 6

    def _draw(self, rng: random.Random, tokenizer: PreTrainedTokenizerBase, length: int) -> Builder:
        vocabulary = distinct(
            lambda: "".join(rng.choices(string.ascii_lowercase, k=self.coded_wordlen)), max(4, length // 50)
        )
        vocabulary[0] = "..."
        shares = [k**-self.alpha / zeta(self.alpha) for k in range(1, len(vocabulary) + 1)]
        before, question, prefix = template_parts(FWE_TEMPLATE, FWE_ANSWER_PREFIX)

        def build(size: int, rng: random.Random) -> Prompt:
            words = [word for word, share in zip(vocabulary, shares, strict=True) for _ in range(int(size * share))]
            rng.shuffle(words)
            return Prompt(before + " ".join(words), question, prefix, tuple(vocabulary[1:4]))

        return build


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        NiahSingle1(),
        NiahSingle2(),
        NiahSingle3(),
        NiahMultikey1(),
        NiahMultikey2(),
        NiahMultikey3(),
        NiahMultivalue(),
        NiahMultiquery(),
        VariableTracking(),
        CommonWords(),
        FrequentWords(),
    )
}
