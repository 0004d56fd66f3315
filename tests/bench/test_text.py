import re

import pytest

from kvevict.bench.haystack import essays
from kvevict.bench.text import split_sentences


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        (
            "Mr. Smith went to Washington. He arrived at 3.30 p.m. on Monday.",
            ["Mr. Smith went to Washington.", "He arrived at 3.30 p.m. on Monday."],
        ),
        ("Use tools, e.g. Python. It is 2.5 times faster!", ["Use tools, e.g. Python.", "It is 2.5 times faster!"]),
        ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
        ("Really? Yes! (It works.) Fine.", ["Really?", "Yes!", "(It works.)", "Fine."]),
        ("J. R. R. Tolkien wrote it. Dr. Who did not.", ["J. R. R. Tolkien wrote it.", "Dr. Who did not."]),
        ("Sales in the U.S. Rose. Oh", ["Sales in the U.S. Rose.", "Oh"]),
        (
            "It ended.Next came 1999. 42 is the answer... Wait",
            ["It ended.Next came 1999.", "42 is the answer...", "Wait"],
        ),
        ("no capital. after this one. Nor this", ["no capital. after this one.", "Nor this"]),
        ("Line one.\n\nLine two.", ["Line one.", "Line two."]),
        ("", []),
        ("   ", []),
    ],
)
def test_split_sentences_on_tricky_text(text: str, sentences: list[str]) -> None:
    assert split_sentences(text) == sentences


def test_split_sentences_gives_the_essays_back() -> None:
    text = re.sub(r"\s+", " ", essays()[:200_000])
    sentences = split_sentences(text)
    assert " ".join(sentences) == text
    assert len(sentences) > 1000 and all(sentences)
