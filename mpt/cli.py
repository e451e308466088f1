"""The `mpt` command line: `mpt launch`, `mpt backends`.

Usage errors print one line, ``mpt: error: ...``, and exit with code 2: the user needs the
argument, the value and the fix, not a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

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


@app.command(context_settings={"allow_interspersed_args": False,
                               "ignore_unknown_options": True})
def launch(
    script: Annotated[Path, typer.Argument(help="Training script each process runs.")],
    script_args: Annotated[list[str] | None, typer.Argument(
        help="Arguments for the script.")] = None,
    nodes: Annotated[str, typer.Option(metavar="N", help="Nodes in the job.")] = "1",
    gpus: Annotated[str, typer.Option(metavar="G", help="Processes per node (one per GPU; "
                                      "CPU processes on gloo without CUDA).")] = "1",
    nr: Annotated[str, typer.Option(metavar="R", help="Rank of this node, 0..nodes-1.")] = "0",
    master_addr: Annotated[str, typer.Option(help="Address of node 0.")] = "127.0.0.1",
    master_port: Annotated[str, typer.Option(metavar="PORT",
                                             help="Rendezvous port on node 0.")] = "29500",
    backend: Annotated[str, typer.Option(help="Distributed backend (see `mpt backends`).")] = "ddp",
    precision: Annotated[str, typer.Option(
        help="fp32, fp16-mixed or bf16-mixed.")] = "fp32",
    loss_scale: Annotated[str, typer.Option(
        help="fp16 loss scaling: 'dynamic' or a static number.")] = "dynamic",
    log_dir: Annotated[Path | None, typer.Option(
        help="Also write each rank's output to a file here.")] = None,
    max_restarts: Annotated[str, typer.Option(
        metavar="K", help="Restart the whole gang this often after a failure.")] = "0",
    dry_run: Annotated[bool, typer.Option(
        help="Print every process of the job and exit.")] = False,
) -> None:
    """Start this node's processes of a (multi-node) training job."""
    import torch

    from mpt import launchers

    if str(script).startswith("-"):
        raise UsageError("option", script, "mpt launch has no such option",
                         "see `mpt launch --help`; options for the script go after SCRIPT")
    spec = launchers.LaunchSpec(
        script=script, script_args=tuple(script_args or ()), nodes=_int("--nodes", nodes),
        gpus=_int("--gpus", gpus), nr=_int("--nr", nr), master_addr=master_addr,
        master_port=launchers.parse_port(master_port), backend=backend, precision=precision,
        loss_scale=loss_scale, log_dir=log_dir, max_restarts=_int("--max-restarts", max_restarts))
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dry_run:
        _print_plan(spec, cuda_devices)
        return
    spec.check_machine(cuda_devices)
    if not cuda_devices:
        err.print(f"mpt: no CUDA device here: running {spec.gpus} CPU process(es) per node on gloo")
    failure = launchers.run(spec)
    if failure is not None:
        how = (f"was killed by {failure.signal}" if failure.signal
               else f"exited with code {failure.exit_code}")
        err.print(f"mpt: rank {failure.rank} (node {spec.nr}, local rank "
                  f"{failure.local_rank}) {how}; the job was stopped")
        raise typer.Exit(failure.exit_code)


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


def main() -> None:
    """Console-script entry point: run the app, turn usage errors into one line and exit 2."""
    try:
        # Without standalone mode typer returns a command's exit code instead of exiting.
        code = app(standalone_mode=False)
    except MptError as exc:
        err.print(f"mpt: error: {exc}")
        sys.exit(USAGE_ERROR)
    except typer.TyperException as exc:  # typer's own parse errors (unknown option, ...)
        err.print(f"mpt: error: {exc.format_message().rstrip('.')}. Fix: see `mpt --help`")
        sys.exit(USAGE_ERROR)
    sys.exit(code if isinstance(code, int) else 0)
