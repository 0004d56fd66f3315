"""The ``kvevict`` command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from kvevict.bench.options import comma_separated

EXIT_USAGE = 2
BENCH_SUBCOMMANDS = {"memory": "memory", "throughput": "throughput", "decode-speed": "speed"}
"""``kvevict bench NAME ...``: subcommands with parsers of their own, by the module that runs them."""


def _budget_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--budget", type=int, help="retained tokens per KV head per layer")
    group.add_argument("--keep", type=float, help="fraction of the prompt to retain (prefill), in (0, 1]")
    parser.add_argument(
        "--interval", type=int, default=None, help="decode-time eviction every N steps (default: the policy's)"
    )


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' or 'gemma3' (embedded, offline; gemma3: `make gemma3`), a local directory with a config.json, or a hub id",
    )
    parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16 or auto")
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda (default: where the model loads)")
    parser.add_argument("--attn", default=None, help="base attention kernel: sdpa (default), eager, flash_attention_2")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvevict", description="KV-cache eviction for Hugging Face transformers.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    commands.add_parser("policies", help="list the eviction policies", description="List every registered policy.")

    generate = commands.add_parser(
        "generate",
        help="answer prompts with a compressed cache",
        description="Compress the prompt under a policy, then decode greedily (decode-time policies keep evicting). "
        "Several prompts are answered as one left-padded batch, each row evicted on its own (each gets what it gets "
        "alone); their answers are printed in order, each as '[i] answer'.",
    )
    generate.add_argument(
        "prompt",
        nargs="+",
        help="the prompt text, or '-' to read it from standard input; several prompts: generated as one batch",
    )
    generate.add_argument(
        "--policy",
        default="full",
        help="policy name (see `kvevict policies`; default: full), parameters in brackets: "
        "lazyeviction[window=22], critical+snapkv[critical.alpha=0]",
    )
    _budget_args(generate)
    generate.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    _model_args(generate)

    commands.add_parser("tasks", help="list the benchmark tasks", description="List every benchmark task.")

    bench = commands.add_parser(
        "bench",
        help="run tasks × policies × budgets into a results directory",
        description="Run every task × policy × budget; one JSON line per sample in OUT/results.jsonl. "
        "Resumable: finished samples are skipped when the same command runs again. "
        "`kvevict bench memory --help`: the prefill peak-memory microbenchmark; "
        "`kvevict bench decode-speed --help`: the cost of a decode step under eviction; "
        "`kvevict bench throughput --help`: sequences served per second under a KV memory cap.",
    )
    bench.add_argument("tasks", type=_names, help="comma-separated task names (see `kvevict tasks`)")
    bench.add_argument(
        "--policies",
        type=_names,
        default=("full",),
        help="comma-separated policies (default: full); parameters in brackets: h2o,lazyeviction[window=22]",
    )
    budgets = bench.add_mutually_exclusive_group()
    budgets.add_argument(
        "--budgets", type=comma_separated(int), default=(), help="comma-separated budgets, tokens per KV head per layer"
    )
    budgets.add_argument(
        "--keep", type=comma_separated(float), default=(), help="comma-separated fractions of the prompt to keep"
    )
    bench.add_argument("--length", type=int, default=2048, help="prompt length in tokens (default: 2048)")
    bench.add_argument("--samples", type=int, default=4, help="samples per task (default: 4)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the generated samples (default: 0)")
    bench.add_argument("--out", type=Path, required=True, help="results directory (created; resumed if it exists)")
    bench.add_argument("--query-aware", action="store_true", help="compress context + question (default: context only)")
    bench.add_argument(
        "--interval", type=int, default=None, help="decode-time eviction every N steps (default: the policy's)"
    )
    bench.add_argument(
        "--fidelity", action="store_true", help="also replay the full cache's answer: top-1, KL, perplexity"
    )
    bench.add_argument("--max-new-tokens", type=int, default=None, help="override every task's generation length")
    bench.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="C",
        help="compress each prompt C tokens per pass: at most budget + C entries per KV head (default: one pass)",
    )
    bench.add_argument(
        "--batch-size",
        type=int,
        default=1,
        metavar="N",
        help="run N samples (of one task and setting) as one left-padded batch, each evicted on its own: the same "
        "results as one by one (default: 1); fidelity replays stay one at a time",
    )
    _model_args(bench)
    cluster = bench.add_argument_group(
        "Ray cluster",
        "Spread the sweep over Ray actors, each loading the model once; the same results, resumable as "
        "ever. Needs pip install 'kvevict[ray]'. Exit status 1 if a unit of work failed.",
    )
    cluster.add_argument(
        "--workers", type=int, default=None, metavar="N", help="run on N Ray workers (default: in this process)"
    )
    cluster.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="join this running cluster (ray start --head prints it; 'auto': this node's); default: start a local "
        "cluster for the sweep and stop it afterwards",
    )
    cluster.add_argument(
        "--gpus-per-worker",
        type=float,
        default=0.0,
        metavar="G",
        help="GPUs per worker, fractions share one (default: 0); with GPUs the model loads on cuda",
    )
    cluster.add_argument(
        "--cpus-per-worker", type=float, default=1.0, metavar="C", help="CPUs and torch threads per worker (default: 1)"
    )

    report = commands.add_parser(
        "report", help="summarise a results directory", description="Mean score per task × policy × budget, % of full."
    )
    report.add_argument("directory", type=Path, help="a directory written by `kvevict bench`")
    report.add_argument("--plot", type=Path, default=None, help="also draw score vs budget into this PNG")

    demo = commands.add_parser(
        "demo",
        help="a small offline suite on the embedded model, with its report and plot",
        description="Run a few RULER-style tasks on the embedded SmolLM2 for full and several baselines at two "
        "budgets, print the report and write the plot.",
    )
    demo.add_argument(
        "--out", type=Path, default=Path("results/demo"), help="results directory (default: results/demo)"
    )

    lm_eval = commands.add_parser(  # parsed by lm-eval itself (kvevict.lm_eval.main)
        "lm-eval",
        help="evaluate a policy on lm-evaluation-harness tasks (`kvevict lm-eval --help`)",
        description="lm-eval's own command line with --model kvevict: kvevict lm-eval --model_args "
        "pretrained=smollm2,policy=snapkv,budget=64 --tasks kvevict. Needs pip install 'kvevict[lm-eval]'.",
    )
    lm_eval.add_argument("args", nargs=argparse.REMAINDER, help="lm-eval's arguments")

    analyze = commands.add_parser(
        "analyze",
        help="measurements behind the papers' figures",
        description="Analyses that reproduce the papers' observations on a model (see `kvevict analyze ANALYSIS "
        "--help`).",
    )
    analyses = analyze.add_subparsers(dest="analysis", required=True, metavar="ANALYSIS")
    for add_analysis in ANALYSES:
        add_analysis(analyses)
    return parser


# -- kvevict analyze: one function per analysis adds its parser and sets `run` ------------------
def _recurrence_parser(analyses: argparse._SubParsersAction) -> None:
    recurrence = analyses.add_parser(
        "recurrence",
        help="LazyEviction's maximum recurrence interval (MRI) distribution and the window W it suggests",
        description="Greedy full-cache generation per prompt while tracking LazyEviction's timestamps and MRI "
        "(nothing is evicted); reports the MRI distribution over every (layer, KV head, token) entry retained at "
        "the end, prompt and decode tokens (paper Fig. 3c), and the suggested W = the 80th percentile of MRI over "
        "recurring entries (MRI >= 1).",
    )
    recurrence.add_argument(
        "--prompt-set",
        default="builtin",
        help="'builtin' (8 short reasoning prompts, default), a .txt file (blank-line-separated prompts), a .jsonl "
        "file (field prompt/question/problem) or a task name (see `kvevict tasks`; hub tasks need internet)",
    )
    recurrence.add_argument("--samples", type=int, default=4, help="prompts to run (default: 4)")
    recurrence.add_argument("--max-new-tokens", type=int, default=512, help="tokens to generate (default: 512)")
    recurrence.add_argument(
        "--alpha", type=float, default=None, help="attention threshold (default: LazyEviction's for the model family)"
    )
    recurrence.add_argument("--out", type=Path, default=None, help="write the JSON summary to OUT/recurrence.json")
    recurrence.add_argument("--plot", type=Path, default=None, help="draw the MRI histogram into this PNG")
    recurrence.add_argument("--per-layer", action="store_true", help="also print the per-layer breakdown")
    _model_args(recurrence)
    recurrence.set_defaults(run=_analyze_recurrence)


def _heads_parser(analyses: argparse._SubParsersAction) -> None:
    heads = analyses.add_parser(
        "heads",
        help="a retrieval-head profile of a model (the head importance HeadKV allocates budgets by)",
        description="Teacher-force the copy of a needle from offline essay haystacks and score each query head by "
        "how often its strongest attention lands on the token being copied (retrieval heads, Wu et al. 2024). "
        "Writes the profile JSON that `make_policy('headkv', headkv={'profile': PATH})` loads.",
    )
    heads.add_argument("--out", type=Path, required=True, help="where to write the profile JSON")
    heads.add_argument("--samples", type=int, default=8, help="haystacks (default: 8)")
    heads.add_argument("--length", type=int, default=1024, help="haystack prompt length in tokens (default: 1024)")
    heads.add_argument("--seed", type=int, default=0, help="seed of the haystacks (default: 0)")
    heads.add_argument("--plot", type=Path, default=None, help="draw the layer x head heatmap into this PNG")
    _model_args(heads)
    heads.set_defaults(run=_analyze_heads)


def _perturbation_parser(analyses: argparse._SubParsersAction) -> None:
    perturbation = analyses.add_parser(
        "perturbation",
        help="per-head attention-output perturbation of policies against full attention (CriticalKV Figs. 4-6)",
        description="Compress offline RULER prompts (query-aware) under each policy, run the first decoded token and "
        "measure, per layer and query head, the L1 distance of the attention output from the full cache's (and of "
        "the final hidden state); report the share of heads where the last policy perturbs less than each other one.",
    )
    perturbation.add_argument(
        "--policies", type=_names, required=True, help="BASELINE[,...],CANDIDATE: the last is compared with each"
    )
    perturbation.add_argument("--budget", type=int, required=True, help="tokens per KV head per layer")
    perturbation.add_argument("--samples", type=int, default=8, help="prompts (default: 8)")
    perturbation.add_argument("--length", type=int, default=1024, help="prompt length in tokens (default: 1024)")
    perturbation.add_argument("--seed", type=int, default=0, help="seed of the prompts (default: 0)")
    perturbation.add_argument("--out", type=Path, default=None, help="write OUT/perturbation.json")
    perturbation.add_argument("--plot", type=Path, default=None, help="draw per-layer and per-head plots into this PNG")
    _model_args(perturbation)
    perturbation.set_defaults(run=_analyze_perturbation)


def _directional_parser(analyses: argparse._SubParsersAction) -> None:
    directional = analyses.add_parser(
        "directional",
        help="MomentKV's directional analysis: evicted mass, cos(f_E, f_R), amplification, error with/without NC",
        description="Compress each sample's context under --policy at --budget, then probe every layer with the "
        "question tokens: the evicted attention mass w_E, cos(f_E, f_R), the amplification gamma, and the relative "
        "attention-output error without and with MomentKV's normalization correction (seed 003, Fig. 2 and 3b).",
    )
    directional.add_argument("--policy", default="snapkv", help="a prompt-compressing policy (default: snapkv)")
    directional.add_argument("--budget", type=int, required=True, help="retained tokens per KV head per layer")
    directional.add_argument("--task", default="niah_single_1", help="offline task to draw samples from")
    directional.add_argument("--length", type=int, default=2048, help="prompt length in tokens (default: 2048)")
    directional.add_argument("--samples", type=int, default=1, help="samples (default: 1)")
    directional.add_argument("--order", type=int, default=1, choices=(0, 1), help="NC approximation order (default 1)")
    directional.add_argument("--out", type=Path, default=None, help="write OUT/directional.json")
    directional.add_argument("--plot", type=Path, default=None, help="draw the per-layer panels into this PNG")
    _model_args(directional)
    directional.set_defaults(run=_analyze_directional)


def _importance_parser(analyses: argparse._SubParsersAction) -> None:
    importance = analyses.add_parser(
        "importance",
        help="EpiKV's counterfactual importance labels and per-layer Spearman rho of the hidden-state change",
        description="Greedy step-by-step answers to seeded arithmetic problems; sliding occlusion (window 32, "
        "stride 16) over the reasoning span with greedy regeneration of the answer labels a token 1 when a covering "
        "window flips it; then per-layer Spearman rho of the rolling-64 hidden-state change (and its rolling "
        "z-score) against the labels (EpiKV Appendix A). Writes OUT/labels.jsonl (resumable), labels.csv, "
        "importance.csv, importance.json and importance.png.",
    )
    importance.add_argument("--samples", type=int, default=4, help="problems to label (default: 4)")
    importance.add_argument("--max-new-tokens", type=int, default=96, help="reasoning + answer tokens (default: 96)")
    importance.add_argument("--seed", type=int, default=0, help="seed of the generated problems (default: 0)")
    importance.add_argument(
        "--out", type=Path, default=Path("results/importance"), help="output directory (default: results/importance)"
    )
    _model_args(importance)
    importance.set_defaults(run=_analyze_importance)


def _retention_parser(analyses: argparse._SubParsersAction) -> None:
    retention = analyses.add_parser(
        "retention",
        help="where a policy ranks a needle in every layer and KV head, and which layers must keep it",
        description="For a RULER needle task (niah_*), context-only: the rank of the needle's tokens under the "
        "policy's scores in every layer and KV head, the share of them each head keeps, the answer's score as "
        "compressed and with the needle forced into every head; with --necessity, leave-one-layer-out of the "
        "forcing names the layers that must keep it. Writes OUT/retention.json and retention.png.",
    )
    retention.add_argument("task", help="a needle task, e.g. niah_single_2")
    retention.add_argument("--policy", default="kvzip", help="policy spec (default: kvzip)")
    retention.add_argument("--keep", type=float, default=0.25, help="fraction of the context kept (default: 0.25)")
    retention.add_argument("--samples", type=int, default=1, help="samples (default: 1)")
    retention.add_argument("--length", type=int, default=2048, help="prompt length in tokens (default: 2048)")
    retention.add_argument("--seed", type=int, default=0, help="seed of the generated samples (default: 0)")
    retention.add_argument("--necessity", action="store_true", help="leave-one-layer-out forcing (one run per layer)")
    retention.add_argument(
        "--out", type=Path, default=Path("results/retention"), help="output directory (default: results/retention)"
    )
    _model_args(retention)
    retention.set_defaults(run=_analyze_retention)


ANALYSES = (
    _recurrence_parser,
    _heads_parser,
    _perturbation_parser,
    _directional_parser,
    _importance_parser,
    _retention_parser,
)


def _names(text: str) -> tuple[str, ...]:
    from kvevict.policies import split_names

    return split_names(text)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvevict")
    except PackageNotFoundError:
        return "unknown"


def _policies() -> int:
    from kvevict.policies import describe_policies

    rows = describe_policies()
    width = max(len(name) for name, _ in rows)
    for name, summary in rows:
        print(f"{name.ljust(width)}  {summary}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kvevict import Budget, EvictionCache, answer, load_model, make_policy

    policy = make_policy(args.policy)  # bad input fails before the model loads
    if args.budget is not None:
        Budget(args.budget, args.keep)
        policy.check_budget(args.budget)
    if args.prompt.count("-") > 1:
        raise ValueError("'-' (read the prompt from standard input) can stand for one prompt only")
    prompts = [sys.stdin.read() if prompt == "-" else prompt for prompt in args.prompt]
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn)
    cache = EvictionCache(model, policy, budget=args.budget, keep=args.keep, interval=args.interval)
    replies = answer(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens, cache=cache)
    for i, reply in enumerate(replies, start=1):
        print(reply if len(replies) == 1 else f"[{i}] {reply}")
    lengths = cache.layer_lengths()
    print(
        f"[{args.policy}, {cache.budget}] tokens seen {cache.get_seq_length()}, retained {max(lengths)} per KV head, "
        f"KV {cache.kv_bytes() / 2**20:.2f} MiB",
        file=sys.stderr,
    )
    return 0


def _tasks() -> int:
    from kvevict.bench.tasks import all_tasks

    tasks = all_tasks()
    width = max(map(len, tasks))
    for name, task in tasks.items():
        print(f"{name.ljust(width)}  {task.source:7}  {task.metric}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from kvevict.bench.report import format_report, summarize
    from kvevict.bench.runner import BenchConfig, BenchRunner

    config = BenchConfig(
        tasks=args.tasks,
        model=args.model,
        policies=args.policies,
        budgets=args.budgets,
        keeps=args.keep,
        length=args.length,
        samples=args.samples,
        seed=args.seed,
        query_aware=args.query_aware,
        interval=args.interval,
        fidelity=args.fidelity,
        max_new_tokens=args.max_new_tokens,
        prefill_chunk=args.prefill_chunk,
        batch_size=args.batch_size,
        dtype=args.dtype,
        device=args.device,
        attn=args.attn,
    )
    if args.workers is None:
        if args.ray_address is not None:
            raise ValueError("--ray-address needs --workers")
        store, failed = BenchRunner(config, args.out).run(), []
    else:
        from kvevict.bench.cluster import ClusterConfig, run_sweep

        cluster = ClusterConfig(args.workers, args.ray_address, args.gpus_per_worker, args.cpus_per_worker)
        sweep = run_sweep(config, args.out, cluster)
        store, failed = sweep.store, sweep.failed
    print(format_report(summarize(store)))
    print(f"results: {store.path}", file=sys.stderr)
    for failure in failed:
        print(f"kvevict bench: failed: {failure.describe()}", file=sys.stderr)
    if failed:
        print(f"kvevict bench: {len(failed)} units failed; run the same command to retry them", file=sys.stderr)
    return 1 if failed else 0


def _report(args: argparse.Namespace) -> int:
    from kvevict.bench.report import format_report, plot_report, summarize
    from kvevict.bench.store import ResultStore

    if not (args.directory / "results.jsonl").is_file():
        raise FileNotFoundError(
            f"{args.directory} has no results.jsonl; run `kvevict bench ... --out {args.directory}`"
        )
    rows = summarize(ResultStore(args.directory))
    print(format_report(rows))
    if args.plot:
        print(f"plot: {plot_report(rows, args.plot)}", file=sys.stderr)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvevict.demo import run_demo

    run_demo(args.out)
    return 0


def _analyze_recurrence(args: argparse.Namespace) -> int:
    from kvevict import load_model
    from kvevict.analysis import recurrence as analysis
    from kvevict.policies.lazyeviction import LazyEviction

    LazyEviction(alpha=args.alpha)  # bad input fails before the model loads
    if args.samples < 1 or args.max_new_tokens < 1:
        raise ValueError("--samples and --max-new-tokens must be >= 1")
    analysis.check_prompt_set(args.prompt_set)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn)
    prompts = analysis.load_prompts(args.prompt_set, args.samples, tokenizer)
    run = analysis.run_recurrence(
        model,
        tokenizer,
        prompts,
        max_new_tokens=args.max_new_tokens,
        alpha=args.alpha,
        model_name=args.model,
        prompt_set=args.prompt_set,
    )
    summary = analysis.summarize_run(run)
    overall = analysis.mri_summary(run.values())
    layers = [analysis.mri_summary(run.values(i)) for i in range(len(run.layers))] if args.per_layer else []
    title = (
        f"MRI distribution: {args.model}, {args.prompt_set} x {len(prompts)}, alpha {run.alpha:g}, "
        f"{sum(run.new_tokens)} tokens generated (up to {args.max_new_tokens} per prompt)"
    )
    print(analysis.format_summary(overall, layers, title=title))
    if args.out:
        print(f"summary: {analysis.write_summary(summary, args.out)}", file=sys.stderr)
    if args.plot:
        plot = analysis.plot_histogram(
            run.values(), args.plot, overall.suggested_window, title=f"MRI, {args.model} ({args.prompt_set})"
        )
        print(f"plot: {plot}", file=sys.stderr)
    return 0


def _analyze_heads(args: argparse.Namespace) -> int:
    from kvevict import load_model
    from kvevict.analysis import heads as analysis

    if args.samples < 1 or args.length < 64:
        raise ValueError("--samples must be >= 1 and --length >= 64")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn)
    profile = analysis.head_profile(model, tokenizer, samples=args.samples, length=args.length, seed=args.seed)
    print(f"profile: {analysis.write_profile(profile, args.out)}", file=sys.stderr)
    print(analysis.format_profile(profile))
    if args.plot:
        print(f"plot: {analysis.plot_profile(profile, args.plot)}", file=sys.stderr)
    return 0


def _analyze_perturbation(args: argparse.Namespace) -> int:
    from kvevict import load_model, make_policy
    from kvevict.analysis import perturbation as analysis

    if len(args.policies) < 2:
        raise ValueError(
            f"--policies takes two or more policies, BASELINE[,...],CANDIDATE; got {','.join(args.policies)}"
        )
    for name in args.policies:  # bad input fails before the model loads
        make_policy(name).check_budget(args.budget)
    if args.samples < 1:
        raise ValueError("--samples must be >= 1")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn)
    result = analysis.run_perturbation(
        model, tokenizer, list(args.policies), args.budget, samples=args.samples, length=args.length, seed=args.seed
    )
    *baselines, candidate = args.policies
    comparisons = [analysis.compare(result, baseline, candidate) for baseline in baselines]
    if args.out:
        print(f"result: {analysis.write_result(result, comparisons, args.out)}", file=sys.stderr)
    print("\n\n".join(analysis.format_comparison(comparison) for comparison in comparisons))
    if args.plot:
        print(f"plot: {analysis.plot_comparison(result, comparisons[0], args.plot)}", file=sys.stderr)


def _analyze_directional(args: argparse.Namespace) -> int:
    from kvevict import load_model, make_policy
    from kvevict.analysis import directional as analysis
    from kvevict.bench.tasks import get_task

    make_policy(args.policy).check_budget(args.budget)  # bad input fails before the model loads
    if args.samples < 1:
        raise ValueError("--samples must be >= 1")
    task = get_task(args.task)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn)
    samples = task.samples(tokenizer, length=args.length, count=args.samples)
    prompts = analysis.sample_prompts(tokenizer, samples)
    layers = analysis.run_directional(model, prompts, args.policy, args.budget, order=args.order)
    title = f"directional: {args.model}, {args.policy} at budget {args.budget}, {args.task} x {len(samples)}"
    print(analysis.format_directional(layers, title))
    config = {key: getattr(args, key) for key in ("model", "policy", "budget", "task", "length", "order")}
    if args.out:
        print(
            f"summary: {analysis.write_directional(layers, config | {'samples': len(samples)}, args.out)}",
            file=sys.stderr,
        )
    if args.plot:
        print(f"plot: {analysis.plot_directional(layers, args.plot, title)}", file=sys.stderr)


def _analyze_importance(args: argparse.Namespace) -> int:
    from kvevict import load_model
    from kvevict.analysis import importance as analysis

    if args.samples < 1 or args.max_new_tokens < 2:
        raise ValueError("--samples must be >= 1 and --max-new-tokens >= 2")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn)
    samples = analysis.run_importance(
        model, tokenizer, args.out, samples=args.samples, max_new_tokens=args.max_new_tokens, seed=args.seed
    )
    result = analysis.summary(samples, args.model)
    print(analysis.format_summary(result))
    for path in analysis.write_outputs(samples, result, args.out):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _analyze_retention(args: argparse.Namespace) -> int:
    from kvevict import load_model
    from kvevict.analysis import retention as analysis
    from kvevict.budgets import Budget
    from kvevict.policies import make_policy

    Budget(keep=args.keep)
    make_policy(args.policy)
    if args.samples < 1 or not args.task.startswith("niah"):
        raise ValueError(f"give a needle task (niah_*) and --samples >= 1, got {args.task!r}, {args.samples}")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn)
    results = analysis.run_retention(
        model,
        tokenizer,
        args.task,
        args.policy,
        args.keep,
        samples=args.samples,
        length=args.length,
        seed=args.seed,
        necessity=args.necessity,
    )
    print(analysis.format_summary(results))
    for path in analysis.write_outputs(results, args.out):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in BENCH_SUBCOMMANDS:  # beside bench's positional tasks
        name = argv[1]
        module = importlib.import_module(f"kvevict.bench.{BENCH_SUBCOMMANDS[name]}")
        try:
            return module.main(argv[2:])
        except (ValueError, OSError) as err:  # bad input, missing files, an unknown hub id
            print(f"kvevict bench {name}: error: {err}", file=sys.stderr)
            return EXIT_USAGE
    if argv[:1] == ["lm-eval"]:  # lm-eval's own arguments, which its parser reads
        try:
            return importlib.import_module("kvevict.lm_eval").main(argv[1:])
        except ModuleNotFoundError as err:
            print(f"kvevict lm-eval: error: {err}", file=sys.stderr)
            return EXIT_USAGE
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {
        "policies": _policies,
        "generate": lambda: _generate(args),
        "tasks": _tasks,
        "bench": lambda: _bench(args),
        "report": lambda: _report(args),
        "demo": lambda: _demo(args),
        "analyze": lambda: args.run(args),
    }
    try:
        return handlers[args.command]()
    except (ValueError, OSError) as err:  # bad input, missing files, an unknown hub id
        print(f"kvevict {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
