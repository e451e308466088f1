"""Both ranks record their pid; rank 1 then fails while rank 0 waits in a barrier.

usage: exit_code.py OUT_DIR [exit|kill]: rank 1 exits with code 3, or SIGKILLs itself.
"""

import os
import signal
import sys
import time
from pathlib import Path

import mpt

out = Path(sys.argv[1])
rt = mpt.Runtime()
(out / f"pid{rt.rank}").write_text(str(os.getpid()))
rt.barrier()  # both pids are on disk before anyone fails
if rt.rank == 1:
    time.sleep(0.5)
    if sys.argv[2:] == ["kill"]:
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
    sys.exit(3)
rt.barrier()  # rank 0 would wait here forever: the launcher must end it
time.sleep(60)
