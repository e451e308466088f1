"""``--snapshot-every K``: the training state kept in memory on two nodes, so that a lost node
costs at most K optimizer steps instead of the steps since the last checkpoint on disk.

Every K training iterations, at the end of ``rt.step``, every rank takes part in gathering what a
non-sharded checkpoint holds: the full weights and optimizer state of every model under its name,
the precision's state, the schedulers and the loaders' positions (the collectives of ``rt.save``
but the RNG's). Rank 0 copies it to host memory, every rank notes its RNG state, and the
training loop goes on. Each rank's snapshot thread then gathers the RNG states to rank 0 on a
gloo group of its own (beside the training's collectives, as tensors: nothing is pickled), and
rank 0's lays the checkpoint's files out in host memory it keeps from one snapshot to the next
(``pack``: the files one after the other, the manifest last, then an index; each file with its
crc32 in the manifest), and:

1. sends that buffer to the first rank of the next node (rank ``gpus``), whose snapshot thread
   commits it into that node's store as rank 0's commits it into its own (2.);
2. commits it into this node's store as one file, ``step-N.snapshot``: written under a
   temporary name, then renamed (the commit), the newest two kept. The store is
   ``--snapshot-dir``, by default a directory in ``/dev/shm`` (memory) that the node's
   `mpt launch` makes and removes, so it outlives the workers that a restart replaces, not the
   node.

The next snapshot waits for both. After a restart (a lost node, a node that joined), ``rt.resume``
asks every rank for the newest snapshot its node holds. The newest one the survivors hold, where
it is newer than the newest checkpoint on disk, is sent to every rank (the file's bytes, as one
tensor), unpacked into a checkpoint directory in memory and loaded like a checkpoint (it
restores at any world size, under any backend, and its crc32s are checked first); otherwise the
disk checkpoint is. With one node there is no peer: the snapshot outlives worker restarts only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zlib
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import fsspec
import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors

from mpt.checkpoint import io, tensorfile
from mpt.checkpoint.background import BackgroundWriter
from mpt.checkpoint.encode import encode, rng_state
from mpt.checkpoint.format import MANIFEST, CheckpointError, FileEntry, crc32_hex
from mpt.checkpoint.state import Snapshot, TrainingState, gather_object, take_snapshot
from mpt.errors import UsageError

if TYPE_CHECKING:
    from mpt.checkpoint.state import StateHolder

KEEP = 2
"""Snapshots a store keeps: the newest, and the one before while the newest is written."""
RESTORED = "memory://mpt-snapshot"
"""Where a restored snapshot is put for loading: this process's fsspec memory filesystem."""
SUFFIX = ".snapshot"
"""A committed snapshot in a store: ``step-N.snapshot``."""
_COMMITTED = re.compile(r"step-(\d+)\.snapshot")
_LENGTH = struct.Struct("<q")
_PIECE = 8 << 20
"""Bytes per write() (see tensorfile)."""
_TAIL = 1 << 16
"""Room kept after the files for the manifest and the index, so that they need no new memory."""


def pack(files: Mapping[str, bytes]) -> bytes:
    """Files as one buffer: their contents one after the other, then an index (JSON, name:
    size, in that order) and its length (8 bytes, little-endian)."""
    index = json.dumps({name: len(data) for name, data in files.items()}).encode()
    return b"".join([*files.values(), index, _LENGTH.pack(len(index))])


def unpack(buffer: bytes | memoryview, where: str = "snapshot") -> dict[str, memoryview]:
    """``pack``'s files, as views into ``buffer``; a CheckpointError where it is not one whole
    (torn or damaged)."""
    view = memoryview(buffer)
    end = len(view) - _LENGTH.size
    try:
        (size,) = _LENGTH.unpack_from(view, end)
        index = json.loads(bytes(view[end - size:end])) if 0 < size <= end else None
        files, offset = {}, 0
        for name, length in index.items():
            files[str(name)] = view[offset:offset + length]
            offset += length
    except (struct.error, ValueError, TypeError, AttributeError):
        offset, files = -1, {}
    if offset != end - size or offset < 0:
        raise CheckpointError(where, "its index does not describe its bytes: it is torn or "
                              "damaged", "resume from another snapshot or the disk checkpoint")
    return files


class HostMemory:
    """One buffer in host memory, kept from one snapshot to the next and grown as needed:
    memory fresh from the OS costs a page fault per 4 KiB (see ``BackgroundWriter.stage``)."""

    def __init__(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)

    def get(self, size: int, keep: int = 0) -> memoryview:
        """At least ``size`` bytes, the first ``keep`` as they were."""
        if self.tensor.numel() < size:
            grown = torch.empty(size + size // 4, dtype=torch.uint8)
            grown[:keep].copy_(self.tensor[:keep])
            self.tensor = grown
        return memoryview(self.tensor.numpy())


def lay_out(files: Mapping[str, bytes | Mapping[str, torch.Tensor]],
            manifest: Callable[[dict[str, FileEntry]], bytes], memory: HostMemory) -> int:
    """``pack`` of ``files`` (bytes, or the tensors of a safetensors file) and then their
    manifest, made in ``memory``; return its size. ``manifest(entries)`` makes the manifest
    from each file's size and crc32. The tensors' bytes are copied once, into ``memory``, from
    which the store's file is written and the peer's copy sent."""
    plan: list[tuple[str, bytes, dict[str, torch.Tensor]]] = []
    size = 0
    for name, content in files.items():
        if isinstance(content, bytes):
            plan.append((name, content, {}))
            size += len(content)
        else:
            ordered = {key: t.detach() for key, t in sorted(content.items())}
            head = tensorfile.header(ordered)
            plan.append((name, head, ordered))
            size += len(head) + sum(tensorfile.nbytes(t) for t in ordered.values())
    view = memory.get(size + _TAIL)
    entries, offset = {}, 0
    for name, head, tensors in plan:
        start = offset
        view[offset:offset + len(head)] = head
        offset += len(head)
        for t in tensors.values():
            n = tensorfile.nbytes(t)
            if n:
                memory.tensor[offset:offset + n].copy_(t.reshape(-1).view(torch.uint8))
            offset += n
        entries[name] = FileEntry(bytes=offset - start,
                                  crc32=crc32_hex(zlib.crc32(view[start:offset])))
    text = manifest(entries)  # last: the manifest, then the index
    index = json.dumps({**{name: e.bytes for name, e in entries.items()},
                        MANIFEST: len(text)}).encode()
    tail = b"".join([text, index, _LENGTH.pack(len(index))])
    view = memory.get(offset + len(tail), keep=offset)
    view[offset:offset + len(tail)] = tail
    return offset + len(tail)


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
        self._memory = HostMemory()  # rank 0's and the peer's packed snapshot
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
        group = self._gloo()
        mine = rng_state()
        snapshot = take_snapshot(parts, step=step, stage=self._writer.stage)
        self._writer.submit(lambda: self._finish(step, mine, snapshot, group))

    def _gloo(self) -> dist.ProcessGroup:
        """The snapshots' own gloo group (a collective: every rank makes it at its first
        snapshot or restore)."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._group

    def _finish(self, step: int, mine: Any, snapshot: Snapshot | None,
                group: dist.ProcessGroup) -> None:
        """The snapshot thread's part: gather every rank's RNG state to rank 0, which lays the
        snapshot out, sends it to its peer and keeps it; the peer keeps it too."""
        rngs = _gather_rngs(mine, self.backend.world.rank, self.backend.world.world_size,
                            group)
        if snapshot is not None:
            size = lay_out(snapshot.files(*rngs), snapshot.manifest_of, self._memory)
            if self.peer is not None:  # first: the peer commits while this rank does
                dist.send(torch.tensor([size]), self.peer, group=group)
                dist.send(self._memory.tensor[:size], self.peer, group=group)
            self._keep(step, self._memory.get(size)[:size])
        elif self.backend.world.rank == self.peer:
            length = torch.zeros(1, dtype=torch.int64)
            dist.recv(length, 0, group=group)
            size = int(length)
            view = self._memory.get(size)
            dist.recv(self._memory.tensor[:size], 0, group=group)
            self._keep(step, view[:size])

    def _keep(self, step: int, data: memoryview) -> None:
        """Commit a snapshot into this node's store as ``step-N.snapshot`` (written under a
        temporary name, then renamed), and drop all but the newest ``KEEP`` (and snapshots of
        this step or later: an abandoned run's; and what a killed worker left half-written).

        The oldest snapshot is not deleted but renamed away and written over: the memory of a
        file in /dev/shm is then reused, not allocated (and zeroed) anew each time."""
        store, final = self.store, f"{io.step_dir_name(step)}{SUFFIX}"
        names = self._names()
        committed = sorted(_committed(names).items())
        doomed = [name for s, name in committed if s >= step]
        older = [name for s, name in committed if s < step]
        doomed += older[:max(len(older) - (KEEP - 1), 0)]
        if not store.local:  # an object store: the one put of the final name is the commit
            store.fs.pipe_file(store.local_path(final), bytes(data))
            for name in doomed:
                if name != final:
                    store.fs.rm_file(store.local_path(name))
            return
        os.makedirs(store.path, exist_ok=True)
        staging = store.local_path(io.staging_name(step))
        if doomed:  # uncommitted first: a kill from here on leaves only a temporary file
            os.rename(store.local_path(doomed.pop(0)), staging)
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT, 0o666)
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:done + _PIECE])
            os.ftruncate(fd, len(data))  # a longer file written over: its end goes
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(staging, store.local_path(final))
        io.sync_directory(store.path)
        for name in [*doomed, *filter(io.leftover, names)]:
            path = store.local_path(name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)

    def _names(self) -> list[str]:
        """What this node's store holds."""
        if not self.store.local:
            return self.store.listdir()
        return os.listdir(self.store.path) if os.path.isdir(self.store.path) else []

    def newest(self) -> int | None:
        """The step of the newest snapshot committed in this node's store."""
        return max(_committed(self._names()), default=None)

    def restore(self, newer_than: int | None) -> str | None:
        """Collective: the newest snapshot any rank's node holds, put where this process can
        load it, when it is newer than step ``newer_than`` (the disk's newest); else None."""
        backend, world = self.backend, self.backend.world
        steps = gather_object(backend, self.newest())
        best = max((s for s in steps if s is not None), default=None)
        if best is None or (newer_than is not None and best <= newer_than):
            return None
        holder, group = steps.index(best), self._gloo()
        name = f"{io.step_dir_name(best)}{SUFFIX}"
        kept = self.store.read(name) if world.rank == holder else b""
        length = torch.tensor([len(kept)])
        dist.broadcast(length, holder, group=group)
        buffer = torch.empty(int(length), dtype=torch.uint8)
        if world.rank == holder:
            memoryview(buffer.numpy())[:] = kept
        dist.broadcast(buffer, holder, group=group)
        files = unpack(memoryview(buffer.numpy()), f"{self.store.url}/{name}")
        self._restored = True
        target = io.Location.parse(f"{RESTORED}/{io.step_dir_name(best)}")
        for part in (part for part in files if part != MANIFEST):
            target.write(part, bytes(files[part]))
        target.write(MANIFEST, bytes(files[MANIFEST]))
        return target.url

    def close(self) -> None:
        """Wait for the snapshot in flight; raise its error."""
        try:
            self._writer.close()
        finally:
            _forget_restored()


def _gather_rngs(mine: Any, rank: int, world_size: int, group: dist.ProcessGroup
                 ) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """Collective: every rank's RNG state ``mine`` on rank 0, as ``encode`` makes a list of
    them under ``rng`` (the JSON of each, its tensors by key); empty elsewhere. Each rank's is
    sent as bytes (its JSON and a safetensors file, ``pack``ed): no pickle either way."""
    tensors: dict[str, torch.Tensor] = {}
    tree = encode(mine, f"rng/{rank}", tensors)
    blob = pack({"tree": json.dumps(tree).encode(), "tensors": tensorfile.dump(tensors)})
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(lengths, torch.tensor([len(blob)]), group=group)
    longest = max(int(n) for n in lengths)
    padded = torch.frombuffer(bytearray(blob.ljust(longest, b"\0")), dtype=torch.uint8)
    into = [torch.empty(longest, dtype=torch.uint8) for _ in lengths] if rank == 0 else None
    dist.gather(padded, into, dst=0, group=group)
    trees: list[Any] = []
    every: dict[str, torch.Tensor] = {}
    for received, n in zip(into or [], lengths, strict=False):
        parts = unpack(memoryview(received.numpy())[:int(n)], "an RNG state")
        trees.append(json.loads(bytes(parts["tree"])))
        every.update(load_tensors(bytes(parts["tensors"])))
    return trees, every


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


def _committed(names: list[str]) -> dict[int, str]:
    """The committed snapshots among a store's ``names``, by step."""
    return {int(found[1]): name for name in names if (found := _COMMITTED.fullmatch(name))}


def _forget_restored() -> None:
    """Free the copy a restore left in this process's memory filesystem."""
    memory = fsspec.filesystem("memory")
    path = RESTORED.removeprefix("memory://")
    if memory.exists(path):
        memory.rm(path, recursive=True)
