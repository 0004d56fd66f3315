"""``kvevict bench``: every task × policy × budget, one JSON line per sample, resumable.

For each group of samples sharing a context and each (policy, budget) setting, the context
is prefilled and compressed once; each sample then continues from a copy of that cache
(question, answer prefix, greedy answer). ``full`` runs first in every group, so with
``fidelity`` its answer is replayed, teacher-forced, under every other setting.

A context group under one setting is a :class:`Unit`: :func:`plan_units` lists those still to
run, :class:`UnitRunner` turns one into records. :class:`BenchRunner` runs them in turn here;
:mod:`kvevict.bench.cluster` spreads them over Ray workers with the same two functions.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, StoppingCriteria

from kvevict.bench import clock
from kvevict.bench.fidelity import fidelity_metrics, reference_logits, replay
from kvevict.bench.store import ResultStore
from kvevict.bench.task import Sample, Task
from kvevict.bench.tasks import get_task
from kvevict.budgets import Budget
from kvevict.cache import EvictionCache
from kvevict.generation import check_chunk, compress, continue_greedy, prefill, split_prompt
from kvevict.models import load_model
from kvevict.policies import make_policy


@dataclass(frozen=True)
class Setting:
    """One policy at one budget (``full`` has none)."""

    policy: str
    budget: int | None = None
    keep: float | None = None
    quant: str | None = None
    """Quantized storage (``EvictionCache(quant=...)``); None: full precision."""

    @property
    def reference(self) -> bool:
        """Whether this is the full cache at full precision: the reference of the others."""
        return self.policy == "full" and self.quant is None

    def describe(self) -> str:
        name = self.policy if self.quant is None else f"{self.policy} ({self.quant})"
        if self.budget is not None:
            return f"{name} at budget {self.budget}"
        return name if self.keep is None else f"{name} keeping {self.keep:g}"


@dataclass
class BenchConfig:
    """What ``kvevict bench`` runs; recorded field by field with every result."""

    tasks: tuple[str, ...]
    model: str = "smollm2"
    policies: tuple[str, ...] = ("full",)
    budgets: tuple[int, ...] = ()
    keeps: tuple[float, ...] = ()
    length: int = 2048
    samples: int = 4
    seed: int = 0
    query_aware: bool = False
    interval: int | None = None
    """Decode-time eviction interval; None: each policy's own (1 for most)."""
    fidelity: bool = False
    max_new_tokens: int | None = None
    """Overrides every task's own generation length when set."""
    prefill_chunk: int | None = None
    """Compress prompts this many tokens per pass (bounded memory: budget + chunk); None: one pass."""
    dtype: str | None = None
    device: str | None = None
    attn: str | None = None
    batch_size: int = 1
    """Samples run as one left-padded batch (each row evicted on its own: the same results as one
    by one). A batch takes samples of one task and setting across contexts; each row prefills its
    own context. Settings that replay the full cache's answer (fidelity) run one sample at a time."""
    quants: tuple[str | None, ...] = ()
    """Run every setting with each of these ``quant=`` options (None: full precision); empty: full precision only."""
    quant_group: int | None = None
    """``EvictionCache(quant_group=...)`` of the quantized settings; None: its default."""
    residual: int | None = None
    """``EvictionCache(residual=...)`` of the quantized settings; None: its default (32)."""
    settings: list[Setting] = field(init=False)

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("give at least one task (see `kvevict tasks`)")
        for name in self.tasks:
            get_task(name)
        if self.budgets and self.keeps:
            raise ValueError("give either budgets (--budgets) or keep fractions (--keep), not both")
        for value in (*self.budgets, *self.keeps):
            Budget(value if isinstance(value, int) else None, value if isinstance(value, float) else None)
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch size must be an integer >= 1, got {self.batch_size!r}")
        if self.samples < 1 or self.length < 1:
            raise ValueError(f"samples and length must be positive, got samples={self.samples}, length={self.length}")
        named = [name for name in dict.fromkeys(self.policies) if name != "full"]
        evicting = [name for name in named if make_policy(name).method.evicts]
        unbudgeted = [Setting(name) for name in named if name not in evicting]  # (``think``: ThinK over the full cache)
        if evicting and not (self.budgets or self.keeps):
            raise ValueError(f"policies {', '.join(evicting)} need --budgets or --keep")
        budgets = [Setting(name, budget=b) for name in evicting for b in self.budgets]
        keeps = [Setting(name, keep=k) for name in evicting for k in self.keeps]
        for setting in budgets:
            make_policy(setting.policy).check_budget(setting.budget)
        for name, value, low in (("quant group", self.quant_group, 1), ("residual", self.residual, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if (self.quant_group is not None or self.residual is not None) and not any(self.quants):
            raise ValueError("a quant group or residual needs quantized settings (--quant int8, int4 or int2)")
        check_chunk(self.prefill_chunk)
        for name in named:  # what the settings ask of each policy: a prompt in chunks, quantized storage
            policy = make_policy(name)
            if self.prefill_chunk is not None and not policy.takes_chunks:
                raise ValueError(policy.chunk_refusal("run it without --prefill-chunk"))
            if any(self.quants) and any(stage.rewrites_keys for stage in policy.stages):
                raise ValueError(
                    f"{name} rewrites the kept keys, which a quantized cache holds as codes: run it without --quant"
                )
        # full first: it is the reference for "% of full" and for fidelity
        needs_reference = self.fidelity or any(get_task(name).scored_by_fidelity for name in self.tasks)
        reference = [Setting("full")] if "full" in self.policies or needs_reference else []
        evicting_settings = unbudgeted + budgets + keeps
        if self.quants:  # each setting with each option; the reference stays at full precision
            full = [
                Setting("full", quant=quant) for quant in self.quants if quant is not None and "full" in self.policies
            ]
            evicting_settings = full + [replace(s, quant=quant) for quant in self.quants for s in evicting_settings]
        self.settings = reference + evicting_settings


def _groups(samples: Sequence[Sample]) -> list[list[Sample]]:
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.context_id, []).append(sample)
    return list(groups.values())


@dataclass(frozen=True)
class Unit:
    """One context group under one setting: the context is prefilled and compressed once, then
    each sample continues from a copy. The unit of work of a sweep, run in turn by
    :class:`BenchRunner` or spread over Ray workers by :mod:`kvevict.bench.cluster`; it carries
    everything a worker needs besides its model, so any worker can run (or rerun) it."""

    task: str
    setting: Setting
    samples: tuple[Sample, ...]
    references: Mapping[tuple[str, int], tuple[int, ...]] = field(default_factory=dict, compare=False)
    """The full cache's answer per (task, index), for a setting replayed against it (fidelity)."""

    @property
    def group(self) -> tuple[str, str]:
        return self.task, self.samples[0].context_id

    def describe(self) -> str:
        size = f"{len(self.samples)} samples" if len(self.samples) > 1 else f"sample {self.samples[0].index}"
        return f"{self.setting.describe()} on {self.task} ({size})"


def identity(config: BenchConfig, sample: Sample, setting: Setting) -> dict[str, Any]:
    """The fields that identify a sample's result in the store (:data:`~kvevict.bench.store.KEY_FIELDS`)."""
    policy = make_policy(setting.policy)
    return {
        "task": sample.task,
        "index": sample.index,
        "length": config.length,
        "seed": config.seed,
        "model": config.model,
        "policy": setting.policy,
        "policy_params": policy.params(),
        "budget": setting.budget,
        "keep": setting.keep,
        "interval": None if setting.policy == "full" else config.interval,  # the reference never evicts
        "quant": setting.quant,
        "quant_group": None if setting.quant is None else config.quant_group,
        "residual": None if setting.quant is None else config.residual,
        "query_aware": config.query_aware,
        "max_new_tokens": config.max_new_tokens or sample.max_new_tokens,
        "prefill_chunk": config.prefill_chunk,
    }


def replays_reference(config: BenchConfig, task: Task, setting: Setting) -> bool:
    """Whether ``setting`` replays the full cache's answer, so its unit runs after the group's ``full``."""
    return (config.fidelity or task.scored_by_fidelity) and not setting.reference


def pending(config: BenchConfig, unit: Unit, store: ResultStore) -> Unit | None:
    """``unit`` narrowed to its samples not yet in ``store``; None when all are."""
    todo = tuple(sample for sample in unit.samples if identity(config, sample, unit.setting) not in store)
    return replace(unit, samples=todo) if todo else None


def plan_units(config: BenchConfig, samples: Mapping[str, Sequence[Sample]], store: ResultStore) -> list[Unit]:
    """Every unit of the sweep with samples not yet in ``store``, in run order: task by task,
    context group by group, every setting in turn (``full`` first, the others' reference)."""
    units = (
        pending(config, Unit(task, setting, tuple(group)), store)
        for task, task_samples in samples.items()
        for group in _groups(task_samples)
        for setting in config.settings
    )
    return [unit for unit in units if unit is not None]


def batched(config: BenchConfig, units: Sequence[Unit]) -> list[Unit]:
    """``units`` regrouped into batches of up to ``config.batch_size`` samples: task by task,
    setting by setting (``full`` first, so every reference is stored before it is replayed), the
    samples of every context group in turn. A unit that replays the full answer stays as it is."""
    if config.batch_size == 1:
        return list(units)
    out: list[Unit] = []
    for task in dict.fromkeys(unit.task for unit in units):
        for setting in config.settings:
            mine = [unit for unit in units if unit.task == task and unit.setting == setting]
            if mine and replays_reference(config, get_task(task), setting):
                out += mine
                continue
            samples = [sample for unit in mine for sample in unit.samples]
            for start in range(0, len(samples), config.batch_size):
                out.append(Unit(task, setting, tuple(samples[start : start + config.batch_size])))
    return out


def with_references(config: BenchConfig, unit: Unit, store: ResultStore) -> Unit:
    """``unit`` with the full cache's answers it replays, read from ``store`` (the group's ``full``
    unit must have finished)."""
    if not replays_reference(config, get_task(unit.task), unit.setting):
        return unit
    reference = Setting("full")
    answers = {
        (sample.task, sample.index): tuple(store.get(identity(config, sample, reference))["prediction_ids"])
        for sample in unit.samples
    }
    return replace(unit, references=answers)


@dataclass
class PromptIds:
    """A sample's token ids: ``head`` the compressed part (the context), ``ids`` the whole prompt."""

    head: torch.Tensor
    ids: torch.Tensor

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, sample: Sample) -> PromptIds:
        head, tail = split_prompt(
            tokenizer,
            sample.context,
            sample.question,
            sample.answer_prefix,
            chat_template=sample.metadata.get("chat_template", True),
        )
        return cls(head, torch.cat([head, tail], dim=-1))


class UnitRunner:
    """One loaded model that turns units into records: the engine of the local loop and of every
    Ray worker, so both produce the same records. It keeps the full cache's reference logits of
    the group at hand (computed once, replayed by every other setting of the group)."""

    def __init__(
        self,
        config: BenchConfig,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ):
        self.config = config
        if model is None or tokenizer is None:
            model, tokenizer = load_model(
                config.model, dtype=config.dtype, device=config.device, attn_implementation=config.attn
            )
        self.model, self.tokenizer = model, tokenizer
        self._references: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._group: tuple[str, str] | None = None

    def samples(self) -> dict[str, list[Sample]]:
        """Every task's samples, by task name (they depend on the model's tokenizer)."""
        config = self.config
        return {
            name: get_task(name).samples(self.tokenizer, length=config.length, count=config.samples, seed=config.seed)
            for name in config.tasks
        }

    def run(self, unit: Unit) -> Iterator[dict[str, Any]]:
        """One record per sample of ``unit``, each as soon as it is finished (batches: as the batch ends)."""
        if unit.group != self._group:  # reference logits are large: keep only the current group's
            self._references.clear()
            self._group = unit.group
        task, setting = get_task(unit.task), unit.setting
        if self.config.batch_size > 1 and not replays_reference(self.config, task, setting):
            for batch in self._batches(unit.samples):
                yield from self._run_batch(task, setting, batch)
            return
        samples = unit.samples
        prompts = [PromptIds.of(self.tokenizer, sample) for sample in samples]
        shared: EvictionCache | None = None
        shared_seconds = 0.0
        if not self.config.query_aware:  # compress the common context once
            shared = self._cache(setting)
            shared_seconds = clock.seconds(
                self.model.device, prefill, self.model, prompts[0].head, shared, None, self.config.prefill_chunk
            )
        for sample, prompt in zip(samples, prompts):
            if shared is None:  # query-aware: compress the prompt but its last token, which starts decoding
                cache = self._cache(setting)
                prefill_seconds = clock.seconds(
                    self.model.device, prefill, self.model, prompt.ids[:, :-1], cache, None, self.config.prefill_chunk
                )
            else:
                cache, prefill_seconds = copy.deepcopy(shared), shared_seconds
            at_prefill = cache.row_memory(0)
            fidelity = None
            if replays_reference(self.config, task, setting):
                # a fidelity-scored task only replays: its cache then shows the real decode-time memory
                replayed = cache if task.scored_by_fidelity else copy.deepcopy(cache)
                start = clock.now(self.model.device)
                fidelity = self._fidelity(unit, sample, prompt, replayed)
                decode_seconds = clock.now(self.model.device) - start
            new_ids = None
            if not (task.scored_by_fidelity and not setting.reference):
                max_new_tokens, constraints = self._generation(sample)
                start = clock.now(self.model.device)
                new_ids = continue_greedy(self.model, self.tokenizer, prompt.ids, cache, max_new_tokens, **constraints)
                decode_seconds = clock.now(self.model.device) - start
            yield self._record(
                task,
                setting,
                sample,
                prompt,
                new_ids,
                fidelity,
                at_prefill,
                cache.row_memory(0),
                {"prefill_s": prefill_seconds, "decode_s": decode_seconds, "shared": len(samples) if shared else 1},
            )

    def _generation(self, sample: Sample) -> tuple[int, dict[str, Any]]:
        """``max_new_tokens`` and the deterministic generation options of ``sample``."""
        max_new_tokens = self.config.max_new_tokens or sample.max_new_tokens
        constraints = dict(sample.metadata.get("generation", {}))
        if "min_new_tokens" in constraints:  # a --max-new-tokens override shortens it too
            constraints["min_new_tokens"] = min(constraints["min_new_tokens"], max_new_tokens)
        return max_new_tokens, constraints

    def _batches(self, samples: Sequence[Sample]) -> Iterator[list[Sample]]:
        """``samples`` in batches of up to ``batch_size`` that share their generation options, in order."""
        batch: list[Sample] = []
        for sample in samples:
            if batch and (
                len(batch) == self.config.batch_size or self._generation(batch[0]) != self._generation(sample)
            ):
                yield batch
                batch = []
            batch.append(sample)
        if batch:
            yield batch

    def _run_batch(self, task: Task, setting: Setting, samples: list[Sample]) -> Iterator[dict[str, Any]]:
        """``samples`` as one left-padded batch (each row its own prompt, evicted on its own);
        every row's memory is read when it ends, as the cache of that sample alone would be."""
        prompts = [PromptIds.of(self.tokenizer, sample) for sample in samples]
        cache = self._cache(setting)
        start = clock.now(self.model.device)
        tails = [prompt.ids[:, prompt.head.shape[-1] :] for prompt in prompts]
        heads = [prompt.head for prompt in prompts]
        ids, mask = compress(
            self.model,
            self.tokenizer,
            heads,
            tails,
            cache,
            query_aware=self.config.query_aware,
            chunk=self.config.prefill_chunk,
        )
        prefill_seconds = clock.now(self.model.device) - start
        at_prefill = [cache.row_memory(row) for row in range(len(samples))]
        ends = _RowEnds(cache, self.model.generation_config.eos_token_id, ids.shape[-1])
        max_new_tokens, constraints = self._generation(samples[0])
        start = clock.now(self.model.device)
        new_ids = continue_greedy(
            self.model, self.tokenizer, ids, cache, max_new_tokens, mask, stopping_criteria=[ends], **constraints
        )
        decode_seconds = clock.now(self.model.device) - start
        timing = {"prefill_s": prefill_seconds, "decode_s": decode_seconds, "shared": 1, "batch": len(samples)}
        for row, (sample, prompt) in enumerate(zip(samples, prompts)):
            final = ends.memory.get(row) or cache.row_memory(row)
            yield self._record(task, setting, sample, prompt, new_ids[row], None, at_prefill[row], final, timing)

    def _record(
        self,
        task: Task,
        setting: Setting,
        sample: Sample,
        prompt: PromptIds,
        new_ids: torch.Tensor | None,
        fidelity: dict[str, float] | None,
        at_prefill: dict[str, Any],
        final: dict[str, Any],
        timing: dict[str, float],
    ) -> dict[str, Any]:
        """The stored line of one sample (and, under ``full``, its reference logits kept for replays)."""
        prediction, score = None, None if fidelity is None else fidelity["top1"]
        if new_ids is not None:
            prediction = self.tokenizer.decode(new_ids, skip_special_tokens=True)  # raw: metrics clean it
            score = 1.0 if task.scored_by_fidelity else task.score(prediction, sample)
            if setting.reference and (self.config.fidelity or task.scored_by_fidelity):
                logits = reference_logits(self.model, prompt.ids, new_ids)
                self._references[(sample.task, sample.index)] = (new_ids, logits)
        return {
            **identity(self.config, sample, setting),
            "context_id": sample.context_id,
            "metric": task.metric,
            "score": score,
            "prediction": prediction,
            "prediction_ids": None if new_ids is None else new_ids.tolist(),
            "answers": list(sample.answers),
            "prompt_tokens": prompt.ids.shape[-1],
            "context_tokens": prompt.head.shape[-1],
            "new_tokens": fidelity["tokens"] if new_ids is None else int(new_ids.numel()),
            "kv_bytes_prefill": at_prefill["kv_bytes"],
            "kv_bytes_prefill_by_layer": at_prefill["layer_bytes"],  # (allocated, real): differ for head-wise budgets
            "kv_bytes_final": final["kv_bytes"],
            "kv_bytes_real_final": final["real_bytes"],
            "retained_tokens": final["retained"],  # the longest KV head
            "retained_tokens_mean": round(final["retained_mean"], 2),
            "kept_share": round(final["kept_share"], 5),  # of the entries a full cache holds for the same tokens
            "decode_peak_tokens": final["decode_peak"],
            "peak_tokens": final["peak"],  # prefill included: budget + chunk with --prefill-chunk
            "prefill_s": round(timing["prefill_s"], 4),
            "decode_s": round(timing["decode_s"], 4),
            "shared_prefill": timing["shared"],
            "batch_size": timing.get("batch", 1),
            "fidelity": fidelity,
            "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }

    def _cache(self, setting: Setting) -> EvictionCache:
        return EvictionCache(
            self.model,
            setting.policy,
            budget=setting.budget,
            keep=setting.keep,
            interval=self.config.interval,
            quant=setting.quant,
            quant_group=self.config.quant_group,
            residual=self.config.residual,
        )

    def _fidelity(self, unit: Unit, sample: Sample, prompt: PromptIds, cache: EvictionCache) -> dict[str, float]:
        """Replay the full cache's answer under ``cache``."""
        key = (sample.task, sample.index)
        if key not in self._references:  # the full answer came from another run or worker: with the unit
            tokens = torch.tensor(unit.references[key], dtype=torch.long)
            self._references[key] = (tokens, reference_logits(self.model, prompt.ids, tokens))
        tokens, logits = self._references[key]
        policy_logits = replay(self.model, cache, prompt.ids, tokens, step_by_step=cache.policy.evicts_in("decode"))
        return fidelity_metrics(logits, policy_logits, tokens).to_dict()


class BenchRunner:
    """Runs a :class:`BenchConfig` into a :class:`ResultStore`, unit by unit in this process."""

    def __init__(
        self,
        config: BenchConfig,
        out: str | Path,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ):
        self.config = config
        self.store = ResultStore(out)
        self.worker = UnitRunner(config, model, tokenizer)

    def run(self, progress: bool = True) -> ResultStore:
        units = plan_units(self.config, self.worker.samples(), self.store)
        total = sum(len(unit.samples) for unit in units)
        with tqdm(total=total, desc="bench", unit="sample", disable=not progress) as bar:
            for unit in batched(self.config, units):
                for record in self.worker.run(with_references(self.config, unit, self.store)):
                    self.store.append(record)
                    bar.update()
        return self.store


class _RowEnds(StoppingCriteria):
    """Reads each row's memory when it ends (its end-of-sequence token chosen, not yet fed): a
    finished row of a batch is fed padding while the others go on, which its cache alone never sees."""

    def __init__(self, cache: EvictionCache, eos: int | list[int] | None, prompt_length: int):
        self.cache, self.prompt_length = cache, prompt_length
        self.eos = torch.tensor(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.memory: dict[int, dict[str, Any]] = {}

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        new = input_ids[:, self.prompt_length :]
        ended = torch.isin(new, self.eos.to(new.device)).any(dim=-1)
        for row in ended.nonzero().flatten().tolist():
            self.memory.setdefault(row, self.cache.row_memory(row))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
