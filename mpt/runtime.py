"""``mpt.Runtime``: the one object a training script talks to.

It composes the four parts (environment, backend, precision, checkpoint) and only delegates: it
never asks which backend it runs on, so adding a backend never touches this file.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, overload

import torch
from torch import nn
from torch.utils.data import DataLoader

from mpt import checkpoint
from mpt._native import bind_to_parent
from mpt.backends import Backend, checked_precision, get_backend
from mpt.checkpoint.background import BackgroundWriter
from mpt.data import DistributedLoader
from mpt.environments import World, detect_world, device_name
from mpt.environments.settings import launch_dir, launcher_pid
from mpt.errors import UsageError
from mpt.fault import REQUEUE_EXIT_CODE, Heartbeat, Preemption
from mpt.metrics import MetricsConfig, Monitor
from mpt.pairs import Pair, Pairs
from mpt.precision import LossScaleConfig, Precision
from mpt.run_config import RunConfig
from mpt.scaling import BatchPlan, lr_factor, plan_batch

Schedulers = checkpoint.Stateful | Mapping[str, checkpoint.Stateful] | None
"""An LR scheduler, or several by name (``{"G": sched_g, "D": sched_d}``)."""


def _die_with_launcher(pid: int | None) -> None:
    """Have the kernel SIGKILL this worker when the `mpt launch` that started it dies.

    The elastic agent stops workers when it exits normally, but a launcher killed with SIGKILL
    (OOM killer, a scheduler) runs no cleanup: without this its workers would live on, holding
    GPUs and ports.
    """
    if pid is None:
        return
    if os.getppid() != pid and _pid_exists(pid):
        return  # a process the worker started inherited the variable: not the launcher's child
    if not bind_to_parent(signal.SIGKILL, pid):
        raise SystemExit(f"mpt: the launcher (pid {pid}) is gone; this worker stops too")


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    return True


class Runtime:
    """Run one training script on any backend, precision and number of processes.

    Arguments left as ``None`` come from `mpt launch`'s flags (``MPT_*`` variables), then from
    the defaults: ``ddp``, ``fp32``, no accumulation, dynamic loss scaling.

    Args:
        backend: registered backend name (``mpt backends`` lists them).
        precision: ``fp32``, ``fp16-mixed``, ``bf16-mixed`` (or another registered name).
        accumulate: micro-batches per optimizer step; gradients are reduced on the last only.
        loss_scale: ``"dynamic"``, a static scale, or a ``LossScaleConfig``, for fp16.
        timeout: how long a collective may wait before failing instead of hanging
            (`mpt launch --timeout`; default 30 minutes).
        seed: seed of the per-epoch shuffle of ``setup_dataloader``.
        backend_options: the backend's own options (e.g. DeepSpeed's ``zero_stage``); they
            update those `mpt launch` passed.
        precision_options: the precision's own options (Apex's overrides of an opt level:
            ``keep_batchnorm_fp32``, ``master_weights``, ``loss_scale``, ``cast_model_type``).
        global_batch_size: samples per optimizer step over the whole job (`mpt launch
            --global-batch-size`); the per-rank ``batch_size`` or ``accumulate`` follows from it.
        batch_size: the script's per-rank micro-batch size; with a global batch size, the
            accumulation steps are derived from it (else the batch size is derived).
        lr_scaling: ``"linear"`` or ``"sqrt"``: what ``scale_lr`` multiplies by in the world
            size (`mpt launch --lr-scaling`); None keeps learning rates unchanged.
        run_dir: where ``metrics.jsonl`` and TensorBoard files go (`mpt launch --run-dir`);
            None writes none.
        quiet: no progress bar or progress lines on rank 0 (`mpt launch --quiet`).
        log_every: optimizer steps between two metric records (`mpt launch --log-every`).
        metrics_all_ranks: every rank writes its metrics, not only rank 0
            (`mpt launch --metrics-all-ranks`).
        checkpoint_dir: where ``save`` writes and ``resume`` looks by default, and where a
            preempted run saves (`mpt launch --checkpoint-dir`); a path or fsspec URL.
        async_save: ``save`` returns once the state is in host memory and a thread writes it
            (`mpt launch --async-save`; ``save(async_save=...)`` decides per call).
        resume: what ``resume`` loads: ``"auto"`` (the latest checkpoint of ``checkpoint_dir``,
            if any; the default), ``"never"``, or one checkpoint's path (`mpt launch --resume`).
        env: the environment to read (``os.environ`` by default).
    """

    def __init__(self, backend: str | None = None, precision: str | None = None, *,
                 accumulate: int | None = None,
                 loss_scale: str | float | LossScaleConfig | None = None,
                 timeout: timedelta | None = None, seed: int = 0,
                 backend_options: Mapping[str, Any] | None = None,
                 precision_options: Mapping[str, Any] | None = None,
                 global_batch_size: int | None = None, batch_size: int | None = None,
                 lr_scaling: str | None = None,
                 run_dir: str | os.PathLike[str] | None = None, quiet: bool | None = None,
                 log_every: int | None = None, metrics_all_ranks: bool | None = None,
                 checkpoint_dir: str | os.PathLike[str] | None = None,
                 async_save: bool | None = None, resume: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        _die_with_launcher(launcher_pid(env))
        # The settings `mpt launch` handed over, with the arguments given here on top: both
        # checked by RunConfig, whichever way they came.
        self.config: RunConfig = RunConfig.from_env(env).replace(
            backend=backend, precision=precision, accumulate=accumulate,
            loss_scale=None if isinstance(loss_scale, LossScaleConfig) else loss_scale,
            timeout=timeout.total_seconds() if isinstance(timeout, timedelta) else timeout,
            backend_options=backend_options, precision_options=precision_options,
            global_batch_size=global_batch_size, lr_scaling=lr_scaling,
            run_dir=None if run_dir is None else os.fspath(run_dir), quiet=quiet,
            log_every=log_every, metrics_all_ranks=metrics_all_ranks,
            checkpoint_dir=None if checkpoint_dir is None else os.fspath(checkpoint_dir),
            async_save=async_save, resume=resume)
        """Every run setting, as this process trains with it."""
        config = self.config
        self.world: World = detect_world(env)
        scratch = launch_dir(env)  # under `mpt launch`: its stall watch reads our heartbeat
        self._heartbeat = Heartbeat(scratch, self.world.rank) if scratch else None
        self.device = torch.device(device_name(self.world.local_rank, torch.cuda.is_available()))
        total = config.global_batch_size
        self.batch_plan: BatchPlan | None = None if total is None else plan_batch(
            total, self.world.world_size, batch_size=batch_size, accumulate=config.accumulate)
        """How the global batch splits over ranks and micro-batches (None: no global size)."""
        self.accumulate = (self.batch_plan.accumulate if self.batch_plan
                           else config.accumulate or 1)
        self.batch_size: int | None = self.batch_plan.batch_size if self.batch_plan else batch_size
        """Per-rank micro-batch size to build the DataLoader with (None: the script decides)."""
        self.lr_scaling = config.lr_scaling
        scale = (loss_scale if isinstance(loss_scale, LossScaleConfig)
                 else LossScaleConfig.parse(config.loss_scale))
        # The check `mpt launch` made, again for scripts other launchers started.
        self.precision: Precision = checked_precision(
            config.backend, config.precision, device_type=self.device.type, loss_scale=scale,
            precision_options=config.precision_options, backend_options=config.backend_options)
        self.backend: Backend = get_backend(config.backend)(
            world=self.world, device=self.device, precision=self.precision,
            accumulate=self.accumulate, timeout=timedelta(seconds=config.timeout or 1800.0),
            options=config.backend_options)
        self.seed = seed
        self.checkpoint_dir = config.checkpoint_dir
        """Default root of ``save`` and ``resume`` (None: pass a path to them)."""
        self._writer = BackgroundWriter()  # asynchronous saves: one in flight at a time
        self._unsettled = False  # an asynchronous save since the ranks last met after one
        self.resume_from = config.resume or "auto"
        """``auto``, ``never`` or a checkpoint path: what ``resume`` loads."""
        self.global_step = 0
        """Training iterations done (every optimizer stepped once), counted on from a loaded
        checkpoint's step."""
        self._schedulers: dict[str, checkpoint.Stateful] = {}  # saved with a preempted run
        self._preemption = Preemption()
        metrics = MetricsConfig(run_dir=None if config.run_dir is None else Path(config.run_dir),
                                quiet=config.quiet, log_every=config.log_every,
                                all_ranks=config.metrics_all_ranks)
        self.backend.init_process_group()
        if self.batch_plan is not None:
            self.print(f"mpt: {self.batch_plan.describe()}")
        if self.lr_scaling is not None:
            self.print(f"mpt: lr scaling {self.lr_scaling}: rt.scale_lr multiplies learning rates "
                       f"by {lr_factor(self.lr_scaling, self.world_size):g} "
                       f"(world size {self.world_size})")
        self.pairs = Pairs()
        """Every model and optimizer ``setup`` was given, by name."""
        self._micro_step = 0  # backward calls, over every model
        self._loaders: list[DistributedLoader] = []  # their sampler positions go in checkpoints
        self.monitor = Monitor(metrics, rank=self.rank, device=self.device,
                               precision=self.precision, meta={
                                   "backend": self.backend.name, "precision": self.precision.name,
                                   "world_size": self.world_size, "accumulate": self.accumulate})
        """Progress bar and metrics files, fed by backward, clip_grad_norm_ and step."""

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

        Build the optimizer over ``model.parameters()`` before calling this; the parameters
        move in place, so the optimizer keeps pointing at them.
        """
        name = self.pairs.check_new(name, model, optimizer)
        original_model, original_optimizer = model, optimizer
        model = self.precision.convert_module(self.backend.place(model))
        wrapped, wrapped_optimizer = self.backend.setup(model, optimizer)
        pair = self.pairs.add(Pair(name=name, model=wrapped, optimizer=wrapped_optimizer),
                              original_model, original_optimizer)
        if wrapped_optimizer is None:
            return wrapped
        # After the backend: masters (O2) start from the weights it synchronised.
        self.precision.setup_optimizer(wrapped, wrapped_optimizer)
        self._sync_for_next_micro_batch(pair)
        return wrapped, wrapped_optimizer

    def scale_lr(self, lr: float) -> float:
        """``lr`` scaled by the run's rule in the world size (unchanged without a rule)."""
        return lr * lr_factor(self.lr_scaling, self.world_size)

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
        taken = {known.name for known in self._loaders}
        if name is None:  # the first is the training loader, the others are numbered
            name, number = "train", len(self._loaders)
            while name in taken:
                name, number = f"loader{number}", number + 1
        if name == "train" and self.batch_plan is not None and (
                loader.batch_size != self.batch_plan.batch_size):
            # The seeds' confusion: a per-rank batch that silently changes the global one.
            raise UsageError("DataLoader batch_size", loader.batch_size, "the "
                             f"{self.batch_plan.describe()} needs {self.batch_plan.batch_size} "
                             "per rank for the training loader", "build the DataLoader with "
                             "batch_size=rt.batch_size, or set up an evaluation loader with "
                             "another name (name=\"eval\")")
        if name == "train" and loader.batch_size:  # rt.progress(samples_per_step=...) overrides
            self.monitor.samples_per_step = loader.batch_size * self.accumulate * self.world_size
        distributed = DistributedLoader(loader, rank=self.rank, world_size=self.world_size,
                                        device=self.device, seed=self.seed, name=name)
        self._loaders = [*(known for known in self._loaders if known.name != name), distributed]
        return distributed

    # -- the step -----------------------------------------------------------------------------
    def autocast(self) -> Any:
        """Context for forward pass and loss, in the run's precision."""
        return self.precision.autocast()

    @property
    def is_accumulating(self) -> bool:
        """True while the coming ``rt.step()`` will not step: its micro-batch is not the last of
        an optimizer step (one optimizer set up; see ``accumulating`` for several)."""
        return self.accumulating()

    def accumulating(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Whether ``rt.step(optimizer)`` will only accumulate: its micro-batch is not the last
        of an optimizer step."""
        return self._accumulating(self.pairs.of_optimizer(optimizer, "accumulating"))

    def _accumulating(self, pair: Pair) -> bool:
        return (pair.calls + 1) % self.accumulate != 0

    def _sync_for_next_micro_batch(self, pair: Pair) -> None:
        """Reduce the gradients of the model's next backward only when its micro-batch is the
        last of an optimizer step: the allreduce runs once per step, not per micro-batch. The
        flag must be set before the forward (DDP reads it there), hence after each step."""
        if self.accumulate > 1:
            self.backend.set_gradient_sync(pair.model, not self._accumulating(pair))

    def backward(self, loss: torch.Tensor, *, model: nn.Module | None = None) -> None:
        """Backward of one micro-batch's loss, scaled for precision and divided for accumulation.

        Any loss of any model set up: gradients go wherever autograd takes them, as with
        ``loss.backward()``. ``model`` names the model whose optimizer this loss trains, for
        backends that backpropagate through one engine per model (DeepSpeed): without it, such a
        backend uses the engine of the next ``rt.step``/``rt.clip_grad_norm_``.
        """
        if not self.pairs.pairs:
            raise UsageError("rt.backward", "called before rt.setup", "nothing is set up",
                             "call model, optimizer = rt.setup(model, optimizer) first")
        target = self.pairs.of_model(model)
        self._mark("backward")
        self.backend.backward(loss, None if target is None else target.model)
        self._mark("script")
        self.monitor.on_backward(loss)  # kept on the device; read every log_every steps
        self._micro_step += 1

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor | None:
        """Clip the unscaled gradients of ``optimizer``'s parameters (the only optimizer by
        default) at the end of a step; None while accumulating."""
        pair = self.pairs.of_optimizer(optimizer, "clip_grad_norm_")
        if self._accumulating(pair):
            return None
        assert pair.optimizer is not None
        self._mark("step")  # the norm is reduced across ranks under sharding backends
        norm = self.backend.clip_grad_norm_(pair.model, pair.optimizer, max_norm, norm_type)
        self.monitor.on_grad_norm(norm)
        return norm

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
        pair = self.pairs.of_optimizer(optimizer, "step")
        assert pair.optimizer is not None
        if self._micro_step == 0:
            return False  # no backward yet: nothing to step on
        accumulating = self._accumulating(pair)
        pair.calls += 1
        self._sync_for_next_micro_batch(pair)
        if accumulating:
            self.backend.accumulate_step(pair.model, pair.optimizer)
            return False
        self._mark("step")
        if self.pairs.must_update_before(pair):
            self.backend.update_loss_scale()
            self.pairs.updated()
        stepped = self.backend.optimizer_step(pair.model, pair.optimizer)
        self.backend.zero_grad(pair.optimizer)
        update, ended = self.pairs.stepped(pair)
        if update:
            self.backend.update_loss_scale()
        if ended:
            self.global_step += 1
            first = self.pairs.stepping[0].optimizer  # its learning rate goes in the metrics
            assert first is not None
            self.monitor.on_step(first, self.global_step)
            if self._preemption.should_stop(self.backend.sum_async, self.world_size):
                self._stop_preempted()
        self._mark("script", self.global_step)
        return stepped

    def _stop_preempted(self) -> None:
        """Save where every rank agreed to stop, then exit with the code that asks for a requeue."""
        if self.checkpoint_dir is not None:  # committed before the process exits
            where = self.save(step=self.global_step, async_save=False)
            self.print(f"mpt: preempted: saved step {self.global_step} to {where}; exiting with "
                       f"{REQUEUE_EXIT_CODE} (requeue)")
        else:
            self.print(f"mpt: preempted at step {self.global_step} with no --checkpoint-dir: "
                       f"nothing saved; exiting with {REQUEUE_EXIT_CODE}")
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
        self._mark("collective")
        self.backend.barrier()
        self._mark("script")

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce a tensor across ranks in place (``sum``, ``mean``, ``max``, ``min``)."""
        self._mark("collective")
        result = self.backend.all_reduce(tensor, op)
        self._mark("script")
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
        extra = self._drop_set_up(extra)
        in_background = self.config.async_save if async_save is None else async_save
        self._mark("checkpoint")
        self._writer.wait()  # one checkpoint in flight: the previous one is committed first
        where = checkpoint.save_checkpoint(
            self._root(path, "save"), self._training_state(scheduler),
            step=self.global_step if step is None else step, epoch=epoch, extra=extra, keep=keep,
            sharded=sharded, background=self._writer if in_background else None)
        self._unsettled = self._unsettled or in_background
        self._mark("script")
        return where

    def wait_for_save(self) -> None:
        """Block until every rank's asynchronous save is committed (collective; a no-op when
        none was made since the last wait); raise the error of one that failed."""
        self._writer.wait()
        if self._unsettled:
            self.backend.barrier()  # rank 0 commits: the others wait for it here
            self._unsettled = False

    def load(self, path: str | os.PathLike[str], *,
             scheduler: Schedulers = None) -> dict[str, Any]:
        """Restore a checkpoint (``path``: a root ``save`` wrote into, which loads its latest,
        or one ``step-*`` directory) into the set-up models, optimizers, schedulers and loaders.

        The checkpoint must hold exactly the names set up; a mismatch names what is missing and
        what is extra.
        Works at any world size and under any backend. Returns ``{"step": ..., "epoch": ...
        (when known), **extra}``. Call ``setup_dataloader`` before, so loaders resume mid-epoch.
        """
        self._mark("checkpoint")
        self.wait_for_save()  # a checkpoint being written is committed before anything loads
        info = checkpoint.load_checkpoint(path, self._training_state(scheduler))
        self.global_step = info["step"]
        self.monitor.resume_at(info["step"])  # metrics and progress go on from the saved step
        self._mark("script", self.global_step)
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
        self._remember(scheduler)
        found = (None if self.checkpoint_dir is None
                 else checkpoint.find_latest(self.checkpoint_dir))
        if self.resume_from == "never":
            if found is not None:
                raise UsageError("--resume", "never", f"{self.checkpoint_dir} already holds "
                                 f"{found}; a fresh run would overwrite its steps", "pass "
                                 "--resume auto to continue it, or another --checkpoint-dir")
            return {"step": 0}
        if self.resume_from != "auto":
            found = self.resume_from
        if found is None:
            return {"step": 0}
        info = self.load(found)
        self.print(f"mpt: resumed from {found} at step {info['step']}")
        return info

    def _root(self, path: str | os.PathLike[str] | None, method: str) -> str | os.PathLike[str]:
        root = path if path is not None else self.checkpoint_dir
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
            if isinstance(value, (nn.Module, torch.optim.Optimizer)):
                self.pairs.of_model(value) if isinstance(value, nn.Module) else (
                    self.pairs.of_optimizer(value, "save"))
                continue
            kept[key] = value
        return kept

    def _training_state(self, scheduler: Schedulers) -> checkpoint.TrainingState:
        if not self.pairs.pairs:
            raise UsageError("rt.save/rt.load", "called before rt.setup", "nothing is set up",
                             "call model, optimizer = rt.setup(model, optimizer) first")
        self._remember(scheduler)
        return checkpoint.TrainingState(backend=self.backend, pairs=self.pairs.pairs,
                                        schedulers=self._schedulers, loaders=self._loaders)

    def _mark(self, phase: str, step: int | None = None) -> None:
        """Tell the heartbeat where this rank is (a no-op outside `mpt launch`)."""
        if self._heartbeat is not None:
            self._heartbeat.mark(phase, step)

    # -- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Commit the checkpoint being written, finish the metrics files and the progress
        bar, and leave the process group."""
        self._mark("closing")
        try:
            self._writer.close()  # raises if its write failed: the rest is closed anyway
        finally:
            self._preemption.close()
            self.monitor.close()
            self.backend.shutdown()
            if self._heartbeat is not None:
                self._heartbeat.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
