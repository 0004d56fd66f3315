"""The eight needle sets Fast KVzip's gates are judged on (docs/fastkvzip.md, rounds 21-36): RULER's phrasing
with the held-out families, then seven sets in fourteen phrasings no training context has, 216 samples at 2k.
The first seven (192 samples) hold at most four needles a context, the eighth (round 36) eight.

    python tools/judge_sets.py run all --policies full,fastkvzip --out results/judged
    python tools/judge_sets.py pool results/judged      # answers per set and policy, and the pooled share of full's
    python tools/judge_sets.py pool results/judged --policies kvzip   # kvzip and full only, on the samples both ran

``run`` benches each set into OUT/SET with its own seed and samples (resumable, as `kvevict bench` is); arguments
after the set and ``--out`` go to the bench (``--model gemma3 --max-new-tokens 32``). The sets are registered only
in this process, so no training run or test sees them. The round-26 set is rebuilt from its description (its
script was not kept): its full cache answers 3.67 of 24 where the original's answered 4.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvevict.bench.needles import TASKS, Family, NeedleTask
from kvevict.bench.report import policy_label, sample_scores
from kvevict.commands.common import names as policy_names
from kvevict.gates.judged import SETTINGS


@dataclass(frozen=True)
class JudgingSet:
    tasks: tuple[NeedleTask, ...]
    """Registered for the run; none: RULER's and the held-out tasks already registered (:data:`JUDGING`)."""
    samples: int
    seed: int


JUDGING = ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multivalue", "needles_dialogue",
           "needles_lists_codes")  # fmt: skip


def _set(prefix: str, samples: int, seed: int, *families: tuple[str, Family]) -> JudgingSet:
    return JudgingSet(tuple(NeedleTask(f"{prefix}_{name}", family) for name, family in families), samples, seed)


_R25 = ("Keep in mind that the secret {noun} of {key} equals {value}.", "[memo] {key} -> {noun} {value}")
_R26 = ("Memorize this: {key} corresponds to the {noun} {value}.", "Entry {key} => {value} ({noun})")
_R27 = ("Please take note: whoever asks about {key} should be told the {noun} {value}.",
        '<entry name="{key}" {noun}="{value}"/>')  # fmt: skip
_FIFTH = ("Footnote on {key}: the {noun} on file reads {value}.", "{key} | {noun}: {value} | verified")
_SIXTH = ("Ledger entry: {noun} {value} belongs to {key}.", "{key} -- {noun} on record: {value}")
_SEVENTH = ("Logged: {noun} {value} (holder: {key})", "As for {key}, the {noun} they picked is {value}.")
_EIGHTH = ("Registry note: the {noun} assigned to {key} is {value}.", "{key} >> {noun} >> {value}")

SETS: dict[str, JudgingSet] = {
    "judging": JudgingSet((), 4, 0),
    "round25": _set(
        "fresh", 4, 7,
        ("essay_numbers", Family("essay", "numbers", _R25[0])),
        ("noise_words", Family("noise", "words", _R25[1])),
        ("essay_multikey", Family("essay", "numbers", _R25[1], keys=4)),
        ("lists_uuids", Family("lists", "uuids", _R25[0])),
        ("dialogue_values", Family("dialogue", "numbers", _R25[1], values=2)),
        ("code_numbers", Family("code", "numbers", _R25[0])),
    ),
    "round26": _set(
        "fresh2", 6, 11,
        ("noise_codes", Family("noise", "codes", _R26[0])),
        ("essay_codes", Family("essay", "codes", _R26[1])),
        ("essay_multikey", Family("essay", "numbers", _R26[0], keys=4)),
        ("essay_values", Family("essay", "numbers", _R26[1], values=3)),
    ),
    "fourth": _set(
        "fresh3", 8, 13,
        ("essay_numbers", Family("essay", "numbers", _R27[0], noun="access number", intro=3)),
        ("noise_uuids", Family("noise", "uuids", _R27[1], noun="token")),
        ("essay_multikey", Family("essay", "words", _R27[0], keys=3, noun="password")),
        ("lists_words", Family("lists", "words", _R27[1], noun="label", intro=2)),
        ("dialogue_values", Family("dialogue", "numbers", _R27[0], values=3, noun="room number")),
        ("code_numbers", Family("code", "numbers", _R27[1], noun="port")),
    ),
    "fifth": _set(
        "fresh5", 4, 17,
        ("essay_numbers", Family("essay", "numbers", _FIFTH[0], noun="badge number", intro=1)),
        ("noise_words", Family("noise", "words", _FIFTH[1], noun="codeword")),
        ("essay_multikey", Family("essay", "numbers", _FIFTH[1], keys=3, noun="locker code")),
        ("lists_uuids", Family("lists", "uuids", _FIFTH[0], noun="voucher", intro=2)),
        ("dialogue_values", Family("dialogue", "numbers", _FIFTH[1], values=2, noun="ticket number")),
        ("code_words", Family("code", "words", _FIFTH[0], noun="secret")),
    ),
    "sixth": _set(
        "fresh6", 4, 19,
        ("essay_e", Family("essay", "numbers", _SIXTH[0], noun="membership number")),
        ("essay_f", Family("essay", "numbers", _SIXTH[1], noun="order number", intro=3)),
        ("lists_e", Family("lists", "numbers", _SIXTH[0], noun="shelf number", intro=2)),
        ("dialogue_f", Family("dialogue", "numbers", _SIXTH[1], noun="gate number")),
        ("noise_e", Family("noise", "numbers", _SIXTH[0], noun="seat number")),
        ("code_f", Family("code", "numbers", _SIXTH[1], noun="build number", intro=2)),
    ),
    "seventh": _set(
        "fresh7", 4, 23,
        ("essay_g", Family("essay", "numbers", _SEVENTH[0], noun="parking permit")),
        ("essay_h", Family("essay", "numbers", _SEVENTH[1], noun="locker number", intro=2)),
        ("lists_g", Family("lists", "numbers", _SEVENTH[0], noun="invoice number", intro=3)),
        ("lists_h", Family("lists", "numbers", _SEVENTH[1], noun="bin number")),
        ("code_g", Family("code", "numbers", _SEVENTH[0], noun="release number", intro=2)),
        ("dialogue_h", Family("dialogue", "numbers", _SEVENTH[1], noun="table number")),
    ),
    # eight needles a context, as compress-once-ask-many's documents hold (docs/measurements.md)
    "eighth": _set(
        "fresh8", 4, 29,
        ("essay_i", Family("essay", "numbers", _EIGHTH[0], keys=8, noun="account number")),
        ("essay_j", Family("essay", "numbers", _EIGHTH[1], keys=8, noun="desk number", intro=2)),
        ("lists_i", Family("lists", "numbers", _EIGHTH[0], keys=8, noun="lot number", intro=3)),
        ("dialogue_j", Family("dialogue", "numbers", _EIGHTH[1], keys=8, noun="cabin number")),
        ("noise_i", Family("noise", "numbers", _EIGHTH[0], keys=8, noun="pin")),
        ("code_j", Family("code", "numbers", _EIGHTH[1], keys=4, values=2, noun="build number", intro=1)),
    ),
}  # fmt: skip


def bench_args(name: str, out: Path, extra: Sequence[str] = ()) -> list[str]:
    """`kvevict bench`'s arguments for one set (its tasks registered in this process first)."""
    judged = SETS[name]
    for task in judged.tasks:
        TASKS[task.name] = task
    tasks = ",".join(task.name for task in judged.tasks) or ",".join(JUDGING)
    return ["bench", tasks, "--length", "2048", "--samples", str(judged.samples), "--seed", str(judged.seed),
            "--keep", "0.25,0.1", "--out", str(out / name), *extra]  # fmt: skip


def answers(rows: Sequence[dict], policies: Collection[str] = ()) -> dict[tuple[str, float | None], float]:
    """Answers (summed scores) per setting (the policy labelled as `train-gates --judged` labels it: quantized,
    query-aware or interval runs named) and keep, over the samples every setting ran. ``policies``: only these
    labels' settings and the full cache's (default: all), so a policy run on fewer samples does not shrink the rest."""
    if policies:
        rows = [row for row in rows if policy_label(row, SETTINGS) in {*policies, "full"}]
    ran = sample_scores(rows, SETTINGS)
    common = set.intersection(*(set(scores) for scores in ran.values())) if ran else set()
    return {setting: sum(scores[sample] for sample in common) for setting, scores in ran.items()}


def pool(out: Path, policies: Collection[str] = ()) -> str:
    """A table of each set's answers per setting, and every setting's pooled share of the full cache's
    (``policies``: only these and the full cache, as :func:`answers`)."""
    per_set, labels = {}, set()
    for name in SETS:
        results = out / name / "results.jsonl"
        if results.exists():
            rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
            labels |= {policy_label(row, SETTINGS) for row in rows}
            per_set[name] = answers(rows, policies)
    if not per_set:
        raise SystemExit(f"no results under {out}; run `python tools/judge_sets.py run SETS --out {out}` first")
    if missing := [name for name in policies if name not in labels]:
        raise SystemExit(f"no results of {missing[0]!r} under {out}; found {', '.join(sorted(labels))}")
    settings = sorted({setting for found in per_set.values() for setting in found}, key=str)
    if ("full", None) not in settings:
        raise SystemExit(f"no 'full' results under {out}: the shares need the full cache's answers on the same samples")
    lines = ["set | " + " | ".join(f"{p} @ {k}" if k else p for p, k in settings)]
    for name, found in per_set.items():
        lines.append(name + " | " + " | ".join(f"{found[s]:.2f}" if s in found else "-" for s in settings))
    complete = [found for found in per_set.values() if all(s in found for s in settings)]
    full = sum(found["full", None] for found in complete)
    shares = [f"{100 * sum(found[s] for found in complete) / max(full, 1e-9):.1f} %" for s in settings]
    lines.append(f"pooled ({len(complete)} sets), % of full | " + " | ".join(shares))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="bench sets into OUT/SET; other arguments go to `kvevict bench`")
    run.add_argument("sets", help=f"comma-separated, of {', '.join(SETS)}; or all")
    run.add_argument("--out", type=Path, required=True)
    summary = commands.add_parser("pool", help="answers per set and setting, and the pooled share of full's")
    summary.add_argument("out", type=Path)
    summary.add_argument(
        "--policies", type=policy_names, default=(), help="policies to pool with the full cache, on the samples all ran"
    )
    args, extra = parser.parse_known_args(argv)
    if args.command == "pool":
        print(pool(args.out, args.policies))
        return 0
    names = list(SETS) if args.sets == "all" else args.sets.split(",")
    if unknown := [name for name in names if name not in SETS]:
        parser.error(f"unknown set {unknown[0]!r}; use 'all' or some of {', '.join(SETS)}")
    from kvevict.cli import main as kvevict_main

    for name in names:
        if status := kvevict_main(bench_args(name, args.out, extra)):
            return status
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
