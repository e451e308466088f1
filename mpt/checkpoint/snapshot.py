"""``--snapshot-every K``: the training state kept in the memory of two nodes, every rank keeping
its own part, so that a lost node costs at most K optimizer steps and no rank ever holds more
than its share.

Every K training iterations, at the end of ``rt.step``:

1. Every rank lists the boxes of the state it holds (``mpt.checkpoint.boxes``: its fsdp or
   ZeRO-3 shards, its pipeline stage's tensors, or whole tensors where every rank holds the
   whole state) and its RNG state; one gather of these small lists tells every rank which
   boxes it keeps (a box several ranks hold alike is kept by one of them: under ddp each rank
   keeps 1/N of the state).
2. Each rank writes its piece, ``step-N.rank-R-of-W.snapshot``, into its node's store, from
   the tensors' memory straight into the file (no copy in the process: the store is
   ``--snapshot-dir``, by default a directory in ``/dev/shm`` that the node's ``mpt launch``
   makes and removes, so it outlives the workers a restart replaces, not the node): written
   under a temporary name, then renamed (the commit). The training loop goes on.
3. The snapshot thread sends that file to the same local rank of the next node and receives the
   previous node's, in bounded pieces, on a gloo group of its own; each commits what it receives
   into its own store. A store keeps the newest two snapshots' pieces. The next snapshot waits
   for the exchange.

A piece file is its boxes' bytes one after the other, then a JSON header (the step, the ranks,
the table of every rank's boxes, the state's structure, every rank's RNG state, the manifest's
fields, where each box's bytes lie and their crc32), the header's crc32 and its length.

After a restart (a lost node, a node that joined), ``rt.resume`` asks every rank which pieces
its node's store holds intact. The newest step of which the survivors hold every piece, where
it is newer than the newest checkpoint on disk, is restored: each rank of the new run works out
which boxes overlap the parts it holds (its new shards, at any world size and under any backend)
and their holders read and send just the overlapping parts, every pair of ranks at once, a
window of at most ``CHUNK`` bytes in flight at a time. Otherwise the disk checkpoint is
loaded. With one node there is no peer: the snapshot outlives worker restarts only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mpt.checkpoint import io
from mpt.checkpoint.background import BackgroundWriter
from mpt.checkpoint.boxes import Box, Target, assign, held
from mpt.checkpoint.contents import Contents, Reads
from mpt.checkpoint.encode import encode, rng_state
from mpt.checkpoint.format import FORMAT_VERSION, CheckpointError, Manifest
from mpt.checkpoint.held import gather_object, merged_optimizers, rank_reads
from mpt.checkpoint.sharded import Unread
from mpt.checkpoint.state import (
    TrainingState,
    collect_state,
    manifest_fields,
    mpt_version,
    restore,
)
from mpt.checkpoint.tensorfile import raw_bytes
from mpt.errors import UsageError

if TYPE_CHECKING:
    from mpt.checkpoint.state import StateHolder

KEEP = 2
"""Snapshots a store keeps: the newest, and the one before while the newest is written."""
RESTORED = "memory://mpt-snapshot"
"""How a restored snapshot is named (``mpt: resumed from memory://mpt-snapshot/step-N``)."""
_PIECE_NAME = re.compile(r"step-(\d+)\.rank-(\d+)-of-(\d+)\.snapshot")
_TAIL = struct.Struct("<Iq")  # the header's crc32, its length
CHUNK = 16 << 20
"""Bytes per write(), per read and per message between nodes: the transfer buffer."""


@dataclass(frozen=True, slots=True)
class PieceId:
    """One rank's piece of one snapshot."""

    step: int
    rank: int
    world_size: int

    @property
    def name(self) -> str:
        return f"{io.step_dir_name(self.step)}.rank-{self.rank:05d}-of-{self.world_size:05d}" \
            ".snapshot"


def _write_all(fd: int, data: memoryview | bytes) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def write_piece(path: str, boxes: list[tuple[Box, torch.Tensor]], header: dict[str, Any]
                ) -> None:
    """Write a piece file at ``path``: the boxes' bytes from their tensors' memory (a GPU box
    copied to the host one at a time), then ``header`` with where each box lies."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        where, crc, offset = [], 0, 0
        for box, tensor in boxes:
            host = tensor.detach().to("cpu").contiguous()
            raw = raw_bytes(host)
            for start in range(0, len(raw), CHUNK):
                chunk = raw[start:start + CHUNK]
                _write_all(fd, chunk)
                crc = zlib.crc32(chunk, crc)
            where.append([box.key, offset, len(raw)])
            offset += len(raw)
        text = json.dumps({**header, "data": where, "crc32": crc}).encode()
        _write_all(fd, text + _TAIL.pack(zlib.crc32(text), len(text)))
        os.ftruncate(fd, offset + len(text) + _TAIL.size)  # a longer file written over
    finally:
        os.close(fd)


class Piece:
    """A piece file in a store, read without loading it: its header, and each box by key."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(self.fd).st_size
            if size < _TAIL.size:
                raise ValueError("shorter than its tail")
            crc, length = _TAIL.unpack(os.pread(self.fd, _TAIL.size, size - _TAIL.size))
            if not 0 < length <= size - _TAIL.size:
                raise ValueError("its header length is out of range")
            text = os.pread(self.fd, length, size - _TAIL.size - length)
            if zlib.crc32(text) != crc:
                raise ValueError("its header's crc32 does not match")
            self.header: dict[str, Any] = json.loads(text)
            self.data_bytes = size - _TAIL.size - length
            self.boxes = {key: (offset, n) for key, offset, n in self.header["data"]}
        except (ValueError, KeyError, TypeError):
            os.close(self.fd)
            raise

    def intact(self) -> bool:
        """Whether the boxes' bytes are those written (crc32, read in bounded pieces)."""
        crc = 0
        for start in range(0, self.data_bytes, CHUNK):
            crc = zlib.crc32(os.pread(self.fd, min(CHUNK, self.data_bytes - start), start), crc)
        return crc == self.header["crc32"]

    def read(self, box: Box, part: Box | None = None) -> torch.Tensor:
        """The stored ``box``'s tensor, or only ``part`` of it: read alone where it is whole
        rows (every dim but the first whole, as fsdp's and ZeRO's pieces are), else cut from
        the box."""
        offset, n = self.boxes[box.key]
        part = box if part is None else part
        rows = box.sizes[0] if box.sizes else 1
        if rows and part.sizes[1:] == box.sizes[1:]:
            first = part.offsets[0] - box.offsets[0] if box.sizes else 0
            return self._bytes(offset + first * (n // rows), n // rows * (
                part.sizes[0] if box.sizes else 1), part)
        data = self._bytes(offset, n, box)
        for dim, (at, size) in enumerate(zip(part.offsets, part.sizes, strict=True)):
            data = data.narrow(dim, at - box.offsets[dim], size)
        return data.contiguous()

    def _bytes(self, offset: int, n: int, shape: Box) -> torch.Tensor:
        """``n`` bytes from ``offset``, as a tensor of ``shape``'s sizes and dtype."""
        data = torch.empty(shape.sizes, dtype=shape.torch_dtype)
        raw, done = raw_bytes(data), 0
        while done < n:
            got = os.preadv(self.fd, [raw[done:n]], offset + done)
            if got <= 0:
                raise CheckpointError(self.path, "it ends inside a box", "resume from another "
                                      "snapshot or the disk checkpoint")
            done += got
        return data

    def close(self) -> None:
        os.close(self.fd)


class PeerSnapshots:
    """One rank's part in the run's snapshots (see the module's docstring)."""

    def __init__(self, *, every: int, store: str, backend: StateHolder, timeout: timedelta,
                 say: Callable[[str], None] = print) -> None:
        self.every = every
        """Training iterations between two snapshots."""
        self.store = store
        """This node's store (node-local memory), a local directory."""
        self.backend = backend
        world = backend.world
        # Ranks are numbered node by node: rank r + gpus is the same local rank on the next node.
        several = world.world_size > world.gpus
        self.peer = (world.rank + world.gpus) % world.world_size if several else None
        """The rank that keeps a copy of this rank's pieces on another node (None: one node)."""
        self.source = (world.rank - world.gpus) % world.world_size if several else None
        """The rank whose pieces this rank keeps a copy of."""
        self.timeout = timeout
        """How long a transfer waits for the other side (the run's collective timeout)."""
        self.say = say
        self._writer = BackgroundWriter()
        self._group: dist.ProcessGroup | None = None
        self._chosen: tuple[int, int, list[list[int]]] | None = None
        """The snapshot ``restore`` chose: its step, its world size and, by the rank that wrote
        each piece, the ranks that hold that piece intact (a node's ranks share its store)."""
        self.restored: Manifest | None = None
        """The manifest of the snapshot ``load`` restored."""
        self.moved: dict[str, int] = {}
        """Bytes ``load`` filled into this rank: ``read`` from its own store, ``received``
        from other ranks (only the parts of their boxes this rank holds)."""

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def take(self, parts: TrainingState, step: int) -> None:
        """Collective: snapshot the state after training iteration ``step``."""
        self._writer.wait()  # the previous snapshot is kept on both nodes first
        backend, world = self.backend, self.backend.world
        group = self._gloo()
        pieces = backend.shards_state
        model, tensors, state = collect_state(parts, pieces=pieces, extra=None)
        rng_tensors: dict[str, Any] = {}
        rng = encode(rng_state(), f"rng/{world.rank}", rng_tensors)
        held_now = {key: found for key, value in
                    [*((f"model/{k}", v) for k, v in model.items()), *tensors.items(),
                     *rng_tensors.items()] if (found := held(key, value)) is not None}
        # A pipeline's ranks hold their stage's optimizer state: the structure is every rank's.
        every = gather_object(backend, ([box.row() for box, _ in held_now.values()], rng,
                                        state["optimizers"] if pieces else None))
        if pieces:
            state["optimizers"] = merged_optimizers([trees for _, _, trees in every])
        table = assign([[Box.from_row(row) for row in rows] for rows, _, _ in every])
        kept = [(box, held_now[box.key][1]) for box in table[world.rank]]
        header = {"step": step, "rank": world.rank, "world_size": world.world_size,
                  "table": [[*box.row(), rank] for rank, mine in enumerate(table)
                            for box in mine],
                  "state": state, "rngs": [tree for _, tree, _ in every],
                  "saved_at": time.time(),
                  "manifest": manifest_fields(parts, step=step, epoch=None, sharded=False)}
        mine = PieceId(step, world.rank, world.world_size)
        self._commit(mine, lambda path: write_piece(path, kept, header))
        self._writer.submit(lambda: self._exchange(mine, group))

    def _gloo(self) -> dist.ProcessGroup | None:
        """The snapshots' own gloo group (a collective: every rank makes it at its first
        snapshot or restore); None in a one-process run, which sends nothing."""
        if self._group is None and self.backend.world.world_size > 1:
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._group

    # -- the store -----------------------------------------------------------------------------
    def _commit(self, piece: PieceId, write: Callable[[str], None]) -> None:
        """Write ``piece`` into this node's store under a temporary name (over the file of an
        old snapshot where there is one: /dev/shm then reuses its memory instead of
        allocating and zeroing new pages), then rename it."""
        os.makedirs(self.store, exist_ok=True)
        staging = os.path.join(self.store, f"{io.staging_name(piece.step)}-{piece.rank}")
        doomed = self._doomed(piece.step, other_worlds=False)
        with contextlib.suppress(FileNotFoundError, IndexError):
            os.rename(os.path.join(self.store, doomed[0]), staging)
        write(staging)
        os.rename(staging, os.path.join(self.store, piece.name))

    def _doomed(self, step: int, *, other_worlds: bool) -> list[str]:
        """The pieces of this rank's and its source's that the store no longer needs once a
        snapshot of ``step`` is committed (the other local ranks prune their own): those of
        the ``KEEP - 1`` steps before it stay; an abandoned run's later ones go, and, where
        ``other_worlds``, those of a run of another size."""
        world = self.backend.world
        ours = {world.rank, self.source}
        held_now = {name: p for name, p in self._held().items()
                    if p.rank in ours or (other_worlds and p.world_size != world.world_size)}
        held_steps = sorted({p.step for p in held_now.values()})
        older = [s for s in held_steps if s < step]
        stale = set(older[:max(len(older) - (KEEP - 1), 0)]) | {s for s in held_steps
                                                                if s > step}
        return sorted(name for name, p in held_now.items()
                      if p.step in stale or p.world_size != world.world_size)

    def _prune(self, step: int) -> None:
        """Remove what ``_doomed`` names, and temporary files a killed worker of this local
        rank left."""
        names = os.listdir(self.store) if os.path.isdir(self.store) else []
        ours = (f"-{self.backend.world.rank}", f"-{self.source}")
        for name in [*self._doomed(step, other_worlds=True),
                     *(n for n in names if io.leftover(n) and n.endswith(ours))]:
            with contextlib.suppress(FileNotFoundError):  # another local rank pruned it first
                os.unlink(os.path.join(self.store, name))

    def _held(self) -> dict[str, PieceId]:
        """The committed pieces in this node's store, by file name."""
        names = os.listdir(self.store) if os.path.isdir(self.store) else []
        return {name: PieceId(*map(int, found.groups())) for name in names
                if (found := _PIECE_NAME.fullmatch(name))}

    def newest(self) -> int | None:
        """The step of the newest snapshot of which this node's store holds a piece."""
        return max((p.step for p in self._held().values()), default=None)

    def _exchange(self, mine: PieceId, group: dist.ProcessGroup | None) -> None:
        """The snapshot thread's part: send this rank's piece to its peer while receiving its
        source's, in ``CHUNK`` pieces, and commit it; then prune the store."""
        if self.peer is None or self.source is None:
            self._prune(mine.step)
            return
        path = os.path.join(self.store, mine.name)
        sizes = torch.tensor([os.path.getsize(path)]), torch.zeros(1, dtype=torch.int64)
        _wait(dist.isend(sizes[0], self.peer, group=group),
              dist.irecv(sizes[1], self.source, group=group))
        theirs = PieceId(mine.step, self.source, mine.world_size)
        out, into = torch.empty(CHUNK, dtype=torch.uint8), torch.empty(CHUNK,
                                                                         dtype=torch.uint8)
        send, receive = int(sizes[0]), int(sizes[1])

        def write(staging: str) -> None:
            fd, source = os.open(staging, os.O_WRONLY | os.O_CREAT, 0o666), os.open(path,
                                                                                  os.O_RDONLY)
            try:
                for start in range(0, max(send, receive), CHUNK):
                    n_out, n_in = (max(0, min(CHUNK, total - start)) for total in (send,
                                                                                   receive))
                    if n_out:
                        os.preadv(source, [memoryview(out.numpy())[:n_out]], start)
                    _wait(dist.isend(out[:n_out], self.peer, group=group) if n_out else None,
                          dist.irecv(into[:n_in], self.source, group=group) if n_in else None)
                    _write_all(fd, memoryview(into.numpy())[:n_in])
                os.ftruncate(fd, receive)
            finally:
                os.close(fd)
                os.close(source)

        self._commit(theirs, write)
        self._prune(mine.step)

    # -- restoring ----------------------------------------------------------------------------
    def _checked(self, step: int, size: int) -> dict[int, bool]:
        """By the rank that wrote it, whether each piece of the snapshot of ``step`` by
        ``size`` ranks in this store has the header and bytes that were written."""
        found = {}
        for name, piece in self._held().items():
            if (piece.step, piece.world_size) != (step, size):
                continue
            try:
                opened = Piece(os.path.join(self.store, name))
            except (OSError, ValueError, KeyError, TypeError):
                found[piece.rank] = False
                continue
            try:
                found[piece.rank] = opened.intact() and opened.header["step"] == piece.step
            finally:
                opened.close()
        return found

    def restore(self, newer_than: int | None) -> str | None:
        """Collective: choose the newest snapshot of which the ranks' stores hold every piece
        intact, where it is newer than step ``newer_than`` (the disk's newest); return its
        name for ``load``, else None. A newer snapshot that lacks pieces is said, with why.
        Only the pieces of the snapshot in question are checked, newest first: an older one's
        bytes are read only where every newer one is incomplete."""
        every = gather_object(self.backend, sorted(
            {(p.step, p.world_size) for p in self._held().values()}))
        for step, size in sorted({snapshot for kept in every for snapshot in kept}, reverse=True):
            if newer_than is not None and step <= newer_than:
                break
            have: dict[int, list[int]] = {}  # rank that wrote a piece -> ranks holding it
            damaged: set[int] = set()
            for rank, checked in enumerate(gather_object(self.backend, sorted(
                    self._checked(step, size).items()))):
                for old, ok in checked:
                    if ok:
                        have.setdefault(old, []).append(rank)
                    else:
                        damaged.add(old)
            if len(have) == size:
                self._chosen = (step, size, [have[r] for r in range(size)])
                return f"{RESTORED}/{io.step_dir_name(step)}"
            lost = sorted(set(range(size)) - set(have))
            bad = sorted(damaged - set(have))
            why = (f"damaged: {bad}" if bad == lost else "their node is lost, and no "
                   "complete copy reached the next node" + (f"; damaged: {bad}" if bad else ""))
            self.say(f"mpt: the snapshot of step {step} lacks the pieces of rank(s) {lost} "
                     f"({why}): not restored")
        return None

    def restores(self, path: str) -> bool:
        """Whether ``path`` is what ``restore`` chose."""
        return self._chosen is not None and path == \
            f"{RESTORED}/{io.step_dir_name(self._chosen[0])}"

    def load(self, parts: TrainingState) -> dict[str, Any]:
        """Collective: restore the chosen snapshot into the run: every rank fills the parts it
        holds from the boxes that overlap them, which their holders send (``_exchange``)."""
        assert self._chosen is not None
        step, size, holders = self._chosen
        backend, rank = self.backend, self.backend.world.rank
        group = self._gloo()
        opened: dict[int, Piece] = {}

        def piece(old: int) -> Piece:
            if old not in opened:
                opened[old] = Piece(os.path.join(self.store, PieceId(step, old, size).name))
            return opened[old]

        try:
            header = backend.broadcast_object(
                piece(0).header if rank == holders[0][0] else None, src=holders[0][0])
            table = [(Box.from_row(row[:5]), row[5]) for row in header["table"]]
            reads = rank_reads(parts, header["state"]) if backend.shards_state else Reads()
            targets = {box.key: _target(box, reads, rank) for box, _ in table}
            # Per stored box, the part of it this rank needs: only that part travels.
            wanted = {i: spans for i, (box, _) in enumerate(table)
                      if (target := targets[box.key]) is not None
                      and (spans := target.overlap(box)) is not None}
            moves = _moves(table, gather_object(backend, wanted), holders)
            self.moved = {"read": 0, "received": 0}
            for window in in_windows(moves, CHUNK):
                for how, nbytes in _exchange(window, rank, piece, targets, group):
                    self.moved[how] += nbytes
        finally:
            for opened_piece in opened.values():
                opened_piece.close()
        url = f"{RESTORED}/{io.step_dir_name(step)}"
        values = {key: Unread(key, url) if target is None else target.value
                  for key, target in targets.items() if not key.startswith("rng/")
                  or target is not None}
        state = {**header["state"], "rng": [tree if old == rank else None
                                            for old, tree in enumerate(header["rngs"])]}
        manifest = Manifest(format=FORMAT_VERSION, mpt_version=mpt_version(),
                            saved_at=header["saved_at"], **header["manifest"])
        contents = Contents(location=io.Location.parse(url), manifest=manifest,
                            model={k.removeprefix("model/"): v for k, v in values.items()
                                   if k.startswith("model/")},
                            tensors={k: v for k, v in values.items()
                                     if not k.startswith("model/")}, state=state)
        self.restored = manifest
        return restore(url, contents, parts)

    def close(self) -> None:
        """Wait for the snapshot in flight; raise its error."""
        self._writer.close()


def _wait(*works: Any) -> None:
    """Wait for every started send and receive (None: none started)."""
    for work in works:
        if work is not None:
            work.wait()


def _target(box: Box, reads: Reads, rank: int) -> Target | None:
    """Where this rank puts the stored ``box``'s tensor, as a checkpoint's load would read it
    (``reads``: a sharded checkpoint's model and optimizer tensors), None where it needs none
    of it: another rank's RNG state, another pipeline stage's state."""
    if box.key.startswith("rng/"):
        return Target.of(None, box) if box.key.startswith(f"rng/{rank}/") else None
    if box.key in reads.into:
        return Target.of(reads.into[box.key], box)
    if box.key.startswith(("model/", "optimizer/")) and reads.whole is not None \
            and box.key not in reads.whole:
        return None
    return Target.of(None, box)


@dataclass(frozen=True, slots=True)
class Move:
    """``part`` of the stored ``box`` (in rank ``old``'s piece), from ``sender``, who holds that
    piece now, to ``requester``, who needs it."""

    part: Box
    box: Box
    old: int
    sender: int
    requester: int


def _moves(table: list[tuple[Box, int]], requests: list[dict[int, list[tuple[int, int]]]],
           holders: list[list[int]]) -> list[Move]:
    """Every move of a restore, in the order every rank walks them: per stored box (in the
    piece of the rank that wrote it), the part each requester asked for (``requests[r]``:
    spans by box index), from one of the ranks holding that piece. A requester whose node's
    store holds the piece reads it itself; the others' requests are spread over its holders."""
    found = []
    for index, (box, old) in enumerate(table):
        have = holders[old]
        for requester, asked in enumerate(requests):
            if index not in asked:
                continue
            spans = asked[index]
            part = Box(box.key, box.dtype, box.shape, tuple(b for b, _ in spans),
                       tuple(e - b for b, e in spans))
            sender = requester if requester in have else have[requester % len(have)]
            found.append(Move(part, box, old, sender, requester))
    return found


def in_windows(moves: list[Move], budget: int) -> list[list[Move]]:
    """``moves`` in order, cut into windows of at most ``budget`` bytes (a larger part alone):
    what one rank may hold in flight at once. Every rank cuts the same windows."""
    windows: list[list[Move]] = []
    size = 0
    for move in moves:
        if not windows or size + move.part.nbytes > budget:
            windows.append([])
            size = 0
        windows[-1].append(move)
        size += move.part.nbytes
    return windows


def _exchange(window: list[Move], rank: int, piece: Callable[[int], Piece],
              targets: dict[str, Target | None], group: dist.ProcessGroup | None
              ) -> list[tuple[str, int]]:
    """This rank's part in one window of moves, all at once: it posts every send and receive
    of the window, fills what it reads from its own store meanwhile, then what it received.
    Returns how this rank got each part it needed (``read`` or ``received``) and its bytes."""
    posted, received, sent, got = [], [], [], []
    for tag, move in enumerate(window):  # a tag per move: each receive meets its own send
        if rank == move.requester and rank != move.sender:
            data = torch.empty(move.part.sizes, dtype=move.part.torch_dtype)
            posted.append(dist.irecv(data, move.sender, group=group, tag=tag))
            received.append((move, data))
    for tag, move in enumerate(window):
        if rank != move.sender:
            continue
        data = piece(move.old).read(move.box, move.part)
        if move.requester == rank:
            target = targets[move.box.key]
            assert target is not None
            target.fill(move.part, data)
            got.append(("read", move.part.nbytes))
        else:
            posted.append(dist.isend(data, move.requester, group=group, tag=tag))
            sent.append(data)  # kept until its send is done
    _wait(*posted)
    for move, data in received:
        target = targets[move.box.key]
        assert target is not None
        target.fill(move.part, data)
        got.append(("received", move.part.nbytes))
    return got


def peer_snapshots(every: int, store: str | None, backend: StateHolder, timeout: timedelta,
                   say: Callable[[str], None] = print) -> PeerSnapshots | None:
    """The run's snapshots (``--snapshot-every``, ``--snapshot-dir``), or None (every = 0)."""
    if not every:
        return None
    if store is None:
        raise UsageError("--snapshot-every", every, "there is no --snapshot-dir to keep the "
                         "snapshots in (`mpt launch` makes one on each node)", "start the "
                         "script with `mpt launch`, or pass --snapshot-dir DIR on node-local "
                         "memory (/dev/shm)")
    if not io.Location.parse(store).local:
        raise UsageError("--snapshot-dir", store, "a snapshot store is a node's own memory",
                         "pass a directory on node-local memory (/dev/shm), or leave it out")
    return PeerSnapshots(every=every, store=io.Location.parse(store).path, backend=backend,
                         timeout=timeout, say=say)
