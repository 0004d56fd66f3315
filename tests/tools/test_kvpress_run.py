"""tools/kvpress_run.py: what runs in kvpress's own environment scores and records as kvevict does
(the presses themselves run only there: kvpress pins another transformers)."""

import importlib.util
from pathlib import Path

from kvevict.bench.ruler import string_match_all

spec = importlib.util.spec_from_file_location("kvpress_run", Path(__file__).parents[2] / "tools" / "kvpress_run.py")
kvpress_run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kvpress_run)


def test_it_scores_as_kvevict_does() -> None:
    for prediction, answers in [(" The number is 1234.\n", ["1234"]), ("a B c", ["b", "d"]), ("x\x01y", ["x\ny"])]:
        assert kvpress_run.string_match_all(prediction, answers) == string_match_all(prediction, answers)


def test_its_records_are_what_kvevict_report_reads() -> None:
    from kvevict.bench.report import summarize

    sample = {"task": "t", "index": 0, "length": 64, "seed": 0, "model": "m", "answers": ["7"], "metric": "m"}
    record = kvpress_run.record(sample, "keydiff", 0.25, "it is 7")
    (row,) = summarize([record])
    assert (row.policy, row.keep, row.score) == ("kvpress:keydiff", 0.25, 100.0)


def test_each_press_is_named_by_the_kvevict_policy_it_is_compared_with() -> None:
    class Stub:  # kvpress's presses, as their constructor arguments
        def __getattr__(self, name):
            return lambda *args, **kwargs: (name, args, kwargs)

    presses = kvpress_run.presses(Stub())
    assert presses["snapkv[pool=avg]"](0.25) == (
        "SnapKVPress",
        (),
        {"compression_ratio": 0.75, "window_size": 32, "kernel_size": 7},
    )
    assert presses["think+snapkv[pool=avg]"](0.1)[2] == {}
    (snap, think) = presses["think+snapkv[pool=avg]"](0.1)[1][0]
    assert snap[2]["compression_ratio"] == 0.9 and think[2]["key_channel_compression_ratio"] == 0.4
