"""``mpt.Runtime``: the one object a training script talks to.

It composes the four parts (environment, backend, precision, checkpoint) and only delegates: it
never asks which backend it runs on, so adding a backend never touches this file.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from mpt import checkpoint
from mpt._native import bind_to_parent
from mpt.backends import Backend, get_backend
from mpt.data import DistributedLoader
from mpt.environments import World, detect_world, device_name
from mpt.environments.settings import launcher_pid, read_settings
from mpt.errors import UsageError
from mpt.precision import LossScaleConfig, Precision, check_precision, make_precision


def _parse_accumulate(argument: str, value: object) -> int:
    try:
        number: int = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise UsageError(argument, value, "it must be a whole number of at least 1",
                         f"pass {argument}=1 for no accumulation, or more")
    return number


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
        timeout: how long a collective may wait before failing instead of hanging.
        seed: seed of the per-epoch shuffle of ``setup_dataloader``.
        backend_options: the backend's own options (e.g. DeepSpeed's ``zero_stage``); they
            update those `mpt launch` passed.
        env: the environment to read (``os.environ`` by default).
    """

    def __init__(self, backend: str | None = None, precision: str | None = None, *,
                 accumulate: int | None = None,
                 loss_scale: str | float | LossScaleConfig | None = None,
                 timeout: timedelta = timedelta(minutes=30), seed: int = 0,
                 backend_options: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        _die_with_launcher(launcher_pid(env))
        flags = read_settings(env)
        self.world: World = detect_world(env)
        self.device = torch.device(device_name(self.world.local_rank, torch.cuda.is_available()))
        self.accumulate = _parse_accumulate(
            "accumulate", accumulate if accumulate is not None else flags.get("accumulate", 1))
        precision_name = check_precision(precision or flags.get("precision", "fp32"))
        scale = (loss_scale if isinstance(loss_scale, LossScaleConfig) else LossScaleConfig.parse(
            loss_scale if loss_scale is not None else flags.get("loss_scale", "dynamic")))
        self.precision: Precision = make_precision(precision_name, self.device.type, scale)
        self.backend: Backend = get_backend(backend or flags.get("backend", "ddp"))(
            world=self.world, device=self.device, precision=self.precision,
            accumulate=self.accumulate, timeout=timeout,
            options={**flags.get("backend_options", {}), **(backend_options or {})})
        self.seed = seed
        self.backend.init_process_group()
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._micro_step = 0

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
    def setup(self, model: nn.Module,
              optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move the model to this rank's device and wrap both for the backend.

        Build the optimizer over ``model.parameters()`` before calling this; the parameters
        move in place, so the optimizer keeps pointing at them.
        """
        model = self.precision.convert_module(model.to(self.device))
        self._model, self._optimizer = self.backend.setup(model, optimizer)
        if self.accumulate > 1:
            self.backend.set_gradient_sync(self._model, False)  # the first micro-batch
        return self._model, self._optimizer

    def setup_dataloader(self, loader: DataLoader[Any]) -> DistributedLoader:
        """This rank's shard of ``loader``'s dataset, batches on this rank's device."""
        return DistributedLoader(loader, rank=self.rank, world_size=self.world_size,
                                 device=self.device, seed=self.seed)

    # -- the step -----------------------------------------------------------------------------
    def autocast(self) -> Any:
        """Context for forward pass and loss, in the run's precision."""
        return self.precision.autocast()

    @property
    def is_accumulating(self) -> bool:
        """True while the micro-batches seen since the last step do not yet make a full step."""
        return self._micro_step % self.accumulate != 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch, scaled for precision and divided for accumulation."""
        model, _ = self._require_setup()
        self.backend.backward(loss)
        self._micro_step += 1
        if self.accumulate > 1:
            # The *next* forward must know whether its backward reduces: only the last
            # micro-batch of a step does, so the allreduce runs once per optimizer step.
            self.backend.set_gradient_sync(model, (self._micro_step + 1) % self.accumulate == 0)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip the unscaled gradients at the end of a step; None while accumulating."""
        model, optimizer = self._require_setup()
        if self.is_accumulating:
            return None
        return self.backend.clip_grad_norm_(model, optimizer, max_norm, norm_type)

    def step(self) -> bool:
        """Step the optimizer once every ``accumulate`` micro-batches, then zero the gradients.

        Returns True when the parameters changed; False while accumulating or when fp16
        gradients overflowed (that step is skipped on every rank and the loss scale backs off).
        """
        model, optimizer = self._require_setup()
        if self.is_accumulating or self._micro_step == 0:
            return False
        stepped = self.backend.optimizer_step(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        return stepped

    def _require_setup(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self._model is None or self._optimizer is None:
            raise RuntimeError("call rt.setup(model, optimizer) before training with the runtime")
        return self._model, self._optimizer

    # -- collectives --------------------------------------------------------------------------
    def barrier(self) -> None:
        self.backend.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce a tensor across ranks in place (``sum``, ``mean``, ``max``, ``min``)."""
        return self.backend.all_reduce(tensor, op)

    # -- checkpoints --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], *, step: int = 0, **extra: Any) -> None:
        """Save model, optimizer, precision state (loss scale), ``step`` and ``extra`` values.

        Rank 0 writes (atomically); every rank waits until the file is complete.
        """
        model, optimizer = self._require_setup()
        state = {
            "model": self.backend.model_state_dict(model),
            "optimizer": self.backend.optimizer_state_dict(model, optimizer),
            "precision": self.precision.state_dict(),
            "step": step,
            "extra": extra,
        }
        if self.is_global_zero:
            checkpoint.save_state(path, state)
        self.barrier()

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore what ``save`` wrote into the set-up model and optimizer.

        Returns ``{"step": ..., **extra}``.
        """
        model, optimizer = self._require_setup()
        state = checkpoint.load_state(path)
        self.backend.load_model_state_dict(model, state["model"])
        self.backend.load_optimizer_state_dict(model, optimizer, state["optimizer"])
        self.precision.load_state_dict(state["precision"])
        return {"step": state["step"], **state["extra"]}

    # -- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the process group."""
        self.backend.shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
