"""The `mpt` command line: `mpt launch`, `mpt backends`.

Usage errors print one line, ``mpt: error: ...``, and exit with code 2: the user needs the
argument, the value and the fix, not a traceback.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from mpt.checkpoint.commands import app as checkpoint_app
from mpt.config import ConfigurableCommand, load_into_context
from mpt.errors import MptError, UsageError

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
T = TypeVar("T")

# Options `mpt launch` and `mpt horovodrun` share.
LogDirOption = Annotated[Path | None, typer.Option(
    metavar="DIR", help="Write each rank's stdout and stderr to DIR/rank<R>.log (an earlier job's "
    "logs move to DIR/previous-<time>/; horovodrun's own lines go to DIR/horovodrun.log); only "
    "--tee ranks reach the console.")]
TeeOption = Annotated[str | None, typer.Option(
    metavar="RANKS", help="With --log-dir: the global ranks also shown on the console, each line "
    "prefixed with its rank; comma-separated, or 'all' (default 0).")]
LocalRankArgOption = Annotated[bool, typer.Option(
    "--local-rank-arg", help="Pass --local_rank=<N> to the script, as torch.distributed.launch "
    "did (Apex-era scripts read it from argv).")]


def _version(show: bool) -> None:
    if show:
        from mpt import __version__

        out.print(f"mpt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print mpt's version.")] = False,
) -> None:
    """Mixed-precision, multi-process PyTorch training on the backend chosen by a flag."""


@app.command(cls=ConfigurableCommand, context_settings={"allow_interspersed_args": False,
                                                        "ignore_unknown_options": True})
def launch(
    script: Annotated[Path, typer.Argument(help="Training script each process runs.")],
    script_args: Annotated[list[str] | None, typer.Argument(
        help="Arguments for the script.")] = None,
    config: Annotated[Path | None, typer.Option(  # read by its callback, before the others
        metavar="FILE", is_eager=True, callback=load_into_context,
        help="YAML or TOML file of launch options (`mpt config init`); flags win.")] = None,
    nodes: Annotated[str, typer.Option(metavar="N", help="Nodes in the job.")] = "1",
    gpus: Annotated[str, typer.Option(metavar="G", help="Processes per node (one per GPU; "
                                      "CPU processes on gloo without CUDA).")] = "1",
    nr: Annotated[str, typer.Option(metavar="R", help="Rank of this node, 0..nodes-1.")] = "0",
    master_addr: Annotated[str, typer.Option(help="Address of node 0.")] = "127.0.0.1",
    master_port: Annotated[str, typer.Option(
        metavar="PORT", help="Rendezvous port on node 0; auto picks a free one (one node "
        "only).")] = "29500",
    backend: Annotated[str, typer.Option(help="Distributed backend (see `mpt backends`).")] = "ddp",
    precision: Annotated[str, typer.Option(
        help="fp32, fp16-mixed, bf16-mixed, or Apex's opt levels O0, O1, O2, O3 (O2-bf16, "
        "O3-bf16).")] = "fp32",
    loss_scale: Annotated[str, typer.Option(
        help="fp16 loss scaling: 'dynamic' or a static number.")] = "dynamic",
    keep_batchnorm_fp32: Annotated[str | None, typer.Option(
        metavar="BOOL", help="Opt levels O1-O3: Apex's override, True or False.")] = None,
    master_weights: Annotated[str | None, typer.Option(
        metavar="BOOL", help="Opt levels O1-O3: keep fp32 master weights, True or False.")] = None,
    cast_model_type: Annotated[str | None, typer.Option(
        metavar="DTYPE", help="Opt levels O1-O3: cast the model to float16, bfloat16 or "
        "float32.")] = None,
    log_dir: LogDirOption = None,
    tee: TeeOption = None,
    max_restarts: Annotated[str, typer.Option(
        metavar="K", help="Restart the whole gang this often after a failure.")] = "0",
    checkpoint_dir: Annotated[str | None, typer.Option(
        metavar="DIR", help="Where rt.save() writes and rt.resume() looks (a path or fsspec "
        "URL).")] = None,
    resume: Annotated[str | None, typer.Option(
        metavar="FROM", help="rt.resume(): auto (the latest checkpoint of --checkpoint-dir, if "
        "any; the default), never, or a checkpoint's path.")] = None,
    timeout: Annotated[str | None, typer.Option(
        metavar="SECONDS", help="A collective that waits longer for its peers fails instead of "
        "hanging (default 1800).")] = None,
    heartbeat_timeout: Annotated[str, typer.Option(
        metavar="SECONDS", help="Report a rank that made no progress for this long; 0 = "
        "never.")] = "300",
    grace_period: Annotated[str, typer.Option(
        metavar="SECONDS", help="Time a rank gets to exit (or to save, when preempted) before "
        "SIGKILL.")] = "30",
    rdzv_timeout: Annotated[str, typer.Option(
        metavar="SECONDS", help="How long node 0 waits for the other nodes to arrive.")] = "900",
    global_batch_size: Annotated[str | None, typer.Option(
        metavar="B", help="Samples per optimizer step over all processes; per-rank batch and "
        "accumulation follow (rt.batch_size, rt.accumulate).")] = None,
    lr_scaling: Annotated[str | None, typer.Option(
        metavar="RULE", help="Scale learning rates in the world size with rt.scale_lr: linear "
        "or sqrt.")] = None,
    hosts: Annotated[str | None, typer.Option(
        metavar="H1,H2", help="--backend horovod: the job's hosts, one per node (horovodrun "
        "starts them all from here).")] = None,
    hostfile: Annotated[Path | None, typer.Option(
        metavar="FILE", help="--backend horovod: hosts as 'HOST slots=N' lines.")] = None,
    horovod_controller: Annotated[str, typer.Option(
        metavar="C", help="--backend horovod: gloo or mpi.")] = "gloo",
    horovod_op: Annotated[str | None, typer.Option(
        metavar="OP", help="--backend horovod: average, sum or adasum.")] = None,
    horovod_compression: Annotated[str | None, typer.Option(
        metavar="C", help="--backend horovod: none or fp16 gradients on the wire.")] = None,
    fusion_threshold_mb: Annotated[str | None, typer.Option(
        metavar="MB", help="--backend horovod: tensor-fusion buffer, 0 = off.")] = None,
    cycle_time_ms: Annotated[str | None, typer.Option(
        metavar="MS", help="--backend horovod: wait between fusion cycles.")] = None,
    delay_allreduce: Annotated[bool, typer.Option(
        "--delay-allreduce", help="--backend apex: reduce all gradients after backward, in one "
        "bucket.")] = False,
    message_size: Annotated[str | None, typer.Option(
        metavar="N", help="--backend apex: elements per allreduce bucket.")] = None,
    allreduce_always_fp32: Annotated[bool, typer.Option(
        "--allreduce-always-fp32", help="--backend apex: reduce fp16 gradients in fp32.")] = False,
    gradient_predivide_factor: Annotated[str | None, typer.Option(
        metavar="F", help="--backend apex: divide gradients by F before the allreduce, "
        "multiply by F/world size after.")] = None,
    zero_stage: Annotated[str | None, typer.Option(
        metavar="S", help="--backend deepspeed: ZeRO stage 0, 1, 2 or 3.")] = None,
    offload: Annotated[str | None, typer.Option(
        metavar="WHAT", help="--backend deepspeed: none, optimizer, parameters (stage 3) or "
        "optimizer,parameters, moved to CPU memory.")] = None,
    deepspeed_config: Annotated[Path | None, typer.Option(
        metavar="FILE", help="--backend deepspeed: DeepSpeed JSON config; the flags fill only "
        "what it leaves out.")] = None,
    run_dir: Annotated[Path | None, typer.Option(
        metavar="DIR", help="Write metrics.jsonl and TensorBoard files here "
        "(`mpt visualize DIR` draws them).")] = None,
    quiet: Annotated[bool, typer.Option(
        "--quiet", help="No progress bar or progress lines.")] = False,
    log_every: Annotated[str, typer.Option(
        metavar="STEPS", help="Optimizer steps between two metric records.")] = "10",
    metrics_all_ranks: Annotated[bool, typer.Option(
        "--metrics-all-ranks", help="Every rank writes metrics, not only rank 0.")] = False,
    local_rank_arg: LocalRankArgOption = False,
    dry_run: Annotated[bool, typer.Option(
        help="Print every process of the job and exit.")] = False,
) -> None:
    """Start this node's processes of a (multi-node) training job."""
    import torch

    from mpt import launchers
    from mpt.launchers.horovod_join import check_port
    from mpt.metrics.config import parse_log_every

    if str(script).startswith("-"):
        raise UsageError("option", script, "mpt launch has no such option",
                         "see `mpt launch --help`; options for the script go after SCRIPT")
    # Each backend's own flags; the spec checks them against the chosen backend's options.
    backend_options = {k: v for k, v in {
        "op": horovod_op, "compression": horovod_compression,
        "fusion_threshold_mb": _maybe(_int, "--fusion-threshold-mb", fusion_threshold_mb),
        "cycle_time_ms": _maybe(_number, "--cycle-time-ms", cycle_time_ms),
        "delay_allreduce": delay_allreduce or None,
        "allreduce_always_fp32": allreduce_always_fp32 or None,
        "message_size": _maybe(_int, "--message-size", message_size),
        "gradient_predivide_factor": _maybe(_number, "--gradient-predivide-factor",
                                            gradient_predivide_factor),
        "zero_stage": zero_stage, "offload": offload,
        "config": None if deepspeed_config is None else str(deepspeed_config.resolve()),
    }.items() if v is not None}
    spec = launchers.LaunchSpec(
        script=script, script_args=tuple(script_args or ()), nodes=_int("--nodes", nodes),
        gpus=_int("--gpus", gpus), nr=_int("--nr", nr), master_addr=master_addr,
        master_port=launchers.parse_port(master_port, _int("--nodes", nodes)), backend=backend,
        precision=precision,
        loss_scale=loss_scale, backend_options=backend_options, log_dir=log_dir,
        precision_options={k: v for k, v in {
            "keep_batchnorm_fp32": keep_batchnorm_fp32, "master_weights": master_weights,
            "cast_model_type": cast_model_type}.items() if v is not None},
        max_restarts=_int("--max-restarts", max_restarts), checkpoint_dir=checkpoint_dir,
        resume=resume, timeout=_maybe(_number, "--timeout", timeout),
        heartbeat_timeout=_number("--heartbeat-timeout", heartbeat_timeout),
        grace_period=_int("--grace-period", grace_period),
        rdzv_timeout=_int("--rdzv-timeout", rdzv_timeout),
        global_batch_size=_maybe(_int, "--global-batch-size", global_batch_size),
        lr_scaling=lr_scaling, run_dir=run_dir, quiet=quiet,
        log_every=parse_log_every(log_every), metrics_all_ranks=metrics_all_ranks,
        local_rank_arg=local_rank_arg)
    if tee is not None:  # checked against the world, so after the spec has checked the world
        spec = dataclasses.replace(spec, tee=_tee(tee, spec))
    if hosts or hostfile or _horovodrun_starts(spec.backend):
        _launch_horovodrun(spec, hosts, hostfile, horovod_controller, dry_run)
        return
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dry_run:
        _print_plan(spec, cuda_devices)
        return
    spec.check_machine(cuda_devices)
    check_port(spec)
    if not cuda_devices:
        err.print(f"mpt: no CUDA device here: running {spec.gpus} CPU process(es) per node on gloo")
    outcome = launchers.run(spec, report=err.print)
    for line in outcome.lines:
        err.print(line)
    if outcome.exit_code:
        raise typer.Exit(outcome.exit_code)


def _tee(value: str, spec: LaunchSpec) -> frozenset[int]:
    """``--tee``'s ranks; it selects among the log files, so it needs ``--log-dir``."""
    from mpt.launchers.logs import parse_tee

    if spec.log_dir is None:
        raise UsageError("--tee", value, "it needs --log-dir (without it every rank prints to "
                         "the console)", "add --log-dir DIR, or leave --tee out")
    return parse_tee(value, spec.world.world_size)


def _maybe(parse: Callable[[str, str], T], flag: str, value: str | None) -> T | None:
    """``parse(flag, value)``, or None for an option that was not given."""
    return None if value is None else parse(flag, value)


def _number(flag: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise UsageError(flag, value, "it is not a number", f"pass {flag} 5, 0.5, ...") from None


def _horovodrun_starts(backend: str) -> bool:
    """Whether the backend's processes must be started by horovodrun (it says so itself)."""
    from mpt.backends import get_backend

    return get_backend(backend).launcher == "horovodrun"


def _launch_horovodrun(spec: LaunchSpec, hosts: str | None, hostfile: Path | None,
                       controller: str, dry_run: bool) -> None:
    """Run the whole job (every node) through one horovodrun; its exit code becomes ours."""
    import shlex

    from mpt.launchers import horovodrun

    if not _horovodrun_starts(spec.backend):
        raise UsageError("--hosts" if hosts else "--hostfile", hosts or hostfile,
                         f"backend {spec.backend!r} is not started by horovodrun",
                         "use --backend horovod, or run `mpt launch --nr R` on each node")
    job_hosts = horovodrun.job_hosts(spec, hosts, hostfile)
    command = horovodrun.horovodrun_command(spec, job_hosts, controller)
    if dry_run:
        settings = " ".join(f"{k}={shlex.quote(v)}"
                            for k, v in horovodrun.horovodrun_env(spec).items())
        out.print(f"{settings} {shlex.join(command)}")
        return
    result = horovodrun.run(spec, job_hosts, controller)
    for line in result.lines(spec.local_rank_arg):
        err.print(line, markup=False)
    if result.code:
        raise typer.Exit(result.code)


def _int(flag: str, value: str) -> int:
    """Integer options are parsed here so that a bad one gets mpt's one-line error."""
    try:
        return int(value)
    except ValueError:
        raise UsageError(flag, value, "it is not a whole number",
                         f"pass {flag} 1, 2, ...") from None


def _print_plan(spec: LaunchSpec, cuda_devices: int) -> None:
    from mpt.environments import device_name

    table = Table(title=f"{spec.script} on {spec.world.world_size} process(es): backend "
                  f"{spec.backend}, precision {spec.precision}, rendezvous "
                  f"{spec.master_addr}:{spec.master_port}")
    for column in ("node", "local rank", "global rank", "device"):
        table.add_column(column, justify="right" if column != "device" else "left")
    for node, local_rank, rank in spec.world.all_processes():
        table.add_row(str(node), str(local_rank), str(rank),
                      device_name(local_rank, cuda_devices > 0))
    out.print(table)
    if spec.global_batch_size is not None:
        out.print(f"global batch size {spec.global_batch_size}: "
                  f"{spec.global_batch_size // spec.world.world_size} samples per process per "
                  "optimizer step (micro-batch size x accumulation)")
    if spec.lr_scaling is not None:
        from mpt.scaling import lr_factor

        out.print(f"lr scaling {spec.lr_scaling}: learning rates x "
                  f"{lr_factor(spec.lr_scaling, spec.world.world_size):g}")


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
    from mpt.environments.settings import settings_env
    from mpt.launchers import horovodrun as hvdrun
    from mpt.precision import LossScaleConfig, check_precision

    check_precision(precision)
    LossScaleConfig.parse(loss_scale)
    env = settings_env(backend="horovod", precision=precision, loss_scale=loss_scale)
    result = hvdrun.run_passthrough(args, env, log_dir=log_dir, tee=tee,
                                    local_rank_arg=local_rank_arg)
    for line in result.lines(local_rank_arg):
        err.print(line, markup=False)
    if result.code:
        raise typer.Exit(result.code)


@app.command()
def backends() -> None:
    """List every backend, whether it can run here, and what to install if not."""
    from mpt.backends import broken, registered

    table = Table(title="mpt backends")
    for column in ("backend", "available", "version", "reason / install"):
        table.add_column(column)
    for name, cls in sorted(registered().items()):
        info = cls.availability()
        note = "" if info.available else f"{info.reason}; {info.install}"
        table.add_row(name, "yes" if info.available else "no", info.version, note)
    for name, reason in sorted(broken().items()):
        table.add_row(name, "no", "", reason)
    out.print(table)


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
app.add_typer(config_app, name="config")
app.add_typer(checkpoint_app, name="checkpoint")


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
