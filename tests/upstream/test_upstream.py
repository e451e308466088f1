"""Scripts in the shape of the Horovod, Apex, DeepSpeed and PyTorch DDP examples, migrated with
exactly the edits their guide's table names (see edits.py), run on 2 ranks (gloo, CPU) and
compared with the unchanged script under its own launcher where that launcher exists here.

Each script records rank 0's per-step losses; "trains like" means the same loss curve.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ds_env, find_free_port, run_mpt
from edits import migrate, table

HERE = Path(__file__).parent


def losses(record: Path) -> torch.Tensor:
    return torch.tensor(json.loads(record.read_text())["losses"], dtype=torch.float64)


def same_curve(got: Path, want: Path, rtol: float) -> None:
    a, b = losses(got), losses(want)
    assert len(a) == len(b) > 5 and len(set(b.tolist())) > 1
    torch.testing.assert_close(a, b, rtol=rtol, atol=1e-6)


def launch(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    result = run_mpt("launch", "--gpus", "2", *args, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def original_launcher(command: list[str], timeout: float = 300) -> None:
    """Run an upstream launcher (torchrun, horovodrun) as a user would, without mpt's settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPT_")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env={**env, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(find_free_port()), *args]


def port() -> tuple[str, str]:
    return "--master-port", str(find_free_port())


HVD_MNIST = HERE / "hvd_mnist.py"


@pytest.fixture(scope="module")
def hvd_mnist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Horovod's MNIST example migrated, and the unchanged one's record under horovodrun."""
    pytest.importorskip("horovod.torch")
    out = tmp_path_factory.mktemp("hvd_mnist")
    migrated, used = migrate(HVD_MNIST, "horovod", out / "migrated")
    assert used == {before for before, _ in table("horovod")}  # it exercises every row
    horovodrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable))
    original_launcher([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                       str(HVD_MNIST), str(out / "horovodrun.json")])
    assert json.loads((out / "horovodrun.json").read_text())["accuracy"] > 0.7
    return migrated, out / "horovodrun.json"


def trains_as(record: Path, reference: Path) -> None:
    """The same curve to 1e-4 and the same test accuracy to 0.01."""
    same_curve(record, reference, rtol=1e-4)
    accuracy = [json.loads(path.read_text())["accuracy"] for path in (record, reference)]
    assert accuracy[0] == pytest.approx(accuracy[1], abs=0.01)


def test_horovod_mnist_unchanged_and_migrated_trains_as_under_horovodrun(hvd_mnist, tmp_path):
    migrated, reference = hvd_mnist
    # unchanged, under a plain `mpt launch`: hvd.init() joins mpt's rendezvous
    launch(*port(), str(HVD_MNIST), str(tmp_path / "joined.json"))
    assert json.loads((tmp_path / "joined.json").read_text())["world_size"] == 2
    same_curve(tmp_path / "joined.json", reference, rtol=1e-6)
    # migrated, under the backend the guide names first
    launch("--backend", "horovod", str(migrated), str(tmp_path / "hvd.json"))
    trains_as(tmp_path / "hvd.json", reference)


@pytest.mark.slow
def test_horovod_mnist_migrated_trains_under_ddp_as_under_horovodrun(hvd_mnist, tmp_path):
    migrated, reference = hvd_mnist
    launch(*port(), str(migrated), str(tmp_path / "ddp.json"))
    trains_as(tmp_path / "ddp.json", reference)


def test_horovod_synthetic_benchmark_under_mpt_horovodrun_gets_one_thread_per_rank(tmp_path):
    pytest.importorskip("horovod.torch")
    result = run_mpt("horovodrun", "-np", "2", "-H", "localhost:2", sys.executable,
                     str(HERE / "hvd_synthetic.py"), str(tmp_path / "bench.json"),
                     env={"OMP_NUM_THREADS": ""}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["threads"] == 1.0 and record["img_sec"] > 0
    assert "Total img/sec on 2 process(es)" in result.stdout


TUTORIAL_ONLY = {"torch.cuda.set_device(…)", ".to(self.gpu_id)", 'f"cuda:{self.gpu_id}"',
                 "self.model = DDP(…)", "self.model.module.state_dict()", "return DataLoader(…)"}
"""The torchrun rows only the tutorial's own shape (ddp_trainer.py) has; ddp_tutorial.py has the
others."""


def test_ddp_tutorial_unchanged_and_migrated_trains_as_under_torchrun(tmp_path):
    script = HERE / "ddp_tutorial.py"
    migrated, used = migrate(script, "torchrun", tmp_path / "migrated")
    assert used == {before for before, _ in table("torchrun")} - TUTORIAL_ONLY
    original_launcher(torchrun(str(script), str(tmp_path / "torchrun.json"),
                               str(tmp_path / "snap0.pt")))
    launch(*port(), str(script), str(tmp_path / "mpt.json"), str(tmp_path / "snap1.pt"))
    same_curve(tmp_path / "mpt.json", tmp_path / "torchrun.json", rtol=1e-6)
    # migrated, under Horovod: its DistributedSampler with default arguments needs
    # torch.distributed there too (the migrated Horovod MNIST runs under ddp)
    backend = "horovod" if shutil.which("horovodrun", path=os.path.dirname(sys.executable)) \
        else "ddp"
    launch("--backend", backend, *port(), str(migrated), str(tmp_path / "runtime.json"),
           str(tmp_path / "runtime.pt"))
    same_curve(tmp_path / "runtime.json", tmp_path / "torchrun.json", rtol=1e-4)
    assert "MODEL_STATE" in torch.load(tmp_path / "runtime.pt")


def test_apex_examples_run_with_their_imports_changed_and_local_rank_in_argv(tmp_path):
    simple, used = migrate(HERE / "apex_simple.py", "apex", tmp_path / "migrated")
    imagenet, used_too = migrate(HERE / "apex_imagenet.py", "apex", tmp_path / "migrated")
    dcgan, _ = migrate(HERE / "apex_dcgan.py", "apex", tmp_path / "migrated")
    assert used | used_too == {before for before, _ in table("apex")}
    runpy.run_path(str(dcgan))  # DCGAN's imports (its num_losses=3 training is not run here)
    out = launch(*port(), "--local-rank-arg", str(simple), str(tmp_path))
    assert "final loss" in out
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["local_rank"] for r in ranks] == [0, 1]  # each its own --local_rank
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["losses"][-1] < ranks[0][
        "losses"][0]
    launch(*port(), "--local-rank-arg", str(imagenet), str(tmp_path), "--opt-level", "O2",
           "--sync_bn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["local_rank"] for r in ranks] == [0, 1]
    assert ranks[0]["sync_bn"] == "SyncBatchNorm"
    assert ranks[0]["losses"] == ranks[1]["losses"]  # reduce_tensor: the mean over ranks
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


def cpu_port(source: str) -> str:
    """The DDP tutorial's shape made to run on the CPU unmigrated, for torchrun's reference: what
    upstream writes for its GPUs, and nothing else, replaced."""
    for before, after in (('    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))\n', ""),
                          ('backend="nccl"', 'backend="gloo"'), (".to(self.gpu_id)", '.to("cpu")'),
                          ("device_ids=[self.gpu_id]", "device_ids=None"),
                          ('f"cuda:{self.gpu_id}"', '"cpu"')):
        assert before in source, before
        source = source.replace(before, after)
    return source


@pytest.mark.slow
def test_ddp_tutorial_as_upstream_has_it_migrated_matches_torchrun_bit_for_bit(tmp_path):
    """rt made in ddp_setup() and used in Trainer and prepare_dataloader (global rt), the GPU
    moves by local rank, a DataLoader returned over several lines, model.module; resumed from
    its snapshot on the CPU (map_location)."""
    script = HERE / "ddp_trainer.py"
    migrated, used = migrate(script, "torchrun", tmp_path / "migrated")
    assert used == {b for b, _ in table("torchrun")} - {  # TUTORIAL_ONLY's rows among them
        "model = DDP(…)", "… = DataLoader(…)", 'int(os.environ["RANK"])'}
    reference = tmp_path / "reference" / script.name
    reference.parent.mkdir()
    reference.write_text(cpu_port(script.read_text()))
    original_launcher(torchrun(str(reference), "3", "1", "--snapshot", str(tmp_path / "t.pt"),
                               "--record", str(tmp_path / "torchrun.json")))
    out = launch(*port(), str(migrated), "3", "1", "--snapshot", str(tmp_path / "m.pt"),
                 "--record", str(tmp_path / "mpt.json"))
    # Found anywhere in the output: two ranks printing at once can share a line (an unbuffered
    # print writes its text and its newline apart).
    printed = sorted(re.findall(r"\[GPU\d\] Epoch \d+ \| Batchsize: \d+ \| Steps: \d+", out))
    assert printed == sorted(f"[GPU{r}] Epoch {e} | Batchsize: 32 | Steps: 8"
                             for r in range(2) for e in range(3))
    assert losses(tmp_path / "mpt.json").tolist() == losses(tmp_path / "torchrun.json").tolist()
    want, got = (torch.load(tmp_path / f"{n}.pt")["MODEL_STATE"] for n in ("t", "m"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    out = launch(*port(), str(migrated), "4", "1", "--snapshot", str(tmp_path / "m.pt"),
                 "--record", str(tmp_path / "resumed.json"))
    assert "Resuming training from snapshot at Epoch 2" in out
    assert torch.load(tmp_path / "m.pt")["EPOCHS_RUN"] == 3


def test_deepspeed_cifar_migrated_trains_as_the_deepspeed_original(tmp_path):
    """deepspeed.initialize over several lines, add_config_arguments, set_device, rt read in
    test(), fp16_enabled(): the table takes the example's shape; the config's Adam, WarmupLR and
    clipping become AdamW, a LambdaLR and rt.clip_grad_norm_."""
    pytest.importorskip("deepspeed")
    script = HERE / "ds_cifar.py"
    migrated, used = migrate(script, "deepspeed", tmp_path / "migrated")
    assert used == {before for before, _ in table("deepspeed")}
    cache = ds_env()
    os.environ.update(cache)
    original_launcher(torchrun(str(script), str(tmp_path / "deepspeed.json")), timeout=600)
    launch(*port(), "--backend", "deepspeed", "--zero-stage", "1", "--global-batch-size", "16",
           str(migrated), str(tmp_path / "mpt.json"), timeout=600, env=cache)
    want, got = losses(tmp_path / "deepspeed.json"), losses(tmp_path / "mpt.json")
    assert len(got) == len(want) == 16
    # the first epoch: the same order (DistributedSampler, seed 0), weights, AdamW and warm-up;
    # DeepSpeed's loader never calls set_epoch (its second epoch repeats the first's order)
    torch.testing.assert_close(got[:8], want[:8], rtol=1e-4, atol=1e-6)
