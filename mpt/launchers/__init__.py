"""Who starts the processes, and who tears them all down when one fails.

The names below are imported when first used: each worker imports ``mpt.launchers.worker``,
which must not pull torch's elastic agent into every process it starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpt.lazy import lazy_attributes

if TYPE_CHECKING:
    from mpt.launchers.elastic import Failure, Outcome, run
    from mpt.launchers.spec import LaunchSpec, parse_port, port_is_free

_HOMES = {"Failure": "elastic", "Outcome": "elastic", "run": "elastic", "LaunchSpec": "spec",
          "parse_port": "spec", "port_is_free": "spec"}

__all__ = ["Failure", "LaunchSpec", "Outcome", "parse_port", "port_is_free", "run"]


__getattr__ = lazy_attributes(__name__, _HOMES)
