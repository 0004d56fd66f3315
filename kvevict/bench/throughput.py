"""``kvevict bench throughput``: sequences served per second under a cap on resident KV memory.

For each setting (policy × budget or keep; the full cache always runs first, as the
reference) the jobs of one *workload* are served by continuous batching
(:mod:`kvevict.bench.serving`: admission by each row's ceiling, resident bytes):

* ``oneshot``: ``--prompts`` prompts of ``--length`` tokens from ``--task`` (a long context
  and its question), ``--new-tokens`` generated after each; prefilled in one pass, or in
  chunks of ``--prefill-chunk`` where only that admits them. Quality: top-1 agreement of each
  sequence's tokens with the full cache's, position by position.
* ``longgen``: ``--prompts`` short essay prompts (:mod:`kvevict.bench.longgen`) and long
  generations (``--new-tokens`` in the hundreds to thousands, no repeated 4-gram, no early
  end). The free-running agreement falls as soon as a sequence diverges once, so each record
  also carries **teacher-forced fidelity** (:func:`~kvevict.bench.fidelity.teacher_forced`):
  the full cache's sequences fed through the policy and the policy's fed through the full
  cache, top-1 agreement and KL at every generated position (``teacher_forced_top1``,
  ``teacher_forced_kl``: both directions' mean; ``teacher_forced`` has each).
* ``ask``: *compress once, ask many times*. ``--prompts`` documents of ``--length`` tokens,
  ``--questions`` needle questions each (:mod:`kvevict.bench.documents`); each document is
  compressed once, context-only, and every question answered from a copy of its compressed
  cache (the full cache's peer: prefix caching, the context computed once and copied).
  Reported: answers per second, the task score, resident KV MiB per compressed document.

``--new-tokens`` may list several lengths (``256,1024``): every setting runs at each, so the
ratio to the full cache can be read against generation length. One JSON line per setting and
length in ``OUT/throughput.jsonl``, written when it finished; a rerun skips finished ones.
A benchmark, never a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvevict.bench.memory import MIB
from kvevict.bench.options import comma_separated, device_option, quant_list
from kvevict.bench.report import text_table
from kvevict.bench.runner import Setting
from kvevict.bench.serving import Served, Server
from kvevict.bench.workloads import Document, Learned, Library, PromptJob, QuestionJob, setting_cache
from kvevict.figures import pyplot, save_figure
from kvevict.generation import stop_tokens_of
from kvevict.policies import make_policy
from kvevict.quant import QuantConfig
from kvevict.storage import ColumnBytes

RESULTS_FILE = "throughput.jsonl"
Workload = Literal["oneshot", "longgen", "ask"]
WORKLOADS: tuple[str, ...] = ("oneshot", "longgen", "ask")


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
    workload: Workload = "oneshot"
    questions: int = 8
    """Questions per document (``ask``)."""
    fidelity: bool = True
    """Teacher-forced fidelity of every ``longgen`` setting (two extra forced decodes, untimed)."""

    def __post_init__(self) -> None:
        for name in ("prompts", "length", "new_tokens", "questions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not math.isfinite(self.memory_cap_mib) or self.memory_cap_mib <= 0:
            raise ValueError(f"the memory cap must be a positive number of MiB, got {self.memory_cap_mib}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"the prefill chunk must be a positive number of tokens, got {self.prefill_chunk}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}: choose one of {', '.join(WORKLOADS)}")

    @property
    def cap_bytes(self) -> int:
        return int(self.memory_cap_mib * MIB)


def settings(
    policies: Sequence[str], budgets: Sequence[int] = (), keeps: Sequence[float] = (), quants: Sequence[str | None] = ()
) -> list[Setting]:
    """The full cache (the reference, always first), then every evicting policy at every size;
    each of them again per quantization in ``quants`` (None: unquantized)."""
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


def estimate_column_bytes(model: PreTrainedModel, quant: str | None = None) -> list[ColumnBytes]:
    """Per layer, what one row's entries hold before a cache has shown its own: per column keys
    and values plus each KV head's position (int64) and validity (bool), and with ``quant``
    (``EvictionCache``'s default group and residual) the codes instead between passes
    (:class:`~kvevict.storage.ColumnBytes`); per-token policy state joins once the first cache
    of a setting is built."""
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    layers = config.num_hidden_layers
    dense = token_bytes(model) // layers + heads * (8 + 1)
    quantized = QuantConfig.make(quant, None, None, head_dim)
    return [ColumnBytes.of(dense, heads, head_dim, model.dtype.itemsize, quantized)] * layers


def agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """Top-1 agreement: the share of positions where each sequence's greedy token is the reference's."""
    same = [a == b for out, ref in zip(outputs, reference, strict=True) for a, b in zip(out, ref)]
    return sum(same) / max(len(same), 1)


def _figures(served: Served, jobs: int, prompt_tokens: int) -> dict[str, Any]:
    generated = sum(len(out) for out in served.outputs)
    return {
        "sequences": jobs,
        "max_batch": served.max_batch,
        "mean_batch": sum(served.batch_sizes) / len(served.batch_sizes) if served.batch_sizes else 0.0,
        "peak_kv_bytes": served.peak_bytes,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_per_s": prompt_tokens / served.prefill_s if served.prefill_s else None,
        "decode_steps": served.decode_steps,
        "decode_tokens_per_s": (generated - jobs) / served.decode_s if served.decode_s else None,
        "tokens_per_s": generated / served.seconds,
        "seconds": served.seconds,
        "prefill_seconds": served.prefill_s,
        "decode_seconds": served.decode_s,
    }


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
    """The token ids of ``config.prompts`` samples of the workload's task (``longgen``'s essay
    prompts for the long-generation workload; context, question and answer prefix otherwise)."""
    from kvevict.bench.runner import PromptIds
    from kvevict.bench.tasks import get_task

    task = "longgen" if config.workload == "longgen" else config.task
    samples = get_task(task).samples(tokenizer, length=config.length, count=config.prompts, seed=config.seed)
    return [PromptIds.of(tokenizer, sample).ids for sample in samples]


def ask_documents(config: ThroughputConfig, tokenizer: PreTrainedTokenizerBase) -> list[Document]:
    """``config.prompts`` documents with ``config.questions`` questions each (the ``ask`` workload)."""
    from kvevict.bench.documents import documents
    from kvevict.bench.runner import PromptIds

    grouped = documents(
        tokenizer, length=config.length, count=config.prompts, questions=config.questions, seed=config.seed
    )
    built = []
    for samples in grouped:
        prompts = [PromptIds.of(tokenizer, sample) for sample in samples]
        context = prompts[0].head
        tails = [prompt.ids[:, context.shape[-1] :] for prompt in prompts]
        built.append(Document(context, tails, samples))
    return built


def workload_inputs(config: ThroughputConfig, tokenizer: PreTrainedTokenizerBase) -> list[Any]:
    """What the configuration's workload serves: prompts, or documents with their questions."""
    return ask_documents(config, tokenizer) if config.workload == "ask" else task_prompts(config, tokenizer)


def serve_setting(
    model: PreTrainedModel,
    inputs: Sequence[Any],
    config: ThroughputConfig,
    setting: Setting,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Serve the workload's jobs under ``setting``; returns each job's tokens and the figures."""
    from kvevict.bench.workloads import EssayTokens

    learned = Learned()
    if config.workload == "ask":
        library = Library(model, inputs, setting, learned)
        jobs = [
            QuestionJob(library, d, q, config.new_tokens)
            for d, doc in enumerate(inputs)
            for q in range(len(doc.questions))
        ]
        server = Server(model, config.cap_bytes, stop_tokens=stop_tokens_of(model), shared_bytes=library.resident_bytes)
        prompt_tokens = sum(doc.context.shape[-1] + sum(q.shape[-1] for q in doc.questions) for doc in inputs)
    else:
        jobs = [PromptJob(model, ids, setting, config.new_tokens, learned, config.prefill_chunk) for ids in inputs]
        essay = EssayTokens(banned=stop_tokens_of(model)) if config.workload == "longgen" else None
        server = Server(model, config.cap_bytes, next_tokens=essay)
        prompt_tokens = sum(ids.shape[-1] for ids in inputs)
    served = server.serve(jobs, estimate_column_bytes(model, setting.quant))
    figures = _figures(served, len(jobs), prompt_tokens)
    if config.workload == "ask":
        figures |= _answers(served, inputs, library, tokenizer)
    else:
        figures["prefill_chunks"] = learned.chunks  # per sequence: None where it was prefilled in one pass
        figures["prefill_chunk"] = max((c for c in learned.chunks if c is not None), default=None)
    return served.outputs, figures


def _answers(served: Served, documents: Sequence[Document], library: Library, tokenizer) -> dict[str, Any]:
    """The ``ask`` workload's figures: answers per second, the task score, KV per document."""
    from kvevict.bench.documents import score

    if tokenizer is None:
        raise ValueError("the ask workload scores answers, which needs the model's tokenizer")
    samples = [sample for doc in documents for sample in doc.samples]
    answers = [tokenizer.decode(tokens, skip_special_tokens=True).strip() for tokens in served.outputs]
    scores = [score(answer, sample) for answer, sample in zip(answers, samples, strict=True)]
    return {
        "answers": len(answers),
        "answers_per_s": len(answers) / served.seconds,
        "score": 100 * sum(scores) / len(scores),
        "kv_bytes_per_document": sum(library.document_bytes) / len(library.document_bytes),
        "predictions": answers,
    }


def _teacher_forced(
    model: PreTrainedModel, prompts: Sequence[torch.Tensor], setting: Setting, outputs: list, reference: list
) -> dict[str, Any]:
    """Both directions of teacher-forced fidelity against the full cache (the full cache: 1 and 0)."""
    from kvevict.bench.fidelity import teacher_forced

    if setting.policy == "full":
        directions = {"full_through_policy": (1.0, 0.0), "policy_through_full": (1.0, 0.0)}
    else:
        length = max(ids.shape[-1] for ids in prompts)
        rows = teacher_forced(
            model, [*prompts, *prompts], [*reference, *outputs], lambda: setting_cache(setting, model, length)
        )
        n = len(prompts)
        directions = {
            name: (sum(a for a, _ in part) / n, sum(k for _, k in part) / n)
            for name, part in (("full_through_policy", rows[:n]), ("policy_through_full", rows[n:]))
        }
    top1 = sum(a for a, _ in directions.values()) / 2
    kl = sum(k for _, k in directions.values()) / 2
    detail = {name: {"top1": a, "kl": k} for name, (a, k) in directions.items()}
    return {"teacher_forced_top1": top1, "teacher_forced_kl": kl, "teacher_forced": detail}


def run_throughput(
    model: PreTrainedModel,
    inputs: Sequence[Any],
    config: ThroughputConfig,
    runs: Sequence[Setting],
    out: str | Path,
    progress: bool = True,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> list[dict[str, Any]]:
    """Serve the workload's ``inputs`` (prompts ``[1, n]``, or :class:`Document` for ``ask``)
    under every setting (the full cache first), into ``out``; returns the records."""
    from tqdm import tqdm

    if len(inputs) != config.prompts:
        raise ValueError(f"{len(inputs)} prompts given, the configuration says {config.prompts}")
    store = ThroughputStore(out)
    runs = [Setting("full"), *(s for s in runs if not s.reference)]
    records: list[dict[str, Any]] = []
    for setting in tqdm(runs, desc=f"bench throughput ({config.workload})", unit="setting", disable=not progress):
        record = store.get(identity(config, setting))
        if record is None:
            outputs, figures = serve_setting(model, inputs, config, setting, tokenizer)
            reference = outputs if setting.reference else records[0]["outputs"]
            record = {**identity(config, setting), **figures, "quality": agreement(outputs, reference)}
            if config.workload == "longgen" and config.fidelity:
                record |= _teacher_forced(model, inputs, setting, outputs, reference)
            record["outputs"] = outputs
            store.add(record)
        records.append(record)
    return records


def _name(record: dict[str, Any]) -> str:
    """The policy, and its quantization if any."""
    return record["policy"] + (f"+{record['quant']}" if record.get("quant") else "")


def _size(record: dict[str, Any]) -> str:
    if record["policy"] == "full":
        return "-"
    return str(record["budget"]) if record["budget"] is not None else f"keep {record['keep']:g}"


def _rate(record: dict[str, Any]) -> float:
    """What a workload serves per second: answers (``ask``), else tokens, end to end."""
    return record["answers_per_s"] if record.get("workload") == "ask" else record["tokens_per_s"]


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """One table per generation length, every setting a row, its rate against the full cache's."""
    first = records[0]
    workload = first.get("workload", "oneshot")
    header = ["policy", "budget", "max batch", "mean batch", "peak KV MiB"]
    if workload == "ask":
        header += ["KV MiB / doc", "answers/s", "vs full", "prefill share", "score"]
    else:
        header += ["chunk", "decode tok/s", "tok/s", "vs full", "prefill share", "top-1 free"]
        header += ["top-1 forced", "KL forced"] if workload == "longgen" else []
    lines = []
    for length in dict.fromkeys(r["new_tokens"] for r in records):
        group = [r for r in records if r["new_tokens"] == length]
        full = next(r for r in group if r["policy"] == "full")
        rows = []
        for r in group:
            cells = [_name(r), _size(r), str(r["max_batch"]), f"{r.get('mean_batch', 0):.1f}"]
            cells.append(f"{r['peak_kv_bytes'] / MIB:.1f}")
            if workload == "ask":
                cells += [f"{r['kv_bytes_per_document'] / MIB:.2f}", f"{r['answers_per_s']:.2f}"]
                cells += [f"{_rate(r) / _rate(full):.2f}x", _share(r), f"{r['score']:.1f}"]
            else:
                decode = "-" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.1f}"
                cells += [str(r["prefill_chunk"] or "-"), decode, f"{r['tokens_per_s']:.2f}"]
                cells += [f"{_rate(r) / _rate(full):.2f}x", _share(r), f"{r['quality']:.3f}"]
                if workload == "longgen":
                    forced = r.get("teacher_forced_top1")
                    cells += ["-", "-"] if forced is None else [f"{forced:.3f}", f"{r['teacher_forced_kl']:.3f}"]
            rows.append(cells)
        unit = f"{first['questions']} questions per document" if workload == "ask" else "prompts"
        tokens = first["length"] if workload == "ask" else round(first["prompt_tokens"] / first["sequences"])
        title = (
            f"{workload} under {first['memory_cap_mib']:g} MiB of resident KV: {first['prompts']} "
            f"{'documents' if workload == 'ask' else unit} of ~{tokens} tokens"
            + (f", {unit}" if workload == "ask" else "")
            + f", {length} new tokens each"
        )
        lines += [title, *text_table(header, rows), ""]
    return "\n".join(lines).rstrip()


def _share(record: dict[str, Any]) -> str:
    """The share of the run's time spent prefilling (``ask``: the documents and the questions).
    Prefill is the same work under every policy, so ``1 / share`` of the full cache bounds what
    any policy's ratio can reach."""
    return f"{record['prefill_seconds'] / record['seconds']:.0%}"


def _quality(record: dict[str, Any]) -> float:
    """The workload's quality figure in [0, 1]: the score (``ask``), teacher-forced top-1
    (``longgen``, where measured), else top-1 agreement with the full cache."""
    if record.get("workload") == "ask":
        return record["score"] / 100
    return record.get("teacher_forced_top1", record["quality"])


def plot(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Rate against the full cache and quality, one bar per setting, each named on its axis
    (and, with several generation lengths, the ratio against length, one line per setting)."""
    plt = pyplot()
    lengths = list(dict.fromkeys(r["new_tokens"] for r in records))
    panels = 3 if len(lengths) > 1 else 2
    figure, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.2))
    last = [r for r in records if r["new_tokens"] == lengths[-1]]
    full = next(r for r in last if r["policy"] == "full")
    labels = [f"{_name(r)}\n{_size(r)}" if r["policy"] != "full" else _name(r) for r in last]
    colors = ["grey" if r is full else "tab:green" for r in last]
    unit = "answers" if records[0].get("workload") == "ask" else "tokens"
    for axis, values, ylabel in (
        (axes[0], [_rate(r) / _rate(full) for r in last], f"{unit}/s vs the full cache"),
        (axes[1], [_quality(r) for r in last], "quality (score, or forced top-1)"),
    ):
        axis.bar(range(len(last)), values, color=colors)
        axis.set_xticks(range(len(last)), labels, rotation=30, ha="right", fontsize=8)
        axis.set(ylabel=ylabel)
        for x, value in enumerate(values):
            axis.annotate(f"{value:.2f}", (x, value), ha="center", va="bottom", fontsize=8)
    axes[0].axhline(1.0, color="black", linestyle="--", linewidth=1)
    axes[0].set_title(f"{lengths[-1]} new tokens, cap {full['memory_cap_mib']:g} MiB")
    if len(lengths) > 1:
        for setting in dict.fromkeys((_name(r), _size(r)) for r in records if _name(r) != "full"):
            points = []
            for length in lengths:
                group = [r for r in records if r["new_tokens"] == length]
                base = next(r for r in group if r["policy"] == "full")
                match = [r for r in group if (_name(r), _size(r)) == setting]
                points += [(length, _rate(match[0]) / _rate(base))] if match else []
            axes[2].plot(*zip(*points), marker="o", label=" ".join(setting))
        axes[2].axhline(1.0, color="black", linestyle="--", linewidth=1, label="full")
        axes[2].set(xscale="log", xlabel="new tokens per sequence", ylabel=f"{unit}/s vs the full cache")
        axes[2].legend(fontsize=7)
    figure.tight_layout()
    return save_figure(figure, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvevict bench throughput",
        description="Serve a workload under a cap on resident KV memory with continuous batching, per policy and "
        "budget: admission by each row's ceiling (budget + interval for a decode-time policy), chunked prefill "
        "where it admits more, finished sequences' slots refilled. Workloads: oneshot (long prompt, short answer), "
        "longgen (short prompt, long generation; teacher-forced fidelity), ask (compress a document once, ask "
        "many questions). One JSON line per setting in OUT/throughput.jsonl (resumable), tables, OUT/throughput.png.",
    )
    parser.add_argument("--model", default="smollm2", help="model name or path (default: the embedded smollm2)")
    parser.add_argument("--workload", choices=WORKLOADS, default="oneshot", help="what is served (default oneshot)")
    parser.add_argument("--task", default="niah_single_1", help="offline task of the oneshot prompts")
    parser.add_argument("--prompts", type=int, default=8, help="prompts (ask: documents) per setting (default 8)")
    parser.add_argument("--questions", type=int, default=8, help="questions per document, ask (default 8)")
    parser.add_argument("--length", type=int, default=2048, help="prompt or document length in tokens (default 2048)")
    parser.add_argument(
        "--new-tokens",
        type=comma_separated(int),
        default=(64,),
        help="tokens generated per sequence, or several lengths (256,1024) (default 64)",
    )
    parser.add_argument("--memory-cap", type=float, default=512, help="resident KV memory cap in MiB (default 512)")
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
    parser.add_argument("--quant", type=quant_list, default=(), help="also run every setting quantized: none,int4,...")
    parser.add_argument(
        "--no-fidelity", action="store_true", help="longgen: skip teacher-forced fidelity (two untimed replays)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated prompts (default 0)")
    parser.add_argument("--out", type=Path, required=True, help="results directory (created; resumed if it exists)")
    parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    device_option(parser)
    return parser


def main(argv: Sequence[str]) -> int:
    from kvevict.models import load_model
    from kvevict.policies import split_names

    args = build_parser().parse_args(argv)
    runs = settings(split_names(args.policies), args.budgets, args.keep, args.quant)
    configs = [
        ThroughputConfig(
            model=args.model,
            task=args.task,
            prompts=args.prompts,
            length=args.length,
            new_tokens=new_tokens,
            memory_cap_mib=args.memory_cap,
            prefill_chunk=args.prefill_chunk or None,
            seed=args.seed,
            workload=args.workload,
            questions=args.questions,
            fidelity=not args.no_fidelity,
        )
        for new_tokens in args.new_tokens
    ]
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    inputs = workload_inputs(configs[0], tokenizer)
    records = [
        record
        for config in configs
        for record in run_throughput(model, inputs, config, runs, args.out, tokenizer=tokenizer)
    ]
    print(format_table(records))
    print(f"results: {args.out / RESULTS_FILE}\nplot: {plot(records, args.out / 'throughput.png')}", flush=True)
    return 0
