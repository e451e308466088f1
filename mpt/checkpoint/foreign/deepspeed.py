"""A DeepSpeed checkpoint directory (``engine.save_checkpoint``): its whole training state.

The tag folder (``latest`` names it) holds the engine's ``*model_states.pt`` (weights as the
module held them, parameter shapes, LR scheduler, ``client_state``) and, under ZeRO, one
``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank: that rank's flat
partition of the fp32 master weights and of each optimizer moment. Those partitions are put
back together parameter by parameter (``mpt.checkpoint.foreign.zero``), reading one rank's
file at a time. Any stage (0-3), any world size, fp32 or bf16 (fp16 where DeepSpeed's scaler is
dynamic; its fused stage-0 optimizer is not read). Pipeline and tensor parallel checkpoints are
refused. A tag folder in DeepSpeed's universal layout (``ds_to_universal.py``'s, or mpt's
``--to deepspeed``; ``latest_universal`` names it) is read parameter by parameter
(``mpt.checkpoint.foreign.universal``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from mpt.checkpoint.foreign import optimizer as optim
from mpt.checkpoint.foreign import torchload, universal, zero
from mpt.checkpoint.foreign.imported import NEVER_HELD, Imported, as_int
from mpt.checkpoint.io import STEP_PREFIX
from mpt.errors import UsageError
from mpt.precision import LossScaleState


def is_deepspeed(src: Path) -> bool:
    """Whether ``src`` looks like what ``engine.save_checkpoint`` writes: a ``latest`` file or
    a tag folder holding ``*_model_states.pt``. An mpt root has a ``latest`` too, naming one of
    its ``step-N`` folders: not DeepSpeed's, even with that folder gone."""
    latest = src / "latest"
    if latest.is_file():
        return not latest.read_text().strip().startswith(STEP_PREFIX)
    return any(src.glob("*_model_states.pt")) or any(src.glob("*/*_model_states.pt"))


def read(src: Path, tag: str | None = None, *, optimizer: bool = True) -> Imported:
    """The training state of tag ``tag`` (default: the one ``latest`` names) of ``src`` (its
    optimizer's where ``optimizer``; the fp32 masters are read in any case)."""
    folder, tag = _tag_folder(src, tag)
    states = torchload.load(_engine_file(folder), deepspeed=True)
    _refuse_model_parallel(folder, states)
    world = int(states.get("dp_world_size") or 1)
    optim_files = _rank_files(folder, world)
    buffers = {name: states["module"][name] for name in states.get("buffer_names") or []}
    layout = _stage(states)
    if optim_files:
        trainable, named, loss_scaler = zero.merge(optim_files, states["param_shapes"], world,
                                                   moments=optimizer)
        frozen = _frozen(folder, states, world)
    elif universal.holds(folder):
        trainable, named, loss_scaler = universal.merge(folder, states, moments=optimizer)
        frozen, layout = {}, "universal checkpoint"
    else:
        trainable, named, loss_scaler = _stage0(folder, states, list(buffers), optimizer)
        frozen = {}
    kind = None
    if named is not None:
        named = _with_adam_mode(named, states.get("ds_config") or {})
        named, kind = optim.as_torch(named, str(folder))
        optim.check_shapes(named, {name: t.shape for name, t in trainable.items()},
                           str(folder))
    client = {k: v for k, v in states.items() if k not in universal.ENGINE_KEYS}
    step = as_int(client.pop("step", None))
    if step is None:
        step = states.get("global_steps") or _tag_step(tag)
    epoch = as_int(client.pop("epoch", None))
    scale = _loss_scale(loss_scaler)
    return Imported(
        source=f"DeepSpeed {layout}, {world} rank(s)",
        weights={**trainable, **frozen, **buffers}, optimizer=named, optimizer_kind=kind,
        scheduler=states.get("lr_scheduler"), loss_scale=scale,
        precision=_precision(states.get("ds_config") or {}), step=step, epoch=epoch,
        world_size=world,
        extra={k: v for k, v in client.items() if isinstance(v, int | float | str | bool)},
        lacks=[*NEVER_HELD, *(["the loss scaler's count of clean steps (its scale comes in)"]
                             if scale is not None else [])])


def _tag_folder(src: Path, tag: str | None) -> tuple[Path, str]:
    """The tag folder to read and its name; refused with the tags there are."""
    tags = sorted(p.parent.name for p in src.glob("*/*model_states.pt"))
    if tag is None:
        latest = next((src / name for name in universal.LATEST if (src / name).is_file()), None)
        if latest is None:
            raise UsageError("SRC", src, f"it has no 'latest' file naming the tag to read (its "
                             f"tags: {', '.join(tags) or 'none'})", "pass --tag TAG")
        tag = latest.read_text().strip()
    folder = src / tag
    if not any(folder.glob("*model_states.pt")):
        raise UsageError("SRC", src, f"tag {tag!r} has no model states "
                         f"({folder} is missing or incomplete; its tags: "
                         f"{', '.join(tags) or 'none'})", "pass --tag with one of its tags")
    return folder, tag


def _engine_file(folder: Path) -> Path:
    """The engine's model-states file of data-parallel rank 0 (ZeRO-3 writes one per rank)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (folder / name).is_file():
            return folder / name
    return sorted(folder.glob("*model_states.pt"))[0]  # refused below as a layout not read


def _refuse_model_parallel(folder: Path, states: dict[str, Any]) -> None:
    dims = states.get("checkpoint_parallel_dimensions") or {}
    degrees = {"tensor": int(states.get("mp_world_size") or 1),
               "pipeline": int(dims.get("pp_degree") or 1)}
    split = [f"{kind} parallel degree {n}" for kind, n in degrees.items() if n > 1]
    if any(folder.glob("layer_*-model_states.pt")):
        split.append("pipeline stages")
    if split:
        raise UsageError("SRC", folder, f"it was saved with {', '.join(split)}, which this "
                         "conversion does not merge", "save it from a data-parallel run")


def _rank_files(folder: Path, world: int) -> list[Path]:
    """Each data-parallel rank's optimizer file, by rank (none at stage 0); one missing is
    named."""
    found = sorted(folder.glob("*zero_pp_rank_*_optim_states.pt"))
    if not found:
        return []
    prefix = found[0].name.split("zero_pp_rank_")[0]  # "bf16_" from the bf16 optimizer
    files = [folder / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
             for r in range(world)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UsageError("SRC", folder, f"it was saved by {world} ranks and "
                         f"{', '.join(missing)} is missing", "copy every rank's file of the tag "
                         "folder, or convert another tag")
    return files


def _stage0(folder: Path, states: dict[str, Any], buffers: list[str], optimizer: bool
            ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, Any]:
    """Weights, named optimizer state (where ``optimizer``) and loss scaler of a checkpoint
    without ZeRO: the optimizer's numbered state sits in the model-states file."""
    module = states["module"]
    names = [name for name in module if name not in buffers]
    saved = states.get("optimizer")
    if saved is None and not optimizer:
        return {name: module[name] for name in names}, None, None
    if saved is None:
        raise UsageError("SRC", folder, "it holds no optimizer state", "convert with "
                         "--weights-only")
    if "fp32_groups_flat" in saved:
        raise UsageError("SRC", folder, "its fp16 optimizer keeps flat fp32 groups, which this "
                         "conversion does not read", "save it again from DeepSpeed with bf16 or "
                         "ZeRO, or take its fp32 weights with DeepSpeed's zero_to_fp32")
    inner = saved.get("optimizer_state_dict", saved)  # bf16/fp16: a wrapper around torch's
    optim.in_model_order(inner.get("param_groups") or [], str(folder))
    named = optim.named_from_numbered(inner, names, str(folder))
    order = [name for group in named["param_groups"] for name in group["params"]]
    weights = {name: module[name] for name in names}
    if "fp32_groups" in saved:  # the masters, a list per group in the optimizer's order
        masters = [t for group in saved["fp32_groups"] for t in group]
        weights = {name: master for name, master in zip(order, masters, strict=True)}
    scaler = saved if "cur_scale" in saved else None
    return weights, named if optimizer else None, scaler


def _frozen(folder: Path, states: dict[str, Any], world: int) -> dict[str, torch.Tensor]:
    """Parameters the optimizer does not hold: whole in the module below ZeRO-3, in pieces
    in each rank's model-states file at ZeRO-3."""
    shapes = states.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    if not states.get("frozen_param_fragments"):
        return {name: states["module"][name] for name in shapes}
    pieces: dict[str, list[torch.Tensor]] = {name: [] for name in shapes}
    for rank in range(world):
        path = folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        fragments = torchload.load(path, deepspeed=True)["frozen_param_fragments"]
        for name in shapes:
            pieces[name].append(fragments[name].flatten())
    return {name: torch.cat(pieces[name])[:math.prod(shape)].view(shape).clone()
            for name, shape in shapes.items()}


def _with_adam_mode(named: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """``named`` with ``adam_w_mode`` in the groups of DeepSpeed's own Adam (FusedAdam,
    DeepSpeedCPUAdam: groups with ``bias_correction``), which keeps it out of its groups: the
    config's, where DeepSpeed's default is decoupled weight decay, for ``Adam`` too."""
    settings = config.get("optimizer") if isinstance(config.get("optimizer"), dict) else {}
    if str(settings.get("type", "")).lower() not in ("adam", "adamw"):
        return named
    params = settings.get("params") or {}
    decoupled = settings["type"].lower() == "adamw" or bool(params.get("adam_w_mode", True))
    groups = [{**group, "adam_w_mode": decoupled} if "bias_correction" in group else group
              for group in named["param_groups"]]
    return {**named, "param_groups": groups}


def _stage(states: dict[str, Any]) -> str:
    """The ZeRO stage the run's config names, in words."""
    zero_config = (states.get("ds_config") or {}).get("zero_optimization") or {}
    stage = int(zero_config.get("stage", 0)) if isinstance(zero_config, dict) else 0
    return f"ZeRO-{stage}" if stage else "without ZeRO"


def _precision(config: dict[str, Any]) -> str:
    for key, name in (("bf16", "bf16-mixed"), ("bfloat16", "bf16-mixed"),
                      ("fp16", "fp16-mixed")):
        if isinstance(config.get(key), dict) and config[key].get("enabled"):
            return name
    return "fp32"


def _loss_scale(scaler: Any) -> LossScaleState | None:
    """The scale DeepSpeed's loss scaler stood at (None where it does not scale). Its count of
    clean steps towards the next growth starts afresh: DeepSpeed counts them otherwise
    (iterations since the last overflow), and the translation lives with its backend."""
    if scaler is None:
        return None
    fields = scaler if isinstance(scaler, dict) else vars(scaler)  # stage 0 keeps them inline
    dynamic = bool(fields.get("dynamic", fields.get("dynamic_loss_scale", False)))
    scale = float(fields.get("cur_scale", 1.0))
    return LossScaleState(scale=scale) if dynamic or scale != 1.0 else None


def _tag_step(tag: str) -> int | None:
    match = re.fullmatch(r"global_step(\d+)", tag)
    return None if match is None else int(match.group(1))
