"""The DeepSpeed config mpt builds: the user's config first; mpt fills only what it leaves out.

Pure dict work, no ``import deepspeed``: `mpt launch` validates the options with it before any
process starts (and on a machine where DeepSpeed is not installed yet), so every conflict is one
``UsageError`` instead of an assertion deep inside ``deepspeed.initialize`` on every rank.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mpt.comm import GradComm
from mpt.errors import UsageError
from mpt.precision import LossScaleConfig, PrecisionSpec, describe

ZERO_STAGES = (0, 1, 2, 3)
DEFAULT_STAGE = 1
"""The stage where neither ``--zero-stage`` nor the config chooses one: stage 1 trains the same
numbers as stage 0 (in fp32; closer to ddp's in bf16), shards the optimizer's state, and is the
one stage that keeps several models' gradients apart (a GAN's), so a user need not know that."""
OFFLOAD_TARGETS = ("optimizer", "parameters")
"""What ``--offload`` may move to CPU memory: optimizer state (ZeRO 1-3), parameters (ZeRO 3)."""

KNOWN_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients",
    "gradient_predivide_factor", "gradient_clipping", "sparse_gradients",
    "communication_data_type", "seq_parallel_communication_data_type", "fp16", "bf16",
    "bfloat16", "amp", "torch_autocast", "zero_optimization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "optimizer", "scheduler", "activation_checkpointing",
    "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
    "aio", "elasticity", "autotuning", "checkpoint", "data_types", "data_efficiency",
    "curriculum_learning", "compression_training", "pipeline", "monitor_config",
    "memory_breakdown", "disable_allgather", "sparse_attention", "eigenvalue",
    "progressive_layer_drop", "quantize_training", "zero_quantized_weights",
    "zero_quantized_gradients", "zero_quantized_nontrainable_weights", "nebula",
    "tensor_parallel", "compile", "hybrid_engine", "weight_quantization", "dataloader_drop_last",
    "use_node_local_storage", "load_universal_checkpoint", "graph_harvesting",
    "timers", "zenflow", "managed_gradient_accumulation", "use_data_before_expert_parallelism",
    "expert_parallel", "mics_shard_size", "mics_hierarchical_params_gather",
})
"""Top-level keys DeepSpeed 0.19 reads. DeepSpeed ignores any other key without a word, so a
typo such as ``"gradient_cliping"`` would silently train without clipping: mpt refuses it."""


def parse_stage(value: object) -> int:
    """``--zero-stage``: 0, 1, 2 or 3."""
    try:
        stage = int(str(value))
    except ValueError:
        stage = -1
    if stage not in ZERO_STAGES:
        raise UsageError("--zero-stage", value, "DeepSpeed ZeRO has stages 0, 1, 2 and 3",
                         "pass --zero-stage 2 (shards optimizer state and gradients), or 3 to "
                         "shard parameters too")
    return stage


def parse_offload(value: object) -> frozenset[str]:
    """``--offload``: ``none``, ``optimizer``, ``parameters`` or ``optimizer,parameters``."""
    items = {part.strip() for part in str(value).split(",") if part.strip()}
    if items == {"none"}:
        return frozenset()
    if not items or not items <= set(OFFLOAD_TARGETS):
        raise UsageError("--offload", value, "it names nothing DeepSpeed can offload",
                         "pass none, optimizer, parameters or optimizer,parameters")
    return frozenset(items)


def load_user_config(value: object) -> dict[str, Any]:
    """The user's DeepSpeed config: a dict, or the path of a JSON file; unknown keys refused."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        config = dict(value)
    else:
        path = Path(str(value))
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError("--deepspeed-config", path, f"it cannot be read ({exc.strerror})",
                             "pass the path of a DeepSpeed JSON config file") from None
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError("--deepspeed-config", path, f"it is not valid JSON (line {exc.lineno}"
                             f", column {exc.colno}: {exc.msg})", "fix the file; DeepSpeed configs "
                             "are plain JSON objects") from None
        if not isinstance(config, dict):
            raise UsageError("--deepspeed-config", path, "it holds no JSON object",
                             'write the config as {"key": value, ...}')
    for key in config:
        if key not in KNOWN_KEYS:
            close = difflib.get_close_matches(key, sorted(KNOWN_KEYS), n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see DeepSpeed's config reference"
            raise UsageError("DeepSpeed config key", key, "DeepSpeed 0.19 has no such key and "
                             "would ignore it", f"{hint} Remove or rename it")
    for key in ("optimizer", "scheduler"):
        if key in config:
            raise UsageError("DeepSpeed config key", key, "mpt hands DeepSpeed your torch "
                             "optimizer from rt.setup(model, optimizer), and DeepSpeed refuses "
                             f"a config {key} next to it", f"remove {key!r} from the config and "
                             "build the optimizer (and scheduler) in the script")
    modes = {mode for key, mode in _SECTIONS.items() if _enabled(config, key)}
    if len(modes) > 1:  # no --precision could then be accepted: every hint would loop
        raise UsageError("DeepSpeed config key", "fp16", "the config enables bf16 as well, and "
                         "DeepSpeed trains in one of the two", 'set "enabled": false in one of '
                         "the two sections, or drop it")
    return config


def chosen_stage(user: Mapping[str, Any], stage: int | None) -> int | None:
    """The stage ``--zero-stage`` or the config chose; None where neither did."""
    zero = user.get("zero_optimization", {})
    user_stage = zero.get("stage") if isinstance(zero, Mapping) else None
    return stage if stage is not None or user_stage is None else parse_stage(user_stage)


def check_stage_and_offload(user: Mapping[str, Any], stage: int | None,
                            offload: frozenset[str]) -> int:
    """The ZeRO stage the run uses; flags that contradict the config or each other are refused."""
    zero = user.get("zero_optimization", {})
    user_stage = zero.get("stage") if isinstance(zero, Mapping) else None
    if stage is not None and user_stage is not None and int(user_stage) != stage:
        raise UsageError("--zero-stage", stage, f"the DeepSpeed config sets stage {user_stage}",
                         "drop one of the two, or make them agree")
    final = chosen_stage(user, stage)
    final = DEFAULT_STAGE if final is None else final
    if "optimizer" in offload and final == 0:
        raise UsageError("--offload", "optimizer", "ZeRO stage 0 keeps no optimizer state of "
                         "its own to offload", "pass --zero-stage 1, 2 or 3 with it")
    if "parameters" in offload and final != 3:
        raise UsageError("--offload", "parameters", f"only ZeRO stage 3 partitions parameters "
                         f"(stage is {final})", "pass --zero-stage 3, or --offload optimizer")
    return final


def _section(config: dict[str, Any], key: str) -> dict[str, Any]:
    value = config.get(key)
    if value is None:
        value = config[key] = {}
    if not isinstance(value, dict):
        raise UsageError("DeepSpeed config key", key, "it must be a JSON object",
                         f'write "{key}": {{...}}')
    return value


def _enabled(config: Mapping[str, Any], key: str) -> bool:
    section = config.get(key)
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


MODES = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""DeepSpeed's precision modes (config sections) by the compute dtype they give. Each casts the
model and steps fp32 master weights inside the engine."""

_MIXED = {"fp16": "fp16-mixed", "bf16": "bf16-mixed"}
_SECTIONS = {"fp16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}
"""A config's precision sections, by the mode each turns on (bfloat16: bf16's older name)."""


def config_mode(config: Mapping[str, Any]) -> str | None:
    """The precision mode a DeepSpeed config enables (``fp16``, ``bf16``), None if neither."""
    return next((mode for key, mode in _SECTIONS.items() if _enabled(config, key)), None)


def mode_of(spec: PrecisionSpec) -> str | None:
    """The DeepSpeed mode that trains ``spec``: the one of its compute dtype (None: fp32)."""
    return next((mode for mode, dtype in MODES.items() if spec.compute == dtype), None)


def _conflict(user: Mapping[str, Any], spec: PrecisionSpec, device_type: str) -> str | None:
    """Why DeepSpeed cannot train ``spec`` with the config ``user`` on ``device_type``; None
    where it can."""
    mode = mode_of(spec)
    if spec.params != torch.float32:
        return (f"casts the model and keeps fp32 master weights itself, in its {mode} mode: "
                f"mpt's {spec.name} cast would hide them from its optimizer")
    if mode == "fp16" and device_type == "cpu":  # DeepSpeed's CPU accelerator refuses fp16
        return "has no fp16 on CPU"
    for key, which in _SECTIONS.items():
        section = user.get(key)
        if isinstance(section, Mapping) and "enabled" in section:
            on = bool(section["enabled"])
            if on != (mode == which):
                return (f"is given a DeepSpeed config that {'enables' if on else 'disables'} "
                        f"{key}")
    return None


def _default_name(user: Mapping[str, Any]) -> str:
    """The precision a run gets when ``--precision`` is left out (the config's mode, else fp32);
    ``DeepSpeedBackend.default_precision`` says the same to the launcher."""
    mode = config_mode(user)
    return "fp32" if mode is None else _MIXED[mode]


def _fixes(user: Mapping[str, Any], spec: PrecisionSpec, device_type: str) -> list[str]:
    """What the user can change so that the run is accepted, each alternative checked here to
    be accepted as it is (a hint never leads to a second refusal)."""
    def accepted(config: Mapping[str, Any], name: str, device: str) -> bool:
        return _conflict(config, describe(name), device) is None

    modes = [config_mode(user), mode_of(spec), "bf16"]  # the config's first, then the flag's
    names = [*(_MIXED[mode] for mode in modes if mode is not None), "fp32"]
    names = [n for i, n in enumerate(names) if n not in names[:i] and n != spec.name]
    fixes = []
    name = next((n for n in names if accepted(user, n, device_type)), None)
    if name is not None:
        left_out = " (or leave --precision out)" if name == _default_name(user) else ""
        fixes.append(f"use --precision {name}{left_out}")
    # A precision section that contradicts the flag, dropped; with another precision where the
    # device cannot run the flag's (fp16 on CPU).
    sections = [key for key in _SECTIONS if isinstance(user.get(key), Mapping)]
    for key in sections:
        without = {k: v for k, v in user.items() if k != key}
        if accepted(without, spec.name, device_type):
            fixes.append(f"drop the {key!r} section of the DeepSpeed config")
        elif name is None:
            both = next((n for n in names if accepted(without, n, device_type)), None)
            if both is not None:
                fixes.append(f"use --precision {both} and drop the {key!r} section of the "
                             "DeepSpeed config")
    if device_type == "cpu" and accepted(user, spec.name, "cuda"):
        fixes.append("run on GPUs")
    if spec.params != torch.float32:
        fixes.append(f"--backend apex for {spec.name} (without DeepSpeed's flags)")
    return fixes


def precision_refusal(user: Mapping[str, Any], spec: PrecisionSpec,
                      device_type: str) -> tuple[str, str] | None:
    """Why DeepSpeed cannot train ``spec`` (with the user's config) right, and what works: the
    alternatives joined by ", or ", each one accepted when followed alone."""
    reason = _conflict(user, spec, device_type)
    if reason is None:
        return None
    return reason, ", or ".join(_fixes(user, spec, device_type))


def _precision(config: dict[str, Any], mode: str | None, scale: LossScaleConfig) -> None:
    """Turn on DeepSpeed's ``mode`` section, with mpt's loss-scale settings where fp16."""
    if mode is not None:
        # DeepSpeed 0.19 casts the parameters to the mode's dtype but leaves the buffers as they
        # are unless told: a batchnorm's fp32 running statistics beside its bf16 weight make
        # its forward fail. Cast them too, as the module's .half()/.bfloat16() would.
        _section(config, "data_types").setdefault("buffer_dtype", mode)
    if mode == "bf16":
        _section(config, "bfloat16" if "bfloat16" in config else "bf16").setdefault("enabled",
                                                                                      True)
    elif mode == "fp16":
        fp16 = _section(config, "fp16")
        fp16.setdefault("enabled", True)
        if any(k in fp16 for k in ("loss_scale", "initial_scale_power")):
            return  # the user's loss-scale settings win as a whole
        if not scale.dynamic:
            fp16["loss_scale"] = scale.init_scale
            return
        power = math.log2(scale.init_scale)
        if (not power.is_integer() or scale.growth_factor != 2.0
                or scale.backoff_factor != 0.5):
            raise UsageError("loss_scale", scale, "DeepSpeed's dynamic loss scaler starts at a "
                             "power of two and only doubles and halves",
                             "use init_scale 2**k with growth 2 and backoff 0.5, or put an fp16 "
                             "section in the DeepSpeed config")
        fp16.setdefault("loss_scale", 0)  # 0 = dynamic
        fp16.setdefault("initial_scale_power", int(power))
        fp16.setdefault("loss_scale_window", scale.growth_interval)
        fp16.setdefault("hysteresis", 1)  # GradScaler backs off on the first overflow
        fp16.setdefault("min_loss_scale", 1)


def _batch_sizes(config: dict[str, Any], accumulate: int, world_size: int) -> None:
    """Fill ``gradient_accumulation_steps`` and the batch sizes so that they multiply out.

    mpt never sees the batch size (the script's loader has it); DeepSpeed needs one only for its
    throughput reports and its own data loader, so a micro-batch of 1 is assumed when the config
    names none.
    """
    gas = config.setdefault("gradient_accumulation_steps", accumulate)
    if gas != accumulate:
        raise UsageError("accumulate", accumulate, "the DeepSpeed config sets "
                         f"gradient_accumulation_steps={gas}", "pass the same number to "
                         "--accumulate / Runtime(accumulate=...), or drop it from the config")
    micro = config.get("train_micro_batch_size_per_gpu")
    total = config.get("train_batch_size")
    if micro is None and total is None:
        micro = 1
    if micro is None:
        micro, rest = divmod(int(total), accumulate * world_size)  # type: ignore[arg-type]
        if rest or micro < 1:
            raise UsageError("train_batch_size", total, f"it is not a multiple of "
                             f"gradient_accumulation_steps ({accumulate}) x world size "
                             f"({world_size})", "make it one, or give "
                             "train_micro_batch_size_per_gpu instead")
    if total is None:
        total = int(micro) * accumulate * world_size
    if int(total) != int(micro) * accumulate * world_size:
        raise UsageError("train_batch_size", total, f"it must equal train_micro_batch_size_per_gpu"
                         f" ({micro}) x gradient_accumulation_steps ({accumulate}) x world size "
                         f"({world_size}) = {int(micro) * accumulate * world_size}",
                         "give only one of the two batch sizes and mpt fills the other")
    config["train_micro_batch_size_per_gpu"] = int(micro)
    config["train_batch_size"] = int(total)


BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size")
"""ZeRO's bucket sizes (elements) that ``--bucket-mb`` sets: the reduction's and, at stages 1-2,
the all-gather of the updated weights'."""


def comm_refusal(user: Mapping[str, Any], stage: int, comm: GradComm
                 ) -> tuple[str, Any, str, str] | None:
    """Why DeepSpeed cannot communicate as ``comm`` asks at ZeRO ``stage`` with the user's
    config, and what works (``Backend.comm_refusal``'s answer); None where it can.

    A cast is DeepSpeed's ``communication_data_type``, which every stage reduces in (stage 0's
    allreduce, stages 1-2's reduce/reduce-scatter, stage 3's reduce-scatter). Its buckets are
    ZeRO's: stage 0 reduces in fixed buffers of 5e8 elements whatever the config says.
    """
    if comm.compression == "powersgd":
        return comm.refused("--grad-compression", "has no PowerSGD", "use --grad-compression "
                            "bf16 or fp16 (its communication_data_type), or --backend ddp or "
                            "apex for powersgd")
    given = user.get("communication_data_type")
    if comm.cast is not None and given is not None and str(given).lower() != comm.cast:
        return comm.refused("--grad-compression", f"is given a DeepSpeed config whose "
                            f"communication_data_type is {given}", "drop one of the two, or "
                            "make them agree")
    if comm.bucket_mb is None:
        return None
    if stage == 0:
        return comm.refused("--bucket-mb", "reduces at ZeRO stage 0 in fixed buffers of 5e8 "
                            "elements", "pass --zero-stage 1, 2 or 3 with it, or leave "
                            "--bucket-mb out")
    zero = user.get("zero_optimization")
    set_here = [key for key in BUCKET_KEYS if isinstance(zero, Mapping) and key in zero]
    if set_here:
        return comm.refused("--bucket-mb", f"is given a DeepSpeed config that sets "
                            f"zero_optimization.{set_here[0]}", "drop one of the two")
    return None


def _communication(config: dict[str, Any], comm: GradComm, mode: str | None) -> None:
    """``--grad-compression``'s dtype and ``--bucket-mb``'s buckets (in elements of the mode's
    gradients, an even number: ZeRO aligns its all-gather buffer to 2 elements)."""
    if comm.cast is not None:
        config.setdefault("communication_data_type", comm.cast)
    if comm.bucket_mb is not None:
        width = 4 if mode is None else 2
        elements = max(2, int(comm.bucket_mb * 2**20 / width) // 2 * 2)
        zero = _section(config, "zero_optimization")
        for key in BUCKET_KEYS:
            zero.setdefault(key, elements)


def build_config(user: Mapping[str, Any], *, stage: int | None, offload: frozenset[str],
                 mode: str | None, loss_scale: LossScaleConfig, accumulate: int,
                 world_size: int, comm: GradComm | None = None) -> dict[str, Any]:
    """The config handed to ``deepspeed.initialize`` for precision mode ``mode`` (``fp16``,
    ``bf16`` or None, see ``mode_of``; checked against the config by ``precision_refusal``);
    raises UsageError on any other conflict."""
    config = json.loads(json.dumps(dict(user)))  # a deep copy; the user's dict stays untouched
    final_stage = check_stage_and_offload(config, stage, offload)
    zero = _section(config, "zero_optimization")
    zero["stage"] = final_stage
    if "optimizer" in offload:
        zero.setdefault("offload_optimizer", {"device": "cpu"})
    if "parameters" in offload:
        zero.setdefault("offload_param", {"device": "cpu"})
    _precision(config, mode, loss_scale)
    _communication(config, comm or GradComm(), mode)
    _batch_sizes(config, accumulate, world_size)
    # mpt hands DeepSpeed the script's own torch optimizer: let ZeRO take any of them, and let
    # offload run it on CPU (DeepSpeedCPUAdam is faster, but it is not what the script built).
    config.setdefault("zero_allow_untested_optimizer", True)
    if offload:
        config.setdefault("zero_force_ds_cpu_optimizer", False)
    # DeepSpeed 0.19 clips at 1.0 unless told otherwise; under mpt a step clips only when the
    # script calls rt.clip_grad_norm_ (as under ddp), or at the config's own gradient_clipping.
    config.setdefault("gradient_clipping", 0.0)
    config.setdefault("steps_per_print", 2**31 - 1)  # mpt's script does its own logging
    return config
