"""Continuous batching under a cap on resident bytes (``kvevict.bench.serving``): the batch bound,
admission by ceiling, a job whose real ceiling exceeds its prediction, the refusal."""

from __future__ import annotations

import pytest

from kvevict.bench.runner import Setting
from kvevict.bench.serving import Server, batch_bound
from kvevict.bench.throughput import estimate_column_bytes
from kvevict.bench.workloads import Learned, PromptJob
from kvevict.quant import QuantConfig
from kvevict.storage import ColumnBytes, capacity_bound
from tests.bench.test_throughput import full_column_bytes, rows_bound
from tests.conftest import prompt, tiny_model


def test_a_batch_is_bounded_by_its_longest_rows_padded_storage_layer_by_layer() -> None:
    layers = [ColumnBytes(100), ColumnBytes(10)]
    assert batch_bound([], 4, layers) == 0
    rows = [[10, 400], [40, 5], [25, 5]]  # per layer: a layer as long as its longest row there
    assert batch_bound(rows, 4, layers) == 3 * (capacity_bound(40, 4) * 100 + capacity_bound(400, 4) * 10)
    assert capacity_bound(40, 4) == 40 + 4 + 16 and capacity_bound(400, 4) == 400 + 4 + 100


def test_a_quantized_batch_is_bounded_by_its_codes_its_residual_and_one_dense_layer() -> None:
    """int4, 2 KV heads of 16 dims, fp32, groups of 16, residual 32: per entry and head 16 B of
    codes and 16 B of scales and zero points; 4 B of position, 1 of validity per column and head."""
    quant = QuantConfig.make("int4", 16, 32, 16)
    dense = 2 * (2 * 16 * 4 + 8 + 1)
    layer = ColumnBytes.of(dense, 2, 16, 4, quant)
    assert (layer.coded, layer.kept, layer.full, layer.tail) == (2 * 32, 2 * 5, 2 * 128, 31)
    rows = [[100, 100], [60, 20]]
    columns, short = capacity_bound(100, 1), capacity_bound(20, 1)
    between = columns * 10 + 100 * 64 + 31 * 256
    assert batch_bound(rows, 1, [layer, layer]) == 2 * (2 * between + columns * (dense + 2))
    assert layer.resident(20, 1) == short * 10 + 20 * 64 + 20 * 256  # all of a short row at full precision
    assert batch_bound(rows, 1, [ColumnBytes(dense)] * 2) == 2 * 2 * columns * dense


class Underestimated(PromptJob):
    """A prompt whose row's ceiling is predicted far too low (as for a policy whose heads
    keep more than its budget before any was measured)."""

    def predicted_ceiling(self) -> list[int]:
        return [1] * len(self.cache().eviction_layers)


def test_a_job_whose_real_ceiling_does_not_fit_waits_for_a_row_to_finish() -> None:
    model = tiny_model()
    column = sum(full_column_bytes(model))
    cap = rows_bound(model, 3, 67) - column  # 60 + 7 fed tokens per row: two full rows, not three
    assert rows_bound(model, 2, 67) + capacity_bound(60, 0) * column <= cap  # and a prefill beside them
    jobs = [Underestimated(model, prompt(60, seed=s), Setting("full"), 8, Learned()) for s in range(4)]
    served = Server(model, cap).serve(jobs, estimate_column_bytes(model))
    assert served.max_batch == 2 and served.peak_bytes <= cap
    assert [len(tokens) for tokens in served.outputs] == [8] * 4


def test_a_cap_below_one_sequence_is_refused() -> None:
    model = tiny_model()
    jobs = [PromptJob(model, prompt(60), Setting("full"), 8, Learned())]
    with pytest.raises(ValueError, match=r"holds no sequence of this setting: one needs about [\d.]+ MiB"):
        Server(model, 1000).serve(jobs, estimate_column_bytes(model))
