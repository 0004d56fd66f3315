"""``kvevict analyze directional``: MomentKV's per-layer directional analysis (seed 003, Fig. 2 / 3b)."""

from __future__ import annotations

import json

import torch

from kvevict.analysis.directional import (
    LayerDirectional,
    directional_metrics,
    format_directional,
    plot_directional,
    run_directional,
    write_directional,
)
from tests.conftest import prompt, tiny_model

B, HKV, G, D = 1, 2, 2, 8
SCALING = D**-0.5


def _entries(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(B, HKV, n, D, generator=generator), torch.randn(B, HKV, n, D, generator=generator)


def test_metrics_decompose_the_full_output_exactly() -> None:
    keys, values = _entries(6, 0)  # retained, the last 3 are the queries' own entries
    old_keys, old_values = _entries(10, 1)
    evicted = torch.zeros(B, HKV, 10, dtype=torch.bool)
    evicted[..., 2:8] = True
    query = torch.randn(B, HKV * G, 3, D, generator=torch.Generator().manual_seed(2)) * 2
    metrics = directional_metrics(query, keys, values, old_keys, old_values, evicted, SCALING)
    # brute force: one softmax over evicted ∪ retained (causal among the last 3)
    every_key = torch.cat([old_keys[:, :, 2:8], keys], 2).repeat_interleave(G, 1)
    every_value = torch.cat([old_values[:, :, 2:8], values], 2).repeat_interleave(G, 1)
    logits = query @ every_key.transpose(-1, -2) * SCALING
    logits = logits.masked_fill(torch.arange(12)[None, :] > torch.arange(9, 12)[:, None], float("-inf"))
    attention = logits.softmax(-1)
    full = attention @ every_value
    retained_logits = logits[..., 6:]
    f_r = retained_logits.softmax(-1) @ values.repeat_interleave(G, 1)
    f_e = logits[..., :6].softmax(-1) @ old_values[:, :, 2:8].repeat_interleave(G, 1)
    torch.testing.assert_close(metrics["evicted_mass"], attention[..., :6].sum(-1))
    torch.testing.assert_close(metrics["error"], (full - f_r).norm(dim=-1) / full.norm(dim=-1))
    torch.testing.assert_close(metrics["cosine"], torch.cosine_similarity(f_e, f_r, dim=-1))
    # Eq. 7: relative error = w_E · γ(θ)
    torch.testing.assert_close(metrics["error"], metrics["evicted_mass"] * metrics["amplification"])
    assert all(value.shape == (B, HKV * G, 3) for value in metrics.values())


def test_nc_error_vanishes_for_one_cluster_of_evicted_keys() -> None:
    keys, values = _entries(4, 3)
    old_keys, old_values = _entries(8, 4)
    old_keys[:] = old_keys[:, :, :1]  # identical evicted keys: the moment estimate is exact
    evicted = torch.ones(B, HKV, 8, dtype=torch.bool)
    query = torch.randn(B, HKV * G, 2, D, generator=torch.Generator().manual_seed(5)) * 2
    metrics = directional_metrics(query, keys, values, old_keys, old_values, evicted, SCALING)
    assert metrics["error_nc"].max() < 1e-5 < metrics["error"].min()


def test_run_on_a_tiny_model_reports_every_layer(tmp_path) -> None:
    model = tiny_model()
    prompts = [(prompt(96, seed=s), prompt(5, seed=s + 10)) for s in (1, 2)]
    layers = run_directional(model, prompts, "snapkv", 40, progress=False)
    assert [layer.layer for layer in layers] == [0, 1]
    assert all(layer.observations == 2 * 4 * 5 for layer in layers)  # samples × query heads × question tokens
    for layer in layers:
        means = layer.means()
        assert 0 < means["evicted_mass"] < 1 and -1 <= means["cosine"] <= 1 and means["error"] > 0
    text = format_directional(layers, "tiny")
    assert "NC lowers the relative attention-output error in" in text and "mean" in text
    summary = json.loads(write_directional(layers, {"policy": "snapkv"}, tmp_path).read_text())
    assert summary["policy"] == "snapkv" and len(summary["layers"]) == 2
    assert plot_directional(layers, tmp_path / "d.png").stat().st_size > 0


def test_format_counts_the_layers_nc_improves() -> None:
    better = LayerDirectional(0, 1, 0.1, 0.0, 1.0, 0.1, 0.05)
    worse = LayerDirectional(1, 1, 0.1, 0.0, 1.0, 0.1, 0.2)
    text = format_directional([better, worse])
    assert "in 1 of 2 layers" in text and "+50.0%" in text and "-100.0%" in text
