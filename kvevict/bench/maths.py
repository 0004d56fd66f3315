"""Math reasoning: MATH-500, GSM8K and AIME 2024, scored with math-verify.

The prompt is the reasoning-model one of DeepSeek-R1's (and LazyEviction's) evaluations,
``{problem}\\nPlease reason step by step, and put your final answer within \\boxed{}.``, sent
whole as the ``context`` (no question, no answer prefix) inside the chat template. The answer is
the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces; for GSM8K, the
last number of the text when nothing is boxed. It matches the reference when both are equal as
normalised strings or when math-verify's ``verify(parse(gold), parse(answer))`` holds (each
wrapped in ``$...$``); a math-verify failure or timeout counts as no match. GSM8K's reference is
the number after ``####``, without thousands separators.

``length`` is ignored: the prompts are short and the load is in the generated reasoning.
``max_new_tokens`` is 4096 by default; the papers allow up to 32k (the runner can override it).

Data: ``datasets.load_dataset`` from the hub (``HuggingFaceH4/MATH-500`` test,
``openai/gsm8k`` ``main`` test, ``HuggingFaceH4/aime_2024`` train); a local folder of
``<task name>.jsonl`` files with the same fields (``data_dir`` or ``$KVEVICT_MATH_DIR``)
replaces the hub. ``count`` rows are chosen as in LongBench (:func:`~kvevict.bench.longbench.pick`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import datasets
from math_verify import parse, verify
from transformers import PreTrainedTokenizerBase

from kvevict.bench.longbench import json_rows, local_folder, pick
from kvevict.bench.task import Sample, Task

INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
DATA_DIR_ENV = "KVEVICT_MATH_DIR"
BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` of ``text``, nested braces included;
    None without one or when its braces do not close."""
    starts = [match.end() for match in BOXED.finditer(text)]
    if not starts:
        return None
    depth = 1
    for position in range(starts[-1], len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[starts[-1] : position]
    return None


def last_number(text: str) -> str | None:
    """The last number of ``text``, without thousands separators."""
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def gsm8k_reference(solution: str) -> str:
    """GSM8K's final answer: the number after ``####``, without thousands separators."""
    return solution.split("####")[-1].strip().replace(",", "")


def normalize(answer: str) -> str:
    """Whitespace, ``$``, ``\\left``/``\\right``, ``\\!`` and a final period dropped; ``\\dfrac``
    and ``\\tfrac`` read as ``\\frac``."""
    for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""), ("\\!", "")):
        answer = answer.replace(old, new)
    return re.sub(r"[\s$]", "", answer).rstrip(".")


def equivalent(gold: str, answer: str) -> bool:
    """Whether ``answer`` matches ``gold``: equal normalised strings, or equal for math-verify
    (gold first); never raises."""
    if normalize(gold) == normalize(answer):
        return True
    try:
        return bool(verify(parse(f"${gold}$"), parse(f"${answer}$")))
    except Exception:  # noqa: BLE001 (arbitrary model output: no match rather than a crash)
        return False


class MathTask(Task):
    """A math benchmark: one problem per sample, answer extracted and checked with math-verify."""

    source = "hub"
    metric = "math_verify"
    hub: ClassVar[tuple[str, str | None, str]]
    """Dataset id, configuration and split on the hub."""
    problem_field: ClassVar[str] = "problem"

    def __init__(self, data_dir: Path | None = None, max_new_tokens: int = 4096) -> None:
        self.data_dir = data_dir
        """Folder of ``<name>.jsonl`` files replacing the hub (else ``$KVEVICT_MATH_DIR``)."""
        self.max_new_tokens = max_new_tokens

    def rows(self) -> datasets.Dataset:
        folder = local_folder(self.data_dir, DATA_DIR_ENV)
        if folder is not None:
            return json_rows(folder / f"{self.name}.jsonl")
        repo, config, split = self.hub
        return datasets.load_dataset(repo, config, split=split)

    def reference(self, row: dict[str, Any]) -> str:
        return str(row["answer"])

    def extract(self, prediction: str) -> str | None:
        return last_boxed(prediction)

    def samples(self, tokenizer: PreTrainedTokenizerBase, *, length: int, count: int, seed: int = 0) -> list[Sample]:
        """``count`` problems; ``tokenizer`` and ``length`` are not used."""
        rows = self.rows()
        return [
            Sample(
                task=self.name,
                index=index,
                context=rows[index][self.problem_field] + INSTRUCTION,
                question="",
                answer_prefix="",
                answers=(self.reference(rows[index]),),
                max_new_tokens=self.max_new_tokens,
                context_id=f"{self.name}/{index}",
            )
            for index in pick(len(rows), count, seed)
        ]

    def score(self, prediction: str, sample: Sample) -> float:
        answer = self.extract(prediction)
        return float(answer is not None and equivalent(sample.answers[0], answer))


class Math500(MathTask):
    """MATH-500 (Lightman et al., 2023): 500 MATH test problems."""

    name = "math500"
    hub = ("HuggingFaceH4/MATH-500", None, "test")


class GSM8K(MathTask):
    """GSM8K (Cobbe et al., 2021): 1319 grade-school test problems."""

    name = "gsm8k"
    hub = ("openai/gsm8k", "main", "test")
    problem_field = "question"

    def reference(self, row: dict[str, Any]) -> str:
        return gsm8k_reference(row["answer"])

    def extract(self, prediction: str) -> str | None:
        return last_boxed(prediction) or last_number(prediction)


class AIME2024(MathTask):
    """AIME 2024: the 30 problems of contests I and II."""

    name = "aime2024"
    hub = ("HuggingFaceH4/aime_2024", None, "train")


TASKS: dict[str, Task] = {task.name: task for task in (Math500(), GSM8K(), AIME2024())}
