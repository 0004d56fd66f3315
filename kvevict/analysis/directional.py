"""``kvevict analyze directional``: the directional cost of eviction, per layer (MomentKV,
seed 003, Sec. 3, Figure 2, and the layer-wise NC error of Figure 3b).

For a query ``q`` of a head, with ``R`` the retained and ``E`` the evicted entries, the
full attention output decomposes exactly as ``f = w_R f_R + w_E f_E`` (Eq. 3). Measured:

- ``w_E = Z_E / (Z_R + Z_E)``, the evicted attention mass;
- ``cos(f_E, f_R)``, the angle between the evicted and retained sub-outputs;
- ``γ(θ) = ‖f_E − f_R‖ / ‖f‖`` (Eq. 7, the amplification: ``‖f − f_R‖/‖f‖ = w_E·γ``);
- the relative output error without NC, ``‖f − f_R‖/‖f‖``, and with NC,
  ``‖f − f̂‖/‖f‖`` where ``f̂`` is MomentKV's corrected output (Eq. 12) from the moment
  statistics of ``E``.

Protocol: each sample's context is prefilled under the policy at the budget (compressed
once, context-only), then its question tokens are the probe queries: at every eviction
layer their post-RoPE queries, the retained entries (causal among the question's own) and
the entries the prompt compression evicted give the quantities above. Each query head and
question token is one observation; a layer's value is the mean over them and the samples.
The question pass runs on the policy's own cache (for a policy with NC, on its corrected
stream); each layer's correction is applied to that layer's queries, so layers compare
alike. Attention rows here are ``question × n`` (a few dozen queries), never ``n × n``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvevict.bench.report import text_table
from kvevict.compat import with_cache
from kvevict.figures import pyplot, save_figure
from kvevict.moments import MomentStats, accumulate, nc_correct
from kvevict.signals import LogitSpec, as_spec, attention_logits

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from kvevict.bench.task import Sample

METRICS = ("evicted_mass", "cosine", "amplification", "error", "error_nc")


@dataclass
class LayerDirectional:
    """Per-observation sums of one layer (divide by ``observations`` for the means)."""

    layer: int
    observations: int = 0
    evicted_mass: float = 0.0
    cosine: float = 0.0
    amplification: float = 0.0
    error: float = 0.0
    error_nc: float = 0.0

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        self.observations += metrics["error"].numel()
        for name in METRICS:
            setattr(self, name, getattr(self, name) + float(metrics[name].double().sum()))

    def means(self) -> dict[str, float]:
        count = max(self.observations, 1)
        return {name: getattr(self, name) / count for name in METRICS}


def directional_metrics(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    evicted_keys: torch.Tensor,
    evicted_values: torch.Tensor,
    evicted: torch.Tensor,
    scaling: float,
    order: int = 1,
) -> dict[str, torch.Tensor]:
    """The quantities of Figure 2 / 3b for every query head and query, ``{name: [B, Hq, q]}``.

    ``query`` ``[B, Hq, q, d]`` sits at the end of the retained ``keys``/``values``
    ``[B, Hkv, n, d]`` (causal among its own entries); ``evicted`` ``[B, Hkv, m]`` flags the
    evicted entries among ``evicted_keys``/``evicted_values`` ``[B, Hkv, m, d]``, all visible.
    """
    b, hq = query.shape[:2]
    hkv = keys.shape[1]
    group = hq // hkv
    log_r = attention_logits(query, keys, scaling)
    log_e = attention_logits(query, evicted_keys, scaling, evicted, causal=False)
    z_r, z_e = log_r.logsumexp(-1), log_e.logsumexp(-1)
    f_r = log_r.softmax(-1) @ values.float().repeat_interleave(group, 1)
    f_e = log_e.softmax(-1) @ evicted_values.float().repeat_interleave(group, 1)
    w_e = torch.sigmoid(z_e - z_r)
    full = (1 - w_e)[..., None] * f_r + w_e[..., None] * f_e
    stats = accumulate(
        MomentStats.zeros(b, hkv, evicted_keys.shape[-1], evicted_values.shape[-1], order, query.device),
        evicted_keys,
        evicted_values,
        evicted,
    )
    corrected = nc_correct(f_r, z_r, query, stats, scaling)
    norm = full.norm(dim=-1).clamp(min=1e-12)
    return {
        "evicted_mass": w_e,
        "cosine": torch.nn.functional.cosine_similarity(f_e, f_r, dim=-1),
        "amplification": (f_e - f_r).norm(dim=-1) / norm,
        "error": (full - f_r).norm(dim=-1) / norm,
        "error_nc": (full - corrected).norm(dim=-1) / norm,
    }


def sample_prompts(tokenizer: PreTrainedTokenizerBase, samples: Sequence[Sample]) -> list[tuple[Tensor, Tensor]]:
    """``(context ids, question ids)`` of each sample (chat template applied)."""
    from kvevict.generation import split_prompt

    return [split_prompt(tokenizer, s.context, s.question, s.answer_prefix) for s in samples]


@torch.inference_mode()
def run_directional(
    model: PreTrainedModel,
    prompts: Sequence[tuple[Tensor, Tensor]],
    policy: str,
    budget: int,
    *,
    order: int = 1,
    progress: bool = True,
) -> list[LayerDirectional]:
    """Prefill each context under ``policy`` at ``budget``, probe with its question tokens."""
    from tqdm import tqdm

    from kvevict.cache import EvictionCache

    layers: dict[int, LayerDirectional] = {}
    for context, question in tqdm(prompts, desc="directional", unit="sample", disable=not progress):
        cache = EvictionCache(model, policy, budget=budget)
        passes = {layer.layer_idx: _record_passes(layer) for layer in cache.eviction_layers}
        model(input_ids=context.to(model.device), **with_cache(cache))
        cache.end_prompt()  # the question probes the compressed context
        model(input_ids=question.to(model.device), **with_cache(cache))
        if any(layer.valid is not None for layer in cache.eviction_layers):
            raise ValueError(
                f"policy {policy!r} gives heads different budgets; the directional analysis compares the same "
                "number of retained entries per head: use a policy without head-wise budgets (e.g. snapkv, h2o)"
            )
        for index, (prompt_pass, probe) in passes.items():
            retained = cache.layers[index].positions
            evicted = ~(prompt_pass["positions"][..., :, None] == retained[..., None, :]).any(-1)
            if not bool(evicted.any()):
                raise ValueError(
                    f"policy {policy!r} evicted nothing from a {context.shape[1]}-token context at budget {budget}: "
                    "use a policy that compresses the prompt and a budget below the context length"
                )
            metrics = directional_metrics(
                probe["query"],
                probe["keys"],
                probe["values"],
                prompt_pass["keys"],
                prompt_pass["values"],
                evicted,
                probe["scaling"],
                order,
            )
            layers.setdefault(index, LayerDirectional(index)).add(metrics)
    return [layers[index] for index in sorted(layers)]


def _record_passes(layer: object) -> list[dict]:
    """The two passes of ``layer`` (context, question): query and entries before any eviction."""
    passes, original = [], layer.after_attention

    def spy(
        query: torch.Tensor,
        scaling: float | LogitSpec,
        module: torch.nn.Module | None = None,
        row: torch.Tensor | None = None,
    ) -> None:
        passes.append(
            {
                "query": query,
                "scaling": as_spec(scaling).scaling,
                "keys": layer.keys,
                "values": layer.values,
                "positions": layer.positions,
            }
        )
        original(query, scaling, module, row)

    layer.after_attention = spy
    return passes


def format_directional(layers: list[LayerDirectional], title: str = "") -> str:
    """Per-layer table plus the network mean and how many layers NC improves."""
    header = ["layer", "w_E", "cos(f_E,f_R)", "gamma", "err", "err+NC", "reduction"]
    rows, means = [], [layer.means() for layer in layers]
    for layer, m in zip(layers, means):
        rows.append([str(layer.layer), *_cells(m)])
    average = {name: sum(m[name] for m in means) / len(means) for name in METRICS}
    rows.append(["mean", *_cells(average)])
    better = sum(m["error_nc"] < m["error"] for m in means)
    lines = [title] if title else []
    lines += text_table(header, rows)
    lines += ["", f"NC lowers the relative attention-output error in {better} of {len(layers)} layers"]
    return "\n".join(lines)


def _cells(m: dict[str, float]) -> list[str]:
    reduction = 1 - m["error_nc"] / m["error"] if m["error"] > 0 else 0.0
    return [
        f"{m['evicted_mass']:.4f}",
        f"{m['cosine']:+.3f}",
        f"{m['amplification']:.3f}",
        f"{m['error']:.4f}",
        f"{m['error_nc']:.4f}",
        f"{reduction:+.1%}",
    ]


def plot_directional(layers: list[LayerDirectional], path: str | Path, title: str = "") -> Path:
    """Three panels per layer: ``w_E``; ``cos(f_E, f_R)``; relative error without / with NC."""
    plt = pyplot()

    index = [layer.layer for layer in layers]
    means = [layer.means() for layer in layers]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].bar(index, [m["evicted_mass"] for m in means], color="tab:blue")
    axes[0].set_title("evicted mass $w_E$")
    axes[1].bar(index, [m["cosine"] for m in means], color="tab:purple")
    axes[1].axhline(0, color="black", linewidth=0.8)
    axes[1].set_title(r"$\cos(f_E, f_R)$")
    width = 0.4
    axes[2].bar(
        [i - width / 2 for i in index], [m["error"] for m in means], width, label="renormalised", color="tab:red"
    )
    axes[2].bar([i + width / 2 for i in index], [m["error_nc"] for m in means], width, label="NC", color="tab:green")
    axes[2].set_title(r"relative error $\|f - \hat f\| / \|f\|$")
    axes[2].legend(frameon=False)
    for axis in axes:
        axis.set_xlabel("layer")
        axis.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    return save_figure(figure, path)


def write_directional(layers: list[LayerDirectional], config: dict[str, object], directory: str | Path) -> Path:
    """Write the configuration and per-layer means to ``DIRECTORY/directional.json``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "directional.json"
    payload = {
        **config,
        "layers": [{"layer": layer.layer, "observations": layer.observations, **layer.means()} for layer in layers],
    }
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return path
