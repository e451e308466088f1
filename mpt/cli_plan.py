"""`mpt plan`: the layouts of a model on a cluster, priced by a cost model, best first.

Registered in mpt/cli.py as ``app.command("plan")(plan_command)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from mpt.errors import UsageError
from mpt.estimate import OPTIMIZER_STATES

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mpt.environments.world import World
    from mpt.plan.calibrate import Calibration
    from mpt.plan.profiles import BackendStep, StepSpec

err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)
GIB = 2.0**30
INPUT_DTYPES = {"float32": "float32", "int64": "int64"}


def plan_command(
    model: Annotated[str | None, typer.Argument(
        help="FILE.py:FUNCTION or package.module:FUNCTION: builds the model (run on the meta "
        "device).")] = None,
    nodes: Annotated[int, typer.Option(help="Nodes of the cluster.")] = 1,
    gpus: Annotated[int, typer.Option(help="Devices (ranks) per node.")] = 1,
    link: Annotated[str | None, typer.Option(
        help="Each node's link to the others: 100gbit, 200gbit, 400gbit, ..., or a rate "
        "such as 25gbit (default: the --calibration's link measured across nodes, else "
        "100gbit).")] = None,
    device: Annotated[str, typer.Option(
        help="Datasheet device profile: h100-sxm, h200, a100-sxm-80gb, a100-sxm-40gb, "
        "p100-pcie.")
    ] = "h100-sxm",
    calibration: Annotated[Path | None, typer.Option(
        metavar="FILE", help="Use this machine's figures measured by --calibrate instead of "
        "--device.")] = None,
    batch: Annotated[int | None, typer.Option(
        help="Samples per optimizer step over all ranks (default 8 per rank).")] = None,
    input_shape: Annotated[str | None, typer.Option(
        help="One sample's shape, e.g. 3,224,224, or 128 (tokens) with --input-dtype int64; "
        "default: the first layer's input features.")] = None,
    input_dtype: Annotated[str, typer.Option(help="float32, or int64 for token ids.")
                           ] = "float32",
    precision: Annotated[str, typer.Option(help="As `mpt launch --precision`.")] = "fp32",
    optimizer: Annotated[str, typer.Option(
        help=f"Its state per parameter: {', '.join(OPTIMIZER_STATES)}.")] = "adam",
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON for tools.")] = False,
    top: Annotated[int, typer.Option(
        metavar="N", help="The table shows the N fastest layouts and the N closest to "
        "fitting (0: all; --json lists all).")] = 25,
    calibrate: Annotated[bool, typer.Option(
        "--calibrate", help="Measure this machine (matmuls by dtype, memory, collectives "
        "between its --gpus processes, at least 2) and save the figures; with --nodes N, run "
        "it on every node with its --nr: the link between the nodes is measured too; with "
        "MODEL, time that model's own step too (at --batch over the ranks, --precision, "
        "--optimizer), which a plan of it with --calibration then scales its compute by.")
    ] = False,
    output: Annotated[Path, typer.Option(
        metavar="FILE", help="With --calibrate: where the figures go (on node 0).")
    ] = Path("mpt-calibration.json"),
    nr: Annotated[int, typer.Option(help="With --calibrate --nodes N: this node's rank, "
                                    "0..N-1.")] = 0,
    master_addr: Annotated[str, typer.Option(
        help="With --calibrate --nodes N: node 0's address.")] = "127.0.0.1",
    master_port: Annotated[int, typer.Option(
        help="With --calibrate --nodes N: a free port on node 0.")] = 29500,
) -> None:
    """Rank every layout mpt can run for MODEL on --nodes x --gpus: memory per rank, step time
    (compute, exposed communication, pipeline bubble), bytes per link, and what limits each."""
    for flag, count in (("--nodes", nodes), ("--gpus", gpus)):
        if count < 1:
            raise UsageError(flag, count, "it must be at least 1", f"pass {flag} 1 or more")
    if top < 0:
        raise UsageError("--top", top, "it cannot be negative", "pass 0 for every layout, or N")
    if model is None and not calibrate:
        raise UsageError("MODEL", "(none)", "no model to plan for",
                         "pass FILE.py:FUNCTION, or --calibrate to measure this machine")
    import torch

    from mpt.estimate import load_model, meta_model
    from mpt.parse import one_of

    one_of(*OPTIMIZER_STATES)("--optimizer", optimizer)
    dtype = getattr(torch, one_of(*INPUT_DTYPES)("--input-dtype", input_dtype))
    net = shape = None
    if model is not None:
        net = meta_model(load_model(model))
        shape = _input_shape(input_shape, net)
        _check_input(net, shape, dtype)
    if calibrate:
        from mpt.environments.world import World
        from mpt.plan.profiles import StepSpec
        from mpt.precision import describe

        describe(precision)  # refused here, in one line, not in every process
        ranks = nodes * gpus
        per_rank = 8 if batch is None else batch // ranks
        if batch is not None and (batch < ranks or batch % ranks):
            raise UsageError("--batch", batch, f"it does not split over {ranks} rank(s)",
                             f"pass a multiple of {ranks}")
        step = None
        if model is not None and shape is not None:
            step = StepSpec(model=model, input_shape=tuple(shape), input_dtype=input_dtype,
                            micro_batch=per_rank, precision=precision, optimizer=optimizer)
        # one node: a collective needs two processes, on a port of this machine's choosing
        world = World(nodes=nodes, gpus=gpus if nodes > 1 else max(gpus, 2), nr=nr,
                      master_addr=master_addr, master_port=master_port,
                      source="mpt plan --calibrate")
        found = _calibrate(world, step, gpus)
        if found is not None:
            _say_calibrated(found, output)
        return
    assert model is not None and net is not None and shape is not None
    from mpt.plan.network import Cluster
    from mpt.plan.planner import plan
    from mpt.plan.profiles import device_profile, link_profile

    measured = step = None
    if calibration is not None:
        from mpt.plan import calibrate as calibrated

        found = calibrated.load(calibration)
        chosen = found.device(str(calibration))
        measured = None if link is not None else found.measured_link(str(calibration))
        step = found.measured_step()
    else:
        chosen = device_profile(device)
    cluster = Cluster(nodes=nodes, gpus=gpus, device=chosen,
                      link=measured or link_profile(link or "100gbit"))
    result = plan(net, cluster, precision=precision,
                  batch=batch if batch is not None else 8 * cluster.world_size,
                  input_shape=shape, input_dtype=dtype, optimizer=optimizer, step=step)
    script = model.rpartition(":")[0] if model.rpartition(":")[0].endswith(".py") else "TRAIN.py"
    if json_output:
        from mpt.plan.report import as_json

        out.print_json(json.dumps(as_json(result, script)))
    else:
        from mpt.plan.report import print_tables

        print_tables(result, script, Console(width=max(out.width, 160), highlight=False),
                     top=top)


def _input_shape(given: str | None, net: object) -> list[int]:
    """``--input-shape`` parsed, or the first Linear's input features."""
    from torch import nn

    if given is not None:
        from mpt.parse import parse_sizes

        return parse_sizes("--input-shape", given, "3,224,224")
    assert isinstance(net, nn.Module)
    first = next((m for m in net.modules() if not list(m.children())
                  and any(True for _ in m.parameters())), None)
    if isinstance(first, nn.Linear):
        return [first.in_features]
    raise UsageError("--input-shape", "(none)", f"the model's first layer is "
                     f"{type(first).__name__}, whose input shape is not known",
                     "pass one sample's shape, e.g. --input-shape 3,224,224, or --input-shape "
                     "128 --input-dtype int64 for 128 tokens")


def _check_input(net: nn.Module, shape: list[int], dtype: torch.dtype) -> None:
    """A forward of two samples of ``shape`` on the meta device (batch norm refuses one): a
    UsageError where the model refuses them."""
    from mpt.estimate import example_input
    from mpt.plan.workload import MODEL_ERRORS, refusal

    try:
        net(example_input([2, *shape], dtype))
    except MODEL_ERRORS as exc:
        raise UsageError("--input-shape", ",".join(map(str, shape)), f"the model's forward "
                         f"refuses a sample of that shape ({refusal(exc)})",
                         "pass one sample's shape as the model takes it, e.g. --input-shape "
                         "3,224,224, or --input-shape 128 --input-dtype int64") from None


def _calibrate(world: World, step: StepSpec | None, training: int) -> Calibration | None:
    """The figures ``world``'s processes on this node measure with every other node's (None
    on nodes other than node 0): ``training`` of them at once for the device figures and
    ``step``'s model."""
    from mpt.plan import calibrate

    across = f" and across {world.nodes} nodes" if world.nodes > 1 else ""
    model = "" if step is None else f", then {step.model}'s own step"
    err.print(f"measuring: collectives between {world.gpus} process(es) per node{across}, then "
              f"matmuls by shape, memory, op overhead and optimizer steps{model} (about 30 s "
              "on 2 CPU cores)")
    if world.nodes == 1:
        return calibrate.measure(world.gpus, step, training)
    return calibrate.measure_nodes(world, step, training)


def _timed_alone(alone: BackendStep) -> str:
    """What the calibration's summary says of one backend's step timed alone."""
    words = (f"; under --backend {alone.backend} {alone.options} at one rank "
             f"{alone.step * 1e3:.1f} ms a step")
    if alone.accumulated is not None:
        words += f", of 2 micro-batches {alone.accumulated * 1e3:.1f} ms"
    if alone.plain is not None:
        words += f" (the plain step beside it {alone.plain * 1e3:.1f} ms)"
    return words


def _say_calibrated(found: Calibration, output: Path) -> None:
    from mpt.plan import calibrate

    calibrate.save(found, output)
    flops = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in found.flops.items())
    between = (f"across {found.nodes} nodes: allreduce bus bandwidth "
               f"{found.link['all_reduce']['bus_bandwidth'] / 1e9:.2f} GB/s; " if found.link
               else "")
    step = found.measured_step()
    timed = "" if step is None else (
        f"; {step.spec.model}'s step at micro-batch {step.spec.micro_batch}: forward + "
        f"backward {step.forward_backward * 1e3:.1f} ms"
        + "".join(f", in {k} pieces {seconds * 1e3:.1f} ms" for k, seconds in step.split.items())
        + f", {step.spec.optimizer} step {step.update * 1e3:.1f} ms"
        + "".join(_timed_alone(alone) for alone in step.alone))
    err.print(f"wrote {output}: matmul GFLOP/s {flops}; memory "
              f"{found.memory_bandwidth / 1e9:.1f} GB/s; {between}allreduce bus bandwidth "
              f"within a node {found.collectives['all_reduce']['bus_bandwidth'] / 1e9:.2f} GB/s "
              f"({found.backend}, {found.ranks} process(es) per node){timed}. Use it with "
              f"--calibration {output}")
