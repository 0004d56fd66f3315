"""``kvevict bench throughput``: sequences served per second under a KV memory cap.

For each setting (policy × budget or keep; the full cache always runs first, as the
reference) ``N`` prompts are served by one loop of continuous batching:

* **Admission.** A prompt is admitted while the KV memory of the running batch, reserved to
  the end of every running sequence (what each row holds now plus one entry per head and
  layer for each token it still has to feed), plus the new prompt's prefill transient and
  its own decode growth, fits in ``--memory-cap``. The prefill transient is the whole
  prompt when it is prefilled in one pass, and the most entries a head held while an
  earlier prompt of the setting was prefilled in chunks (``EvictionCache.peak_entries``;
  ``budget + chunk`` under a uniform allocation). A prompt is prefilled in one pass (the
  fastest) when that fits, else in chunks of ``--prefill-chunk`` where the policy can score
  a prompt chunk by chunk and that admits it.
* **Compression.** Each admitted prompt is prefilled alone into a batch-1
  :class:`~kvevict.cache.EvictionCache` (compressed under the policy), then spliced into the
  running batch (``EvictionCache.splice``): into the slot of a finished sequence, or as a
  new row.
* **Decoding.** The running sequences decode together, one greedy token per row and step,
  each at its own position; a finished sequence (``--new-tokens`` tokens) frees its slot.

KV memory is computed from the tensors the caches hold: the entries of each row (its
longest head, for all its heads, every layer: ``EvictionCache.row_bytes``), plus the
prefill transient; ``peak_kv_bytes`` is the most held at any moment (within a decode step,
before it evicts; within a prefill, at its peak). Storage slack (preallocated columns) and
activations are not counted. Quality: top-1 agreement of each sequence's greedy tokens with
the full cache's, position by position, averaged over the sequences.

One JSON line per setting in ``OUT/throughput.jsonl``, written when the setting finished;
a rerun skips finished settings. A benchmark, never a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvevict.bench.memory import MIB
from kvevict.bench.options import comma_separated, quant_list
from kvevict.bench.report import text_table
from kvevict.cache import EvictionCache
from kvevict.compat import with_cache
from kvevict.figures import pyplot, save_figure
from kvevict.generation import prefill
from kvevict.policies import make_policy

RESULTS_FILE = "throughput.jsonl"


@dataclass(frozen=True)
class Setting:
    """One policy at one budget (tokens per KV head) or keep (fraction of the prompt)."""

    policy: str
    budget: int | None = None
    keep: float | None = None
    quant: str | None = None

    @property
    def label(self) -> str:
        size = f"budget {self.budget}" if self.budget is not None else f"keep {self.keep}" if self.keep else ""
        return f"{self.policy}{'' if self.quant is None else '+' + self.quant} {size}".strip()


@dataclass(frozen=True)
class ThroughputConfig:
    """What every setting of a run shares (and what identifies its records)."""

    model: str
    task: str
    prompts: int
    length: int
    new_tokens: int
    memory_cap_mib: float
    prefill_chunk: int | None = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompts", "length", "new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not math.isfinite(self.memory_cap_mib) or self.memory_cap_mib <= 0:
            raise ValueError(f"the memory cap must be a positive number of MiB, got {self.memory_cap_mib}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"the prefill chunk must be a positive number of tokens, got {self.prefill_chunk}")

    @property
    def cap_bytes(self) -> int:
        return int(self.memory_cap_mib * MIB)


def settings(
    policies: Sequence[str], budgets: Sequence[int] = (), keeps: Sequence[float] = (), quants: Sequence[str | None] = ()
) -> list[Setting]:
    """The full cache (the reference, always first), then every evicting policy at every size."""
    evicting = [name for name in policies if name != "full"]
    if evicting and not budgets and not keeps:
        raise ValueError("evicting policies need --budgets (tokens per KV head) or --keep (fractions of the prompt)")
    if budgets and keeps:
        raise ValueError("give --budgets or --keep, not both")
    for name in evicting:
        make_policy(name)  # an unknown or refused spelling fails before anything runs
    sizes = [{"budget": b} for b in budgets] + [{"keep": k} for k in keeps]
    runs = [Setting("full"), *(Setting(name, **size) for name in evicting for size in sizes)]
    return [Setting(s.policy, s.budget, s.keep, quant) for quant in quants or (None,) for s in runs]


def token_bytes(model: PreTrainedModel) -> int:
    """Bytes of one token's keys and values, every KV head of every layer."""
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * model.dtype.itemsize


def _chunk_for(setting: Setting, chunk: int | None, cache: EvictionCache, length: int) -> int | None:
    """The prefill chunk ``setting`` may use: where the policy scores a prompt chunk by chunk and
    its budget plus a chunk holds less than the whole prompt (None: one pass only). A decode-time
    policy that evicts later chunks holds the first one whole, so it takes chunks of at most its
    budget (:class:`~kvevict.policies.selection.PromptKeeping`)."""
    policy = cache.policy
    if chunk is None or setting.policy == "full" or policy.deferred_prefill or not policy.evicts_in("prefill", True):
        return None
    budget = cache.budget.resolve(length)
    if budget is None or budget + chunk >= length:
        return None
    return chunk if policy.evicts_in("prefill") or chunk <= budget else None


def _chunk_peak(cache: EvictionCache, length: int, chunk: int, measured: int) -> int:
    """Entries per head a chunked prefill will hold at most: ``budget + chunk`` under a uniform
    allocation; else the most an earlier chunked prefill of the setting held (the whole prompt
    before any was measured: layer- and head-wise budgets exceed the budget on some heads)."""
    if measured:
        return measured
    if cache.policy.allocator.name == "uniform":
        return min(length, cache.budget.resolve(length) + chunk)
    return length


@dataclass
class _Served:
    """Counters of one setting's run."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    peak_bytes: int = 0
    max_batch: int = 0
    prefill_peak: int = 0
    """Most entries per head a chunked prefill of this setting held (the next one's prediction)."""


@torch.inference_mode()
def serve(
    model: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    setting: Setting,
    new_tokens: int,
    cap_bytes: int,
    chunk: int | None = None,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Generate ``new_tokens`` greedy tokens after each prompt ``[1, n]`` under ``cap_bytes`` of
    KV memory (module docstring); returns the tokens of each prompt and the run's figures."""
    per_token = token_bytes(model)
    budget = {} if setting.policy == "full" else {"budget": setting.budget, "keep": setting.keep}
    pending = list(range(len(prompts)))
    outputs: list[list[int]] = [[] for _ in prompts]
    batch: EvictionCache | None = None
    slots: list[int | None] = []  # the sequence each batch row serves (None: finished, free)
    served, chunks = _Served(), [None] * len(prompts)
    start = time.perf_counter()

    def held() -> int:
        rows = batch.row_bytes() if batch is not None else []
        return sum(allocated for (allocated, _), seq in zip(rows, slots) if seq is not None)

    def reserved() -> int:
        return held() + sum(new_tokens - len(outputs[seq]) for seq in slots if seq is not None) * per_token

    def retire() -> None:
        """Free the slots of finished sequences (the whole batch once none runs)."""
        nonlocal batch, slots
        slots = [None if seq is None or len(outputs[seq]) >= new_tokens else seq for seq in slots]
        if batch is not None and all(seq is None for seq in slots):
            batch.close()
            batch, slots = None, []

    while pending or slots:
        retire()
        while pending:  # admit while the cap holds the running batch, the prefill transient and the newcomer's growth
            ids = prompts[pending[0]]
            cache = EvictionCache(model, setting.policy, prompt_length=ids.shape[-1], quant=setting.quant, **budget)
            chunk_used, transient = None, ids.shape[-1]  # one pass (fastest) while the whole prompt fits
            chunkable = _chunk_for(setting, chunk, cache, ids.shape[-1])
            if reserved() + (transient + new_tokens) * per_token > cap_bytes and chunkable is not None:
                chunk_used, transient = chunkable, _chunk_peak(cache, ids.shape[-1], chunkable, served.prefill_peak)
            if reserved() + (transient + new_tokens) * per_token > cap_bytes:
                cache.close()
                if any(seq is not None for seq in slots):
                    break  # wait for a running sequence to finish
                raise ValueError(
                    f"the memory cap ({cap_bytes / MIB:.1f} MiB) holds no {setting.label} sequence: one needs "
                    f"{(transient + new_tokens) * per_token / MIB:.1f} MiB ({transient} prompt entries per head "
                    f"+ {new_tokens} new tokens)"
                )
            seq = pending.pop(0)
            before, tick = held(), time.perf_counter()
            logits = prefill(model, ids, cache, chunk=chunk_used)
            served.prefill_s += time.perf_counter() - tick
            served.prompt_tokens += ids.shape[-1]
            served.peak_bytes = max(served.peak_bytes, before + cache.peak_entries() * per_token)
            if chunk_used is not None:
                served.prefill_peak = max(served.prefill_peak, cache.peak_entries())
            chunks[seq] = chunk_used
            outputs[seq].append(int(logits[0].argmax()))
            if batch is None:
                batch, slots = cache, [seq]
            else:
                row = slots.index(None) if None in slots else len(slots)
                batch.splice(row, cache)  # the finished sequence's slot, or a new row
                cache.close()
                slots[row : row + 1] = [seq]
            served.max_batch = max(served.max_batch, sum(seq is not None for seq in slots))
        retire()
        free = [row for row, seq in enumerate(slots) if seq is None]
        if free:  # no newcomer fits into these slots now
            batch.remove_rows(free)
            slots = [seq for seq in slots if seq is not None]
        if not slots:
            continue
        tokens = torch.tensor([[outputs[seq][-1]] for seq in slots], device=model.device)
        served.peak_bytes = max(served.peak_bytes, held() + len(slots) * per_token)  # appended, not yet evicted
        tick = time.perf_counter()
        logits = model(input_ids=tokens, position_ids=batch.next_positions(), **with_cache(batch)).logits[:, -1]
        served.decode_s += time.perf_counter() - tick
        for seq, token in zip(slots, logits.argmax(-1).tolist()):
            outputs[seq].append(token)
    seconds = time.perf_counter() - start
    generated = len(prompts) * new_tokens
    figures = {
        "sequences": len(prompts),
        "max_batch": served.max_batch,
        "peak_kv_bytes": served.peak_bytes,
        "prefill_chunk": max((c for c in chunks if c is not None), default=None),
        "prefill_chunks": chunks,  # per sequence: None where it was prefilled in one pass
        "prompt_tokens": served.prompt_tokens,
        "prefill_tokens_per_s": served.prompt_tokens / served.prefill_s,
        "decode_tokens_per_s": (generated - len(prompts)) / served.decode_s if served.decode_s else None,
        "tokens_per_s": generated / seconds,
        "seconds": seconds,
        "prefill_seconds": served.prefill_s,
        "decode_seconds": served.decode_s,
    }
    return outputs, figures


def agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """Top-1 agreement: the share of positions where each sequence's greedy token is the reference's."""
    same = [a == b for out, ref in zip(outputs, reference, strict=True) for a, b in zip(out, ref, strict=True)]
    return sum(same) / len(same)


class ThroughputStore:
    """``OUT/throughput.jsonl``: one line per finished setting, flushed at once."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / RESULTS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = self.path.read_text(encoding="utf-8").splitlines() if self.path.exists() else []
        self.records = [json.loads(line) for line in lines if line.strip().endswith("}")]

    def get(self, identity: dict[str, Any]) -> dict[str, Any] | None:
        return next((r for r in self.records if all(r.get(k) == v for k, v in identity.items())), None)

    def add(self, record: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")
            out.flush()
            os.fsync(out.fileno())
        self.records.append(record)


def identity(config: ThroughputConfig, setting: Setting) -> dict[str, Any]:
    """What identifies a setting's record (a rerun of the same command skips it)."""
    fields = {**asdict(config), **asdict(setting)}
    return {"prefill_chunk_option" if k == "prefill_chunk" else k: v for k, v in fields.items()}


def task_prompts(config: ThroughputConfig, tokenizer: PreTrainedTokenizerBase) -> list[torch.Tensor]:
    """The token ids of ``config.prompts`` samples of ``config.task`` (context, question and answer prefix)."""
    from kvevict.bench.runner import PromptIds
    from kvevict.bench.tasks import get_task

    samples = get_task(config.task).samples(tokenizer, length=config.length, count=config.prompts, seed=config.seed)
    return [PromptIds.of(tokenizer, sample).ids for sample in samples]


def run_throughput(
    model: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    config: ThroughputConfig,
    runs: Sequence[Setting],
    out: str | Path,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Serve ``prompts`` under every setting (the full cache first), into ``out``; returns the records."""
    from tqdm import tqdm

    if len(prompts) != config.prompts:
        raise ValueError(f"{len(prompts)} prompts given, the configuration says {config.prompts}")
    store = ThroughputStore(out)
    runs = [Setting("full"), *(s for s in runs if s != Setting("full"))]
    records = []
    for setting in tqdm(runs, desc="bench throughput", unit="setting", disable=not progress):
        record = store.get(identity(config, setting))
        if record is None:
            outputs, figures = serve(model, prompts, setting, config.new_tokens, config.cap_bytes, config.prefill_chunk)
            reference = outputs if setting == Setting("full") else records[0]["outputs"]
            record = {**identity(config, setting), **figures, "quality": agreement(outputs, reference)}
            record["outputs"] = outputs
            store.add(record)
        records.append(record)
    return records


def format_table(records: Sequence[dict[str, Any]]) -> str:
    full = next(r for r in records if r["policy"] == "full")
    rows = []
    for r in records:
        size = "-" if r["policy"] == "full" else str(r["budget"] if r["budget"] is not None else f"keep {r['keep']}")
        rows.append(
            [
                r["policy"] + (f"+{r['quant']}" if r.get("quant") else ""),
                size,
                str(r["prefill_chunk"] or "-"),
                str(r["max_batch"]),
                f"{r['peak_kv_bytes'] / MIB:.1f}",
                f"{r['prefill_tokens_per_s']:.0f}",
                "-" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.1f}",
                f"{r['tokens_per_s']:.2f}",
                f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}x",
                _share(r),
                f"{r['quality']:.3f}",
            ]
        )
    header = ["policy", "budget", "chunk", "max batch", "peak KV MiB", "prefill tok/s", "decode tok/s"]
    header += ["tok/s", "vs full", "prefill share", "top-1 agreement"]
    cap = records[0]["memory_cap_mib"]
    title = f"throughput under {cap:g} MiB of KV, {records[0]['prompts']} prompts of ~{records[0]['length']} tokens"
    return "\n".join([f"{title}, {records[0]['new_tokens']} new tokens each", *text_table(header, rows)])


def _share(record: dict[str, Any]) -> str:
    """The share of the run's time spent prefilling. Prefill is the same work under every
    policy, so ``1 / share`` of the full cache bounds what any policy's ratio can reach."""
    if "prefill_seconds" not in record:  # a record written before this figure existed
        return "-"
    return f"{record['prefill_seconds'] / record['seconds']:.0%}"


def plot(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """End-to-end tokens/s and top-1 agreement vs budget (or keep), one line per policy; full dashed."""
    plt = pyplot()
    figure, (speed, quality) = plt.subplots(1, 2, figsize=(10, 4))
    full = next(r for r in records if r["policy"] == "full")
    for name in dict.fromkeys(r["policy"] for r in records if r["policy"] != "full"):
        points = sorted(
            (r["budget"] if r["budget"] is not None else r["keep"], r["tokens_per_s"], r["quality"])
            for r in records
            if r["policy"] == name
        )
        sizes, speeds, qualities = zip(*points)
        speed.plot(sizes, speeds, marker="o", label=name)
        quality.plot(sizes, qualities, marker="o", label=name)
    speed.axhline(full["tokens_per_s"], color="grey", linestyle="--", label="full")
    quality.axhline(1.0, color="grey", linestyle="--", label="full")
    xlabel = "keep (fraction of the prompt)" if any(r["keep"] for r in records) else "budget (tokens per KV head)"
    speed.set(xlabel=xlabel, ylabel="tokens / s (end to end)", title=f"under {full['memory_cap_mib']:g} MiB of KV")
    quality.set(xlabel=xlabel, ylabel="top-1 agreement with full", ylim=(0, 1.05))
    speed.legend()
    return save_figure(figure, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvevict bench throughput",
        description="Serve N prompts under a KV memory cap with continuous batching, per policy and budget: "
        "admission counting the prefill transient, chunked prefill where it admits more, finished sequences' "
        "slots refilled. One JSON line per setting in OUT/throughput.jsonl (resumable), a table, OUT/throughput.png.",
    )
    parser.add_argument("--model", default="smollm2", help="model name or path (default: the embedded smollm2)")
    parser.add_argument("--task", default="niah_single_1", help="offline task the prompts come from")
    parser.add_argument("--prompts", type=int, default=8, help="prompts to serve per setting (default 8)")
    parser.add_argument("--length", type=int, default=2048, help="prompt length in tokens (default 2048)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    parser.add_argument("--memory-cap", type=float, default=512, help="KV memory cap in MiB (default 512)")
    parser.add_argument("--policies", default="full,snapkv", help="comma-separated policies (full always runs)")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument(
        "--budgets",
        type=comma_separated(int),
        default=(),
        help="comma-separated budgets (tokens per KV head per layer)",
    )
    sizes.add_argument(
        "--keep", type=comma_separated(float), default=(), help="comma-separated fractions of the prompt to keep"
    )
    parser.add_argument(
        "--prefill-chunk", type=int, default=256, help="chunked prefill where it admits more (0: never; default 256)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated prompts (default 0)")
    parser.add_argument("--out", type=Path, required=True, help="results directory (created; resumed if it exists)")
    parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    parser.add_argument("--quant", type=quant_list, default=(), help="also run every setting quantized: none,int4,...")
    return parser


def main(argv: Sequence[str]) -> int:
    from kvevict.models import load_model
    from kvevict.policies import split_names

    args = build_parser().parse_args(argv)
    runs = settings(split_names(args.policies), args.budgets, args.keep, args.quant)
    config = ThroughputConfig(
        model=args.model,
        task=args.task,
        prompts=args.prompts,
        length=args.length,
        new_tokens=args.new_tokens,
        memory_cap_mib=args.memory_cap,
        prefill_chunk=args.prefill_chunk or None,
        seed=args.seed,
    )
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    records = run_throughput(model, task_prompts(config, tokenizer), config, runs, args.out)
    print(format_table(records))
    print(f"results: {args.out / RESULTS_FILE}\nplot: {plot(records, args.out / 'throughput.png')}", flush=True)
    return 0
