"""LongBench v1 (Bai et al., 2023): the 16 English tasks, from the hub's ``THUDM/LongBench`` data.

Faithful to the official code (``LongBench/`` in github.com/THUDM/LongBench): the prompt templates
(``config/dataset2prompt.json``) and generation lengths (``config/dataset2maxlen.json``) verbatim;
the metrics of ``metrics.py`` with ``eval.py``'s task mapping, first-line rule (trec, triviaqa,
samsum) and maximum over the reference answers; ``pred.py``'s middle truncation and its tasks
without chat template (trec, triviaqa, samsum, lcc, repobench-p). Differences:

- scores are in [0, 1] (the official reports them ×100);
- ``code_sim_score`` uses ``rapidfuzz.fuzz.ratio`` rounded to an integer, which equals the
  official fuzzywuzzy ``fuzz.ratio`` with python-Levenshtein (normalised indel similarity);
- a template is split at ``{context}``: ``context`` is its text up to the (truncated) context,
  ``question`` the rest without its leading newlines, and the runner joins them with ``"\\n\\n"``.
  That is the official separator in 13 tasks; trec has ``"\\n"``, lcc and repobench-p none, so
  their prompts gain one (trec) or two newlines there;
- ``length`` bounds the whole rendered prompt (chat template included), and the cut is made in
  the context only; ``pred.py`` cuts the raw prompt before wrapping it in the chat template;
- samsum: ``pred.py`` also stops generation at a newline; here the first-line rule alone applies.

Data: the hub dataset is a loading script (unsupported by ``datasets`` ≥ 4), so ``data.zip`` is
downloaded with ``huggingface_hub`` and ``data/<task>.jsonl`` read with ``datasets``' JSON
builder; a local folder of ``<task>.jsonl`` files (``data_dir`` or ``$KVEVICT_LONGBENCH_DIR``)
replaces the download. The helpers for local data and sample selection serve
:mod:`kvevict.bench.maths` too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import string
import tempfile
import zipfile
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import datasets
from huggingface_hub import hf_hub_download
from rapidfuzz import fuzz
from rouge import Rouge
from transformers import PreTrainedTokenizerBase

from kvevict.bench.task import Sample, Task
from kvevict.generation import split_prompt

HUB_REPO = "THUDM/LongBench"
HUB_ARCHIVE = "data.zip"
DATA_DIR_ENV = "KVEVICT_LONGBENCH_DIR"

PROMPTS: dict[str, str] = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": 'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": 'Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ',
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
"""``config/dataset2prompt.json`` (English tasks), verbatim."""

MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "lcc": 64,
    "repobench-p": 64,
}
"""``config/dataset2maxlen.json`` (English tasks), verbatim."""

RAW_PROMPT = frozenset({"trec", "triviaqa", "samsum", "lcc", "repobench-p"})
"""``pred.py``: tasks prompted without the chat template."""
FIRST_LINE = frozenset({"trec", "triviaqa", "samsum"})
"""``eval.py``: tasks scored on the first line of the prediction only."""


# Metrics (metrics.py)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles (a, an, the), single spaces (the SQuAD rule)."""
    text = "".join(char for char in text.lower() if char not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    """Token F1 between the normalised answers."""
    predicted, reference = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    same = sum((Counter(predicted) & Counter(reference)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def rouge_score(prediction: str, ground_truth: str) -> float:
    """ROUGE-L F of the ``rouge`` package; 0 where it fails (empty text, recursion on long text),
    as the official bare ``except`` does."""
    try:
        return Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"]
    except Exception:  # noqa: BLE001 (the official bare except)
        return 0.0


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str]) -> float:
    """1/k when the reference class is among the k class names found in the prediction; names
    contained in the reference (and not equal to it) do not count."""
    matches = [name for name in all_classes if name in prediction]
    # Kept from the official code for equal scores: removing while iterating skips the next match.
    for name in matches:
        if name in ground_truth and name != ground_truth:
            matches.remove(name)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _share_equal(numbers: list[str], target: str) -> float:
    """Fraction of ``numbers`` equal to ``target`` (0 without numbers)."""
    return numbers.count(target) / len(numbers) if numbers else 0.0


def count_score(prediction: str, ground_truth: str) -> float:
    """Fraction of the numbers in the prediction that equal the reference count."""
    return _share_equal(re.findall(r"\d+", prediction), ground_truth)


def retrieval_score(prediction: str, ground_truth: str) -> float:
    """Fraction of the numbers in the prediction that equal N of the reference "Paragraph N"."""
    return _share_equal(re.findall(r"\d+", prediction), re.findall(r"Paragraph (\d+)", ground_truth)[0])


def code_sim_score(prediction: str, ground_truth: str) -> float:
    """Edit similarity of the first prediction line without ```` ` ````, ``#`` or ``//`` (the
    official fuzzywuzzy ``fuzz.ratio``: an integer percentage)."""
    lines = prediction.lstrip("\n").split("\n")
    line = next((line for line in lines if not any(mark in line for mark in ("`", "#", "//"))), "")
    return round(fuzz.ratio(line, ground_truth)) / 100


METRICS: dict[str, Callable[..., float]] = {
    **dict.fromkeys(
        ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"), qa_f1_score
    ),
    **dict.fromkeys(("gov_report", "qmsum", "multi_news", "samsum"), rouge_score),
    "trec": classification_score,
    "passage_count": count_score,
    "passage_retrieval_en": retrieval_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}
"""``eval.py``'s ``dataset2metric`` (English tasks)."""


# Data (shared with kvevict.bench.maths)


def local_folder(data_dir: Path | None, env: str) -> Path | None:
    """``data_dir``, else the folder named by the environment variable ``env``, else None."""
    if data_dir is not None:
        return Path(data_dir)
    value = os.environ.get(env)
    return Path(value) if value else None


def json_rows(path: Path) -> datasets.Dataset:
    """The rows of a JSON-lines file, read with ``datasets``' JSON builder."""
    return datasets.load_dataset("json", data_files=str(path), split="train")


def pick(total: int, count: int, seed: int) -> list[int]:
    """Indices of ``count`` of ``total`` rows: all when ``count >= total``, else a random subset
    drawn with ``seed``; in dataset order either way."""
    if count >= total:
        return list(range(total))
    return sorted(random.Random(seed).sample(range(total), count))


def hub_folder() -> Path:
    """The ``data`` folder of the hub's ``data.zip``, extracted next to the downloaded archive
    (once; later calls find it there)."""
    archive = Path(hf_hub_download(repo_id=HUB_REPO, filename=HUB_ARCHIVE, repo_type="dataset"))
    folder = archive.parent / "data"
    if not folder.is_dir():
        with tempfile.TemporaryDirectory(dir=archive.parent) as scratch, zipfile.ZipFile(archive) as zipped:
            zipped.extractall(scratch)
            with contextlib.suppress(OSError):  # a concurrent process extracted it first
                Path(scratch, "data").rename(folder)
    return folder


# Prompts


def fit_context(
    tokenizer: PreTrainedTokenizerBase, head: str, text: str, question: str, *, length: int, chat_template: bool
) -> str:
    """``head + text``, with ``text`` cut in the middle so that the prompt rendered by
    :func:`~kvevict.generation.split_prompt` has at most ``length`` tokens.

    ``pred.py``'s truncation: the first and the last ``length // 2`` prompt tokens are kept, each
    half decoded on its own; here the cut falls in ``text`` whatever the template's length, and is
    deepened by the overshoot of re-tokenising the decoded halves until the prompt fits.
    """
    ids = tokenizer(text, add_special_tokens=False).input_ids
    front: int | None = None  # context tokens kept at each end, once the prompt overflows
    back = 0
    kept = text
    while True:
        before, after = split_prompt(tokenizer, head + kept, question, chat_template=chat_template)
        excess = before.shape[-1] + after.shape[-1] - length
        if excess <= 0:
            return head + kept
        if front is None:
            half = length // 2
            front = min(len(ids), max(0, half - (before.shape[-1] - len(ids))))
            back = min(len(ids) - front, max(0, half - after.shape[-1]))
        elif front + back == 0:
            raise ValueError(f"the prompt without its context exceeds {length} tokens")
        else:
            take_back = min(back, excess // 2)
            take_front = min(front, excess - take_back)
            front, back = front - take_front, back - min(back, excess - take_front)
        kept = tokenizer.decode(ids[:front], skip_special_tokens=True) + tokenizer.decode(
            ids[len(ids) - back :], skip_special_tokens=True
        )


class LongBenchTask(Task):
    """One LongBench task: its official template, generation length and metric."""

    source = "hub"

    def __init__(self, dataset: str, data_dir: Path | None = None) -> None:
        self.dataset = dataset
        self.name = f"longbench_{dataset}"
        self.metric = METRICS[dataset].__name__
        self.data_dir = data_dir
        """Folder of ``<dataset>.jsonl`` files replacing the hub (else ``$KVEVICT_LONGBENCH_DIR``)."""

    def rows(self) -> datasets.Dataset:
        folder = local_folder(self.data_dir, DATA_DIR_ENV) or hub_folder()
        return json_rows(folder / f"{self.dataset}.jsonl")

    def samples(self, tokenizer: PreTrainedTokenizerBase, *, length: int, count: int, seed: int = 0) -> list[Sample]:
        """``count`` rows (see :func:`pick`), each prompt middle-truncated to ``length`` tokens."""
        rows = self.rows()
        head, rest = PROMPTS[self.dataset].split("{context}")
        chat_template = self.dataset not in RAW_PROMPT
        samples = []
        for index in pick(len(rows), count, seed):
            row = rows[index]
            question = rest.lstrip("\n").format(input=row["input"])
            context = fit_context(tokenizer, head, row["context"], question, length=length, chat_template=chat_template)
            samples.append(
                Sample(
                    task=self.name,
                    index=index,
                    context=context,
                    question=question,
                    answer_prefix="",
                    answers=tuple(row["answers"]),
                    max_new_tokens=MAX_NEW_TOKENS[self.dataset],
                    context_id=f"{self.name}/{hashlib.sha1(context.encode()).hexdigest()[:16]}",
                    metadata={
                        "_id": row["_id"],
                        "length": row["length"],
                        "all_classes": row["all_classes"],
                        "chat_template": chat_template,
                    },
                )
            )
        return samples

    def score(self, prediction: str, sample: Sample) -> float:
        """The best score over the reference answers (``eval.py``'s ``scorer``)."""
        if self.dataset in FIRST_LINE:
            prediction = prediction.lstrip("\n").split("\n")[0]
        metric = METRICS[self.dataset]
        if metric is classification_score:
            metric = partial(classification_score, all_classes=sample.metadata["all_classes"])
        return max((metric(prediction, answer) for answer in sample.answers), default=0.0)


TASKS: dict[str, Task] = {task.name: task for task in map(LongBenchTask, PROMPTS)}
