"""The runtime's observer: turns backward/clip/step calls into records, files and progress.

The training loop pays for it per step with a list append and a counter. Every ``log_every``
steps one record is made: the losses and gradient norms seen since the last record are stacked
into one tensor and copied to the host once (on CUDA without blocking: the copy is picked up at a
later step, so the loop never waits for the GPU). The files are written in the training thread:
a writer thread of its own made short steps slower, not faster, because it takes the GIL from the
loop for up to a switch interval (5 ms) each time it wakes.
"""

from __future__ import annotations

import atexit
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mpt.metrics.config import MetricsConfig
from mpt.metrics.memory import memory_metrics
from mpt.metrics.progress import Display, make_display
from mpt.metrics.writers import (
    JsonlWriter,
    TensorBoardWriter,
    Writer,
    metrics_file,
    tensorboard_dir,
)
from mpt.precision import Precision

if TYPE_CHECKING:
    from mpt.connector import Connection


class _Pending:
    """A record whose device figures (losses, gradient norms) may still be on their way."""

    def __init__(self, step: int, losses: list[torch.Tensor], norms: list[torch.Tensor],
                 values: dict[str, Any]) -> None:
        self.step, self.values, self.walltime = step, values, time.time()
        self.split = len(losses)
        self.figures: torch.Tensor | None = _stack(losses + norms)
        self.ready: torch.cuda.Event | None = None
        if self.figures is not None and self.figures.is_cuda:
            self.figures = self.figures.to("cpu", non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def done(self) -> bool:
        return self.ready is None or self.ready.query()

    def finish(self) -> dict[str, Any]:
        if self.ready is not None:
            self.ready.synchronize()
        figures = self.figures.tolist() if self.figures is not None else []
        losses, norms = figures[:self.split], figures[self.split:]
        self.values["loss"] = sum(losses) / len(losses) if losses else None
        # An overflowed fp16 step has an inf norm that says nothing about the model (the
        # skipped-steps count says it): the mean is over the finite norms.
        finite = [n for n in norms if math.isfinite(n)]
        self.values["grad_norm"] = sum(finite) / len(finite) if finite else None
        return self.values


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D fp32 tensor of scalars, with as few device operations as the inputs allow."""
    if not tensors:
        return None
    first = tensors[0]
    if all(t.dtype == first.dtype and t.dim() == 0 for t in tensors):
        return torch.stack(tensors).float()
    return torch.stack([t.float().reshape(()) for t in tensors])


class Monitor:
    """Progress on rank 0 and metrics files per run directory, fed by ``mpt.Runtime``.

    Args:
        config: what to record and show.
        rank: this process's global rank.
        device: where the losses live (and whose memory is reported).
        precision: the run's precision, for the loss scale and the skipped steps.
        meta: facts about the run written at the top of metrics.jsonl (backend, world size...).
    """

    def __init__(self, config: MetricsConfig, *, rank: int, device: torch.device,
                 precision: Precision, meta: dict[str, Any]) -> None:
        self.config, self.rank, self.device, self.precision = config, rank, device, precision
        self.writers: list[Writer] = []
        if config.run_dir is not None and (rank == 0 or config.all_ranks):
            run_dir = config.run_dir.absolute()
            self.writers = [JsonlWriter(metrics_file(run_dir, rank), {**meta, "rank": rank}),
                            TensorBoardWriter(tensorboard_dir(run_dir, rank))]
        self.show_progress = rank == 0 and not config.quiet
        self.active = bool(self.writers) or self.show_progress
        """False when there is nothing to show or write: every hook then returns at once."""
        self.display: Display | None = None
        self.step = 0
        """The runtime's optimizer step count (skipped ones included) at the last ``on_step``."""
        self._start = 0
        self.total: int | None = None
        self.samples_per_step: int | None = None
        """Samples per optimizer step over all ranks, for samples/s (set by setup_dataloader)."""
        self._losses: list[torch.Tensor] = []
        self._norms: list[torch.Tensor] = []
        self._window = (0, time.perf_counter())
        self._pending: _Pending | None = None
        self._closed = False
        if self.active:
            atexit.register(self.close)

    @classmethod
    def for_run(cls, run: Connection) -> Monitor:
        """The monitor a run's settings ask for (``run_dir``, ``quiet``, ``log_every``,
        ``metrics_all_ranks``), its metrics files headed by the run's facts."""
        config, precision = run.config, run.precision
        metrics = MetricsConfig(run_dir=None if config.run_dir is None else Path(config.run_dir),
                                quiet=config.quiet, log_every=config.log_every,
                                all_ranks=config.metrics_all_ranks)
        return cls(metrics, rank=run.world.rank, device=run.device, precision=precision, meta={
            "backend": run.backend.name, "precision": precision.name,
            "world_size": run.world.world_size, "accumulate": run.accumulate})

    # -- hooks called by the runtime ------------------------------------------------------------
    def on_backward(self, loss: torch.Tensor) -> None:
        if self.active:
            self._losses.append(loss.detach())

    def on_grad_norm(self, norm: torch.Tensor) -> None:
        if self.active:
            self._norms.append(norm.detach())

    def on_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """``step``: the runtime's count of optimizer steps, this one included."""
        if not self.active:
            return
        self.step = step
        if self.step == self._start + 1:
            if self.show_progress:
                self.display = make_display(self.total)
            if self.config.log_every > 1:  # rates from here on, not counting set-up time
                self._window = (self.step, time.perf_counter())
        if self._pending is not None and self._pending.done():
            self._emit(self._pending)
            self._pending = None
        if self.step % self.config.log_every == 0:
            self._record(optimizer)
        elif self.display is not None:
            self.display.advance(self.step)

    def resume_at(self, step: int) -> None:
        """Count on from a loaded checkpoint's step, so a resumed run's records continue its
        curves instead of starting again at 0."""
        self.step = self._start = step
        self._window = (step, time.perf_counter())

    def set_total(self, total: int | None, samples_per_step: int | None = None) -> None:
        """The run's optimizer steps (for the ETA) and, where given, its samples per step."""
        self.total = total
        if samples_per_step is not None:
            self.samples_per_step = samples_per_step
        if self.display is not None:
            self.display.set_total(total)

    def log(self, values: dict[str, Any]) -> None:
        """Write the user's own metrics at the current step (tensors are read here)."""
        if not self.writers or self._closed:
            return
        numbers = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        for writer in self.writers:
            writer.write(self.step, numbers, time.time())

    def close(self) -> None:
        """Write what is pending, stop the bar, close the files; safe to call more than once."""
        if self._closed or not self.active:
            return
        if self._pending is not None:
            self._emit(self._pending)
            self._pending = None
        self._closed = True
        if self.display is not None:
            self.display.close()
        for writer in self.writers:
            writer.close()

    # -- records --------------------------------------------------------------------------------
    def _record(self, optimizer: torch.optim.Optimizer) -> None:
        start_step, start_time = self._window
        now = time.perf_counter()
        steps, seconds = self.step - start_step, now - start_time
        self._window = (self.step, now)
        values: dict[str, Any] = {
            "lr": float(optimizer.param_groups[0]["lr"]),
            "loss_scale": self.precision.loss_scale,
            "skipped_steps": self.precision.skipped_steps,
            # No rate at the first step after a start or a resume: its window opened at its
            # own end, so that set-up time counts in no rate.
            "step_time_s": seconds / steps if steps else None,
            "samples_per_s": (self.samples_per_step * steps / seconds
                              if self.samples_per_step and steps else None),
            **memory_metrics(self.device),
        }
        if self._pending is not None:  # the GPU is more than a record behind: wait for it
            self._emit(self._pending)
        pending = _Pending(self.step, self._losses, self._norms, values)
        self._losses, self._norms = [], []
        if pending.ready is None:  # on a CPU the figures are already here
            self._emit(pending)
            self._pending = None
        else:
            self._pending = pending

    def _emit(self, pending: _Pending) -> None:
        values = pending.finish()
        for writer in self.writers:
            writer.write(pending.step, values, pending.walltime)
        if self.display is not None:
            self.display.show(pending.step, values)
