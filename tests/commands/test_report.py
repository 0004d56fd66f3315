"""``kvevict report`` (kvevict.commands.report): a results directory's table and plot."""

from pathlib import Path

from kvevict.cli import main


def test_report_prints_the_table_and_plots(tmp_path, capsys) -> None:
    run = Path(__file__).parents[1] / "bench" / "data" / "report_run"
    assert main(["report", str(run), "--plot", str(tmp_path / "p.png")]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0].split()[:3] == ["task", "policy", "budget"]
    assert (tmp_path / "p.png").is_file() and "plot:" in captured.err


def test_report_on_a_missing_run_exits_2(tmp_path, capsys) -> None:
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "has no results.jsonl" in capsys.readouterr().err


def test_report_prints_the_frontier_in_bytes(tmp_path, capsys) -> None:
    run = Path(__file__).parents[1] / "bench" / "data" / "report_run"
    assert main(["report", str(run), "--frontier", str(tmp_path / "f.png")]) == 0
    captured = capsys.readouterr()
    assert "| setting | saves by |" in captured.out and "95 %" in captured.out.splitlines()[-1]
    assert (tmp_path / "f.png").is_file()
