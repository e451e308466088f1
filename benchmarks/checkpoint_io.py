"""Save + load time of mpt's checkpoint format against ``torch.save``/``torch.load``, in one run.

    .venv/bin/python benchmarks/checkpoint_io.py                # ~100 M parameters, Adam state
    .venv/bin/python benchmarks/checkpoint_io.py --layers 2     # a quick look (~20 M)

Both sides save and load the same state: the model's weights, Adam's two moments per
parameter and the precision state, from the same process. The torch side writes one file with
``torch.save`` and fsyncs it (a checkpoint not on disk is not a checkpoint) and reads it back
with ``torch.load(weights_only=True)`` into the model and optimizer. The mpt side is
``rt.save(dir, keep=1)`` and ``rt.load(dir)``: safetensors and JSON in a temporary directory,
fsynced, renamed, a ``latest`` pointer, and a sha256 of every file written and checked, which
torch's side does not do. Rounds alternate which side goes first; the figure per side is the
fastest round (the least disturbed by the machine); the ratio is torch/mpt (goal: >= 1.0).

Then the same state is saved asynchronously and synchronously in alternation: the figure is the
time ``rt.save(async_save=True)`` keeps the training loop waiting, as a fraction of a synchronous
save's whole time (goal: <= 10 %).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

import mpt


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=10, help="Linear(3162, 3162) layers "
                        "(10 M parameters each)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    torch.manual_seed(0)
    rt = mpt.Runtime(env={}, quiet=True)
    model = nn.Sequential(*[nn.Linear(3162, 3162) for _ in range(args.layers)])
    model, opt = rt.setup(model, torch.optim.Adam(model.parameters()))
    rt.backward(model(torch.randn(2, 3162)).sum())
    assert rt.step()  # Adam's moments exist from here on
    params = sum(p.numel() for p in model.parameters())
    root = tempfile.mkdtemp(prefix="mpt-ckpt-bench-", dir=args.dir)

    def torch_save() -> None:
        with open(os.path.join(root, "torch.pt"), "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "precision": rt.precision.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    def torch_load() -> None:
        state = torch.load(os.path.join(root, "torch.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])

    sides: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "mpt": (lambda: rt.save(os.path.join(root, "mpt"), keep=1),
                lambda: rt.load(os.path.join(root, "mpt"))),
        "torch": (torch_save, torch_load),
    }
    times: dict[str, list[tuple[float, float]]] = {"mpt": [], "torch": []}
    try:
        for round_ in range(args.rounds):
            order = ["mpt", "torch"] if round_ % 2 == 0 else ["torch", "mpt"]
            for side in order:
                save, load = sides[side]
                times[side].append((timed(save), timed(load)))
        size = os.path.getsize(os.path.join(root, "torch.pt"))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    best = {side: min(times[side], key=sum) for side in times}
    print(f"{params / 1e6:.1f} M parameters, {size / 2**30:.2f} GiB of state; fastest of "
          f"{args.rounds} rounds (save + load):")
    for side, (save, load) in best.items():
        print(f"  {side:5s} save {save:6.2f} s  load {load:6.2f} s  total {save + load:6.2f} s")
    print(f"ratio torch/mpt: {sum(best['torch']) / sum(best['mpt']):.2f} (goal >= 1.0)")
    blocked, whole = async_blocking(rt, model, args.rounds)
    print(f"asynchronous save: training blocked {blocked:.3f} s of a {whole:.2f} s synchronous "
          f"save of the same state (median of {args.rounds}): {blocked / whole:.1%} "
          "(goal <= 10 %)")
    rt.close()


def async_blocking(rt: mpt.Runtime, model: nn.Module, rounds: int) -> tuple[float, float]:
    """Median time ``rt.save(async_save=True)`` holds the training loop (its collectives and
    the copy to host memory), and of a synchronous ``rt.save`` of the same state, alternating.
    Each asynchronous save is committed (outside the timing) before the next save starts."""
    root = tempfile.mkdtemp(prefix="mpt-ckpt-bench-async-")
    blocked, whole = [], []
    try:
        for round_ in range(rounds):
            for asynchronous in ((True, False) if round_ % 2 == 0 else (False, True)):
                seconds = timed(lambda a=asynchronous: rt.save(root, keep=1, async_save=a))
                (blocked if asynchronous else whole).append(seconds)
                rt.wait_for_save()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return statistics.median(blocked), statistics.median(whole)


if __name__ == "__main__":
    main()
