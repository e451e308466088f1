"""`--local-rank-arg`: ``--local_rank=<N>`` in the script's argv, as torch.distributed.launch did.

Scripts of that era (all of Apex's examples, DeepSpeed's) read the process's GPU from argv;
torchrun and `mpt launch` only export ``LOCAL_RANK``. The launchers put this flag before the
script in the worker shim's arguments; the shim (``mpt.launchers.worker``) turns it into the
script's first argument. Kept apart from the shim so that the launchers need not import it
(``python -m mpt.launchers.worker`` warns when its module was imported before).
"""

from __future__ import annotations

LOCAL_RANK_ARG = "--local-rank-arg"
"""Given before the script in the worker shim's arguments: pass ``--local_rank=<N>`` to it."""

LOCAL_RANK_HINT = ("mpt: exit code 2 is a script's usage error, and --local-rank-arg passed it "
                   "--local_rank=<N>: if it takes no --local_rank, leave --local-rank-arg out "
                   "(the local rank is also in the LOCAL_RANK variable)")
"""What the launchers say when a rank exits with 2 (argparse's code) under the flag."""


def with_local_rank(args: list[str], local_rank: int) -> list[str]:
    """The script's arguments with ``--local_rank=<N>`` first, where torch.distributed.launch
    put it."""
    return [f"--local_rank={local_rank}", *args]
