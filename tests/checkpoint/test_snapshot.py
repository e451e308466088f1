"""``--snapshot-every``: in-memory snapshots kept on two nodes, and what a resume takes from them.

Real `mpt launch` jobs of tests/workers/elastic_train.py (gloo, CPU); the resumes run in
`make conformance`:

- two one-process nodes on 127.0.0.1 take a snapshot after each of 4 steps (a checkpoint on
  disk at step 3 only): each node's store then holds the same newest two, byte for byte;
- a snapshot laid out in memory is a checkpoint whose files carry crc32s, and one changed bit
  in any of them is refused at load; a store commits one file per snapshot, keeps two;
- a 2-process job on the second node's store alone (the first node's memory is gone) resumes
  from the snapshot of step 4, not from the disk's step 3, and trains on as the uninterrupted
  run would have;
- with neither copy left (an empty store), the same job resumes from the disk's step 3;
- a two-stage pipeline's snapshot resumes with two stages and with none, on its curve.

The elastic cases (a lost node, at most one step redone) are in tests/launchers/test_elastic.py.
"""

from __future__ import annotations

import filecmp
import json
import shutil
import subprocess
import zlib
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import find_free_port, mpt_command, run_mpt, worker
from torch import nn

import mpt
from mpt.checkpoint import CheckpointError, io
from mpt.checkpoint.encode import encode, rng_state
from mpt.checkpoint.snapshot import HostMemory, PeerSnapshots, lay_out, pack, unpack
from mpt.checkpoint.state import TrainingState, take_snapshot
from mpt.errors import UsageError

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


def test_each_snapshot_is_kept_on_the_next_node_too(two_nodes):
    first, second = two_nodes / "memory0", two_nodes / "memory1"
    assert sorted(p.name for p in first.iterdir()) == ["step-000000003.snapshot",
                                                       "step-000000004.snapshot"]
    same = filecmp.dircmp(first, second)
    assert not same.left_only and not same.right_only and not same.diff_files
    assert sorted(same.same_files) == sorted(p.name for p in first.iterdir())
    files = unpack((first / "step-000000004.snapshot").read_bytes())
    assert list(files) == ["model.safetensors", "state.safetensors", "state.json",
                           "manifest.json"]
    assert json.loads(bytes(files["manifest.json"]))["step"] == 4


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


def test_pack_and_unpack_keep_every_file():
    files = {"manifest.json": b"{}", "state.safetensors": bytes(range(256)) * 3, "empty": b""}
    assert unpack(pack(files)) == files


@pytest.mark.parametrize("damage", ["torn", "index", "length"])
def test_unpack_refuses_a_torn_or_damaged_buffer(damage):
    packed = bytearray(pack({"model.safetensors": b"x" * 100, "manifest.json": b"{}"}))
    if damage == "torn":
        packed = packed[:60] + packed[-40:]
    elif damage == "index":
        packed[-12] ^= 0xFF  # a byte of the index's JSON
    else:
        packed[-8:] = (10**6).to_bytes(8, "little")
    with pytest.raises(CheckpointError, match="torn or damaged"):
        unpack(bytes(packed))


def laid_out_snapshot(tmp_path: Path) -> tuple[mpt.Runtime, nn.Module, Path]:
    """A one-process run's snapshot after 3 steps, laid out as ``lay_out`` sends and keeps it,
    unpacked into a checkpoint directory; the run's weights spoiled afterwards."""
    torch.manual_seed(0)
    rt = mpt.Runtime(env={}, quiet=True)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model, _ = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.1))
    for _ in range(3):
        rt.backward(model(torch.randn(5, 4)).pow(2).mean())
        rt.step()
    parts = TrainingState(backend=rt.backend, pairs=rt.pairs.pairs)
    snapshot = take_snapshot(parts, step=3, stage=lambda _, tensors: {
        key: t.clone() for key, t in tensors.items()})
    tensors: dict[str, torch.Tensor] = {}
    rngs = [encode(rng_state(), "rng/0", tensors)]
    memory = HostMemory()
    size = lay_out(snapshot.files(rngs, tensors), snapshot.manifest_of, memory)
    files = unpack(memory.get(size)[:size])
    assert list(files)[-1] == "manifest.json"  # written last
    where = tmp_path / "step-000000003"
    where.mkdir()
    for name, data in files.items():
        (where / name).write_bytes(bytes(data))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    return rt, model, where


def test_a_snapshot_is_a_checkpoint_checked_by_crc32(tmp_path):
    rt, model, where = laid_out_snapshot(tmp_path)
    manifest = json.loads((where / "manifest.json").read_text())
    assert manifest["step"] == 3 and sorted(manifest["files"]) == [
        "model.safetensors", "state.json", "state.safetensors"]
    for name, entry in manifest["files"].items():
        assert set(entry) == {"bytes", "crc32"}
        assert int(entry["crc32"], 16) == zlib.crc32((where / name).read_bytes())
    assert rt.load(where)["step"] == 3
    assert all(not torch.all(p == 7.0) for p in model.parameters())


@pytest.mark.parametrize("name", ["model.safetensors", "state.safetensors", "state.json"])
@pytest.mark.parametrize("place", ["local", "memory"])
def test_a_damaged_snapshot_file_is_refused_by_its_crc32(tmp_path, name, place):
    rt, model, where = laid_out_snapshot(tmp_path)
    data = bytearray((where / name).read_bytes())
    data[-3] ^= 0x01  # one bit, in the last tensor's bytes (or the JSON's end)
    (where / name).write_bytes(bytes(data))
    url = str(where)
    if place == "memory":
        url = f"memory://damaged-{name}/step-000000003"
        for path in where.iterdir():
            io.Location.parse(url).write(path.name, path.read_bytes())
    with pytest.raises(CheckpointError, match=f"{name}: crc32 [0-9a-f]{{8}} does not match"):
        rt.load(url)
    assert all(torch.all(p == 7.0) for p in model.parameters())


def test_a_manifest_entry_without_a_checksum_is_refused(tmp_path):
    rt, _, where = laid_out_snapshot(tmp_path)
    manifest = json.loads((where / "manifest.json").read_text())
    del manifest["files"]["state.json"]["crc32"]
    (where / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"state\.json: the manifest records no checksum"):
        rt.load(where)


def test_a_store_commits_one_file_per_snapshot_and_keeps_the_newest_two(tmp_path):
    world = SimpleNamespace(gpus=1, world_size=1, rank=0)
    store = tmp_path / "store"
    snapshots = PeerSnapshots(every=1, store=str(store), backend=SimpleNamespace(world=world),
                              timeout=timedelta(seconds=10))
    assert snapshots.newest() is None
    for step in (1, 2, 3):
        snapshots._keep(step, memoryview(bytes([step]) * (1000 * step)))
    (store / ".tmp-step-000000004-killed").write_bytes(b"half")  # a worker killed mid-write
    assert sorted(p.name for p in store.iterdir()) == [
        ".tmp-step-000000004-killed", "step-000000002.snapshot", "step-000000003.snapshot"]
    assert snapshots.newest() == 3
    snapshots._keep(4, memoryview(b"\x04" * 10))
    assert sorted(p.name for p in store.iterdir()) == ["step-000000003.snapshot",
                                                       "step-000000004.snapshot"]
    assert (store / "step-000000004.snapshot").read_bytes() == b"\x04" * 10  # written over
    # a run resumed from an earlier step: the abandoned run's later snapshots go
    snapshots._keep(2, memoryview(b"\x02"))
    assert sorted(p.name for p in store.iterdir()) == ["step-000000002.snapshot"]
    assert snapshots.newest() == 2


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
