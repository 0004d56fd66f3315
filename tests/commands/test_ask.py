"""``kvevict ask`` (kvevict.commands.ask) on the embedded model: a compressed document answered
from its file, each question from its own copy; bad input refused in one line."""

from __future__ import annotations

import pytest
import torch

import kvevict
from kvevict.cli import main
from tests.conftest import prompt, tiny_model


def test_a_compressed_document_answers_from_its_file(document, tmp_path, capsys) -> None:
    out = tmp_path / "doc.kv"
    assert main(["compress", str(document), "--policy", "snapkv", "--keep", "0.5", "--out", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "compressed by snapkv (keep=0.5)" in summary and out.is_file()
    question = "What is the secret passcode for the vault?"
    assert main(["ask", str(out), question, "Who wrote the text?", "--max-new-tokens", "20"]) == 0
    answers = capsys.readouterr().out.strip().splitlines()
    assert [line[:4] for line in answers] == ["[1] ", "[2] "]
    assert main(["ask", str(out), question, "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out.strip() == answers[0][4:]  # each question from its own copy


def test_a_cache_that_does_not_name_its_model_asks_for_one(refused, tmp_path) -> None:
    """A cache of a model kvevict.load_model did not load records no source to load it from again."""
    model = tiny_model()
    cache = kvevict.EvictionCache(model, "h2o", budget=24)
    with torch.no_grad():
        model(input_ids=prompt(40), past_key_values=cache)
    path = cache.save(tmp_path / "tiny.kv")
    assert refused(["ask", str(path), "why?"]) == (
        f"kvevict ask: error: {path} does not say which model it was saved from: give --model\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ask", "/no/such/doc.kv", "why?"], "no such file"),
        (["ask", "BAD", "why?"], "is not a readable kvevict cache"),
        (["ask", "DOC", "why?", "--max-new-tokens", "0"], "--max-new-tokens must be a positive"),
    ],
)
def test_bad_input_is_refused_in_one_line(argv, message: str, refused) -> None:
    assert message in refused(argv)
