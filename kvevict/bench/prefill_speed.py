"""``kvevict bench prefill-speed``: what compressing a prompt costs, as a ratio to a plain prefill.

A policy's prefill — the forward over the prompt and whatever the policy does to compress it
(KVzip's repeat pass and scoring, MomentKV's MI loop, Fast KVzip's gates, SnapKV's window
votes) — is timed against a plain prefill of the same prompt into transformers'
``DynamicCache`` (the last token's logits only, as ``generate`` computes them). Prefills are
taken in pairs, a plain one right before each policy's, in turns over the policies (round
robin, ``repeats`` times): on a shared machine the load drifts over seconds, so each policy is
compared with plain prefills taken under the same load, and the ratio reported is the median
of its pairs' ratios (:func:`~kvevict.bench.speed.paired_ratio`). The prompts are essay text
(the packaged haystack) of each length.
A benchmark, never a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Mapping, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from kvevict.bench.clock import seconds
from kvevict.bench.options import comma_separated, device_option
from kvevict.bench.report import markdown_records
from kvevict.bench.speed import paired_ratio
from kvevict.budgets import Budget
from kvevict.cache import EvictionCache, KeptEntries
from kvevict.compat import with_cache
from kvevict.generation import check_chunk, prefill
from kvevict.policies import make_policy, split_names

POLICIES = ("snapkv", "expected-attention", "kvzip", "kvzip[precision=fp32]", "fastkvzip", "momentkv")


def measure(
    model: PreTrainedModel,
    prompts: Mapping[int, torch.Tensor],
    policies: Sequence[str] = POLICIES,
    *,
    keep: float | None = 0.25,
    budget: int | None = None,
    chunk: int | None = None,
    repeats: int = 3,
    progress: bool = True,
) -> list[dict[str, object]]:
    """Rows ``{length, policy, seconds, plain_seconds, ratio, kept_share, kept_mean, kept_longest}`` per prompt length (``prompts``:
    length → ids ``[1, length]``) and policy: the median seconds of the policy's prefill (into an
    ``EvictionCache`` at ``keep`` or ``budget``, ``chunk`` tokens per pass when given), of the plain
    prefills paired with it, the median of the pairs' ratios, and what the cache kept
    (:class:`~kvevict.cache.KeptEntries`: the share of the entries, per KV head the mean and
    the longest)."""
    from tqdm import tqdm

    Budget(budget, keep)
    check_chunk(chunk)
    rows = []
    bar = tqdm(total=len(prompts) * len(policies) * repeats, desc="bench prefill-speed", disable=not progress)
    with torch.inference_mode():
        for length, ids in prompts.items():
            ids = ids.to(model.device)
            times: dict[str, list[float]] = {name: [] for name in policies}
            plain_times: dict[str, list[float]] = {name: [] for name in policies}
            kept: dict[str, KeptEntries] = {}
            for _ in range(repeats):
                for name in policies:
                    plain = with_cache(DynamicCache())
                    plain_times[name].append(seconds(model.device, model, input_ids=ids, **plain, logits_to_keep=1))
                    cache = EvictionCache(model, name, budget=budget, keep=keep)
                    times[name].append(seconds(model.device, prefill, model, ids, cache, chunk=chunk))
                    kept[name] = cache.kept()
                    cache.close()
                    bar.update()
            for name in policies:
                rows.append(
                    {
                        "length": length,
                        "policy": name,
                        "seconds": statistics.median(times[name]),
                        "plain_seconds": statistics.median(plain_times[name]),
                        "ratio": paired_ratio(times[name], plain_times[name]),
                        "kept_share": kept[name].share,
                        "kept_mean": kept[name].mean,
                        "kept_longest": kept[name].longest,
                    }
                )
    bar.close()
    return rows


def format_table(rows: list[dict[str, object]]) -> str:
    return markdown_records(
        rows,
        {
            "policy": "{policy}",
            "prompt tokens": "{length}",
            "kept": "{kept_share:.1%}",
            "per KV head: mean, longest": "{kept_mean:.1f}, {kept_longest}",
            "prefill s": "{seconds:.2f}",
            "plain prefill s": "{plain_seconds:.2f}",
            "ratio": "{ratio:.2f}x",
        },
    )


def essay_prompts(tokenizer: object, lengths: Sequence[int]) -> dict[int, torch.Tensor]:
    """``length → ids [1, length]``: the start of the packaged essays, tokenized."""
    from kvevict.bench.haystack import essays

    ids = tokenizer(essays(), return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[-1] < max(lengths):
        raise ValueError(f"the essays hold {ids.shape[-1]} tokens, fewer than --lengths asks for ({max(lengths)})")
    return {length: ids[:, :length] for length in lengths}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvevict bench prefill-speed",
        description="Time each policy's prefill (compression included) against a plain prefill of the same prompt.",
    )
    parser.add_argument("--model", default="smollm2", help="model name or path (default: the embedded smollm2)")
    device_option(parser)
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help=f"comma-separated policies (default: {','.join(POLICIES)})"
    )
    parser.add_argument(
        "--lengths",
        type=comma_separated(int, low=1),
        default=(2048,),
        help="comma-separated prompt lengths in tokens (default 2048)",
    )
    budgets = parser.add_mutually_exclusive_group()
    budgets.add_argument("--keep", type=float, default=None, help="fraction of the prompt to keep (default 0.25)")
    budgets.add_argument("--budget", type=int, default=None, help="tokens kept per KV head per layer")
    parser.add_argument(
        "--prefill-chunk", type=int, default=None, metavar="C", help="compress C tokens per pass (default: one pass)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="paired prefills per policy and length (default 3)")
    return parser


def main(argv: Sequence[str]) -> int:
    from kvevict.models import load_model

    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    keep = 0.25 if args.keep is None and args.budget is None else args.keep
    Budget(args.budget, keep)
    check_chunk(args.prefill_chunk)
    policies = split_names(args.policies)
    for name in policies:
        make_policy(name)  # an unknown policy fails before the model loads
    model, tokenizer = load_model(args.model, device=args.device)
    rows = measure(
        model,
        essay_prompts(tokenizer, args.lengths),
        policies,
        keep=keep,
        budget=args.budget,
        chunk=args.prefill_chunk,
        repeats=args.repeats,
    )
    print(format_table(rows))
    return 0
