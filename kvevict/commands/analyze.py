"""``kvevict analyze ANALYSIS``: the measurements behind the papers' figures.

Each analysis is a pair here: ``_NAME_parser`` adds its subparser (and sets ``run`` to its
handler), ``_NAME`` runs it; :data:`ANALYSES` lists the parser builders. The work itself is in
:mod:`kvevict.analysis`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvevict.commands.common import BENCH, Subcommands, load_model_from, model_args, names


def add_parser(commands: Subcommands) -> None:
    analyze = commands.add_parser(
        "analyze",
        help="measurements behind the papers' figures",
        description="Analyses that reproduce the papers' observations on a model (see `kvevict analyze ANALYSIS "
        "--help`).",
    )
    analyses = analyze.add_subparsers(dest="analysis", required=True, metavar="ANALYSIS")
    for add_analysis in ANALYSES:
        add_analysis(analyses)
    analyze.set_defaults(extra=BENCH)


def _recurrence_parser(analyses: Subcommands) -> None:
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
    model_args(recurrence)
    recurrence.set_defaults(run=_recurrence)


def _recurrence(args: argparse.Namespace) -> int:
    from kvevict.analysis import recurrence as analysis
    from kvevict.policies.lazyeviction import LazyEviction

    LazyEviction(alpha=args.alpha)  # bad input fails before the model loads
    if args.samples < 1 or args.max_new_tokens < 1:
        raise ValueError("--samples and --max-new-tokens must be >= 1")
    analysis.check_prompt_set(args.prompt_set)
    model, tokenizer = load_model_from(args)
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


def _heads_parser(analyses: Subcommands) -> None:
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
    model_args(heads)
    heads.set_defaults(run=_heads)


def _heads(args: argparse.Namespace) -> int:
    from kvevict.analysis import heads as analysis

    if args.samples < 1 or args.length < 64:
        raise ValueError("--samples must be >= 1 and --length >= 64")
    model, tokenizer = load_model_from(args)
    profile = analysis.head_profile(model, tokenizer, samples=args.samples, length=args.length, seed=args.seed)
    print(f"profile: {analysis.write_profile(profile, args.out)}", file=sys.stderr)
    print(analysis.format_profile(profile))
    if args.plot:
        print(f"plot: {analysis.plot_profile(profile, args.plot)}", file=sys.stderr)
    return 0


def _perturbation_parser(analyses: Subcommands) -> None:
    perturbation = analyses.add_parser(
        "perturbation",
        help="per-head attention-output perturbation of policies against full attention (CriticalKV Figs. 4-6)",
        description="Compress offline RULER prompts (query-aware) under each policy, run the first decoded token and "
        "measure, per layer and query head, the L1 distance of the attention output from the full cache's (and of "
        "the final hidden state); report the share of heads where the last policy perturbs less than each other one.",
    )
    perturbation.add_argument(
        "--policies", type=names, required=True, help="BASELINE[,...],CANDIDATE: the last is compared with each"
    )
    perturbation.add_argument("--budget", type=int, required=True, help="tokens per KV head per layer")
    perturbation.add_argument("--samples", type=int, default=8, help="prompts (default: 8)")
    perturbation.add_argument("--length", type=int, default=1024, help="prompt length in tokens (default: 1024)")
    perturbation.add_argument("--seed", type=int, default=0, help="seed of the prompts (default: 0)")
    perturbation.add_argument("--out", type=Path, default=None, help="write OUT/perturbation.json")
    perturbation.add_argument("--plot", type=Path, default=None, help="draw per-layer and per-head plots into this PNG")
    model_args(perturbation)
    perturbation.set_defaults(run=_perturbation)


def _perturbation(args: argparse.Namespace) -> int:
    from kvevict import make_policy
    from kvevict.analysis import perturbation as analysis

    if len(args.policies) < 2:
        raise ValueError(
            f"--policies takes two or more policies, BASELINE[,...],CANDIDATE; got {','.join(args.policies)}"
        )
    for name in args.policies:  # bad input fails before the model loads
        make_policy(name).check_budget(args.budget)
    if args.samples < 1:
        raise ValueError("--samples must be >= 1")
    model, tokenizer = load_model_from(args)
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
    return 0


def _directional_parser(analyses: Subcommands) -> None:
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
    model_args(directional)
    directional.set_defaults(run=_directional)


def _directional(args: argparse.Namespace) -> int:
    from kvevict import make_policy
    from kvevict.analysis import directional as analysis
    from kvevict.bench.tasks import get_task

    make_policy(args.policy).check_budget(args.budget)  # bad input fails before the model loads
    if args.samples < 1:
        raise ValueError("--samples must be >= 1")
    task = get_task(args.task)
    model, tokenizer = load_model_from(args)
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
    return 0


def _importance_parser(analyses: Subcommands) -> None:
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
    model_args(importance)
    importance.set_defaults(run=_importance)


def _importance(args: argparse.Namespace) -> int:
    from kvevict.analysis import importance as analysis

    if args.samples < 1 or args.max_new_tokens < 2:
        raise ValueError("--samples must be >= 1 and --max-new-tokens >= 2")
    model, tokenizer = load_model_from(args)
    samples = analysis.run_importance(
        model, tokenizer, args.out, samples=args.samples, max_new_tokens=args.max_new_tokens, seed=args.seed
    )
    result = analysis.summary(samples, args.model)
    print(analysis.format_summary(result))
    for path in analysis.write_outputs(samples, result, args.out):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _retention_parser(analyses: Subcommands) -> None:
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
    model_args(retention)
    retention.set_defaults(run=_retention)


def _retention(args: argparse.Namespace) -> int:
    from kvevict.analysis import retention as analysis
    from kvevict.budgets import Budget
    from kvevict.policies import make_policy

    Budget(keep=args.keep)
    make_policy(args.policy)
    if args.samples < 1 or not args.task.startswith("niah"):
        raise ValueError(f"give a needle task (niah_*) and --samples >= 1, got {args.task!r}, {args.samples}")
    model, tokenizer = load_model_from(args)
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


ANALYSES = (
    _recurrence_parser,
    _heads_parser,
    _perturbation_parser,
    _directional_parser,
    _importance_parser,
    _retention_parser,
)
"""The analyses, in the order ``kvevict analyze --help`` lists them."""
