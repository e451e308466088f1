"""One run's checkpoints: where they go, what a resume loads, and the asynchronous write in flight.

``rt.save``/``rt.load``/``rt.resume``/``rt.wait_for_save`` land here. The session knows the run's
live objects only through ``TrainingState`` (the backend as a ``StateHolder``), so it never asks
which backend runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mpt.checkpoint.background import BackgroundWriter
from mpt.checkpoint.format import CONVERTED, Manifest
from mpt.checkpoint.io import find_latest, resolve
from mpt.checkpoint.snapshot import PeerSnapshots, peer_snapshots
from mpt.checkpoint.state import (
    Stateful,
    StateHolder,
    TrainingState,
    load_checkpoint,
    save_checkpoint,
)
from mpt.data import DistributedLoader
from mpt.elastic import report_resize
from mpt.errors import UsageError
from mpt.pairs import Pairs

if TYPE_CHECKING:
    from mpt.connector import Connection
    from mpt.elastic import Resize
    from mpt.metrics import Monitor

Schedulers = Stateful | Mapping[str, Stateful] | None
"""An LR scheduler, or several by name (``{"G": sched_g, "D": sched_d}``)."""


class CheckpointSession:
    """Saves and restores the run's state; one asynchronous save in flight at a time."""

    def __init__(self, *, backend: StateHolder, pairs: Pairs,
                 loaders: Callable[[], Sequence[DistributedLoader]], root: str | None,
                 resume: str, async_save: bool, snapshots: PeerSnapshots | None,
                 resized: Callable[[Manifest], Resize | None] | None = None,
                 say: Callable[[str], None] = print) -> None:
        self.backend = backend
        self.pairs = pairs
        self.loaders = loaders
        """The loaders set up so far (their positions are saved by name)."""
        self.root = root
        """Default root of ``save`` and ``resume`` (None: pass a path to them)."""
        self.resume_from = resume
        """``auto``, ``never`` or a checkpoint path: what ``to_resume`` names."""
        self.async_save = async_save
        """Whether ``save`` writes in the background unless told otherwise."""
        self.snapshots = snapshots
        """In-memory snapshots on two nodes (``--snapshot-every``), or None."""
        self.resized = resized
        """Says and logs how the run changed since the checkpoint it resumed (world size, batch
        split), with the factor of its learning rates; returns None where it did not."""
        self.say = say
        """Prints a line once for the job (rank 0's)."""
        self._writer = BackgroundWriter()
        self._unsettled = False  # an asynchronous save since the ranks last met after one
        self._schedulers: dict[str, Stateful] = {}  # saved with a preempted run too

    @classmethod
    def for_run(cls, run: Connection, *, pairs: Pairs, monitor: Monitor,
                loaders: Callable[[], Sequence[DistributedLoader]],
                say: Callable[[str], None]) -> CheckpointSession:
        """The session a run's settings ask for: its ``checkpoint_dir``, ``resume`` (default
        ``auto``), ``async_save`` and peer snapshots (``snapshot_every``, ``snapshot_dir``); a
        resize after a resume is said with ``say`` and logged to ``monitor``."""
        config, state = run.config, run.state

        def resized(saved: Manifest) -> Resize | None:  # an elastic job's new world, or not
            return report_resize(
                saved, world_size=run.world.world_size, plan=run.batch_plan,
                samples_per_step=monitor.samples_per_step, lr_scaling=config.lr_scaling,
                layout=run.config.layout, say=say, log=monitor.log)

        return cls(backend=state, pairs=pairs, loaders=loaders, root=config.checkpoint_dir,
                   resume=config.resume or "auto", async_save=config.async_save,
                   snapshots=peer_snapshots(config.snapshot_every, config.snapshot_dir, state,
                                            run.backend.timeout, say), resized=resized, say=say)

    def save(self, path: str | os.PathLike[str] | None, *, step: int, epoch: int | None,
             scheduler: Schedulers, keep: int | None, sharded: bool | None,
             async_save: bool | None, extra: dict[str, Any]) -> str:
        """``rt.save`` (see there); returns the checkpoint directory's URL."""
        extra = self._drop_set_up(extra)
        in_background = self.async_save if async_save is None else async_save
        self._writer.wait()  # one checkpoint in flight: the previous one is committed first
        where = save_checkpoint(
            self._root(path, "save"), self._training_state(scheduler), step=step, epoch=epoch,
            extra=extra, keep=keep, sharded=sharded,
            background=self._writer if in_background else None, say=self.say)
        self._unsettled = self._unsettled or in_background
        return where

    def after_iteration(self, step: int) -> None:
        """At the end of every training iteration: a snapshot, when one is due (collective)."""
        if self.snapshots is not None and self.snapshots.due(step):
            self.snapshots.take(self._training_state(None), step)

    def wait(self) -> None:
        """``rt.wait_for_save``: every rank's asynchronous save committed (collective)."""
        self._writer.wait()
        if self._unsettled:
            self.backend.barrier()  # rank 0 commits: the others wait for it here
            self._unsettled = False

    def load(self, path: str | os.PathLike[str], scheduler: Schedulers) -> dict[str, Any]:
        """``rt.load``: restore ``path`` into the run's live objects: an mpt checkpoint, the
        snapshot ``rt.resume`` chose, or another framework's checkpoint
        (``mpt.checkpoint.foreign``), imported on the way."""
        self.wait()  # a checkpoint being written is committed before anything loads
        if self.snapshots is not None and self.snapshots.restores(os.fspath(path)):
            return self.snapshots.load(self._training_state(scheduler))
        if find_latest(path) is None:
            from mpt.checkpoint import foreign

            if foreign.is_foreign(path):
                return foreign.load(path, self._training_state(scheduler), self.say)
        return load_checkpoint(path, self._training_state(scheduler))

    def to_resume(self, scheduler: Schedulers) -> str | None:
        """What ``rt.resume`` loads: the run's ``resume`` setting made a checkpoint path, or
        None for a fresh start. ``never`` refuses a root that holds checkpoints already; with
        ``auto``, a snapshot newer than the newest checkpoint on disk wins (collective)."""
        self._remember(scheduler)
        found = None if self.root is None else find_latest(self.root)
        if self.resume_from == "never":
            if found is not None:
                raise UsageError("--resume", "never", f"{self.root} already holds {found}; a "
                                 "fresh run would overwrite its steps", "pass --resume auto to "
                                 "continue it, or another --checkpoint-dir")
            return None
        if self.resume_from != "auto":
            return self.resume_from
        if self.snapshots is not None:
            on_disk = None if found is None else resolve(found).manifest().step
            return self.snapshots.restore(newer_than=on_disk) or found
        return found

    def resume(self, scheduler: Schedulers, load: Callable[[str], dict[str, Any]]
               ) -> dict[str, Any]:
        """``rt.resume``: ``load`` what ``to_resume`` names (or start fresh, at step 0), say
        so, and scale the learning rates where the run was resized since."""
        found = self.to_resume(scheduler)
        if found is None:
            return {"step": 0}
        info = load(found)
        self.say(f"mpt: resumed from {found} at step {info['step']}")
        # Another framework's run, imported or converted, had its own learning rates for its
        # own world: they go on as they were, whichever way it came in.
        if self.snapshots is not None and self.snapshots.restores(found):
            saved = self.snapshots.restored
        else:
            saved = resolve(found).manifest() if find_latest(found) is not None else None
        saved_by_mpt = saved is not None and saved.backend != CONVERTED
        resize = self.resized(saved) if self.resized is not None and saved_by_mpt else None
        if resize is not None:
            self.scale_lr(resize.lr_ratio)
        return info

    def scale_lr(self, ratio: float) -> None:
        """Multiply the learning rates of every optimizer and LR scheduler by ``ratio`` (a
        resize under ``--lr-scaling``): the current ones, and the base ones a scheduler
        computes them from."""
        if ratio == 1.0:
            return
        for pair in self.pairs.pairs:
            for group in [] if pair.optimizer is None else pair.optimizer.param_groups:
                for key in ("lr", "initial_lr"):
                    if key in group:
                        group[key] *= ratio
        for scheduler in self._schedulers.values():
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * ratio for lr in scheduler.base_lrs]

    def close(self) -> None:
        """Commit the checkpoint and the snapshot being written; raise if a write failed."""
        try:
            self._writer.close()
        finally:
            if self.snapshots is not None:
                self.snapshots.close()

    def _root(self, path: str | os.PathLike[str] | None, method: str) -> str | os.PathLike[str]:
        root = path if path is not None else self.root
        if root is None:
            raise UsageError("path", None, f"rt.{method} needs a directory and the run has no "
                             "checkpoint_dir", "pass one, or `mpt launch --checkpoint-dir DIR`")
        return root

    def _remember(self, scheduler: Schedulers) -> None:
        if scheduler is None:
            return
        if isinstance(scheduler, Mapping):
            self._schedulers = dict(scheduler)
        else:
            self._schedulers = {"scheduler": scheduler}

    def _drop_set_up(self, extra: dict[str, Any]) -> dict[str, Any]:
        """``extra`` without the models and optimizers ``setup`` knows (saved by name anyway);
        one that was never set up cannot be saved as an extra value."""
        kept = {}
        for key, value in extra.items():
            if isinstance(value, nn.Module):
                self.pairs.of_model(value)
            elif isinstance(value, torch.optim.Optimizer):
                self.pairs.of_optimizer(value, "save")
            else:
                kept[key] = value
        return kept

    def _training_state(self, scheduler: Schedulers) -> TrainingState:
        if not self.pairs.pairs:
            raise UsageError("rt.save/rt.load", "called before rt.setup", "nothing is set up",
                             "call model, optimizer = rt.setup(model, optimizer) first")
        self._remember(scheduler)
        return TrainingState(backend=self.backend, pairs=self.pairs.pairs,
                             schedulers=self._schedulers, loaders=self.loaders())
