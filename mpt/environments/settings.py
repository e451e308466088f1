"""The variables `mpt launch` sets for its workers besides the run's settings.

The settings themselves (backend, precision, ...) travel in one variable, ``MPT_RUN_CONFIG``
(see ``mpt.run_config``); these say where the launcher is and how to reach it.
"""

from __future__ import annotations

from collections.abc import Mapping

LAUNCHER_PID = "MPT_LAUNCHER_PID"
"""Pid of the `mpt launch` process that started this worker, so the worker can die with it."""


FAILURE_DIR = "MPT_FAILURE_DIR"
"""The launcher's scratch folder: each worker of `mpt launch` notes there how it ended (see
mpt.launchers.worker) and keeps its heartbeat there (see mpt.fault.heartbeat)."""


LOG_FILE = "MPT_LOG_FILE"
"""This worker's log file under `mpt launch --log-dir` (under horovodrun, the folder its launcher
writes ``rank<R>.log`` into). Its stdout already goes there; the worker then sends its stderr to
the same stream (see mpt.launchers.logs), so tracebacks stay in order."""


HOROVOD_RENDEZVOUS = "MPT_HOROVOD_RENDEZVOUS"
"""``host:port`` of the Horovod rendezvous `mpt launch` hosts, so that a script's ``hvd.init()``
joins the job (see mpt.launchers.horovod_join)."""


def horovod_rendezvous(env: Mapping[str, str]) -> str | None:
    """Where `mpt launch` hosts Horovod's rendezvous; None where it does not (or horovodrun
    started this process and set Horovod's variables itself)."""
    if "HOROVOD_RANK" in env:
        return None
    return env.get(HOROVOD_RENDEZVOUS) or None


def launcher_pid(env: Mapping[str, str]) -> int | None:
    """The pid of the `mpt launch` that started this process, if one did."""
    value = env.get(LAUNCHER_PID, "")
    return int(value) if value.isdigit() else None


def launch_dir(env: Mapping[str, str]) -> str | None:
    """The scratch folder of the `mpt launch` that started this process, if one did."""
    return env.get(FAILURE_DIR) or None
