"""`mpt plan`'s calibrated step time against steps measured on this machine, in the same run.

    .venv/bin/python benchmarks/plan_step.py [--rounds 3] [--steps 8]

One 2-process gloo job (one intra-op thread per process, as `mpt launch` starts ranks) does,
each round: the calibration `mpt plan --calibrate` does (``mpt.plan.calibrate``'s collective
sweep and device figures), then times the step of every case, so that the figures the cost
model is given and the steps it predicts see the same machine (other jobs share its cores).
Then the cost model (``mpt.plan.planner.plan`` on the meta model, this round's figures) prices
each case's layout, and the benchmark prints predicted, measured and their ratio.

Cases (fp32, raw torch: what mpt's backends wrap):

- ``mlp ddp``: tests/plan/plan_ddp_step.py's MLP (6.3 M parameters), batch 16 per rank,
  SGD momentum, ``DistributedDataParallel``;
- ``mlp fsdp``: the same under ``fully_shard`` with mpt's default units (each Linear of at least
  1 M parameters, then the root);
- ``gpt ddp``: examples/gpt.py's GPT, 4 layers x 256 wide, 4 heads, 128 tokens, 8 sequences per
  rank, AdamW, ``DistributedDataParallel``.

Each measured step is the median of the slowest rank's steps after 3 warm-up steps. Under ddp
the job also times the step without its allreduce (``no_sync``) and the optimizer step alone,
printed beside the model's terms: where a prediction misses, they say which term.

A benchmark, not a test: it prints figures and never fails on them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "plan"))
import plan_ddp_step as mlp_job  # noqa: E402  the MLP the accuracy test measures

GPT_SHAPE = {"layers": 4, "heads": 4, "embed": 256, "block": 128, "vocab": 96}
GPT_BATCH = 8
"""Sequences per rank."""


def _gpt_module() -> Any:
    spec = importlib.util.spec_from_file_location("mpt_example_gpt", ROOT / "examples" / "gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def build_gpt() -> nn.Module:
    """examples/gpt.py's GPT at ``GPT_SHAPE``."""
    gpt = _gpt_module()
    return gpt.GPT(gpt.GPTConfig(**GPT_SHAPE))


def build_mlp() -> nn.Module:
    return mlp_job.build()


CASES: dict[str, dict[str, Any]] = {
    "mlp ddp": {"build": build_mlp, "backend": "ddp", "batch": mlp_job.BATCH,
                "input": ([mlp_job.FEATURES], torch.float32), "optimizer": "sgd-momentum"},
    "mlp fsdp": {"build": build_mlp, "backend": "fsdp", "batch": mlp_job.BATCH,
                 "input": ([mlp_job.FEATURES], torch.float32), "optimizer": "sgd-momentum"},
    "gpt ddp": {"build": build_gpt, "backend": "ddp", "batch": GPT_BATCH,
                "input": ([GPT_SHAPE["block"]], torch.int64), "optimizer": "adamw"},
}


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def _wrap(model: nn.Module, backend: str) -> nn.Module:
    if backend == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for module in list(model.children()):
        if sum(p.numel() for p in module.parameters()) >= 1_000_000:
            fully_shard(module)
    fully_shard(model)
    return model


def _batch(case: dict[str, Any]) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """One batch and the loss of the model's output on it."""
    shape, dtype = case["input"]
    if dtype == torch.int64:
        x = torch.randint(0, GPT_SHAPE["vocab"], (case["batch"], *shape))
        y = torch.randint(0, GPT_SHAPE["vocab"], (case["batch"], *shape))
        return x, lambda out: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
    x, y = torch.randn(case["batch"], *shape), torch.randn(case["batch"], *shape)
    return x, lambda out: nn.functional.mse_loss(out, y)


def _slowest(seconds: float) -> float:
    import torch.distributed as dist

    took = torch.tensor(seconds)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def _time_case(case: dict[str, Any], steps: int) -> dict[str, float]:
    """Median seconds (slowest rank) of the whole step; under ddp also without the allreduce
    and of the optimizer step alone."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = _wrap(case["build"](), case["backend"])
    optimizer = _optimizer(case["optimizer"], model.parameters())
    x, loss_of = _batch(case)

    def step(sync: bool) -> tuple[float, float]:
        dist.barrier()
        start = time.perf_counter()
        if sync or case["backend"] != "ddp":
            loss_of(model(x)).backward()
        else:
            with model.no_sync():
                loss_of(model(x)).backward()
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        return _slowest(end - start), _slowest(end - middle)

    found: dict[str, list[float]] = {"step": [], "no allreduce": [], "optimizer": []}
    for index in range(steps + 3):
        whole, opt = step(True)
        if case["backend"] == "ddp":
            alone, _ = step(False)
        if index >= 3:
            found["step"].append(whole)
            found["optimizer"].append(opt)
            if case["backend"] == "ddp":
                found["no allreduce"].append(alone)
    return {key: statistics.median(times) for key, times in found.items() if times}


def _worker(rank: int, world: int, port: int, rounds: int, steps: int, out: str) -> None:
    import torch.distributed as dist

    mlp_job.join(rank, world, port)
    try:
        found = [{**mlp_job.calibration_round(world),
                  "cases": {name: _time_case(case, steps) for name, case in CASES.items()}}
                 for _ in range(rounds)]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(found))


def predict(name: str, found: dict[str, Any]) -> Any:
    """The cost model's prediction of case ``name`` from one round's calibration."""
    from mpt.estimate import meta_model
    from mpt.plan import calibrate
    from mpt.plan.network import Cluster
    from mpt.plan.planner import plan
    from mpt.plan.profiles import link_profile

    case = CASES[name]
    calibration = calibrate.Calibration(identity=calibrate.identity(), ranks=2, backend="gloo",
                                        memory=2.0**34, collectives=found["collectives"],
                                        **found["figures"])
    cluster = Cluster(nodes=1, gpus=2, device=calibration.device("this round"),
                      link=link_profile("1gbit"))
    shape, dtype = case["input"]
    result = plan(meta_model(case["build"]), cluster, precision="fp32", batch=2 * case["batch"],
                  input_shape=shape, input_dtype=dtype, optimizer=case["optimizer"])
    return next(p for p in result.fitting if p.layout.label == f"--backend {case['backend']}")


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per case and round")
    parser.add_argument("--save", type=Path, help="also write the rounds' figures here")
    parser.add_argument("--load", type=Path, help="predict from saved figures, measure nothing")
    args = parser.parse_args()
    if args.load is not None:
        report(json.loads(args.load.read_text()))
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "rounds.json")
        mp.spawn(_worker, args=(2, port, args.rounds, args.steps, out), nprocs=2, join=True)
        rounds = json.loads(Path(out).read_text())
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.save is not None:
        args.save.write_text(json.dumps(rounds))
    report(rounds)


def report(rounds: list[dict[str, Any]]) -> None:
    """Each round's predicted and measured step of every case, and the ratios' range."""
    print("round | case | predicted ms | measured ms | ratio | terms predicted (ms) | "
          "measured parts (ms)")
    ratios: dict[str, list[float]] = {name: [] for name in CASES}
    sums: dict[str, list[float]] = {name: [0.0, 0.0] for name in CASES}
    for index, found in enumerate(rounds):
        for name, measured in found["cases"].items():
            p = predict(name, found)
            ratio = p.step / measured["step"]
            ratios[name].append(ratio)
            sums[name][0] += p.step
            sums[name][1] += measured["step"]
            terms = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in p.terms.items() if v)
            parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in measured.items())
            print(f"{index} | {name} | {p.step * 1e3:.1f} | {measured['step'] * 1e3:.1f} | "
                  f"{ratio:.2f} | {terms} | {parts}")
    for name, found_ratios in ratios.items():
        predicted, measured = sums[name]
        print(f"{name}: predicted / measured {min(found_ratios):.2f}-{max(found_ratios):.2f}, "
              f"summed over the rounds {predicted / measured:.2f}")


if __name__ == "__main__":
    main()
