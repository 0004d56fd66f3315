"""``kvevict analyze heads``: a retrieval-head profile of any model, for HeadKV budgets.

Retrieval-head scoring (Wu et al., 2024, "Retrieval Head Mechanistically Explains
Long-Context Factuality"), the profile HeadKV allocates by: a needle (a 7-digit number)
sits in an essay haystack (RULER ``niah_single_2``, offline); after the question the
model is teacher-forced to copy it. At every copied token, a query head *retrieves* when
its strongest attention (argmax over the cache) lands inside the needle, on the very token
being copied. A head's score for a prompt is the share of copied tokens it retrieved.

The attention rows come from kvevict's own attention path (the last query's row, no
``output_attentions``), so any supported model and kernel works. The profile is JSON:
``{"model": fingerprint, "heads": {"layer-head": [score per prompt]}}``, the format
:class:`~kvevict.policies.allocation.HeadKV` loads (HeadKV's own files, a bare mapping,
load too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from kvevict.bench.report import text_table
from kvevict.compat import with_cache
from kvevict.figures import pyplot, save_figure
from kvevict.policies.allocation import model_fingerprint
from kvevict.policies.base import Method
from kvevict.signals import NOTHING, Phase, Regime, Requirements, Signals

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from kvevict.cache import EvictionCache, EvictionLayer

TASK = "niah_single_2"
NEVER_EVICT = 2**62


class ArgmaxProbe(Method):
    """Records, at every decode pass, where each query head attends most (never evicts)."""

    name = "argmax-probe"
    summary = "records each query head's argmax attention at decode (analysis only)"
    regimes = ("decode",)
    evicts = False

    def requirements(self, phase: Phase, evicting: bool, regime: Regime) -> Requirements:
        return Requirements(last_query_attention=True) if phase == "decode" else NOTHING

    def observe(self, layer: EvictionLayer, signals: Signals) -> None:
        if signals.last_query_attention is not None:
            strongest = signals.last_query_attention[0].argmax(dim=-1)  # [Hq] cache indexes
            self.argmax(layer.owner)[layer.layer_idx] = layer.positions[0, 0].gather(0, strongest)  # all heads

    def argmax(self, cache: EvictionCache) -> dict[int, torch.Tensor]:
        """Layer index → ``[Hq]`` position of the strongest attention of the cache's last pass."""
        return self.shared(cache).setdefault("argmax", {})


def find_span(haystack: list[int], needle: list[int]) -> range | None:
    """Where ``needle`` occurs in ``haystack`` (the last occurrence), if it does."""
    for start in range(len(haystack) - len(needle), -1, -1):
        if haystack[start : start + len(needle)] == needle:
            return range(start, start + len(needle))
    return None


@torch.inference_mode()
def retrieval_scores(model: PreTrainedModel, prompt_ids: torch.Tensor, target: list[int], span: range) -> torch.Tensor:
    """Share of the ``target`` tokens each query head retrieved from ``span``, ``[L, Hq]``."""
    from kvevict.cache import EvictionCache

    cache = EvictionCache(model, ArgmaxProbe(), budget=NEVER_EVICT)
    probe: ArgmaxProbe = cache.policy.method
    ids = prompt_ids.to(model.device)
    model(input_ids=ids[:, :-1], **with_cache(cache))
    config = model.config.get_text_config(decoder=True)
    hits = torch.zeros(config.num_hidden_layers, config.num_attention_heads)
    fed = ids[:, -1:]
    prompt = ids[0].tolist()
    for token in target:
        model(input_ids=fed, **with_cache(cache))  # its query predicts `token`
        for layer, positions in probe.argmax(cache).items():
            for head, position in enumerate(positions.tolist()):
                hits[layer, head] += int(position in span and prompt[position] == token)
        fed = torch.tensor([[token]], device=model.device)
    return hits / len(target)


def head_profile(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, samples: int = 8, length: int = 1024, seed: int = 0
) -> dict:
    """The retrieval-head profile of ``model`` over ``samples`` offline haystacks."""
    from kvevict.bench.tasks import get_task
    from kvevict.generation import split_prompt

    config = model.config.get_text_config(decoder=True)
    heads: dict[str, list[float]] = {
        f"{layer}-{head}": [] for layer in range(config.num_hidden_layers) for head in range(config.num_attention_heads)
    }
    used = 0
    for sample in tqdm(get_task(TASK).samples(tokenizer, length=length, count=samples, seed=seed), desc="haystacks"):
        head, tail = split_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
        prompt_ids = torch.cat([head, tail], dim=-1)
        needle = tokenizer(sample.answers[0], add_special_tokens=False).input_ids
        span = find_span(head[0].tolist(), needle)
        if span is None:  # the needle tokenizes differently inside the essay: nothing to copy from
            continue
        scores = retrieval_scores(model, prompt_ids, needle, span)
        for (layer, query_head), value in zip(
            ((layer, h) for layer in range(scores.shape[0]) for h in range(scores.shape[1])), scores.flatten().tolist()
        ):
            heads[f"{layer}-{query_head}"].append(value)
        used += 1
    if used == 0:
        raise ValueError(f"no haystack had its needle as a token span of the context ({samples} tried)")
    return {
        "model": model_fingerprint(config),
        "method": "retrieval",
        "task": TASK,
        "length": length,
        "samples": used,
        "heads": heads,
    }


def importance_matrix(profile: dict) -> torch.Tensor:
    """Mean score per (layer, query head), ``[L, Hq]``."""
    keys = [tuple(map(int, key.split("-"))) for key in profile["heads"]]
    layers, heads = max(k[0] for k in keys) + 1, max(k[1] for k in keys) + 1
    matrix = torch.zeros(layers, heads)
    for (layer, head), values in zip(keys, profile["heads"].values()):
        matrix[layer, head] = sum(values) / len(values) if values else 0.0
    return matrix


def format_profile(profile: dict, top: int = 10) -> str:
    """The strongest retrieval heads as a table."""
    matrix = importance_matrix(profile)
    order = matrix.flatten().argsort(descending=True)[:top].tolist()
    rows = [[f"{i // matrix.shape[1]}", f"{i % matrix.shape[1]}", f"{matrix.flatten()[i]:.3f}"] for i in order]
    summary = (
        f"{profile['samples']} haystacks of {profile['length']} tokens; heads with any retrieval: "
        f"{int((matrix > 0).sum())}/{matrix.numel()}"
    )
    return "\n".join([summary, *text_table(["layer", "head", "retrieval score"], rows)])


def write_profile(profile: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=1))
    return path


def plot_profile(profile: dict, path: str | Path) -> Path:
    """A layer × head heatmap of the retrieval scores."""
    plt = pyplot()

    matrix = importance_matrix(profile)
    fig, ax = plt.subplots(figsize=(1 + 0.4 * matrix.shape[1], 1 + 0.22 * matrix.shape[0]))
    image = ax.imshow(matrix.numpy(), aspect="auto", cmap="viridis")
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_title("retrieval score")
    fig.colorbar(image, ax=ax)
    return save_figure(fig, path)
