"""Continuous batching under a cap on resident KV memory: the loop every throughput workload runs.

Owns: admission, the running batch (its rows, their slots, their ceilings), the decode step,
and what the run measured (time, resident bytes, batch sizes). Each sequence comes as a
:class:`Job`, which knows how to build its batch-1 cache (a prompt prefilled and compressed,
or a compressed document copied and asked a question); this module only schedules them.

* **Admission by ceiling.** A job is admitted while the running batch's bound, plus the
  job's transient while its cache is built, fits the cap, and the batch's bound with the
  job as one more row fits it too. A row's *ceiling* is the most entries any of its KV heads
  will hold until it finishes (:meth:`~kvevict.cache.EvictionCache.row_ceiling`: budget +
  interval for a decode-time policy, retained entries + new tokens otherwise), and a batch's
  *bound* is what padded storage of that many columns holds
  (:func:`~kvevict.storage.capacity_bound`: room to grow and slack included) for every row:
  ``rows × capacity_bound(max ceiling) × column bytes``. A quantized setting's bound counts what
  its layers hold between passes (:class:`~kvevict.storage.ColumnBytes`: codes, scales and zero
  points per entry, at most ``flush − 1`` full-precision entries, positions, validity and state
  per column) and one layer dequantized, the one a pass attends, so the same cap admits
  proportionally more of its rows. Before a job's cache exists its
  ceiling is predicted (:meth:`Job.predicted_ceiling`); once built, the real one is checked,
  and a job that no longer fits waits, its cache counted, until a row finishes.
* **Decoding.** The running rows decode together, one token per row and step, each at its
  own position (``position_ids=cache.next_positions()``); a finished row frees its slot,
  which the next job's row fills (:meth:`~kvevict.cache.EvictionCache.splice`).
* **Measured.** ``peak_kv_bytes`` is the most resident bytes seen: the batch's
  :meth:`~kvevict.cache.EvictionCache.kv_bytes` after every step and splice, plus, while a
  job is built, its pass's peak (:meth:`Job.start_peak`: per layer, entries per head in padded
  storage). The copies a splice makes while it adds a row are transient and not counted.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedModel

from kvevict.bench.clock import now
from kvevict.bench.memory import MIB
from kvevict.cache import EvictionCache
from kvevict.compat import with_cache
from kvevict.storage import ColumnBytes, capacity_bound

NextTokens = Callable[[torch.Tensor, Sequence[Sequence[int]]], list[int]]
"""Picks each row's next token from its logits ``[B, V]`` and its tokens so far (greedy by default)."""


class Job(Protocol):
    """One sequence to serve."""

    new_tokens: int
    """Tokens to generate (the first comes from the job's own pass)."""

    def transient_bytes(self, free_bytes: int, column_bytes: Sequence[int]) -> int | None:
        """Resident bytes its cache holds at most while it is built (``column_bytes``: per layer,
        of an entry column), choosing the cheapest way that fits ``free_bytes`` (e.g. chunked
        prefill); None: no way fits."""

    def predicted_ceiling(self) -> list[int]:
        """Its row's ceiling (per layer, entries per head), predicted before its cache exists."""

    def start(self) -> tuple[EvictionCache, torch.Tensor]:
        """Build its batch-1 cache (as chosen by the last :meth:`transient_bytes`) and return it
        with the logits ``[V]`` of its first new token."""

    def start_peak(self) -> list[int]:
        """Per layer, the most entries per KV head its cache held during the last :meth:`start`, in
        padded storage (a prompt's prefill; a question, its compressed document's widest head
        there and the question: a copy's own pass, not the prefill the document once had)."""


def padded_bytes(entries: Sequence[int], column_bytes: Sequence[int], room: int = 0) -> int:
    """Resident bytes of one row holding ``entries[l]`` entries per head in layer ``l`` (room to
    grow and slack included: :func:`~kvevict.storage.capacity_bound`)."""
    return sum(capacity_bound(n, room) * size for n, size in zip(entries, column_bytes, strict=True))


def batch_bound(ceilings: Sequence[Sequence[int]], room: int, layers: Sequence[ColumnBytes]) -> int:
    """Resident bytes of a batch whose rows have ``ceilings`` (per layer, entries per head) in
    padded storage: each layer as long as its longest row's ceiling there (the layers of a pass
    are all unpacked at once), a row of layer ``l`` holding what ``layers[l]`` says; quantized,
    the layers between passes and the largest of them dequantized while a pass attends it."""
    if not ceilings:
        return 0
    longest = [max(row[layer] for row in ceilings) for layer in range(len(layers))]
    resident = sum(layer.resident(n, room) for layer, n in zip(layers, longest, strict=True))
    return len(ceilings) * (resident + max(layer.attended(n, room) for layer, n in zip(layers, longest)))


@dataclass
class Served:
    """What one run measured."""

    outputs: list[list[int]]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    seconds: float = 0.0
    peak_bytes: int = 0
    max_batch: int = 0
    decode_steps: int = 0
    batch_sizes: list[int] = field(default_factory=list)


@dataclass
class _Row:
    job: int
    ceiling: list[int]


class Server:
    """Serves jobs under ``cap_bytes`` of resident KV memory (module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        cap_bytes: int,
        next_tokens: NextTokens | None = None,
        stop_tokens: Collection[int] = (),
        shared_bytes: Callable[[], int] = lambda: 0,
    ):
        """``stop_tokens``: a row finishes early on one of them (an answer's end of sequence).
        ``shared_bytes``: resident bytes the jobs hold between them (compressed documents that
        questions are still to be asked about), counted against the cap."""
        self.model, self.cap = model, cap_bytes
        self.next_tokens = next_tokens or (lambda logits, _: logits.argmax(-1).tolist())
        self.stop_tokens, self.shared_bytes = frozenset(stop_tokens), shared_bytes
        self.batch: EvictionCache | None = None
        self.rows: list[_Row | None] = []
        self.waiting: tuple[int, EvictionCache] | None = None
        self.layer_bytes: list[ColumnBytes] = []
        self.room = 1

    def _ceilings(self, extra: Sequence[Sequence[int]] = ()) -> list[Sequence[int]]:
        return [row.ceiling for row in self.rows if row is not None] + list(extra)

    def _bound(self, extra: Sequence[Sequence[int]] = ()) -> int:
        waiting = 0 if self.waiting is None else self.waiting[1].kv_bytes()
        return batch_bound(self._ceilings(extra), self.room, self.layer_bytes) + waiting + self.shared_bytes()

    def _remaining(self, served: Served, job: int, jobs: Sequence[Job]) -> int:
        output = served.outputs[job]
        return 0 if output and output[-1] in self.stop_tokens else jobs[job].new_tokens - len(output)

    @torch.inference_mode()
    def serve(self, jobs: Sequence[Job], estimate: Sequence[ColumnBytes]) -> Served:
        """Serve every job once; ``estimate``: per layer, what a row's entries hold before any
        cache was measured (raised to each built cache's)."""
        served = Served(outputs=[[] for _ in jobs])
        self.layer_bytes = list(estimate)
        pending = list(range(len(jobs)))
        start = now(self.model.device)
        while pending or self.waiting is not None or any(row is not None for row in self.rows):
            self._retire(served, jobs)
            while self._admit(pending, jobs, served):
                pass
            self._step(jobs, served)
        served.seconds = now(self.model.device) - start
        if self.batch is not None:
            self.batch.close()
            self.batch, self.rows = None, []
        return served

    def _admit(self, pending: list[int], jobs: Sequence[Job], served: Served) -> bool:
        """Admit one job (or the waiting one) if the cap allows; whether one was."""
        running = any(row is not None for row in self.rows)
        if self.waiting is not None:
            return self._join_or_wait(*self.waiting, served, jobs, running)
        if not pending:
            return False
        job = pending[0]
        free = self.cap - self._bound()
        transient = jobs[job].transient_bytes(free, [layer.dense for layer in self.layer_bytes])
        predicted = jobs[job].predicted_ceiling()
        if transient is None or self._bound([predicted]) > self.cap:
            if running:
                return False  # wait for a running row to finish
            need = max(transient or 0, batch_bound([predicted], self.room, self.layer_bytes))
            shared = self.shared_bytes()
            raise ValueError(
                f"the memory cap ({self.cap / MIB:.1f} MiB) holds no sequence of this setting: one needs about "
                f"{need / MIB:.1f} MiB ({max(predicted)} entries per head at most while it decodes)"
                + (f", besides the {shared / MIB:.1f} MiB its compressed document holds" if shared else "")
            )
        pending.pop(0)
        tick = now(self.model.device)
        cache, logits = jobs[job].start()
        served.prefill_s += now(self.model.device) - tick
        built_bytes = [layer.storage_bytes() for layer in cache.eviction_layers]
        self.layer_bytes = [mine.widest(theirs) for mine, theirs in zip(self.layer_bytes, built_bytes, strict=True)]
        self.room = max(self.room, cache.sequences[0].interval)
        padded = sum(entries * size for entries, size in zip(jobs[job].start_peak(), cache.column_bytes(), strict=True))
        served.peak_bytes = max(served.peak_bytes, self._resident() + max(cache.kv_bytes(), padded))
        served.outputs[job].append(self.next_tokens(logits[None], [served.outputs[job]])[0])
        return self._join_or_wait(job, cache, served, jobs, running)

    def _join_or_wait(self, job: int, cache: EvictionCache, served: Served, jobs: Sequence[Job], running: bool) -> bool:
        """Join the batch with ``cache``'s row if its real ceiling fits beside the running rows; else it
        waits, holding its cache, for a row to finish. Whether it joined."""
        ceiling = cache.row_ceiling(0, self._remaining(served, job, jobs))
        if running and batch_bound(self._ceilings([ceiling]), self.room, self.layer_bytes) > self.cap:
            self.waiting = (job, cache)  # its real ceiling exceeds the prediction
            return False
        self.waiting = None
        self._join(job, cache, ceiling, served)
        return True

    def _join(self, job: int, cache: EvictionCache, ceiling: list[int], served: Served) -> None:
        if self.batch is None:
            self.batch, self.rows = cache, [_Row(job, ceiling)]
        else:
            slot = next((i for i, row in enumerate(self.rows) if row is None), len(self.rows))
            self.batch.splice(slot, cache)  # a finished sequence's slot, or a new row
            cache.close()
            self.rows[slot : slot + 1] = [_Row(job, ceiling)]
        running = sum(row is not None for row in self.rows)
        served.max_batch = max(served.max_batch, running)
        served.peak_bytes = max(served.peak_bytes, self._resident())

    def _resident(self) -> int:
        waiting = 0 if self.waiting is None else self.waiting[1].kv_bytes()
        return (0 if self.batch is None else self.batch.kv_bytes()) + waiting + self.shared_bytes()

    def _retire(self, served: Served, jobs: Sequence[Job]) -> None:
        """Free the slots of finished rows (the whole batch once none runs)."""
        self.rows = [None if row is None or self._remaining(served, row.job, jobs) <= 0 else row for row in self.rows]
        if self.batch is not None and all(row is None for row in self.rows):
            self.batch.close()
            self.batch, self.rows = None, []

    def _step(self, jobs: Sequence[Job], served: Served) -> None:
        """One decode step of every running row (free slots no newcomer took are dropped first)."""
        self._retire(served, jobs)
        free = [i for i, row in enumerate(self.rows) if row is None]
        if free and self.batch is not None:
            self.batch.remove_rows(free)
            self.rows = [row for row in self.rows if row is not None]
        if not self.rows:
            return
        histories = [served.outputs[row.job] for row in self.rows]
        tokens = torch.tensor([[history[-1]] for history in histories], device=self.model.device)
        tick = now(self.model.device)
        logits = self.model(
            input_ids=tokens, position_ids=self.batch.next_positions(), **with_cache(self.batch)
        ).logits[:, -1]
        served.decode_s += now(self.model.device) - tick
        served.decode_steps += 1
        served.batch_sizes.append(len(self.rows))
        served.peak_bytes = max(served.peak_bytes, self._resident())
        for history, token in zip(histories, self.next_tokens(logits, histories)):
            history.append(token)
