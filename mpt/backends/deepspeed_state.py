"""Full, by-name state out of DeepSpeed's flat shards, and back in.

ZeRO keeps the fp32 master weights and the optimizer state as one flat tensor per param group
and rank (stages 1-2, and bf16 at stage 0) or per sub-group (stage 3); the torch optimizer inside
only ever sees those flat shards. DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*`` functions
translate one parameter at a time; this module applies them to a whole model, in mpt's by-name
format (``mpt.state.named``), and handles what they leave out: per-group scalars such as
Adam's ``step``, optimizer state that does not exist yet in a fresh job, and refreshing the
low-precision weights after the masters changed.

At ZeRO-3 a sharded checkpoint takes each rank's partitions as they are instead
(``local_weights``/``local_optimizer_state``): ``FlatPiece`` ranges of DeepSpeed's
``safe_get_local_*`` views, which mpt's DCP storage writes as whole rows and reads in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpt.precision import LossScaleState
from mpt.state.flat import FlatPiece, exchange_tails


def _utils() -> Any:
    """``deepspeed.utils``, imported on use: the backend imported deepspeed already (after
    choosing its accelerator), and the loss-scale translation below needs none of it."""
    import deepspeed.utils

    return deepspeed.utils


def _full_shape(param: torch.nn.Parameter) -> torch.Size:
    """A parameter's real shape (ZeRO-3 leaves an empty placeholder in the module)."""
    return getattr(param, "ds_shape", param.shape)


def _set_full(param: torch.nn.Parameter, value: torch.Tensor, key: str | None = None) -> None:
    """Write this rank's part of a full fp32 master (``key`` None) or optimizer state tensor.

    At ZeRO-3 DeepSpeed 0.19's ``safe_set_full_*`` cuts the value into equal partitions without
    the padding its own partitions carry, and fails on a parameter whose size is not a
    multiple of the world size (e.g. a bias of 1 on 2 ranks); the padded cut is done here.
    """
    if not hasattr(param, "ds_id"):
        if key is None:
            _utils().safe_set_full_fp32_param(param, value)
        else:
            _utils().safe_set_full_optimizer_state(param, value, key)
        return
    opt = param._z3_optimizer
    part, _ = opt._get_fp32_opt_state_partition(param, release_swap_buffers=False,
                                                 optim_state_key=key)
    flat = value.flatten().to(part.dtype)
    start = part.numel() * opt._get_param_partition_rank(param)
    count = max(0, min(part.numel(), flat.numel() - start))
    part.data.narrow(0, 0, count).copy_(flat.narrow(0, start, count))


def _has_master(param: torch.nn.Parameter) -> bool:
    """Whether DeepSpeed keeps this parameter's fp32 master in a flat shard."""
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


class FlatState:
    """The parameters of one DeepSpeed engine by name, and their state in the flat shards."""

    def __init__(self, engine: Any, groups: list[list[str]]) -> None:
        self.engine = engine
        self.groups = groups
        """Parameter names per (non-empty) param group, as the user's optimizer held them."""
        self.names = [name for group in groups for name in group]
        self.params = dict(engine.module.named_parameters())

    @property
    def _inner(self) -> torch.optim.Optimizer:
        """The torch optimizer that DeepSpeed's wrapper steps on the flat shards."""
        return self.engine.optimizer.optimizer

    def _flat(self, param: torch.nn.Parameter, group: int) -> torch.Tensor:
        """The flat fp32 shard holding this rank's part of ``param`` (and its state's key)."""
        opt = self.engine.optimizer
        if hasattr(param, "ds_id"):  # stage 3: one shard per sub-group
            sub_group = opt.grad_position[opt.get_param_id(param)][0]
            return opt.fp32_partitioned_groups_flat[sub_group]
        return self._inner.param_groups[group]["params"][0]

    # -- weights ------------------------------------------------------------------------------
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Set full weights (fp32 masters where DeepSpeed has them) and buffers on every rank."""
        module, opt = self.engine.module, self.engine.optimizer
        masters = False
        with torch.no_grad():
            for name, param in self.params.items():
                if _has_master(param):
                    _set_full(param, state[name])
                    masters = True
                else:
                    param.copy_(state[name])
            for name, buffer in module.named_buffers():
                buffer.copy_(state[name])
            if not masters:
                if opt is not self.engine.basic_optimizer and hasattr(opt, "refresh_fp32_params"):
                    opt.refresh_fp32_params()  # fp16 at stage 0: masters from the weights
                return
            # The masters changed: copy them into the (partitioned) weights the forward uses.
            if self.engine.zero_optimization_partition_weights():
                self._refresh_partitions()
            else:
                opt.update_lp_params()

    # -- optimizer state ----------------------------------------------------------------------
    def optimizer_state(self) -> dict[str, Any]:
        """Full optimizer state by name (collective: every rank calls, in the same order)."""
        return self._optimizer_state(
            lambda param, key: _utils().safe_get_full_optimizer_state(param, key).clone())

    def _optimizer_state(self, tensor: Callable[[torch.nn.Parameter, str], Any]
                         ) -> dict[str, Any]:
        """The optimizer state by name, ``tensor(param, key)`` for each per-element tensor."""
        state: dict[str, dict[str, Any]] = {}
        for group, names in enumerate(self.groups):
            for name in names:
                param = self.params[name]
                flat = self._flat(param, group)
                entry: dict[str, Any] = {}
                for key, value in self._inner.state.get(flat, {}).items():
                    if torch.is_tensor(value) and value.shape == flat.shape:
                        entry[key] = tensor(param, key)
                    else:  # per group, e.g. Adam's step: the same for each of its parameters
                        entry[key] = value.clone() if torch.is_tensor(value) else value
                if entry:
                    state[name] = entry
        param_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": names}
                        for group, names in zip(self.engine.optimizer.param_groups, self.groups,
                                                strict=True)]
        return {"state": state, "param_groups": param_groups}

    def load_optimizer_state(self, named: dict[str, Any]) -> None:
        """Restore ``optimizer_state``'s output, even into an optimizer that never stepped, or
        finish a load of ``local_optimizer_state``'s (whose ranges DCP read in place)."""
        for group, saved in zip(self.engine.optimizer.param_groups, named["param_groups"],
                                strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        inner, filled = self._inner, set()
        for group, names in enumerate(self.groups):
            for name in names:
                saved = named["state"].get(name)
                if not saved:
                    continue
                param = self.params[name]
                flat = self._flat(param, group)
                filled.add(flat)
                slot = inner.state[flat]
                full = [k for k, v in saved.items()
                        if torch.is_tensor(v) and v.shape == _full_shape(param)]
                for key, value in saved.items():
                    if key in full:
                        # torch creates its state at the first step; create it now instead.
                        slot.setdefault(key, torch.zeros_like(flat))
                    elif isinstance(value, FlatPiece):
                        # A copy onto itself, unless DeepSpeed handed out a copy (an offloaded
                        # partition moved to the device): then this is where the value lands.
                        _utils().safe_set_local_optimizer_state(param, _padded(param, value), key)
                    else:
                        slot[key] = value.clone() if torch.is_tensor(value) else value
                mapping = getattr(param, "_hp_mapping", None)
                if mapping is not None:  # stages 1-2: point the param at the new state tensors
                    mapping.set_optim_state_fragment(flat, slot)
                for key in full:
                    value = saved[key].to(device=flat.device, dtype=flat.dtype)
                    _set_full(param, value, key)
        if self.engine.zero_optimization_partition_weights():  # stage 3: no links to redo
            for flat in [flat for flat in inner.state if flat not in filled]:
                del inner.state[flat]  # saved before its first step: fresh again

    # -- this rank's partitions (ZeRO-3) --------------------------------------------------------
    def _piece(self, param: torch.nn.Parameter, local: torch.Tensor | None) -> FlatPiece:
        """``local`` (a partition of ``param``'s size, padded) as the range this rank holds."""
        if local is None:  # no master (a frozen parameter): the partition the module uses
            local = param.ds_tensor
        size, numel = local.numel(), param.ds_numel
        start = size * dist.get_rank(group=param.ds_process_group)
        return FlatPiece(shape=_full_shape(param), start=start,
                         flat=local.detach().view(-1)[:max(0, min(size, numel - start))])

    def local_weights(self, device: torch.device) -> dict[str, torch.Tensor | FlatPiece]:
        """Buffers whole, and this rank's range of each fp32 master (collective)."""
        state: dict[str, torch.Tensor | FlatPiece] = dict(self.engine.module.state_dict())
        pieces = {name: self._piece(param, _utils().safe_get_local_fp32_param(param))
                  for name, param in self.params.items()}
        exchange_tails(list(pieces.values()), device)
        return {**state, **pieces}

    def local_optimizer_state(self, device: torch.device, *, create: bool) -> dict[str, Any]:
        """Optimizer state by name with this rank's range of each per-element tensor
        (collective). ``create``: an optimizer that has not stepped gets zero state first."""
        if create:
            self._create_state()
        pieces: list[FlatPiece] = []

        def piece(param: torch.nn.Parameter, key: str) -> FlatPiece:
            pieces.append(self._piece(param, _utils().safe_get_local_optimizer_state(param, key)))
            return pieces[-1]

        state = self._optimizer_state(piece)
        exchange_tails(pieces, device)
        return state

    def _create_state(self) -> None:
        """Make the inner optimizer's state by one step on zero gradients at learning rate 0,
        as ``torch.distributed.checkpoint.state_dict`` does for a fresh optimizer."""
        inner = self._inner
        if inner.state:
            return
        flats = [flat for group in inner.param_groups for flat in group["params"]]
        rates = [group.get("lr") for group in inner.param_groups]
        for flat in flats:
            flat.grad = torch.zeros_like(flat)
        for group in inner.param_groups:
            if "lr" in group:
                group["lr"] = 0.0
        inner.step()
        for group, rate in zip(inner.param_groups, rates, strict=True):
            if rate is not None:
                group["lr"] = rate
        for flat in flats:
            flat.grad = None

    def load_local_weights(self, state: dict[str, Any]) -> None:
        """Finish a load of ``local_weights``' output, whose ranges DCP read in place."""
        with torch.no_grad():
            for name, param in self.params.items():
                if param.requires_grad:  # it has a master (a frozen one was read in place)
                    _utils().safe_set_local_fp32_param(param, _padded(param, state[name]))
            for name, buffer in self.engine.module.named_buffers():
                buffer.copy_(state[name])
            self._refresh_partitions()

    def _refresh_partitions(self) -> None:
        """ZeRO-3, after the masters changed: copy them into the partitions the forward
        gathers, and gather again the small parameters ZeRO-3 keeps whole between steps
        (``stage3_param_persistence_threshold``), which would otherwise keep their old values
        for the next forward, as DeepSpeed does after loading its own checkpoints."""
        opt = self.engine.optimizer
        opt.checkpoint_event_prologue()  # releases the gathered ones, partitions untouched
        for sub_group in range(len(opt.fp16_groups)):
            opt._reassign_or_swap_out_partitioned_parameters(sub_group)
        opt.checkpoint_event_epilogue()


def _padded(param: torch.nn.Parameter, piece: FlatPiece) -> torch.Tensor:
    """``piece``'s range with the zeros DeepSpeed pads the last partition with."""
    return F.pad(piece.flat, (0, param.ds_tensor.numel() - piece.flat.numel()))


def loss_scaler_of(optimizer: Any) -> Any:
    """DeepSpeed's fp16 loss-scale state: ``loss_scaler`` in ZeRO, ``loss_scale_config`` in the
    stage-0 fp16 optimizer (both have ``cur_scale``, ``cur_iter``, ``last_overflow_iter``)."""
    for name in ("loss_scaler", "loss_scale_config"):
        scaler = getattr(optimizer, name, None)
        if scaler is not None and hasattr(scaler, "cur_scale"):
            return scaler
    return None


def _dynamic(loss_scaler: Any) -> bool:
    return bool(getattr(loss_scaler, "dynamic", getattr(loss_scaler, "dynamic_loss_scale", False)))


def _last_overflow(loss_scaler: Any) -> int:
    value = getattr(loss_scaler, "last_overflow_iter", None)
    return -1 if value is None else int(value)


def scaler_state(loss_scaler: Any) -> LossScaleState:
    """Where DeepSpeed's fp16 loss scaler stands, in mpt's terms.

    mpt counts clean steps since the last growth or overflow; DeepSpeed counts iterations since
    the last overflow and grows every ``scale_window``.
    """
    window = int(getattr(loss_scaler, "scale_window", 1) or 1)
    clean = int(loss_scaler.cur_iter) - _last_overflow(loss_scaler) - 1
    return LossScaleState(scale=float(loss_scaler.cur_scale),
                          clean_steps=clean % window if _dynamic(loss_scaler) else 0)


def apply_scaler_state(loss_scaler: Any, state: LossScaleState) -> None:
    """Set DeepSpeed's loss scaler to ``state`` (inverse of ``scaler_state``)."""
    loss_scaler.cur_scale = state.scale
    if _dynamic(loss_scaler):
        loss_scaler.last_overflow_iter = int(loss_scaler.cur_iter) - 1 - state.clean_steps
