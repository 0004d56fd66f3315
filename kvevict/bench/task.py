"""The task interface of the benchmark suite (the registry of tasks is :mod:`kvevict.bench.tasks`).

A task turns a tokenizer, a target length and a sample count into :class:`Sample` s, and
scores a prediction against a sample. Offline tasks (RULER-style, :mod:`kvevict.bench.ruler`)
are generated locally; hub tasks (:mod:`kvevict.bench.longbench`, :mod:`kvevict.bench.maths`)
load their data through ``datasets`` when the hub is reachable.

Adding a task: subclass :class:`Task` in the module of its family and add the instance to
that module's ``TASKS`` (a new family's module also goes in :func:`kvevict.bench.tasks.all_tasks`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Sample:
    """One prompt of a task.

    The model sees ``context`` (the part that is compressed), then ``question`` and the
    ``answer_prefix`` it continues from. Samples with the same ``context_id`` share their
    context, which the runner prefills and compresses once.
    """

    task: str
    index: int
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    """Reference answers (for RULER: every string that must appear; see the task's metric)."""
    max_new_tokens: int
    context_id: str
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


class Task(ABC):
    """A benchmark task: sample generation or loading, and per-sample scoring in [0, 1]."""

    name: ClassVar[str]
    source: ClassVar[str]
    """``"offline"`` (generated here) or ``"hub"`` (needs the Hugging Face hub)."""
    metric: ClassVar[str]
    """Name of the scoring function, recorded with every result."""
    scored_by_fidelity: ClassVar[bool] = False
    """Label-free tasks: the runner replays the full cache's answer under each policy and
    scores a sample by its top-1 agreement (:mod:`kvevict.bench.fidelity`)."""

    @abstractmethod
    def samples(self, tokenizer: PreTrainedTokenizerBase, *, length: int, count: int, seed: int = 0) -> list[Sample]:
        """``count`` samples whose prompt is about ``length`` tokens of ``tokenizer``
        (generated tasks fit it; loaded tasks truncate to it), reproducible from ``seed``."""

    def score(self, prediction: str, sample: Sample) -> float:
        """Score of ``prediction`` for ``sample``, in [0, 1] (tasks with reference answers)."""
        raise TypeError(f"task {self.name!r} has no reference answers: it is scored by fidelity")
