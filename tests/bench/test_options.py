"""Comma-separated option values: parsed, or refused naming what is allowed (exit code 2)."""

from __future__ import annotations

import argparse

import pytest

from kvevict.bench.options import comma_separated, quant_list
from kvevict.cli import main


def test_parses_comma_separated_values() -> None:
    assert comma_separated(int)("1, 8,") == (1, 8)
    assert comma_separated(float)("0.25,0.1") == (0.25, 0.1)


@pytest.mark.parametrize(("text", "low"), [("a,2", None), ("", None), ("0,8", 1), ("0.5", None)])
def test_refuses_a_bad_list_naming_what_is_allowed(text: str, low: int | None) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected comma-separated integers"):
        comma_separated(int, low=low)(text)


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "niah_single_1", "--budgets", "64,x", "--out", "unused"],
        ["bench", "throughput", "--keep", "half", "--out", "unused"],
        ["bench", "decode-speed", "--batch-sizes", "0,8"],
    ],
)
def test_the_cli_exits_2_with_the_reason(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "expected comma-separated" in capsys.readouterr().err


def test_parses_quant_options_with_none_for_full_precision() -> None:
    assert quant_list("none,int8, int4,int2") == (None, "int8", "int4", "int2")


@pytest.mark.parametrize("text", ["int3", "", "int4,fp8"])
def test_refuses_a_bad_quant_list_naming_what_is_allowed(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected comma-separated int8, int4, int2 or none"):
        quant_list(text)
