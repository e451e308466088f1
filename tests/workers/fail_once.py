"""Rank 1 fails on the gang's first attempt only; with --max-restarts 1 the job then succeeds.

usage: fail_once.py OUT_DIR. No process group: the test is about what each attempt leaves in
the log files, so a peer's connection error must not add to them.
"""

import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]  # torch's agent
print(f"attempt {attempt} of rank {rank}")
if attempt == "0":
    started = out / f"rank{rank}.started"
    started.write_text("")
    if rank == "1":
        deadline = time.monotonic() + 60
        while not (out / "rank0.started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # rank 0 has printed its line before the failure ends it
        raise RuntimeError("rank 1 fails on the first attempt")
    time.sleep(60)  # the launcher ends it when rank 1 fails
