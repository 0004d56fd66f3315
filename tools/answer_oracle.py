"""An upper bound for KVzip's one pool at a given keep (docs/fastkvzip.md, round 24): every context
entry scored by what the answer actually reads, not by KVzip's repeat of the context.

KVzip's machinery is kept whole (its scores: the max over queries and the GQA group of the
attention probability; its global pool with sinks); only the teacher-forced pass changes, from
"repeat the context" to the question followed by the full cache's own greedy answer. Two more
settings swap halves between the two, to tell the allocation (entries per head) from the ranking
inside each head: ``counts=kvzip`` keeps KVzip's per-head counts and ranks by the answer's
reading, ``counts=answer`` the other way round.

    python tools/answer_oracle.py niah_multikey_1,niah_multivalue --keep 0.1 --samples 4 --out oracle.jsonl

A record per sample and setting is appended as it finishes; a rerun skips the finished ones. This is
a measurement, not a policy: it needs the answer, which no compressor has.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import kvevict
from kvevict.gates.train import ReadingKVzip
from kvevict.generation import greedy_after, prefill, split_prompt, stop_tokens_of
from kvevict.policies.allocation import GlobalBudget
from kvevict.policies.base import Stages
from kvevict.policies.pipeline import Policy

SETTINGS = ("kvzip", "answer", "counts=kvzip", "counts=answer")
"""What scores and what allocates: KVzip, the answer's reading, or one allocating for the other's ranking."""


class CountsFrom(GlobalBudget):
    """KVzip's pool, or (``replay`` given) the per-head counts another pass recorded (``recorded``)."""

    def __init__(self, replay: list[torch.Tensor] | None = None):
        super().__init__(safeguard=0.0)
        self.replay, self.recorded = replay, []

    def allocate_layers(self, layers: list, scores: list[torch.Tensor], comparable: bool) -> None:
        if self.replay is None:
            super().allocate_layers(layers, scores, comparable)
            self.recorded = [self.memo(layer)["counts"].clone() for layer in layers]
        else:
            for layer, counts in zip(layers, self.replay, strict=True):
                self.memo(layer)["counts"] = counts.clone()


class AnswerReading(ReadingKVzip):
    """KVzip with its repeat replaced by ``reading`` ``[1, m]`` (the question and an answer, teacher-forced),
    or by KVzip's own repeat when ``reading`` is None; its pool is ``allocator``'s."""

    def __init__(self, reading: torch.Tensor | None, allocator: CountsFrom, **params: object):
        super().__init__(None if reading is None else [reading], **params)
        self.allocator_stage = allocator

    def stages(self) -> Stages:
        return Stages(scorer=self, protector=super().stages().protector, allocator=self.allocator_stage)


def compressed(
    model: Any,
    context: torch.Tensor,
    reading: torch.Tensor | None,
    keep: float,
    counts: list[torch.Tensor] | None = None,
) -> tuple[kvevict.EvictionCache, list[torch.Tensor]]:
    """A cache of ``context`` compressed at ``keep`` by KVzip's pool over ``reading``'s scores (None:
    KVzip's repeat), with another pass's per-head ``counts`` when given; and the counts it used."""
    cache = kvevict.EvictionCache(model, Policy(AnswerReading(reading, CountsFrom(counts)), []), keep=keep)
    prefill(model, context, cache)
    return cache, cache.policy.allocator.recorded or counts  # (the cache holds its own copy of the policy)


def answered(model: Any, cache: kvevict.EvictionCache, tail: torch.Tensor, max_new_tokens: int) -> list[int]:
    """``cache``'s greedy answer after ``tail``; the cache is closed (freed) once it has answered."""
    try:
        return greedy_after(model, cache, tail, max_new_tokens, stop_tokens_of(model))
    finally:
        cache.close()


def run_sample(model: Any, tokenizer: Any, task: Any, sample: Any, keep: float) -> dict[str, list[int]]:
    """Each setting's answer tokens for one sample, and the full cache's (``full``)."""
    context, tail = split_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    length = sample.max_new_tokens or task.tokens_to_generate
    with torch.inference_mode():
        full = kvevict.EvictionCache(model, "full")
        prefill(model, context, full)
        answers = {"full": answered(model, full, tail, length)}
        reading = torch.cat([tail, torch.tensor([answers["full"]])], dim=-1)
        kvzip, kvzip_counts = compressed(model, context, None, keep)
        answers["kvzip"] = answered(model, kvzip, tail, length)
        oracle, oracle_counts = compressed(model, context, reading, keep)
        answers["answer"] = answered(model, oracle, tail, length)
        answers["counts=kvzip"] = answered(
            model, compressed(model, context, reading, keep, kvzip_counts)[0], tail, length
        )
        answers["counts=answer"] = answered(
            model, compressed(model, context, None, keep, oracle_counts)[0], tail, length
        )
    return answers


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tasks", help="comma-separated offline tasks (see `kvevict tasks`)")
    parser.add_argument("--keep", type=float, default=0.1, help="share of the context kept (default 0.1)")
    parser.add_argument("--samples", type=int, default=4, help="samples per task (default 4)")
    parser.add_argument("--length", type=int, default=2048, help="prompt length in tokens (default 2048)")
    parser.add_argument("--model", default="smollm2", help="embedded model name or a local directory")
    parser.add_argument("--out", required=True, help="JSON lines file (appended; finished samples skipped)")
    args = parser.parse_args(argv)
    if not 0 < args.keep < 1:
        parser.error(f"--keep must be in (0, 1), got {args.keep}")
    from kvevict.bench.tasks import get_task

    out = Path(args.out)
    done = {(r["task"], r["index"]) for r in map(json.loads, out.read_text().splitlines())} if out.exists() else set()
    model, tokenizer = kvevict.load_model(args.model)
    jobs = [(name, get_task(name)) for name in args.tasks.split(",")]
    todo = [
        (name, task, sample)
        for name, task in jobs
        for sample in task.samples(tokenizer, length=args.length, count=args.samples, seed=0)
        if (name, sample.index) not in done
    ]
    for name, task, sample in tqdm(todo, desc="answer oracle", unit="sample"):
        answers = run_sample(model, tokenizer, task, sample, args.keep)
        texts = {key: tokenizer.decode(ids, skip_special_tokens=True) for key, ids in answers.items()}
        scores = {key: task.score(text, sample) for key, text in texts.items()}
        record = {"task": name, "index": sample.index, "keep": args.keep, "scores": scores, "predictions": texts}
        with out.open("a") as file:
            file.write(json.dumps(record) + "\n")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for setting in ("full", *SETTINGS):
        mean = 100 * sum(r["scores"][setting] for r in records) / max(1, len(records))
        print(f"{setting:>14}: {mean:5.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
