"""Where records go: one JSON object per line, and TensorBoard event files.

A record is a flat dict of numbers for one optimizer step (plus ``step`` and ``time``). Writers
are called once per record, never per step, so their cost is spread over ``log_every`` steps.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any, Protocol

from mpt.errors import MissingDependencyError


def metrics_file(run_dir: Path, rank: int) -> Path:
    """Rank 0's metrics.jsonl is the run's; other ranks (with --metrics-all-ranks) add theirs."""
    return run_dir / ("metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl")


def tensorboard_dir(run_dir: Path, rank: int) -> Path:
    """One folder per rank, so TensorBoard shows the ranks as runs side by side."""
    return run_dir / "tensorboard" / f"rank{rank}"


class Writer(Protocol):
    def write(self, step: int, values: dict[str, Any], walltime: float) -> None: ...

    def close(self) -> None: ...


def _finite(value: Any) -> Any:
    """JSON has no inf or NaN: such a value (an overflowed fp16 step) is written as null."""
    return value if not isinstance(value, float) or math.isfinite(value) else None


class JsonlWriter:
    """``metrics.jsonl``: readable by anything, and by `mpt visualize` while the run goes on.

    Each record is written whole and flushed, so a reader sees at most one half-written line,
    the last one.
    """

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")
        self._put({"meta": meta})

    def write(self, step: int, values: dict[str, Any], walltime: float) -> None:
        self._put({"step": step, "time": round(walltime, 3),
                   **{k: _finite(v) for k, v in values.items()}})

    def _put(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardWriter:
    """TensorBoard event files, written in the calling thread with tensorboard's RecordWriter.

    torch's ``SummaryWriter`` hands every event to a writer thread; each hand-off wakes that
    thread, which then holds the GIL that a Python-bound training loop needs, and short steps
    measurably slowed down. Here a record is one event (one ``Summary`` with all its numbers),
    serialised and written whole, then flushed, so TensorBoard also reads a run in progress.
    """

    def __init__(self, log_dir: Path) -> None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.record_writer import RecordWriter
        except ImportError as exc:
            raise MissingDependencyError("writing TensorBoard files (--run-dir)", "tensorboard",
                                         "pip install tensorboard", str(exc)) from exc
        self._event, self._summary = Event, Summary
        log_dir.mkdir(parents=True, exist_ok=True)
        # The name TensorBoard looks for (the one SummaryWriter gives its files).
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.0"
        self.file = (log_dir / name).open("wb")
        self.records = RecordWriter(self.file)
        self._put(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write(self, step: int, values: dict[str, Any], walltime: float) -> None:
        scalars = [self._summary.Value(tag=k, simple_value=float(v))
                   for k, v in values.items() if isinstance(v, (int, float))]
        if scalars:
            self._put(self._event(wall_time=walltime, step=step,
                                  summary=self._summary(value=scalars)))

    def _put(self, event: Any) -> None:
        self.records.write(event.SerializeToString())
        self.file.flush()

    def close(self) -> None:
        self.file.close()
