"""Each rank writes to stdout, stderr and stdout in turn; then one rank may fail.

usage: log_lines.py [FAIL_RANK] [--many N]: FAIL_RANK raises after its lines while the others
wait for it. ``--many N``: each rank also writes N rounds of lines the way that ranks sharing a
console mix up: several words to one print, one line in two prints, a line on stderr.
"""

import sys

import mpt

args = sys.argv[1:]
many = 0
if "--many" in args:
    at = args.index("--many")
    many = int(args[at + 1])
    del args[at:at + 2]

rt = mpt.Runtime()
rank = rt.rank
print(f"out 1 from rank {rank}")
print(f"err 2 from rank {rank}", file=sys.stderr)
print(f"out 3 from rank {rank}")
for i in range(many):
    print("line", i, "of", "rank", rank, "in", "pieces")  # under -u: one write per word
    print(f"line {i} of rank {rank}", end="")
    print(" in two prints")
    print(f"err {i} of rank {rank}", file=sys.stderr)
rt.barrier()  # every rank has written its lines before one fails
if args == [str(rank)]:
    raise ValueError(f"rank {rank} fails on purpose")
rt.barrier()  # the others would wait here forever: the launcher ends them
rt.close()
