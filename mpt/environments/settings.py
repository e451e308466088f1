"""The run settings `mpt launch` hands to its workers as ``MPT_*`` environment variables.

`mpt launch --backend deepspeed --precision bf16-mixed` exports ``MPT_BACKEND`` and
``MPT_PRECISION``; the worker's ``mpt.Runtime()`` reads them here, so the same script switches
backend by a flag. Arguments given to ``Runtime(...)`` in code take precedence over them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

SETTINGS = {
    "backend": "MPT_BACKEND",
    "precision": "MPT_PRECISION",
    "loss_scale": "MPT_LOSS_SCALE",
    "accumulate": "MPT_ACCUMULATE",
    "backend_options": "MPT_BACKEND_OPTIONS",
    "precision_options": "MPT_PRECISION_OPTIONS",
    "run_dir": "MPT_RUN_DIR",
    "quiet": "MPT_QUIET",
    "log_every": "MPT_LOG_EVERY",
    "metrics_all_ranks": "MPT_METRICS_ALL_RANKS",
    "global_batch_size": "MPT_GLOBAL_BATCH_SIZE",
    "lr_scaling": "MPT_LR_SCALING",
    "timeout": "MPT_TIMEOUT",
    "checkpoint_dir": "MPT_CHECKPOINT_DIR",
    "resume": "MPT_RESUME",
}
"""Runtime argument -> environment variable carrying it from `mpt launch` to the workers."""


LAUNCHER_BACKENDS = {"HOROVOD_RANK": "horovod"}
"""A launcher's variable -> the backend its processes need when MPT_BACKEND is unset: a script
started by a plain ``horovodrun`` (gloo) can only join the job through Horovod's rendezvous."""


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


def read_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """The settings present in ``env``, keyed by Runtime argument name.

    Values are strings still to be parsed, except the ``*_options`` dicts (carried as JSON).
    A launcher that implies a backend (``LAUNCHER_BACKENDS``) sets it when MPT_BACKEND is unset.
    """
    values: dict[str, Any] = {arg: env[var] for arg, var in SETTINGS.items() if env.get(var)}
    for options in ("backend_options", "precision_options"):
        if options in values:
            values[options] = json.loads(values[options])
    implied = [backend for var, backend in LAUNCHER_BACKENDS.items() if var in env]
    if "backend" not in values and implied:
        values["backend"] = implied[0]
    return values


def settings_env(**values: object) -> dict[str, str]:
    """The variables that carry ``values`` (None values and empty dicts are left out)."""
    return {SETTINGS[arg]: json.dumps(v) if isinstance(v, dict) else str(v)
            for arg, v in values.items() if v is not None and v != {}}
