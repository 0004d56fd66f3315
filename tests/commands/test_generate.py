"""``kvevict generate`` (kvevict.commands.generate): bad input refused before a model
loads, naming what was wrong; prompts answered, several as one batch in order."""

import pytest

from kvevict.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--policy", "h2oo", "--budget", "64", "hi"], "unknown policy 'h2oo'; known policies: full"),
        (["generate", "-", "hi", "-"], "'-' (read the prompt from standard input) can stand for one prompt only"),
        (["generate", "--policy", "snapkv", "--budget", "8", "hi"], "budget 8 is smaller than snapkv's"),
        (["generate", "--policy", "h2o[window=8", "--budget", "64", "hi"], "bad policy spec 'h2o[window=8'"),
        (["generate", "--policy", "h2o[window=80]", "--budget", "64", "hi"], "smaller than h2o's sinks (4) + recent"),
        (
            ["generate", "--policy", "snapkv[window=abc]", "--budget", "64", "hi"],
            "kvevict generate: error: snapkv: parameter 'window' expects an integer >= 1, got 'abc'",
        ),
        (
            ["generate", "--policy", "adakv+critical+lagkv", "--budget", "64", "hi"],
            "critical and lagkv's own lagkv-quotas are both selectors",
        ),
        (
            ["generate", "--model", "/no/such/dir", "hi"],
            "model path '/no/such/dir' does not exist; a model (--model) is 'smollm2' (the embedded",
        ),
    ],
)
def test_bad_input_exits_2_with_a_message_before_loading(argv, message: str, capsys) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_model_directory_without_a_config_or_a_file_is_refused(tmp_path, capsys) -> None:
    assert main(["generate", "--model", str(tmp_path), "hi"]) == 2
    assert "has no config.json; a model (--model) is 'smollm2'" in capsys.readouterr().err
    (tmp_path / "model.gguf").write_text("")
    assert main(["generate", "--model", str(tmp_path / "model.gguf"), "hi"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_on_the_embedded_model(capsys) -> None:
    assert (
        main(
            [
                "generate",
                "--model",
                "smollm2",
                "--policy",
                "streamingllm",
                "--budget",
                "16",
                "--max-new-tokens",
                "8",
                "Name a color.",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "[streamingllm, budget=16]" in captured.err and "% of the entries (16 per KV head)" in captured.err


@pytest.mark.slow
def test_generate_answers_several_prompts_as_one_batch_in_order(capsys) -> None:
    options = ["--model", "smollm2", "--policy", "h2o", "--budget", "16", "--max-new-tokens", "6"]
    prompts = ["Name a color.", "What is the capital of France? Answer in one word."]
    assert main(["generate", *options, *prompts]) == 0
    batched = capsys.readouterr().out.splitlines()
    alone = []
    for text in prompts:
        assert main(["generate", *options, text]) == 0
        alone.append(capsys.readouterr().out.strip())
    assert batched == [f"[{i}] {reply}" for i, reply in enumerate(alone, start=1)]
