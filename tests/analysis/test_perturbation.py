"""Attention-output perturbation against the full cache."""

from __future__ import annotations

import pytest
import torch

from kvevict.analysis.perturbation import (
    Perturbation,
    compare,
    first_token,
    format_comparison,
    plot_comparison,
    run_perturbation,
)
from tests.conftest import prompt, tiny_model


def test_head_outputs_are_the_attention_output_per_head() -> None:
    model = tiny_model()
    ids = prompt(50)
    captured = first_token(model, ids, None, None)
    assert captured.head_outputs.shape == (2, 4, 64)  # layers, query heads, hidden
    # the heads' contributions sum to the attention output (o_proj has no bias)
    outputs = []
    hook = model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda m, a, out: outputs.append(out))
    with torch.no_grad():
        model(input_ids=ids)
    hook.remove()
    torch.testing.assert_close(captured.head_outputs[1].sum(dim=0), outputs[0][0, -1], rtol=1e-4, atol=1e-5)
    unchanged = first_token(model, ids, "full", None)
    assert torch.equal(captured.head_outputs, unchanged.head_outputs)
    assert torch.equal(captured.final_hidden, unchanged.final_hidden)


def test_eviction_perturbs_and_a_budget_over_the_length_does_not() -> None:
    model = tiny_model()
    ids = prompt(120)
    reference = first_token(model, ids, None, None)
    assert torch.equal(first_token(model, ids, "snapkv", 500).head_outputs, reference.head_outputs)
    evicted = first_token(model, ids, "snapkv", 40)
    assert (evicted.head_outputs - reference.head_outputs).abs().sum() > 0


def test_compare_counts_heads_where_the_candidate_is_lower(tmp_path) -> None:
    result = Perturbation(
        policies=["a", "b"],
        budget=8,
        prompts=1,
        heads={"a": [[1.0, 2.0], [3.0, 4.0]], "b": [[0.5, 3.0], [1.0, 1.0]]},
        final={"a": 2.0, "b": 1.0},
    )
    comparison = compare(result, "a", "b")
    assert comparison["share_of_heads_lower"] == 0.75
    assert [row["share_lower"] for row in comparison["layers"]] == [0.5, 1.0]
    assert "75.0% of heads" in format_comparison(comparison)
    assert plot_comparison(result, comparison, tmp_path / "p.png").stat().st_size > 0


@pytest.mark.slow
def test_run_over_offline_prompts(tokenizer) -> None:
    model = tiny_model(vocab=len(tokenizer))
    result = run_perturbation(model, tokenizer, ["snapkv", "critical+snapkv"], 64, samples=2, length=200)
    assert result.prompts == 2
    assert torch.tensor(result.heads["snapkv"]).shape == (2, 4)
    assert all(value >= 0 for value in result.final.values())
