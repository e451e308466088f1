"""The run settings `mpt launch` hands to its workers as ``MPT_*`` environment variables.

`mpt launch --backend deepspeed --precision bf16-mixed` exports ``MPT_BACKEND`` and
``MPT_PRECISION``; the worker's ``mpt.Runtime()`` reads them here, so the same script switches
backend by a flag. Arguments given to ``Runtime(...)`` in code take precedence over them.
"""

from __future__ import annotations

from collections.abc import Mapping

SETTINGS = {
    "backend": "MPT_BACKEND",
    "precision": "MPT_PRECISION",
    "loss_scale": "MPT_LOSS_SCALE",
    "accumulate": "MPT_ACCUMULATE",
}
"""Runtime argument -> environment variable carrying it from `mpt launch` to the workers."""


LAUNCHER_PID = "MPT_LAUNCHER_PID"
"""Pid of the `mpt launch` process that started this worker, so the worker can die with it."""


FAILURE_DIR = "MPT_FAILURE_DIR"
"""Folder where each worker of `mpt launch` notes when it failed (see mpt.launchers.worker)."""


def launcher_pid(env: Mapping[str, str]) -> int | None:
    """The pid of the `mpt launch` that started this process, if one did."""
    value = env.get(LAUNCHER_PID, "")
    return int(value) if value.isdigit() else None


def read_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The settings present in ``env``, keyed by Runtime argument name (values not yet parsed)."""
    return {arg: env[var] for arg, var in SETTINGS.items() if env.get(var)}


def settings_env(**values: object) -> dict[str, str]:
    """The environment variables that carry ``values`` (None values are left out)."""
    return {SETTINGS[arg]: str(v) for arg, v in values.items() if v is not None}
