"""The prefill-speed benchmark runs end to end (its timings are never asserted)."""

from __future__ import annotations

import pytest
import torch

from kvevict.bench import prefill_speed
from kvevict.cli import main
from tests.conftest import prompt, tiny_model


def test_each_policy_and_length_is_paired_with_plain_prefills() -> None:
    prompts = {48: prompt(48), 96: prompt(96)}
    policies = ["snapkv[window=8]", "fastkvzip[gates=initial,window=4]"]
    rows = prefill_speed.measure(tiny_model(), prompts, policies, repeats=2)
    assert [(row["length"], row["policy"]) for row in rows] == [(n, name) for n in (48, 96) for name in policies]
    assert all(row["ratio"] > 0 and row["plain_seconds"] > 0 for row in rows)
    kept = [(row["kept_share"], row["kept_mean"], row["kept_longest"]) for row in rows if row["policy"] == policies[0]]
    assert kept == [(0.25, 12.0, 12), (0.25, 24.0, 24)]  # keep 0.25 of each prompt, in every head
    table = prefill_speed.format_table(rows)
    assert table.count("\n") == 5 and "| snapkv[window=8] | 96 | 25.0% | 24.0, 24 |" in table


def test_a_chunked_prefill_keeps_the_budget() -> None:
    (row,) = prefill_speed.measure(
        tiny_model(), {96: prompt(96)}, ["snapkv[window=8]"], keep=None, budget=20, chunk=32, repeats=1
    )
    assert row["kept_longest"] == 20 and row["kept_share"] == 20 / 96


def test_the_prompts_are_the_essays_cut_to_each_length() -> None:
    class Words:  # one token per character: enough to check the cut
        def __call__(self, text: str, **_: object):
            return type("Encoded", (), {"input_ids": torch.tensor([[ord(c) % 97 for c in text[:5000]]])})()

    prompts = prefill_speed.essay_prompts(Words(), (100, 300))
    assert {length: tuple(ids.shape) for length, ids in prompts.items()} == {100: (1, 100), 300: (1, 300)}
    assert torch.equal(prompts[100], prompts[300][:, :100])
    with pytest.raises(ValueError, match="fewer than --lengths"):
        prefill_speed.essay_prompts(Words(), (10_000,))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "snapkvv"], "unknown policy 'snapkvv'"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--keep", "1.5"], "keep"),
        (["--prefill-chunk", "0"], "prefill chunk"),
        (["--device", "gpu"], "unknown device 'gpu'; use cpu, cuda, cuda:N or mps"),
    ],
)
def test_bad_options_are_refused_in_one_line_before_the_model_loads(argv, message: str, capsys) -> None:
    assert main(["bench", "prefill-speed", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
