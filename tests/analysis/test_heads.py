"""Retrieval-head profiles: the argmax rule against a brute-force eager computation."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

import kvevict
from kvevict.analysis.heads import find_span, format_profile, head_profile, importance_matrix, retrieval_scores
from tests.conftest import prompt, tiny_model


def test_find_span_takes_the_last_occurrence() -> None:
    assert find_span([5, 1, 2, 9, 1, 2], [1, 2]) == range(4, 6)
    assert find_span([5, 1, 2], [2, 1]) is None


def test_retrieval_scores_match_argmax_of_the_full_attention_matrix() -> None:
    model = tiny_model(attn="eager")
    ids = prompt(60)
    span = range(20, 26)
    target = ids[0, 20:26].tolist()  # copy the "needle"
    scores = retrieval_scores(model, ids, target, span)
    # brute force: eager attention weights of each teacher-forced query
    hits = torch.zeros(2, 4)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=cache)
        fed = ids[:, -1:]
        for token in target:
            out = model(input_ids=fed, past_key_values=cache, output_attentions=True)
            for layer, weights in enumerate(out.attentions):
                for head, position in enumerate(weights[0, :, -1].argmax(dim=-1).tolist()):
                    hits[layer, head] += position in span and ids[0, position] == token
            fed = torch.tensor([[token]])
    torch.testing.assert_close(scores, hits / len(target))


@pytest.mark.slow
def test_profile_of_a_model_loads_into_headkv(tokenizer, tmp_path) -> None:
    model = tiny_model(vocab=len(tokenizer))
    profile = head_profile(model, tokenizer, samples=2, length=200)
    assert profile["samples"] >= 1 and set(profile["model"]) >= {"num_hidden_layers", "num_key_value_heads"}
    assert importance_matrix(profile).shape == (2, 4)
    assert "retrieval score" in format_profile(profile)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    policy = kvevict.make_policy("headkv", headkv={"profile": str(path)})
    cache = kvevict.EvictionCache(model, policy, budget=40)
    with torch.no_grad():
        model(input_ids=prompt(100), past_key_values=cache)
    assert max(cache.layer_lengths()) < 100
