"""What rank 0 shows while training: a rich progress bar on a terminal, plain lines elsewhere.

The bar is redrawn by rich's own refresh thread; the training loop only moves a counter per
step (under a microsecond) and hands over the latest record every ``log_every`` steps.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class Display(Protocol):
    def advance(self, step: int) -> None:
        """Called every optimizer step: must cost next to nothing."""

    def show(self, step: int, values: dict[str, Any]) -> None:
        """Called with each record."""

    def set_total(self, total: int | None) -> None: ...

    def close(self) -> None: ...


def summary(values: dict[str, Any]) -> str:
    """The record's headline figures, e.g. ``loss 0.4123  412 samples/s  scale 65536``."""
    parts = []
    if values.get("loss") is not None:
        parts.append(f"loss {values['loss']:.4g}")
    if values.get("samples_per_s") is not None:
        parts.append(f"{values['samples_per_s']:,.0f} samples/s")
    elif values.get("step_time_s"):
        parts.append(f"{1 / values['step_time_s']:,.1f} steps/s")
    if values.get("loss_scale", 1.0) != 1.0:
        parts.append(f"scale {values['loss_scale']:g}")
    if values.get("skipped_steps"):
        parts.append(f"skipped {values['skipped_steps']}")
    return "  ".join(parts)


class RichBar:
    """step/total, bar, loss, samples/s, loss scale, elapsed and ETA, redrawn twice a second
    (a redraw takes ~1 ms of Python, holding the GIL the training loop needs).

    While the bar is live, rich routes the script's own prints above it.
    """

    def __init__(self, stream: TextIO, total: int | None) -> None:
        self.progress = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("{task.fields[summary]}"), TimeElapsedColumn(), TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(file=stream), refresh_per_second=2, transient=False)
        self.task: TaskID = self.progress.add_task("train", total=total, summary="")
        self.progress.start()

    def advance(self, step: int) -> None:
        self.progress.update(self.task, completed=step)

    def show(self, step: int, values: dict[str, Any]) -> None:
        self.progress.update(self.task, completed=step, summary=summary(values))

    def set_total(self, total: int | None) -> None:
        self.progress.update(self.task, total=total)

    def close(self) -> None:
        self.progress.stop()


class PlainLines:
    """One line per record at most every ``interval`` seconds (and the first and last ones), for
    logs and pipes, where a redrawn bar would leave a mess of carriage returns."""

    def __init__(self, stream: TextIO, total: int | None, interval: float = 10.0) -> None:
        self.stream, self.total, self.interval = stream, total, interval
        self.start = time.monotonic()
        self.last_line = -float("inf")
        self.pending: tuple[int, dict[str, Any]] | None = None

    def advance(self, step: int) -> None:
        pass

    def show(self, step: int, values: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - self.last_line < self.interval:
            self.pending = (step, values)
            return
        self.last_line, self.pending = now, None
        self._line(step, values, now)

    def _line(self, step: int, values: dict[str, Any], now: float) -> None:
        elapsed = now - self.start
        of = f"/{self.total}" if self.total else ""
        eta = ""
        if self.total and step:
            eta = f"  ETA {_clock(elapsed / step * max(self.total - step, 0))}"
        print(f"step {step}{of}  {summary(values)}  elapsed {_clock(elapsed)}{eta}",
              file=self.stream, flush=True)

    def set_total(self, total: int | None) -> None:
        self.total = total

    def close(self) -> None:
        if self.pending is not None:  # the last record, so the log ends with the final figures
            self._line(*self.pending, time.monotonic())
            self.pending = None


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def make_display(total: int | None, stream: TextIO | None = None) -> Display:
    """A bar where ``stream`` (stderr by default) is a terminal, plain lines otherwise."""
    stream = stream or sys.stderr
    if Console(file=stream).is_terminal:
        return RichBar(stream, total)
    return PlainLines(stream, total)
