"""The run's settings: one frozen, typed tree that everything else is derived from.

`mpt launch`'s options for these settings are generated from the fields below (``run_options``),
so are the keys a ``--config`` file may hold for them; the launcher hands the whole tree to its
workers in one variable, ``MPT_RUN_CONFIG`` (JSON); the worker's ``mpt.Runtime(...)`` reads it
and lets the arguments given in code win. Every value is checked here, once, whichever way it
came, and booleans take one vocabulary (``mpt.parse.BOOLEANS``).

A new setting is a new field here (with its ``help``, and its parser if it is not a string);
``tests/test_run_config.py`` checks that the Runtime takes it as an argument too.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mpt.comm import COMPRESSIONS, GradComm, parse_bucket_mb, parse_compression
from mpt.environments.host_memory import HOST_MEMORY, parse_host_memory
from mpt.errors import UsageError
from mpt.parallel import ParallelPlan
from mpt.parse import parse_bool, parse_int, parse_number
from mpt.pipeline.config import PipelinePlan, parse_stages, plan_pipeline

VARIABLE = "MPT_RUN_CONFIG"
"""The one environment variable that carries the run's settings from `mpt launch` to workers."""


def _setting(default: Any, help: str, *, parse: Callable[[str, Any], Any] | None = None,
             metavar: str | None = None) -> Any:
    """A field of ``RunConfig``: its default, the help of its `mpt launch` option, how a value
    given as text is parsed, and the option's metavar."""
    metadata = {"help": help, "parse": parse, "metavar": metavar}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


def _options(argument: str, value: Any) -> dict[str, Any]:
    """A dict of options: a mapping, or its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise UsageError(argument, value, f"it is not valid JSON ({exc.msg})",
                             'pass a JSON object such as {"zero_stage": 2}') from None
    if not isinstance(value, Mapping):
        raise UsageError(argument, value, "it is not a mapping of option names to values",
                         'pass a JSON object such as {"zero_stage": 2}')
    return dict(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """What every worker of a run trains with (the Runtime's settings)."""

    backend: str = _setting("ddp", "Distributed backend (see `mpt backends`).")
    precision: str | None = _setting(
        None, "fp32, fp16-mixed, bf16-mixed, or Apex's opt levels O0, O1, O2, O3 (O2-bf16, "
        "O3-bf16); default: a DeepSpeed config's fp16/bf16, else fp32 (see `mpt backends`).")
    loss_scale: str = _setting("dynamic", "fp16 loss scaling: 'dynamic' or a static number.")
    accumulate: int | None = _setting(
        None, "Micro-batches per optimizer step (default 1, or what --global-batch-size "
        "implies).", parse=parse_int, metavar="N")
    backend_options: dict[str, Any] = _setting(  # noqa: RUF009 - a field(), not a call
        {}, "The backend's own options as JSON (its flags below fill them too).",
        parse=_options, metavar="JSON")
    precision_options: dict[str, Any] = _setting(  # noqa: RUF009 - a field(), not a call
        {}, "The precision's own options as JSON (Apex's overrides: see the flags below).",
        parse=_options, metavar="JSON")
    grad_compression: str = _setting(
        "none", f"Gradients on the wire: {', '.join(COMPRESSIONS[:-1])} (cast for the "
        f"reduction and back) or {COMPRESSIONS[-1]} (low-rank with error feedback: ddp, apex). "
        "A backend that cannot do it refuses it before start.", parse=parse_compression,
        metavar="KIND")
    bucket_mb: float | None = _setting(
        None, "Gradient MiB per collective (0: one per gradient): DDP's bucket cap (its first "
        "bucket keeps torch's 1 MiB, so the first allreduce starts early), Apex's message size, "
        "Horovod's fusion threshold, DeepSpeed's reduce/allgather buckets (ZeRO 1-3); default: "
        "the backend's.", parse=parse_bucket_mb, metavar="MIB")
    global_batch_size: int | None = _setting(
        None, "Samples per optimizer step over all processes; per-rank batch and accumulation "
        "follow (rt.batch_size, rt.accumulate).", parse=parse_int, metavar="B")
    lr_scaling: str | None = _setting(
        None, "Scale learning rates in the world size with rt.scale_lr: linear or sqrt.",
        metavar="RULE")
    timeout: float | None = _setting(
        None, "A collective that waits longer for its peers fails instead of hanging (default "
        "1800).", parse=parse_number, metavar="SECONDS")
    host_memory: str = _setting(
        HOST_MEMORY[0], "How the C allocator (glibc) treats freed host memory: fast (glibc's "
        "defaults: freed blocks are kept for reuse, so resident memory can grow to several "
        "times what the run holds, but blocks of 32 MiB and more and a heap's free top go "
        "back to the OS, and steps fault them in again), lean (freed blocks of 128 KiB and "
        "more go back to the OS at once: resident memory tracks what the run holds, and each "
        "step pays page faults again: 1.0-2.7 x the step time of CPU training) or steady "
        "(freed blocks of every size are kept for reuse: mpt launch preloads jemalloc where "
        "the machine has it, else glibc's heaps keep them; after the first steps no step "
        "faults memory in again, as a GPU's caching allocator; resident memory stays at its "
        "peak: up to 1.4 x fast's under jemalloc, twice and more in glibc's heaps); "
        "docs/parallel.md.",
        parse=parse_host_memory, metavar="|".join(HOST_MEMORY))
    checkpoint_dir: str | None = _setting(
        None, "Where rt.save() writes and rt.resume() looks (a path or fsspec URL).",
        metavar="DIR")
    async_save: bool = _setting(
        False, "rt.save() returns once the state is copied to host memory; a thread writes and "
        "commits it while training goes on.", parse=parse_bool)
    snapshot_every: int = _setting(
        0, "Every K optimizer steps, keep the training state in the memory of two nodes: a "
        "lost node then costs at most K steps (0: never; docs/fault-tolerance.md).",
        parse=parse_int, metavar="K")
    snapshot_dir: str | None = _setting(
        None, "This node's store of snapshots, in memory (default: a directory in /dev/shm "
        "that the node's mpt launch makes and removes).", metavar="DIR")
    resume: str | None = _setting(
        None, "rt.resume(): auto (the latest checkpoint of --checkpoint-dir, if any; the "
        "default), never, or a checkpoint's path.", metavar="FROM")
    run_dir: str | None = _setting(
        None, "Write metrics.jsonl and TensorBoard files here (`mpt visualize DIR` draws "
        "them).", metavar="DIR")
    quiet: bool = _setting(False, "No progress bar or progress lines.", parse=parse_bool)
    log_every: int = _setting(10, "Optimizer steps between two metric records.",
                              parse=parse_int, metavar="STEPS")
    metrics_all_ranks: bool = _setting(False, "Every rank writes metrics, not only rank 0.",
                                       parse=parse_bool)
    pipeline_stages: tuple[int, ...] = _setting(
        (1,), "Cut the model into P pipeline stages over ranks (ddp, fsdp); the world is P x the "
        "data-parallel size (docs/pipeline.md). Counts in order of preference, such as 2,1, let "
        "an elastic job run at each world the first that divides it (its checkpoints and "
        "snapshots load at any count).", parse=parse_stages, metavar="P")
    tensor_parallel: int = _setting(
        1, "Split each layer the model's tensor_parallel_plan() names over T ranks of a node "
        "(ddp, fsdp); the world is T x the pipeline stages x the data-parallel size "
        "(docs/parallel.md).", parse=parse_int, metavar="T")
    pipeline_schedule: str = _setting(
        "1f1b", "Pipeline schedule: gpipe, 1f1b, or with two chunks per rank "
        "interleaved-1f1b or interleaved-zb (zero bubble).",
        metavar="NAME")
    microbatches: int | None = _setting(
        None, "Micro-batches per rt.forward_backward under a pipeline (default 2 x P).",
        parse=parse_int, metavar="M")
    pipeline_split: str | None = _setting(
        None, "Where stages 1.. start: block names, comma-separated (default: balanced by "
        "parameter count).", metavar="NAMES")

    def __post_init__(self) -> None:
        from mpt.backends import get_backend, offering
        from mpt.metrics.config import parse_log_every
        from mpt.precision import LossScaleConfig, check_precision
        from mpt.scaling import check_lr_scaling

        # A count given in code (pipeline_stages=2) is the one-count tuple the flag parses to.
        object.__setattr__(self, "pipeline_stages",
                           parse_stages("--pipeline-stages", self.pipeline_stages))
        backend = get_backend(self.backend)
        values = backend.check_options(self.backend_options)
        backend.check_comm(self.grad_comm, values)
        if self.precision is not None:
            check_precision(self.precision)
        LossScaleConfig.parse(self.loss_scale)
        for flag, count in (("--accumulate", self.accumulate),
                            ("--global-batch-size", self.global_batch_size)):
            if count is not None and count < 1:
                raise UsageError(flag, count, "it must be at least 1", f"pass {flag} 1 or more")
        check_lr_scaling(self.lr_scaling)
        parse_host_memory(flag_of("host_memory"), self.host_memory)
        if self.timeout is not None and not self.timeout > 0:
            raise UsageError("--timeout", self.timeout, "it must be positive",
                             "pass --timeout 30, for example")
        if self.checkpoint_dir is not None or self.resume not in (None, "auto", "never"):
            # the checkpoint package (fsspec) only where there is a path to check
            from mpt.checkpoint import check_resume, check_root

            check_root("--checkpoint-dir", self.checkpoint_dir)
            check_resume("--resume", self.resume)
        if self.pipeline_split is not None and len(self.pipeline_stages) > 1:
            raise UsageError("--pipeline-split", self.pipeline_split, "it names where the "
                             "stages of one count start, and --pipeline-stages lists "
                             f"{self._stages_text}", "drop --pipeline-split (each count is "
                             "then balanced by parameter count), or pass one stage count")
        if self._pipelined and not backend.pipelines:
            raise UsageError("--pipeline-stages", self._stages_text, f"--backend "
                             f"{self.backend} cannot cut a model into pipeline stages",
                             f"use --backend {offering('pipelines')}, or drop "
                             "--pipeline-stages")
        for pipeline in filter(None, map(self._pipeline, self.pipeline_stages)):
            refusal = backend.pipeline_refusal(pipeline.schedule, pipeline.split_backward, values)
            if refusal is not None:
                raise UsageError(*refusal)
        split = self._model_split()
        if split is not None and self.precision is not None:
            import torch

            from mpt.precision import describe

            if describe(self.precision, options=self.precision_options).params != torch.float32:
                raise UsageError("--precision", self.precision, f"--backend {self.backend} "
                                 f"under {split} is checked against one process only with "
                                 "fp32 weights (the mixed precisions autocast them); casting "
                                 "the weights themselves is not",
                                 f"use --precision bf16-mixed, fp16-mixed or O1, or drop {split}")
        if split is not None and self.grad_compression == "powersgd":
            raise UsageError("--grad-compression", "powersgd", f"under {split} the replicas "
                             "average one flat bucket after the backward, not DDP's buckets "
                             "PowerSGD hooks into", "use --grad-compression bf16 or fp16, or "
                             f"drop {split}")
        if self.snapshot_every < 0:
            raise UsageError("--snapshot-every", self.snapshot_every, "it cannot be negative",
                             "pass 1 for a snapshot after every step, or 0 for none")
        if self.snapshot_every and not backend.snapshots:
            raise UsageError("--snapshot-every", self.snapshot_every, f"--backend {self.backend} "
                             "has no torch.distributed group to copy snapshots over",
                             f"drop --snapshot-every, or use --backend {offering('snapshots')}")
        parse_log_every(self.log_every)

    def _model_split(self) -> str | None:
        """The flag that splits one model over several ranks (pipeline stages, tensor
        parallelism), None where every rank holds a whole one."""
        if self._pipelined:
            return "--pipeline-stages"
        return "--tensor-parallel" if self.tensor_parallel > 1 else None

    @property
    def _pipelined(self) -> bool:
        """Whether some world of the run cuts the model into stages."""
        return max(self.pipeline_stages) > 1 or self.pipeline_split is not None

    @property
    def _stages_text(self) -> str:
        """``--pipeline-stages`` as written: ``2`` or ``2,1``."""
        return ",".join(map(str, self.pipeline_stages))

    def stages_at(self, world_size: int) -> int:
        """The pipeline stages at ``world_size`` processes: the first of ``pipeline_stages``
        whose model replicas (with ``tensor_parallel``) divide the world, else the first
        (whose layout then refuses that world)."""
        span = self.tensor_parallel
        return next((p for p in self.pipeline_stages if world_size % (p * span) == 0),
                    self.pipeline_stages[0])

    def _pipeline(self, stages: int) -> PipelinePlan | None:
        """The plan of ``stages`` stages (checked: schedule, micro-batches, split), None for
        one stage."""
        if stages == 1 and self.pipeline_split is None:
            return None
        return plan_pipeline(stages, self.pipeline_schedule, self.microbatches,
                             self.pipeline_split)

    def pipeline_at(self, world_size: int) -> PipelinePlan | None:
        """The pipeline plan at ``world_size`` processes, None where it runs one stage."""
        return self._pipeline(self.stages_at(world_size))

    def layout(self, world_size: int) -> ParallelPlan:
        """The job's parallel layout at ``world_size`` processes: the pipeline's stages there,
        and the backend's data axes over the ranks they leave (a UsageError names the flag
        when they do not divide the world). Every worker computes it at its world, the
        launcher at each world the job may reach."""
        from mpt.backends import get_backend

        return get_backend(self.backend).layout_of(world_size, self.backend_options,
                                                   pp=self.stages_at(world_size),
                                                   tp=self.tensor_parallel)

    @property
    def grad_comm(self) -> GradComm:
        """The gradient-communication settings, as the backend takes them."""
        return GradComm(compression=self.grad_compression, bucket_mb=self.bucket_mb)

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> RunConfig:
        """A config from values as users write them (text from flags, files or variables, or
        typed values from code); None values keep the defaults."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        typed: dict[str, Any] = {}
        for name, value in values.items():
            if name not in fields:
                raise UsageError("run setting", name, "mpt has no such setting",
                                 f"use one of {', '.join(fields)}")
            if value is None:
                continue
            parse = fields[name].metadata["parse"]
            typed[name] = parse(flag_of(name), value) if parse else str(value)
        return cls(**typed)

    def replace(self, **values: Any) -> RunConfig:
        """This config with ``values`` (as ``parse`` takes them) on top; None keeps a value,
        and option dicts are merged key by key (the new ones win)."""
        current = self.values()
        given = {k: v for k, v in values.items() if v is not None}
        for name in ("backend_options", "precision_options"):
            if name in given:
                given[name] = {**current[name], **_options(flag_of(name), given[name])}
        return RunConfig.parse({**current, **given})

    def values(self) -> dict[str, Any]:
        """Every setting by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # -- the hand-off from launcher to workers ----------------------------------------------------
    def to_env(self) -> dict[str, str]:
        """The one variable that gives a worker this config, every setting spelled out."""
        return {VARIABLE: json.dumps(self.values(), sort_keys=True)}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RunConfig:
        """What `mpt launch` handed this process (defaults where nothing was). A process that
        horovodrun started without mpt can only join its job through Horovod: its backend is
        horovod where no launcher of mpt's handed a config over (its variable names one)."""
        retired = sorted(f"MPT_{f.name.upper()}" for f in dataclasses.fields(cls)
                         if f"MPT_{f.name.upper()}" in env)
        if retired:  # read once, by earlier versions: ignoring it would train another run
            name = retired[0].removeprefix("MPT_").lower()
            raise UsageError(retired[0], env[retired[0]], f"mpt reads its settings from "
                             f"{VARIABLE} only", f"unset it and pass {VARIABLE}="
                             f"'{{\"{name}\": ...}}' or `mpt launch {flag_of(name)}`")
        values = _options(VARIABLE, env.get(VARIABLE) or "{}")
        if "HOROVOD_RANK" in env:
            values.setdefault("backend", "horovod")
        return cls.parse(values)


def flag_of(name: str) -> str:
    """The `mpt launch` option of setting ``name``."""
    return "--" + name.replace("_", "-")
