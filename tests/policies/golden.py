"""The entries every policy keeps on fixed tiny inputs, and the main policies on the embedded
SmolLM2, for the golden-file tests.

:func:`kept_entries` feeds a tiny random Llama (tests/conftest.py) a fixed prompt, then fixed
decode tokens (teacher-forced, so a policy's choices never change what the model reads), and
records the absolute positions each eviction layer holds after the prompt and after every
``SNAPSHOT_EVERY``-th decode step (padding of head-wise budgets dropped). The golden file
``golden/kept_entries.json`` was written from main 9973a50, before the stage redesign (issue 13);
rewrite it with ``python -m tests.policies.golden`` (only when a change of kept entries is meant).

:func:`real_kept_entries` does the same on the embedded SmolLM2-135M-Instruct for the main
policies (:data:`REAL_POLICIES`): the first ``REAL_PROMPT`` tokens of the offline essays, then
the next ``REAL_DECODE_STEPS`` teacher-forced, on one thread (a fixed order of float sums, so
near-ties break the same way every run); snapshots after the prompt and at the end, each head's
positions as a hex bitmask. ``golden/kept_entries_smollm2.json`` was written from main 81ce0fa
(before the cache split, issue 31); rewrite it with ``python -m tests.policies.golden smollm2``.

A record holds bit for bit only where the computation is the same on every CPU. The fp32
records are (checked under every ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA`` of an
AVX512-BF16 machine, and on an AMX one); a bf16 product is not: oneDNN and ATen round bf16
sums differently per instruction set, so near-tied entries swap. A reduced-precision policy
(:data:`REDUCED_PRECISION`) is therefore compared with its fp32 record by :func:`agreement`,
within bounds measured across instruction sets (:data:`MOST_APART`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import kvevict
from tests.conftest import build_policy, prompt, tiny_model

GOLDEN = Path(__file__).parent / "golden" / "kept_entries.json"
PROMPT, BUDGET, DECODE_STEPS, SNAPSHOT_EVERY = 80, 40, 24, 6
COMPOSITIONS = [*kvevict.list_policies(), "moment-nc+snapkv", "moment-nc+adakv+snapkv"]
"""Every registered policy and listed composition, and the contract suite's extra ones."""
FOUND_WRONG = ("adakv+critical+snapkv", "pyramidkv+critical+snapkv")
"""Spellings issue 13 found silently wrong (CriticalKV dropped under an allocator)."""
HEAD_WISE = ("adakv",)
"""Allocators recorded over every base policy (head-wise budgets)."""


def spellings() -> list[str]:
    """The policies recorded: every composition above, the spellings found wrong, and every
    head-wise allocator over every base policy."""
    bases = list(kvevict.policies.POLICIES)
    head_wise = [f"{prefix}+{base}" for prefix in HEAD_WISE for base in bases]
    return [*COMPOSITIONS, *FOUND_WRONG, *(name for name in head_wise if name not in COMPOSITIONS)]


def snapshot(cache: kvevict.EvictionCache) -> list[list[list[int]]]:
    """Positions held by each eviction layer and KV head, ascending (batch row 0, padding
    dropped; storage reuses slots, so its order is not the kept set's)."""
    layers = []
    for layer in cache.eviction_layers:
        valid = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
        layers.append([sorted(heads[held].tolist()) for heads, held in zip(layer.positions[0], valid[0])])
    return layers


def kept_entries(name: str, model: torch.nn.Module) -> list[list[list[list[int]]]]:
    """Snapshots of the kept positions of ``name`` on the fixed inputs (see the module docstring)."""
    cache = kvevict.EvictionCache(model, build_policy(name), budget=None if name == "full" else BUDGET)
    tokens = prompt(DECODE_STEPS, seed=7)
    snapshots = []
    with torch.no_grad():
        model(input_ids=prompt(PROMPT), past_key_values=cache)
        snapshots.append(snapshot(cache))
        for step in range(DECODE_STEPS):
            model(input_ids=tokens[:, step : step + 1], past_key_values=cache)
            if (step + 1) % SNAPSHOT_EVERY == 0:
                snapshots.append(snapshot(cache))
    cache.close()
    return snapshots


REAL_GOLDEN = GOLDEN.with_name("kept_entries_smollm2.json")
REAL_POLICIES = (
    "snapkv",
    "h2o",
    "tova",
    "streamingllm",
    "kvzip[precision=fp32]",
    "epikv",
    "lazyeviction",
    "critical+adakv+snapkv",
)
"""The main policies, recorded bit for bit: prompt-time scorers, decode-time ones, the hidden-state
family and a composition (all fp32)."""
REDUCED_PRECISION = {"kvzip[precision=bf16]": "kvzip[precision=fp32]"}
"""Policies that compute in bf16 (KVzip's default where the CPU multiplies bf16 in hardware) →
the fp32 record their kept entries are compared with."""
MOST_APART = {"share": 0.985, "entries": 8}
"""How far a bf16 run may stray from the fp32 record (:func:`agreement`): at least ``share`` of
the entries kept by either kept by both, and no head with more than ``entries`` entries kept by
one and not the other. Measured on an AVX512-BF16 CPU (AMD EPYC) under ``ATEN_CPU_CAPABILITY``
default / avx2 / avx512 × ``ONEDNN_MAX_CPU_ISA`` unset / AVX2 / AVX512_CORE / AVX512_CORE_BF16
(12 runs, 9 distinct kept sets): 0.9942–0.9957 in common, at most 4 entries apart in a head
(KVzip's budget is global, so a near-tie between heads moves an entry from one head to
another); the bf16 record written on an AMX CPU in round 14 was 0.9942 and 3 from fp32's. The
bounds allow about 2.5× and 2× those distances."""
REAL_PROMPT, REAL_BUDGET, REAL_DECODE_STEPS = 300, 64, 16


def real_inputs(tokenizer) -> torch.Tensor:
    """``[1, REAL_PROMPT + REAL_DECODE_STEPS]`` token ids: the start of the offline essays."""
    from kvevict.bench.haystack import essays

    ids = tokenizer(essays()[:4000], add_special_tokens=False, return_tensors="pt").input_ids
    return ids[:, : REAL_PROMPT + REAL_DECODE_STEPS]


def bitmasks(cache: kvevict.EvictionCache) -> list[list[str]]:
    """:func:`snapshot` with each head's positions as the hex digits of ``sum(1 << position)``."""
    return [[format(sum(1 << p for p in heads), "x") for heads in layer] for layer in snapshot(cache)]


def positions(bitmask: str) -> list[int]:
    """The positions of a :func:`bitmasks` entry, ascending."""
    bits = int(bitmask, 16)
    return [p for p in range(bits.bit_length()) if bits >> p & 1]


def real_kept_entries(name: str, model: torch.nn.Module, ids: torch.Tensor) -> list[list[list[str]]]:
    """The kept positions of ``name`` on SmolLM2 after the prompt of ``ids`` and after its
    teacher-forced rest (see the module docstring)."""
    cache = kvevict.EvictionCache(model, build_policy(name), budget=REAL_BUDGET)
    with torch.no_grad():
        model(input_ids=ids[:, :REAL_PROMPT], past_key_values=cache)
        snapshots = [bitmasks(cache)]
        for step in range(REAL_PROMPT, ids.shape[-1]):
            model(input_ids=ids[:, step : step + 1], past_key_values=cache)
        snapshots.append(bitmasks(cache))
    cache.close()
    return snapshots


def first_difference(expected: list, now: list) -> str:
    """Where two :func:`real_kept_entries` results first differ, with the positions only one keeps."""
    for snap, (before, after) in enumerate(zip(expected, now)):
        for layer, (heads_before, heads_after) in enumerate(zip(before, after)):
            for head, (kept_before, kept_after) in enumerate(zip(heads_before, heads_after)):
                if kept_before != kept_after:
                    lost = sorted(set(positions(kept_before)) - set(positions(kept_after)))
                    gained = sorted(set(positions(kept_after)) - set(positions(kept_before)))
                    return f"snapshot {snap}, layer {layer}, KV head {head}: no longer kept {lost}, now kept {gained}"
    return "the shapes differ" if expected != now else "no difference"


def agreement(record: list, now: list) -> tuple[float, int]:
    """How close two :func:`real_kept_entries` results are: the share of the entries kept by
    either that both keep (over every snapshot, layer and KV head), and the most entries one
    head keeps in one and not the other."""
    common = either = most = 0
    for snap_before, snap_now in zip(record, now, strict=True):
        for heads_before, heads_now in zip(snap_before, snap_now, strict=True):
            for before, after in zip(heads_before, heads_now, strict=True):
                kept_before, kept_now = set(positions(before)), set(positions(after))
                common += len(kept_before & kept_now)
                either += len(kept_before | kept_now)
                most = max(most, len(kept_before ^ kept_now))
    return (common / either if either else 1.0), most


def record_real() -> dict[str, object]:
    """Kept entries of every policy of :data:`REAL_POLICIES` on the embedded SmolLM2."""
    torch.set_num_threads(1)
    model, tokenizer = kvevict.load_model("smollm2")
    ids = real_inputs(tokenizer)
    return {name: real_kept_entries(name, model, ids) for name in REAL_POLICIES}


def print_real(name: str) -> None:
    """Print :func:`real_kept_entries` of ``name`` as JSON (a run in a process of its own, whose
    CPU capabilities were set before torch loaded)."""
    torch.set_num_threads(1)
    model, tokenizer = kvevict.load_model("smollm2")
    print(json.dumps(real_kept_entries(name, model, real_inputs(tokenizer))))


def record() -> dict[str, object]:
    """Kept entries of every spelling; a spelling that fails records its error."""
    torch.set_num_threads(1)  # tiny matrices: one thread is ~10x faster on a busy machine
    model = tiny_model()
    recorded: dict[str, object] = {}
    for name in spellings():
        try:
            recorded[name] = kept_entries(name, model)
        except Exception as err:  # noqa: BLE001 - what the spelling did is what is recorded
            recorded[name] = f"{type(err).__name__}: {err}"
    return recorded


if __name__ == "__main__":
    if sys.argv[1:2] == ["kept"]:
        print_real(sys.argv[2])
    elif sys.argv[1:] == ["smollm2"]:
        REAL_GOLDEN.write_text(json.dumps(record_real(), separators=(",", ":")) + "\n")
    else:
        GOLDEN.write_text(json.dumps(record(), separators=(",", ":")) + "\n")
