"""Sweeps on a local 2-CPU Ray cluster: the records of a local run, resumable, robust to a lost worker.

A tiny random model behind the real SmolLM2 tokenizer is saved to disk, so that every worker
loads the same model by path. The first test starts (and stops) its own cluster through the
command line; the others share one cluster.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvevict.bench.cluster import LOCAL_TEMP_DIR, ClusterConfig, require_ray, run_sweep
from kvevict.bench.runner import BenchConfig, BenchRunner, Unit, UnitRunner
from kvevict.bench.store import RESULTS_FILE, ResultStore
from kvevict.cli import main
from tests.conftest import tiny_model

pytestmark = pytest.mark.xdist_group("ray")  # one local cluster at a time: they share LOCAL_TEMP_DIR

VOLATILE = ("prefill_s", "decode_s", "finished_at")
"""Timings: the only fields that differ between two runs of the same sweep."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model(vocab=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def sweep(model_dir: Path) -> BenchConfig:
    """Two samples × (full, h2o, snapkv) at one budget, with fidelity: six units, three per sample."""
    return BenchConfig(
        tasks=("niah_single_1",),
        model=str(model_dir),
        policies=("full", "h2o", "snapkv"),
        budgets=(40,),
        samples=2,
        length=200,
        max_new_tokens=6,
        fidelity=True,
    )


def comparable(store: ResultStore) -> list[dict[str, Any]]:
    """The store's records without timings, in a fixed order (workers finish in any order)."""
    records = [{k: v for k, v in record.items() if k not in VOLATILE} for record in store]
    return sorted(records, key=lambda r: (r["index"], r["policy"]))


@pytest.fixture(scope="module")
def local(model_dir, tmp_path_factory) -> Path:
    """The sweep run here, unit by unit: the records every cluster run must reproduce."""
    out = tmp_path_factory.mktemp("local")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker with one CPU: the fidelity KL's last bits depend on it
    try:
        BenchRunner(sweep(model_dir), out).run(progress=False)
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray = require_ray()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=LOCAL_TEMP_DIR)
    yield
    ray.shutdown()


def test_the_command_on_two_workers_writes_the_local_records(model_dir, local, tmp_path, capsys) -> None:
    ray = require_ray()
    assert not ray.is_initialized()
    args = ["bench", "niah_single_1", "--model", str(model_dir), "--policies", "full,h2o,snapkv", "--budgets", "40"]
    args += ["--samples", "2", "--length", "200", "--max-new-tokens", "6", "--fidelity", "--out", str(tmp_path)]
    assert main([*args, "--workers", "2"]) == 0
    assert not ray.is_initialized()  # the local cluster it started is stopped
    assert comparable(ResultStore(tmp_path)) == comparable(ResultStore(local))
    assert len((tmp_path / RESULTS_FILE).read_text().splitlines()) == 2 * 3
    assert "niah_single_1" in capsys.readouterr().out  # the report


def test_a_resumed_sweep_runs_only_what_is_missing_and_then_nothing(model_dir, local, ray_cluster, tmp_path) -> None:
    lines = (local / RESULTS_FILE).read_text().splitlines(keepends=True)
    (tmp_path / RESULTS_FILE).write_text("".join(lines[:3]))  # as if a local run had stopped half-way
    result = run_sweep(sweep(model_dir), tmp_path, ClusterConfig(workers=2), progress=False)
    assert result.complete and not result.lost
    assert comparable(result.store) == comparable(ResultStore(local))
    written = (tmp_path / RESULTS_FILE).read_bytes()
    assert written.startswith("".join(lines[:3]).encode()) and len(written.splitlines()) == 6

    again = run_sweep(sweep(model_dir), tmp_path, ClusterConfig(workers=1), progress=False)
    assert again.complete and (tmp_path / RESULTS_FILE).read_bytes() == written


def test_a_unit_whose_worker_dies_is_redone_once_on_another(model_dir, local, ray_cluster, tmp_path) -> None:
    attempts = tmp_path / "attempts"  # one line per run of a unit, by any worker
    out = tmp_path / "out"

    class DyingRunner(UnitRunner):
        """Dies (the whole actor process) on the first attempt at h2o on sample 1, its record computed
        but not yet handed over."""

        def run(self, unit: Unit) -> Iterator[dict[str, Any]]:
            name = f"{unit.setting.policy}-{unit.samples[0].index}"
            first = name not in attempts.read_text().split() if attempts.exists() else True
            with attempts.open("a") as log:
                log.write(f"{name} {os.getpid()}\n")
            for record in super().run(unit):
                if name == "h2o-1" and first:
                    os._exit(1)
                yield record

    result = run_sweep(sweep(model_dir), out, ClusterConfig(workers=2), progress=False, runner=DyingRunner)
    assert result.complete
    assert [(f.unit.setting.policy, [s.index for s in f.unit.samples]) for f in result.lost] == [("h2o", [1])]
    runs = [line.split() for line in attempts.read_text().splitlines()]
    names = [name for name, _ in runs]
    assert sorted(names) == sorted(["full-0", "full-1", "h2o-0", "h2o-1", "h2o-1", "snapkv-0", "snapkv-1"])
    first, retry = [pid for name, pid in runs if name == "h2o-1"]
    assert first != retry
    assert comparable(ResultStore(out)) == comparable(ResultStore(local))
    assert len((out / RESULTS_FILE).read_text().splitlines()) == 6  # nothing written twice


def test_a_failing_unit_is_reported_and_the_others_finish(model_dir, ray_cluster, tmp_path, capsys) -> None:
    args = ["bench", "niah_single_1", "--model", str(model_dir), "--policies", "full,headkv,h2o", "--budgets", "40"]
    args += ["--samples", "2", "--length", "200", "--max-new-tokens", "6", "--out", str(tmp_path)]
    assert main([*args, "--workers", "2"]) == 1
    err = capsys.readouterr().err
    # the tiny model has no bundled head profile: headkv fails when its cache is built
    assert err.count("failed: headkv at budget 40 on niah_single_1 (sample") == 2
    assert "ValueError: headkv needs a head profile for this model" in err
    assert "2 units failed" in err
    assert sorted((r["policy"], r["index"]) for r in ResultStore(tmp_path)) == [
        ("full", 0),
        ("full", 1),
        ("h2o", 0),
        ("h2o", 1),
    ]


def test_workers_without_ray_fail_with_the_install_hint(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["bench", "niah_single_1", "--workers", "2", "--out", str(tmp_path)]) == 2
    assert "pip install 'kvevict[ray]'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "--workers must be at least 1"),
        (["--workers", "1", "--cpus-per-worker", "0"], "--cpus-per-worker > 0"),
        (["--ray-address", "auto"], "--ray-address needs --workers"),
    ],
)
def test_bad_cluster_options_are_refused_before_any_work(args, message, tmp_path, capsys) -> None:
    assert main(["bench", "niah_single_1", *args, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_a_worker_no_node_can_hold_is_refused(model_dir, ray_cluster, tmp_path) -> None:
    with pytest.raises(ValueError, match="no node of the Ray cluster can hold a worker with 1 CPUs and 1 GPUs"):
        run_sweep(sweep(model_dir), tmp_path, ClusterConfig(workers=1, gpus_per_worker=1), progress=False)
