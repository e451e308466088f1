"""Backend ``apex`` on real processes (2 ranks, gloo, CPU): Apex DDP's knobs average gradients
exactly as plain DDP does, and a training run matches one process on the whole batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from common import reference_params
from conftest import run_mpt, worker

from mpt.backends import get_backend
from mpt.backends.apex import ApexBackend, ApexDistributedDataParallel, fused_adam
from mpt.environments import World
from mpt.errors import MissingDependencyError, UsageError
from mpt.precision import make_precision

STEPS, MICRO = 4, 4


def test_apex_knobs_give_plain_ddp_gradients_on_two_ranks(tmp_path, free_port):
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--backend",
                     "apex", "--bucket-mb", str(40 * 4 / 2**20), "--gradient-predivide-factor", "2",
                     "--allreduce-always-fp32", worker("apex_knobs.py"), str(tmp_path),
                     str(STEPS), str(MICRO))
    assert result.returncode == 0, result.stderr
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    reference = reference_params(STEPS, 2 * MICRO)
    for r in ranks:
        assert r["backend"] == "apex" and r["wrapper"] == "ApexDistributedDataParallel"
        assert r["launched"] == {"options": {"gradient_predivide_factor": 2.0,
                                             "allreduce_always_fp32": True, "delay_allreduce": None,
                                             "gradient_average": None, "fused_optimizer": False,
                                             "powersgd_rank": 1, "powersgd_start_step": 1000},
                                 "predivide": 2.0, "fp32": True,  # the flags reached the hook
                                 "bucket_mb": 40 * 4 / 2**20}
        for got, want in zip(r["trained"], reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        results = r["results"]
        plain = results["plain ddp"]["grads"]
        for name in ("apex defaults", "delay_allreduce", "message_size 40", "predivide 2",
                     "predivide 8, fp32"):
            for got, want in zip(results[name]["grads"], plain, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
        for got, want in zip(results["sum"]["grads"], plain, strict=True):
            torch.testing.assert_close(got, 2 * want, rtol=1e-6, atol=1e-6)
        assert results["apex defaults"]["allreduces"] == 1  # a small model fits one bucket
        # message_size cuts a 6-layer stack into one bucket per layer; delay_allreduce keeps
        # every gradient in one bucket, reduced once backward is done; the first bucket is
        # torch DDP's 1 MiB, so the allreduce starts with backward's first gradients
        assert r["buckets"] == {"message_size 40": 6, "delay_allreduce": 1,
                                "message_size 2 MiB": 2}
    for p0, p1 in zip(ranks[0]["trained"], ranks[1]["trained"], strict=True):
        assert torch.equal(p0, p1)


def backend(**options) -> ApexBackend:
    cls = get_backend("apex")
    return cls(world=World(), device=torch.device("cpu"),
               precision=make_precision("fp32", "cpu"), options=options)


def test_backend_options_are_checked_even_on_one_process():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert backend(delay_allreduce="true").setup(model, opt) == (model, opt)
    with pytest.raises(UsageError, match=r"^--gradient-predivide-factor=lots"):  # before setup
        backend(gradient_predivide_factor="lots")
    with pytest.raises(UsageError, match=r"^--delay-allreduce=perhaps"):
        backend(delay_allreduce="perhaps")
    with pytest.raises(UsageError, match=r"^backend option gradient_average=2"):
        backend(gradient_average="2")
    with pytest.raises(UsageError, match="has no such option"):
        backend(bucket="x")


def test_bad_apex_ddp_arguments_are_usage_errors():
    model = torch.nn.Linear(2, 2)
    for kwargs in ({"message_size": 0}, {"gradient_predivide_factor": 0.0},
                   {"allreduce_trigger_params": [model.weight]}):
        with pytest.raises(UsageError):
            ApexDistributedDataParallel(model, **kwargs)


def test_availability_says_which_apex_pieces_are_in_use():
    info = ApexBackend.availability()
    assert info.available and "apex:" in info.version


def test_fused_optimizer_needs_apex_and_an_adam():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UsageError, match="Adam"):
        fused_adam(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        import apex.optimizers  # noqa: F401
    except ImportError:
        with pytest.raises(MissingDependencyError, match="Apex"):
            fused_adam(torch.optim.Adam(model.parameters()))
    else:
        pytest.skip("NVIDIA Apex is installed: the fused path is tested on GPU machines")
