"""tools/ask_swap.py: the gates and KVzip in each other's per-head counts, and with given tokens
ranked first in every head (docs/fastkvzip.md, round 37)."""

import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

import kvevict
from kvevict.bench.documents import documents
from kvevict.generation import prefill, split_prompt
from tests.conftest import kept_positions, prompt, tiny_model

TOOLS = Path(__file__).parents[2] / "tools"
sys.path.insert(0, str(TOOLS))  # ask_swap imports answer_oracle, its neighbour
spec = importlib.util.spec_from_file_location("ask_swap", TOOLS / "ask_swap.py")
ask_swap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ask_swap)
INITIAL = {"gates": "initial"}


def _kept(model, ids, scorer, counts=None, first=None):
    params = INITIAL if scorer is ask_swap.GATES else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny model has no tokenizer: KVzip repeats the bare context
        cache, recorded = ask_swap.compressed(model, ids, scorer, 0.25, counts, first, **params)
    return kept_positions(cache), recorded


def _by_name(model, ids, name):
    cache = kvevict.EvictionCache(model, name, keep=0.25)
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        prefill(model, ids, cache)
    return kept_positions(cache)


def test_each_scorer_alone_keeps_what_its_name_keeps() -> None:
    model, ids = tiny_model(), prompt(192)
    assert _kept(model, ids, ask_swap.REPEAT)[0] == _by_name(model, ids, "kvzip")
    assert _kept(model, ids, ask_swap.GATES)[0] == _by_name(model, ids, "fastkvzip[gates=initial]")


def test_swapped_counts_keep_the_other_passes_counts_with_their_own_ranking() -> None:
    model, ids = tiny_model(), prompt(192)
    repeat, repeat_counts = _kept(model, ids, ask_swap.REPEAT)
    gates, gates_counts = _kept(model, ids, ask_swap.GATES)
    assert [c.tolist() for c in repeat_counts] != [c.tolist() for c in gates_counts]
    swapped, _ = _kept(model, ids, ask_swap.GATES, repeat_counts)  # the gates' ranking in KVzip's counts
    assert [[len(h) for h in layer] for layer in swapped] == [[len(h) for h in layer] for layer in repeat]
    assert swapped not in (repeat, gates)


@pytest.mark.parametrize("scorer", ["REPEAT", "GATES"])
def test_tokens_ranked_first_are_kept_in_every_head(scorer: str) -> None:
    model, ids = tiny_model(), prompt(192)
    first = torch.tensor([40, 41, 42, 60, 61])
    kept, _ = _kept(model, ids, getattr(ask_swap, scorer), first=first)
    assert all(set(first.tolist()) <= set(head) for layer in kept for head in layer)


def test_needle_positions_cover_every_needle_sentence_and_nothing_else(tokenizer) -> None:
    document = documents(tokenizer, length=400, count=1, questions=3, seed=1)[0]
    context, _ = split_prompt(tokenizer, document[0].context)
    positions = ask_swap.needle_positions(tokenizer, context, document)
    text = tokenizer.decode(context[0, positions])
    for sample in document:
        assert f"{sample.metadata['keys'][0]} is: {sample.answers[0]}." in text
    assert "grass" not in text and len(positions) < context.shape[1] // 2


def test_needles_held_counts_the_entries_on_the_given_tokens() -> None:
    model, ids = tiny_model(), prompt(192)
    first = torch.tensor([40, 41, 42, 60, 61])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny model has no tokenizer: KVzip repeats the bare context
        cache, _ = ask_swap.compressed(model, ids, ask_swap.REPEAT, 0.25, first=first)
        plain, _ = ask_swap.compressed(model, ids, ask_swap.REPEAT, 0.25)
    kept = kept_positions(cache)
    entries = sum(len(head) for layer in kept for head in layer)
    held = ask_swap.needles_held(cache, first)
    assert held == {"needles per head": 1.0, "on needles": 5 * sum(len(layer) for layer in kept) / entries}
    per_head = [len(set(head) & set(first.tolist())) / 5 for layer in kept_positions(plain) for head in layer]
    assert ask_swap.needles_held(plain, first)["needles per head"] == sum(per_head) / len(per_head)


def test_a_run_records_every_setting_per_document_and_a_rerun_skips_finished_documents(
    smollm2, tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.setattr(ask_swap.kvevict, "load_model", lambda name: smollm2)  # loaded once per session
    out = tmp_path / "swap.jsonl"
    argv = ["--documents", "1", "--questions", "2", "--length", "300", "--new-tokens", "2", "--keep", "0.5"]
    assert ask_swap.main([*argv, "--out", str(out)]) == 0
    (record,) = map(json.loads, out.read_text().splitlines())
    assert record["document"] == 0 and set(record["scores"]) == set(record["held"]) == set(ask_swap.SETTINGS)
    assert all(len(scores) == 2 for scores in record["scores"].values())
    assert all(held["needles per head"] == 1.0 for name, held in record["held"].items() if "needles first" in name)
    assert ask_swap.main([*argv, "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 1
    assert "kvzip ranking, gates counts" in capsys.readouterr().out


def test_bad_arguments_are_refused_with_what_is_allowed(capsys) -> None:
    with pytest.raises(SystemExit):
        ask_swap.main(["--keep", "1.5", "--out", "x.jsonl"])
    assert "--keep must be in (0, 1), got 1.5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ask_swap.main(["--questions", "0", "--out", "x.jsonl"])
    assert "--questions must be a positive integer, got 0" in capsys.readouterr().err


def test_the_teachers_readings_are_each_question_then_its_answer(tokenizer) -> None:
    document = documents(tokenizer, length=400, count=1, questions=3, seed=1)[0]
    read = ask_swap.readings(tokenizer, document, ask_swap.tails(tokenizer, document))
    assert len(read) == 3
    for reading, sample in zip(read, document, strict=True):
        text = tokenizer.decode(reading[0])
        assert sample.question in text and text.endswith(f"{sample.answer_prefix} {sample.answers[0]}.")
