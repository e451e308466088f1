"""The `mpt` command line: `mpt launch`, `mpt backends`.

Usage errors print one line, ``mpt: error: ...``, and exit with code 2: the user needs the
argument, the value and the fix, not a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from mpt.backends.base import BackendOption, LaunchOption
from mpt.cli_checkpoint import app as checkpoint_app
from mpt.cli_plan import plan_command
from mpt.config import ConfigurableCommand, load_into_context
from mpt.errors import MptError, UsageError
from mpt.estimate import OPTIMIZER_STATES
from mpt.install import app as install_app
from mpt.parallel import AXES, ParallelPlan
from mpt.parse import parse_int, parse_number, parse_sizes
from mpt.run_config import RunConfig, flag_of

if TYPE_CHECKING:
    from mpt.launchers import LaunchSpec

app = typer.Typer(
    name="mpt",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)

USAGE_ERROR = 2

PYTHON_NAME = re.compile(r"python[\d.]*")
"""A Python interpreter's file name, in a command line `mpt horovodrun` passes on."""

# Options `mpt launch` and `mpt horovodrun` share.
LogDirOption = Annotated[Path | None, typer.Option(
    metavar="DIR", help="Write each rank's stdout and stderr to DIR/rank<R>.log (an earlier job's "
    "logs move to DIR/previous-<time>/; the launchers' own reports go to DIR/horovodrun.log or "
    "DIR/elastic.node<N>.log, elastic jobs' DIR/elastic.<host>.log); only --tee ranks reach the "
    "console.")]
TeeOption = Annotated[str | None, typer.Option(
    metavar="RANKS", help="With --log-dir: the global ranks also shown on the console, each line "
    "prefixed with its rank; comma-separated, or 'all' (default 0).")]
LocalRankArgOption = Annotated[bool, typer.Option(
    "--local-rank-arg", help="Pass --local_rank=<N> to the script, as torch.distributed.launch "
    "did (Apex-era scripts read it from argv).")]


VERSIONS_SHOWN = {"torch": "torch", "DeepSpeed": "deepspeed", "Horovod": "horovod"}
"""The packages `mpt --version` names beside mpt's: name shown -> distribution."""


def _installed_version(distribution: str) -> str:
    """A distribution's version from its metadata (nothing imported), or "not installed"."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _version(show: bool) -> None:
    if show:
        from mpt import __version__

        others = ", ".join(f"{name} {_installed_version(dist)}"
                           for name, dist in VERSIONS_SHOWN.items())
        out.print(f"mpt {__version__} ({others})")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the versions of mpt, torch, DeepSpeed "
                                          "and Horovod.")] = False,
) -> None:
    """Mixed-precision, multi-process PyTorch training on the backend chosen by a flag."""


RunOptions = dict[str, Any] | None
"""A command's parameter that ``_with_run_options`` replaces by one option per setting."""
BackendFlags = dict[str, Any] | None
"""A command's parameter that ``_with_run_options`` replaces by the backends' own flags."""
LaunchFlags = dict[str, Any] | None
"""A command's parameter that ``_with_run_options`` replaces by the backends' launch flags."""


def _run_option(setting: dataclasses.Field[Any]) -> inspect.Parameter:
    """The `mpt launch` option of one ``RunConfig`` setting: a flag for a yes/no setting, else a
    value parsed by ``RunConfig.parse`` (so that a bad one gets mpt's one-line error)."""
    help_text, metavar = setting.metadata["help"], setting.metadata["metavar"]
    if setting.type in (bool, "bool"):
        return inspect.Parameter(setting.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                 default=False, annotation=Annotated[bool, typer.Option(
                                     flag_of(setting.name), help=help_text)])
    return inspect.Parameter(setting.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                             default=_default_text(setting),
                             annotation=Annotated[str | None, typer.Option(
                                 metavar=metavar, help=help_text)])


def _default_text(setting: dataclasses.Field[Any]) -> str | None:
    """A setting's default as its option takes it (None: not shown, e.g. a dict's)."""
    if isinstance(setting.default, tuple):  # --pipeline-stages 2,1
        return ",".join(map(str, setting.default))
    return str(setting.default) if isinstance(setting.default, str | int) else None


def _parameter(flag: str) -> str:
    """The command's parameter of a generated flag: ``--zero-stage`` -> ``zero_stage``."""
    return flag.removeprefix("--").replace("-", "_")


def _backend_flags() -> dict[str, tuple[str, str, BackendOption]]:
    """Parameter name -> (backend, option name, option) of every built-in backend option with a
    flag."""
    from mpt.backends import BUILTIN

    return {_parameter(option.flag): (backend, name, option)
            for backend, cls in BUILTIN.items() for name, option in cls.options.items()
            if option.flag is not None}


def _launch_flags() -> dict[str, tuple[str, str, LaunchOption]]:
    """Parameter name -> (its backends, option name, option) of every built-in backend's
    launch options; backends that declare the same flag share it (``horovod or other``)."""
    from mpt.backends import BUILTIN

    found: dict[str, tuple[str, str, LaunchOption]] = {}
    for backend, cls in BUILTIN.items():
        for name, option in cls.launch_options.items():
            parameter = _parameter(option.flag)
            first = found.get(parameter)  # its declaration and help; every backend named
            found[parameter] = ((backend, name, option) if first is None
                                else (f"{first[0]} or {backend}", first[1], first[2]))
    return found


def _backend_flag(parameter: str, backend: str, option: BackendOption, *,
                  applies_with: str = "", default: str | None = None) -> inspect.Parameter:
    """The `mpt launch` flag of one backend option; its value is parsed by the backend (a
    launch option's by the launcher)."""
    help_text = f"--backend {' '.join(filter(None, (backend, applies_with)))}: {option.help}."
    annotation: Any = (Annotated[bool, typer.Option(option.flag, help=help_text)]
                       if option.is_switch else
                       Annotated[str | None, typer.Option(option.flag, help=help_text,
                                                          metavar=option.metavar)])
    return inspect.Parameter(parameter, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                             default=False if option.is_switch else default,
                             annotation=annotation)


def _with_run_options(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` with one option per ``RunConfig`` setting where its ``run`` parameter was,
    one flag per backend option that declares one where its ``backend_flags`` was, and one per
    backend launch option where its ``launch_flags`` was; it receives their values, as given,
    in ``run``, ``backend_flags`` and ``launch_flags`` (options by name)."""
    settings = dataclasses.fields(RunConfig)
    flags = _backend_flags()
    launch_flags = _launch_flags()
    signature = inspect.signature(command, eval_str=True)
    parameters: list[inspect.Parameter] = []
    for parameter in signature.parameters.values():
        if parameter.name == "run":
            parameters += [_run_option(s) for s in settings]
        elif parameter.name == "backend_flags":
            parameters += [_backend_flag(p, backend, option)
                           for p, (backend, _, option) in flags.items()]
        elif parameter.name == "launch_flags":
            parameters += [_backend_flag(p, backends, option, applies_with=option.applies_with,
                                         default=option.default)
                           for p, (backends, _, option) in launch_flags.items()]
        else:
            parameters.append(parameter)

    @functools.wraps(command)
    def with_run_options(**values: Any) -> None:
        run = {s.name: values.pop(s.name) for s in settings}
        given = {flags[p][1]: values.pop(p) for p in flags}
        launch = {launch_flags[p][1]: values.pop(p) for p in launch_flags}
        command(run=run, backend_flags={k: v for k, v in given.items() if v not in (None, False)},
                launch_flags={k: v for k, v in launch.items() if v not in (None, False)},
                **values)

    with_run_options.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=parameters)
    return with_run_options


@app.command(cls=ConfigurableCommand, context_settings={"allow_interspersed_args": False,
                                                        "ignore_unknown_options": True})
@_with_run_options
def launch(
    script: Annotated[Path, typer.Argument(help="Training script each process runs.")],
    script_args: Annotated[list[str] | None, typer.Argument(
        help="Arguments for the script.")] = None,
    config: Annotated[Path | None, typer.Option(  # read by its callback, before the others
        metavar="FILE", is_eager=True, callback=load_into_context,
        help="YAML or TOML file of launch options (`mpt config init`); flags win.")] = None,
    nodes: Annotated[str, typer.Option(metavar="N|MIN:MAX", help="Nodes in the job; MIN:MAX "
                                       "for an elastic job (ranks from the rendezvous, no "
                                       "--nr; it goes on while MIN nodes remain).")] = "1",
    gpus: Annotated[str, typer.Option(metavar="G", help="Processes per node (one per GPU; "
                                      "CPU processes on gloo without CUDA).")] = "1",
    nr: Annotated[str | None, typer.Option(metavar="R", help="Rank of this node, 0..nodes-1 "
                                           "(default 0).")] = None,
    master_addr: Annotated[str, typer.Option(help="Address of node 0.")] = "127.0.0.1",
    master_port: Annotated[str, typer.Option(
        metavar="PORT", help="Rendezvous port on node 0; auto picks a free one (one node "
        "only).")] = "29500",
    local_addr: Annotated[str | None, typer.Option(
        metavar="ADDR", help="--nodes MIN:MAX: this node's address as the others reach it "
        "(default: its host name's).")] = None,
    run: RunOptions = None,  # every RunConfig setting, one option each (see _with_run_options)
    keep_batchnorm_fp32: Annotated[str | None, typer.Option(
        metavar="BOOL", help="Opt levels O1-O3: Apex's override, true or false.")] = None,
    master_weights: Annotated[str | None, typer.Option(
        metavar="BOOL", help="Opt levels O1-O3: keep fp32 master weights, true or false.")] = None,
    cast_model_type: Annotated[str | None, typer.Option(
        metavar="DTYPE", help="Opt levels O1-O3: cast the model to float16, bfloat16 or "
        "float32.")] = None,
    log_dir: LogDirOption = None,
    tee: TeeOption = None,
    max_restarts: Annotated[str | None, typer.Option(
        metavar="K", help="Restart the whole gang this often after a failure (default 0; "
        "with --nodes MIN:MAX: MAX-MIN+3, a lost node counts as one).")] = None,
    heartbeat_timeout: Annotated[str, typer.Option(
        metavar="SECONDS", help="Report a rank that made no progress for this long; 0 = "
        "never.")] = "300",
    grace_period: Annotated[str, typer.Option(
        metavar="SECONDS", help="Time a rank gets to exit (or to save, when preempted) before "
        "SIGKILL.")] = "30",
    rdzv_timeout: Annotated[str, typer.Option(
        metavar="SECONDS", help="How long node 0 waits for the other nodes to arrive; also how "
        "long a node that can no longer reach the rendezvous host waits before it ends.")] = "900",
    launch_flags: LaunchFlags = None,  # how each backend's job may start (see _with_run_options)
    backend_flags: BackendFlags = None,  # each backend's own options (see _with_run_options)
    local_rank_arg: LocalRankArgOption = False,
    dry_run: Annotated[bool, typer.Option(
        help="Print every process of the job and exit.")] = False,
) -> None:
    """Start this node's processes of a (multi-node) training job."""
    import torch

    from mpt import launchers
    from mpt.elastic import check_node_rank, default_max_restarts, parse_nodes
    from mpt.launchers.logs import console_lines
    from mpt.launchers.node_rank import NodeRankClaim, RendezvousError

    if str(script).startswith("-"):
        raise UsageError("option", script, "mpt launch has no such option",
                         "see `mpt launch --help`; options for the script go after SCRIPT")
    settings = RunConfig.parse(run or {})
    overrides = {k: v for k, v in {"keep_batchnorm_fp32": keep_batchnorm_fp32,
                                   "master_weights": master_weights,
                                   "cast_model_type": cast_model_type}.items() if v is not None}
    settings = settings.replace(backend_options=backend_flags, precision_options=overrides)
    node_range = parse_nodes(nodes)
    check_node_rank(node_range, nr)
    spec = launchers.LaunchSpec(
        script=script, script_args=tuple(script_args or ()), nodes=node_range.max,
        min_nodes=node_range.min if node_range.elastic else None,
        gpus=parse_int("--gpus", gpus), nr=parse_int("--nr", nr or "0"), master_addr=master_addr,
        master_port=launchers.parse_port(master_port, node_range.max), run=settings,
        local_addr=local_addr,
        log_dir=log_dir, max_restarts=default_max_restarts(node_range) if max_restarts is None
        else parse_int("--max-restarts", max_restarts),
        heartbeat_timeout=parse_number("--heartbeat-timeout", heartbeat_timeout),
        grace_period=parse_int("--grace-period", grace_period),
        rdzv_timeout=parse_int("--rdzv-timeout", rdzv_timeout), local_rank_arg=local_rank_arg,
        launch_options=launch_flags or {})
    if tee is not None:  # checked against the world, so after the spec has checked the world
        spec = dataclasses.replace(spec, tee=_tee(tee, spec))
    job_launcher = spec.job_launcher()
    if job_launcher is not None:  # else every backend, horovod too, starts this node's processes
        _launch_job(spec, job_launcher, dry_run)
        return
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dry_run:
        _print_plan(spec, cuda_devices)
        return
    spec.check_machine(cuda_devices)
    if not cuda_devices:
        _say(f"mpt: no CUDA device here: running {spec.gpus} CPU process(es) per node on gloo")
    try:
        # Two nodes given the same --nr: the second stops here (elastic jobs have no --nr).
        with contextlib.nullcontext() if spec.elastic else NodeRankClaim(spec), console_lines():
            outcome = launchers.run(spec, report=_say,
                                    runtime_flags=_runtime_flags({**(run or {}), **overrides},
                                                                 backend_flags or {},
                                                                 spec.backend))
    except RendezvousError as exc:  # node 0 never came
        outcome = launchers.Outcome(1, (f"mpt: {exc}",))
    for line in outcome.lines:
        _say(line)
    if outcome.exit_code:
        raise typer.Exit(outcome.exit_code)


def _say(line: str) -> None:
    """One line of `mpt launch`'s own on stderr, as it is: rich's markup would eat the brackets
    of a line that quotes a rank's words (``[rank0]``, ``list[int]``)."""
    print(line, file=sys.stderr, flush=True)


def _runtime_flags(given: dict[str, Any], backend_flags: dict[str, Any],
                   backend: str) -> tuple[str, ...]:
    """The flags given (as typed) that only an ``mpt.Runtime`` applies: the run settings and
    the precision's overrides in ``given`` that differ from the defaults (so not ``--backend
    ddp``: torchrun's environment is all a plain torch.distributed script needs), and the
    backend's own flags."""
    from mpt.backends import get_backend

    options = get_backend(backend).options
    defaults = {s.name: _default_text(s) for s in dataclasses.fields(RunConfig)}
    flags = {**{flag_of(k): v for k, v in given.items() if v is not None and v is not False
                and str(v) != defaults.get(k)},
             **{options[k].flag or k: v for k, v in backend_flags.items()}}
    return tuple(flag if value is True else f"{flag} {value}" for flag, value in flags.items())


def _tee(value: str, spec: LaunchSpec) -> frozenset[int]:
    """``--tee``'s ranks; it selects among the log files, so it needs ``--log-dir``."""
    from mpt.launchers.logs import parse_tee

    if spec.log_dir is None:
        raise UsageError("--tee", value, "it needs --log-dir (without it every rank prints to "
                         "the console)", "add --log-dir DIR, or leave --tee out")
    return parse_tee(value, spec.world.world_size)


def _launch_job(spec: LaunchSpec, launcher: str, dry_run: bool) -> None:
    """Run the whole job (every node) through the backend's own ``launcher`` (a module of
    ``mpt.launchers`` with ``describe`` and ``run``), as its launch options asked; its exit
    code becomes ours."""
    import importlib

    job = importlib.import_module(f"mpt.launchers.{launcher}")
    if dry_run:
        out.print(job.describe(spec), markup=False)
        return
    code, lines = job.run(spec)
    for line in lines:
        _say(line)
    if code:
        raise typer.Exit(code)


AXIS_COLUMNS = {"pp": "stage", "dp_replicate": "replica", "dp_shard": "shard",
                "tp": "tp rank"}
"""``--dry-run``'s column for each axis of the ``ParallelPlan``."""


def _print_plan(spec: LaunchSpec, cuda_devices: int) -> None:
    from rich.table import Table

    from mpt.environments import device_name

    size = (f"{spec.node_range.min * spec.gpus}..{spec.world.world_size}" if spec.elastic
            else str(spec.world.world_size))
    table = Table(title=f"{spec.script} on {size} process(es): backend "
                  f"{spec.backend}, precision {spec.run.precision}, rendezvous "
                  f"{spec.master_addr}:{spec.master_port}")
    run = spec.run
    pipeline = run.pipeline_at(spec.world.world_size)
    layout = spec.layout
    replicas = layout.dp_size
    # Each rank's coordinate on every axis in use, where more than one is.
    axes = [axis for axis in AXES if getattr(layout, axis) > 1]
    axes = axes if len(axes) > 1 else []
    columns = ("node", "local rank", "global rank", *(AXIS_COLUMNS[axis] for axis in axes),
               "device")
    for column in columns:
        table.add_column(column, justify="right" if column != "device" else "left")
    for node, local_rank, rank in spec.world.all_processes():
        at = layout.coords(rank)
        table.add_row(str(node), str(local_rank), str(rank), *(str(at[axis]) for axis in axes),
                      device_name(local_rank, cuda_devices > 0))
    out.print(table)
    if axes:
        out.print(f"layout: {layout.describe()}")
    if pipeline is not None:
        out.print(f"pipeline: {pipeline.stages} stages x {replicas} data-parallel replica(s), "
                  f"{pipeline.schedule}, {pipeline.microbatches} micro-batches per "
                  f"rt.forward_backward (GPipe/1F1B bubble {pipeline.bubble:.0%}); each "
                  "stage's blocks and bytes: mpt estimate-memory MODEL --pipeline-stages "
                  f"{pipeline.stages}")
    if spec.elastic:
        from mpt.elastic import describe_sizes

        out.print(f"elastic: --nodes {spec.node_range}, node ranks assigned at the rendezvous "
                  f"(the table shows {spec.nodes} nodes), up to {spec.max_restarts} restart(s)")
        for line in describe_sizes(spec.node_range, spec.gpus, run.layout,
                                   run.global_batch_size, run.accumulate):
            out.print(line)
    elif run.global_batch_size is not None:
        out.print(f"global batch size {run.global_batch_size}: "
                  f"{run.global_batch_size // replicas} samples per data-parallel replica per "
                  "optimizer step (micro-batch size x accumulation)")
    if run.lr_scaling is not None:
        from mpt.scaling import lr_factor

        out.print(f"lr scaling {run.lr_scaling}: learning rates x "
                  f"{lr_factor(run.lr_scaling, spec.world.world_size):g}")


@app.command(context_settings={"allow_interspersed_args": False,
                               "ignore_unknown_options": True})
def horovodrun(
    args: Annotated[list[str], typer.Argument(
        help="horovodrun's arguments, e.g. -np 2 -H localhost:2 python train.py")],
    precision: Annotated[str, typer.Option(help="fp32, fp16-mixed or bf16-mixed.")] = "fp32",
    loss_scale: Annotated[str, typer.Option(
        help="fp16 loss scaling: 'dynamic' or a static number.")] = "dynamic",
    log_dir: LogDirOption = None,
    tee: TeeOption = None,
    local_rank_arg: LocalRankArgOption = False,
) -> None:
    """Run horovodrun ARGS with mpt's settings (backend horovod, precision, one OpenMP thread
    per process), per-rank logs and failure report, as `mpt launch --backend horovod`."""
    import torch

    from mpt.backends import resolve_precision
    from mpt.launchers import horovodrun as hvdrun
    from mpt.precision import LossScaleConfig

    run = RunConfig.parse({"backend": "horovod", "precision": precision,
                           "loss_scale": loss_scale})
    resolve_precision("horovod", precision, loss_scale=LossScaleConfig.parse(loss_scale),
                      device_type="cuda" if torch.cuda.is_available() else "cpu")
    env = run.to_env()
    result = hvdrun.run_passthrough(_with_this_python(args), env, log_dir=log_dir, tee=tee,
                                    local_rank_arg=local_rank_arg)
    for line in result.lines(local_rank_arg):
        err.print(line, markup=False)
    if result.code:
        raise typer.Exit(result.code)


def _with_this_python(args: list[str]) -> list[str]:
    """horovodrun's ``args`` with a bare ``python``, ``python3`` or ``python3.N`` (this
    interpreter's version) replaced by this interpreter. Each worker starts in mpt's shim, and
    the name looked up on PATH may be another Python than the one mpt is installed in (a
    virtualenv not activated): every rank then fails with ``No module named 'mpt'``. A path, or
    the name of another version, is the user's choice and stays."""
    version = sys.version_info
    ours = {"python", f"python{version.major}", f"python{version.major}.{version.minor}"}
    at = next((i for i, arg in enumerate(args) if PYTHON_NAME.fullmatch(Path(arg).name)), None)
    if at is None or args[at] not in ours:
        return list(args)
    return [*args[:at], sys.executable, *args[at + 1:]]


@app.command()
def backends() -> None:
    """List every backend, whether it can run here, the precisions it trains on this machine's
    device, and what to install if it cannot run."""
    import torch
    from rich.table import Table

    from mpt.backends import broken, registered
    from mpt.precision import PRECISIONS, describe

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    table = Table(title=f"mpt backends ({device_type})")
    for column in ("backend", "available", "version", "precisions", "reason / install"):
        table.add_column(column)
    for name, cls in sorted(registered().items()):
        info = cls.availability()
        note = "" if info.available else f"{info.reason}; {info.install}"
        trains = [p for p in PRECISIONS if cls.precision_refusal(describe(p), device_type, {})
                  is None]
        table.add_row(name, "yes" if info.available else "no", info.version, " ".join(trains),
                      note)
    for name, reason in sorted(broken().items()):
        table.add_row(name, "no", "", "", reason)
    out.print(table)


@app.command("estimate-memory")
def estimate_memory(
    model: Annotated[str, typer.Argument(help="FILE.py:FUNCTION or package.module:FUNCTION: "
                                         "builds the model (it runs on the meta device).")],
    world_size: Annotated[int, typer.Option(help="Processes the job shards over.")] = 2,
    precision: Annotated[str, typer.Option(help="As `mpt launch --precision`.")] = "fp32",
    optimizer: Annotated[str, typer.Option(
        help=f"Its state per parameter: {', '.join(OPTIMIZER_STATES)}.")] = "adam",
    input_shape: Annotated[str | None, typer.Option(
        help="One rank's batch, e.g. 8,3,224,224, for the activations (default: none).")] = None,
    input_dtype: Annotated[str, typer.Option(help="float32, or int64 for token ids.")
                           ] = "float32",
    pipeline_stages: Annotated[int, typer.Option(
        help="Also show each of P pipeline stages' blocks and bytes (as `mpt launch "
        "--pipeline-stages`).")] = 1,
    gpus: Annotated[int | None, typer.Option(
        help="Processes per node, for the snapshot stores' size (default: one node).")
                    ] = None,
) -> None:
    """Per-rank bytes of parameters, gradients, optimizer state and activations under every
    backend and the options that change them, for a model built on the meta device."""
    import torch
    from rich.table import Table

    from mpt.backends import registered
    from mpt.checkpoint.snapshot import CHUNK
    from mpt.estimate import (
        activation_bytes,
        example_input,
        load_model,
        meta_model,
        snapshot_estimate,
    )
    from mpt.parse import one_of
    from mpt.precision import describe

    if world_size < 1:
        raise UsageError("--world-size", world_size, "it must be at least 1", "pass 1 or more")
    layout = ParallelPlan.for_world(world_size, pp=pipeline_stages)  # P must divide the world
    states = OPTIMIZER_STATES[one_of(*OPTIMIZER_STATES)("--optimizer", optimizer)]
    spec = describe(precision)
    net = meta_model(load_model(model))
    activations = 0
    if input_shape is not None:
        dtype = {"float32": torch.float32, "int64": torch.int64}[
            one_of("float32", "int64")("--input-dtype", input_dtype)]
        shape = parse_sizes("--input-shape", input_shape, "8,3,224,224")
        activations = activation_bytes(net, example_input(shape, dtype))
    gib = 2.0**30
    table = Table(title=f"per-rank memory, {world_size} ranks, {precision}, {optimizer} "
                  f"({sum(p.numel() for p in net.parameters()):,} parameters), GiB")
    table.add_column("backend and options", no_wrap=True)
    for column in ("parameters", "gradients", "optimizer", "activations", "device", "host"):
        table.add_column(column, justify="right", min_width=len(column))
    for _, cls in sorted(registered().items()):
        if cls.precision_refusal(spec, "cuda", {}) is not None:
            continue  # refused before start: nothing to estimate
        for row in cls.estimate_memory(net, spec, states, world_size, {}):
            table.add_row(row.label, *(f"{b / gib:.2f}" for b in (
                row.parameters, row.gradients, row.optimizer, activations,
                row.device + activations, row.host)))
    Console(width=max(out.width, 120)).print(table)  # the labels need the width
    out.print("device: the sum of the four; host: what offloading moves to host memory. "
              "Not counted: communication buffers, the allocator's slack and the process "
              "itself (a few hundred MiB at least); activations as saved for backward in the "
              "model's own dtype (autocast keeps some in 16 bits: fewer bytes).")
    per_node = world_size if gpus is None else gpus
    if per_node < 1 or world_size % per_node:
        raise UsageError("--gpus", gpus, f"it does not divide --world-size {world_size} into "
                         "nodes", f"pass a divisor of {world_size}")
    snap = snapshot_estimate(net, weight_bytes=spec.params.itemsize,
                             master_bytes=4 if spec.master != spec.params else 0,
                             optimizer_states=states, world_size=world_size, per_node=per_node)
    copies = " and their copies of the previous node's" if per_node < world_size else ""
    out.print(f"--snapshot-every: each rank's piece {snap.piece / gib:.2f} GiB (1/{world_size} "
              f"of the weights and optimizer state, under every backend); a node's store "
              f"{snap.store / gib:.2f} GiB (the newest two snapshots' pieces of its "
              f"{per_node} rank(s){copies}); taking one adds {snap.adds / 2**20:.0f} MiB per "
              "rank (transfer buffers), a "
              f"restore {snap.restore_adds / 2**20:.0f} MiB (the parts in flight: a window "
              f"of {CHUNK >> 20} MiB, or the largest tensor). A sharded rt.save adds at most "
              "one 256 MiB file per rank.")
    if layout.pp > 1:
        _print_stages(net, layout, spec, states)


def _print_stages(net: Any, layout: ParallelPlan, spec: Any, states: int) -> None:
    """Each pipeline stage's blocks, its bytes of parameters, gradients and optimizer state (a
    parameter two stages share counts on both), and what a rank of it holds under ddp and under
    fsdp's two pipeline modes."""
    from rich.table import Table

    from mpt.backends.fsdp import largest_unit
    from mpt.pipeline.split import Stage, stage_blocks

    gib, shards = 2.0**30, layout.dp_size
    table = Table(title=f"per-stage memory, {layout.pp} pipeline stages, {shards} replica(s) "
                        "each, GiB")
    columns = ("stage", "blocks", "count", "parameters", "gradients", "optimizer",
               "ddp rank", "fsdp rank", "fsdp rank, reshard")
    for column in columns:
        table.add_column(column, justify="left" if column == "blocks" else "right")
    for index, blocks in enumerate(stage_blocks(net, layout.pp)):
        params = {id(p): p for _, block in blocks for p in block.parameters()}.values()
        count = sum(p.numel() for p in params)
        trained = sum(p.numel() for p in params if p.requires_grad)
        masters = 4 * trained if spec.master != spec.params else 0
        weights, grads = count * spec.params.itemsize, trained * spec.params.itemsize
        optimizer = 4 * states * trained + masters
        whole = weights + grads + optimizer
        unit = spec.params.itemsize * largest_unit(Stage([blocks]), None)
        names = [name for name, _ in blocks]
        table.add_row(str(index), names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} "
                      f"({len(names)})", f"{count:,}",
                      *(f"{v / gib:.3f}" for v in (weights, grads, optimizer, whole,
                                                   whole / shards + weights + grads,
                                                   whole / shards + 3 * unit)))
    Console(width=max(out.width, 120)).print(table)
    out.print("Per rank of a stage, without activations: ddp holds the stage whole. fsdp holds "
              f"1/{shards} of it and, by default, the stage's weights and gradients unsharded "
              "through each step (torch's PipelineStage keeps them gathered over the "
              "micro-batches); with --fsdp-reshard-after-forward yes, only the unit it runs, "
              "the one it gathers ahead and that unit's gradients (at the cost of gathering "
              "and reduce-scattering once per micro-batch).")


@app.command()
def env(
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
    = False,
) -> None:
    """Report Python, torch, CUDA/NCCL, devices, backends and the detected cluster world."""
    import json
    import os

    from mpt import report

    facts = report.collect(os.environ)  # the report names the environment it was run in
    if json_output:
        out.print_json(json.dumps(facts))
    else:
        for table in report.tables(facts):
            out.print(table)


@app.command()
def visualize(
    run_dir: Annotated[Path, typer.Argument(help="A run's --run-dir.")],
    out_dir: Annotated[Path | None, typer.Option(
        "--out", metavar="DIR", help="Where the PNGs and index.html go (RUN_DIR/plots).")] = None,
    watch: Annotated[bool, typer.Option(
        "--watch", help="Redraw as the run writes, until Ctrl-C.")] = False,
    interval: Annotated[str, typer.Option(
        metavar="SECONDS", help="With --watch: seconds between redraws.")] = "10",
) -> None:
    """Draw a run's metrics: one PNG per curve (a line per rank) and a self-contained HTML page."""
    from mpt import visualize as draw

    draw.command(run_dir, out_dir, watch=watch, interval=interval, say=err.print)


config_app = typer.Typer(help="Config files for `mpt launch --config FILE`.",
                         no_args_is_help=True)
app.command("plan")(plan_command)
app.add_typer(config_app, name="config")
app.add_typer(checkpoint_app, name="checkpoint")
app.add_typer(install_app, name="install")


@config_app.command("init")
def config_init(
    ctx: typer.Context,
    path: Annotated[Path, typer.Argument(help="File to write: *.yaml, *.yml or *.toml.")]
    = Path("mpt.yaml"),
) -> None:
    """Write a commented template of every `mpt launch` option; never overwrites a file."""
    from mpt import config

    root = ctx.find_root()
    launch_command = root.command.get_command(root, "launch")  # type: ignore[attr-defined]
    config.write_template(path, typer.Context(launch_command, parent=root, info_name="launch"))
    out.print(f"wrote {path}: use it with `mpt launch --config {path} SCRIPT`")


def main() -> None:
    """Console-script entry point: run the app, turn usage errors into one line and exit 2."""
    try:
        # Without standalone mode typer returns a command's exit code instead of exiting.
        code = app(standalone_mode=False)
    except MptError as exc:
        err.print(f"mpt: error: {exc}", markup=False)
        sys.exit(USAGE_ERROR)
    except typer.TyperException as exc:  # typer's own parse errors (unknown option, ...)
        err.print(f"mpt: error: {exc.format_message().rstrip('.')}. Fix: see `mpt --help`")
        sys.exit(USAGE_ERROR)
    sys.exit(code if isinstance(code, int) else 0)
