"""Who am I? The :class:`World` of this process, read from the launcher that started it.

This is the only place in mpt that reads rank-related environment variables. Every function takes
the environment as an argument (callers pass ``os.environ``), so each launcher's rank maths is
tested with a plain dict instead of real processes.

Sources are tried in this fixed order; the first that detects wins. Launchers nest (torchrun or
mpirun inside a SLURM job, where the processes inherit the job's SLURM variables), so the
launcher that started the process itself comes before the allocation around it:

1. ``torchelastic``: torchrun, ``python -m torch.distributed.run``, ``mpt launch`` (built on
   torchrun's machinery) and the DeepSpeed launcher. Detected on ``TORCHELASTIC_RUN_ID``, or on
   ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` with ``LOCAL_WORLD_SIZE`` (DeepSpeed: ``LOCAL_SIZE``).
2. ``horovod``: horovodrun over gloo (``HOROVOD_RANK``, ...).
3. ``openmpi``: mpirun, or horovodrun over MPI (``OMPI_COMM_WORLD_RANK``, ...). Under SLURM,
   mpirun starts its daemons with srun, so its ranks inherit one SLURM task's variables.
4. ``slurm``: one process per ``srun`` task. Detected on ``SLURM_PROCID`` and ``SLURM_NTASKS``,
   except in an ``salloc`` shell (``SLURM_JOB_NAME`` is ``bash`` or ``interactive``), which is
   not one of the job's tasks.
5. ``kubernetes``: a Kubeflow PyTorchJob pod running one process (``MASTER_ADDR``,
   ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` without ``LOCAL_RANK``). A pod that runs torchrun
   (``PET_NPROC_PER_NODE``) has workers with ``LOCAL_RANK``, caught by source 1.
6. ``local``: none of the above: one process.

Every source checks that the launcher's numbers agree with ``rank = nr * gpus + local_rank`` and
``world_size = nodes * gpus`` and raises :class:`~mpt.errors.UsageError` naming the variable
when they do not, rather than starting a job whose processes disagree on who is who.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import ClassVar, NamedTuple, Protocol

from mpt.environments.world import World
from mpt.errors import UsageError

DEFAULT_PORT = 29500
"""torch.distributed's customary rendezvous port, used when a launcher names none."""


class Source(Protocol):
    """One launcher or cluster environment that can tell a process its place in the job."""

    name: ClassVar[str]

    @staticmethod
    def detects(env: Mapping[str, str]) -> bool:
        """Whether ``env`` looks like this source started the process."""

    @staticmethod
    def world(env: Mapping[str, str]) -> World:
        """The world ``env`` describes; raises UsageError when its variables disagree."""


class _Names(NamedTuple):
    """The variables one launcher uses for the rank maths; None where it has no such variable."""

    rank: str
    size: str
    local_rank: str | None = None
    local_size: str | None = None
    nodes: str | None = None
    node_rank: str | None = None


def _int(env: Mapping[str, str], name: str, source: str, least: int = 0,
         most: int | None = None) -> int:
    """Read a whole-number variable, naming it, its value and the launcher when it is unusable."""
    if name not in env:
        raise UsageError(name, "<unset>", f"it is missing while other {source} variables are set",
                         f"start the job through {source} unchanged, or unset its variables "
                         "to run as one local process")
    text = env[name]
    try:
        value: int | None = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < least or (most is not None and value > most):
        bounds = f"at least {least}" if most is None else f"in {least}..{most}"
        raise UsageError(name, text, f"it must be a whole number {bounds}",
                         f"start the job through {source} unchanged, or set {name} to such "
                         "a number")
    return value


def _first_set(env: Mapping[str, str], *names: str) -> str:
    """The first of ``names`` present in ``env``, else the first: for launchers that give the
    same number different names."""
    return next((name for name in names if name in env), names[0])


def _read_world(env: Mapping[str, str], source: str, names: _Names, *, hint: str,
                default_addr: str | None = None, default_port: int = DEFAULT_PORT) -> World:
    """Turn one launcher's variables into a World, refusing any that disagree with each other.

    Launchers state different subsets of (processes per node, nodes, node rank); what one leaves
    out follows from block placement, which is then checked against the rank it gave. ``hint``
    says how to get block placement from this launcher.
    """
    size = _int(env, names.size, source, least=1)
    gpus = _int(env, names.local_size, source, least=1) if names.local_size else None
    nodes = _int(env, names.nodes, source, least=1) if names.nodes else None
    if gpus is None:
        gpus = size // nodes if nodes else 1
    if nodes is None:
        nodes = size // gpus
    if nodes * gpus != size:
        given = ", ".join(f"{n}={env[n]}" for n in (names.nodes, names.local_size) if n)
        raise UsageError(names.size, size, "it must be nodes * processes per node, the same "
                         f"number on every node ({given})",
                         "start the same number of processes on every node")
    rank = _int(env, names.rank, source, most=size - 1)
    local_rank = _int(env, names.local_rank, source, most=gpus - 1) if names.local_rank else 0
    if names.node_rank is None or names.node_rank not in env:
        nr = rank // gpus
    else:
        nr = _int(env, names.node_rank, source, most=nodes - 1)
    if rank != nr * gpus + local_rank:
        raise UsageError(names.rank, rank, "mpt needs consecutive ranks on each node (node rank * "
                         f"processes per node + local rank = {nr}*{gpus}+{local_rank})", hint)
    has_port = "MASTER_PORT" in env
    port = _int(env, "MASTER_PORT", source, 1, 65535) if has_port else default_port
    addr = env.get("MASTER_ADDR") or default_addr or ("127.0.0.1" if nodes == 1 else None)
    return World(nodes=nodes, gpus=gpus, nr=nr, local_rank=local_rank, master_addr=addr,
                 master_port=port, source=source)


class TorchElastic:
    """torchrun and everything built on it (``mpt launch``), plus the DeepSpeed launcher, which
    sets the same variables under partly different names (LOCAL_SIZE, CROSS_RANK)."""

    name: ClassVar[str] = "torchelastic"

    @staticmethod
    def detects(env: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in env or (
            all(n in env for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
            and any(n in env for n in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")))

    @staticmethod
    def world(env: Mapping[str, str]) -> World:
        names = _Names(rank="RANK", size="WORLD_SIZE", local_rank="LOCAL_RANK",
                       local_size=_first_set(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE"),
                       node_rank=_first_set(env, "GROUP_RANK", "CROSS_RANK"))
        world = _read_world(env, TorchElastic.name, names, hint="start every node with the same "
                            "--nproc-per-node and leave the variables torchrun sets unchanged")
        if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return world  # a store of its own per attempt (torchrun's c10d rendezvous)
        return replace(world, attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))


class _RankVariables:
    """A launcher that exports a complete set of rank variables of its own: reading it is
    declaring their names, and its rank variable alone says it started the process."""

    name: ClassVar[str]
    names: ClassVar[_Names]
    hint: ClassVar[str]

    @classmethod
    def detects(cls, env: Mapping[str, str]) -> bool:
        return cls.names.rank in env

    @classmethod
    def world(cls, env: Mapping[str, str]) -> World:
        return _read_world(env, cls.name, cls.names, hint=cls.hint)


class Horovod(_RankVariables):
    """horovodrun over gloo, which exports Horovod's own rank variables."""

    name = "horovod"
    names = _Names(rank="HOROVOD_RANK", size="HOROVOD_SIZE", local_rank="HOROVOD_LOCAL_RANK",
                   local_size="HOROVOD_LOCAL_SIZE", nodes="HOROVOD_CROSS_SIZE",
                   node_rank="HOROVOD_CROSS_RANK")
    hint = "give horovodrun the same number of slots on every host (-H host1:4,host2:4)"


class OpenMpi(_RankVariables):
    """mpirun (and horovodrun over MPI); the node rank follows from block placement."""

    name = "openmpi"
    names = _Names(rank="OMPI_COMM_WORLD_RANK", size="OMPI_COMM_WORLD_SIZE",
                   local_rank="OMPI_COMM_WORLD_LOCAL_RANK", local_size="OMPI_COMM_WORLD_LOCAL_SIZE")
    hint = ("map ranks by slot (mpirun --map-by slot), not by node, so that each node holds "
            "consecutive ranks")


_HOSTLIST_HEAD = re.compile(r"((?:[^,\[\]]|\[[^\[\]]*\])+)(?:,|$)")
_HOSTLIST_RANGES = re.compile(r"\[(\d+)(?:-\d+)?(?:,\d+(?:-\d+)?)*\]")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: ``"node[01-04,07],gpu-a[1-2]"`` gives ``"node01"``.

    SLURM compresses its node list; node 0 of the job is its first host, where rank 0 runs and
    the rendezvous listens. Zero padding is part of the host name, so it is kept. Parsed here
    rather than by calling ``scontrol show hostnames``, which is not on every compute node.
    """
    head = _HOSTLIST_HEAD.match(nodelist.strip())
    host = _HOSTLIST_RANGES.sub(lambda m: m.group(1), head.group(1)) if head else ""
    if not host or "[" in host or "]" in host:
        raise UsageError("SLURM_JOB_NODELIST", nodelist, "it is not a SLURM hostlist such as "
                         "node[01-04,07]", "set MASTER_ADDR to the first node of the job")
    return host


class Slurm:
    """srun tasks, one process each; the salloc shell itself is not a task and is ignored."""

    name: ClassVar[str] = "slurm"

    @staticmethod
    def detects(env: Mapping[str, str]) -> bool:
        return ("SLURM_PROCID" in env and "SLURM_NTASKS" in env
                and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"))

    @staticmethod
    def world(env: Mapping[str, str]) -> World:
        nodelist = _first_set(env, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        addr = first_host(env[nodelist]) if nodelist in env and "MASTER_ADDR" not in env else None
        # From the job id, as Lightning does, so that two jobs sharing a node differ in port.
        job = _int(env, "SLURM_JOB_ID", Slurm.name) if "SLURM_JOB_ID" in env else None
        port = DEFAULT_PORT if job is None else 10000 + job % 20000
        names = _Names(rank="SLURM_PROCID", size="SLURM_NTASKS", local_rank="SLURM_LOCALID",
                       nodes="SLURM_NNODES", node_rank="SLURM_NODEID")
        return _read_world(env, Slurm.name, names, default_addr=addr, default_port=port,
                           hint="use srun --distribution=block (the default) so that each node "
                                "holds consecutive ranks")


class Kubernetes:
    """A Kubeflow PyTorchJob pod that runs one process: each pod is a node of one process."""

    name: ClassVar[str] = "kubernetes"

    @staticmethod
    def detects(env: Mapping[str, str]) -> bool:
        return (all(n in env for n in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))
                and "LOCAL_RANK" not in env)

    @staticmethod
    def world(env: Mapping[str, str]) -> World:
        if env.get("PET_NPROC_PER_NODE", "1").strip() != "1":
            # The pod was meant to start several workers through torchrun; this process is not
            # one of them, and taking it for the pod's only process would build a wrong world.
            raise UsageError("PET_NPROC_PER_NODE", env["PET_NPROC_PER_NODE"], "the pod is meant to "
                             "run torchrun, but this process was not started by it",
                             "start the training script with torchrun in the pod's command")
        return _read_world(env, Kubernetes.name, _Names(rank="RANK", size="WORLD_SIZE"),
                           hint="leave RANK and WORLD_SIZE as the training operator sets them")


SOURCES: tuple[type[Source], ...] = (TorchElastic, Horovod, OpenMpi, Slurm, Kubernetes)
"""Detection order; see the module docstring for why this order."""


def detect_world(env: Mapping[str, str]) -> World:
    """The world of this process, from the first source in :data:`SOURCES` that detects.

    Without any, this is one local process. A WORLD_SIZE above 1 that no source explains means
    a launcher's variables were set only in part, and training alone would silently ignore them.
    """
    for source in SOURCES:
        if source.detects(env):
            return source.world(env)
    if env.get("WORLD_SIZE", "1").strip() not in ("", "0", "1"):
        raise UsageError("WORLD_SIZE", env["WORLD_SIZE"], "no supported launcher's variables are "
                         "complete, so this process cannot tell its place in the job",
                         "also set RANK, LOCAL_RANK and LOCAL_WORLD_SIZE (as torchrun does), or "
                         "start the job with torchrun or `mpt launch`")
    return World(source="local")
