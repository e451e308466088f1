"""Save and restore a whole training state in mpt's format, through the backend's interface only.

Nothing here knows which backend runs: full weights come from ``backend.model_state_dict`` and
optimizer state keyed by parameter name from ``backend.optimizer_state_dict`` (both collectives
every rank calls), so a checkpoint written under one backend and world size loads under any
other. Rank 0 writes (every rank writes its own shard in the sharded variant); every rank reads,
so the path must be one every rank sees: a shared filesystem or an fsspec URL. A backend whose
ranks hold pieces of the state (``shards_state``: shards, or a pipeline's stages) gathers
nothing for a sharded checkpoint: each rank writes the pieces it holds and reads back only the
pieces it holds; the optimizers' structure in ``state.json`` is the union of every rank's.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

import torch

from mpt.checkpoint import io, tensorfile
from mpt.checkpoint.contents import Contents, Reads
from mpt.checkpoint.contents import read as read_contents
from mpt.checkpoint.encode import decode, encode, rng_state, set_rng_state
from mpt.checkpoint.format import (
    FORMAT_VERSION,
    MANIFEST,
    MODEL_FILE,
    SHARDED_DIR,
    STATE_JSON,
    STATE_TENSORS,
    CheckpointError,
    FileEntry,
    Manifest,
    entry_for,
)
from mpt.checkpoint.held import check_gather, gather_object, merged_optimizers, rank_reads
from mpt.errors import UsageError

if TYPE_CHECKING:
    from torch import nn

    from mpt.checkpoint.background import BackgroundWriter
    from mpt.data import DistributedLoader
    from mpt.environments import World
    from mpt.pairs import Pair
    from mpt.precision import Precision

SHARD_THRESHOLD = 2**31
"""Model + optimizer bytes above which ``sharded=None`` picks the sharded variant (2 GiB)."""


class Stateful(Protocol):
    """An LR scheduler or anything else with torch's ``state_dict``/``load_state_dict`` pair."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class StateHolder(Protocol):
    """What a checkpoint needs of the run's backend: its place in the job, its precision, and
    the state of each model and optimizer in the portable form of ``mpt.state`` (collectives:
    every rank calls them). Any ``mpt.backends.Backend`` is one; the checkpoint never asks
    which."""

    name: str
    world: World
    precision: Precision
    shards_state: bool

    def unwrap(self, model: nn.Module) -> nn.Module: ...
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]: ...
    def local_model_state_dict(self, model: nn.Module) -> dict[str, Any]: ...
    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None: ...
    def optimizer_state_dict(self, model: nn.Module,
                             optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...
    def local_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                   *, create: bool = False) -> dict[str, Any]: ...
    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None: ...
    def comm_state_dict(self, model: nn.Module) -> list[dict[str, Any]]: ...
    def load_comm_state_dict(self, model: nn.Module, states: list[dict[str, Any]]) -> None: ...
    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...
    def barrier(self) -> None: ...


@dataclass(kw_only=True, slots=True)
class TrainingState:
    """The live objects a checkpoint is taken from and restored into."""

    backend: StateHolder
    """The run's backend: gathers and scatters weights and optimizer state."""
    pairs: Sequence[Pair]
    """Every model (wrapped or not) and optimizer ``setup`` returned, by name."""
    schedulers: dict[str, Stateful] = field(default_factory=dict)
    """The LR schedulers by name (``scheduler`` for a single one)."""
    loaders: Sequence[DistributedLoader] = field(default_factory=list)
    """Loaders made by ``setup_dataloader``, whose sampler positions are saved by name."""


def save_checkpoint(path: str | os.PathLike[str], parts: TrainingState, *, step: int,
                    epoch: int | None = None, extra: dict[str, Any] | None = None,
                    keep: int | None = None, sharded: bool | None = None,
                    background: BackgroundWriter | None = None,
                    say: Callable[[str], None] | None = None) -> str:
    """Collective: write a checkpoint under root ``path``; return its directory's URL.

    ``background``: return once every tensor is copied to host memory (and, ``sharded``, each
    rank's shard is written) and let this writer write, commit and prune rank 0's files while
    training goes on; the URL is the checkpoint's once it is committed. ``say``: where a save
    of a backend that holds pieces gathers the whole state anyway, the line that says so.
    """
    backend, world = parts.backend, parts.backend.world
    if keep is not None and keep < 1:
        raise UsageError("keep", keep, "at least the new checkpoint must be kept",
                         "pass keep=1 or more, or None to keep every checkpoint")
    root = io.Location.parse(path)
    # A backend whose ranks hold pieces of the state writes just those, each rank its own,
    # unless told not to or the root is remote (each rank writes local files).
    pieces = backend.shards_state and sharded is not False and root.local
    if pieces:
        sharded = True
    elif backend.shards_state:
        check_gather(parts, "sharded=False" if sharded is False else f"a root at {root.url}",
                      say)
    model_tensors, tensors, state = collect_state(parts, pieces=pieces, extra=extra)
    # every rank's RNG, so that each rank of a resumed run draws what it would have drawn; with
    # pieces, every rank's optimizer structure too (its own parameters': a pipeline's stage's)
    every = gather_object(backend, (rng_state(), state["optimizers"] if pieces else None))
    state["rng"] = encode([rng for rng, _ in every], "rng", tensors)
    if pieces:
        state["optimizers"] = merged_optimizers([trees for _, trees in every])
    if sharded is None:
        size = sum(t.numel() * t.element_size() for t in [*model_tensors.values(),
                                                            *tensors.values()])
        sharded = size > SHARD_THRESHOLD
    if sharded and not root.local:
        raise UsageError("sharded", True, f"{root.url} is not on a filesystem every rank writes "
                         "to", "pass a shared local path, or sharded=False for a remote URL")

    final = io.step_dir_name(step)
    staging = backend.broadcast_object(io.staging_name(step) if root.local else final)
    target = root.child(staging)
    if world.rank == 0:
        root.makedirs()
        if not root.local and root.exists(final):
            root.remove(final)  # an object store writes in place: drop the old copy first
    backend.barrier()
    if sharded:
        from mpt.checkpoint import sharded as dcp_storage

        moved = {key: t for key, t in tensors.items() if key.startswith("optimizer/")}
        dcp_storage.save({**{f"model/{k}": v for k, v in model_tensors.items()}, **moved},
                         target.child(SHARDED_DIR).path)
        tensors = {key: t for key, t in tensors.items() if key not in moved}
    if world.rank == 0:
        blobs: dict[str, bytes | dict[str, torch.Tensor]] = {
            STATE_TENSORS: tensors, STATE_JSON: json.dumps(state).encode()}
        if not sharded:
            blobs[MODEL_FILE] = model_tensors
        if background is not None:  # the next steps change weights and moments in place
            blobs = {name: blob if isinstance(blob, bytes) else background.stage(name, blob)
                     for name, blob in blobs.items()}
        manifest = manifest_fields(parts, step=step, epoch=epoch, sharded=sharded)
        if background is None:
            write_directory(root, staging, final, blobs, keep=keep, manifest=manifest)
        else:
            background.submit(lambda: write_directory(root, staging, final, blobs, keep=keep,
                                                      manifest=manifest))
    if background is None:
        backend.barrier()  # nobody goes on (or loads) before the checkpoint is committed
    return root.child(final).url


def collect_state(parts: TrainingState, *, pieces: bool, extra: dict[str, Any] | None
             ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Collective: the state every rank hands to the writer: model tensors by
    ``<model>/<key>`` (each rank's own piece where ``pieces``, else the full weights), the
    other tensors by key, and ``state.json``'s content, which refers to them (but for the
    RNG states, gathered apart)."""
    backend = parts.backend
    model_of = backend.local_model_state_dict if pieces else backend.model_state_dict
    optimizer_of = backend.local_optimizer_state_dict if pieces else backend.optimizer_state_dict
    model_tensors = {f"{pair.name}/{key}": t.detach() if isinstance(t, torch.Tensor) else t
                     for pair in parts.pairs for key, t in model_of(pair.model).items()}
    tensors: dict[str, Any] = {}
    state = {
        "models": [pair.name for pair in parts.pairs],
        "optimizers": {pair.name: encode(optimizer_of(pair.model, pair.optimizer),
                                         f"optimizer/{pair.name}", tensors)
                       for pair in parts.pairs if pair.optimizer is not None},
        "precision": encode(backend.precision.state_dict(), "precision", tensors),
        # each rank's state of each model's gradient communication (PowerSGD's error feedback)
        "comm": {pair.name: encode(comm, f"comm/{pair.name}", tensors) for pair in parts.pairs
                 if (comm := backend.comm_state_dict(pair.model))},
        "schedulers": {name: encode(scheduler.state_dict(), f"scheduler/{name}", tensors)
                       for name, scheduler in parts.schedulers.items()},
        "loaders": {loader.name: loader.state_dict() for loader in parts.loaders},
        "extra": encode(dict(extra or {}), "extra", tensors),
    }
    return model_tensors, tensors, state


def manifest_fields(parts: TrainingState, *, step: int, epoch: int | None,
                     sharded: bool) -> dict[str, Any]:
    """The manifest's fields that describe the run (``write_directory`` adds the rest)."""
    backend, loaders = parts.backend, parts.loaders
    if epoch is None and loaders:  # the training loader's epoch, else the first one's
        epoch = next((lo.epoch for lo in loaders if lo.name == "train"), loaders[0].epoch)
    return dict(backend=backend.name, world_size=backend.world.world_size,
                precision=backend.precision.name, step=step, epoch=epoch, sharded=sharded,
                loss_scale=backend.precision.loss_scale,
                parameters=sum(p.numel() for pair in parts.pairs
                               for p in backend.unwrap(pair.model).parameters()))


def write_directory(root: io.Location, staging: str, final: str,
                    blobs: dict[str, bytes | dict[str, torch.Tensor]], *,
                    manifest: dict[str, Any], keep: int | None = None,
                    tensors: Callable[[BinaryIO, dict[str, torch.Tensor]], FileEntry]
                    = tensorfile.write) -> None:
    """Write ``blobs`` (bytes, or tensors for a safetensors file, written by ``tensors``) and
    the manifest into ``root/staging``, commit it as ``final``, prune.

    ``manifest``: the Manifest's fields but the version, time and file list, filled in here.
    Shards other ranks already wrote under ``staging/sharded`` are listed too.
    """
    target = root.child(staging)

    def write(name: str, data: bytes | dict[str, torch.Tensor]) -> FileEntry:
        if isinstance(data, bytes):
            target.write(name, data)
            return entry_for(data)
        with target.open_write(name) as f:
            return tensors(f, data)

    # The files are written at once, as they are read (see load_checkpoint): each is hashed
    # while written, and one file's hashing and fsync need not wait for the other's.
    with ThreadPoolExecutor(len(blobs)) as pool:
        futures = {name: pool.submit(write, name, data) for name, data in blobs.items()}
        files: dict[str, FileEntry] = {name: future.result() for name, future in futures.items()}
    shards = target.child(SHARDED_DIR)
    if shards.exists():
        target.fsync_tree()
        for name in shards.listdir():
            files[f"{SHARDED_DIR}/{name}"] = entry_for(shards.read(name))
    target.write(MANIFEST, _manifest(files, manifest))  # the commit mark, last
    target.fsync_tree()
    io.commit(root, staging, final)
    if keep is not None:
        io.prune(root, keep, protect=final)


def _manifest(files: dict[str, FileEntry], fields: dict[str, Any]) -> bytes:
    """manifest.json of a checkpoint of ``files`` whose other fields are ``fields``."""
    return Manifest(format=FORMAT_VERSION, mpt_version=mpt_version(), saved_at=time.time(),
                    files=files, **fields).to_json().encode()


def load_checkpoint(path: str | os.PathLike[str], parts: TrainingState) -> dict[str, Any]:
    """Collective: restore the checkpoint at ``path`` (a root or one checkpoint directory).

    Returns ``{"step": ..., "epoch": ... (when saved), **extra}``.
    """
    backend = parts.backend
    contents = read_contents(path, lambda saved: rank_reads(parts, saved) if backend.shards_state
                             else Reads())
    return restore(contents.location.url, contents, parts)


def restore(where: str, contents: Contents, parts: TrainingState) -> dict[str, Any]:
    """Collective: put ``contents`` (a checkpoint's, read from ``where``) into the run's live
    objects; returns what ``load_checkpoint`` returns."""
    backend, world = parts.backend, parts.backend.world
    manifest, state = contents.manifest, contents.state
    model_state, tensors = contents.model, contents.tensors
    _check_names(where, "models", state["models"], [p.name for p in parts.pairs])
    if "imported" in state:  # converted from another framework: its names and optimizer class
        _check_imported(where, parts, model_state, state["imported"])
    for pair in parts.pairs:
        prefix = f"{pair.name}/"
        backend.load_model_state_dict(pair.model, {key.removeprefix(prefix): t for key, t in
                                                   model_state.items() if key.startswith(prefix)})
        saved = state["optimizers"].get(pair.name)
        if pair.optimizer is not None and saved is not None:  # None: converted from weights
            backend.load_optimizer_state_dict(pair.model, pair.optimizer,
                                              decode(saved, tensors))
    backend.precision.load_state_dict(decode(state["precision"], tensors))
    comms = state.get("comm", {})  # absent where the run kept none, and in older checkpoints
    for pair in parts.pairs:
        if pair.name in comms:
            backend.load_comm_state_dict(pair.model, decode(comms[pair.name], tensors))
    if parts.schedulers:
        _check_names(where, "LR schedulers", list(state["schedulers"]),
                     list(parts.schedulers))
        for name, scheduler in parts.schedulers.items():
            scheduler.load_state_dict(decode(state["schedulers"][name], tensors))
    positions = state["loaders"]
    if isinstance(positions, list):  # written before loaders had names: in set-up order
        positions = {lo.name: p for lo, p in zip(parts.loaders, positions, strict=False)}
    for loader in parts.loaders:
        if loader.name in positions:
            loader.load_state_dict(positions[loader.name])
    rngs = decode(state["rng"], tensors)
    if world.rank < len(rngs):  # ranks a smaller run did not have keep the state they seeded
        set_rng_state(rngs[world.rank])
    epoch = {} if manifest.epoch is None else {"epoch": manifest.epoch}
    return {"step": manifest.step, **epoch, **decode(state["extra"], tensors)}


def _check_names(where: str, what: str, saved: list[str], wanted: list[str]) -> None:
    """Refuse a checkpoint whose ``what`` are not the run's, naming the missing and extra."""
    missing = [name for name in wanted if name not in saved]
    extra = [name for name in saved if name not in wanted]
    if missing or extra:
        raise CheckpointError(where, f"its {what} are {saved}, this run has {wanted} (missing "
                              f"{missing or 'none'}, extra {extra or 'none'})",
                              "set up the same names as the run that saved it "
                              "(rt.setup(..., name=...)), or load another checkpoint")


def _check_imported(where: str, parts: TrainingState, model_state: dict[str, Any],
                    imported: dict[str, Any]) -> None:
    """Refuse, before anything is restored, a checkpoint converted from another framework
    whose weights are not named as the run's model names them (the first few that differ),
    or whose optimizer state is of another class (``imported["optimizers"]``, by model name)
    than the run's: torch would take another optimizer's moments and hyper-parameters without
    a word, and train on another curve."""
    for pair in parts.pairs:
        saved = {key.split("/", 1)[1] for key in model_state if key.startswith(f"{pair.name}/")}
        live = parts.backend.unwrap(pair.model).state_dict()
        missing = [key for key in live if key not in saved]
        if missing:
            theirs = sorted(saved - set(live))
            raise CheckpointError(where, f"model {pair.name!r} has {', '.join(missing[:3])}, "
                                  f"which it lacks (its names that differ: "
                                  f"{', '.join(theirs[:3]) or 'none'})", "convert the "
                                  "checkpoint of this model, or name its parameters alike")
        kind = imported.get("optimizers", {}).get(pair.name)
        if kind is None or pair.optimizer is None:
            continue
        # a wrapper that subclasses the optimizer (Horovod's) is the torch class it wraps
        mro = type(pair.optimizer).__mro__
        have = next((c.__name__ for c in mro if c.__module__.startswith("torch.optim.")),
                    mro[0].__name__)
        if have != kind:
            raise CheckpointError(where, f"its optimizer state is {kind}'s (imported from "
                                  f"another framework) and model {pair.name!r} has a {have}",
                                  f"create a {kind} as the run that saved it did, or convert it "
                                  "again with --weights-only to start the optimizer afresh")


def mpt_version() -> str:
    from mpt import __version__

    return __version__
