"""``kvevict train-gates`` (kvevict.commands.train_gates): the settings refused before a model
loads, and the ones given handed to the trainer (the training itself: tests/gates/test_train.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvevict.cli import main
from kvevict.gates.train import TrainConfig

REFUSAL = (
    "kvevict train-gates: error: --length must exceed 5, --tokens, --steps and --workers be >= 1, "
    "--top, --order and --listwise >= 0 and --count >= 2 (one is held out)\n"
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
        ["--workers", "0"],
        ["--listwise", "-1"],
    ],
)
def test_bad_settings_are_refused_in_one_line_before_a_model_loads(argv, monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr("kvevict.models.load_model", lambda *a, **k: pytest.fail("the model should not load"))
    assert main(["train-gates", "--model", "smollm2", "--out", str(tmp_path), *argv]) == 2
    assert capsys.readouterr().err == REFUSAL


def test_the_settings_given_reach_the_trainer_and_the_rest_are_its_defaults(monkeypatch, tmp_path, capsys) -> None:
    built = []

    def build(model, tokenizer, config, out, texts, workers):
        built.append((model, tokenizer, config, out, texts, workers))
        return out / "gates.safetensors"

    monkeypatch.setattr("kvevict.models.load_model", lambda name: (f"model of {name}", "tokenizer"))
    monkeypatch.setattr("kvevict.gates.train.build", build)
    argv = ["--model", "tiny", "--out", str(tmp_path), "--length", "6,64", "--steps", "3", "--lr", "0.5"]
    argv += ["--listwise", "0.1"]
    assert main(["train-gates", *argv, "--top", "2", "--text", "a.txt", "b.txt", "--workers", "2"]) == 0
    config = TrainConfig(model="tiny", length=(6, 64), steps=3, lr=0.5, top=2, listwise=0.1)
    assert built == [("model of tiny", "tokenizer", config, tmp_path, [Path("a.txt"), Path("b.txt")], 2)]
    assert capsys.readouterr().out == f"wrote {tmp_path / 'gates.safetensors'}\n"


def test_judged_results_are_recorded_in_the_outs_gates_without_training(monkeypatch, tmp_path, capsys) -> None:
    import json

    from safetensors import safe_open
    from transformers import AutoConfig

    from kvevict.gates import initial_gates, save_gates, shape_of
    from kvevict.gates.judged import KEY
    from kvevict.models import smollm2_checkpoint
    from tests.gates.test_judged import ROWS

    monkeypatch.setattr("kvevict.models.load_model", lambda *a, **k: pytest.fail("the model should not load"))
    monkeypatch.setattr("kvevict.gates.train.build", lambda *a, **k: pytest.fail("nothing should train"))
    gates = tmp_path / "llama-L30-D576-H9-KV3.safetensors"
    save_gates(gates, initial_gates(shape_of(AutoConfig.from_pretrained(smollm2_checkpoint()))), {})
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    assert main(["train-gates", "--model", "smollm2", "--out", str(tmp_path), "--judged", str(results)]) == 0
    assert capsys.readouterr().out == (
        f"recorded in {gates}: fastkvzip on 3 samples keeps 100.0 % of full's score at keep 0.25, 50.0 % at keep 0.1\n"
    )
    with safe_open(str(gates), "pt") as opened:
        assert json.loads(opened.metadata()[KEY])["share_of_full"] == {"0.25": 100.0, "0.1": 50.0}
    assert main(["train-gates", "--model", "smollm2", "--out", str(tmp_path / "none"), "--judged", str(results)]) == 2
    assert "does not exist: train the gates into --out first" in capsys.readouterr().err
