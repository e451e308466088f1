"""``mpt.Runtime``: the one object a training script talks to. It wires the parts together
and only delegates: the backend wraps and reduces, the precision casts and scales, ``TrainStep``
(the backend's) runs backward/clip/step, ``CheckpointSession`` saves and resumes, ``Loaders``
shards the data, ``Monitor`` reports, ``WorkerFaults`` answers to the launcher. It never asks
which backend it runs on, so adding a backend never touches this file."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Any, overload

import torch
from torch import nn
from torch.utils.data import DataLoader

from mpt.backends import Topology
from mpt.checkpoint.session import CheckpointSession, Schedulers
from mpt.connector import connect
from mpt.data import DistributedLoader, Loaders
from mpt.errors import UsageError
from mpt.fault.worker import WorkerFaults
from mpt.launchers.notes import note_runtime
from mpt.metrics import Monitor
from mpt.pairs import Pairs
from mpt.run_config import RunConfig
from mpt.scaling import BatchPlan, lr_factor
from mpt.step import TrainStep


class Runtime(contextlib.AbstractContextManager["Runtime"]):
    """Run one training script on any backend, precision and number of processes.

    Args:
        config: every run setting (``mpt.RunConfig``); default: `mpt launch`'s hand-off
            (``MPT_RUN_CONFIG``), else the defaults (``ddp``, ``fp32``, dynamic loss scaling).
        seed: seed of the per-epoch shuffle of ``setup_dataloader``.
        batch_size: the script's per-rank micro-batch size; with a global batch size, the
            accumulation steps are derived from it (else the batch size is).
        env: the environment to read (``os.environ`` by default).
        **settings: ``RunConfig`` settings by name (``backend="fsdp"``; each `mpt launch` flag
            says what it does) on top of ``config``; None keeps its value. ``loss_scale`` may
            be a ``LossScaleConfig``, ``timeout`` a ``timedelta``.
    """

    def __init__(self, config: RunConfig | None = None, *, seed: int = 0,
                 batch_size: int | None = None, env: Mapping[str, str] | None = None,
                 **settings: Any) -> None:
        env = os.environ if env is None else env
        note_runtime()  # `mpt launch` reports run flags no Runtime applied
        run = connect(env, config, batch_size=batch_size, **settings)
        self._faults = WorkerFaults(run.world, env, sum_async=run.backend.sum_async)
        self.config: RunConfig = run.config
        """Every run setting, as this process trains with it."""
        self.world, self.device, self.accumulate = run.world, run.device, run.accumulate
        self.precision, self.backend, self._batch_size = run.precision, run.backend, run.batch_size
        self.topology: Topology = run.topology
        """Where this rank sits in the backend's layout: its data-parallel rank and size."""
        self.batch_plan: BatchPlan | None = run.batch_plan
        """How the global batch splits over replicas and micro-batches (None: no global size)."""
        self.backend.init_process_group()
        for line in run.notes():
            self.print(line)
        self.pairs = Pairs()
        """Every model and optimizer ``setup`` was given, by name."""
        self._loaders = Loaders(rank=self.topology.dp_rank, world_size=self.topology.dp_size,
                                device=self.device, seed=seed, batch_plan=self.batch_plan)
        self.monitor = Monitor.for_run(run)
        """Progress bar and metrics files, fed by backward, clip_grad_norm_ and step."""
        self._step: TrainStep = run.make_step(
            pairs=self.pairs, accumulate=self.accumulate, monitor=self.monitor,
            mark=self._faults.mark, on_iteration=self._on_iteration)
        self._checkpoints = CheckpointSession.for_run(
            run, pairs=self.pairs, monitor=self.monitor, loaders=lambda: self._loaders.loaders,
            say=self.print)

    # -- who am I -----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def local_rank(self) -> int:
        return self.world.local_rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.world.rank == 0

    @property
    def batch_size(self) -> int:
        """Per-rank micro-batch size to build the training DataLoader with: the share of
        ``--global-batch-size``, else ``Runtime(batch_size=...)``, else the DeepSpeed config's
        micro-batch. Raises where none of them names one."""
        if self._batch_size is None:
            raise UsageError("rt.batch_size", None, "no per-rank batch size is named (by "
                             "--global-batch-size, Runtime(batch_size=...) or the backend's "
                             "own config)", "pass --global-batch-size B to mpt launch, or "
                             "build the DataLoader with the script's own batch size")
        return self._batch_size

    @property
    def checkpoint_dir(self) -> str | None:
        """Default root of ``save`` and ``resume`` (None: pass a path to them)."""
        return self.config.checkpoint_dir

    @property
    def global_step(self) -> int:
        """Training iterations done (each optimizer stepped once), on from a loaded checkpoint's."""
        return self._step.global_step

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_global_zero:  # rank 0 only
            print(*args, **kwargs, flush=True)

    # -- setup --------------------------------------------------------------------------------
    @overload
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
              name: str | None = None) -> tuple[nn.Module, torch.optim.Optimizer]: ...

    @overload
    def setup(self, model: nn.Module, optimizer: None = None, *,
              name: str | None = None) -> nn.Module: ...

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
              name: str | None = None) -> tuple[nn.Module, torch.optim.Optimizer] | nn.Module:
        """Move the model to this rank's device and wrap it and its optimizer for the backend;
        under an autocast precision its forward then autocasts by itself. Call it once per
        model (a GAN's generator and discriminator, each with its optimizer; an EMA copy or a
        frozen teacher without one, placed and equal on every rank). ``name`` keys the pair in
        checkpoints (default ``model``, ``model_1``, ... in call order). Build the optimizer
        over ``model.parameters()`` first: they move in place. ``--backend fsdp`` also takes a
        model built on the meta device, materialised one unit at a time."""
        pair = self._step.add(self.pairs.check_new(name, model, optimizer), model, optimizer)
        return pair.model if pair.optimizer is None else (pair.model, pair.optimizer)

    def scale_lr(self, lr: float) -> float:  # by the run's rule in the data-parallel size
        return lr * lr_factor(self.config.lr_scaling, self.topology.dp_size)

    def setup_dataloader(self, loader: DataLoader[Any], name: str | None = None
                         ) -> DistributedLoader:
        """This rank's shard of ``loader``'s dataset, batches on this rank's device (samplers:
        see ``mpt.data``). ``name`` keys its position in checkpoints; the one named ``"train"``
        (the first, unless named) alone is bound to the global batch and counts samples."""
        distributed = self._loaders.add(loader, name)
        if distributed.name == "train" and loader.batch_size:  # rt.progress(...) overrides
            self.monitor.samples_per_step = (loader.batch_size * self.accumulate
                                             * self.topology.dp_size)
        return distributed

    # -- the step -----------------------------------------------------------------------------
    def autocast(self) -> Any:
        """Context for forward pass and loss, in the run's precision. Optional: the models
        ``setup`` returns autocast their forwards by themselves (outputs leave in fp32)."""
        return self.precision.autocast()

    @property
    def is_accumulating(self) -> bool:
        """True while the coming ``rt.step()`` will not step: its micro-batch is not the last of
        an optimizer step (one optimizer set up; see ``accumulating`` for several)."""
        return self.accumulating()

    def accumulating(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Whether ``rt.step(optimizer)`` will only accumulate: its micro-batch is not the last
        of an optimizer step."""
        return self._step.accumulating(self.pairs.of_optimizer(optimizer, "accumulating"))

    def forward_backward(self, inputs: Any, target: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor], *,
                         model: nn.Module | None = None) -> torch.Tensor:
        """Forward ``inputs`` through the model (the only one set up with an optimizer, or
        ``model``), ``loss_fn(output, target)`` and its backward; the loss (detached) on every
        rank. A pipeline's schedule runs it over the stages. Call ``rt.step()`` after it."""
        return self._step.forward_backward(model, inputs, target, loss_fn)

    def evaluate(self, inputs: Any, target: Any = None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, *,
                 model: nn.Module | None = None) -> Any:
        """The model's output for ``inputs`` without gradients, or ``loss_fn(output, target)``
        when given; under a pipeline too (every rank gets it)."""
        return self._step.evaluate(model, inputs, target, loss_fn)

    def backward(self, loss: torch.Tensor, *, model: nn.Module | None = None) -> None:
        """Backward of one micro-batch's loss, scaled for precision and divided for
        accumulation. ``model``: the one whose optimizer this loss trains, for backends with
        one engine per model (default: the next ``rt.step``'s)."""
        self._step.backward(loss, model)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor | None:
        """Clip the unscaled gradients of ``optimizer``'s parameters (the only optimizer by
        default) at the end of a step; None while accumulating."""
        pair = self.pairs.of_optimizer(optimizer, "clip_grad_norm_")
        return self._step.clip_grad_norm_(pair, max_norm, norm_type)

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Step ``optimizer`` (the only one by default) once every ``accumulate`` calls (one
        per micro-batch), then zero its gradients; True when its parameters changed (not
        while accumulating or when fp16 gradients overflowed). An iteration ends when every
        optimizer stepped: the loss scale is updated once, ``global_step`` counts one, and a
        preempted job saves and exits (``REQUEUE_EXIT_CODE``) on every rank."""
        return self._step.step(self.pairs.of_optimizer(optimizer, "step"))

    def _on_iteration(self) -> None:
        """At the end of every iteration: a snapshot when due; stop if the job is preempted."""
        self._checkpoints.after_iteration(self.global_step)
        self._faults.stop_if_preempted(
            self.global_step, close=self.close, say=self.print,
            save=None if self.checkpoint_dir is None else lambda: self.save(async_save=False))

    def progress(self, total: int | None = None, *, samples_per_step: int | None = None) -> None:
        """Tell the progress bar the run's optimizer steps (its ETA) and, for a loader not set
        up by ``setup_dataloader``, the samples per step."""
        self.monitor.set_total(total, samples_per_step)

    def log(self, **metrics: float | torch.Tensor) -> None:
        """Record the script's own figures (``val_acc=0.97``) at the current step, beside the
        run's metrics (a tensor is read here: a wait for the device)."""
        self.monitor.log(metrics)

    # -- collectives --------------------------------------------------------------------------
    def barrier(self) -> None:
        with self._faults.phase("collective"):
            self.backend.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce a tensor across ranks in place (``sum``, ``mean``, ``max``, ``min``)."""
        with self._faults.phase("collective"):
            return self.backend.all_reduce(tensor, op)

    # -- checkpoints --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str] | None = None, *, step: int | None = None,
             epoch: int | None = None, scheduler: Schedulers = None,
             keep: int | None = None, sharded: bool | None = None,
             async_save: bool | None = None, **extra: Any) -> str:
        """Checkpoint the run atomically into ``path/step-<step>/`` (default root
        ``checkpoint_dir``; an fsspec URL too), point ``path/latest`` at it and return its URL;
        every rank calls it (docs/checkpoints.md). ``step``: default ``global_step``.
        ``scheduler``: one, or a dict by name (default: the last given). ``keep``: keep the
        newest ``keep`` only. ``sharded``: per-rank pieces (default: past 2 GiB).
        ``async_save``: return once the state is in host memory (a thread writes it; the next
        save, load or close waits). ``extra``: JSON-able values (``model=``/``optimizer=`` may
        name what ``setup`` returned: saved anyway)."""
        with self._faults.phase("checkpoint"):
            return self._checkpoints.save(
                path, step=self.global_step if step is None else step, epoch=epoch,
                scheduler=scheduler, keep=keep, sharded=sharded, async_save=async_save,
                extra=extra)

    def model_state_dict(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The whole weights of ``model`` (default: the one with an optimizer) under its own
        names on every rank, from whichever stages or shards hold them (collective)."""
        pair = self._step.pair_of(model, "model_state_dict")
        with self._faults.phase("collective"):
            return self._checkpoints.backend.model_state_dict(pair.model)

    def wait_for_save(self) -> None:
        """Block until every rank's asynchronous save is committed (collective); raise the
        error of one that failed."""
        self._checkpoints.wait()

    def load(self, path: str | os.PathLike[str], *,
             scheduler: Schedulers = None) -> dict[str, Any]:
        """Restore a checkpoint (a root ``save`` wrote into: its latest; or one ``step-*``
        directory) into what was set up, at any world size and under any backend; it must hold
        exactly the names set up. Call ``setup_dataloader`` first, so loaders resume mid-epoch.
        Returns ``{"step": ..., "epoch": ... (when known), **extra}``."""
        self._faults.mark("checkpoint")
        info = self._checkpoints.load(path, scheduler)
        self._step.resume_at(info["step"])  # and marks the heartbeat's step
        return info

    def resume(self, *, scheduler: Schedulers = None) -> dict[str, Any]:
        """Load what the run's ``resume`` setting names, once, after ``setup`` and
        ``setup_dataloader``; train on from the returned ``"step"``. ``auto``: the latest
        complete checkpoint of ``checkpoint_dir``, or a fresh start (``{"step": 0}``), so one
        command starts, resumes and restarts a job; ``never`` refuses a ``checkpoint_dir`` that
        holds checkpoints (they would be overwritten)."""
        return self._checkpoints.resume(scheduler, load=self.load)

    # -- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Commit the checkpoint being written, finish the metrics files and the progress
        bar, and leave the process group."""
        self._faults.mark("closing")
        try:
            self._checkpoints.close()  # raises if its write failed: the rest is closed anyway
        finally:
            self._faults.settle()
            self.monitor.close()
            self.backend.shutdown()
            self._faults.close()

    def __exit__(self, *exc: object) -> None:
        self.close()
