"""Run one command per node of an emulated cluster, as a scheduler would, and collect how each
node's command ended.

A multi-node job is N independent `mpt launch --nr i` commands that meet at node 0's address;
nothing but the network joins them. ``run_nodes`` starts them together, waits for all of them
(or for the deadline, at which every process of every node is killed), and returns each node's
exit code and output. ``launch_command`` writes node i's `mpt launch` line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpt.cluster.netns import EmulatedCluster, kill_namespace


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeResult:
    """How one node's command ended."""

    nr: int
    exit_code: int | None
    """Its exit code; None when it was killed at the deadline or never started."""
    output: str
    """Its stdout and stderr, interleaved as written."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterRun:
    """How every node's command ended."""

    nodes: tuple[NodeResult, ...]
    timed_out: bool
    """Whether the deadline passed with a command still running (all were then killed)."""
    seconds: float
    """From the first start to the last exit (or the deadline)."""

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(n.exit_code == 0 for n in self.nodes)

    def report(self) -> str:
        """Every node's exit code and output, for an assertion message."""
        return "\n".join(f"--- node {n.nr}: exit {n.exit_code}\n{n.output}" for n in self.nodes)


def launch_command(cluster: EmulatedCluster, nr: int, script: str | Path,
                   script_args: Sequence[str] = (), *, gpus: int = 1, master_port: int = 29500,
                   master_addr: str | None = None, launch_args: Sequence[str] = ()) -> list[str]:
    """Node ``nr``'s `mpt launch` line for a job across every node of ``cluster``, meeting at
    ``master_addr`` (a name such as ``node0`` resolves through each node's hosts file; None:
    node 0's address)."""
    master = cluster.members[0].address if master_addr is None else master_addr
    return [sys.executable, "-m", "mpt", "launch", "--nodes", str(cluster.nodes),
            "--gpus", str(gpus), "--nr", str(nr), "--master-addr", master,
            "--master-port", str(master_port), *launch_args, str(script), *script_args]


def run_nodes(cluster: EmulatedCluster, commands: Sequence[Sequence[str] | None], *,
              timeout: float, env: Mapping[str, str] | None = None,
              cwd: str | None = None) -> ClusterRun:
    """Run ``commands[i]`` on node i (None: node i starts nothing, as a node that never
    arrives), all at once; wait for every one, at most ``timeout`` seconds."""
    if len(commands) != cluster.nodes:
        raise ValueError(f"{len(commands)} commands for {cluster.nodes} nodes")
    base = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="mpt-cluster-") as scratch:
        files = [Path(scratch, f"node{nr}.log") for nr in range(cluster.nodes)]
        outputs = [path.open("w") for path in files]
        processes: list[subprocess.Popen[str] | None] = []
        codes: list[int | None] = [None] * cluster.nodes
        started = time.monotonic()
        try:
            for node, command, out in zip(cluster.members, commands, outputs, strict=True):
                processes.append(None if command is None
                                 else node.popen(command, env=base, output=out, cwd=cwd))
            deadline = started + timeout
            while time.monotonic() < deadline and any(
                    p is not None and codes[i] is None for i, p in enumerate(processes)):
                time.sleep(0.05)
                codes = [c if c is not None or p is None else p.poll()
                         for c, p in zip(codes, processes, strict=True)]
            seconds = time.monotonic() - started
            timed_out = any(p is not None and codes[i] is None for i, p in enumerate(processes))
        finally:
            for node in cluster.members:  # what is left (everything, after a timeout)
                kill_namespace(node.namespace)
            for process in processes:
                if process is not None:
                    process.wait()
            for out in outputs:
                out.close()
        return ClusterRun(nodes=tuple(NodeResult(nr=nr, exit_code=codes[nr],
                                                 output=files[nr].read_text(errors="replace"))
                                      for nr in range(cluster.nodes)),
                          timed_out=timed_out, seconds=seconds)
