"""``kvevict analyze importance``: counterfactual importance labels and the per-layer Spearman ρ
of the hidden-state change against them (EpiKV, seed 000, §3.4 and Appendices A, C).

Per sample:

1. A seeded arithmetic word problem (offline) is put in the chat template with an instruction to
   think step by step and finish with ``Answer: N``; the model answers greedily (full cache).
2. The answer boundary is the start of the last ``Answer`` of the generation (fallback: the last
   ``answer_tokens`` generated tokens); the reasoning span is every generated token before it.
3. Occlusion: windows of 32 tokens with stride 16 slide over the span (each interior token is
   covered twice); a window's tokens are replaced by the padding id (same context length, so the
   label measures content, not position), prompt + occluded span are fed and the answer is
   regenerated greedily (``answer_tokens`` tokens). A token is labelled 1 when any window covering
   it changes the answer of the unoccluded context, else 0. The answer is the number after
   ``Answer:``, else the last number, else the whole regenerated text.
4. ``g_l`` of every token on every layer is read by :class:`~kvevict.hidden.HiddenStateRecorder`
   hooks over one pass of prompt + generation; ``ḡ_l`` is its rolling mean over 64 tokens (and
   ``z_l`` the rolling z-score, EpiKV's detrended signal), over the whole sequence.

Per layer, Spearman ρ of ``ḡ_l`` (and of ``z_l``) against the labels, pooled over the reasoning
tokens of every sample. Every sample with an answer is used (the paper keeps correctly answered
traces; correctness is recorded). Samples are written to ``OUT/labels.jsonl`` as they finish
(a rerun resumes), then ``labels.csv``, ``importance.csv``, ``importance.json`` and a plot.
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvevict.bench.report import text_table
from kvevict.figures import pyplot, save_figure
from kvevict.generation import continue_greedy
from kvevict.hidden import HiddenStateRecorder, decoder_layers
from kvevict.policies.epikv import ROLLING, rolling_mean, rolling_zscore

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

WINDOW, STRIDE = 32, 16
ANSWER_TOKENS = 16
INSTRUCTION = "\nThink step by step, then write the final answer on its own line as 'Answer: <number>'."
ANSWER_MARK = "Answer"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
NAMES = ("Ana", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo")
ITEMS = ("apples", "marbles", "stickers", "pencils", "cards", "shells")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int


def make_problems(count: int, seed: int = 0) -> list[Problem]:
    """``count`` small arithmetic word problems (two or three steps), seeded."""
    rng = random.Random(seed)
    problems = []
    for index in range(count):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b, c = rng.randint(12, 60), rng.randint(3, 9), rng.randint(2, 11)
        kind = index % 3
        if kind == 0:
            text = f"{name} has {a} {item}, buys {b} more and then gives {c} to a friend. How many {item} are left?"
            answer = a + b - c
        elif kind == 1:
            text = f"A box holds {b} {item}. {name} fills {c} boxes and has {a} loose {item}. How many {item} in all?"
            answer = b * c + a
        else:
            text = f"{name} had {a} {item} and shared {b * c} of them equally among {c} friends. How many are left?"
            answer = a - b * c
        problems.append(Problem(text, answer))
    return problems


def occlusion_windows(length: int, window: int = WINDOW, stride: int = STRIDE) -> list[tuple[int, int]]:
    """``[start, stop)`` windows of ``window`` tokens every ``stride`` covering ``0 .. length``."""
    if window < 1 or stride < 1:
        raise ValueError(f"window and stride must be >= 1, got window={window}, stride={stride}")
    starts = range(0, max(1, length - window + stride), stride)
    return [(start, min(start + window, length)) for start in starts if start < length]


def labels_from_flips(length: int, windows: Sequence[tuple[int, int]], flipped: Sequence[bool]) -> list[int]:
    """1 for every token covered by at least one window that flipped the answer."""
    labels = [0] * length
    for (start, stop), flip in zip(windows, flipped, strict=True):
        if flip:
            labels[start:stop] = [1] * (stop - start)
    return labels


def average_ranks(values: Sequence[float]) -> list[float]:
    """Ranks 1..n, ties sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        stop = start
        while stop + 1 < len(order) and values[order[stop + 1]] == values[order[start]]:
            stop += 1
        for i in order[start : stop + 1]:
            ranks[i] = (start + stop) / 2 + 1
        start = stop + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's ρ: the Pearson correlation of the average ranks (NaN when one side is constant)."""
    if len(x) != len(y):
        raise ValueError(f"spearman needs equal lengths, got {len(x)} and {len(y)}")
    rx, ry = torch.tensor(average_ranks(x), dtype=torch.float64), torch.tensor(average_ranks(y), dtype=torch.float64)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = (rx.square().sum() * ry.square().sum()).sqrt()
    return float("nan") if denominator == 0 else float((rx * ry).sum() / denominator)


def extract_answer(text: str) -> str:
    """The number after the last ``Answer:``, else the last number, else the stripped text."""
    tail = text[text.rfind(ANSWER_MARK) :] if ANSWER_MARK in text else ""
    numbers = NUMBER.findall(tail) or NUMBER.findall(text)
    return (numbers[0] if tail and NUMBER.findall(tail) else numbers[-1]) if numbers else text.strip()


def answer_boundary(tokenizer: PreTrainedTokenizerBase, generated: Sequence[int], answer_tokens: int) -> int:
    """Index of the generated token where the last ``Answer`` starts (fallback: the last
    ``answer_tokens`` tokens are the answer), at least 1."""
    text = tokenizer.decode(generated, skip_special_tokens=True)
    mark = text.rfind(ANSWER_MARK)
    if mark > 0:
        for k in range(1, len(generated) + 1):
            if len(tokenizer.decode(generated[:k], skip_special_tokens=True)) > mark:
                return max(1, k - 1)
    return max(1, len(generated) - answer_tokens)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> torch.Tensor:
    text = question + INSTRUCTION
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    return tokenizer(text, return_tensors="pt").input_ids


def layer_changes(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """``g_l`` of every token on every decoder layer, ``[L, n]`` fp32 (hooks, one pass)."""
    recorder = HiddenStateRecorder(model, range(len(decoder_layers(model))))
    try:
        with torch.inference_mode():
            model(input_ids=ids.to(model.device), use_cache=False)
    finally:
        recorder.close()
    return torch.cat([recorder.changes[i] for i in recorder.layers])


@dataclass
class LabelledSample:
    index: int
    question: str
    reference: int
    generation: str
    answer: str
    correct: bool
    prompt_tokens: int
    span_tokens: list[int]
    labels: list[int]
    windows: list[tuple[int, int]]
    flipped: list[bool]
    rolling_change: list[list[float]]
    """``ḡ_l`` at the span tokens, per layer."""
    rolling_zscore: list[list[float]]
    """``z_l`` at the span tokens, per layer."""


def label_sample(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problem: Problem,
    index: int,
    *,
    max_new_tokens: int,
    window: int = WINDOW,
    stride: int = STRIDE,
    answer_tokens: int = ANSWER_TOKENS,
    rolling: int = ROLLING,
) -> LabelledSample:
    """Generate, occlude, regenerate and read the hidden-state changes of one problem."""
    ids = prompt_ids(tokenizer, problem.question)
    generated = continue_greedy(model, tokenizer, ids, None, max_new_tokens).cpu()
    boundary = answer_boundary(tokenizer, generated.tolist(), answer_tokens)
    span = generated[:boundary]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def regenerate(reasoning: torch.Tensor) -> str:
        context = torch.cat([ids[0], reasoning])[None]
        new = continue_greedy(model, tokenizer, context, None, answer_tokens)
        return extract_answer(tokenizer.decode(new, skip_special_tokens=True))

    answer = regenerate(span)
    windows = occlusion_windows(len(span), window, stride)
    flipped = []
    for start, stop in windows:
        occluded = span.clone()
        occluded[start:stop] = pad
        flipped.append(regenerate(occluded) != answer)
    changes = layer_changes(model, torch.cat([ids[0], generated])[None])
    positions = slice(ids.shape[-1], ids.shape[-1] + len(span))
    return LabelledSample(
        index=index,
        question=problem.question,
        reference=problem.answer,
        generation=tokenizer.decode(generated, skip_special_tokens=True),
        answer=answer,
        correct=answer == str(problem.answer),
        prompt_tokens=ids.shape[-1],
        span_tokens=span.tolist(),
        labels=labels_from_flips(len(span), windows, flipped),
        windows=windows,
        flipped=flipped,
        rolling_change=rolling_mean(changes, rolling)[:, positions].tolist(),
        rolling_zscore=rolling_zscore(changes, rolling)[:, positions].tolist(),
    )


def read_samples(directory: str | Path) -> list[LabelledSample]:
    """The finished samples of ``OUT/labels.jsonl`` (a torn last line is ignored)."""
    path = Path(directory) / "labels.jsonl"
    if not path.exists():
        return []
    samples = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        record["windows"] = [tuple(w) for w in record["windows"]]
        samples.append(LabelledSample(**record))
    return samples


def run_importance(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out: str | Path,
    *,
    samples: int,
    max_new_tokens: int,
    seed: int = 0,
    progress: bool = True,
    **options: Any,
) -> list[LabelledSample]:
    """Label ``samples`` problems into ``out`` (resuming), returning every finished sample."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    done = {sample.index: sample for sample in read_samples(out)}
    path = out / "labels.jsonl"
    for index, problem in enumerate(tqdm(make_problems(samples, seed), desc="importance", disable=not progress)):
        if index in done:
            continue
        sample = label_sample(model, tokenizer, problem, index, max_new_tokens=max_new_tokens, **options)
        with path.open("a", encoding="utf-8") as lines:
            lines.write(json.dumps(asdict(sample)) + "\n")
            lines.flush()
            os.fsync(lines.fileno())
        done[index] = sample
    return [done[i] for i in sorted(done) if i < samples]


@dataclass
class LayerCorrelation:
    layer: int
    rho: float
    """Spearman ρ of ``ḡ_l`` with the labels."""
    rho_z: float
    """Spearman ρ of ``z_l`` with the labels."""


def correlations(samples: Sequence[LabelledSample]) -> list[LayerCorrelation]:
    """Per-layer Spearman ρ over the pooled reasoning tokens of ``samples``."""
    labels = [label for sample in samples for label in sample.labels]
    layers = len(samples[0].rolling_change) if samples else 0

    def pooled(field: Callable[[LabelledSample], list[list[float]]], layer: int) -> list[float]:
        return [value for sample in samples for value in field(sample)[layer]]

    return [
        LayerCorrelation(
            layer,
            spearman(pooled(lambda s: s.rolling_change, layer), labels),
            spearman(pooled(lambda s: s.rolling_zscore, layer), labels),
        )
        for layer in range(layers)
    ]


def summary(samples: Sequence[LabelledSample], model_name: str) -> dict[str, Any]:
    tokens = sum(len(s.labels) for s in samples)
    return {
        "model": model_name,
        "samples": len(samples),
        "correct": sum(s.correct for s in samples),
        "tokens": tokens,
        "important_fraction": sum(sum(s.labels) for s in samples) / tokens if tokens else float("nan"),
        "layers": [asdict(c) for c in correlations(samples)],
    }


def format_summary(result: dict[str, Any]) -> str:
    rows = [[str(c["layer"]), f"{c['rho']:+.3f}", f"{c['rho_z']:+.3f}"] for c in result["layers"]]
    head = (
        f"importance labels: {result['model']}, {result['samples']} samples ({result['correct']} correct), "
        f"{result['tokens']} reasoning tokens, {result['important_fraction']:.2f} important"
    )
    return "\n".join([head, *text_table(["layer", "rho(g_rolling)", "rho(z)"], rows)])


def write_outputs(samples: Sequence[LabelledSample], result: dict[str, Any], out: str | Path) -> list[Path]:
    """``labels.csv`` (one row per reasoning token), ``importance.csv``, ``importance.json`` and
    ``importance.png``."""
    out = Path(out)
    labels, table, data = out / "labels.csv", out / "importance.csv", out / "importance.json"
    with labels.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["sample", "span_index", "position", "token", "label"])
        for s in samples:
            for i, (token, label) in enumerate(zip(s.span_tokens, s.labels, strict=True)):
                writer.writerow([s.index, i, s.prompt_tokens + i, token, label])
    with table.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["layer", "rho", "rho_z"])
        writer.writerows([c["layer"], c["rho"], c["rho_z"]] for c in result["layers"])
    data.write_text(json.dumps(result, indent=2), encoding="utf-8")
    return [labels, table, data, plot_correlations(result, out / "importance.png")]


def plot_correlations(result: dict[str, Any], path: str | Path) -> Path:
    plt = pyplot()

    layers = [c["layer"] for c in result["layers"]]
    figure, axes = plt.subplots(figsize=(7, 3.5))
    axes.bar([x - 0.2 for x in layers], [c["rho"] for c in result["layers"]], width=0.4, label="rolling-64 ḡ")
    axes.bar([x + 0.2 for x in layers], [c["rho_z"] for c in result["layers"]], width=0.4, label="rolling z")
    axes.axhline(0, color="black", linewidth=0.8)
    axes.set(xlabel="decoder layer", ylabel="Spearman ρ with importance", title=f"{result['model']}")
    axes.legend()
    return save_figure(figure, path)
