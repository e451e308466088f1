"""The training loop of the elastic tests (tests/launchers/test_elastic.py): one per node count.

usage: elastic_train.py OUT [--steps N] [--stop-at K] [--sleep SECONDS] [--save-every N]
                        [--forward-backward]

fp32 Adam on a fixed shuffled dataset through ``rt.setup_dataloader``, built with
``batch_size=rt.batch_size`` (the per-rank share of `mpt launch --global-batch-size`), a save to
``--checkpoint-dir`` after every step (every ``--save-every``) and ``step = rt.resume()["step"]``:
a restart at another world size goes on from the newest checkpoint (or `--snapshot-every`'s
snapshot) with the batch re-planned.

What it writes into OUT:

- ``pids/<pid>``: each worker's pid (no process may outlive the job), holding its rank;
- ``curve.txt`` (rank 0): ``step world_size loss time`` per step, every attempt appending, where
  ``loss`` is the mean over the ranks of the step's loss, i.e. the loss of the global batch, and
  ``time`` is when the step completed;
- ``resumed.txt`` (rank 0): ``attempt world_size step stages`` per start;
- ``seen-rank<r>.txt``: ``start step sample`` for every sample the rank trained on, where
  ``start`` is the same for every rank of one start of the gang (the latest start that ran a
  step is the one whose step counts).

``--stop-at K`` ends the run after step K (the first half of a reference run that changes
world size through a checkpoint).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from common import FEATURES, make_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpt

SAMPLES = 48  # 4 steps per epoch at a global batch of 12: the runs cross epochs

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--stop-at", type=int, default=0)
parser.add_argument("--sleep", type=float, default=0.2, help="seconds added to every step")
parser.add_argument("--save-every", type=int, default=1, help="steps between saves (0: none)")
parser.add_argument("--forward-backward", action="store_true",
                    help="train through rt.forward_backward (what --pipeline-stages needs)")
args = parser.parse_args(sys.argv[1:])
out: Path = args.out

rt = mpt.Runtime()
(out / "pids").mkdir(exist_ok=True)
(out / "pids" / str(os.getpid())).write_text(str(rt.rank))
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # set by torch's elastic agent

g = torch.Generator().manual_seed(3)
data = TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g),
                     torch.randn(SAMPLES, 1, generator=g), torch.arange(SAMPLES))
model = make_model()
model, optimizer = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
loader = rt.setup_dataloader(DataLoader(data, batch_size=rt.batch_size, shuffle=True))
step = rt.resume()["step"]
if rt.rank == 0:
    with open(out / "resumed.txt", "a") as f:
        print(attempt, rt.world_size, step, rt.topology.stages, file=f, flush=True)

start = rt.all_reduce(torch.tensor([time.time()], dtype=torch.float64), "max").item()
last = args.stop_at or args.steps
with open(out / "curve.txt", "a") as curve, open(out / f"seen-rank{rt.rank}.txt", "a") as seen:
    while step < last:
        for x, y, index in loader:
            if args.forward_backward:  # the batch's loss, on every rank, under a pipeline too
                loss = rt.forward_backward(x, y, nn.functional.mse_loss)
            else:
                loss = nn.functional.mse_loss(model(x), y)
                rt.backward(loss)
            rt.step()
            step += 1
            mean = rt.all_reduce(loss.detach().clone(), "mean")
            if rt.topology.stage == 0:  # a pipeline's stages read the same rows: one says
                seen.write("".join(f"{start!r} {step} {i}\n" for i in index.tolist()))
                seen.flush()
            if rt.rank == 0:
                print(step, rt.world_size, repr(mean.item()), repr(time.time()), file=curve,
                      flush=True)
            if args.save_every and step % args.save_every == 0:
                rt.save(step=step, keep=3)
            time.sleep(args.sleep)
            if step >= last:
                break
rt.close()
