"""``kvevict bench``: every task × policy × budget, one JSON line per sample, resumable.

For each group of samples sharing a context and each (policy, budget) setting, the context
is prefilled and compressed once; each sample then continues from a copy of that cache
(question, answer prefix, greedy answer). ``full`` runs first in every group, so with
``fidelity`` its answer is replayed, teacher-forced, under every other setting.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvevict.bench.fidelity import fidelity_metrics, reference_logits, replay
from kvevict.bench.store import ResultStore
from kvevict.bench.tasks import Sample, Task, get_task
from kvevict.budgets import Budget
from kvevict.cache import EvictionCache
from kvevict.generation import continue_greedy, prefill, split_prompt
from kvevict.models import load_model
from kvevict.policies import make_policy


@dataclass(frozen=True)
class Setting:
    """One policy at one budget (``full`` has none)."""

    policy: str
    budget: int | None = None
    keep: float | None = None


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
    dtype: str | None = None
    device: str | None = None
    attn: str | None = None
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
        if self.samples < 1 or self.length < 1:
            raise ValueError(f"samples and length must be positive, got samples={self.samples}, length={self.length}")
        evicting = [name for name in dict.fromkeys(self.policies) if name != "full"]
        if evicting and not (self.budgets or self.keeps):
            raise ValueError(f"policies {', '.join(evicting)} need --budgets or --keep")
        budgets = [Setting(name, budget=b) for name in evicting for b in self.budgets]
        keeps = [Setting(name, keep=k) for name in evicting for k in self.keeps]
        for setting in budgets:
            make_policy(setting.policy).check_budget(setting.budget)
        # full first: it is the reference for "% of full" and for fidelity
        needs_reference = self.fidelity or any(get_task(name).scored_by_fidelity for name in self.tasks)
        reference = [Setting("full")] if "full" in self.policies or needs_reference else []
        self.settings = reference + budgets + keeps


def _groups(samples: list[Sample]) -> list[list[Sample]]:
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.context_id, []).append(sample)
    return list(groups.values())


@dataclass
class _Prompt:
    head: torch.Tensor
    ids: torch.Tensor

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, sample: Sample) -> _Prompt:
        head, tail = split_prompt(
            tokenizer,
            sample.context,
            sample.question,
            sample.answer_prefix,
            chat_template=sample.metadata.get("chat_template", True),
        )
        return cls(head, torch.cat([head, tail], dim=-1))


class BenchRunner:
    """Runs a :class:`BenchConfig` into a :class:`ResultStore`."""

    def __init__(
        self,
        config: BenchConfig,
        out: str | Path,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ):
        self.config = config
        self.store = ResultStore(out)
        if model is None or tokenizer is None:
            model, tokenizer = load_model(
                config.model, dtype=config.dtype, device=config.device, attn_implementation=config.attn
            )
        self.model, self.tokenizer = model, tokenizer
        self._references: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def run(self, progress: bool = True) -> ResultStore:
        plan = [(task, self._samples(task)) for task in map(get_task, self.config.tasks)]
        pending = sum(
            1
            for _, samples in plan
            for sample in samples
            for setting in self.config.settings
            if not self._done(sample, setting)
        )
        with tqdm(total=pending, desc="bench", unit="sample", disable=not progress) as bar:
            for task, samples in plan:
                for group in _groups(samples):
                    for setting in self.config.settings:
                        todo = [sample for sample in group if not self._done(sample, setting)]
                        for record in self._run_group(task, todo, setting):
                            self.store.append(record)
                            bar.update()
                    self._references.clear()
        return self.store

    def _samples(self, task: Task) -> list[Sample]:
        return task.samples(self.tokenizer, length=self.config.length, count=self.config.samples, seed=self.config.seed)

    def _identity(self, sample: Sample, setting: Setting) -> dict[str, Any]:
        policy = make_policy(setting.policy)
        return {
            "task": sample.task,
            "index": sample.index,
            "length": self.config.length,
            "seed": self.config.seed,
            "model": self.config.model,
            "policy": setting.policy,
            "policy_params": policy.params(),
            "budget": setting.budget,
            "keep": setting.keep,
            "interval": None if setting.policy == "full" else self.config.interval,  # the reference never evicts
            "query_aware": self.config.query_aware,
            "max_new_tokens": self.config.max_new_tokens or sample.max_new_tokens,
        }

    def _done(self, sample: Sample, setting: Setting) -> bool:
        return self._identity(sample, setting) in self.store

    def _cache(self, setting: Setting) -> EvictionCache:
        return EvictionCache(
            self.model, setting.policy, budget=setting.budget, keep=setting.keep, interval=self.config.interval
        )

    def _run_group(self, task: Task, samples: list[Sample], setting: Setting) -> Iterator[dict[str, Any]]:
        if not samples:
            return
        prompts = [_Prompt.of(self.tokenizer, sample) for sample in samples]
        shared: EvictionCache | None = None
        shared_seconds = 0.0
        if not self.config.query_aware:  # compress the common context once
            shared = self._cache(setting)
            shared_seconds = _timed(prefill, self.model, prompts[0].head, shared)
        for sample, prompt in zip(samples, prompts):
            if shared is None:  # query-aware: compress the prompt but its last token, which starts decoding
                cache = self._cache(setting)
                prefill_seconds = _timed(prefill, self.model, prompt.ids[:, :-1], cache)
            else:
                cache, prefill_seconds = copy.deepcopy(shared), shared_seconds
            kv_prefill, kv_layers = cache.kv_bytes(), cache.layer_bytes()
            with_reference = self.config.fidelity or task.scored_by_fidelity
            fidelity = None
            if with_reference and setting.policy != "full":
                # a fidelity-scored task only replays: its cache then shows the real decode-time memory
                replayed = cache if task.scored_by_fidelity else copy.deepcopy(cache)
                start = time.perf_counter()
                fidelity = self._fidelity(sample, prompt, replayed)
                decode_seconds = time.perf_counter() - start
            if task.scored_by_fidelity and setting.policy != "full":
                new_ids, prediction, score = None, None, fidelity["top1"]
            else:
                max_new_tokens = self.config.max_new_tokens or sample.max_new_tokens
                start = time.perf_counter()
                constraints = dict(sample.metadata.get("generation", {}))
                if "min_new_tokens" in constraints:  # a --max-new-tokens override shortens it too
                    constraints["min_new_tokens"] = min(constraints["min_new_tokens"], max_new_tokens)
                new_ids = continue_greedy(self.model, self.tokenizer, prompt.ids, cache, max_new_tokens, **constraints)
                decode_seconds = time.perf_counter() - start
                prediction = self.tokenizer.decode(new_ids, skip_special_tokens=True)  # raw: metrics clean it
                score = 1.0 if task.scored_by_fidelity else task.score(prediction, sample)
                if setting.policy == "full" and with_reference:
                    self._references[(sample.task, sample.index)] = (
                        new_ids,
                        reference_logits(self.model, prompt.ids, new_ids),
                    )
            yield {
                **self._identity(sample, setting),
                "context_id": sample.context_id,
                "metric": task.metric,
                "score": score,
                "prediction": prediction,
                "prediction_ids": None if new_ids is None else new_ids.tolist(),
                "answers": list(sample.answers),
                "prompt_tokens": prompt.ids.shape[-1],
                "context_tokens": prompt.head.shape[-1],
                "new_tokens": fidelity["tokens"] if new_ids is None else int(new_ids.numel()),
                "kv_bytes_prefill": kv_prefill,
                "kv_bytes_prefill_by_layer": kv_layers,  # (allocated, real entries): differ for head-wise budgets
                "kv_bytes_final": cache.kv_bytes(),
                "kv_bytes_real_final": sum(real for _, real in cache.layer_bytes()),
                "retained_tokens": max(cache.layer_lengths()),
                "decode_peak_tokens": cache.decode_peak(),
                "prefill_s": round(prefill_seconds, 4),
                "decode_s": round(decode_seconds, 4),
                "shared_prefill": len(samples) if shared is not None else 1,
                "fidelity": fidelity,
                "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
            }

    def _fidelity(self, sample: Sample, prompt: _Prompt, cache: EvictionCache) -> dict[str, float]:
        """Replay the full cache's answer under ``cache``."""
        tokens, logits = self._reference(sample, prompt)
        policy_logits = replay(self.model, cache, prompt.ids, tokens, step_by_step=cache.policy.evicts_in("decode"))
        return fidelity_metrics(logits, policy_logits, tokens).to_dict()

    def _reference(self, sample: Sample, prompt: _Prompt) -> tuple[torch.Tensor, torch.Tensor]:
        """The full cache's answer and logits: from this run, or (resumed) from its record."""
        key = (sample.task, sample.index)
        if key not in self._references:
            record = self.store.get(self._identity(sample, Setting("full")))
            tokens = torch.tensor(record["prediction_ids"], dtype=torch.long)
            self._references[key] = (tokens, reference_logits(self.model, prompt.ids, tokens))
        return self._references[key]


def _timed(action: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    action(*args)
    return time.perf_counter() - start
