"""``kvevict train-gates`` (kvevict.commands.train_gates): the settings refused before a model
loads, and the ones given handed to the trainer (the training itself: tests/gates/test_train.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvevict.cli import main
from kvevict.gates.train import TrainConfig

REFUSAL = (
    "kvevict train-gates: error: --length must exceed 5, --tokens and --steps be >= 1, --top and --order >= 0 "
    "and --count >= 2 (one is held out)\n"
)


@pytest.mark.parametrize(
    "argv",
    [
        ["--length", "5"],
        ["--length", "1024,5"],
        ["--tokens", "0"],
        ["--steps", "0"],
        ["--top", "-1"],
        ["--order", "-0.5"],
        ["--count", "1"],
    ],
)
def test_bad_settings_are_refused_in_one_line_before_a_model_loads(argv, monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr("kvevict.models.load_model", lambda *a, **k: pytest.fail("the model should not load"))
    assert main(["train-gates", "--model", "smollm2", "--out", str(tmp_path), *argv]) == 2
    assert capsys.readouterr().err == REFUSAL


def test_the_settings_given_reach_the_trainer_and_the_rest_are_its_defaults(monkeypatch, tmp_path, capsys) -> None:
    built = []

    def build(model, tokenizer, config, out, texts):
        built.append((model, tokenizer, config, out, texts))
        return out / "gates.safetensors"

    monkeypatch.setattr("kvevict.models.load_model", lambda name: (f"model of {name}", "tokenizer"))
    monkeypatch.setattr("kvevict.gates.train.build", build)
    argv = ["--model", "tiny", "--out", str(tmp_path), "--length", "6,64", "--steps", "3", "--lr", "0.5"]
    assert main(["train-gates", *argv, "--top", "2", "--text", "a.txt", "b.txt"]) == 0
    config = TrainConfig(model="tiny", length=(6, 64), steps=3, lr=0.5, top=2)
    assert built == [("model of tiny", "tokenizer", config, tmp_path, [Path("a.txt"), Path("b.txt")])]
    assert capsys.readouterr().out == f"wrote {tmp_path / 'gates.safetensors'}\n"
