"""``kvevict analyze perturbation``: the attention-output perturbation of eviction policies
(CriticalKV, seed 004, Sec. 4.5, Figures 4–6).

For each offline prompt (RULER tasks, query-aware: everything but the last prompt token is
compressed), the first decoded token's pass is run with a full cache and under each
policy. The perturbation of query head ``h`` of layer ``ℓ`` is the L1 distance between its
contributions to the attention output, ``‖(o_h − ô_h) W_O[:, h·d:(h+1)·d]ᵀ‖₁`` (the head's
output projected by its slice of ``W_O``: the quantity CriticalKV bounds, ``‖(A − A′)VW_O‖₁``);
the final hidden state's L1 distance is reported too. Perturbations accumulate across layers, as in
the paper: every layer sees the hidden states its own evicted predecessors produced.

The comparison ``A`` vs ``B`` reports per layer the mean perturbation of each and the share
of heads where ``B`` is lower (averaged over prompts first), and a plot.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from kvevict.bench.report import text_table
from kvevict.compat import with_cache
from kvevict.figures import pyplot, save_figure

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from kvevict.policies import Policy

DEFAULT_TASKS = ("niah_single_2", "niah_multikey_1", "vt", "fwe")


@dataclass
class FirstToken:
    """What the first decoded token's pass produced."""

    head_outputs: torch.Tensor
    """Each query head's contribution to its layer's attention output (its output projected
    by its slice of ``W_O``), ``[L, Hq, hidden]`` fp32."""
    final_hidden: torch.Tensor
    """The last hidden state (after the final norm), ``[hidden]`` fp32."""


@torch.inference_mode()
def first_token(
    model: PreTrainedModel, ids: torch.Tensor, policy: str | Policy | None, budget: int | None
) -> FirstToken:
    """Compress ``ids[:, :-1]`` under ``policy`` (None: a full cache), then run the last
    prompt token and capture every layer's per-head attention output."""
    from transformers import DynamicCache

    from kvevict.cache import EvictionCache

    cache = DynamicCache() if policy is None else EvictionCache(model, policy, budget=budget)
    ids = ids.to(model.device)
    model(input_ids=ids[:, :-1], **with_cache(cache))
    outputs: list[torch.Tensor] = []
    blocks = model.model.layers
    hooks = [
        block.self_attn.o_proj.register_forward_pre_hook(lambda _, args: outputs.append(args[0][0, -1].float()))
        for block in blocks
    ]
    try:
        out = model(input_ids=ids[:, -1:], **with_cache(cache), output_hidden_states=True)
    finally:
        for hook in hooks:
            hook.remove()
    heads = blocks[0].self_attn.config.num_attention_heads
    per_head = torch.stack(outputs).view(len(blocks), heads, -1)  # [L, Hq, d]
    d = per_head.shape[-1]
    contributions = torch.stack(
        [
            torch.stack(
                [per_head[i, h] @ block.self_attn.o_proj.weight[:, h * d : (h + 1) * d].float().T for h in range(heads)]
            )
            for i, block in enumerate(blocks)
        ]
    )
    return FirstToken(contributions, out.hidden_states[-1][0, -1].float())


@dataclass
class Perturbation:
    """Mean L1 perturbation over prompts, per policy."""

    policies: list[str]
    budget: int
    prompts: int
    heads: dict[str, list[list[float]]]
    """Policy → ``[L][Hq]`` mean ``‖o − ô‖₁`` of each query head."""
    final: dict[str, float]
    """Policy → mean ``‖h − ĥ‖₁`` of the final hidden state."""

    def matrix(self, policy: str) -> torch.Tensor:
        return torch.tensor(self.heads[policy])


def run_perturbation(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    policies: list[str],
    budget: int,
    *,
    samples: int = 8,
    length: int = 1024,
    tasks: tuple[str, ...] = DEFAULT_TASKS,
    seed: int = 0,
) -> Perturbation:
    """Perturbation of every policy against the full cache over ``samples`` prompts drawn
    round-robin from ``tasks``."""
    from kvevict.bench.tasks import get_task
    from kvevict.generation import split_prompt

    per_task = -(-samples // len(tasks))
    prompts = [
        sample
        for name in tasks
        for sample in get_task(name).samples(tokenizer, length=length, count=per_task, seed=seed)
    ]
    prompts = sorted(prompts, key=lambda s: s.index)[:samples]  # round-robin over tasks
    heads = {name: torch.zeros(0) for name in policies}
    final = dict.fromkeys(policies, 0.0)
    for sample in tqdm(prompts, desc="prompts"):
        head, tail = split_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
        ids = torch.cat([head, tail], dim=-1)
        reference = first_token(model, ids, None, None)
        for name in policies:
            compressed = first_token(model, ids, name, budget)
            distance = (compressed.head_outputs - reference.head_outputs).abs().sum(dim=-1)
            heads[name] = distance if heads[name].numel() == 0 else heads[name] + distance
            final[name] += float((compressed.final_hidden - reference.final_hidden).abs().sum())
    return Perturbation(
        policies=list(policies),
        budget=budget,
        prompts=len(prompts),
        heads={name: (total / len(prompts)).tolist() for name, total in heads.items()},
        final={name: total / len(prompts) for name, total in final.items()},
    )


def compare(result: Perturbation, baseline: str, candidate: str) -> dict:
    """Share of heads (overall and per layer) where ``candidate`` perturbs less than ``baseline``."""
    a, b = result.matrix(baseline), result.matrix(candidate)
    lower = b < a
    return {
        "baseline": baseline,
        "candidate": candidate,
        "share_of_heads_lower": float(lower.float().mean()),
        "layers": [
            {
                "layer": layer,
                baseline: float(a[layer].mean()),
                candidate: float(b[layer].mean()),
                "share_lower": float(lower[layer].float().mean()),
            }
            for layer in range(a.shape[0])
        ],
        "final_hidden": {baseline: result.final[baseline], candidate: result.final[candidate]},
    }


def format_comparison(comparison: dict) -> str:
    base, cand = comparison["baseline"], comparison["candidate"]
    rows = [
        [
            str(row["layer"]),
            f"{row[base]:.4f}",
            f"{row[cand]:.4f}",
            f"{100 * (1 - row[cand] / row[base]):+.1f}%" if row[base] else "-",
            f"{100 * row['share_lower']:.0f}%",
        ]
        for row in comparison["layers"]
    ]
    final = comparison["final_hidden"]
    return "\n".join(text_table(["layer", f"L1 {base}", f"L1 {cand}", "reduction", "heads lower"], rows)) + (
        f"\n{cand} lowers the attention-output perturbation in {100 * comparison['share_of_heads_lower']:.1f}% of "
        f"heads; final hidden state L1: {base} {final[base]:.3f}, {cand} {final[cand]:.3f}"
    )


def write_result(result: Perturbation, comparisons: list[dict], directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "perturbation.json"
    path.write_text(json.dumps({**asdict(result), "comparisons": comparisons}, indent=1))
    return path


def plot_comparison(result: Perturbation, comparison: dict, path: str | Path) -> Path:
    """Left: mean perturbation per layer of both policies; right: per-head reduction."""
    plt = pyplot()

    base, cand = comparison["baseline"], comparison["candidate"]
    a, b = result.matrix(base), result.matrix(cand)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    layers = range(a.shape[0])
    left.plot(layers, a.mean(dim=1), marker="o", label=base)
    left.plot(layers, b.mean(dim=1), marker="o", label=cand)
    left.set_xlabel("layer")
    left.set_ylabel("mean L1 perturbation of head outputs")
    left.set_yscale("log")
    left.legend()
    reduction = (1 - b / a.clamp(min=1e-12)).clamp(-1, 1)
    image = right.imshow(reduction.numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
    right.set_xlabel("query head")
    right.set_ylabel("layer")
    right.set_title(f"1 − {cand} / {base} (blue: {cand} lower)")
    fig.colorbar(image, ax=right)
    fig.suptitle(f"first decoded token, budget {result.budget}, {result.prompts} prompts")
    return save_figure(fig, path)
