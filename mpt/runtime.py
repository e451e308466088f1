"""``mpt.Runtime``: the one object a training script talks to.

It wires the parts together and only delegates: the backend wraps and reduces, the precision
casts and scales, ``TrainStep`` (the backend's) runs backward/clip/step, ``CheckpointSession``
saves and resumes, ``Loaders`` shards the data, ``WorkerFaults`` answers to the launcher. It never
asks which backend it runs on, so adding a backend never touches this file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, overload

import torch
from torch import nn
from torch.utils.data import DataLoader

from mpt.backends import Backend, Topology
from mpt.checkpoint.session import CheckpointSession, Schedulers
from mpt.checkpoint.snapshot import peer_snapshots
from mpt.connector import connect
from mpt.data import DistributedLoader, Loaders
from mpt.elastic import report_resize
from mpt.environments import World
from mpt.errors import UsageError
from mpt.fault import REQUEUE_EXIT_CODE
from mpt.fault.worker import WorkerFaults
from mpt.launchers.notes import note_runtime
from mpt.metrics import MetricsConfig, Monitor
from mpt.pairs import Pair, Pairs
from mpt.precision import LossScaleConfig, Precision
from mpt.run_config import RunConfig
from mpt.scaling import BatchPlan, lr_factor
from mpt.step import TrainStep


class Runtime:
    """Run one training script on any backend, precision and number of processes.

    Each argument is the ``mpt.RunConfig`` setting of the same name (its `mpt launch` flag says
    what it does): those left as None come from `mpt launch` (``MPT_RUN_CONFIG``), then from the
    defaults (``ddp``, ``fp32``, no accumulation, dynamic loss scaling). Besides them:

    Args:
        loss_scale: also a ``LossScaleConfig``.
        timeout: also a ``timedelta``.
        seed: seed of the per-epoch shuffle of ``setup_dataloader``.
        batch_size: the script's per-rank micro-batch size; with a global batch size, the
            accumulation steps are derived from it (else the batch size is derived).
        env: the environment to read (``os.environ`` by default).
    """

    def __init__(self, backend: str | None = None, precision: str | None = None, *,
                 accumulate: int | None = None,
                 loss_scale: str | float | LossScaleConfig | None = None,
                 timeout: timedelta | float | None = None, seed: int = 0,
                 backend_options: Mapping[str, Any] | None = None,
                 precision_options: Mapping[str, Any] | None = None,
                 grad_compression: str | None = None, bucket_mb: float | None = None,
                 global_batch_size: int | None = None, batch_size: int | None = None,
                 lr_scaling: str | None = None,
                 run_dir: str | os.PathLike[str] | None = None, quiet: bool | None = None,
                 log_every: int | None = None, metrics_all_ranks: bool | None = None,
                 checkpoint_dir: str | os.PathLike[str] | None = None,
                 async_save: bool | None = None, resume: str | None = None,
                 snapshot_every: int | None = None, snapshot_dir: str | None = None,
                 pipeline_stages: int | None = None, pipeline_schedule: str | None = None,
                 microbatches: int | None = None, pipeline_split: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        note_runtime()  # `mpt launch` reports run flags no Runtime applied
        run = connect(env, batch_size=batch_size, loss_scale=loss_scale, timeout=timeout,
                      backend=backend, precision=precision, accumulate=accumulate,
                      backend_options=backend_options, precision_options=precision_options,
                      grad_compression=grad_compression, bucket_mb=bucket_mb,
                      global_batch_size=global_batch_size, lr_scaling=lr_scaling,
                      run_dir=None if run_dir is None else os.fspath(run_dir), quiet=quiet,
                      log_every=log_every, metrics_all_ranks=metrics_all_ranks,
                      checkpoint_dir=None if checkpoint_dir is None else os.fspath(checkpoint_dir),
                      async_save=async_save, resume=resume, snapshot_every=snapshot_every,
                      snapshot_dir=snapshot_dir, pipeline_stages=pipeline_stages,
                      pipeline_schedule=pipeline_schedule, microbatches=microbatches,
                      pipeline_split=pipeline_split)
        self._faults = WorkerFaults(run.world.rank, env)
        self.config: RunConfig = run.config
        """Every run setting, as this process trains with it."""
        self.world: World = run.world
        self.device: torch.device = run.device
        self.topology: Topology = run.topology
        """Where this rank sits in the backend's layout: its data-parallel rank and size."""
        self.batch_plan: BatchPlan | None = run.batch_plan
        """How the global batch splits over replicas and micro-batches (None: no global size)."""
        self.accumulate: int = run.accumulate
        self._batch_size = run.batch_size
        self.precision: Precision = run.precision
        self.backend: Backend = run.backend
        config = self.config
        self.backend.init_process_group()
        if self.batch_plan is not None:
            self.print(f"mpt: {self.batch_plan.describe()}")
        if config.lr_scaling is not None:
            self.print(f"mpt: lr scaling {config.lr_scaling}: rt.scale_lr multiplies learning "
                       f"rates by {lr_factor(config.lr_scaling, self.topology.dp_size):g} "
                       f"(data-parallel size {self.topology.dp_size})")
        self.pairs = Pairs()
        """Every model and optimizer ``setup`` was given, by name."""
        self._loaders = Loaders(rank=self.topology.dp_rank, world_size=self.topology.dp_size,
                                device=self.device, seed=seed, batch_plan=self.batch_plan)
        self.monitor = Monitor(
            MetricsConfig(run_dir=None if config.run_dir is None else Path(config.run_dir),
                          quiet=config.quiet, log_every=config.log_every,
                          all_ranks=config.metrics_all_ranks),
            rank=self.rank, device=self.device, precision=self.precision, meta={
                "backend": self.backend.name, "precision": self.precision.name,
                "world_size": self.world_size, "accumulate": self.accumulate})
        """Progress bar and metrics files, fed by backward, clip_grad_norm_ and step."""
        self._step: TrainStep = self.backend.make_step(
            pairs=self.pairs, accumulate=self.accumulate, monitor=self.monitor,
            mark=self._faults.mark, on_iteration=self._on_iteration)
        self._checkpoints = CheckpointSession(
            backend=self.backend, pairs=self.pairs, loaders=lambda: self._loaders.loaders,
            root=config.checkpoint_dir, resume=config.resume or "auto",
            async_save=config.async_save, snapshots=peer_snapshots(
                config.snapshot_every, config.snapshot_dir, self.backend, self.backend.timeout))

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
                             "--global-batch-size, Runtime(batch_size=...) or a DeepSpeed "
                             "config's train_micro_batch_size_per_gpu)", "pass "
                             "--global-batch-size B to mpt launch, or build the DataLoader "
                             "with the script's own batch size")
        return self._batch_size

    @property
    def checkpoint_dir(self) -> str | None:
        """Default root of ``save`` and ``resume`` (None: pass a path to them)."""
        return self.config.checkpoint_dir

    @property
    def global_step(self) -> int:
        """Training iterations done (every optimizer stepped once), counted on from a loaded
        checkpoint's step."""
        return self._step.global_step

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if self.is_global_zero:
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
        """Move the model to this rank's device and wrap it and its optimizer for the backend.

        ``--backend fsdp`` also takes a model built on the meta device (``with
        torch.device("meta"):``): it materialises it one unit at a time, each initialised by
        its modules' ``reset_parameters`` from rank 0's random state, then sharded, so the
        whole model never exists on a rank.

        Call it once per model: a GAN sets up its generator and its discriminator, each with
        its optimizer; an EMA copy or a frozen teacher comes without one (then only the model
        is returned, placed and equal on every rank). ``name`` keys the pair in checkpoints
        (default ``model``, then ``model_1``, ... in the order of the calls).

        Under an autocast precision the returned model's forward runs under
        ``torch.autocast`` with no ``rt.autocast()`` in the script (``mpt.precision.forward``).

        Build the optimizer over ``model.parameters()`` before calling this; the parameters
        move in place, so the optimizer keeps pointing at them.
        """
        name = self.pairs.check_new(name, model, optimizer)
        original_model, original_optimizer = model, optimizer
        model = self.precision.convert_module(
            self.backend.place(model, trained=optimizer is not None))
        wrapped, wrapped_optimizer = self.backend.setup(model, optimizer)
        self.precision.autocast_forward(wrapped)  # no rt.autocast() needed in the script
        pair = self.pairs.add(Pair(name=name, model=wrapped, optimizer=wrapped_optimizer),
                              original_model, original_optimizer)
        if wrapped_optimizer is None:
            return wrapped
        # After the backend: masters (O2) start from the weights it synchronised.
        self.precision.setup_optimizer(wrapped, wrapped_optimizer)
        self._step.sync_for_next_micro_batch(pair)
        return wrapped, wrapped_optimizer

    def scale_lr(self, lr: float) -> float:
        """``lr`` scaled by the run's rule in the data-parallel size (unchanged without one)."""
        return lr * lr_factor(self.config.lr_scaling, self.topology.dp_size)

    def setup_dataloader(self, loader: DataLoader[Any], name: str | None = None
                         ) -> DistributedLoader:
        """This rank's shard of ``loader``'s dataset, batches on this rank's device.

        A plain sampler (``shuffle=True``/``False``) becomes mpt's sharded, reshuffled one; a
        ``DistributedSampler`` keeps its shuffle, seed and drop_last; any other sampler is kept
        as it is (see ``mpt.data``). ``name`` keys the loader's position in checkpoints (set up
        again under a name, a loader replaces the one before). The loader named ``"train"`` (the
        first one set up, unless named otherwise) is the training loader: only its batch size
        is bound to the global batch, and it counts the samples per step; evaluation loaders
        (any other name) may have any batch size.
        """
        distributed = self._loaders.add(loader, name)
        if distributed.name == "train" and loader.batch_size:  # rt.progress(...) overrides
            self.monitor.samples_per_step = (loader.batch_size * self.accumulate
                                             * self.topology.dp_size)
        return distributed

    # -- the step -----------------------------------------------------------------------------
    def autocast(self) -> Any:
        """Context for forward pass and loss, in the run's precision. Optional: the models
        ``setup`` returns autocast their forwards by themselves (their low-precision outputs
        leave in fp32); inside this context they add nothing and return autocast's dtypes."""
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
        ``model``), ``loss_fn(output, target)`` and its backward, in the run's precision; return
        the batch's loss (detached), on every rank.

        The same call trains a model cut into pipeline stages (``--pipeline-stages``), where
        the schedule runs the micro-batches' forwards and backwards over the ranks: a script
        written with it trains with and without a pipeline. Call ``rt.step()`` after it.
        """
        return self._step.forward_backward(model, inputs, target, loss_fn)

    def evaluate(self, inputs: Any, target: Any = None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, *,
                 model: nn.Module | None = None) -> Any:
        """The model's output for ``inputs`` without gradients, or ``loss_fn(output, target)``
        when given; under a pipeline too (every rank gets it)."""
        return self._step.evaluate(model, inputs, target, loss_fn)

    def backward(self, loss: torch.Tensor, *, model: nn.Module | None = None) -> None:
        """Backward of one micro-batch's loss, scaled for precision and divided for accumulation.

        Any loss of any model set up: gradients go wherever autograd takes them, as with
        ``loss.backward()``. ``model`` names the model whose optimizer this loss trains, for
        backends that backpropagate through one engine per model (DeepSpeed): without it, such a
        backend uses the engine of the next ``rt.step``/``rt.clip_grad_norm_``.
        """
        self._step.backward(loss, model)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor | None:
        """Clip the unscaled gradients of ``optimizer``'s parameters (the only optimizer by
        default) at the end of a step; None while accumulating."""
        pair = self.pairs.of_optimizer(optimizer, "clip_grad_norm_")
        return self._step.clip_grad_norm_(pair, max_norm, norm_type)

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Step ``optimizer`` (the only one set up by default) once every ``accumulate`` calls,
        then zero its gradients. Call it once per micro-batch.

        Returns True when its parameters changed; False while accumulating or when fp16
        gradients overflowed (that step is skipped on every rank; the scale backs off).

        With several optimizers, one training iteration ends when every optimizer has stepped:
        there the shared loss scale is updated once and ``global_step`` counts one. An optimizer
        stepping again before the others (a critic's extra steps) updates the scale first.
        When the job is preempted (`mpt launch` got SIGTERM or SIGUSR1), every rank ends at the
        same iteration: it saves to ``checkpoint_dir`` and exits with ``REQUEUE_EXIT_CODE``.
        """
        return self._step.step(self.pairs.of_optimizer(optimizer, "step"))

    def _on_iteration(self) -> None:
        """At the end of every training iteration: a snapshot when one is due; stop here if
        the job is preempted."""
        self._checkpoints.after_iteration(self.global_step)
        if not self._faults.should_stop(self.backend.sum_async, self.world_size):
            return
        step = self.global_step
        if self.checkpoint_dir is not None:  # committed before the process exits
            where = self.save(step=step, async_save=False)
            self.print(f"mpt: preempted: saved step {step} to {where}; exiting with "
                       f"{REQUEUE_EXIT_CODE} (requeue)")
        else:
            self.print(f"mpt: preempted at step {step} with no --checkpoint-dir: nothing saved; "
                       f"exiting with {REQUEUE_EXIT_CODE}")
        self.close()
        raise SystemExit(REQUEUE_EXIT_CODE)

    def progress(self, total: int | None = None, *, samples_per_step: int | None = None) -> None:
        """Tell the progress bar the run's optimizer steps (for its ETA) and, where the loader
        did not come through ``setup_dataloader``, the samples per step over all ranks."""
        self.monitor.set_total(total)
        if samples_per_step is not None:
            self.monitor.samples_per_step = samples_per_step

    def log(self, **metrics: float | torch.Tensor) -> None:
        """Record the script's own figures (e.g. ``val_acc=0.97``) at the current step.

        Written where the run's metrics are (rank 0's files, or every rank's with
        ``metrics_all_ranks``); a tensor is read here, which waits for the device.
        """
        self.monitor.log(metrics)

    # -- collectives --------------------------------------------------------------------------
    def barrier(self) -> None:
        self._faults.mark("collective")
        self.backend.barrier()
        self._faults.mark("script")

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce a tensor across ranks in place (``sum``, ``mean``, ``max``, ``min``)."""
        self._faults.mark("collective")
        result = self.backend.all_reduce(tensor, op)
        self._faults.mark("script")
        return result

    # -- checkpoints --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str] | None = None, *, step: int | None = None,
             epoch: int | None = None, scheduler: Schedulers = None,
             keep: int | None = None, sharded: bool | None = None,
             async_save: bool | None = None, **extra: Any) -> str:
        """Checkpoint the run into ``path/step-<step>/`` and point ``path/latest`` at it.

        ``path`` defaults to ``checkpoint_dir``, ``step`` to ``global_step``, ``scheduler`` to
        the last one given to ``save``, ``load`` or ``resume``; several schedulers go in as a
        dict by name (``scheduler={"G": sched_g, "D": sched_d}``).

        Saved: the full weights and optimizer state of every model ``setup`` was given, under
        its name, the precision state (loss scale, masters), the schedulers' states, the sampler
        position of every ``setup_dataloader`` loader, every rank's RNG, ``step``, ``epoch`` and
        the JSON-able ``extra`` values. Every rank calls it; it returns once the checkpoint is
        committed. ``keep``: delete all but the newest ``keep`` checkpoints of ``path``.
        ``sharded``: write models and optimizers as per-rank shards through
        torch.distributed.checkpoint (default: when they pass 2 GiB). ``path`` may be an fsspec
        URL (``s3://...``). Returns the checkpoint directory's URL.

        ``async_save`` (default: the run's ``async_save`` setting, `mpt launch --async-save`):
        return once the state is copied to host memory and let a thread write and commit it
        while training goes on (with ``sharded``, each rank's shard is written before the
        return). The commit stays atomic: until it, ``latest`` names the previous checkpoint.
        The next ``save``, ``load`` and ``close`` wait for it, and raise its error if the write
        failed; ``rt.wait_for_save()`` waits on demand.

        ``model=``/``optimizer=`` (Fabric's habit) may name objects ``setup`` returned: they are
        saved anyway, by name.
        """
        self._faults.mark("checkpoint")
        where = self._checkpoints.save(
            path, step=self.global_step if step is None else step, epoch=epoch,
            scheduler=scheduler, keep=keep, sharded=sharded, async_save=async_save, extra=extra)
        self._faults.mark("script")
        return where

    def wait_for_save(self) -> None:
        """Block until every rank's asynchronous save is committed (collective; a no-op when
        none was made since the last wait); raise the error of one that failed."""
        self._checkpoints.wait()

    def load(self, path: str | os.PathLike[str], *,
             scheduler: Schedulers = None) -> dict[str, Any]:
        """Restore a checkpoint (``path``: a root ``save`` wrote into, which loads its latest,
        or one ``step-*`` directory) into the set-up models, optimizers, schedulers and loaders.

        The checkpoint must hold exactly the names set up; a mismatch names what is missing and
        what is extra.
        Works at any world size and under any backend. Returns ``{"step": ..., "epoch": ...
        (when known), **extra}``. Call ``setup_dataloader`` before, so loaders resume mid-epoch.
        """
        self._faults.mark("checkpoint")
        info = self._checkpoints.load(path, scheduler)
        self._step.global_step = info["step"]
        self.monitor.resume_at(info["step"])  # metrics and progress go on from the saved step
        self._faults.mark("script", self.global_step)
        return info

    def resume(self, *, scheduler: Schedulers = None) -> dict[str, Any]:
        """Load what the run's ``resume`` setting names, if anything: call it once, after
        ``setup`` and ``setup_dataloader``, and train on from the returned ``"step"``.

        ``auto`` loads the latest complete checkpoint of ``checkpoint_dir`` and starts afresh
        when there is none, so the same command starts a job, resumes it after a crash or a
        preemption, and a restart by ``--max-restarts`` loses no step. ``never`` starts afresh
        and refuses a ``checkpoint_dir`` that holds checkpoints already (they would be
        overwritten). Returns ``load``'s result, or ``{"step": 0}`` for a fresh start.
        """
        found = self._checkpoints.to_resume(scheduler)
        if found is None:
            return {"step": 0}
        info = self.load(found)
        self.print(f"mpt: resumed from {found} at step {info['step']}")
        resized = report_resize(  # an elastic job's new world, or a manual resize
            found, world_size=self.world_size, plan=self.batch_plan,
            samples_per_step=self.monitor.samples_per_step, lr_scaling=self.config.lr_scaling,
            layout=self.topology.plan, say=self.print, log=self.monitor.log)
        if resized is not None:
            self._checkpoints.scale_lr(resized.lr_ratio)
        return info

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

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
