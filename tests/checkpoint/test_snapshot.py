"""``--snapshot-every``: each rank's piece of the state kept on two nodes, and what a resume
takes from them.

Real `mpt launch` jobs of tests/workers/elastic_train.py (gloo, CPU); the resumes run in
`make conformance`:

- two one-process nodes on 127.0.0.1 take a snapshot after each of 4 steps (a checkpoint on
  disk at step 3 only): each rank writes its piece (ddp: about half of the state each, no box
  twice) and each node's store holds both ranks' pieces of the newest two, byte for byte;
- a one-process run keeps the newest two snapshots and resumes the newest; one flipped bit in a
  piece's bytes or header makes it count as missing, and the step before is restored, said;
- boxes held alike by several ranks are kept once, spread evenly, and fill a rank of any other
  cut (another fsdp world size, a ZeRO-3 range);
- a 2-process job on the second node's store alone (the first node's memory is gone) resumes
  from the snapshot of step 4, not from the disk's step 3, and trains on as the uninterrupted
  run would have;
- with neither copy left (an empty store), the same job resumes from the disk's step 3;
- a two-stage pipeline's snapshot (each stage's pieces) resumes with two stages and with none,
  on its curve.

The elastic cases (a lost node, at most one step redone, ddp, fsdp and ZeRO-3) are in
tests/launchers/test_elastic.py.
"""

from __future__ import annotations

import filecmp
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import find_free_port, mpt_command, run_mpt, worker
from torch import nn

import mpt
from mpt.checkpoint.boxes import Box, Target, assign
from mpt.checkpoint.snapshot import Move, Piece, in_windows, write_piece
from mpt.errors import UsageError
from mpt.state.flat import FlatPiece

FLAGS = ("--global-batch-size", "12")


def launch(out: Path, ck: Path, store: Path, steps: int, *flags: str) -> str:
    """One 2-process job of elastic_train.py with a snapshot after every step (``flags``: more
    launch flags; a pipeline's make the script train through rt.forward_backward); its
    output."""
    script = ("--forward-backward",) if "--pipeline-stages" in flags else ()
    done = run_mpt("launch", "--gpus", "2", "--master-port", "auto", *FLAGS, *flags,
                   "--checkpoint-dir", str(ck), "--snapshot-every", "1", "--snapshot-dir",
                   str(store), worker("elastic_train.py"), str(out), "--steps", str(steps),
                   "--save-every", "3", "--sleep", "0", *script, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr


def curve(out: Path) -> dict[int, float]:
    rows = (line.split() for line in (out / "curve.txt").read_text().splitlines())
    return {int(step): float(loss) for step, _, loss, _ in rows}


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two one-process nodes, 4 steps, each node's store in ``memory0``/``memory1``."""
    tmp = tmp_path_factory.mktemp("snapshots")
    (tmp / "out").mkdir()
    port = str(find_free_port())
    nodes = [subprocess.Popen(mpt_command(
        "launch", "--nodes", "2", "--gpus", "1", "--nr", str(nr), "--master-port", port, *FLAGS,
        "--checkpoint-dir", str(tmp / "ck"), "--snapshot-every", "1", "--snapshot-dir",
        str(tmp / f"memory{nr}"), worker("elastic_train.py"), str(tmp / "out"), "--steps", "4",
        "--save-every", "3", "--sleep", "0"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for nr in (0, 1)]
    for node in nodes:
        output, _ = node.communicate(timeout=240)
        assert node.returncode == 0, output[-4000:]
    return tmp


def test_each_rank_keeps_its_piece_and_the_next_node_a_copy(two_nodes):
    first, second = two_nodes / "memory0", two_nodes / "memory1"
    names = [f"step-00000000{step}.rank-0000{rank}-of-00002.snapshot" for step in (3, 4)
             for rank in (0, 1)]
    assert sorted(p.name for p in first.iterdir()) == names
    same = filecmp.dircmp(first, second)
    assert not same.left_only and not same.right_only and not same.diff_files
    assert sorted(same.same_files) == names
    pieces = [Piece(str(first / f"step-000000004.rank-0000{rank}-of-00002.snapshot"))
              for rank in (0, 1)]
    try:
        assert all(piece.intact() and piece.header["step"] == 4 for piece in pieces)
        # ddp: every rank holds the whole state, and each keeps about half of it
        kept = [sum(n for _, n in piece.boxes.values()) for piece in pieces]
        table = pieces[0].header["table"]
        assert table == pieces[1].header["table"]
        whole = {row[0] for row in table if not row[0].startswith("rng/")}
        assert {row[0] for row in table if row[5] == 0} & {
            row[0] for row in table if row[5] == 1} == set()
        assert {key for key in whole if key.startswith("model/")} and min(kept) > 0
        largest = max(math.prod(row[4]) * 4 for row in table)
        assert abs(kept[0] - kept[1]) <= largest
    finally:
        for piece in pieces:
            piece.close()


@pytest.mark.slow
def test_a_resume_takes_a_snapshot_newer_than_the_disk_and_else_the_disk(two_nodes, tmp_path):
    # The uninterrupted run: 8 steps at 2 processes, from the first node's checkpoint of step 3.
    uninterrupted = tmp_path / "uninterrupted"
    uninterrupted.mkdir()
    launch(uninterrupted, tmp_path / "ck-u", tmp_path / "memory-u", 8)
    reference = curve(uninterrupted)

    memory = shutil.copytree(two_nodes / "memory1", tmp_path / "memory1")  # the fixture's stays
    for case, store, restored in (("memory", memory, 4), ("disk", tmp_path / "empty", 3)):
        out = tmp_path / case
        out.mkdir()
        ck = shutil.copytree(two_nodes / "ck", tmp_path / f"ck-{case}")
        said = launch(out, ck, store, 8)
        source = (f"memory://mpt-snapshot/step-{restored:09d}" if case == "memory"
                  else str(ck / f"step-{restored:09d}"))
        assert f"mpt: resumed from {source} at step {restored}" in said
        got = curve(out)
        assert sorted(got) == list(range(restored + 1, 9))
        assert max(abs(got[s] - reference[s]) for s in got) <= 1e-6


@pytest.mark.slow
def test_a_pipelines_snapshot_resumes_at_two_stages_and_at_one(tmp_path):
    """Two stages (2 processes, --pipeline-stages 2): each stage's weights are gathered into
    the snapshot under the model's names; a job resumed from it, with two stages or none (2
    replicas), goes on as the uninterrupted two-stage run (the disk holds step 3 only)."""
    pipeline = ("--pipeline-stages", "2", "--microbatches", "2")
    reference = tmp_path / "uninterrupted"
    reference.mkdir()
    launch(reference, tmp_path / "ck-u", tmp_path / "memory-u", 8, *pipeline)
    first = tmp_path / "first"
    first.mkdir()
    launch(first, tmp_path / "ck", tmp_path / "memory", 4, *pipeline)
    for case, flags in (("two stages", pipeline), ("one stage", ())):
        out = tmp_path / case
        out.mkdir()
        said = launch(out, shutil.copytree(tmp_path / "ck", tmp_path / f"ck {case}"),
                      shutil.copytree(tmp_path / "memory", tmp_path / f"memory {case}"), 8,
                      *flags)
        assert "mpt: resumed from memory://mpt-snapshot/step-000000004 at step 4" in said, case
        got, want = curve(out), curve(reference)
        assert sorted(got) == [5, 6, 7, 8], case
        assert max(abs(got[s] - want[s]) for s in got) <= 1e-6, case


def train_with_snapshots(tmp_path: Path, steps: int) -> tuple[mpt.Runtime, nn.Module]:
    """A one-process run with a snapshot after each of ``steps`` steps (no checkpoint on
    disk)."""
    torch.manual_seed(0)
    rt = mpt.Runtime(env={}, quiet=True, snapshot_every=1, snapshot_dir=str(tmp_path / "store"),
                     checkpoint_dir=str(tmp_path / "ck"))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model, _ = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.1))
    assert rt.resume()["step"] == 0
    for _ in range(steps):
        rt.backward(model(torch.randn(5, 4)).pow(2).mean())
        rt.step()
    return rt, model


def resumed(tmp_path: Path) -> tuple[int, nn.Module]:
    rt = mpt.Runtime(env={}, quiet=True, snapshot_every=1, snapshot_dir=str(tmp_path / "store"),
                     checkpoint_dir=str(tmp_path / "ck"))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model, _ = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.1))
    step = rt.resume()["step"]
    rt.close()
    return step, model


def test_a_store_keeps_the_newest_two_and_a_resume_restores_the_newest(tmp_path, capsys):
    rt, model = train_with_snapshots(tmp_path, 3)
    rt.close()
    store = tmp_path / "store"
    assert sorted(p.name for p in store.iterdir()) == [
        "step-000000002.rank-00000-of-00001.snapshot",
        "step-000000003.rank-00000-of-00001.snapshot"]
    step, again = resumed(tmp_path)
    assert step == 3
    assert "mpt: resumed from memory://mpt-snapshot/step-000000003 at step 3" in \
        capsys.readouterr().out
    for want, got in zip(model.state_dict().values(), again.state_dict().values(),
                         strict=True):
        assert torch.equal(want, got)


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_damaged_piece_is_not_restored_and_the_step_before_is(tmp_path, capsys, where):
    rt, _ = train_with_snapshots(tmp_path, 3)
    rt.close()
    newest = tmp_path / "store" / "step-000000003.rank-00000-of-00001.snapshot"
    data = bytearray(newest.read_bytes())
    data[3 if where == "data" else -20] ^= 0x01  # one bit
    newest.write_bytes(bytes(data))
    piece = Piece(str(tmp_path / "store" / "step-000000002.rank-00000-of-00001.snapshot"))
    assert piece.intact()
    piece.close()
    step, _ = resumed(tmp_path)
    out = capsys.readouterr().out
    assert step == 2
    assert "mpt: the snapshot of step 3 lacks the pieces of rank(s) [0]" in out
    assert "resumed from memory://mpt-snapshot/step-000000002 at step 2" in out


def test_boxes_are_kept_once_and_evenly_and_refill_any_other_cut():
    whole = torch.arange(48.0).reshape(8, 6)
    rows = [(0, 3), (3, 6), (6, 8)]  # a cut over 3 ranks, as fsdp's Shard(0)
    stored = [Box("w", "float32", (8, 6), (a, 0), (b - a, 6)) for a, b in rows]
    # replicas: every rank holds every box; each is kept once, the bytes spread
    kept = assign([stored, stored, stored])
    assert sorted(b.offsets for k in kept for b in k) == [(0, 0), (3, 0), (6, 0)]
    assert all(len(k) == 1 for k in kept)
    # a rank of another cut (rows 2 to 6, columns 1 to 4) takes its part of each box
    target = Target(box=((2, 1), (4, 3)), tensor=torch.zeros(4, 3))
    assert target.overlap(stored[2]) is None
    for box in stored:
        if target.overlap(box) is not None:
            target.fill(box, whole[box.offsets[0]:box.offsets[0] + box.sizes[0]])
    assert torch.equal(target.tensor, whole[2:6, 1:4])
    # a ZeRO-3 range of the flattened tensor (elements 10 to 29) takes its elements
    flat = FlatPiece(shape=torch.Size([8, 6]), flat=torch.zeros(20), start=10)
    ranged = Target.of(flat, stored[0])
    for box in stored:
        if ranged.overlap(box) is not None:
            ranged.fill(box, whole[box.offsets[0]:box.offsets[0] + box.sizes[0]])
    assert torch.equal(flat.flat, whole.reshape(-1)[10:30])


def test_a_restores_moves_go_in_windows_of_a_bounded_size():
    def move(rows: int) -> Move:  # rows of 1 KiB
        part = Box("w", "float32", (64, 256), (0, 0), (rows, 256))
        return Move(part, part, 0, 0, 1)

    moves = [move(n) for n in (4, 4, 8, 20, 2, 2)]
    windows = in_windows(moves, 16 << 10)
    assert [[m.part.sizes[0] for m in w] for w in windows] == [[4, 4, 8], [20], [2, 2]]
    assert [m for w in windows for m in w] == moves  # every move once, in order
    assert in_windows([], 16 << 10) == []


def test_a_piece_reads_only_the_part_of_a_box_a_rank_needs(tmp_path):
    whole = torch.arange(48.0).reshape(8, 6)
    box = Box("w", "float32", (10, 6), (2, 0), (8, 6))  # rows 2 to 9 of a 10 x 6 tensor
    scalar = Box("step", "float32", (), (), ())
    path = str(tmp_path / "piece")
    write_piece(path, [(box, whole), (scalar, torch.tensor(7.0))], {"step": 1})
    piece = Piece(path)
    try:
        rows = Box("w", "float32", (10, 6), (4, 0), (3, 6))  # whole rows: read alone
        block = Box("w", "float32", (10, 6), (5, 1), (2, 3))  # columns too: cut from the box
        assert torch.equal(piece.read(box, rows), whole[2:5])
        assert torch.equal(piece.read(box, block), whole[3:5, 1:4])
        assert torch.equal(piece.read(box), whole)
        assert piece.read(scalar, scalar).item() == 7.0
    finally:
        piece.close()


def test_snapshots_need_a_store_and_a_backend_that_can_copy_them(run_cli, tmp_path):
    with pytest.raises(UsageError, match="--snapshot-dir"):
        mpt.Runtime(snapshot_every=1, env={})
    script = tmp_path / "train.py"
    script.write_text("")
    for flags, says in ((["--snapshot-every", "-1"], "--snapshot-every=-1 is invalid: it "
                         "cannot be negative"),
                        (["--backend", "horovod", "--snapshot-every", "2"], "--backend horovod "
                         "has no torch.distributed group")):
        result = run_cli("launch", *flags, str(script))
        assert result.returncode == 2
        assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_default_store_lives_in_memory_as_long_as_the_launch(tmp_path):
    """Without --snapshot-dir the node's store is made in /dev/shm and removed at the end."""
    script = tmp_path / "where.py"
    script.write_text("import mpt\nrt = mpt.Runtime()\nprint('STORE', rt.config.snapshot_dir)\n"
                      "rt.close()\n")
    done = subprocess.run(mpt_command("launch", "--snapshot-every", "1", str(script)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    store = Path(next(line.split()[1] for line in done.stdout.splitlines()
                      if line.startswith("STORE")))
    assert store.parent == Path("/dev/shm") and store.name.startswith("mpt-snapshots-")
    assert not store.exists()

