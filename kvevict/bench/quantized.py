"""``kvevict bench quant``: quantized storage (:mod:`kvevict.quant`) against transformers'
``QuantizedCache``, and eviction composed with quantization.

For each prompt of the offline tasks, the full cache's greedy answer is replayed teacher-forced
(:mod:`kvevict.bench.fidelity`) under every run, one token per pass as generation feeds it:

- the unquantized ``DynamicCache`` (the reference: its logits; its decode steps, each taken in
  turn with the run's, give the run's decode-step ratio);
- kvevict's ``full`` policy with ``quant=int8|int4|int2`` (KIVI: keys per channel, values per
  token, ``--group`` and ``--residual``);
- transformers' ``QuantizedCache`` with the quanto backend at the same bits (int4, int2: quanto
  has no int8), ``q_group_size=--group`` and ``residual_length=--residual``, when
  ``optimum-quanto`` imports (else those runs are left out and the table says so);
- each ``--policies`` policy at ``--keep``, unquantized and with each ``--quant``.

Each row: top-1 agreement and mean KL(reference ‖ run) over the answer positions, the KV bytes
held after the replay and their mean over its decode steps (kvevict: ``kv_bytes()``; a
transformers cache: every tensor its layers hold, quanto's packed codes, scales and shifts
included; the mean is what to compare, over a whole number of flushes: each cache flushes its
full-precision residual at its own step), and the median over decode steps of a step's time
over the paired ``DynamicCache`` step's. A benchmark, never a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache, PreTrainedModel, QuantizedCache

from kvevict.bench.fidelity import fidelity_metrics, reference_logits
from kvevict.bench.memory import MIB
from kvevict.bench.options import quant_list
from kvevict.bench.report import text_table
from kvevict.cache import EvictionCache
from kvevict.compat import with_cache
from kvevict.quant import BITS

PEER_BITS = (4, 2)
"""The bits transformers' quanto backend quantizes a cache to."""


@dataclass(frozen=True)
class QuantRun:
    """One cache to replay under: kvevict's (``policy`` at ``keep``, ``quant``) or, with ``peer``,
    transformers' ``QuantizedCache`` (quanto) at ``quant``'s bits."""

    policy: str = "full"
    keep: float | None = None
    quant: str | None = None
    peer: bool = False

    @property
    def label(self) -> str:
        if self.peer:
            return f"QuantizedCache quanto {self.quant}"
        size = "" if self.keep is None else f" keep {self.keep:g}"
        return f"kvevict {self.policy}{size} {self.quant or 'unquantized'}"


def quanto_available() -> bool:
    return importlib.util.find_spec("optimum.quanto") is not None


def plan(policies: Sequence[str], keep: float, quants: Sequence[str | None], peer: bool) -> list[QuantRun]:
    """``full`` with each quantization (and the peer at the same bits), then each policy at
    ``keep`` unquantized and with each quantization."""
    quantized = [quant for quant in quants if quant is not None]
    runs = [QuantRun(quant=quant) for quant in quantized]
    runs += [QuantRun(quant=quant, peer=True) for quant in quantized if peer and BITS[quant] in PEER_BITS]
    runs += [QuantRun(name, keep, quant) for name in policies for quant in dict.fromkeys([None, *quantized])]
    return runs


def make_cache(model: PreTrainedModel, run: QuantRun, group: int, residual: int) -> Cache:
    if run.peer:
        assert run.quant is not None
        return QuantizedCache(
            "quanto", model.config, nbits=BITS[run.quant], q_group_size=group, residual_length=residual
        )
    return EvictionCache(model, run.policy, keep=run.keep, quant=run.quant, quant_group=group, residual=residual)


def _tensor_bytes(x: torch.Tensor) -> int:
    """Bytes of ``x``, or of the tensors a tensor subclass holds (quanto's codes, scales, shifts)."""
    if hasattr(x, "__tensor_flatten__") and type(x) is not torch.Tensor:
        names, _ = x.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(x, name)) for name in names)
    return x.numel() * x.element_size()


def cache_bytes(cache: Cache) -> int:
    """KV bytes ``cache`` holds: kvevict's resident bytes, or every tensor of a transformers cache's layers."""
    if isinstance(cache, EvictionCache):
        return cache.kv_bytes()
    held = 0
    for layer in cache.layers:
        held += sum(_tensor_bytes(x) for x in vars(layer).values() if isinstance(x, torch.Tensor))
    return held


@torch.inference_mode()
def replay_paired(
    model: PreTrainedModel, cache: Cache, ids: torch.Tensor, answer: torch.Tensor
) -> tuple[torch.Tensor, list[float], list[int]]:
    """``answer`` ``[T]`` teacher-forced after ``ids`` one token per pass, through ``cache`` and,
    step by step in turn, an unquantized ``DynamicCache``: the ``[T, V]`` logits of ``cache``
    predicting each answer token, each decode pass's seconds over the paired DynamicCache pass's,
    and the KV bytes ``cache`` holds after the prompt and after each decode pass (:func:`cache_bytes`, not timed)."""
    reference = DynamicCache()
    model(input_ids=ids, **with_cache(reference))
    logits = [model(input_ids=ids, **with_cache(cache)).logits[0, -1:]]
    if isinstance(cache, EvictionCache):
        cache.end_prompt()
    ratios, held = [], [cache_bytes(cache)]
    for token in answer[:-1]:
        start = time.perf_counter()
        model(input_ids=token.view(1, 1), **with_cache(reference))
        middle = time.perf_counter()
        logits.append(model(input_ids=token.view(1, 1), **with_cache(cache)).logits[0, -1:])
        ratios.append((time.perf_counter() - middle) / (middle - start))
        held.append(cache_bytes(cache))
    return torch.cat(logits), ratios, held


@torch.inference_mode()
def greedy_answer(model: PreTrainedModel, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The full cache's greedy answer ``[new_tokens]``."""
    cache, tokens = DynamicCache(), []
    logits = model(input_ids=ids, **with_cache(cache)).logits[:, -1]
    for _ in range(new_tokens):
        tokens.append(logits.argmax(-1))
        logits = model(input_ids=tokens[-1].view(1, 1), **with_cache(cache)).logits[:, -1]
    return torch.cat(tokens)


def measure(
    model: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    runs: Sequence[QuantRun],
    *,
    new_tokens: int = 32,
    group: int = 32,
    residual: int = 32,
    progress: bool = True,
) -> list[dict[str, object]]:
    """One row per run (prompts pooled): ``top1``, ``kl``, ``kv_mib`` (after the replay) and
    ``mean_kv_mib`` (over its decode steps; after the prompt where there are none), each a mean over prompts,
    ``step_ratio`` (median over the decode steps of each step's time over the paired
    ``DynamicCache`` step's, :func:`replay_paired`), over the prompts the run's policy accepts
    (``prompts``: a ``keep=`` budget below a policy's windows is refused on a short prompt).
    ``progress``: a bar over prompts × runs."""
    from tqdm import tqdm

    totals: dict[str, dict[str, list[float]]] = {}
    bar = tqdm(total=len(prompts) * len(runs), desc="bench quant", unit="run", disable=not progress)
    for ids in prompts:
        ids = ids.to(model.device)
        answer = greedy_answer(model, ids, new_tokens)
        expected = reference_logits(model, ids, answer)
        for run in runs:
            total = totals.setdefault(run.label, {"top1": [], "kl": [], "kv": [], "mean_kv": [], "ratio": []})
            cache = make_cache(model, run, group, residual)
            bar.update()
            try:
                logits, ratios, held = replay_paired(model, cache, ids, answer)
            except ValueError:  # a policy refusing this prompt (a keep= budget below its windows): left out
                continue
            fidelity = fidelity_metrics(expected, logits, answer)
            total["top1"].append(fidelity.top1)
            total["kl"].append(fidelity.kl)
            total["kv"].append(held[-1])
            total["mean_kv"].append(statistics.fmean(held[1:] or held))
            total["ratio"] += ratios
            if isinstance(cache, EvictionCache):
                cache.close()
    bar.close()
    return [
        {
            "run": label,
            "prompts": len(total["top1"]),
            "top1": statistics.fmean(total["top1"]),
            "kl": statistics.fmean(total["kl"]),
            "kv_mib": statistics.fmean(total["kv"]) / MIB,
            "mean_kv_mib": statistics.fmean(total["mean_kv"]) / MIB,
            "step_ratio": statistics.median(total["ratio"]),
        }
        for label, total in totals.items()
        if total["top1"]
    ]


def format_table(rows: Sequence[dict[str, object]]) -> str:
    header = [
        "run",
        "prompts",
        "top-1 vs unquantized",
        "KL (nats)",
        "KV MiB",
        "mean KV MiB",
        "decode step / DynamicCache",
    ]
    body = [
        [
            str(r["run"]),
            str(r["prompts"]),
            f"{r['top1']:.3f}",
            f"{r['kl']:.4f}",
            f"{r['kv_mib']:.2f}",
            f"{r['mean_kv_mib']:.2f}",
            f"{r['step_ratio']:.2f}x",
        ]
        for r in rows
    ]
    return "\n".join(text_table(header, body))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvevict bench quant",
        description="Quantized storage against transformers' QuantizedCache (quanto), and eviction + quantization: "
        "top-1 agreement and KL against the unquantized cache, KV MiB, decode-step ratio.",
    )
    parser.add_argument("--model", default="smollm2", help="model name or path (default: the embedded smollm2)")
    parser.add_argument("--tasks", default="niah_single_1,longgen", help="offline tasks the prompts come from")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per task (default 2)")
    parser.add_argument("--length", type=int, default=1024, help="prompt length in tokens (default 1024)")
    parser.add_argument("--new-tokens", type=int, default=32, help="answer tokens replayed (default 32)")
    parser.add_argument("--quant", type=quant_list, default=("int8", "int4", "int2"), help="default int8,int4,int2")
    parser.add_argument("--group", type=int, default=32, help="quant group (tokens per key group, channels per value)")
    parser.add_argument("--residual", type=int, default=32, help="recent tokens at full precision (default 32)")
    parser.add_argument(
        "--policies", default="snapkv,kvzip,tova,lazyeviction", help="evicting policies composed with quantization"
    )
    parser.add_argument("--keep", type=float, default=0.25, help="fraction of the prompt kept (default 0.25)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated prompts (default 0)")
    return parser


def main(argv: Sequence[str]) -> int:
    from kvevict.bench.runner import PromptIds
    from kvevict.bench.tasks import get_task
    from kvevict.models import load_model
    from kvevict.policies import split_names

    args = build_parser().parse_args(argv)
    model, tokenizer = load_model(args.model)
    peer = quanto_available()
    prompts = []
    for task in split_names(args.tasks):
        samples = get_task(task).samples(tokenizer, length=args.length, count=args.prompts, seed=args.seed)
        prompts += [PromptIds.of(tokenizer, sample).ids for sample in samples]
    runs = plan(split_names(args.policies), args.keep, args.quant, peer)
    rows = measure(model, prompts, runs, new_tokens=args.new_tokens, group=args.group, residual=args.residual)
    print(format_table(rows))
    if not peer:
        print(
            "optimum-quanto is not installed: transformers' QuantizedCache runs left out (pip install optimum-quanto)"
        )
    return 0
