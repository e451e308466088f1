"""Both ranks record their pid; rank 1 then exits with code 3 while rank 0 waits in a barrier.

usage: exit_code.py OUT_DIR
"""

import sys
import time
from pathlib import Path

import mpt

out = Path(sys.argv[1])
rt = mpt.Runtime()
(out / f"pid{rt.rank}").write_text(str(__import__("os").getpid()))
rt.barrier()  # both pids are on disk before anyone fails
if rt.rank == 1:
    time.sleep(0.5)
    sys.exit(3)
rt.barrier()  # rank 0 would wait here forever: the launcher must end it
time.sleep(60)
