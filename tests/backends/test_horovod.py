"""The horovod backend on real processes: 2 ranks, gloo, CPU, started by `mpt launch` (which hosts
Horovod's rendezvous), by horovodrun and by `mpt horovodrun`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import pid_alive, run_mpt, worker

HVD = ("launch", "--backend", "horovod", "--gpus", "2")


def load_ranks(out: Path) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float = 1e-5) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def test_horovod_trains_like_ddp_and_checkpoints_move_between_them(tmp_path, free_port):
    ddp_out, hvd_out = tmp_path / "ddp", tmp_path / "hvd"
    ddp_out.mkdir(), hvd_out.mkdir()
    ddp = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port),
                  worker("hvd_curves.py"), str(ddp_out))
    assert ddp.returncode == 0, ddp.stderr
    hvd = run_mpt(*HVD, worker("hvd_curves.py"), str(hvd_out), str(ddp_out / "ckpt"))
    assert hvd.returncode == 0, hvd.stderr
    ddp_ranks, hvd_ranks = load_ranks(ddp_out), load_ranks(hvd_out)
    assert [r["backend"] for r in hvd_ranks] == ["horovod"] * 2
    want = torch.tensor(ddp_ranks[0]["fp32"])
    assert len(want) == 20 and len(set(want.tolist())) == 20  # a curve, not a constant
    for r in hvd_ranks:
        torch.testing.assert_close(torch.tensor(r["fp32"]), want, rtol=1e-5, atol=0)
        # k micro-batches accumulated = one batch k times larger
        close(r["accumulate"], r["one_batch"])
        # two backward passes before a step: the first one's early allreduce is not used
        close(r["two_backwards"], r["one_batch"])
        # bf16-mixed: autocast computes in bf16, gradients stay fp32 and reduce as in ddp
        assert torch.isfinite(torch.tensor(r["bf16"])).all()
        torch.testing.assert_close(torch.tensor(r["bf16"]), torch.tensor(ddp_ranks[0]["bf16"]),
                                   rtol=1e-2, atol=1e-3)
        close(r["bf16_params"], ddp_ranks[0]["bf16_params"], tol=1e-2)
    for p0, p1 in zip(hvd_ranks[0]["bf16_params"], hvd_ranks[1]["bf16_params"], strict=True):
        assert torch.equal(p0, p1)  # replicas stay identical
    # the same checkpoint state, keyed by parameter name, from either backend
    ddp0, hvd0 = ddp_ranks[0], hvd_ranks[0]
    assert hvd0["model_state"].keys() == ddp0["model_state"].keys()
    close(list(hvd0["model_state"].values()), list(ddp0["model_state"].values()))
    opt_ddp, opt_hvd = ddp0["optimizer_state"], hvd0["optimizer_state"]
    assert opt_hvd["param_groups"] == opt_ddp["param_groups"]
    assert opt_hvd["state"].keys() == opt_ddp["state"].keys() == ddp0["model_state"].keys()
    for name, state in opt_ddp["state"].items():
        close([opt_hvd["state"][name]["momentum_buffer"]], [state["momentum_buffer"]])
    # a ddp checkpoint loaded under horovod restores ddp's weights on every rank
    for r in hvd_ranks:
        close(r["loaded"], list(ddp0["model_state"].values()), tol=0)


def test_channels_last_weights_gradients_and_optimizer_state_broadcast_and_reduce(tmp_path):
    # Horovod refuses non-contiguous tensors: the backend sends contiguous copies
    result = run_mpt(*HVD, worker("hvd_channels_last.py"), str(tmp_path))
    assert result.returncode == 0, result.stderr
    rank0, rank1 = load_ranks(tmp_path)
    assert not torch.equal(rank0["before"][0], rank1["before"][0])  # the broadcast had work
    for key in ("setup", "momentum", "trained"):  # rank 0's weights and state, then in step
        for p0, p1 in zip(rank0[key], rank1[key], strict=True):
            assert torch.equal(p0, p1), key
    close(rank0["setup"], rank0["before"], tol=0)
    close(rank0["trained"], rank0["replay"])  # the averaged gradients of the global batch
    assert not torch.equal(rank0["trained"][0], rank0["setup"][0])
    for rank in (rank0, rank1):
        close(rank["loaded"], rank0["trained"], tol=0)
    assert rank0["channels_last"] == rank1["channels_last"] == [True, True]  # layouts kept


def test_a_failing_rank_fails_the_job_with_its_code_and_nothing_is_left(tmp_path):
    result = run_mpt(*HVD, worker("exit_code.py"), str(tmp_path), timeout=60)
    assert result.returncode == 3, result.stderr
    assert "rank 1 (node 0, local rank 1) exited with code 3" in result.stderr
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids)


def test_plain_horovodrun_is_detected_and_runs_the_horovod_backend(tmp_path):
    horovodrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable))
    assert horovodrun is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPT_")}
    result = subprocess.run(
        [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
         worker("report_world.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=60, env={**env, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (report["rank"], report["world_size"], report["source"]) == (rank, 2, "horovod")
        assert report["backend"] == "horovod" and report["sum"] == 3.0
        # torch.distributed works beside Horovod: dist.* and a default DistributedSampler
        assert report["torch_sum"] == 3.0 and report["sampler"] == [rank, rank + 2, rank + 4]


def test_mpt_horovodrun_gives_what_mpt_launch_gives(tmp_path):
    # settings, one OpenMP thread per process, --local_rank, rank<R>.log files and the tee
    logs = tmp_path / "logs"
    result = run_mpt("horovodrun", "--precision", "bf16-mixed", "--log-dir", str(logs),
                     "--tee", "1", "--local-rank-arg", "-np", "2", "-H", "localhost:2",
                     sys.executable, worker("report_world.py"), str(tmp_path),
                     env={"OMP_NUM_THREADS": ""})
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "rank1.json").read_text())
    assert (report["backend"], report["precision"], report["sum"]) == ("horovod", "bf16-mixed",
                                                                        3.0)
    assert report["omp"] == "1" and report["threads"] == 1
    for rank in (0, 1):
        assert f"report from rank {rank} --local_rank={rank}" in (
            logs / f"rank{rank}.log").read_text()
    assert "[rank1]: report from rank 1" in result.stdout
    assert "rank 0" not in result.stdout and "<stdout>" not in result.stdout


def test_bf16_parameters_and_bad_options_are_one_clear_error():
    # One process, no horovodrun: Horovod runs as a world of one.
    from mpt import Runtime
    from mpt.errors import UsageError

    rt = Runtime(backend="horovod", env={})
    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    with pytest.raises(UsageError, match="Horovod cannot allreduce bf16 tensors"):
        rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(UsageError, match="bf16-mixed"):
        rt.all_reduce(torch.ones(2, dtype=torch.bfloat16))
    assert rt.all_reduce(torch.ones(2), op="sum").tolist() == [1.0, 1.0]
    with pytest.raises(UsageError, match="adasum"):
        Runtime(backend="horovod", backend_options={"op": "max"}, env={})
    rt.close()


def test_one_process_steps_on_its_own_gradients_as_horovod_does():
    """A world of one reduces nothing, as hvd.DistributedOptimizer (no hooks at size 1): its
    gradients are not cast to fp16 and back under --grad-compression fp16."""
    from mpt import Runtime

    rt = Runtime(backend="horovod", grad_compression="fp16", env={})
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    twin = torch.nn.Linear(4, 2)
    twin.load_state_dict(model.state_dict())
    model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    x = torch.randn(3, 4)
    rt.backward(model(x).pow(2).sum() / 3)
    rt.step()
    plain = torch.optim.SGD(twin.parameters(), lr=1.0)
    (twin(x).pow(2).sum() / 3).backward()
    plain.step()
    for got, want in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(got, want)
    rt.close()
