"""Which rank brought the job down, when several are found dead in the same poll."""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from mpt.launchers.elastic import root_cause


def failures(*exitcodes: int) -> dict[int, ProcessFailure]:
    """Rank r has pid 100 + r; no error files, so torch stamps them all with the same second."""
    return {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
            for rank, code in enumerate(exitcodes)}


@pytest.mark.parametrize(("exitcodes", "notes", "expected"), [
    # rank 1 exited first; rank 0's collective then failed: the notes order them
    ((1, 3), {100: 2_000, 101: 1_000}, 1),
    # rank 2 was OOM-killed (no note); ranks 0 and 1 failed afterwards with notes
    ((1, 1, -signal.SIGKILL), {100: 5, 101: 6}, 2),
    # rank 0 failed; the agent stopped rank 1 with SIGTERM
    ((4, -signal.SIGTERM), {100: 7}, 0),
    # only ranks the agent stopped: any of them, not an error
    ((-signal.SIGTERM, -signal.SIGTERM), {}, 0),
])
def test_root_cause(exitcodes, notes, expected):
    rank, failure = root_cause(failures(*exitcodes), notes)
    assert rank == expected and failure.exitcode == exitcodes[expected]
