"""The CLI's bad inputs: one line naming the argument, the value and a fix; exit code 2."""

from __future__ import annotations

import socket

import pytest
import torch
from conftest import run_mpt, worker

SCRIPT = worker("report_world.py")


@pytest.mark.parametrize(("args", "names"), [
    (["--backend", "horovodd", SCRIPT], ["--backend=horovodd", "ddp"]),
    (["--precision", "fp8", SCRIPT], ["--precision=fp8", "fp16-mixed", "bf16-mixed", "fp32"]),
    (["missing_script.py"], ["SCRIPT=missing_script.py", "no such file"]),
    (["--nodes", "2", "--nr", "2", SCRIPT], ["--nr=2", "0 and 1"]),
    (["--gpus", "0", SCRIPT], ["--gpus=0", "1 or more"]),
    (["--master-port", "http", SCRIPT], ["--master-port=http", "1..65535"]),
    (["--master-port", "70000", SCRIPT], ["--master-port=70000"]),
    (["--nodes", "two", SCRIPT], ["--nodes=two", "whole number"]),
    (["--loss-scale", "big", SCRIPT], ["--loss-scale=big", "dynamic"]),
    (["--no-such-flag", SCRIPT], ["--no-such-flag", "mpt launch --help"]),
    (["--nodes", "2", "--master-port", "auto", SCRIPT], ["--master-port=auto", "fixed port"]),
    (["--resume", "auto", SCRIPT], ["--resume=auto", "--checkpoint-dir"]),
    (["--resume", "no/such/ckpt", SCRIPT], ["--resume=no/such/ckpt", "no checkpoint"]),
    (["--checkpoint-dir", SCRIPT, SCRIPT], [f"--checkpoint-dir={SCRIPT}", "is a file"]),
    (["--grace-period", "0", SCRIPT], ["--grace-period=0", "positive"]),
    (["--accumulate", "0", SCRIPT], ["--accumulate=0", "at least 1"]),
    (["--backend", "horovod", "--horovod-op", "mean", SCRIPT], ["--horovod-op=mean", "adasum"]),
    (["--zero-stage", "2", SCRIPT], ["--zero-stage=2", "belongs to --backend deepspeed"]),
    (["--backend-options", "{bad", SCRIPT], ["--backend-options={bad", "JSON"]),
    (["--quiet", "--metrics-all-ranks", "--log-every", "0", SCRIPT], ["--log-every=0"]),
    (["--timeout", "soon", SCRIPT], ["--timeout=soon", "not a number"]),
    (["--rdzv-timeout", "-5", SCRIPT], ["--rdzv-timeout=-5", "positive"]),
])
def test_bad_input_is_one_line_and_exit_2(args, names):
    result = run_mpt("launch", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpt: error: "), result.stderr
    assert "Fix:" in lines[0] and "Traceback" not in result.stderr
    for name in names:
        assert name in lines[0]


def test_a_busy_master_port_is_refused_before_any_worker_starts(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run_mpt("launch", "--gpus", "2", "--master-port", str(port), SCRIPT,
                         str(tmp_path))
    assert result.returncode == 2
    assert f"--master-port={port} is invalid: the port is already in use" in result.stderr
    assert not list(tmp_path.iterdir()), "a worker ran"


def test_backends_lists_ddp_as_available():
    result = run_mpt("backends")
    assert result.returncode == 0
    row = next(line for line in result.stdout.splitlines() if " ddp " in line)
    assert "yes" in row and torch.__version__ in row
    assert "fp32 fp16-mixed bf16-mixed O0 O1 O2 O3 O2-bf16 O3-bf16" in row  # what it trains


def test_third_party_backends_register_through_entry_points(tmp_path):
    (tmp_path / "fake_backend.py").write_text(
        "from mpt.backends import DDPBackend\n\n"
        "class FakeBackend(DDPBackend):\n    name = 'fake'\n")
    dist = tmp_path / "fake_backend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-backend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[mpt.backends]\nfake = fake_backend:FakeBackend\nbroken = no_such_module:Nothing\n")
    env = {"PYTHONPATH": str(tmp_path)}
    listing = run_mpt("backends", env=env).stdout
    assert any(" fake " in line and "yes" in line for line in listing.splitlines())
    assert any(" broken " in line and "failed to load" in line for line in listing.splitlines())
    result = run_mpt("launch", "--dry-run", "--backend", "fake", SCRIPT, env=env)
    assert result.returncode == 0 and "backend fake" in result.stdout
    result = run_mpt("launch", "--backend", "broken", SCRIPT, env=env)
    assert result.returncode == 2 and "no_such_module" in result.stderr
