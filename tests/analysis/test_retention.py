"""``kvevict analyze retention``: needle tokens located, ranks recorded, forcing keeps the needle."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvevict.analysis.retention import analyze_sample, needle_positions, probe_policy, recorded_scores, write_outputs
from kvevict.bench.tasks import get_task
from kvevict.cache import EvictionCache
from kvevict.generation import prefill, split_prompt
from kvevict.policies import make_policy
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def sample(tokenizer):
    return get_task("niah_single_2").samples(tokenizer, length=300, count=1)[0]


def test_needle_positions_cover_the_needle_sentence(tokenizer, sample) -> None:
    mask = needle_positions(tokenizer, sample)
    head, _ = split_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    text = tokenizer.decode(head[0][mask])
    assert "One of the special magic" in text and sample.answers[0] in text
    assert int(mask.sum()) < 40  # the sentence, not the haystack


@pytest.mark.parametrize("policy", ["snapkv", "kvzip"])
def test_forcing_keeps_the_needle_in_every_head_at_the_same_memory(tokenizer, sample, policy: str) -> None:
    model = tiny_model(vocab=len(tokenizer))
    needle = needle_positions(tokenizer, sample)
    head, _ = split_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    held = []
    for force in (False, True):
        base = make_policy(policy, tokenizer=tokenizer) if policy == "kvzip" else make_policy(policy)
        cache = EvictionCache(model, probe_policy(base, needle, force=force), keep=0.25)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prefill(model, head, cache)
        assert sorted(recorded_scores(cache)) == [0, 1]  # every layer's scores recorded
        held.append(cache.kv_bytes())
    wanted = needle.nonzero().flatten()
    for layer in cache.eviction_layers:
        real = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
        for h in range(layer.num_kv_heads):
            assert set(wanted.tolist()) <= set(layer.positions[0, h][real[0, h]].tolist())
    assert held[0] == held[1]


def test_analysis_reports_every_layer_and_head_and_writes_a_plot(tokenizer, sample, tmp_path) -> None:
    model = tiny_model(vocab=len(tokenizer))
    result = analyze_sample(model, tokenizer, sample, "snapkv[window=8]", 0.25, necessity=True)
    assert len(result.best_rank) == 2 and all(len(heads) == 2 for heads in result.best_rank)
    assert all(0 <= share <= 1 for heads in result.kept_share for share in heads)
    assert 0 <= result.score <= 1 and 0 <= result.score_forced <= 1
    paths = write_outputs([result], tmp_path)
    assert all(path.exists() for path in paths)


def test_needle_tasks_only(tokenizer) -> None:
    from kvevict.analysis.retention import run_retention

    with pytest.raises(ValueError, match="needle task"):
        run_retention(tiny_model(), tokenizer, "vt", "snapkv", 0.25)
