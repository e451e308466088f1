"""What `mpt launch` was asked to do, validated before any process starts."""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mpt.backends import get_backend, registered, resolve_precision
from mpt.elastic import NodeRange, check_elastic, plan_sizes
from mpt.environments import World
from mpt.environments.host_memory import host_memory_env
from mpt.errors import UsageError
from mpt.launchers.horovod_join import check_port
from mpt.launchers.local_rank import LOCAL_RANK_ARG
from mpt.launchers.logs import DEFAULT_TEE
from mpt.parallel import ParallelPlan, divisors
from mpt.precision import LossScaleConfig
from mpt.run_config import RunConfig
from mpt.scaling import plan_batch


def parse_port(value: str, nodes: int) -> int:
    """A ``--master-port`` value as an int, or a UsageError that says what a port is. ``auto``
    is a port free now, on a job of one node (the others could not know it)."""
    if value == "auto":
        if nodes != 1:
            raise UsageError("--master-port", value, "the other nodes cannot know the port node 0 "
                             "would pick", "pass a fixed port, the same on every node")
        return free_port()
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise UsageError("--master-port", value, "a TCP port is a number in 1..65535",
                         "pass a free port such as 29500, or auto")
    return port


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchSpec:
    """One node's share of a job: which processes to start, where they meet, what they run."""

    script: Path
    """The training script every process runs."""
    script_args: tuple[str, ...] = ()
    """Arguments passed to the script unchanged."""
    nodes: int = 1
    """Nodes in the job; each runs one `mpt launch`. With ``min_nodes``: the most nodes."""
    min_nodes: int | None = None
    """``--nodes MIN:MAX``'s MIN: the job is elastic, node ranks come from torch's c10d
    rendezvous (``nr`` is unused) and it goes on while at least MIN nodes remain. None: static."""
    gpus: int = 1
    """Processes on this node: one per GPU, or CPU processes on gloo where there is no GPU."""
    nr: int = 0
    """This node's rank; node 0 hosts the rendezvous."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, reachable from every node."""
    master_port: int = 29500
    """Port of the rendezvous on node 0."""
    local_addr: str | None = None
    """This node's address as the other nodes reach it, for an elastic job's rendezvous (None:
    the address of its fully qualified host name): where node 0 of a round hosts its workers'
    store. Needed where host names do not tell nodes apart (network namespaces, multi-homed
    hosts)."""
    run: RunConfig = field(default_factory=RunConfig)
    """What every worker trains with: backend, precision, ... (exported as MPT_RUN_CONFIG); its
    precision is the resolved one once the spec exists (a DeepSpeed config's, or fp32)."""
    log_dir: Path | None = None
    """Where each rank's stdout/stderr is also written, one file per rank."""
    tee: frozenset[int] = DEFAULT_TEE
    """Global ranks whose output, with --log-dir, also reaches the console (rank-prefixed)."""
    max_restarts: int = 0
    """How often the whole gang is restarted after a failure before the job fails."""
    grace_period: int = 30
    """Seconds a rank gets to exit after SIGTERM (a peer failed) or SIGUSR1 (preemption: finish
    the step, save) before it is sent SIGKILL."""
    rdzv_timeout: int = 900
    """Seconds node 0 waits for the other nodes' launchers to arrive before giving up."""
    heartbeat_timeout: float = 300.0
    """Seconds without progress after which the launcher reports a rank as stalled; 0: never."""
    local_rank_arg: bool = False
    """Pass ``--local_rank=<N>`` to the script, as ``torch.distributed.launch`` did."""
    launch_options: Mapping[str, Any] = field(default_factory=dict)
    """How the job is started (``Backend.launch_options``), by name: as given, then the run
    backend's own, parsed and with their defaults (the workers never see them)."""

    @property
    def elastic(self) -> bool:
        """True for ``--nodes MIN:MAX``: the world may shrink and grow between restarts."""
        return self.min_nodes is not None

    @property
    def node_range(self) -> NodeRange:
        """``--nodes`` as given: N, or MIN:MAX."""
        return NodeRange(self.nodes if self.min_nodes is None else self.min_nodes, self.nodes,
                         elastic=self.elastic)

    @property
    def world(self) -> World:
        """The job's rank layout as seen from local rank 0 of this node (the largest world of
        an elastic job)."""
        return World(nodes=self.nodes, gpus=self.gpus, nr=self.nr, master_addr=self.master_addr,
                     master_port=self.master_port, source="mpt launch")

    def __post_init__(self) -> None:
        self.world  # noqa: B018 - World validates nodes, gpus, nr and the port: those errors first
        # Refuses a pair the backend would train wrong; the workers get the name it resolved.
        run = self.run
        resolved = resolve_precision(
            run.backend, run.precision, loss_scale=LossScaleConfig.parse(run.loss_scale),
            precision_options=run.precision_options, backend_options=run.backend_options,
            device_type="cuda" if torch.cuda.is_available() else "cpu")
        object.__setattr__(self, "run", dataclasses.replace(run, precision=resolved))
        if self.elastic:
            check_elastic(self.node_range, self.backend)
        run = self.run
        for count in self.node_range.sizes:  # the layout every world of the job has
            try:
                run.layout(count * self.gpus)
            except UsageError as exc:
                if not (self.elastic and exc.argument == "--pipeline-stages"
                        and len(run.pipeline_stages) == 1):
                    raise
                stages = run.pipeline_stages[0]  # offer a fallback count for such worlds
                raise UsageError("--pipeline-stages", stages, f"{exc.problem} at {count} "
                                 f"node(s) of --nodes {self.node_range}", "list counts in "
                                 f"order of preference (e.g. --pipeline-stages {stages},1: no "
                                 "pipeline where it does not divide), or a --nodes range it "
                                 "divides") from None
        tp = self.run.tensor_parallel
        if tp > 1 and self.gpus % tp:  # a tp group's per-layer collectives stay in one node
            fits = divisors(self.gpus)
            raise UsageError("--tensor-parallel", tp, f"a tensor-parallel group must lie within "
                             f"one node, and {tp} does not divide the {self.gpus} process(es) "
                             "of a node", f"pass --tensor-parallel one of "
                             f"{', '.join(map(str, fits))}, or change --gpus")
        if self.run.global_batch_size is not None:  # the script's batch size is checked later
            if self.elastic:
                plan_sizes(self.run.global_batch_size, self.node_range, self.gpus,
                           self.run.layout)
            else:
                plan_batch(self.run.global_batch_size, self.layout.dp_size)
        if not self.script.is_file():
            raise UsageError("SCRIPT", str(self.script), "no such file",
                             "pass the path of the training script, e.g. examples/digits.py")
        if self.max_restarts < 0:
            raise UsageError("--max-restarts", self.max_restarts, "it cannot be negative",
                             "pass 0 to fail on the first error")
        for flag, value in {"--grace-period": self.grace_period,
                            "--rdzv-timeout": self.rdzv_timeout}.items():
            if value <= 0:
                raise UsageError(flag, value, "it must be positive", f"pass {flag} 30, for "
                                 "example")
        if self.heartbeat_timeout < 0:
            raise UsageError("--heartbeat-timeout", self.heartbeat_timeout, "it cannot be "
                             "negative", "pass 0 to turn the report off, or 300")
        if self.run.resume == "auto" and self.run.checkpoint_dir is None:
            raise UsageError("--resume", "auto", "there is no --checkpoint-dir to look in",
                             "pass --checkpoint-dir DIR as well")
        object.__setattr__(self, "launch_options", self._own_launch_options())

    def _own_launch_options(self) -> dict[str, Any]:
        """The run backend's launch options, parsed, with the defaults of those not given; one
        that selects another backend's launcher is refused (the others do nothing here)."""
        own = get_backend(self.backend)
        for name, value in self.launch_options.items():
            if value is None or name in own.launch_options:
                continue
            owner = next((cls for cls in registered().values() if name in cls.launch_options
                          and cls.launch_options[name].selects_launcher), None)
            if owner is not None:
                raise UsageError(owner.launch_options[name].flag, value, f"backend "
                                 f"{self.backend!r} is not started by {owner.launcher}",
                                 f"use --backend {owner.name}, or run `mpt launch --nr R` on "
                                 "each node")
        given = {k: v for k, v in self.launch_options.items() if v is not None}
        return {name: option.parse(option.flag, given[name]) if name in given
                else option.default for name, option in own.launch_options.items()}

    def job_launcher(self) -> str | None:
        """The launcher (a module of ``mpt.launchers``) that starts the whole job from this
        node, where a launch option given selects the backend's own (``--hosts``: horovodrun);
        None: this node's `mpt launch` starts its own processes, whatever the backend."""
        own = get_backend(self.backend)
        selected = any(option.selects_launcher and self.launch_options.get(name)
                       for name, option in own.launch_options.items())
        return own.launcher if selected else None

    @property
    def backend(self) -> str:
        return self.run.backend

    @property
    def layout(self) -> ParallelPlan:
        """The job's parallel layout (at its largest world, for an elastic job)."""
        return self.run.layout(self.world.world_size)

    def worker_env(self) -> dict[str, str]:
        """What every worker inherits, whichever launcher starts it: the run's settings (its
        ``mpt.Runtime`` reads them), one thread per process, the allocator ``--host-memory``
        preloads, and what the backend's engine reads from the environment."""
        return {**self.run.to_env(), **thread_env(self.gpus),
                **host_memory_env(self.run.host_memory, os.environ),
                **get_backend(self.backend).worker_env(self)}

    def worker_args(self) -> list[str]:
        """What each process runs after ``python``: the script through mpt's worker shim."""
        flag = [LOCAL_RANK_ARG] if self.local_rank_arg else []
        return ["-u", "-m", "mpt.launchers.worker", *flag, str(self.script), *self.script_args]

    def check_machine(self, cuda_devices: int) -> None:
        """Errors that depend on this machine, or that only a run (no ``--dry-run``) meets: too
        few GPUs, a rendezvous port already taken, what the workers' Horovod needs here."""
        if cuda_devices and self.gpus > cuda_devices:
            raise UsageError("--gpus", self.gpus, f"this node has only {cuda_devices} visible "
                             f"GPU(s)", f"pass --gpus {cuda_devices} or fewer, or check "
                             "CUDA_VISIBLE_DEVICES")
        if self.nr == 0 and not self.elastic and not port_is_free(self.master_port):
            raise UsageError("--master-port", self.master_port, "the port is already in use on "
                             "this node", "pick another port, or stop the job that holds it")
        if not self.elastic:  # an elastic job runs no Horovod rendezvous (Horovod is refused)
            check_port(self)
        get_backend(self.backend).check_launch(self)


def thread_env(processes_per_node: int | None) -> dict[str, str]:
    """One OpenMP thread per process where a node runs several, unless the user chose: N
    processes each using every core oversubscribe the CPU (torchrun does the same)."""
    if (processes_per_node or 0) > 1 and not os.environ.get("OMP_NUM_THREADS"):
        return {"OMP_NUM_THREADS": "1"}
    return {}


def free_port() -> int:
    """A port nothing listens on now, picked by the kernel (``--master-port auto``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    """True when nothing listens on ``port`` (node 0 binds it for the rendezvous store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR: a port left in TIME_WAIT by a finished job is free to use again.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True
