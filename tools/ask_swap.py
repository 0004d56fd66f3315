"""Where a compressor loses on the documents of *compress once, ask many* (docs/fastkvzip.md, round 37).

Each document (RULER's noise with ``--questions`` needles, every one asked; ``kvevict bench throughput
--workload ask``'s documents) is compressed once per setting at ``--keep``, and each question is answered
from a copy of that compressed cache (saved and loaded, so no question sees another's tokens). Seven settings:

- ``kvzip`` and ``fastkvzip``: as a user gets them (one pool over every layer and head, no floor);
- ``gates ranking, kvzip counts``: each head keeps as many entries as ``kvzip`` gave it, the gates' best
  of them; ``kvzip ranking, gates counts`` the other way round (the allocation against the ranking);
- ``kvzip, needles first`` and ``fastkvzip, needles first``: the scorer's own, with every token of every
  needle sentence ranked above the rest in every head (what keeping the needles everywhere does);
- ``answers teacher``: the shipped gates' teacher as the scorer (``train-gates --teacher answers``: KVzip+'s
  scores with every question and its answer teacher-forced in place of the repeat), in KVzip's pool.

    python tools/ask_swap.py --documents 6 --keep 0.1 --out results/ask-swap.jsonl

A record per document is appended as it finishes; a rerun skips the finished ones. This is a
measurement, not a policy: ``needles first`` needs to know where the needles are.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from answer_oracle import CountsFrom, answered  # tools/ (the directory of this script)
from tqdm import tqdm

import kvevict
from kvevict.bench.documents import ManyNeedles, documents, score
from kvevict.bench.ruler import NEEDLE
from kvevict.gates.train import ReadingKVzip, answer_reading
from kvevict.generation import prefill, question_ids, split_prompt
from kvevict.policies.base import Method, Stages
from kvevict.policies.fastkvzip import FastKVzip
from kvevict.policies.kvzip import KVzip
from kvevict.policies.pipeline import Policy

SETTINGS = (
    "kvzip",
    "fastkvzip",
    "gates ranking, kvzip counts",
    "kvzip ranking, gates counts",
    "kvzip, needles first",
    "fastkvzip, needles first",
    "answers teacher",
)
FIRST = 10.0
"""Added to a needle token's score by ``needles first``: above any score the gates or KVzip give (≤ 1)."""


def variant(scorer: type[Method]) -> type[Method]:
    """``scorer`` with its pool given (``allocator``) and, optionally, the tokens at ``first``
    (absolute positions) ranked above the rest in every head."""

    class Variant(scorer):  # type: ignore[misc, valid-type]
        def __init__(self, allocator: CountsFrom, first: torch.Tensor | None = None, **params: object):
            super().__init__(**params)
            self.allocator_stage, self.first = allocator, first

        def stages(self) -> Stages:
            return Stages(scorer=self, protector=super().stages().protector, allocator=self.allocator_stage)

        def score(self, layer: Any, signals: Any) -> torch.Tensor:
            scores = super().score(layer, signals)
            if self.first is None:
                return scores
            return scores + FIRST * torch.isin(layer.positions, self.first.to(layer.device)).to(scores.dtype)

    Variant.__name__ = f"Swappable{scorer.__name__}"
    return Variant


GATES, REPEAT, READING = variant(FastKVzip), variant(KVzip), variant(ReadingKVzip)


def compressed(
    model: Any,
    context: torch.Tensor,
    scorer: type[Method],
    keep: float,
    counts: list[torch.Tensor] | None = None,
    first: torch.Tensor | None = None,
    **params: object,
) -> tuple[kvevict.EvictionCache, list[torch.Tensor]]:
    """``context`` ``[1, n]`` compressed at ``keep`` by ``scorer`` (:data:`GATES`, :data:`REPEAT` or
    :data:`READING`, with ``params``) in its pool, or in another pass's per-head ``counts``; and the counts it
    used."""
    cache = kvevict.EvictionCache(model, Policy(scorer(CountsFrom(counts), first, **params), []), keep=keep)
    with torch.inference_mode():
        prefill(model, context, cache)
    return cache, cache.policy.allocator.recorded or counts  # (the cache holds its own copy of the policy)


def needle_positions(tokenizer: Any, context: torch.Tensor, document: Sequence[Any]) -> torch.Tensor:
    """The positions in ``context`` of every token of the document's needle sentences."""
    text = tokenizer.decode(context[0])
    offsets = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    if len(offsets) != context.shape[1]:
        raise ValueError("the context does not tokenize back to itself; its needles cannot be located")
    kind = ManyNeedles(len(document)).value_type
    positions: list[int] = []
    for sample in document:
        sentence = NEEDLE.format(type_needle_v=kind, key=sample.metadata["keys"][0], value=sample.answers[0])
        start = text.index(sentence)
        end = start + len(sentence)
        positions += [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
    return torch.tensor(sorted(set(positions)))


def needles_held(cache: kvevict.EvictionCache, needles: torch.Tensor) -> dict[str, float]:
    """Where ``cache``'s entries went: the share of them on needle sentences (``on needles``), and the
    share of the needle tokens each head holds, averaged over every layer's heads (``needles per head``)."""
    kept = on_needles = 0
    per_head: list[float] = []
    for layer in cache.eviction_layers:
        positions = layer.positions[0]
        valid = torch.ones_like(positions, dtype=torch.bool) if layer.valid is None else layer.valid[0]
        for head, real in zip(positions, valid, strict=True):
            hit = torch.isin(head[real], needles).sum().item()
            kept, on_needles = kept + int(real.sum()), on_needles + hit
            per_head.append(hit / len(needles))
    return {"on needles": on_needles / kept, "needles per head": sum(per_head) / len(per_head)}


def tails(tokenizer: Any, document: Sequence[Any]) -> list[torch.Tensor]:
    """What follows the compressed document for each question (:func:`~kvevict.generation.question_ids`):
    the question, the end of the user turn, the generation prompt and the answer prefix, ``[1, t]`` each."""
    return [question_ids(tokenizer, sample.question, sample.answer_prefix) for sample in document]


def readings(tokenizer: Any, document: Sequence[Any], asked: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What the answers teacher reads of a document, as ``train-gates`` builds it
    (:func:`~kvevict.gates.train.answer_reading`): each question's tail in ``asked``, then its answer."""
    return [answer_reading(tokenizer, tail, sample.answers) for tail, sample in zip(asked, document, strict=True)]


def answers(
    model: Any,
    tokenizer: Any,
    cache: kvevict.EvictionCache,
    document: Sequence[Any],
    asked: Sequence[torch.Tensor],
    scratch: Path,
    new_tokens: int,
) -> list[float]:
    """Each question's score, its answer at most ``new_tokens`` long after its tail in ``asked``, from a copy
    of ``cache`` (which is closed: freed)."""
    path = cache.save(scratch / "document.kv")
    cache.close()
    scores = []
    for sample, tail in zip(document, asked, strict=True):
        tokens = answered(model, kvevict.EvictionCache.load(path, model), tail, new_tokens)
        scores.append(score(tokenizer.decode(tokens, skip_special_tokens=True), sample))
    return scores


def run_document(
    model: Any, tokenizer: Any, document: Sequence[Any], keep: float, new_tokens: int = 16
) -> dict[str, dict[str, Any]]:
    """Every setting's scores on one document's questions (``scores``; answers of at most ``new_tokens``),
    and where its entries went (``held``, :func:`needles_held`)."""
    context, _ = split_prompt(tokenizer, document[0].context)
    needles = needle_positions(tokenizer, context, document)
    asked = tails(tokenizer, document)
    result: dict[str, dict[str, Any]] = {"scores": {}, "held": {}}
    with tempfile.TemporaryDirectory() as scratch:

        def ask(setting: str, build: Callable[[], tuple[kvevict.EvictionCache, Any]]) -> Any:
            cache, counts = build()
            result["held"][setting] = needles_held(cache, needles)
            result["scores"][setting] = answers(model, tokenizer, cache, document, asked, Path(scratch), new_tokens)
            return counts

        repeat_counts = ask("kvzip", lambda: compressed(model, context, REPEAT, keep))
        gates_counts = ask("fastkvzip", lambda: compressed(model, context, GATES, keep))
        ask("gates ranking, kvzip counts", lambda: compressed(model, context, GATES, keep, repeat_counts))
        ask("kvzip ranking, gates counts", lambda: compressed(model, context, REPEAT, keep, gates_counts))
        ask("kvzip, needles first", lambda: compressed(model, context, REPEAT, keep, first=needles))
        ask("fastkvzip, needles first", lambda: compressed(model, context, GATES, keep, first=needles))
        read = readings(tokenizer, document, asked)
        ask(
            "answers teacher",
            lambda: compressed(model, context, READING, keep, readings=read, plus=True, precision="fp32"),
        )
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=6, help="documents (default 6)")
    parser.add_argument("--questions", type=int, default=8, help="needles, each asked, per document (default 8)")
    parser.add_argument("--keep", type=float, default=0.1, help="share of the context kept (default 0.1)")
    parser.add_argument("--length", type=int, default=2048, help="document length in tokens (default 2048)")
    parser.add_argument("--new-tokens", type=int, default=16, help="answer tokens at most (default 16, as the bench)")
    parser.add_argument("--model", default="smollm2", help="embedded model name or a local directory")
    parser.add_argument("--out", required=True, help="JSON lines file (appended; finished documents skipped)")
    args = parser.parse_args(argv)
    if not 0 < args.keep < 1:
        parser.error(f"--keep must be in (0, 1), got {args.keep}")
    for name in ("documents", "questions", "length", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    out = Path(args.out)
    done = {r["document"] for r in map(json.loads, out.read_text().splitlines())} if out.exists() else set()
    model, tokenizer = kvevict.load_model(args.model)
    grouped = documents(tokenizer, length=args.length, count=args.documents, questions=args.questions)
    todo = [(i, document) for i, document in enumerate(grouped) if i not in done]
    for i, document in tqdm(todo, desc="ask swap", unit="document"):
        record = {
            "document": i,
            "keep": args.keep,
            **run_document(model, tokenizer, document, args.keep, args.new_tokens),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as file:
            file.write(json.dumps(record) + "\n")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    print(f"{'setting':>28}  score  entries on needles  needle tokens per head")
    for setting in SETTINGS:
        scores = [s for r in records for s in r["scores"][setting]]
        held = [r["held"][setting] for r in records]
        share, per_head = (
            100 * sum(h[k] for h in held) / max(1, len(held)) for k in ("on needles", "needles per head")
        )
        print(f"{setting:>28}  {100 * sum(scores) / max(1, len(scores)):5.1f}  {share:17.1f} %  {per_head:20.1f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
