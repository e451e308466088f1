"""``rt.batch_size``: the per-rank micro-batch from a global batch size, the script's own, or
a DeepSpeed config's; one line naming the flag where nothing names one."""

from __future__ import annotations

import pytest

import mpt
from mpt.backends import DeepSpeedBackend
from mpt.errors import UsageError


def test_without_any_source_it_names_the_flag_instead_of_returning_none():
    with mpt.Runtime(env={}) as rt, pytest.raises(
            UsageError, match=r"rt.batch_size=None is invalid: .*Fix: pass --global-batch-size"):
        rt.batch_size  # noqa: B018 - the property is what is tested


def test_a_global_batch_or_the_scripts_own_size_names_it():
    with mpt.Runtime(env={}, global_batch_size=12, batch_size=4) as rt:
        assert (rt.batch_size, rt.accumulate) == (4, 3)
    with mpt.Runtime(env={}, batch_size=5) as rt:
        assert rt.batch_size == 5


@pytest.mark.parametrize(("config", "dp_size", "micro"), [
    ({"train_micro_batch_size_per_gpu": 6}, 2, 6),
    ({"train_batch_size": 24, "gradient_accumulation_steps": 2}, 4, 3),
    ({"train_batch_size": 24}, 2, 12),  # the run's accumulation (1)
    ({}, 2, None),
])
def test_a_deepspeed_config_names_its_micro_batch(config, dp_size, micro):
    """What ``engine.train_micro_batch_size_per_gpu()`` returns, without starting DeepSpeed."""
    assert DeepSpeedBackend.default_batch_size({"config": config}, 1, dp_size) == micro
