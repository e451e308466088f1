"""`make gpu-check`: every path only a GPU runs, in one command, within 8 minutes on one GPU.

A machine with a GPU is lent rarely and briefly; this is what to run on it. Each check is one
subprocess with a timeout, and its result (pass, fail, timeout, missing, skipped), its time, the
end of its output and its figures go into one JSON report, rewritten after every check so that a
run cut short still leaves what it measured:

- grid: tests/conformance/grid.py on CUDA, world 1: fp16-mixed, O1, O2 and O3 under ddp, apex,
  horovod, fsdp and deepspeed (DeepSpeed fp16 is refused on CPU), each against ddp fp32;
- nccl: one allreduce of a CUDA tensor at world 2 over NCCL (two GPUs visible, else skipped);
- fsdp-offload: a model made on the meta device, materialised by ``--backend fsdp
  --fsdp-cpu-offload`` into pinned host memory, trained on CUDA;
- horovod-cuda: Horovod's CUDA build allreducing a CUDA tensor;
- pytest-gpu: the tests marked ``gpu`` (``pytest -m gpu``);
- each example, briefly in bf16-mixed: samples/s (tokens/s for the GPT) from its metrics, and
  MFU against the datasheet peak of the GPU (examples/gpt.py's table) where the example counts
  its FLOPs (the GPT does; the others report none, so their MFU is left null).

A package a check needs that is not installed (deepspeed, horovod, torchvision) makes it
"missing", not failed. The exit code is 1 when a check failed or timed out, else 0.

Without a CUDA GPU it prints one line and exits 0: there is nothing to check, which is no failure
of the code (a CPU machine's `make gpu-check` says so and stops). Where a GPU is visible to the
driver but this torch cannot use it (a driver older than the build's CUDA, or a CPU build), it
prints one line naming the driver and the build, and exits 1: then the machine needs fixing.

    python benchmarks/gpu_check.py [--report runs/gpu-check/report.json] [--budget 480]

mpt runs from this source tree (``python -m mpt``, the tree on PYTHONPATH): a GPU machine that
has torch but no network need not install anything else for the checks that need nothing else.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 480.0
"""The whole run's limit: 8 minutes."""
GRID_PRECISIONS = ("fp16-mixed", "O1", "O2", "O3")
EXAMPLES = {  # name: (arguments after the script, what its throughput counts)
    "digits": (["--steps", "100"], "samples"),
    "imagenet": (["--steps", "40", "--eval-every", "40"], "samples"),
    "gpt": (["--steps", "60", "--eval-every", "60", "--sample", "0"], "tokens"),
    "pix2pix": (["--steps", "40"], "samples"),
}
NEEDS = {"horovod": "horovod", "deepspeed": "deepspeed", "imagenet": "torchvision"}
"""Packages a backend or example needs beyond torch."""


@dataclass
class Result:
    """One check, as the report keeps it."""

    name: str
    status: str
    """pass, fail, timeout, missing (a package is not installed) or skipped (not applicable)."""
    seconds: float = 0.0
    command: list[str] = field(default_factory=list)
    returncode: int | None = None
    tail: str = ""
    """The last lines of its output."""
    figures: dict[str, Any] = field(default_factory=dict)


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


# -- is there a GPU to check? -------------------------------------------------------------------

def nvidia_smi_gpus() -> list[tuple[str, str]]:
    """(name, driver version) of each GPU the driver lists; [] without nvidia-smi or GPUs."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = [[part.strip() for part in line.split(",")] for line in out.splitlines()]
    return [(row[0], row[1]) for row in rows if len(row) == 2]


def unusable_line() -> str | None:
    """None where torch can use a CUDA GPU; else the one line to print (see the docstring)."""
    import torch

    if torch.cuda.is_available():
        return None
    gpus = nvidia_smi_gpus()
    build = f"torch {torch.__version__}" + (f" built for CUDA {torch.version.cuda}"
                                             if torch.version.cuda else ", a CPU build,")
    if not gpus:
        return f"gpu-check: no CUDA GPU here ({build}); nothing to check"
    name, driver = gpus[0]
    why = "it has no CUDA"
    if torch.version.cuda:
        try:
            torch.cuda.init()
        except (RuntimeError, AssertionError) as exc:
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        else:
            why = "torch.cuda.is_available() is False"
    return (f"gpu-check: {name} with driver {driver} is visible but {build} cannot use it "
            f"({why}): install a driver for that CUDA, or a torch built for this driver")


# -- the checks -------------------------------------------------------------------------------

def mpt_launch(*args: str) -> list[str]:
    return [sys.executable, "-m", "mpt", "launch", *args]


def run(name: str, command: list[str], timeout: float, env: dict[str, str]) -> Result:
    """Run one check to its end or its timeout; pass where it exits 0. The check runs in a
    process group of its own, which a timeout ends whole: a launcher's workers must not hold the
    GPU while the next check runs."""
    start = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=ROOT, env=env, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return Result(name, "timeout", time.monotonic() - start, command,
                      tail=tail_of(f"{output}\n(stopped after {timeout:.0f} s)"))
    return Result(name, "pass" if process.returncode == 0 else "fail",
                  time.monotonic() - start, command, process.returncode, tail_of(output))


def tail_of(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def last_values(metrics: Path, *keys: str) -> dict[str, float]:
    """The last value of each of ``keys`` among a run's metrics.jsonl records."""
    found: dict[str, float] = {}
    if not metrics.is_file():
        return found
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        found.update({k: record[k] for k in keys if record.get(k) is not None})
    return found


def example_figures(run_dir: Path, counts: str, peak_tflops: float | None) -> dict[str, Any]:
    """samples/s (or tokens/s) and MFU of an example's short run, from its metrics.jsonl."""
    values = last_values(run_dir / "metrics.jsonl", "samples_per_s", "tokens_per_s", "mfu")
    rate = values.get("tokens_per_s" if counts == "tokens" else "samples_per_s",
                      values.get("samples_per_s"))
    return {f"{counts}_per_s": rate, "mfu": values.get("mfu"), "peak_tflops": peak_tflops,
            **({} if "mfu" in values else {"mfu_note": "the example counts no FLOPs"})}


def datasheet_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of ``device_name`` from examples/gpt.py's table, None if unknown."""
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    table: dict[str, float] = module.DATASHEET_TFLOPS
    return next((table[k] for k in sorted(table, key=len, reverse=True) if k in device_name),
                None)


def plan(report_dir: Path, gpus: int) -> list[tuple[str, list[str], float, str]]:
    """(name, command, timeout, why it cannot run or "") of every check, in order."""
    backends = [b for b in ("ddp", "apex", "fsdp", "horovod", "deepspeed")
                if installed(NEEDS.get(b, "torch"))]
    checks = [("grid", [sys.executable, "tests/conformance/grid.py", "--backends",
                        ",".join(backends), "--precisions", ",".join(GRID_PRECISIONS),
                        "--shapes", "1x1", "--compressions=", "--pipeline-stages", "1",
                        "--tensor-parallel=", "--output",
                        str(report_dir / "support-matrix-cuda.md")], 240.0, "")]
    checks += [(f"grid-{b}", [], 0.0, f"{NEEDS[b]} is not installed")
               for b in ("horovod", "deepspeed") if b not in backends]
    me = str(Path(__file__).resolve())
    checks.append(("nccl", mpt_launch("--gpus", "2", me, "--worker", "nccl"), 90.0,
                   "" if gpus >= 2 else f"{gpus} GPU visible; NCCL at world 2 needs 2"))
    checks.append(("fsdp-offload", mpt_launch("--backend", "fsdp", "--fsdp-cpu-offload",
                                              "--precision", "bf16-mixed", me, "--worker",
                                              "fsdp-offload"), 90.0, ""))
    checks.append(("horovod-cuda", mpt_launch("--backend", "horovod", me, "--worker",
                                              "horovod-cuda"), 90.0,
                   "" if installed("horovod") else "horovod is not installed"))
    checks.append(("pytest-gpu", [sys.executable, "-m", "pytest", "-m", "gpu", "-q",
                                  "-p", "no:cacheprovider", "tests"], 180.0, ""))
    for name, (args, _) in EXAMPLES.items():
        need = NEEDS.get(name)
        checks.append((f"example-{name}", mpt_launch(
            "--precision", "bf16-mixed", "--quiet", "--run-dir",
            str(report_dir / "examples" / name), f"examples/{name}.py", *args), 150.0,
            f"{need} is not installed" if need and not installed(need) else ""))
    return checks


def check_all(report: Path, budget: float) -> int:
    """Run every check within ``budget`` seconds, writing ``report`` as it goes."""
    import torch

    report.parent.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    device = torch.cuda.get_device_name(0)
    peak = datasheet_tflops(device)
    head = {"device": device, "gpus": gpus, "torch": torch.__version__,
            "cuda": torch.version.cuda, "driver": next(iter(nvidia_smi_gpus()), ("", ""))[1],
            "datasheet_bf16_tflops": peak, "budget_s": budget}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    results: list[Result] = []
    began = time.monotonic()
    for name, command, timeout, missing in plan(report.parent, gpus):
        left = budget - (time.monotonic() - began)
        if missing:
            result = Result(name, "missing" if "installed" in missing else "skipped",
                            command=command, tail=missing)
        elif left < 10:
            result = Result(name, "skipped", command=command, tail="out of the time budget")
        else:
            result = run(name, command, min(timeout, left), env)
            if name.startswith("example-") and result.status == "pass":
                counts = EXAMPLES[name.removeprefix("example-")][1]
                result.figures = example_figures(
                    report.parent / "examples" / name.removeprefix("example-"), counts, peak)
        results.append(result)
        print(f"gpu-check: {name:<18} {result.status:<8} {result.seconds:6.1f} s  "
              f"{json.dumps(result.figures) if result.figures else ''}", flush=True)
        report.write_text(json.dumps({**head, "seconds": time.monotonic() - began,
                                      "checks": [asdict(r) for r in results]}, indent=2))
    failed = [r.name for r in results if r.status in ("fail", "timeout")]
    print(f"gpu-check: {len(results) - len(failed)} of {len(results)} without failure "
          f"on {device} in {time.monotonic() - began:.0f} s; report {report}"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


# -- the workers the checks launch (`mpt launch ... gpu_check.py --worker NAME`) -----------------

def worker_nccl() -> None:
    """One allreduce of a CUDA tensor through the Runtime's process group, which is NCCL's."""
    import torch
    import torch.distributed as dist

    import mpt

    rt = mpt.Runtime(quiet=True)
    tensor = torch.full((4,), float(rt.rank + 1), device=rt.device)
    dist.all_reduce(tensor)
    assert dist.get_backend() == "nccl", dist.get_backend()
    assert tensor.tolist() == [float(sum(range(1, rt.world_size + 1)))] * 4, tensor
    rt.close()


def worker_fsdp_offload() -> None:
    """A meta-device model that fsdp materialises into pinned host memory, trained on CUDA."""
    import torch
    from torch import nn

    import mpt

    rt = mpt.Runtime(quiet=True)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    model, _ = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    locals_ = [p.to_local() for p in model.parameters()]
    assert all(t.device.type == "cpu" and t.is_pinned() for t in locals_), \
        [(t.device, t.is_pinned()) for t in locals_]
    torch.manual_seed(0)
    x = torch.randn(128, 64, device=rt.device)
    y = x[:, :1].clone()
    losses = []
    for _ in range(20):
        with rt.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        rt.backward(loss)
        rt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] and all(map(math.isfinite, losses)), losses
    rt.print(f"fsdp offload: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    rt.close()


def worker_horovod_cuda() -> None:
    """Horovod's own allreduce of a CUDA tensor, which needs Horovod's CUDA build."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    tensor = torch.full((4,), float(hvd.rank() + 1), device="cuda")
    out = hvd.allreduce(tensor, op=hvd.Sum)
    print(f"horovod cuda_built={hvd.cuda_built()} nccl_built={hvd.nccl_built()} "
          f"result on {out.device}: {out.tolist()}")
    assert hvd.cuda_built(), "this Horovod was built without CUDA"
    assert out.is_cuda and out.tolist() == [float(sum(range(1, hvd.size() + 1)))] * 4


WORKERS = {"nccl": worker_nccl, "fsdp-offload": worker_fsdp_offload,
           "horovod-cuda": worker_horovod_cuda}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, default=ROOT / "runs" / "gpu-check" /
                        "report.json", help="the JSON report (default runs/gpu-check/)")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help="seconds for the whole run (default 480)")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        WORKERS[args.worker]()
        return 0
    line = unusable_line()
    if line is not None:
        print(line)
        return 0 if line.startswith("gpu-check: no CUDA GPU") else 1
    return check_all(args.report, args.budget)


if __name__ == "__main__":
    sys.exit(main())
