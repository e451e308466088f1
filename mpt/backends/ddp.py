"""Native PyTorch DistributedDataParallel: NCCL on GPUs, gloo on CPUs."""

from __future__ import annotations

import atexit
import gc
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mpt.backends.base import Availability, Backend
from mpt.errors import UsageError

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _done() -> None:
    """The wait of a sum over a world of one: there is nothing to wait for."""


class DDPBackend(Backend):
    """One model replica per process; DDP averages gradients in buckets during backward.

    A world of one process gets neither a process group nor the DDP wrapper: there is nothing
    to reduce, and the wrapper's bucket copies would only cost time.
    """

    name = "ddp"
    _control: dist.ProcessGroup | None = None
    """The CPU group of ``sum_async`` (set on first use)."""

    @classmethod
    def availability(cls) -> Availability:
        if not dist.is_available():
            return Availability(available=False, version=torch.__version__,
                                reason="this torch build has no torch.distributed",
                                install="pip install torch==2.13.0 (a Linux build)")
        comms = [n for n, ok in (("gloo", dist.is_gloo_available()),
                                 ("nccl", dist.is_nccl_available()),
                                 ("mpi", dist.is_mpi_available())) if ok]
        return Availability(available=True, version=f"{torch.__version__} ({', '.join(comms)})")

    group_alone: ClassVar[bool] = False
    """Whether a world of one still gets a process group (fully_shard and DeepSpeed need one,
    DDP does not)."""

    def init_process_group(self) -> None:
        if dist.is_initialized():
            return
        if not self.world.is_distributed:
            if self.group_alone:  # an in-process store: no port, no launcher variables
                dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                        store=dist.HashStore(), rank=0, world_size=1,
                                        timeout=self.timeout)
                atexit.register(self.shutdown)  # for scripts that never call rt.close()
            return
        if self.world.master_addr is None:
            raise UsageError("MASTER_ADDR", "<unset>", f"the {self.world.source} launcher did not "
                             "say where rank 0 runs", "export MASTER_ADDR=<host of rank 0>")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # tcp:// with the world's explicit address rather than env://: the address may come from
        # SLURM or MPI variables that torch's env:// would not understand. Under torchrun-style
        # launchers torch reuses the agent's store on that port instead of binding it twice.
        where: dict[str, Any] = {
            "init_method": f"tcp://{self.world.master_addr}:{self.world.master_port}"}
        if self.world.attempt:
            # A restarted gang: torch's static rendezvous keeps the agent's store across
            # restarts, so without a prefix of its own the new gang would read the dead one's
            # addresses (gloo: "connectFullMesh failed ... Connection refused").
            store = dist.TCPStore(self.world.master_addr, self.world.master_port,
                                  self.world.world_size, is_master=False, timeout=self.timeout)
            where = {"store": dist.PrefixStore(f"mpt/attempt-{self.world.attempt}", store)}
        dist.init_process_group(
            backend="nccl" if self.device.type == "cuda" else "gloo",
            rank=self.world.rank,
            world_size=self.world.world_size,
            timeout=self.timeout,
            **where,
        )
        atexit.register(self.shutdown)  # for scripts that never call rt.close()

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
              ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        if not self.world.is_distributed:
            return model, optimizer
        if optimizer is None:  # nothing to reduce: no wrapper, no buffer broadcast per forward
            self.broadcast_module_(model)
            return model, None
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids), optimizer

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        # What DDP.no_sync() does, without a context the user's loop would have to open around
        # the forward: DDP reads the flag in forward to decide whether backward will reduce.
        if isinstance(model, DistributedDataParallel):
            model.require_backward_grad_sync = enabled

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
            # gloo's finished work objects sit in reference cycles; left to interpreter
            # teardown, freeing them aborts the process ("terminate called without an active
            # exception") in about one exit in eight (3 of 24 runs). Free them now, while
            # Python is whole.
            gc.collect()

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if not dist.is_initialized():
            return tensor
        if op == "mean":
            dist.all_reduce(tensor, dist.ReduceOp.SUM)
            return tensor.div_(self.world.world_size)
        dist.all_reduce(tensor, _REDUCE_OPS[op])
        return tensor

    def broadcast_tensor_(self, tensor: torch.Tensor, src: int = 0) -> None:
        if dist.is_initialized():
            dist.broadcast(tensor, src=src)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def sum_async(self, tensor: torch.Tensor) -> Callable[[], None]:
        if not dist.is_initialized():
            return _done
        if self._control is None:
            # A gloo group of its own, on the CPU: under NCCL the default group would tie the
            # decision to the GPU stream. Created on first use, which every rank reaches at the
            # same step.
            self._control = dist.new_group(backend="gloo", timeout=self.timeout)
        return dist.all_reduce(tensor, group=self._control, async_op=True).wait
