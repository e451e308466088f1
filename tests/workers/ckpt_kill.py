"""kill -9 a process in the middle of saving, many times; after each kill, load what is there.

usage: ckpt_kill.py ROOT TRIALS OUT_JSON
One process builds the run and saves step 0. Each trial forks a child that saves one checkpoint
after another (keep=2) until this process SIGKILLs it after a random delay spread over a few
save durations, so kills land in every phase: writing files, the manifest, the rename, the
`latest` update, pruning. Then this process loads ROOT (checksums verified) and records what it
found. Forking keeps a trial to milliseconds; the killed child is a real process.
"""

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import mpt
from mpt.checkpoint.io import LATEST, Location, complete_checkpoints, resolve

torch.set_num_threads(1)  # no intra-op thread pool for a forked child to inherit half of
root, trials, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
rt = mpt.Runtime(env={})
model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
model, optimizer = rt.setup(model, torch.optim.Adam(model.parameters()))
model(torch.randn(2, 256)).sum().backward()
rt.step()
start = time.monotonic()
rt.save(root, step=0)
duration = time.monotonic() - start
delays = random.Random(0)  # its own generator: rt.load restores the global one
records = []
for trial in range(trials):
    child = os.fork()
    if child == 0:
        step = 1000 * (trial + 1)
        while True:
            step += 1
            rt.save(root, step=step, keep=2)
    time.sleep(delays.uniform(0.0, 3 * duration))
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    record = {"latest": (root / LATEST).read_text(), "resolved": resolve(root).path}
    record["step"] = rt.load(root)["step"]  # raises if what latest names is not whole
    record["leftovers"] = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    # every directory that looks committed must load, not only the newest
    record["complete"] = [name for _, name in complete_checkpoints(Location.parse(root))]
    for name in record["complete"]:
        rt.load(root / name)
    records.append(record)
out.write_text(json.dumps({"save_seconds": duration, "trials": records}))
rt.close()
