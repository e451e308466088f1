"""``--grad-compression powersgd``: torch's PowerSGD comm hook on one DDP model, with its state in
checkpoints.

PowerSGD sends a low-rank approximation of each gradient matrix and keeps, per rank, what the
approximation left out (its error feedback), adding it to the next step's gradients; warm start
keeps the last step's factors P and Q. torch keeps both per DDP *bucket* (``PowerSGDState``'s
``error_dict``, ``p_memory_dict``, ``q_memory_dict``, by bucket index), and a bucket's layout is
not fixed: DDP rebuilds its buckets after the first iteration of every new wrapper, so a resumed
job's first step sees other buckets than the saved ones (torch's own rule, that PowerSGD starts at
step 2 or later, avoids exactly this in a fresh job). Hence the hook here:

1. notes which parameters each bucket holds, by name, as PowerSGD starts using it;
2. when a bucket index comes back with its parameters in another order (a new wrapper's first
   step: DDP rebuilds its buckets in the order gradients arrive), moves each parameter's error
   with it (a bucket's flat gradient buffer is its gradients one after the other) and keeps the
   factors P and Q (the same tensors, so the same sizes: a valid warm start); when the buckets
   hold other parameters (another ``--bucket-mb``), hands every bucket's error back to its
   parameters, lays it out again for each new bucket, and starts P and Q afresh;
3. saves the errors, factors and step count with the layout they belong to, so that a job that
   resumes with the same buckets continues exactly as the uninterrupted job would;
4. on gloo, starts a bucket's compression only once the previous bucket's is done. torch's hook
   issues its second and third allreduce from the callbacks of the first, which gloo runs on its
   own threads as each finishes: with two buckets or more, the ranks issued them in different
   orders and hung (measured: 6 buckets, 2 ranks). NCCL runs such callbacks in issue order.

No ``from __future__ import annotations``: DDP checks the hook's annotations as real types.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)

DEFAULT_RANK = 1
"""Rank of each gradient matrix's approximation (torch's default)."""
DEFAULT_START_STEP = 1000
"""Steps of plain allreduce before PowerSGD starts (torch's default: early training is the most
sensitive to approximate gradients; torch suggests about 10 % of the run)."""


class PowerSGD:
    """One DDP model's PowerSGD state, kept in a form a checkpoint can save and a job with other
    buckets can restore."""

    def __init__(self, module: nn.Module, *, rank: int, start_step: int,
                 group: dist.ProcessGroup | None = None) -> None:
        self.state = PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                   start_powerSGD_iter=start_step)
        """torch's state, which its ``powerSGD_hook`` reads and updates."""
        named = dict(module.named_parameters())
        self._names = {id(param): name for name, param in named.items()}
        self._sizes = {name: param.numel() for name, param in named.items()}
        self._layout: dict[int, tuple[str, ...]] = {}
        """Bucket index -> its parameters' names, for the buckets PowerSGD keeps state of."""
        self._loose: dict[str, torch.Tensor] = {}
        """Error feedback by parameter name, waiting for the bucket that will hold it."""
        self._in_order = dist.get_backend(group) == "gloo"
        """Whether each bucket waits for the previous one's collectives (see 4. above)."""
        self._previous: torch.futures.Future[torch.Tensor] | None = None

    def lay_out(self, bucket: dist.GradBucket) -> None:
        """Make the state of ``bucket``'s index belong to the parameters it holds now."""
        index = bucket.index()
        names = tuple(self._names[id(param)] for param in bucket.parameters())
        before = self._layout.get(index)
        if before == names:
            return
        if before is not None and sorted(before) == sorted(names):
            self._reorder(index, before, names)
            return
        if before is not None:  # the buckets were regrouped: errors back to their parameters
            self._loosen()
        if any(name in self._loose for name in names):
            self.state.error_dict[index] = torch.cat([
                self._loose.pop(name) if name in self._loose
                else bucket.buffer().new_zeros(self._sizes[name]) for name in names])
        self._layout[index] = names

    def _reorder(self, index: int, before: tuple[str, ...], names: tuple[str, ...]) -> None:
        """The same parameters in another order (a new wrapper's first step, before DDP rebuilt
        its buckets in gradient order): the errors move with their parameters; the factors stay,
        a valid start for the power iteration whatever order its tensors come in."""
        error = self.state.error_dict.get(index)
        if error is not None:
            pieces = dict(zip(before, error.split([self._sizes[n] for n in before]), strict=True))
            self.state.error_dict[index] = torch.cat([pieces[name] for name in names])
        self._layout[index] = names

    def _loosen(self) -> None:
        for index, names in self._layout.items():
            error = self.state.error_dict.pop(index, None)
            if error is not None:
                self._loose.update(zip(names, error.split([self._sizes[n] for n in names]),
                                       strict=True))
        self._layout.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: step count, seed generator, and per bucket its parameters, error
        feedback and factors (on the CPU: other ranks' states travel to rank 0 by pickle)."""
        s = self.state
        name, keys, pos, has_gauss, cached = s.rng.get_state()
        buckets = [{"index": index, "params": list(names),
                    **{key: memory[index].cpu() for key, memory in (
                        ("error", s.error_dict), ("p", s.p_memory_dict), ("q", s.q_memory_dict))
                       if index in memory}}
                   for index, names in self._layout.items()]
        return {"iter": s.iter, "buckets": buckets,
                "loose": {name: error.cpu() for name, error in self._loose.items()},
                "rng": {"name": name, "keys": torch.from_numpy(keys.astype("int64")),
                        "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
                "compression": [s.total_numel_before_compression,
                                s.total_numel_after_compression, s.next_stats_report]}

    def load_state_dict(self, states: list[dict[str, Any]], rank: int, device: torch.device
                        ) -> None:
        """Restore every rank's saved ``states`` (``state_dict``'s, in rank order): this rank's
        error feedback where the job has as many ranks as the saved one (a rank's error is its
        own; with another world size it is dropped, and PowerSGD goes on from the step it was
        at); the factors and the rest from rank 0, where every rank had the same."""
        mine = states[rank] if len(states) > rank else None
        first = states[0]
        s = self.state
        s.iter = int(first["iter"])
        rng = first["rng"]
        s.rng.set_state((rng["name"], rng["keys"].numpy().astype("uint32"), rng["pos"],
                         rng["has_gauss"], rng["cached"]))
        (s.total_numel_before_compression, s.total_numel_after_compression,
         s.next_stats_report) = first["compression"]
        s.error_dict.clear()
        s.p_memory_dict.clear()
        s.q_memory_dict.clear()
        self._layout.clear()
        self._loose.clear()
        for bucket, own in zip(first["buckets"], (mine or first)["buckets"], strict=True):
            index = int(bucket["index"])
            self._layout[index] = tuple(bucket["params"])
            for key, memory in (("p", s.p_memory_dict), ("q", s.q_memory_dict)):
                if key in bucket:
                    memory[index] = bucket[key].to(device)
            if mine is not None and "error" in own:
                s.error_dict[index] = own["error"].to(device)
        if mine is not None:
            self._loose = {name: error.to(device) for name, error in mine["loose"].items()}


    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """torch's ``powerSGD_hook`` on ``bucket``, its state laid out for the parameters it
        holds, after the previous bucket's collectives on gloo."""
        if self.state.iter < self.state.start_powerSGD_iter:
            return powerSGD_hook(self.state, bucket)  # one plain allreduce, in bucket order
        self.lay_out(bucket)
        if self._in_order and self._previous is not None:
            self._previous.wait()
        self._previous = powerSGD_hook(self.state, bucket)
        return self._previous


def powersgd_hook(comm: PowerSGD, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook DDP calls with ``comm`` (``PowerSGD.reduce``)."""
    return comm.reduce(bucket)
