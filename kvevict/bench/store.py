"""The results store: one JSON line per finished sample, appended and flushed at once.

An interrupted run loses nothing it finished: every line is written and fsynced when its
sample ends, a torn last line (the process died mid-write) is cut off when the store is
reopened, and a restarted run skips every configuration already present.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RESULTS_FILE = "results.jsonl"
KEY_FIELDS = (
    "task",
    "index",
    "length",
    "seed",
    "model",
    "policy",
    "policy_params",
    "budget",
    "keep",
    "interval",
    "query_aware",
    "max_new_tokens",
    "prefill_chunk",  # absent from records written before it: None, one pass
    "quant",  # likewise: None, full precision
    "quant_group",  # likewise (and unquantized): None, EvictionCache's default
    "residual",  # likewise
)


def record_key(record: dict[str, Any]) -> str:
    """What identifies a result: the sample and the full configuration that produced it."""
    return json.dumps([record.get(field) for field in KEY_FIELDS], sort_keys=True, default=str)


class ResultStore:
    """``DIR/results.jsonl``, append-only."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.path = self.directory / RESULTS_FILE
        self.directory.mkdir(parents=True, exist_ok=True)
        self._repair()
        self._records = {record_key(record): record for record in self}

    def _repair(self) -> None:
        """Cut a torn last line left by an interrupted write."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            self.path.write_bytes(data[: data.rfind(b"\n") + 1])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        with self.path.open(encoding="utf-8") as lines:
            for line in lines:
                if line.strip():
                    yield json.loads(line)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, record: dict[str, Any]) -> bool:
        return record_key(record) in self._records

    def get(self, identity: dict[str, Any]) -> dict[str, Any]:
        """The stored record with the same key as ``identity``."""
        return self._records[record_key(identity)]

    def append(self, record: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
            out.flush()
            os.fsync(out.fileno())
        self._records[record_key(record)] = record
