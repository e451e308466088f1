"""DeepSpeed's universal checkpoint layout: written from an mpt checkpoint, and read.

DeepSpeed's own ``ds_to_universal.py`` turns a ZeRO checkpoint into this layout, which its
engine loads at any world size and ZeRO stage 1-3 (``"checkpoint": {"load_universal":
true}``): each trainable parameter whole, in a folder of its own, the optimizer's
hyper-parameters beside them, the engine's model-states file above::

    latest, latest_universal                  the tag, e.g. global_step3
    global_step3/mp_rank_00_model_states.pt   module (every weight), param_shapes (each
                                              param group's parameters), lr_scheduler,
                                              global_steps, ... and the script's client_state
    global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt
                                              the same but module and optimizer (ZeRO-3's)
    global_step3/zero/optimizer_state.pt      ds_version, param_groups (lr, betas, ...), and
                                              for ZeRO-3 optimizer_state_dict (the step)
    global_step3/zero/<name>/fp32.pt          {"param": the fp32 weight}
    global_step3/zero/<name>/exp_avg.pt       {"param": ...}, one file per per-element moment
    global_step3/zero/<name>/step.pt          the step count (a tensor, as torch keeps it)

A universal load (``load_hp_checkpoint_state`` in DeepSpeed's ``universal_checkpoint.py``, and
ZeRO-3's own in ``stage3.py``) reads a parameter's ``<key>.pt`` files and gives this rank's
slice of each to its flat partition; the groups' keys but ``params`` replace the live groups'
(at ZeRO-3, the first group's replace every group's). It restores no module state: buffers and
frozen parameters are only in the model-states file's ``module``. Without ZeRO DeepSpeed reads
no ``zero/`` folder: its ordinary load takes ``module`` and the torch optimizer's numbered
state under ``optimizer`` from the model-states file, which ``write`` fills too (so the
weights and moments are written twice).

Every file is a ``torch.save`` of tensors, numbers, strings and plain containers: nothing of
DeepSpeed's own classes, so DeepSpeed need not be installed to write it, and its loss scaler
(pickled as an object of its class) is not written (``said`` tells how to start from it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mpt.checkpoint.foreign import torchload
from mpt.errors import UsageError
from mpt.state.named import from_named

if TYPE_CHECKING:
    from mpt.checkpoint.foreign.export import Run

MODEL_STATES = "mp_rank_00_model_states.pt"
MODEL_STATES_ZERO3 = "zero_pp_rank_0_mp_rank_00_model_states.pt"
ZERO = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
LATEST = ("latest", "latest_universal")
"""The files naming the tag: ``latest`` for an ordinary load, ``latest_universal`` for a
universal one."""
DS_VERSION = "0.19.8"
"""The DeepSpeed whose layout this writes (its ZeRO load refuses a file without a version)."""
ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "ds_config", "ds_version", "checkpoint_parallel_dimensions",
    "ds_checkpoint_version", "mp_rank", "universal_checkpoint_info"})
"""What DeepSpeed's engine writes into a model-states file; the rest is the script's
``client_state``."""
NOT_WRITTEN = ("the data loader's position", "the RNG states")
"""What an mpt checkpoint holds and a DeepSpeed checkpoint has no place for."""


def tag(run: Run) -> str:
    """The tag folder's name: DeepSpeed's default, ``global_step<N>``."""
    return f"global_step{run.step}"


def write(run: Run, root: Path, tag: str) -> None:
    """Write ``run`` as a DeepSpeed checkpoint directory ``root`` (created here) of tag
    ``tag``."""
    folder = root / tag
    folder.mkdir(parents=True)
    groups = _groups(run)
    steps = []
    if run.optimizer is not None:  # without one, a universal load has nothing to read
        for names in groups:
            for name, files in _parameter_files(run, names).items():
                (folder / ZERO / name).mkdir(parents=True)
                for key, value in files.items():
                    torch.save(value, folder / ZERO / name / f"{key}.pt")
                steps += [files["step"]] if "step" in files else []
        param_groups = [
            {**{k: v for k, v in group.items() if k not in ("params", "param_names")},
             "params": [index]} for index, group in enumerate(run.optimizer["param_groups"])]
        torch.save({"ds_version": DS_VERSION, "param_groups": param_groups,
                    # where ZeRO-3 looks: its step, and the first group's hyper-parameters
                    **({"optimizer_state_dict": {"state": {0: {"step": steps[0]}},
                                                 "param_groups": param_groups}} if steps else {})},
                   folder / ZERO / OPTIMIZER_STATE)
    trainable = {name for names in groups for name in names}
    states = {
        "module": run.weights,
        "buffer_names": [name for name in run.weights if name not in trainable],
        "optimizer": None if run.optimizer is None else from_named(run.optimizer, run.order()),
        "param_shapes": [{name: run.weights[name].shape for name in names} for names in groups],
        "lr_scheduler": run.scheduler, "global_steps": run.step,
        "skipped_steps": run.skipped_steps, "dp_world_size": run.world_size, "mp_world_size": 1,
        "ds_version": DS_VERSION, **client_state(run)}
    torch.save(states, folder / MODEL_STATES)
    if run.optimizer is not None:  # ZeRO-3 reads its rank 0's file: no weights needed there
        torch.save({k: v for k, v in states.items() if k not in ("module", "optimizer")},
                   folder / MODEL_STATES_ZERO3)
    for name in LATEST:
        (root / name).write_text(tag)


def client_state(run: Run) -> dict[str, Any]:
    """What ``engine.load_checkpoint`` returns as the script's ``client_state``: what
    ``rt.load`` returns (``step``, ``epoch`` where saved, the extras), and ``loss_scale``
    where the run scaled its loss."""
    state = {"step": run.step, **({} if run.epoch is None else {"epoch": run.epoch}),
             **{k: v for k, v in run.extra.items() if k not in ENGINE_KEYS}}
    if run.scaler is not None:
        state["loss_scale"] = float(run.scaler["scale"])
    return state


def said(run: Run, dst: Path, tag: str) -> str:
    """Two lines: what was written, and what it does not carry."""
    held = ["weights"] + (["optimizer"] if run.optimizer is not None else []) + (
        ["LR scheduler"] if run.scheduler is not None else [])
    load = ('engine.load_checkpoint(dir, tag) with "checkpoint": {"load_universal": true} at '
            'ZeRO 1-3, without it and without ZeRO' if run.optimizer is not None else
            "engine.load_checkpoint(dir, tag, load_module_only=True): it holds no optimizer")
    lost = list(NOT_WRITTEN)
    dropped = sorted(k for k in run.extra if k in ENGINE_KEYS)
    if dropped:
        lost.append(f"the extras {', '.join(dropped)} (DeepSpeed's own names)")
    if run.scaler is not None:
        scale = float(run.scaler["scale"])
        power = f'; start it with "fp16": {{"initial_scale_power": {int(math.log2(scale))}}}' \
            if scale > 0 and math.log2(scale).is_integer() else ""
        lost.append(f"the loss scaler (DeepSpeed keeps an object of its own class; the scale, "
                    f"{scale:g}, is in client_state['loss_scale']{power})")
    trainable = set(run.order()) if run.optimizer is not None else set(run.weights)
    buffers = [name for name in run.weights if name not in trainable]
    if buffers:
        lost.append(f"{', '.join(buffers[:3])}{', ...' if len(buffers) > 3 else ''} under a "
                    f"universal load ({len(buffers)} tensors outside the optimizer, which it "
                    "does not restore: take them from the model-states file's 'module')")
    return (f"wrote {dst} (deepspeed, universal layout, tag {tag}): {', '.join(held)}; "
            f"step {run.step}; load it with {load}\n"
            f"not in it (the DeepSpeed run takes them from its own seed and start): "
            f"{', '.join(lost)}")


def _groups(run: Run) -> list[list[str]]:
    """Each param group's parameter names; one group of every floating-point weight where
    the checkpoint holds no optimizer. Names the model lacks are refused."""
    if run.optimizer is None:
        return [[name for name, t in run.weights.items() if t.is_floating_point()]]
    groups = [list(group["params"]) for group in run.optimizer["param_groups"]]
    unknown = [name for names in groups for name in names if name not in run.weights]
    if unknown:
        raise UsageError("SRC", run.location, f"its optimizer names parameters its model lacks: "
                         f"{', '.join(unknown[:3])}", "export a checkpoint rt.save wrote")
    return groups


def _parameter_files(run: Run, names: list[str]) -> dict[str, dict[str, Any]]:
    """One param group's files, by parameter: ``fp32``, each per-element moment and ``step``.
    DeepSpeed keeps one flat state per group: its parameters' steps must agree, and one
    without state (it never had a gradient) takes zero moments, as in DeepSpeed's flat
    partition."""
    state = {} if run.optimizer is None else run.optimizer["state"]
    keys: set[str] = set()
    steps = {}
    for name in names:
        for key, value in state.get(name, {}).items():
            if key == "step":
                steps[name] = value
            elif isinstance(value, torch.Tensor) and value.shape == run.weights[name].shape:
                keys.add(key)
            else:
                raise UsageError("SRC", run.location, f"its optimizer keeps {key!r} of {name} "
                                 f"({_kind(value)}), not one value per element",
                                 "export --to torch or dcp (DeepSpeed's flat ZeRO state holds "
                                 "per-element moments and a step only)")
    counts = {float(step) for step in steps.values()}
    if len(counts) > 1:
        raise UsageError("SRC", run.location, f"its parameters {', '.join(names[:3])} have "
                         f"taken different numbers of steps ({', '.join(map(str, counts))}), "
                         "and DeepSpeed keeps one count per param group",
                         "export --to torch or dcp")
    step = next(iter(steps.values()), None)
    files = {}
    for name in names:
        weight = run.weights[name]
        held = state.get(name, {})
        files[name] = {"fp32": {"param": weight.detach().to(torch.float32, copy=True)}, **{
            key: {"param": held[key].detach().clone() if key in held else torch.zeros(
                weight.shape, dtype=torch.float32)} for key in sorted(keys)}}
        if step is not None:
            files[name]["step"] = step.detach().clone() if isinstance(step, torch.Tensor) \
                else step
    return files


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def holds(folder: Path) -> bool:
    """Whether the tag folder ``folder`` is in the universal layout."""
    return (folder / ZERO / OPTIMIZER_STATE).is_file()


def merge(folder: Path, states: dict[str, Any], *, moments: bool = True
          ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, Any]:
    """The fp32 weights by name, the optimizer state by name (``mpt.state.named``'s form,
    DeepSpeed's param-group entries as they are; None unless ``moments``) and the loss scaler
    of the universal tag folder ``folder``, whose model-states file holds ``states``; one
    parameter's folder read at a time."""
    shapes = states.get("param_shapes") or []
    saved = torchload.load(folder / ZERO / OPTIMIZER_STATE, deepspeed=True)
    groups = saved.get("param_groups") or []
    members = [list(group) for group in shapes]
    if len(groups) == 1:  # ZeRO-3 may split one param group into sub-groups
        members = [[name for names in members for name in names]]
    if len(groups) != len(members):
        raise UsageError("SRC", folder / ZERO / OPTIMIZER_STATE, f"it has {len(groups)} param "
                         f"groups and the model-states file lists {len(shapes)}", "convert a "
                         "tag folder written by one save")
    masters: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for group in shapes:
        for name, shape in group.items():
            where = folder / ZERO / name
            if not (where / "fp32.pt").is_file():
                raise UsageError("SRC", where, "the parameter's fp32.pt is missing",
                                 "convert a complete universal checkpoint")
            masters[name] = _tensor(where / "fp32.pt", shape)
            if not moments:
                continue
            state[name] = {}
            for path in sorted(where.glob("*.pt")):
                if path.stem == "step":
                    state[name]["step"] = torchload.load(path, deepspeed=True)
                elif path.stem != "fp32":
                    state[name][path.stem] = _tensor(path, shape)
    step = ((saved.get("optimizer_state_dict") or {}).get("state") or {}).get(0, {}).get("step")
    if step is not None:  # ZeRO-3's conversion keeps one step for all, there alone
        for entry in state.values():
            entry.setdefault("step", step)
    named = {"state": state, "param_groups": [
        {**group, "params": names} for group, names in zip(groups, members, strict=True)]}
    return masters, named if moments else None, saved.get("loss_scaler")


def _tensor(path: Path, shape: Any) -> torch.Tensor:
    """The whole tensor a parameter's ``<key>.pt`` holds (``{"param": tensor}``, or the
    tensor flat), checked against its shape."""
    saved = torchload.load(path, deepspeed=True)
    tensor = saved.get("param") if isinstance(saved, dict) else saved  # ZeRO-3's: flat, bare
    if not isinstance(tensor, torch.Tensor) or tensor.numel() != math.prod(shape):
        raise UsageError("SRC", path, f"it holds no tensor of the parameter's shape "
                         f"{tuple(shape)}", "convert a universal checkpoint of one tensor-"
                         "parallel degree (ds_to_universal.py's output, unchanged)")
    return tensor.reshape(shape)
