"""The calibrated cost model against a step measured here: 2 real gloo processes, a small MLP
under ddp, calibration and steps measured in the same processes in alternating rounds
(plan_ddp_step.py).

Tolerance: the predicted steps of the rounds, summed, within BOUND of the measured ones. The
goal is +-20 %. With the shape-aware matmuls and the calibrated optimizer step the model
matches each part of the step where calibration and step see the same load (docs/plan.md);
what is left is this shared 2-core machine's noise between a calibration and the steps it
predicts (load average 2-6 from other jobs while it was written): docs/benchmarks.md keeps the
runs.
"""

from __future__ import annotations

import pytest
import torch

from mpt.estimate import meta_model
from mpt.plan.network import Cluster
from mpt.plan.planner import plan
from mpt.plan.profiles import link_profile

BOUND = (0.7, 1.4)


@pytest.mark.slow
def test_calibrated_ddp_step_is_close_to_the_measured_one(free_port) -> None:
    import plan_ddp_step as job

    predicted = measured = 0.0
    for calibration, step in job.measure(free_port):
        cluster = Cluster(nodes=1, gpus=2, device=calibration.device("measured in this test"),
                          link=link_profile("1gbit"))
        result = plan(meta_model(job.build), cluster, precision="fp32", batch=2 * job.BATCH,
                      input_shape=[job.FEATURES], input_dtype=torch.float32,
                      optimizer="sgd-momentum")
        one = next(p for p in result.fitting if p.layout.label == "--backend ddp").step
        print(f"predicted {one * 1e3:.1f} ms, measured {step * 1e3:.1f} ms, "
              f"ratio {one / step:.2f}")
        predicted, measured = predicted + one, measured + step
    print(f"all rounds: ratio {predicted / measured:.2f}")
    assert BOUND[0] <= predicted / measured <= BOUND[1]
