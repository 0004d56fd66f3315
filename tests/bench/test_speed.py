"""The decode-speed benchmark runs end to end (its timings are never asserted)."""

from __future__ import annotations

import pytest

from kvevict.bench import speed
from kvevict.cli import main
from tests.conftest import tiny_model


def test_measure_reports_each_policy_and_batch_against_the_full_cache() -> None:
    rows = speed.measure(tiny_model(), ["streamingllm", "h2o"], entries=16, batch_sizes=(1, 2), steps=1, repeats=1)
    assert [(row["batch"], row["policy"]) for row in rows] == [
        (1, "streamingllm"),
        (1, "h2o"),
        (2, "streamingllm"),
        (2, "h2o"),
    ]
    assert all(row["ratio"] > 0 and row["full_ms"] > 0 for row in rows)
    table = speed.format_table(rows)
    assert table.count("\n") == 5 and "| h2o | 2 |" in table


def test_measure_runs_quantized_caches() -> None:
    rows = speed.measure(tiny_model(), ["h2o"], entries=16, batch_sizes=(1,), steps=1, repeats=1, quant="int4")
    assert [row["policy"] for row in rows] == ["h2o (int4)"] and rows[0]["ratio"] > 0


def test_each_step_is_paired_with_a_full_cache_holding_as_many_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """An evicting policy against the full cache at ``entries``; ``full`` (evicts nothing) against a full
    cache that got the same prompt and grows with it."""
    held: list[int] = []
    timed = speed._step_seconds

    def record(model, cache, token):  # entries attended in this step: those held plus the new one
        held.append(cache.layers[0].n if hasattr(cache.layers[0], "n") else cache.get_seq_length())
        return timed(model, cache, token)

    monkeypatch.setattr(speed, "_step_seconds", record)
    speed.measure(tiny_model(), ["full", "h2o"], entries=16, batch_sizes=(1,), steps=2, repeats=1, progress=False)
    full_pairs, h2o_pairs = held[:4], held[4:]
    assert full_pairs == [16 + 64, 16 + 64, 16 + 65, 16 + 65]  # both hold the prompt, then one more entry a step
    assert h2o_pairs[0::2] == [16, 16]  # the full cache cropped back to `entries`, h2o evicted to its budget
    assert all(n <= 17 for n in h2o_pairs[1::2])


def test_the_ratio_is_the_median_of_each_pairs_ratio() -> None:
    # pairs 2/1, 3/2, 10/4: ratios 2, 1.5, 2.5 (the ratio of the medians would be 3/2)
    assert speed.paired_ratio([2.0, 3.0, 10.0], [1.0, 2.0, 4.0]) == 2.0
    assert speed.paired_ratio([4.0, 1.0], [2.0, 1.0]) == 1.5


def test_an_interval_policy_is_compared_interval_by_interval_eviction_included() -> None:
    # blocks of 2 pairs: (1 + 5) / (1 + 1) = 3, (2 + 2) / (1 + 1) = 2, (9 + 1) / (2 + 3) = 2 → median 2
    times, full = [1.0, 5.0, 2.0, 2.0, 9.0, 1.0], [1.0, 1.0, 1.0, 1.0, 2.0, 3.0]
    assert speed.paired_ratio(times, full, block=2) == 2.0
    assert speed.blocks([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [3.0, 7.0]  # a partial block is left out
    # rkv at budget 16 evicts every min(128, 16 // 2) = 8 steps: one step asked, one whole interval taken
    (row,) = speed.measure(tiny_model(), ["rkv"], entries=16, batch_sizes=(2,), steps=1, repeats=2)
    assert row["interval"] == 8 and row["ratio"] > 0


@pytest.mark.parametrize(("times", "full"), [([], []), ([1.0], [1.0, 2.0])])
def test_unpaired_steps_are_refused(times: list[float], full: list[float]) -> None:
    with pytest.raises(ValueError, match="paired steps needed"):
        speed.paired_ratio(times, full)


@pytest.mark.parametrize("flag", ["--batch-sizes=1,x", "--entries=0", "--interval=0"])
def test_bad_options_exit_with_usage_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:  # argparse's own exit, or main's return value
        raise SystemExit(main(["bench", "decode-speed", flag]))
    assert exit_.value.code == 2
    assert "kvevict bench decode-speed: error:" in capsys.readouterr().err


def test_an_unknown_policy_is_refused_in_one_line_before_the_model_loads(monkeypatch, capsys) -> None:
    def no_model(*_args, **_kwargs):
        raise AssertionError("the model loaded before the policies were checked")

    monkeypatch.setattr("kvevict.models.load_model", no_model)
    assert main(["bench", "decode-speed", "--policies", "h2o,h2oo"]) == 2
    err = capsys.readouterr().err
    assert "unknown policy 'h2oo'" in err and err.count("\n") == 1


def test_each_batch_size_is_printed_once_measured_so_an_interrupted_run_keeps_it(monkeypatch, capsys) -> None:
    measured = []

    def measure(model, policies, *, batch_sizes, **_options):
        if measured:
            raise KeyboardInterrupt  # the run stopped while its second batch size was being measured
        measured.append(batch_sizes)
        return [{"batch": batch_sizes[0], "policy": "h2o", "interval": 1, "ms": 2.0, "full_ms": 1.0, "ratio": 2.0}]

    monkeypatch.setattr("kvevict.models.load_model", lambda *_args, **_kwargs: (None, None))
    monkeypatch.setattr(speed, "measure", measure)
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "decode-speed", "--policies", "h2o", "--batch-sizes", "1,8"])
    assert measured == [(1,)]
    assert "| h2o | 1 | 1 | 2.0 | 1.0 | 2.00x |" in capsys.readouterr().out


def test_a_device_torch_cannot_use_is_refused_in_one_line(capsys) -> None:
    assert main(["bench", "decode-speed", "--policies", "h2o", "--device", "gpu"]) == 2
    assert (
        capsys.readouterr().err
        == "kvevict bench decode-speed: error: unknown device 'gpu'; use cpu, cuda, cuda:N or mps\n"
    )
