"""An emulated cluster on one machine, for multi-node tests and benchmarks: nodes are network
namespaces with their own addresses on a bridge, links shaped by tc (see ``netns``); each node
runs its own `mpt launch --nr i` (see ``run``)."""

from mpt.cluster.netns import (
    ClusterError,
    EmulatedCluster,
    LinkShape,
    Node,
    unavailable_reason,
)
from mpt.cluster.run import ClusterRun, NodeResult, launch_command, run_nodes

__all__ = ["ClusterError", "ClusterRun", "EmulatedCluster", "LinkShape", "Node", "NodeResult",
           "launch_command", "run_nodes", "unavailable_reason"]
