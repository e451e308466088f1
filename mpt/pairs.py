"""The models and optimizers a run set up, by name, and when a training iteration ends.

A GAN sets up a generator and a discriminator, each with its optimizer; a distillation run adds
a frozen teacher with none. ``rt.step(optimizer)`` steps one of them, so the runtime must know
which pair an optimizer belongs to, how many micro-batches each has seen (accumulation is
counted per optimizer, by its ``rt.step`` calls), and when every optimizer has stepped: that is
the end of one training iteration, where the shared loss scale is updated once (torch's recipe
for several models and one ``GradScaler``) and ``global_step`` counts one.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from mpt.errors import UsageError


@dataclass(kw_only=True, slots=True, eq=False)
class Pair:
    """One ``rt.setup`` call: a model, wrapped for the backend, and its optimizer (or none)."""

    name: str
    """Its name in checkpoints: ``setup(name=...)``, else from the order of ``setup``."""
    model: nn.Module
    """What ``setup`` returned for the model (a DDP wrapper, a DeepSpeed engine, ...)."""
    optimizer: torch.optim.Optimizer | None
    """What ``setup`` returned for the optimizer; None for an EMA copy or a frozen teacher."""
    calls: int = 0
    """``rt.step`` calls for this optimizer so far: one per micro-batch."""


def default_name(index: int) -> str:
    """``model`` for the first pair (a one-model run's checkpoints keep their name), then
    ``model_1``, ``model_2``, ..."""
    return "model" if index == 0 else f"model_{index}"


@dataclass(kw_only=True, slots=True)
class Pairs:
    """Every pair set up, in ``setup`` order, found by name, model or optimizer."""

    pairs: list[Pair] = field(default_factory=list)
    stepping: list[Pair] = field(default_factory=list)
    """The pairs that have an optimizer, in ``setup`` order."""
    _stepping_ids: set[int] = field(default_factory=set)
    _by_object: weakref.WeakKeyDictionary[object, Pair] = field(
        default_factory=weakref.WeakKeyDictionary)
    """Each model and optimizer, given and returned, to its pair; weakly, since a model given
    may be gone (a pipeline keeps only its stage) and its id taken by a new object."""
    _since_update: set[int] = field(default_factory=set)
    """Pairs (ids) whose optimizer stepped since the loss scale was last updated."""
    _since_count: set[int] = field(default_factory=set)
    """Pairs (ids) whose optimizer stepped since ``global_step`` last counted."""

    def check_new(self, name: str | None, model: nn.Module,
                  optimizer: torch.optim.Optimizer | None) -> str:
        """The name the next pair gets; a UsageError when anything in it is set up already."""
        name = default_name(len(self.pairs)) if name is None else name
        if not isinstance(name, str) or not name or "/" in name:
            raise UsageError("name", name, "a pair's name is a non-empty string without '/'",
                             "pass e.g. name='G'")
        if any(pair.name == name for pair in self.pairs):
            raise UsageError("name", name, "a model was already set up under this name",
                             f"give each rt.setup call its own name (taken: {self.names()})")
        for what, obj in (("model", model), ("optimizer", optimizer)):
            if obj is not None and obj in self._by_object:
                raise UsageError(what, type(obj).__name__, f"this {what} was already set up as "
                                 f"{self._by_object[obj].name!r}", "call rt.setup once per "
                                 "model and optimizer, and use what it returned")
        return name

    def add(self, pair: Pair, *originals: object) -> Pair:
        """Register ``pair``; ``originals``: the objects given to ``setup``, found as well."""
        self.pairs.append(pair)
        if pair.optimizer is not None:
            self.stepping.append(pair)
            self._stepping_ids.add(id(pair))
        for obj in (pair.model, pair.optimizer, *originals):
            if obj is not None:
                self._by_object[obj] = pair
        return pair

    def names(self) -> str:
        return ", ".join(pair.name for pair in self.pairs) or "none"

    def of_model(self, model: nn.Module | None) -> Pair | None:
        """The pair of ``model`` (None for None); a UsageError for a model never set up."""
        if model is None:
            return None
        pair = self._by_object.get(model)
        if pair is None:
            raise UsageError("model", type(model).__name__, "this model was not set up",
                             f"pass the model rt.setup returned (set up: {self.names()})")
        return pair

    def of_optimizer(self, optimizer: torch.optim.Optimizer | None, method: str) -> Pair:
        """The pair ``rt.<method>(optimizer=...)`` means; with no optimizer, the only one."""
        if optimizer is None:
            stepping = self.stepping
            if len(stepping) == 1:
                return stepping[0]
            if not stepping:
                raise UsageError(f"rt.{method}", "()", "no optimizer was set up",
                                 "call model, optimizer = rt.setup(model, optimizer) first")
            names = ", ".join(p.name for p in stepping)
            raise UsageError(f"rt.{method}", "()", f"{len(stepping)} optimizers are set up "
                             f"({names})", f"name the one you mean: rt.{method}(optimizer)")
        pair = self._by_object.get(optimizer)
        if pair is None or pair.optimizer is None:
            raise UsageError("optimizer", type(optimizer).__name__, "this optimizer was not "
                             "set up", "pass it to rt.setup(model, optimizer) first, and "
                             f"step what rt.setup returned (set up: {self.names()})")
        return pair

    # -- iterations ------------------------------------------------------------------------------
    def must_update_before(self, pair: Pair) -> bool:
        """True when ``pair``'s optimizer already stepped since the last scale update: the
        scale is updated before it steps again (GradScaler allows one step per optimizer and
        update; a critic stepping five times per generator step needs this)."""
        return id(pair) in self._since_update

    def stepped(self, pair: Pair) -> tuple[bool, bool]:
        """Record that ``pair``'s optimizer stepped. Returns (update the loss scale now, one
        training iteration ended): both when every optimizer has stepped since the last time."""
        self._since_update.add(id(pair))
        self._since_count.add(id(pair))
        update = self._since_update >= self._stepping_ids
        ended = self._since_count >= self._stepping_ids
        if update:
            self._since_update.clear()
        if ended:
            self._since_count.clear()
        return update, ended

    def updated(self) -> None:
        """The loss scale was updated out of turn (see ``must_update_before``)."""
        self._since_update.clear()
