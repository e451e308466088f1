"""The backend x precision contract: every pair is trained (see tests/conformance) or refused
before anything starts, in one line that names backend, precision and a pair that works."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
import torch.distributed as dist
from conftest import run_mpt, worker

import mpt
from mpt.backends import BUILTIN, resolve_precision
from mpt.errors import UsageError
from mpt.precision import PRECISIONS, describe

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(("name", "compute", "params", "master", "autocast", "scaling"), [
    ("fp32", F32, F32, F32, False, "none"),
    ("fp16-mixed", F16, F32, F32, True, "dynamic"),
    ("bf16-mixed", BF16, F32, F32, True, "none"),
    ("O0", F32, F32, F32, False, "none"),
    ("O1", F16, F32, F32, True, "dynamic"),
    ("O2", F16, F16, F32, False, "dynamic"),
    ("O3", F16, F16, F16, False, "none"),
    ("O2-bf16", BF16, BF16, F32, False, "none"),
    ("O3-bf16", BF16, BF16, BF16, False, "none"),
])
def test_each_precision_publishes_what_it_does_to_the_numbers(name, compute, params, master,
                                                               autocast, scaling):
    spec = describe(name)
    assert (spec.compute, spec.params, spec.master, spec.autocast, spec.loss_scaling) == (
        compute, params, master, autocast, scaling)
    assert spec.reduce == params  # gradients are reduced in the weights' dtype
    assert describe(name, options={"loss_scale": 128.0} if name in ("O2", "O3") else None
                    ).loss_scaling in ("static", scaling)


def test_overrides_change_the_descriptor():
    assert describe("O2", options={"master_weights": False, "loss_scale": 128.0}).master == F16
    assert describe("O3", options={"loss_scale": 128.0}).loss_scaling == "static"
    # batch norm stays fp32 beside a cast model unless told otherwise
    assert (describe("O2").norm, describe("O3").norm, describe("bf16-mixed").norm) == (
        F32, F16, F32)
    assert describe("O2", options={"keep_batchnorm_fp32": False}).norm == F16


@pytest.mark.parametrize("backend", sorted(BUILTIN))
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_refusal_names_backend_and_precision_and_a_pair_that_works(backend, precision,
                                                                      device_type):
    try:
        assert resolve_precision(backend, precision, device_type=device_type) == precision
        return
    except UsageError as exc:
        message = str(exc)
    assert "\n" not in message
    assert f"--precision={precision}" in message and f"--backend {backend}" in message
    # the first precision the fix names trains under the same backend
    instead = re.search(r"Fix: use --precision ([\w-]+)", message)
    assert instead is not None, message
    assert resolve_precision(backend, instead.group(1), device_type=device_type)


def test_the_known_bad_pairs_are_refused_on_this_cpu():
    refused = {(b, p) for b in BUILTIN for p in PRECISIONS
               if _refused(b, p, "cpu")}
    assert refused == {
        ("horovod", "O2-bf16"), ("horovod", "O3-bf16"),  # Horovod has no bf16 tensors
        # DeepSpeed casts and keeps masters itself; it has no fp16 on CPU
        *(("deepspeed", p) for p in ("O2", "O3", "O2-bf16", "O3-bf16", "fp16-mixed", "O1")),
    }


def _refused(backend: str, precision: str, device_type: str) -> bool:
    try:
        resolve_precision(backend, precision, device_type=device_type)
    except UsageError:
        return True
    return False


def test_mpt_launch_refuses_before_any_process_starts(tmp_path):
    start = time.monotonic()
    result = run_mpt("launch", "--gpus", "2", "--backend", "horovod", "--precision", "O2-bf16",
                     worker("equivalence.py"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Horovod has no bf16" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and time.monotonic() - start < 30


def test_a_deepspeed_configs_precision_wins_when_the_flag_is_not_given(tmp_path):
    bf16 = tmp_path / "bf16.json"
    bf16.write_text(json.dumps({"bf16": {"enabled": True}}))
    result = run_mpt("launch", "--dry-run", "--backend", "deepspeed", "--deepspeed-config",
                     str(bf16), worker("equivalence.py"))
    assert result.returncode == 0 and "precision bf16-mixed" in result.stdout, result.stderr
    clash = run_mpt("launch", "--dry-run", "--backend", "deepspeed", "--precision", "fp32",
                    "--deepspeed-config", str(bf16), worker("equivalence.py"))
    assert clash.returncode == 2 and "enables bf16" in clash.stderr
    assert len(clash.stderr.strip().splitlines()) == 1


def test_the_runtime_refuses_the_same_pairs_before_joining_a_group():
    with pytest.raises(UsageError, match="--backend deepspeed casts the model"):
        mpt.Runtime(backend="deepspeed", precision="O2-bf16", env={})
    with pytest.raises(UsageError, match="Horovod has no bf16"):
        mpt.Runtime(backend="horovod", env={"MPT_RUN_CONFIG": '{"precision": "O3-bf16"}'})
    assert not dist.is_initialized()
