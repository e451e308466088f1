"""The training step: backward, clipping and the optimizer step, with accumulation and the loss
scale's timing across several optimizers.

What a script calls ``rt.backward``/``rt.clip_grad_norm_``/``rt.step`` for lands here. It knows
nothing of the backend beyond its interface; a step of another shape (a pipeline's, whose schedule
runs forward and backward itself) is a subclass (``mpt.pipeline.step``), chosen by the connector.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mpt.errors import UsageError
from mpt.metrics import Monitor
from mpt.pairs import Pair, Pairs

if TYPE_CHECKING:
    from mpt.backends.base import Backend

Mark = Callable[..., None]
"""Tells the heartbeat where the rank is: ``mark(phase)`` or ``mark(phase, step)``."""


class TrainStep:
    """Counts micro-batches per optimizer and training iterations, and drives the backend's
    backward, clip and step in the order loss scaling needs."""

    def __init__(self, *, backend: Backend, pairs: Pairs, accumulate: int, monitor: Monitor,
                 mark: Mark, on_iteration: Callable[[], None]) -> None:
        self.backend = backend
        self.pairs = pairs
        self.accumulate = accumulate
        """Micro-batches per optimizer step."""
        self.monitor = monitor
        self.mark = mark
        self.on_iteration = on_iteration
        """Called when a training iteration ends (every optimizer stepped once)."""
        self.global_step = 0
        """Training iterations done, counted on from a loaded checkpoint's step."""
        self.micro_step = 0
        """Backward calls, over every model."""

    def add(self, name: str, model: nn.Module,
            optimizer: torch.optim.Optimizer | None) -> Pair:
        """Place and wrap ``model`` and ``optimizer`` for the backend and the precision (see
        ``Runtime.setup``) and count the pair's micro-batches from here."""
        precision = self.backend.precision
        placed = precision.convert_module(self.place(model, optimizer))
        wrapped, wrapped_optimizer = self.wrap(placed, optimizer)
        precision.autocast_forward(wrapped)  # no rt.autocast() needed in the script
        pair = self.pairs.add(Pair(name=name, model=wrapped, optimizer=wrapped_optimizer),
                              model, optimizer)
        if wrapped_optimizer is not None:
            # After the backend: masters (O2) start from the weights it synchronised.
            precision.setup_optimizer(wrapped, wrapped_optimizer)
            self.sync_for_next_micro_batch(pair)
        return pair

    def place(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        """``model`` on this rank's device (``Backend.place``)."""
        return self.backend.place(model, optimizer)

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
             ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """``model`` and ``optimizer`` as the backend trains them (``Backend.setup``)."""
        return self.backend.setup(model, optimizer)

    def resume_at(self, step: int) -> None:
        """Count on from a loaded checkpoint's ``step``: iterations, metrics and progress, and
        the heartbeat's step."""
        self.global_step = step
        self.monitor.resume_at(step)
        self.mark("script", step)

    def accumulating(self, pair: Pair) -> bool:
        """Whether the pair's coming ``step`` only accumulates (not the step's last micro-batch)."""
        return (pair.calls + 1) % self.accumulate != 0

    def sync_for_next_micro_batch(self, pair: Pair) -> None:
        """Reduce the gradients of the model's next backward only when its micro-batch is the
        last of an optimizer step: the allreduce runs once per step, not per micro-batch. The
        flag must be set before the forward (DDP reads it there), hence after each step."""
        if self.accumulate > 1:
            self.backend.set_gradient_sync(pair.model, not self.accumulating(pair))

    def backward(self, loss: torch.Tensor, model: nn.Module | None) -> None:
        """Backward of one micro-batch's loss (see ``Runtime.backward``)."""
        if not self.pairs.pairs:
            raise UsageError("rt.backward", "called before rt.setup", "nothing is set up",
                             "call model, optimizer = rt.setup(model, optimizer) first")
        target = self.pairs.of_model(model)
        self.mark("backward")
        self.backend.backward(loss, None if target is None else target.model)
        self.mark("script")
        self.monitor.on_backward(loss)  # kept on the device; read every log_every steps
        self.micro_step += 1

    def pair_of(self, model: nn.Module | None, method: str) -> Pair:
        """The pair ``model`` belongs to; with none, the only one that has an optimizer."""
        pair = self.pairs.of_model(model)
        return pair if pair is not None else self.pairs.of_optimizer(None, method)

    def forward_backward(self, model: nn.Module | None, inputs: Any, target: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch (see ``Runtime.forward_backward``)."""
        pair = self.pair_of(model, "forward_backward")
        with self.backend.precision.autocast():
            loss = loss_fn(pair.model(inputs), target)
        self.backward(loss, pair.model)
        return loss.detach()

    def evaluate(self, model: nn.Module | None, inputs: Any, target: Any = None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> Any:
        """A forward without gradients (see ``Runtime.evaluate``)."""
        pair = self.pair_of(model, "evaluate")
        with torch.no_grad(), self.backend.precision.autocast():
            output = pair.model(inputs)
            return output if loss_fn is None else loss_fn(output, target)

    def clip_grad_norm_(self, pair: Pair, max_norm: float,
                        norm_type: float) -> torch.Tensor | None:
        """Clip the pair's unscaled gradients at the end of a step; None while accumulating."""
        if self.accumulating(pair):
            return None
        assert pair.optimizer is not None
        self.mark("step")  # the norm is reduced across ranks under sharding backends
        norm = self.clip(pair.model, pair.optimizer, max_norm, norm_type)
        self.monitor.on_grad_norm(norm)
        return norm

    def clip(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float,
             norm_type: float) -> torch.Tensor:
        """Clip the gradients of ``optimizer``'s parameters; their norm before clipping."""
        return self.backend.clip_grad_norm_(model, optimizer, max_norm, norm_type)

    def step(self, pair: Pair) -> bool:
        """Step the pair's optimizer once every ``accumulate`` calls (see ``Runtime.step``)."""
        assert pair.optimizer is not None
        if self.micro_step == 0:
            return False  # no backward yet: nothing to step on
        accumulating = self.accumulating(pair)
        pair.calls += 1
        self.sync_for_next_micro_batch(pair)
        if accumulating:
            self.backend.accumulate_step(pair.model, pair.optimizer)
            return False
        self.mark("step")
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
            self.on_iteration()
        self.mark("script", self.global_step)
        return stepped
