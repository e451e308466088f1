"""Scripts in the shape of the Horovod, Apex, DeepSpeed and PyTorch DDP examples, migrated with
exactly the edits their guide's table names (see edits.py), run on 2 ranks (gloo, CPU) and
compared with the unchanged script under its own launcher where that launcher exists here.

Each script records rank 0's per-step losses; "trains like" means the same loss curve. Each
guide's migrated script runs under every backend (ddp, fsdp, deepspeed, horovod) in fp32 and
bf16-mixed: fp32 on the original's curve, bf16-mixed finite, falling, near it and not equal to
it. `make test` runs one cell per guide beyond the cases below; the others are marked slow.
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


BACKENDS = ("ddp", "fsdp", "deepspeed", "horovod")
PRECISIONS = ("fp32", "bf16-mixed")


def grid(fast: tuple[str, str] | None, covered: tuple[tuple[str, str], ...] = ()
         ) -> list[object]:
    """Every backend x precision cell as a parameter (backend, precision): ``fast`` runs in
    `make test`, the others are slow; ``covered``: cells another test runs already."""
    return [pytest.param(b, p, id=f"{b}-{p}", marks=() if (b, p) == fast else pytest.mark.slow)
            for b in BACKENDS for p in PRECISIONS if (b, p) not in covered]


def on(backend: str, precision: str) -> tuple[str, ...]:
    """The launch flags of a cell; skips it where the backend is not installed here."""
    if backend == "horovod":
        pytest.importorskip("horovod.torch")
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    return "--backend", backend, "--precision", precision


def trains_mixed(got: torch.Tensor, fp32: torch.Tensor, rtol: float | None, *,
                 falls: bool = True) -> None:
    """A bf16-mixed curve: finite, falling (unless it starts trained: ``falls``), within
    ``rtol`` of the fp32 one where given (a chaotic one drifts apart), and not equal to it (the
    forward did compute in bf16)."""
    assert len(got) == len(fp32) > 5 and torch.isfinite(got).all()
    quarter = max(len(got) // 4, 2)
    assert not falls or got[-quarter:].mean() < got[:quarter].mean()
    if rtol is not None:
        torch.testing.assert_close(got, fp32, rtol=rtol, atol=1e-6)
    assert not torch.equal(got, fp32)


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


@pytest.mark.parametrize(("backend", "precision"), grid(("fsdp", "bf16-mixed"),
                                                       covered=(("horovod", "fp32"),)))
def test_horovod_mnist_migrated_trains_under_every_backend(hvd_mnist, tmp_path, backend,
                                                          precision):
    """horovod.run's row runs too (--num-proc 2: each process calls train itself), and the
    learning-rate scaler reads the run's op (average: the world size)."""
    migrated, reference = hvd_mnist
    record = tmp_path / "record.json"
    launch(*on(backend, precision), *port(), str(migrated), str(record), "--num-proc", "2",
           env=ds_env())
    result = json.loads(record.read_text())
    assert result["world_size"] == result["lr_scaler"] == 2
    if precision == "fp32":
        trains_as(record, reference)
        return
    trains_mixed(losses(record), losses(reference), rtol=None)
    assert result["accuracy"] == pytest.approx(json.loads(reference.read_text())["accuracy"],
                                               abs=0.05)


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
                 "if os.path.exists(snapshot_path):", "self.model = DDP(…)",
                 "… = torch.load(…, map_location=…)",
                 'self.model.load_state_dict(snapshot["MODEL_STATE"])', "snapshot = {…}",
                 "torch.save(snapshot, …)", "if self.gpu_id == 0 and …:", "return DataLoader(…)"}
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
    # mpt.compat.apex reads no mpt setting: the script's opt level and DDP train, whatever
    # --backend and --precision say
    (tmp_path / "flags").mkdir()
    launch(*port(), "--local-rank-arg", "--backend", "fsdp", "--precision", "bf16-mixed",
           str(simple), str(tmp_path / "flags"))
    assert json.loads((tmp_path / "flags" / "rank0.json").read_text()) == ranks[0]
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


TRAINER = HERE / "ddp_trainer.py"
TRAINER_ROWS = {b for b, _ in table("torchrun")} - {  # TUTORIAL_ONLY's rows among them
    "model = DDP(…)", "… = DataLoader(…)", 'int(os.environ["RANK"])'}
"""The torchrun rows the tutorial's own shape takes."""


@pytest.fixture(scope="module")
def trainer_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tutorial's shape under torchrun (cpu_port): 3 epochs with a snapshot after each,
    then resumed from it up to 4 (it trains again the epoch it saved last)."""
    out = tmp_path_factory.mktemp("trainer")
    reference = out / "reference" / TRAINER.name
    reference.parent.mkdir()
    reference.write_text(cpu_port(TRAINER.read_text()))
    for epochs in ("3", "4"):
        original_launcher(torchrun(str(reference), epochs, "1", "--snapshot", str(out / "t.pt"),
                                   "--record", str(out / f"torchrun-{epochs}.json")))
    return out


def trainer_runs(migrated: Path, snapshot: Path, records: Path, *flags: str,
                 env: dict[str, str] | None = None) -> tuple[str, str]:
    """The migrated tutorial for 3 epochs with a snapshot (rt.save) after each, then resumed
    (rt.load) up to 4: what each run printed; records/mpt-3.json and mpt-4.json."""
    printed = []
    for epochs in ("3", "4"):
        printed.append(launch(*flags, *port(), str(migrated), epochs, "1", "--snapshot",
                              str(snapshot), "--record", str(records / f"mpt-{epochs}.json"),
                              env=env))
    assert "Resuming training from snapshot at Epoch 2" in printed[1]
    latest = snapshot / (snapshot / "latest").read_text().strip()
    assert json.loads((latest / "state.json").read_text())["extra"] == {"EPOCHS_RUN": 3}
    return printed[0], printed[1]


def test_ddp_trainer_migrated_saves_under_fsdp_and_resumes_from_its_snapshot(tmp_path):
    """rt.save from every rank, rt.load after rt.setup: fsdp's shards resume (a rank-0
    state_dict() of them did not load). The resumed run trains the saved epoch again, in its
    order (loader.set_epoch) from the saved weights: each of its batches' losses is below the
    first run's for the same batch."""
    migrated, used = migrate(TRAINER, "torchrun", tmp_path / "migrated")
    assert used == TRAINER_ROWS
    trainer_runs(migrated, tmp_path / "snapshot", tmp_path, "--backend", "fsdp")
    first, resumed = losses(tmp_path / "mpt-3.json"), losses(tmp_path / "mpt-4.json")
    assert len(first) == 24 and len(resumed) == 16 and torch.isfinite(resumed).all()
    assert (resumed[:8] < first[16:]).all()
    assert resumed[:8].mean() < first[:8].mean() / 1.5


@pytest.mark.parametrize(("backend", "precision"), grid(fast=None))
def test_ddp_tutorial_as_upstream_has_it_migrated_trains_and_resumes_under_every_backend(
        trainer_reference, tmp_path, backend, precision):
    """rt made in ddp_setup() and used in Trainer and prepare_dataloader (global rt), the GPU
    moves by local rank, a DataLoader returned over several lines, model.module, its snapshot
    saved each epoch and resumed from: fp32 matches torchrun bit for bit, the resumed run too."""
    migrated, used = migrate(TRAINER, "torchrun", tmp_path / "migrated")
    assert used == TRAINER_ROWS
    out, _ = trainer_runs(migrated, tmp_path / "snapshot", tmp_path, *on(backend, precision),
                          env=ds_env())
    # Found anywhere in the output: two ranks printing at once can share a line (an unbuffered
    # print writes its text and its newline apart).
    printed = sorted(re.findall(r"\[GPU\d\] Epoch \d+ \| Batchsize: \d+ \| Steps: \d+", out))
    assert printed == sorted(f"[GPU{r}] Epoch {e} | Batchsize: 32 | Steps: 8"
                             for r in range(2) for e in range(3))
    for epochs in ("3", "4"):
        got = losses(tmp_path / f"mpt-{epochs}.json")
        want = losses(trainer_reference / f"torchrun-{epochs}.json")
        if precision == "fp32":
            assert got.tolist() == want.tolist()
        else:
            trains_mixed(got, want, rtol=2e-2, falls=epochs == "3")  # resumed: trained
    weights = tmp_path / "snapshot" / (tmp_path / "snapshot" / "latest").read_text().strip()
    if precision == "fp32" and (weights / "model.safetensors").exists():  # fsdp: shards
        from safetensors.torch import load_file

        got = load_file(weights / "model.safetensors")
        want = torch.load(trainer_reference / "t.pt")["MODEL_STATE"]
        assert all(torch.equal(want[k], got[f"model/{k}"]) for k in want)


DS_CIFAR = HERE / "ds_cifar.py"


@pytest.fixture(scope="module")
def ds_cifar(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """DeepSpeed's CIFAR example migrated, and the unchanged one's record under torchrun (fp32,
    ZeRO-1, 2 epochs of 8 steps)."""
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("ds_cifar")
    migrated, used = migrate(DS_CIFAR, "deepspeed", out / "migrated")
    assert used == {before for before, _ in table("deepspeed")}
    os.environ.update(ds_env())
    original_launcher(torchrun(str(DS_CIFAR), str(out / "deepspeed.json")), timeout=600)
    return migrated, out / "deepspeed.json"


def ds_launch(*args: str) -> None:
    """The migrated CIFAR example: the config's train_batch_size is --global-batch-size."""
    launch(*port(), "--global-batch-size", "16", *args, timeout=600, env=ds_env())


def test_deepspeed_cifar_migrated_trains_as_the_deepspeed_original(ds_cifar, tmp_path):
    """deepspeed.initialize over several lines, add_config_arguments, set_device, rt read in
    test(), fp16_enabled(): the table takes the example's shape; the config's Adam, WarmupLR and
    clipping become AdamW, a LambdaLR and rt.clip_grad_norm_."""
    migrated, reference = ds_cifar
    ds_launch("--backend", "deepspeed", "--zero-stage", "1", str(migrated),
              str(tmp_path / "mpt.json"))
    want, got = losses(reference), losses(tmp_path / "mpt.json")
    assert len(got) == len(want) == 16
    # the first epoch: the same order (DistributedSampler, seed 0), weights, AdamW and warm-up;
    # DeepSpeed's loader never calls set_epoch (its second epoch repeats the first's order)
    torch.testing.assert_close(got[:8], want[:8], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("backend", "precision"), grid(("ddp", "bf16-mixed"),
                                                       covered=(("deepspeed", "fp32"),)))
def test_deepspeed_cifar_migrated_trains_under_every_backend(ds_cifar, tmp_path, backend,
                                                            precision):
    """bfloat16_enabled()/fp16_enabled() read the run's compute dtype: the inputs are cast to
    bf16 under bf16-mixed, under every backend. From the second epoch on, the set-up loader
    reshuffles where DeepSpeed's repeated the first epoch's order."""
    migrated, reference = ds_cifar
    record = tmp_path / "mpt.json"
    ds_launch(*on(backend, precision), str(migrated), str(record))
    got, want = losses(record), losses(reference)
    assert len(got) == len(want) == 16 and torch.isfinite(got).all()
    assert json.loads(record.read_text())["dtype"] == (
        "None" if precision == "fp32" else "torch.bfloat16")
    if precision == "fp32":
        torch.testing.assert_close(got[:8], want[:8], rtol=1e-4, atol=1e-6)
        assert not torch.allclose(got[8:], want[8:], rtol=1e-3)  # another order
    else:
        trains_mixed(got[:8], want[:8], rtol=1e-2)
    assert got[-4:].mean() < got[:4].mean()


@pytest.mark.slow
def test_deepspeed_cifar_migrated_keeps_deepspeeds_order_with_set_epoch_0(ds_cifar, tmp_path):
    """What deepspeed.md says for DeepSpeed's data order in every epoch."""
    migrated, reference = ds_cifar
    loop = "    for epoch in range(args.epochs):  # noqa: B007\n"
    source = migrated.read_text()
    assert source.count(loop) == 1
    script = tmp_path / migrated.name
    script.write_text(source.replace(loop, loop + "        trainloader.set_epoch(0)\n"))
    ds_launch(str(script), str(tmp_path / "mpt.json"))
    torch.testing.assert_close(losses(tmp_path / "mpt.json"), losses(reference), rtol=1e-4,
                               atol=1e-6)


@pytest.mark.slow
def test_deepspeed_cifar_migrated_refuses_moe_param_groups_in_one_line(ds_cifar, tmp_path):
    migrated, _ = ds_cifar
    result = run_mpt("launch", "--gpus", "1", *port(), "--global-batch-size", "16",
                     str(migrated), str(tmp_path / "mpt.json"), "--moe-param-group",
                     timeout=300)
    assert result.returncode != 0
    assert "--moe-param-group: mixture-of-experts parameter groups are DeepSpeed's own" in (
        result.stdout + result.stderr)
