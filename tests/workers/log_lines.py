"""Each rank writes to stdout, stderr and stdout in turn; then one rank may fail.

usage: log_lines.py [FAIL_RANK]: that rank raises after its lines while the others wait for it.
"""

import sys

import mpt

rt = mpt.Runtime()
rank = rt.rank
print(f"out 1 from rank {rank}")
print(f"err 2 from rank {rank}", file=sys.stderr)
print(f"out 3 from rank {rank}")
rt.barrier()  # every rank has written its lines before one fails
if sys.argv[1:] == [str(rank)]:
    raise ValueError(f"rank {rank} fails on purpose")
rt.barrier()  # the others would wait here forever: the launcher ends them
rt.close()
