"""``kvevict bench --workers N``: a sweep spread over Ray actors, with the same records and store.

Each worker is a Ray actor that loads the model once (a :class:`~kvevict.bench.runner.UnitRunner`,
the local loop's own engine) and runs the units it is handed. The driver plans the units
(:func:`~kvevict.bench.runner.plan_units`), streams back each unit's records one per sample, and
alone appends them to the store (fsynced), so a worker can never corrupt it. A unit whose worker
dies is narrowed to its unfinished samples and retried on another worker, while a fresh actor
replaces the dead one; a unit that raises is reported with its setting and error, and the sweep
goes on. A unit replayed against the full cache's answer (fidelity) waits for its group's
``full`` unit.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from tqdm import tqdm

from kvevict.bench.runner import (
    BenchConfig,
    Setting,
    Unit,
    UnitRunner,
    pending,
    plan_units,
    replays_reference,
    with_references,
)
from kvevict.bench.store import ResultStore
from kvevict.bench.task import Sample
from kvevict.bench.tasks import get_task

INSTALL_HINT = "pip install 'kvevict[ray]'"
LOCAL_TEMP_DIR = "/tmp/kvevict-ray"
"""Session directory of a local cluster: short, because Ray's socket paths must fit in 107 bytes
(a long ``$TMPDIR``, as some CI runners set, breaks the default)."""


@dataclass(frozen=True)
class ClusterConfig:
    """Where a sweep runs and how wide."""

    workers: int
    """Ray actors, each with its own copy of the model."""
    address: str | None = None
    """A running cluster to join (what ``ray start --head`` prints, or ``auto``); None: start a
    local cluster for the sweep and stop it afterwards."""
    gpus_per_worker: float = 0.0
    """GPUs per actor (fractions share a GPU); with GPUs the model loads on ``cuda`` unless the
    bench's ``device`` says otherwise."""
    cpus_per_worker: float = 1.0
    """CPUs per actor, and its torch threads (rounded down, at least 1). Float results (e.g. the
    fidelity KL) are bit-identical to a local run's with as many threads; with another count they
    differ in the last bits (the order of CPU sums depends on it), predictions and scores do not."""
    max_attempts: int = 3
    """Times a unit may lose its worker before it is reported failed, so that a unit that kills
    every worker it lands on (out of memory, a crash in a kernel) cannot loop forever."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.gpus_per_worker < 0 or self.cpus_per_worker <= 0:
            raise ValueError(
                f"--gpus-per-worker must be >= 0 and --cpus-per-worker > 0, "
                f"got {self.gpus_per_worker:g} and {self.cpus_per_worker:g}"
            )
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")


@dataclass(frozen=True)
class UnitFailure:
    """A unit that did not finish (or lost a worker), and why."""

    unit: Unit
    error: str

    def describe(self) -> str:
        return f"{self.unit.describe()}: {self.error}"


@dataclass
class SweepResult:
    """What a sweep on the cluster left: the store, the units that failed, the worker losses survived."""

    store: ResultStore
    failed: list[UnitFailure] = field(default_factory=list)
    lost: list[UnitFailure] = field(default_factory=list)
    """One entry per worker that died under a unit; each such unit was retried (or failed, after
    :attr:`ClusterConfig.max_attempts`)."""

    @property
    def complete(self) -> bool:
        return not self.failed


def require_ray() -> ModuleType:
    """The ``ray`` module, or a usage error saying how to install it."""
    try:
        import ray
    except ImportError as err:  # a usage error: the command asks for what this installation lacks
        raise ValueError(f"--workers runs the sweep on Ray, which is not installed: {INSTALL_HINT}") from err
    return ray


def run_sweep(
    config: BenchConfig,
    out: str | Path,
    cluster: ClusterConfig,
    *,
    progress: bool = True,
    runner: type[UnitRunner] = UnitRunner,
) -> SweepResult:
    """Run (or resume) ``config`` into ``out`` on ``cluster.workers`` Ray actors.

    Joins ``cluster.address`` or starts a local cluster (stopped afterwards); a session this
    process already opened with ``ray.init`` is used as it is. ``runner`` is the class each actor
    instantiates with ``config`` (a subclass can watch or disturb a worker, as the tests do).
    """
    ray = require_ray()
    store = ResultStore(out)
    with _session(ray, cluster):
        _check_fits(ray, cluster)
        return _Driver(ray, config, cluster, store, runner).run(progress)


@contextmanager
def _session(ray: ModuleType, cluster: ClusterConfig) -> Iterator[None]:
    if ray.is_initialized():
        yield
        return
    quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
    if cluster.address is None:  # "local": a new cluster even where one already runs on this node
        cpus = math.ceil(cluster.workers * cluster.cpus_per_worker)
        ray.init(address="local", num_cpus=cpus, _temp_dir=LOCAL_TEMP_DIR, **quiet)
    else:
        ray.init(address=cluster.address, **quiet)
    try:
        yield
    finally:
        ray.shutdown()


def _check_fits(ray: ModuleType, cluster: ClusterConfig) -> None:
    """Refuse workers no node can hold: their actors would wait forever for resources."""
    need = {"CPU": cluster.cpus_per_worker, "GPU": cluster.gpus_per_worker}
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    if not any(all(node.get(name, 0.0) >= amount for name, amount in need.items()) for node in nodes):
        sizes = ", ".join(f"{node.get('CPU', 0.0):g} CPUs and {node.get('GPU', 0.0):g} GPUs" for node in nodes)
        raise ValueError(
            f"no node of the Ray cluster can hold a worker with {cluster.cpus_per_worker:g} CPUs and "
            f"{cluster.gpus_per_worker:g} GPUs (nodes: {sizes or 'none'}); lower --cpus-per-worker or "
            "--gpus-per-worker"
        )


class _Worker:
    """The Ray actor: one model, loaded once when the actor starts, running the units it is handed."""

    def __init__(self, runner: type[UnitRunner], config: BenchConfig, threads: int):
        torch.set_num_threads(threads)  # CPU kernels sum in thread-dependent order: pin it to the CPUs held
        self.runner = runner(config)

    def ready(self) -> None:
        """Answers once the model is loaded."""

    def samples(self) -> dict[str, list[Sample]]:
        return self.runner.samples()

    def run(self, unit: Unit) -> Iterator[dict[str, Any]]:
        """Streamed to the driver (a Ray generator): one record per finished sample."""
        yield from self.runner.run(unit)


class _Driver:
    """Hands units to idle workers, writes their records, retries lost units, reports failures.

    A worker that dies is replaced at once, so the sweep keeps its width.
    """

    def __init__(
        self, ray: ModuleType, config: BenchConfig, cluster: ClusterConfig, store: ResultStore, runner: type[UnitRunner]
    ):
        self.ray, self.config, self.cluster, self.store, self.runner = ray, config, cluster, store, runner
        on_gpu = cluster.gpus_per_worker > 0 and config.device is None
        self.worker_config = replace(config, device="cuda") if on_gpu else config
        self.actor = ray.remote(num_cpus=cluster.cpus_per_worker, num_gpus=cluster.gpus_per_worker)(_Worker)
        self.result = SweepResult(store)
        self.starting: dict[Any, Any] = {}  # readiness ref -> actor
        self.idle: list[Any] = []
        self.running: dict[Any, tuple[Unit, Any]] = {}  # record stream -> (unit, actor)
        self.queue: deque[Unit] = deque()
        self.waiting: dict[tuple[str, str], list[Unit]] = {}  # group -> units replaying its full unit
        self.attempts: dict[tuple[tuple[str, str], Setting], int] = {}

    def run(self, progress: bool) -> SweepResult:
        try:
            with tqdm(desc="bench", unit="sample", disable=not progress) as self.bar:
                for _ in range(self.cluster.workers):
                    self._start_worker()
                units = plan_units(self.config, self._samples(), self.store)
                self.bar.reset(total=sum(len(unit.samples) for unit in units))
                self._schedule(units)
                while self.queue or self.running or self.waiting:
                    while self.queue and self.idle:
                        unit, actor = self.queue.popleft(), self.idle.pop()
                        stream = actor.run.remote(with_references(self.config, unit, self.store))
                        self.running[stream] = (unit, actor)
                    self._next_event()
        finally:
            for actor in [*self.starting.values(), *self.idle, *(actor for _, actor in self.running.values())]:
                self.ray.kill(actor)
        return self.result

    def _start_worker(self) -> None:
        threads = max(1, int(self.cluster.cpus_per_worker))
        actor = self.actor.remote(self.runner, self.worker_config, threads)
        self.starting[actor.ready.remote()] = actor

    def _samples(self) -> dict[str, list[Sample]]:
        """The sweep's samples, from the first worker up (they need the model's tokenizer)."""
        while not self.idle:
            self._next_event()
        return self.ray.get(self.idle[0].samples.remote())

    def _schedule(self, units: list[Unit]) -> None:
        """Queue the units; those replaying a ``full`` unit of this sweep wait for it."""
        references = {unit.group for unit in units if unit.setting.reference}
        for unit in units:
            if unit.group in references and replays_reference(self.config, get_task(unit.task), unit.setting):
                self.waiting.setdefault(unit.group, []).append(unit)
            else:
                self.queue.append(unit)

    def _next_event(self) -> None:
        """Handle what comes first: a worker ready (or not), or a unit's next record, end or error."""
        [event], _ = self.ray.wait([*self.starting, *self.running], num_returns=1)
        if event in self.starting:
            self._started(event)
            return
        unit, actor = self.running[event]
        errors = self.ray.exceptions
        try:
            record = self.ray.get(next(event))
        except StopIteration:
            del self.running[event]
            self.idle.append(actor)
            self._finished(unit)
        except errors.RayTaskError as err:  # the unit raised; its worker carries on
            del self.running[event]
            self.idle.append(actor)
            self._fail(unit, f"{type(err.cause).__name__}: {err.cause}")
        except errors.RayError as err:  # the worker died (killed, crashed, out of memory, node lost)
            del self.running[event]
            self.ray.kill(actor)
            self._lost(unit, err)
        else:
            self.store.append(record)
            self.bar.update()

    def _started(self, ready: Any) -> None:
        actor = self.starting.pop(ready)
        try:
            self.ray.get(ready)
        except self.ray.exceptions.RayActorError as err:
            if err.actor_init_failed:  # e.g. the model does not load: every worker would fail alike
                raise RuntimeError(f"a Ray worker could not start:\n{err}") from err
            self._start_worker()  # its node went away: try again
            return
        self.idle.append(actor)

    def _finished(self, unit: Unit) -> None:
        if unit.setting.reference:
            self.queue.extend(self.waiting.pop(unit.group, []))

    def _lost(self, unit: Unit, err: Exception) -> None:
        """The unit's worker died: replace it, and retry what the unit has left on whichever worker is free."""
        self._start_worker()
        key = (unit.group, unit.setting)
        self.attempts[key] = attempt = self.attempts.get(key, 0) + 1
        self.result.lost.append(UnitFailure(unit, f"worker lost ({type(err).__name__})"))
        rest = pending(self.config, unit, self.store)
        if rest is None:  # it died after its last record
            self._finished(unit)
        elif attempt >= self.cluster.max_attempts:
            self._fail(rest, f"lost its worker {attempt} times (last: {type(err).__name__})")
        else:
            tqdm.write(f"worker lost while running {unit.describe()}; retrying {len(rest.samples)} of its samples")
            self.queue.appendleft(rest)

    def _fail(self, unit: Unit, error: str) -> None:
        failure = UnitFailure(unit, error)
        self.result.failed.append(failure)
        tqdm.write(f"failed: {failure.describe()}")
        if unit.setting.reference:
            for waiting in self.waiting.pop(unit.group, []):
                self._fail(waiting, "its full reference failed")
