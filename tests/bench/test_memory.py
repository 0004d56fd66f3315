import json

import pytest
import torch

from kvevict.bench import memory
from kvevict.bench.memory import LiveTensorBytes, longest_feasible, predicted_over_cap, run_memory
from kvevict.cli import main
from tests.conftest import tiny_model


def test_live_tensor_bytes_counts_allocations_until_freed() -> None:
    with LiveTensorBytes() as tracker:
        a = torch.zeros(1000)
        b = a + 1
        view = b[:10]  # same storage: not counted twice
        del a
        c = b * 2
        del b, view
    assert tracker.peak == 2 * 4000  # never more than two of a, b, c alive together
    assert tracker.live == 4000  # c is still alive
    del c
    assert tracker.live == 0


def test_feasibility_from_the_cap() -> None:
    points = [(n, 100 + n + n * n) for n in (10, 20, 40)]
    assert longest_feasible(points, 2000) == (40, 43)  # 100 + n + n² = 2000 at n ≈ 43.1
    assert longest_feasible(points[:2], 2000) == (20, int(20 * (2000 / 520) ** 0.5))
    assert predicted_over_cap(points, 80, 5000) and not predicted_over_cap(points, 50, 5000)


def test_eager_attentions_grow_faster_than_the_attention_free_path(tmp_path) -> None:
    model = tiny_model()
    lengths = (64, 128, 256)
    paths = ("eager-attentions", "attention-free", "attention-requiring")
    summary = run_memory(model, "tiny", lengths, tmp_path, cap_bytes=2**30, paths=paths, progress=False)
    peak = {(r["path"], r["length"]): r["peak_bytes"] for r in summary["results"]}
    assert len(peak) == 9
    eager_growth = peak[("eager-attentions", 256)] / peak[("eager-attentions", 64)]
    free_growth = peak[("attention-free", 256)] / peak[("attention-free", 64)]
    assert eager_growth > 6 and free_growth < 5  # quadratic attention maps vs linear activations
    assert peak[("eager-attentions", 256)] > peak[("attention-requiring", 256)] > 0
    lines = (tmp_path / "memory.jsonl").read_text().splitlines()
    assert len(lines) == 9 and json.loads(lines[0])["measure"].startswith("live tensor bytes")
    # resumed: nothing is measured again; a cap below eager's peak at 128 stops that path
    cap = peak[("eager-attentions", 128)] - 1
    summary = run_memory(
        model, "tiny", (*lengths, 512), tmp_path, cap_bytes=cap, paths=("eager-attentions",), progress=False
    )
    eager = summary["feasible"]["eager-attentions"]
    assert eager["longest_measured"] == 64 and eager["not_run"] == [512] and 64 < eager["extrapolated"] < 128
    assert len((tmp_path / "memory.jsonl").read_text().splitlines()) == 9
    text = memory.format_summary(summary)
    assert "over cap" in text and "eager-attentions: longest measured under the cap 64" in text
    assert memory.plot_summary(summary, tmp_path / "memory.png").is_file()


def test_chunked_prefill_peak_stops_growing_with_the_context(tmp_path) -> None:
    model = tiny_model()
    paths = ("eager-attentions", "chunked-snapkv", "chunked-h2o", "chunked-epikv")
    summary = run_memory(model, "tiny", (128, 512), tmp_path, 2**30, paths, False, budget=40, chunk=32)
    peak = {(r["path"], r["length"]): r["peak_bytes"] for r in summary["results"]}
    for path in paths[1:]:
        assert peak[(path, 512)] < 1.2 * peak[(path, 128)]  # budget + chunk entries, whatever the length
        assert peak[(path, 512)] < peak[("eager-attentions", 512)] / 4
    assert {(r["budget"], r["chunk"]) for r in summary["results"] if r["path"] != "eager-attentions"} == {(40, 32)}
    again = run_memory(model, "tiny", (128, 512), tmp_path, 2**30, paths[1:], False, budget=48, chunk=32)
    assert {r["budget"] for r in again["results"] if r["path"] != "eager-attentions"} == {48}  # measured anew


def test_chunked_fastkvzip_peak_stops_growing_with_the_context_as_chunked_snapkv(tmp_path, smollm2) -> None:
    """The pooled default (one budget over every layer and head, allocated after each chunk, with no cap:
    each chunk's pass over a ragged layer stays packed, docs/fastkvzip.md round 9) and the per-head one:
    once the context is well past the prompt window (512 tokens held until the last chunk, round 13),
    only the token ids and the per-token scalars grow with it, as chunked SnapKV's, though a head of the
    pool keeps more than round 8's cap (4·B) at the longer context."""
    model, _ = smollm2  # fastkvzip needs trained gates: SmolLM2's are packaged
    paths = ("chunked-snapkv", "chunked-fastkvzip", "chunked-fastkvzip-per-layer")
    summary = run_memory(model, "smollm2", (1152, 1536), tmp_path, 2**34, paths, False, budget=40, chunk=128)
    peak = {(r["path"], r["length"]): r["peak_bytes"] for r in summary["results"]}
    held = {(r["path"], r["length"]): r["peak_tokens"] for r in summary["results"]}
    growth = {path: peak[(path, 1536)] - peak[(path, 1152)] for path in paths}
    assert growth["chunked-fastkvzip"] <= 1.05 * growth["chunked-snapkv"]
    assert growth["chunked-fastkvzip-per-layer"] <= 1.05 * growth["chunked-snapkv"]
    assert held[("chunked-fastkvzip", 1536)] > 4 * 40 + 128  # no cap: a head keeps more than 4·B, a chunk on top
    assert held[("chunked-snapkv", 1536)] == 40 + 128
    assert held[("chunked-fastkvzip-per-layer", 1536)] == 40 + (512 - 32) + 128  # the prompt window beside the budget
    assert {"chunked-fastkvzip", "chunked-fastkvzip-per-layer"}.isdisjoint(memory.DEFAULT_PATHS)  # named only


def test_bench_memory_command_line(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "memory", "--help"])
    assert exit_info.value.code == 0 and "usage: kvevict bench memory" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "memory", "--paths", "eager"])
    assert "unknown paths ['eager']; known paths: eager-attentions" in capsys.readouterr().err
    assert main(["bench", "memory", "--memory-cap", "0"]) == 2
    assert "--memory-cap must be a positive number of MiB" in capsys.readouterr().err
    assert main(["bench", "memory", "--paths", "chunked-epikv", "--budget", "64", "--chunk", "128"]) == 2
    assert "chunked-epikv holds the first chunk whole" in capsys.readouterr().err
