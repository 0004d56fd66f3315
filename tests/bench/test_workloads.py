"""Jobs of the throughput workloads: predicted ceilings against the real ones, what a start
holds at its peak, the long generations' token choice."""

from __future__ import annotations

import pytest
import torch

from kvevict.bench.runner import Setting
from kvevict.bench.workloads import Document, EssayTokens, Learned, Library, PromptJob, QuestionJob
from tests.conftest import prompt, tiny_model


@pytest.mark.parametrize(
    "setting", [Setting("full"), Setting("snapkv", 40), Setting("h2o", 40), Setting("tova", keep=0.5)]
)
def test_a_uniform_policys_predicted_ceiling_is_its_real_one(setting: Setting) -> None:
    model = tiny_model()
    job = PromptJob(model, prompt(90), setting, 20, Learned())
    predicted = job.predicted_ceiling()
    cache, _ = job.start()
    assert cache.row_ceiling(0, 19) == predicted


def test_a_questions_start_peak_is_its_own_pass_not_its_documents_prefill() -> None:
    """The first question compresses the document (its prefill is the peak); a later one holds a
    copy of the compressed document and its question, though the copy inherits the document's peaks."""
    model = tiny_model()
    library = Library(
        model, [Document(prompt(120), [prompt(6, seed=2), prompt(9, seed=3)])], Setting("snapkv", 40), Learned()
    )
    first, second = (QuestionJob(library, 0, question, 4) for question in range(2))
    cache, _ = first.start()
    layers = len(cache.eviction_layers)
    assert first.start_peak() == [cache.peak_entries()] * layers and cache.peak_entries() >= 120
    cache, _ = second.start()
    assert second.start_peak() == [40 + 9] * layers == [layer.rows[0].width for layer in cache.eviction_layers]
    assert cache.peak_entries() >= 120  # what the copy says of its life: the document's prefill


def test_essay_tokens_never_repeat_an_ngram_nor_end() -> None:
    choose = EssayTokens(banned={0}, size=3)
    history: list[int] = []
    logits = torch.zeros(1, 6)
    logits[0, 0] = 9.0  # the end of text: banned
    for _ in range(20):
        favourite = history[-1] % 5 + 1 if history else 1  # greedy alone would cycle 1 2 3 4 5 1 2 ...
        scores = logits.clone()
        scores[0, favourite] = 5.0
        scores[0, 1:] += torch.arange(5) * 0.01
        history.append(choose(scores, [history])[0])
    assert 0 not in history
    grams = [tuple(history[i : i + 3]) for i in range(len(history) - 2)]
    assert len(grams) == len(set(grams))
