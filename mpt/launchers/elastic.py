"""Start this node's processes through torch.distributed.run's machinery and supervise them.

torchrun's elastic agent already does what a hand-written Popen loop gets wrong: it sets each
worker's RANK/LOCAL_RANK/WORLD_SIZE, hosts the rendezvous store on node 0, watches the workers,
and when one fails it stops the others (SIGTERM, then SIGKILL after a grace period). mpt builds
its ``LaunchConfig`` with a static rendezvous (node ranks fixed by ``--nr``) and hands off.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from mpt.environments.settings import LAUNCHER_PID, settings_env
from mpt.launchers.spec import LaunchSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Failure:
    """The first rank that failed, as the launcher reports it."""

    rank: int
    """Global rank of the failed process."""
    local_rank: int
    """Its rank on its node."""
    exit_code: int
    """Its exit code, or 128 + signal number when a signal killed it (the shell's rule)."""
    signal: str = ""
    """The signal's name when a signal killed it."""


def torch_launch_config(spec: LaunchSpec) -> LaunchConfig:
    """The torchrun ``LaunchConfig`` equivalent of ``spec``."""
    logs = (DefaultLogsSpecs(log_dir=str(spec.log_dir), redirects=Std.ALL, tee=Std.ALL)
            if spec.log_dir else DefaultLogsSpecs())
    return LaunchConfig(
        min_nodes=spec.nodes,
        max_nodes=spec.nodes,
        nproc_per_node=spec.gpus,
        run_id=f"mpt-{spec.master_port}",
        rdzv_backend="static",
        rdzv_endpoint=f"{spec.master_addr}:{spec.master_port}",
        rdzv_configs={"rank": spec.nr},
        max_restarts=spec.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=logs,
    )


def worker_env(spec: LaunchSpec) -> dict[str, str]:
    """Variables the workers inherit: mpt's settings, and one thread per process on CPU."""
    env = settings_env(backend=spec.backend, precision=spec.precision, loss_scale=spec.loss_scale)
    env[LAUNCHER_PID] = str(os.getpid())  # workers bind their lives to ours (see Runtime)
    if spec.gpus > 1:
        # N processes each using every core oversubscribe the CPU (torchrun does the same).
        env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    return env


def run(spec: LaunchSpec) -> Failure | None:
    """Run this node's share of the job to the end; the first failure, or None on success."""
    os.environ.update(worker_env(spec))  # the elastic agent passes its environment on
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    try:
        elastic_launch(torch_launch_config(spec), sys.executable)(
            "-u", str(spec.script), *spec.script_args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode
        signal = failure.signal_name() if code < 0 else ""
        return Failure(rank=rank, local_rank=failure.local_rank,
                       exit_code=128 - code if code < 0 else code, signal=signal)
    return None
