"""One gradient-communication interface (``--grad-compression``, ``--bucket-mb``): every backend
honours what its engine can do, as plain torch does it, and refuses the rest before start."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from conftest import run_mpt, worker

from mpt.backends import get_backend
from mpt.backends.deepspeed_config import build_config
from mpt.comm import GradComm
from mpt.environments import World
from mpt.errors import UsageError
from mpt.precision import LossScaleConfig, make_precision
from mpt.run_config import RunConfig

STEPS = 4


# -- real processes: 2 ranks on gloo ------------------------------------------------------------

def test_each_compression_reduces_as_plain_torch_does(tmp_path, free_port):
    """ddp and apex (torch's fp16/bf16 hooks, PowerSGD) and fsdp (the reduce dtype) train to
    exactly the weights plain torch's DDP or fully_shard trains to with the same hook or policy,
    and not to the uncompressed ones; --bucket-mb cuts the buckets PowerSGD keeps state of."""
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port),
                     worker("grad_comm.py"), str(tmp_path), str(STEPS))
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        uncompressed = saved["results"]["ddp none"]["mpt"]
        for case, run in saved["results"].items():
            for got, want in zip(run["mpt"], run["torch"], strict=True):
                assert torch.equal(got, want), case
            if case != "ddp none":
                assert not all(torch.equal(a, b) for a, b in zip(run["mpt"], uncompressed,
                                                                  strict=True)), case
        # 6 layers of 72 fp32 values, buckets of 40 values: one bucket per layer
        assert saved["buckets"] == [[f"{k}.bias", f"{k}.weight"] for k in range(5, -1, -1)]


def resume_run(out: Path, port: int, *bucket_mb: str) -> dict:
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(port), "--grad-compression",
                     "powersgd", "--backend-options", '{"powersgd_start_step": 2}',
                     "--checkpoint-dir", str(out / "checkpoints"),
                     worker("powersgd_resume.py"), str(out), "6", "3", *bucket_mb)
    assert result.returncode == 0, result.stderr
    return torch.load(out / "result.pt")


def test_powersgd_error_feedback_resumes_exactly(tmp_path, free_port):
    """A job saved at step 3 of 6 and loaded into a fresh DDP wrapper ends bit for bit where the
    uninterrupted job did: the checkpoint holds every rank's error feedback (not zero), and
    PowerSGD's factors and step; the wrapper's first step, whose bucket holds the parameters in
    another order until DDP rebuilds it, carries each parameter's error with it."""
    saved = resume_run(tmp_path, free_port)
    assert len(saved["errors"]) == 2 and all(norm > 0 for rank in saved["errors"]
                                             for norm in rank)
    for got, want in zip(saved["resumed"], saved["whole"], strict=True):
        assert torch.equal(got, want)


@pytest.mark.slow
def test_powersgd_state_resumes_into_other_buckets(tmp_path, free_port):
    """Loaded into other buckets (each parameter its own), the saved error of one bucket goes
    back to its parameters and into the new buckets: the job trains on, near the other."""
    saved = resume_run(tmp_path, free_port, "0.0001")
    for got, want in zip(saved["resumed"], saved["whole"], strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0.1, atol=0.05)


# -- bad input: refused before any process starts ----------------------------------------------

@pytest.mark.parametrize(("values", "start"), [
    ({"grad_compression": "zstd"}, "--grad-compression=zstd"),
    ({"bucket_mb": "nan"}, "--bucket-mb=nan"),
    ({"bucket_mb": "-4"}, "--bucket-mb=-4"),
    ({"bucket_mb": "lots"}, "--bucket-mb=lots"),
    ({"backend": "horovod", "grad_compression": "bf16"}, "--grad-compression=bf16"),
    ({"backend": "horovod", "grad_compression": "powersgd"}, "--grad-compression=powersgd"),
    ({"backend": "fsdp", "grad_compression": "powersgd"}, "--grad-compression=powersgd"),
    ({"backend": "fsdp", "bucket_mb": 4}, "--bucket-mb=4"),
    ({"backend": "deepspeed", "grad_compression": "powersgd"}, "--grad-compression=powersgd"),
    ({"backend": "deepspeed", "bucket_mb": 4, "backend_options": {"zero_stage": 0}},
     "--bucket-mb=4"),
    ({"backend": "deepspeed", "grad_compression": "bf16",
      "backend_options": {"config": {"communication_data_type": "fp16"}}},
     "--grad-compression=bf16"),
    ({"backend": "deepspeed", "bucket_mb": 4, "backend_options": {
        "config": {"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}}}},
     "--bucket-mb=4"),
    ({"backend": "apex", "bucket_mb": 4, "backend_options": {"delay_allreduce": True}},
     "--bucket-mb=4"),
    ({"backend": "apex", "grad_compression": "fp16",
      "backend_options": {"allreduce_always_fp32": True}}, "--grad-compression=fp16"),
    ({"backend": "apex", "grad_compression": "powersgd",
      "backend_options": {"gradient_predivide_factor": 2}}, "--grad-compression=powersgd"),
    ({"grad_compression": "powersgd", "backend_options": {"powersgd_start_step": 1}},
     "backend option powersgd_start_step=1"),
])
def test_what_a_backend_cannot_do_is_one_line_naming_flag_value_and_fix(values, start):
    with pytest.raises(UsageError) as info:
        RunConfig.parse(values)
    message = str(info.value)
    assert message.startswith(start) and "\n" not in message and "Fix: " in message
    backend = values.get("backend")
    if backend and "is not one of" not in message:
        assert f"--backend {backend}" in message


def test_what_each_backend_can_do_passes():
    for backend, compression in (("ddp", "powersgd"), ("apex", "bf16"), ("horovod", "fp16"),
                                 ("deepspeed", "bf16"), ("fsdp", "fp16")):
        assert RunConfig.parse({"backend": backend, "grad_compression": compression,
                                "bucket_mb": None if backend == "fsdp" else "8"}).grad_comm == \
            GradComm(compression=compression, bucket_mb=None if backend == "fsdp" else 8.0)


STARTED = "from pathlib import Path; import sys; Path(sys.argv[1], 'started').touch()\n"


def test_mpt_launch_refuses_before_any_process_starts(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(STARTED)
    result = run_mpt("launch", "--gpus", "2", "--backend", "horovod", "--grad-compression",
                     "bf16", str(script), str(tmp_path))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "--grad-compression=bf16" in lines[0] and "--backend horovod" in lines[0]
    assert not (tmp_path / "started").exists()


def test_a_backend_built_in_code_checks_too():
    with pytest.raises(UsageError, match=r"^--grad-compression=bf16 .*--backend horovod"):
        get_backend("horovod")(world=World(), device=torch.device("cpu"),
                               precision=make_precision("fp32", "cpu"),
                               comm=GradComm(compression="bf16"))


# -- how the settings reach each engine --------------------------------------------------------

def test_deepspeed_gets_its_communication_data_type_and_buckets():
    def config(comm: GradComm, mode: str | None = None, user: dict | None = None) -> dict:
        return build_config(user or {}, stage=2, offload=frozenset(), mode=mode,
                            loss_scale=LossScaleConfig(), accumulate=1, world_size=2, comm=comm)

    plain = config(GradComm())
    assert "communication_data_type" not in plain  # DeepSpeed's own: the gradients' dtype
    assert "reduce_bucket_size" not in plain["zero_optimization"]
    made = config(GradComm(compression="bf16", bucket_mb=2))
    assert made["communication_data_type"] == "bf16"
    assert made["zero_optimization"]["reduce_bucket_size"] == 2 * 2**20 // 4  # fp32 elements
    assert made["zero_optimization"]["allgather_bucket_size"] == 2 * 2**20 // 4
    in_bf16 = config(GradComm(bucket_mb=1), mode="bf16")
    assert in_bf16["zero_optimization"]["reduce_bucket_size"] == 2**20 // 2  # bf16 elements
    odd = config(GradComm(bucket_mb=3 / 2**20))  # 3 bytes: ZeRO wants an even element count
    assert odd["zero_optimization"]["allgather_bucket_size"] == 2


def test_horovod_takes_the_bucket_size_as_its_fusion_threshold(monkeypatch):
    pytest.importorskip("horovod.torch")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1")  # restored (unset) after the test
    backend = get_backend("horovod")(world=World(), device=torch.device("cpu"),
                                     precision=make_precision("fp32", "cpu"),
                                     comm=GradComm(compression="fp16", bucket_mb=1.5))
    backend.init_process_group()
    try:
        assert os.environ["HOROVOD_FUSION_THRESHOLD"] == str(int(1.5 * 2**20))
    finally:
        backend.shutdown()
