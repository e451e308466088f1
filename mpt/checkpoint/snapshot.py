"""``--snapshot-every K``: the training state kept in memory on two nodes, so that a lost node
costs at most K optimizer steps instead of the steps since the last checkpoint on disk.

Every K training iterations, at the end of ``rt.step``, every rank takes part in gathering what a
non-sharded checkpoint holds: the full weights and optimizer state of every model under its name,
the precision's state, the schedulers and the loaders' positions (the collectives of ``rt.save``
but the RNG's). Rank 0 copies it to host memory, every rank notes its RNG state, and the
training loop goes on. Each rank's snapshot thread then gathers the RNG states to rank 0 on a
gloo group of its own (beside the training's collectives), and rank 0's:

1. commits the snapshot as a checkpoint directory (``step-N`` with its manifest, the newest two
   kept) into this node's store: ``--snapshot-dir``, by default a directory in ``/dev/shm``
   (memory) that the node's `mpt launch` makes and removes, so it outlives the workers that a
   restart replaces, not the node;
2. sends the same files to the first rank of the next node (rank ``gpus``), whose snapshot
   thread commits them into that node's store.

The next snapshot waits for both. After a restart (a lost node, a node that joined), ``rt.resume``
asks every rank for the newest snapshot its node holds. The newest one the survivors hold, where
it is newer than the newest checkpoint on disk, is sent to every rank and loaded like a
checkpoint (it restores at any world size, under any backend); otherwise the disk checkpoint is.
With one node there is no peer: the snapshot outlives worker restarts only.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import fsspec
import torch
import torch.distributed as dist

from mpt.checkpoint import io
from mpt.checkpoint.background import BackgroundWriter
from mpt.checkpoint.encode import rng_state
from mpt.checkpoint.format import MANIFEST
from mpt.checkpoint.state import Snapshot, TrainingState, gather_object, take_snapshot
from mpt.errors import UsageError

if TYPE_CHECKING:
    from mpt.checkpoint.state import StateHolder

KEEP = 2
"""Snapshots a store keeps: the newest, and the one before while the newest is written."""
RESTORED = "memory://mpt-snapshot"
"""Where a restored snapshot is put for loading: this process's fsspec memory filesystem."""
_LENGTH = struct.Struct("<q")


def pack(files: dict[str, bytes]) -> bytearray:
    """Files as one buffer: the length of a JSON index (name: size), the index, the contents."""
    index = json.dumps({name: len(data) for name, data in files.items()}).encode()
    buffer = bytearray(_LENGTH.pack(len(index)))
    for part in (index, *files.values()):
        buffer += part
    return buffer


def unpack(buffer: bytes | memoryview) -> dict[str, memoryview]:
    """``pack``'s files, as views into ``buffer``."""
    view = memoryview(buffer)
    (size,) = _LENGTH.unpack_from(view)
    offset = _LENGTH.size + size
    files = {}
    for name, length in json.loads(bytes(view[_LENGTH.size:offset])).items():
        files[name] = view[offset:offset + length]
        offset += length
    return files


class PeerSnapshots:
    """One rank's part in the run's snapshots (see the module's docstring)."""

    def __init__(self, *, every: int, store: str, backend: StateHolder,
                 timeout: timedelta) -> None:
        self.every = every
        """Training iterations between two snapshots."""
        self.store = io.Location.parse(store)
        """This node's store (node-local memory)."""
        self.backend = backend
        world = backend.world
        # Ranks are numbered node by node: rank `gpus` is the first of the next node.
        self.peer = world.gpus if world.world_size > world.gpus else None
        """The rank that keeps the copy on another node (None: a one-node job)."""
        self.timeout = timeout
        """How long a transfer waits for the other side (the run's collective timeout)."""
        self._writer = BackgroundWriter()
        self._group: dist.ProcessGroup | None = None
        self._restored = False  # a restored snapshot waits in the memory filesystem

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def take(self, parts: TrainingState, step: int) -> None:
        """Collective: snapshot the state after training iteration ``step``."""
        self._writer.wait()  # the previous snapshot is kept on both nodes first
        if self._restored:  # loaded by now: its copy in this process's memory goes
            _forget_restored()
            self._restored = False
        if self._group is None:  # a collective: every rank makes it at its first snapshot
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        mine = rng_state()
        snapshot = take_snapshot(parts, step=step, stage=self._writer.stage)
        self._writer.submit(lambda: self._finish(step, mine, snapshot))

    def _finish(self, step: int, mine: Any, snapshot: Snapshot | None) -> None:
        """The snapshot thread's part: gather every rank's RNG state to rank 0, which keeps the
        snapshot and sends it to its peer, which keeps it too."""
        rngs: list[Any] = [None] * self.backend.world.world_size
        dist.all_gather_object(rngs, mine, group=self._group)
        if snapshot is not None:
            files = snapshot.files(rngs)
            self._keep(step, files)
            if self.peer is not None:
                buffer = pack(files)
                dist.send(torch.tensor([len(buffer)]), self.peer, group=self._group)
                dist.send(torch.frombuffer(buffer, dtype=torch.uint8), self.peer,
                          group=self._group)
        elif self.backend.world.rank == self.peer:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, 0, group=self._group)
            buffer = torch.empty(int(size), dtype=torch.uint8)
            dist.recv(buffer, 0, group=self._group)
            self._keep(step, unpack(buffer.numpy().data))

    def _keep(self, step: int, files: Mapping[str, bytes | memoryview]) -> None:
        """Commit a snapshot's files into this node's store as ``step-N`` (the manifest last,
        then the rename), and drop all but the newest ``KEEP`` (and what a killed worker left
        half-written)."""
        staging, final = io.staging_name(step), io.step_dir_name(step)
        target = self.store.child(staging)
        for name, data in files.items():
            if name != MANIFEST:
                target.write(name, data)
        target.write(MANIFEST, files[MANIFEST])
        io.commit(self.store, staging, final)
        io.prune(self.store, KEEP, protect=final)

    def newest(self) -> int | None:
        """The step of the newest snapshot committed in this node's store."""
        found = io.find_latest(self.store.url)
        return None if found is None else io.resolve(found).manifest().step

    def restore(self, newer_than: int | None) -> str | None:
        """Collective: the newest snapshot any rank's node holds, put where this process can
        load it, when it is newer than step ``newer_than`` (the disk's newest); else None."""
        backend, world = self.backend, self.backend.world
        steps = gather_object(backend, self.newest())
        best = max((s for s in steps if s is not None), default=None)
        if best is None or (newer_than is not None and best <= newer_than):
            return None
        holder = steps.index(best)
        kept = io.resolve(self.store.url) if world.rank == holder else None
        files: dict[str, bytes] = backend.broadcast_object(
            None if kept is None else {name: kept.read(name) for name in kept.listdir()},
            src=holder)
        self._restored = True
        target = io.Location.parse(f"{RESTORED}/{io.step_dir_name(best)}")
        for name, data in files.items():
            target.write(name, data)
        return target.url

    def close(self) -> None:
        """Wait for the snapshot in flight; raise its error."""
        try:
            self._writer.close()
        finally:
            _forget_restored()


def peer_snapshots(every: int, store: str | None, backend: StateHolder,
                   timeout: timedelta) -> PeerSnapshots | None:
    """The run's snapshots (``--snapshot-every``, ``--snapshot-dir``), or None (every = 0)."""
    if not every:
        return None
    if store is None:
        raise UsageError("--snapshot-every", every, "there is no --snapshot-dir to keep the "
                         "snapshots in (`mpt launch` makes one on each node)", "start the "
                         "script with `mpt launch`, or pass --snapshot-dir DIR on node-local "
                         "memory (/dev/shm)")
    return PeerSnapshots(every=every, store=store, backend=backend, timeout=timeout)


def _forget_restored() -> None:
    """Free the copy a restore left in this process's memory filesystem."""
    memory = fsspec.filesystem("memory")
    path = RESTORED.removeprefix("memory://")
    if memory.exists(path):
        memory.rm(path, recursive=True)
