"""Who starts the processes, and who tears them all down when one fails."""

from mpt.launchers.elastic import Failure, Outcome, run
from mpt.launchers.spec import LaunchSpec, parse_port, port_is_free

__all__ = ["Failure", "LaunchSpec", "Outcome", "parse_port",
           "port_is_free", "run"]
