"""Who starts the processes, and who tears them all down when one fails."""

from mpt.launchers.elastic import Failure, run
from mpt.launchers.spec import LaunchSpec, parse_port, port_is_free

__all__ = ["Failure", "LaunchSpec", "parse_port", "port_is_free", "run"]
