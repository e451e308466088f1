"""Start this node's processes through torch.distributed.run's machinery and supervise them.

torchrun's elastic agent already does what a hand-written Popen loop gets wrong: it sets each
worker's RANK/LOCAL_RANK/WORLD_SIZE, hosts the rendezvous store on node 0, watches the workers,
and when one fails it stops the others (SIGTERM, then SIGKILL after a grace period). mpt builds
its ``LaunchConfig`` with a static rendezvous (node ranks fixed by ``--nr``) and hands off.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from mpt.environments.settings import FAILURE_DIR, LAUNCHER_PID
from mpt.launchers.notes import Note
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


def worker_env(spec: LaunchSpec, failure_dir: str) -> dict[str, str]:
    """Variables the workers inherit: the spec's settings, and the launcher's own two."""
    env = spec.worker_env()
    env[LAUNCHER_PID] = str(os.getpid())  # workers bind their lives to ours (see Runtime)
    env[FAILURE_DIR] = failure_dir  # where they note when they failed (see root_cause)
    return env


def root_cause(failures: dict[int, ProcessFailure], notes: dict[int, Note]) -> Failure:
    """The rank whose failure brought the job down.

    torch's own choice (``get_first_failure``) compares timestamps in whole seconds and also
    lists the ranks the agent stopped itself, so it often names a victim. Here, in order:
    a rank that died without a note (a crash signal, the OOM killer's SIGKILL, ``os._exit``);
    then the rank whose note (by pid) is earliest; last, ranks ended by SIGTERM, which is what
    the agent sends the survivors.
    """

    def order(item: tuple[int, ProcessFailure]) -> tuple[int, float]:
        failure = item[1]
        if failure.pid in notes:
            return 1, notes[failure.pid].failed_at
        if failure.exitcode == -signal.SIGTERM:
            return 2, failure.timestamp
        return 0, failure.timestamp

    rank, failure = min(failures.items(), key=order)
    if failure.pid in notes:
        # The script's own code: the agent's SIGTERM may still catch the rank on its way out
        # (in atexit handlers) once a peer has failed in turn, and replace the code it exits with.
        return Failure(rank=rank, local_rank=failure.local_rank,
                       exit_code=notes[failure.pid].exit_code)
    code = failure.exitcode
    return Failure(rank=rank, local_rank=failure.local_rank,
                   exit_code=128 - code if code < 0 else code,
                   signal=failure.signal_name() if code < 0 else "")


def run(spec: LaunchSpec) -> Failure | None:
    """Run this node's share of the job to the end; the first failure, or None on success."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="mpt-failures-") as failure_dir:
        # The elastic agent passes its own environment on to the workers.
        os.environ.update(worker_env(spec, failure_dir))
        try:
            elastic_launch(torch_launch_config(spec), sys.executable)(
                "-u", "-m", "mpt.launchers.worker", str(spec.script), *spec.script_args)
        except ChildFailedError as err:
            return root_cause(err.failures, Note.read_all(failure_dir))
    return None
