"""Offline sentence splitting: a rule-based stand-in for nltk's punkt ``sent_tokenize``, which
RULER uses to place needles at sentence boundaries but which needs a model download."""

from __future__ import annotations

import re

ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt vs cf viz al e.g i.e inc ltd co corp dept est approx fig vol pp "  # noqa: SIM905
    "gen gov sen rep rev capt col lt sgt jan feb apr jun jul aug sep sept oct nov dec".split()
)
"""Words (lower case, without their final dot) after which a dot does not end a sentence."""

# A candidate break: the last word's final ., ! or ? with any closing quotes or brackets, the
# whitespace after it, and a next word that starts (after any opening quotes or brackets) with
# a capital letter or a digit. Group 1 is the word up to its final punctuation, group 2 the gap.
_CANDIDATE = re.compile(r"""(?<!\S)(\S*?[.!?])["'’”)\]]*(\s+)(?=["'‘“(\[]*[A-Z0-9])""")
_INITIAL = re.compile(r"[a-z]|(?:[a-z]\.)+[a-z]")  # "J" of "J." or "u.s" of "U.S."


def _ends_sentence(word: str) -> bool:
    if not word.endswith("."):
        return True
    stem = word.lstrip("\"'‘“([").lower()[:-1]
    return stem not in ABBREVIATIONS and _INITIAL.fullmatch(stem) is None


def split_sentences(text: str) -> list[str]:
    """The sentences of ``text``, stripped.

    A sentence ends at ``.``, ``!`` or ``?`` (followed by any closing quotes or brackets) when
    whitespace and a capitalised word or a number come next, unless the dot closes a known
    abbreviation ("Mr.", "e.g."), an initial ("J.") or a dotted acronym ("U.S."). Decimal
    numbers and words run together without a space ("3.5", "end.Next") never break. When
    ``text`` is single-spaced, joining the sentences with ``" "`` gives it back."""
    sentences: list[str] = []
    start = 0
    for match in _CANDIDATE.finditer(text):
        if _ends_sentence(match.group(1)):
            sentences.append(text[start : match.start(2)].strip())
            start = match.end(2)
    if text[start:].strip():
        sentences.append(text[start:].strip())
    return sentences
