"""``kvevict analyze retention``: where a scorer ranks a needle, and where it must be kept.

For a RULER needle task, context-only: the context is compressed under a policy while a
probe (:class:`NeedleProbe`, the policy's selector wrapped) records every layer's selection
scores. For each layer and KV head: the best rank of the needle's tokens among the head's
free entries (0 = the top score; protected entries do not count), and the share of the
needle's tokens the head kept. Then the answer is generated three ways: as compressed, with
the needle forced into every head (same budget: it displaces the lowest kept entries), and,
with ``necessity``, with the needle forced everywhere except one layer at a time, which
names the layers that have to keep it for the answer to survive.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvevict.bench.task import Sample
from kvevict.bench.tasks import get_task
from kvevict.budgets import descending_ranks
from kvevict.cache import EvictionCache
from kvevict.figures import pyplot, save_figure
from kvevict.generation import answer, split_prompt
from kvevict.policies import Policy, make_policy
from kvevict.policies.base import Ranking, Selector
from kvevict.signals import Signals

if TYPE_CHECKING:
    from kvevict.cache import EvictionLayer


class NeedleProbe(Selector):
    """The selector of a probed policy (:func:`probe_policy`): records each layer's selection
    scores at its eviction (in the cache, :func:`recorded_scores`) and, with ``force``, ranks
    the ``needle`` positions (a bool ``[n]`` over the prompt) first in every layer but
    ``skip_layer``, then lets the policy's own selector choose. Each head keeps as many
    entries as without forcing (the allocator counted them from the unforced scores): the
    needle displaces the lowest kept entries."""

    name = "probe"
    summary = "records selection scores; optionally forces the needle into chosen layers (analysis only)"
    by_top_scores = True

    def __init__(self, inner: Selector, needle: torch.Tensor, *, force: bool = False, skip_layer: int | None = None):
        super().__init__()
        self.inner = inner
        self.needle = needle
        self.force = force
        self.skip_layer = skip_layer

    def keep(self, layer: EvictionLayer, signals: Signals, ranking: Ranking) -> torch.Tensor:
        scores = ranking.scores
        self.shared(layer.owner)[str(layer.layer_idx)] = scores[0].detach().clone()
        if self.force and layer.layer_idx != self.skip_layer:
            inside = layer.positions < self.needle.shape[0]
            needle = self.needle.to(layer.positions.device)[layer.positions.clamp(max=self.needle.shape[0] - 1)]
            scores = scores.masked_fill(needle & inside, float("inf"))
        return self.inner.keep(layer, signals, replace(ranking, scores=scores))


def probe_policy(policy: Policy, needle: torch.Tensor, *, force: bool = False, skip_layer: int | None = None) -> Policy:
    """A copy of ``policy`` whose selection goes through a :class:`NeedleProbe` (the policy's
    own selector still chooses and keeps its state); refused unless it selects by top scores."""
    if not policy.selects_by_top_scores:
        raise ValueError(f"analyze retention needs a policy that selects by top scores; {policy.name} does not")
    probed = copy.deepcopy(policy)
    probed.selector = NeedleProbe(probed.selector, needle, force=force, skip_layer=skip_layer)
    return probed


def recorded_scores(cache: EvictionCache) -> dict[int, torch.Tensor]:
    """Layer index → the selection scores ``[Hkv, n]`` (first row) a probed policy recorded."""
    recorded = NeedleProbe.shared(cache.policy.selector, cache)
    return {int(key): value for key, value in recorded.items()}


def needle_positions(tokenizer: PreTrainedTokenizerBase, sample: Sample) -> torch.Tensor:
    """Bool ``[n]`` over the context's prompt tokens (as :func:`split_prompt` makes them): the
    tokens of every needle sentence whose value is one of the sample's answers."""
    head, _ = split_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    pieces = [tokenizer.decode([token], skip_special_tokens=False) for token in head[0].tolist()]
    text = "".join(pieces)
    spans = []
    for value in sample.answers:
        end = text.find(value)
        if end < 0:
            raise ValueError(f"answer {value!r} is not in the context of {sample.task} sample {sample.index}")
        start = text.rfind("One of the special magic", 0, end)
        spans.append((start if start >= 0 else end, end + len(value)))
    mask = torch.zeros(head.shape[-1], dtype=torch.bool)
    offset = 0
    for index, piece in enumerate(pieces):
        if any(offset < stop and offset + len(piece) > start for start, stop in spans):
            mask[index] = True
        offset += len(piece)
    return mask


@dataclass
class Retention:
    """The retention of one sample's needle under one policy and budget."""

    task: str
    index: int
    policy: str
    keep: float
    needle_tokens: int
    prompt_tokens: int
    best_rank: list[list[int]]
    """Per layer and KV head: best rank of a needle token among the head's free entries
    (0 = top score; -1: a needle token is protected)."""
    kept_share: list[list[float]]
    """Per layer and KV head: share of the needle's tokens the head kept."""
    score: float
    """The task's score of the answer as compressed."""
    score_forced: float
    """The score with the needle forced into every head."""
    necessary_layers: list[int] = field(default_factory=list)
    """Layers without which (needle forced everywhere else) the answer fails (``necessity``)."""


def _ranks(scores: torch.Tensor, needle: torch.Tensor) -> list[int]:
    """Best rank among a layer's heads' free entries of the needle tokens, per head."""
    free = scores.isfinite()
    ranks = descending_ranks(scores.masked_fill(~free, float("-inf")))
    out = []
    for head in range(scores.shape[0]):
        if bool((scores[head, : needle.shape[0]][needle]).isposinf().any()):
            out.append(-1)
        else:
            out.append(int(ranks[head, : needle.shape[0]][needle].min()))
    return out


def _run(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sample: Sample,
    policy: str,
    keep: float,
    needle: torch.Tensor,
    **probe: object,
) -> tuple[EvictionCache, float]:
    cache = EvictionCache(model, probe_policy(make_policy(policy), needle, **probe), keep=keep)
    reply = answer(
        model,
        tokenizer,
        sample.context,
        sample.question,
        answer_prefix=sample.answer_prefix,
        cache=cache,
        max_new_tokens=sample.max_new_tokens,
    )
    cache.close()
    return cache, get_task(sample.task).score(reply, sample)


@torch.inference_mode()
def analyze_sample(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sample: Sample,
    policy: str,
    keep: float,
    *,
    necessity: bool = False,
) -> Retention:
    """The retention of ``sample``'s needle under ``policy`` at ``keep`` (context-only)."""
    needle = needle_positions(tokenizer, sample)
    cache, score = _run(model, tokenizer, sample, policy, keep, needle)
    scores = recorded_scores(cache)
    best, kept = [], []
    for layer in cache.eviction_layers:
        best.append(_ranks(scores[layer.layer_idx], needle))
        real = layer.valid[0] if layer.valid is not None else torch.ones_like(layer.positions[0], dtype=torch.bool)
        held = [set(layer.positions[0, h][real[h]].tolist()) for h in range(layer.num_kv_heads)]
        wanted = needle.nonzero().flatten().tolist()
        kept.append([sum(p in heads for p in wanted) / len(wanted) for heads in held])
    _, forced = _run(model, tokenizer, sample, policy, keep, needle, force=True)
    necessary = []
    if necessity and forced > 0:
        for index in range(len(cache.eviction_layers)):
            _, without = _run(model, tokenizer, sample, policy, keep, needle, force=True, skip_layer=index)
            if without < forced:
                necessary.append(index)
    return Retention(
        sample.task,
        sample.index,
        policy,
        keep,
        int(needle.sum()),
        needle.shape[0],
        best,
        kept,
        score,
        forced,
        necessary,
    )


def run_retention(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: str,
    policy: str,
    keep: float,
    *,
    samples: int = 1,
    length: int = 2048,
    seed: int = 0,
    necessity: bool = False,
) -> list[Retention]:
    if not task.startswith("niah"):
        raise ValueError(f"analyze retention needs a needle task (niah_*), got {task!r}")
    chosen = get_task(task).samples(tokenizer, length=length, count=samples, seed=seed)
    return [analyze_sample(model, tokenizer, sample, policy, keep, necessity=necessity) for sample in chosen]


def write_outputs(results: list[Retention], out: str | Path) -> list[Path]:
    """``retention.json`` and ``retention.png`` (layers × KV heads: kept share, best rank)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "retention.json"
    data.write_text(json.dumps([asdict(r) for r in results], indent=1))
    plt = pyplot()
    figure, axes = plt.subplots(len(results), 2, figsize=(8, 6 * len(results)), squeeze=False)
    for row, result in zip(axes, results):
        kept = torch.tensor(result.kept_share)
        ranks = torch.tensor(result.best_rank, dtype=torch.float).clamp(min=0) / result.prompt_tokens
        for ax, values, title, cmap in (
            (row[0], kept, "share of needle tokens kept", "Greens"),
            (row[1], ranks, "best needle rank / prompt length", "Reds_r"),
        ):
            image = ax.imshow(values.T, aspect="auto", cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
            ax.set_xlabel("layer")
            ax.set_ylabel("KV head")
            for layer in result.necessary_layers:
                ax.axvline(layer, color="black", linewidth=0.8)
            ax.set_title(f"{result.task}#{result.index} {result.policy} keep {result.keep}\n{title}", fontsize=8)
            figure.colorbar(image, ax=ax)
    return [data, save_figure(figure, out / "retention.png")]


def format_summary(results: list[Retention]) -> str:
    lines = ["sample  needle-tokens  heads-keeping-all  heads-keeping-any  score  score-forced  necessary-layers"]
    for r in results:
        shares = [s for layer in r.kept_share for s in layer]
        lines.append(
            f"{r.task}#{r.index}  {r.needle_tokens}  {sum(s == 1 for s in shares)}/{len(shares)}  "
            f"{sum(s > 0 for s in shares)}/{len(shares)}  {r.score:.2f}  {r.score_forced:.2f}  "
            f"{','.join(map(str, r.necessary_layers)) or '-'}"
        )
    return "\n".join(lines)
