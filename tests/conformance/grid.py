"""The conformance grid: every backend x precision x world size x accumulation on one fixed job.

usage: python tests/conformance/grid.py [--backends ddp,apex] [--precisions fp32,O2]
                                        [--shapes 1x1,2x2] [--zero-stages 0,3]
                                        [--compressions fp16,bf16,powersgd]
                                        [--pipeline-stages 1,2] [--tensor-parallel 2]
                                        [--output FILE]

Each cell is one `mpt launch --gpus WS --backend B --precision P` of
tests/workers/conformance_job.py (the model, data and optimizer are in conformance_model.py)
with accumulation ACC, judged against ddp fp32 at the same world size and accumulation, which
sees the same global batch of 64 samples per step. Deviations are relative: the largest over the
steps of |loss - reference| / reference, and for the weights ||W - W_ref|| / ||W_ref - W_0||
over all parameters (the distance from the reference's weights as a fraction of the distance the
reference trained them from their initial values W_0).

- P (pass): it trained and matches the reference: fp32 and O0 within 1e-5 on the losses and
  the weights; a mixed precision within ``TOLERANCE_FACTOR`` times the largest deviation that
  the same loop in plain torch (no mpt) shows from plain torch fp32 in the recipes of the grid
  that compute in the same dtype (fp16: autocast + loss scaling, fp16 model + fp32 masters, pure
  fp16; bf16: autocast, bf16 model + fp32 masters), measured in this run on the reference's
  micro-batches, and at least ``FLOOR``; its loss also goes down, stays finite, and differs from
  fp32 (the precision was on).
- R (refused): `mpt launch` exited with 2 and one line on stderr naming the backend and the
  precision, before any worker process started.
- F (fail): anything else (wrong numbers, NaN, a crash, a traceback, another exit code, a
  refusal after start). The grid exits with 1 when a cell fails.

The pipeline rows (``--pipeline-stages``, default 1,2; P = 1 is every other row) run the
backends that pipeline (ddp, fsdp) with the model cut into P stages: their world size is the
data-parallel size (P x ws processes), and each shape's reference is ddp fp32 at the same P,
checked against plain torch fp32 on the micro-batches the schedule ran (M per replica batch:
batch norm sees those).

The tensor-parallel rows (``--tensor-parallel``, default 2) run the backends that split layers
(ddp, fsdp) with the model's head split over T ranks (``ConvNet.tensor_parallel_plan``), at
every pipeline P: T x P x ws processes (at most ``MAX_TP_PROCESSES``), judged against the
reference of the same ws and P.

The compression rows run each backend in fp32 with `--grad-compression C`: fp16 and bf16 are
judged as mixed cells of ``COMPRESSED_AS[C]`` (within that mixed-precision tolerance of the
uncompressed run, and not equal to it: the compression was on); PowerSGD (``POWERSGD_OPTIONS``)
within what losing one update of the ten does (see ``judge.judge_run``). A backend that cannot
do C must refuse it before start, naming backend and compression. They run at world size 2
only: one process has no gradients to communicate.

The reference is itself a cell (ddp, fp32), checked the same way against plain torch fp32.
The table is printed and written as Markdown to docs/support-matrix.md (``--output``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conformance_model import STEPS, plain_run
from judge import (
    BACKENDS,
    COMPRESSIONS,
    FP32_CLASS,
    POWERSGD_OPTIONS,
    PRECISIONS,
    SHAPES,
    Cell,
    Outcome,
    Run,
    judge_refusal,
    judge_run,
    measure_baseline,
    measure_planted,
    tolerance_of,
)

from mpt.backends import get_backend

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "workers" / "conformance_job.py"
CELL_TIMEOUT = 600.0


@dataclass
class Reference:
    """ddp fp32 at one shape, and plain torch's deviations per recipe on its micro-batches."""

    run: Run | None
    outcome: Outcome
    baseline: dict[str, tuple[float, float]] = field(default_factory=dict)
    """recipe -> (loss, weight) deviation of plain torch in that recipe from plain torch fp32."""
    planted: dict[str, tuple[float, float]] = field(default_factory=dict)
    """planted bug -> (loss, weight) deviation of plain torch fp32 with it from without."""


# -- running a cell ----------------------------------------------------------------------------

def environment() -> dict[str, str]:
    """The launch environment: DeepSpeed's JIT-built op cached where `make` caches it."""
    return {**os.environ, "COLUMNS": "200", "TORCH_EXTENSIONS_DIR": os.environ.get(
        "TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))}


def command(cell: Cell, out: Path) -> list[str]:
    stage = [] if cell.zero_stage is None else ["--zero-stage", str(cell.zero_stage)]
    comm = [] if cell.compression == "none" else ["--grad-compression", cell.compression]
    if cell.compression == "powersgd" and set(POWERSGD_OPTIONS) <= set(
            get_backend(cell.backend).options):  # the others must refuse powersgd itself
        comm += ["--backend-options", json.dumps(POWERSGD_OPTIONS)]
    pipeline = ["--pipeline-stages", str(cell.stages)] if cell.stages > 1 else []
    hsdp = ["--fsdp-replicate", str(cell.replicate)] if cell.replicate > 1 else []
    tp = ["--tensor-parallel", str(cell.tp)] if cell.tp > 1 else []
    return [sys.executable, "-m", "mpt", "launch", "--gpus", str(cell.processes),
            "--master-port", "auto", "--backend", cell.backend, "--precision", cell.precision,
            *stage, *comm, *pipeline, *hsdp, *tp, str(JOB), str(out), str(cell.accumulate)]


def launch(cell: Cell, out: Path) -> tuple[subprocess.CompletedProcess[str] | None, float]:
    """Run the cell's `mpt launch` outside the checkout (in ``out``), so that the mpt the
    workers import is the installed one, or PYTHONPATH's."""
    began = time.monotonic()
    try:
        result = subprocess.run(command(cell, out), capture_output=True, text=True, cwd=out,
                                timeout=CELL_TIMEOUT, env=environment())
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - began
    return result, time.monotonic() - began


def read_run(out: Path, cell: Cell) -> Run:
    from safetensors.torch import load_file

    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(cell.processes)]
    acc = cell.accumulate
    for r, data in enumerate(ranks):
        if (data["world_size"], data["accumulate"]) != (cell.processes, acc):
            raise ValueError(f"rank {r} ran world size {data['world_size']}, accumulation "
                             f"{data['accumulate']}")
        ran = (data["backend"], data["precision"], data["compression"])
        if ran != (cell.backend, cell.precision, cell.compression):
            raise ValueError(f"rank {r} ran backend {ran[0]}, precision {ran[1]}, compression "
                             f"{ran[2]}")
        if len(data["losses"]) != STEPS * acc:
            raise ValueError(f"rank {r} ran {len(data['losses'])} micro-batches, not "
                             f"{STEPS * acc}")
    losses, schedule, stepped = [], [], []
    # a replica's stages and tp ranks read one batch
    readers = [data for data in ranks if data["stage"] == 0 and data["tp"] == 0]
    for s in range(STEPS):
        micro = range(s * acc, (s + 1) * acc)
        values = [data["losses"][k] for data in readers for k in micro]
        losses.append(sum(values) / len(values))
        schedule.append([chunk for data in readers for k in micro
                         for chunk in data["indices"][k]])
        stepped.append(all(data["stepped"][(s + 1) * acc - 1] for data in ranks))
    off = sum(bool(v) for data in ranks for k, v in enumerate(data["stepped"])
              if (k + 1) % acc != 0)
    return Run(losses=losses, schedule=schedule, params=load_file(out / "weights.safetensors"),
               stepped=stepped, off_boundary_steps=off)


ERROR_LINE = re.compile(r"^([\w.]+(Error|Exception|Interrupt)|SystemExit)\b.*")
PREFIX = re.compile(r"^(\[\d+\]<std(out|err)>:)?(\[rank\d+\]:)?\s*")
"""What horovodrun ("[1]<stderr>:") and torch's agent ("[rank1]:") put before a worker's line."""


def error_summary(result: subprocess.CompletedProcess[str]) -> str:
    """The first exception line a worker printed, else mpt's own last line."""
    lines = [PREFIX.sub("", line).strip()
             for line in (result.stderr + "\n" + result.stdout).splitlines()]
    lines = [line for line in lines if line]
    raised = [line for line in lines if ERROR_LINE.match(line)]
    mpt_lines = [line for line in lines if line.startswith("mpt:")]
    picked = raised[0] if raised else (mpt_lines[-1] if mpt_lines else (lines[-1] if lines
                                                                        else "no output"))
    return f"exit {result.returncode}: {picked[:300]}"


def run_cell(cell: Cell, reference: Reference | None) -> tuple[Outcome, Run | None]:
    """Launch one cell and judge it against ``reference``, or without one against plain torch
    fp32 on the micro-batches the cell saw (how the reference itself is checked)."""
    with tempfile.TemporaryDirectory(prefix="mpt-conformance-") as tmp:
        out = Path(tmp)
        result, seconds = launch(cell, out)
        if result is None:
            return Outcome(cell, "F", f"no result after {CELL_TIMEOUT:.0f} s", seconds), None
        if result.returncode == 2:
            return judge_refusal(cell, result, out, seconds), None
        if result.returncode != 0:
            return Outcome(cell, "F", error_summary(result), seconds), None
        try:
            run = read_run(out, cell)
        except (OSError, ValueError, KeyError) as exc:
            return Outcome(cell, "F", f"exit 0 but its results are unusable: {exc}",
                           seconds), None
    if reference is None:  # (the reference itself) plain torch fp32 on the same micro-batches
        plain = plain_run("fp32", run.schedule)
        want = Run(losses=plain.losses, schedule=run.schedule, params=plain.params,
                   stepped=[True] * STEPS, off_boundary_steps=0)
        baseline = (None if cell.precision in FP32_CLASS and cell.compression == "none"
                    else tolerance_of(measure_baseline(run.schedule), cell))
        outcome = judge_run(cell, run, want, baseline, seconds)
        outcome.detail += " (vs plain torch fp32)"
        return outcome, run
    if reference.run is None:
        return Outcome(cell, "F", f"no reference: ddp fp32 {cell.shape} failed", seconds), run
    return judge_run(cell, run, reference.run, tolerance_of(reference.baseline, cell),
                     seconds, reference.planted), run


def make_reference(world_size: int, accumulate: int, stages: int = 1) -> Reference:
    """ddp fp32 at this shape and pipeline (a failed check against plain torch fails that cell
    only; the others are still compared with what it trained, if it trained)."""
    outcome, run = run_cell(Cell("ddp", "fp32", world_size, accumulate, stages=stages), None)
    if run is None:
        return Reference(run=None, outcome=outcome)
    return Reference(run=run, outcome=outcome, baseline=measure_baseline(run.schedule),
                     planted=measure_planted(run.schedule))


def run_grid(cells: Sequence[Cell], log=print) -> tuple[list[Outcome], dict[str, Reference]]:
    """Run ``cells`` one after the other (the references first); their outcomes, and the
    references by shape (``ws2 acc2``)."""
    references: dict[tuple[int, int, int], Reference] = {}
    outcomes = []
    for cell in sorted(cells, key=lambda c: (c.stages, c.world_size, c.accumulate)):
        shape = (cell.world_size, cell.accumulate, cell.stages)
        if shape not in references:
            references[shape] = make_reference(*shape)
            reference = Cell("ddp", "fp32", *shape[:2], stages=cell.stages)
            log(f"{references[shape].outcome.verdict} {reference} (reference) "
                f"{references[shape].outcome.seconds:5.1f} s  {references[shape].outcome.detail}")
        if (cell.backend, cell.precision, cell.zero_stage, cell.compression) == (
                "ddp", "fp32", None, "none"):
            outcome = references[shape].outcome
        else:
            outcome, _ = run_cell(cell, references[shape])
            log(f"{outcome.verdict} {cell} {outcome.seconds:5.1f} s  {outcome.detail}")
        outcomes.append(outcome)
    return outcomes, {f"ws{ws} acc{acc}" + (f" P{p}" if p > 1 else ""): ref
                      for (ws, acc, p), ref in references.items()}


# -- command line ------------------------------------------------------------------------------

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--shapes", default=",".join(f"{ws}x{acc}" for ws, acc in SHAPES),
                        help="world size x accumulation pairs, e.g. 1x1,2x2")
    parser.add_argument("--zero-stages", default="",
                        help="also run deepspeed at these ZeRO stages (e.g. 0,1,2,3); "
                        "deepspeed's own row uses mpt's default stage")
    parser.add_argument("--pipeline-stages", default="1,2",
                        help="the rows of each --pipeline-stages P: 1, every row above; more, "
                        "the backends that pipeline (ddp, fsdp), the world being P x ws")
    parser.add_argument("--tensor-parallel", default="2",
                        help="the tp rows: ddp and fsdp at each --tensor-parallel T (with every "
                        "--pipeline-stages P), the world being T x P x ws ('' for none)")
    parser.add_argument("--compressions", default=",".join(COMPRESSIONS),
                        help="also run every backend in fp32 with each --grad-compression "
                        "('' for none)")
    parser.add_argument("--output", default=str(ROOT / "docs" / "support-matrix.md"),
                        help="Markdown file to write ('' for none)")
    return parser.parse_args(argv)


MAX_TP_PROCESSES = 4
"""The tp rows' largest job: T x P x ws processes beyond it (8 at ws 2, P 2, T 2) are left to
tests/distributed/test_tensor_parallel.py's slow cases, which train them once each."""


def cells_of(args: argparse.Namespace) -> list[Cell]:
    backends = [b for b in args.backends.split(",") if b]
    precisions = [p for p in args.precisions.split(",") if p]
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",") if s]
    stages = [int(s) for s in args.zero_stages.split(",") if s]
    compressions = [c for c in args.compressions.split(",") if c]
    pipelines = [int(p) for p in args.pipeline_stages.split(",") if p]
    rows = [(b, None) for b in backends]
    rows += [("deepspeed", s) for s in stages]
    cells = [Cell(b, p, ws, acc, stage) for b, stage in rows for p in precisions
             for ws, acc in shapes]
    # one process communicates nothing: compression rows start at two
    cells += [Cell(b, "fp32", ws, acc, compression=c) for b in backends
              for c in compressions for ws, acc in shapes if ws > 1]
    if 1 not in pipelines:
        cells = []
    cells += [Cell(b, p, ws, acc, stages=stages) for stages in pipelines if stages > 1
              for b in backends if get_backend(b).pipelines for p in precisions
              for ws, acc in shapes]
    splits = [int(t) for t in args.tensor_parallel.split(",") if t]
    return cells + [Cell(b, p, ws, acc, stages=stages, tp=tp) for tp in splits for stages
                    in pipelines for b in backends if get_backend(b).tensor_parallel
                    for p in precisions for ws, acc in shapes
                    if tp * stages * ws <= MAX_TP_PROCESSES]


def main(argv: Sequence[str] | None = None) -> int:
    from report import grouped, markdown, text_table

    args = parse_args(sys.argv[1:] if argv is None else argv)
    began = time.monotonic()
    outcomes, references = run_grid(cells_of(args))
    seconds = time.monotonic() - began
    print()
    print(text_table(outcomes))
    print("P pass, R refused before start, F fail; the 4 letters: " + ", ".join(
        f"ws{ws} acc{acc}" for ws, acc in SHAPES) + f"  ({seconds / 60:.1f} min)")
    for line in grouped(outcomes, "F"):
        print(f"F {line}")
    if args.output:
        given = sys.argv[1:] if argv is None else list(argv)
        command = shlex.join(["python", "tests/conformance/grid.py", *given])
        Path(args.output).write_text(markdown(outcomes, references, command, seconds))
        print(f"wrote {args.output}")
    return 1 if any(o.verdict == "F" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
