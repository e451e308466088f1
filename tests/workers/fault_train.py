"""One training run for every case of the fault-injection suite (tests/launchers/test_faults.py).

usage: fault_train.py OUT [--fault none|kill9|raise|hang|kill9_in_save] [--at STEP] [--rank R]
                          [--sleep SECONDS]

2 ranks (or any number), fp32, Adam, a shuffled loader from ``rt.setup_dataloader`` (so the
sampler's position is part of what a resume must restore), ``step = rt.resume()["step"]`` and a
save to the launch's ``--checkpoint-dir`` every SAVE_EVERY steps. The fault fires once: on the
gang's first attempt (``TORCHELASTIC_RESTART_COUNT == "0"``), on rank ``--rank`` only, while it
runs step ``--at``:

- ``kill9``: SIGKILL to itself after its backward, before its optimizer step;
- ``raise``: an exception at the same point;
- ``hang``: a sleep of an hour *before* its backward, so its peer waits in the gradient
  all-reduce (until ``--timeout``);
- ``kill9_in_save``: SIGKILL to itself in the save due at step ``--at``, at the moment the
  complete staging directory (``.tmp-*``, manifest included) is about to be renamed into place:
  the latest point before the commit, where a half-trusted directory would do the most harm.
  Deterministic, unlike a kill after a delay. Only the writing rank (0) is in that code path.

What each rank writes into OUT, read by the tests:

- ``pid-rank<r>-attempt<a>``: its pid, at start (no process may outlive the job);
- ``steps-rank<r>-attempt<a>.txt``: one line per step it ran (written just before the optimizer
  step, after the point where ``kill9``/``raise`` fire), so repeated or skipped steps show;
- ``resumed-rank<r>-attempt<a>``: the step ``rt.resume()`` returned;
- ``exit-rank<r>-attempt<a>.json``: ``rt.global_step`` when the process exits normally or through
  ``SystemExit`` (a preempted rank exits from inside ``rt.step()``);
- ``fault-at``: ``time.time()`` right before the fault fires;
- ``final.pt`` (rank 0): the full weights at the end, gathered by the backend.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from common import FEATURES, make_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpt

STEPS, SAVE_EVERY = 30, 5
SAMPLES, BATCH = 56, 4  # 7 steps per epoch on 2 ranks: saves and faults land mid-epoch

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--fault", default="none",
                    choices=["none", "kill9", "raise", "hang", "kill9_in_save"])
parser.add_argument("--at", type=int, default=0, help="the step during which the fault fires")
parser.add_argument("--rank", type=int, default=1, help="the rank that fails")
parser.add_argument("--sleep", type=float, default=0.05, help="seconds added to every step")
args = parser.parse_args(sys.argv[1:])

rt = mpt.Runtime()
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # set by torch's elastic agent
tag = f"rank{rt.rank}-attempt{attempt}"
out: Path = args.out
(out / f"pid-{tag}").write_text(str(os.getpid()))
armed = attempt == "0" and rt.rank == args.rank and args.fault != "none"


def fire(what: str) -> bool:
    """True (once the time is noted) when fault ``what`` fires now."""
    if not armed or args.fault != what:
        return False
    (out / "fault-at").write_text(repr(time.time()))
    return True


def kill_at_commit() -> None:
    """SIGKILL this process when a save renames its staging directory into place."""
    rename = os.rename

    def renaming(src: str, dst: str, *a: object, **kw: object) -> None:
        if os.path.basename(src).startswith(".tmp-") and fire("kill9_in_save"):
            os.kill(os.getpid(), signal.SIGKILL)
        rename(src, dst, *a, **kw)

    os.rename = renaming  # type: ignore[assignment]


g = torch.Generator().manual_seed(3)
data = TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g),
                     torch.randn(SAMPLES, 1, generator=g))
model = make_model()
model, optimizer = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
loader = rt.setup_dataloader(DataLoader(data, batch_size=BATCH, shuffle=True))
step = rt.resume()["step"]
(out / f"resumed-{tag}").write_text(str(step))
atexit.register(lambda: (out / f"exit-{tag}.json").write_text(
    json.dumps({"global_step": rt.global_step})))

with open(out / f"steps-{tag}.txt", "a") as steps_log:
    while step < STEPS:
        for x, y in loader:
            if step + 1 == args.at and fire("hang"):
                time.sleep(3600)  # before backward: the peer waits in the gradient all-reduce
            loss = nn.functional.mse_loss(model(x), y)
            rt.backward(loss)
            if step + 1 == args.at and fire("kill9"):
                os.kill(os.getpid(), signal.SIGKILL)
            if step + 1 == args.at and fire("raise"):
                raise RuntimeError(f"rank {rt.rank} fails at step {step + 1}")
            print(step + 1, file=steps_log, flush=True)
            rt.step()
            step += 1
            time.sleep(args.sleep)
            if step % SAVE_EVERY == 0:
                if step == args.at and armed:
                    kill_at_commit()
                rt.save(step=step)
            if step >= STEPS:
                break

weights = {k: v.detach().clone() for k, v in rt.backend.model_state_dict(model).items()}
if rt.rank == 0:
    torch.save(weights, out / "final.pt")
rt.close()
