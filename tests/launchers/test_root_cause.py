"""Which rank brought the job down, when several are found dead in the same poll."""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from mpt.launchers.elastic import root_cause
from mpt.launchers.notes import Note


def failures(*exitcodes: int) -> dict[int, ProcessFailure]:
    """Rank r has pid 100 + r; no error files, so torch stamps them all with the same second."""
    return {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
            for rank, code in enumerate(exitcodes)}


@pytest.mark.parametrize(("exitcodes", "notes", "expected", "code"), [
    # rank 1 exited first; rank 0's collective then failed: the notes order them
    ((1, 3), {100: Note(2_000, 1), 101: Note(1_000, 3)}, 1, 3),
    # rank 2 was OOM-killed (no note); ranks 0 and 1 failed afterwards with notes
    ((1, 1, -signal.SIGKILL), {100: Note(5, 1), 101: Note(6, 1)}, 2, 128 + signal.SIGKILL),
    # rank 0 failed; the agent stopped rank 1 with SIGTERM
    ((4, -signal.SIGTERM), {100: Note(7, 4)}, 0, 4),
    # rank 1 called sys.exit(3) first, but the agent's SIGTERM caught it in its atexit handlers
    # after rank 0 had failed in turn: the script's code is reported, not the SIGTERM
    ((1, -signal.SIGTERM), {100: Note(9, 1), 101: Note(8, 3)}, 1, 3),
    # only ranks the agent stopped: any of them, not an error
    ((-signal.SIGTERM, -signal.SIGTERM), {}, 0, 128 + signal.SIGTERM),
])
def test_root_cause(exitcodes, notes, expected, code):
    failure = root_cause(failures(*exitcodes), notes)
    assert (failure.rank, failure.exit_code) == (expected, code)


def test_notes_are_read_back_as_written(tmp_path):
    note = Note(1_700_000_000_000_000_000, 3, 1)
    note.write(str(tmp_path), 123)
    (tmp_path / "124.tmp").write_text("1")  # a note still being written is not read
    assert Note.read_all(str(tmp_path)) == {123: note}


def test_exit_code_2_under_local_rank_arg_says_how_to_do_without_it(tmp_path):
    from pathlib import Path

    from mpt.launchers import LaunchSpec
    from mpt.launchers.elastic import Failure, describe
    from mpt.launchers.local_rank import LOCAL_RANK_HINT

    script = tmp_path / "train.py"
    script.write_text("")
    spec = LaunchSpec(script=Path(script), gpus=2, local_rank_arg=True)
    failure = Failure(rank=0, local_rank=0, exit_code=2)
    assert describe(failure, spec, {})[-1] == LOCAL_RANK_HINT
    assert LOCAL_RANK_HINT not in describe(Failure(rank=0, local_rank=0, exit_code=1), spec, {})
    assert spec.worker_args()[3:5] == ["--local-rank-arg", str(script)]
