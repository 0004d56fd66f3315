import pytest

import kvevict
from kvevict.cli import main


def test_policies_lists_name_and_summary(capsys) -> None:
    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == kvevict.list_policies()
    assert all(len(line.split()) > 2 for line in lines)


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["policies", "--help"], ["demo", "--help"]])
def test_help_everywhere(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0 and "usage: kvevict" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--policy", "h2oo", "--budget", "64", "hi"], "unknown policy 'h2oo'; known policies: full"),
        (["generate", "--policy", "snapkv", "--budget", "8", "hi"], "budget 8 is smaller than snapkv's"),
    ],
)
def test_bad_input_exits_2_with_a_message_before_loading(argv, message: str, capsys) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_budget_and_keep_are_exclusive(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--budget", "64", "--keep", "0.5", "hi"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


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
    assert "[streamingllm, budget=16]" in captured.err and "retained 16 per KV head" in captured.err
