"""The entries every policy keeps on fixed tiny inputs, for the golden-file test.

:func:`kept_entries` feeds a tiny random Llama (tests/conftest.py) a fixed prompt, then fixed
decode tokens (teacher-forced, so a policy's choices never change what the model reads), and
records the absolute positions each eviction layer holds after the prompt and after every
``SNAPSHOT_EVERY``-th decode step (padding of head-wise budgets dropped). The golden file
``golden/kept_entries.json`` was written from main 9973a50, before the stage redesign (issue 13);
rewrite it with ``python -m tests.policies.golden`` (only when a change of kept entries is meant).
"""

from __future__ import annotations

import json
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
    GOLDEN.write_text(json.dumps(record(), separators=(",", ":")) + "\n")
