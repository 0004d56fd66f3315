"""tools/answer_oracle.py: KVzip's machinery with another teacher-forced reading, and the swap of
per-head counts between two passes (docs/fastkvzip.md, round 24)."""

import importlib.util
import warnings
from pathlib import Path

import torch

import kvevict
from tests.conftest import kept_positions, prompt, tiny_model

spec = importlib.util.spec_from_file_location("answer_oracle", Path(__file__).parents[2] / "tools" / "answer_oracle.py")
answer_oracle = importlib.util.module_from_spec(spec)
spec.loader.exec_module(answer_oracle)


def _kept(model, ids, reading=None, counts=None):
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # the tiny model has no tokenizer: KVzip repeats the bare context
        cache, recorded = answer_oracle.compressed(model, ids, reading, 0.25, counts)
    return kept_positions(cache), recorded


def test_without_a_reading_it_keeps_what_kvzip_keeps_and_replaying_its_own_counts_changes_nothing() -> None:
    model, ids = tiny_model(), prompt(96)
    kvzip = kvevict.EvictionCache(model, "kvzip", keep=0.25)
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        kvevict.generation.prefill(model, ids, kvzip)
    kept, counts = _kept(model, ids)
    assert kept == kept_positions(kvzip) and len(counts) == 2  # one [B, H] count per layer
    assert _kept(model, ids, counts=counts)[0] == kept


def test_a_reading_scores_the_context_by_what_it_reads_and_the_counts_can_come_from_another_pass() -> None:
    model, ids = tiny_model(), prompt(96)
    repeat, repeat_counts = _kept(model, ids)
    reading = prompt(24)[:, 12:]  # any other tokens, teacher-forced after the context
    read, read_counts = _kept(model, ids, reading)
    assert read != repeat
    assert [c.tolist() for c in read_counts] != [c.tolist() for c in repeat_counts]
    swapped, _ = _kept(model, ids, reading, repeat_counts)  # the reading's ranking in KVzip's counts
    assert [[len(head) for head in layer] for layer in swapped] == [[len(head) for head in layer] for layer in repeat]
    assert swapped != repeat
