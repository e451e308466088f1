"""What an mpt checkpoint directory holds, read and checked against its manifest.

``load_checkpoint`` restores these contents into a run; ``mpt checkpoint convert --to`` writes
them in another framework's format. Every file is refused unless its size and checksum are the
manifest's; sharded tensors are read through torch.distributed.checkpoint (``sharded``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from mpt.checkpoint import io, tensorfile
from mpt.checkpoint.format import (
    MODEL_FILE,
    SHARDED_DIR,
    STATE_JSON,
    STATE_TENSORS,
    CheckpointError,
    Manifest,
    verify,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Contents:
    """One checkpoint's files, parsed."""

    location: io.Location
    """The checkpoint directory."""
    manifest: Manifest
    """Its manifest."""
    model: dict[str, Any]
    """Weights by ``<model name>/<key>`` (whole tensors, or the pieces read into; where a rank
    read a sharded checkpoint in part, ``sharded.Unread`` for the rest)."""
    tensors: dict[str, Any]
    """The other tensors ``state`` refers to (``mpt.checkpoint.encode``)."""
    state: dict[str, Any]
    """``state.json``: model names, optimizers, precision, schedulers, loaders, RNG, extras."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Reads:
    """What one rank reads of a sharded checkpoint's tensors (by key: ``model/<model>/<name>``,
    ``optimizer/...``). By default, everything, whole."""

    into: dict[str, Any] = field(default_factory=dict)
    """Keys read in place into these tensors: ``DTensor`` shards and ``FlatPiece`` ranges are
    read only where their pieces lie."""
    whole: Collection[str] | None = None
    """The other keys read, whole; the rest are left unread (``sharded.Unread`` stands for
    each). None: every other key."""


def read(path: str | os.PathLike[str],
         reads: Callable[[dict[str, Any]], Reads] = lambda state: Reads()) -> Contents:
    """The contents of the checkpoint at ``path`` (a root or one checkpoint directory).

    ``reads``: what this rank reads of a sharded checkpoint's tensors, given its ``state.json``
    (a collective where the run's ranks hold pieces: called only for a sharded checkpoint).
    """
    location = io.resolve(path)
    manifest = location.manifest()

    def read_file(name: str) -> bytes:
        return verify(location.url, name, location.read(name), manifest.files.get(name))

    def parse(name: str, parser: Callable[[bytes], Any]) -> Any:
        try:
            return parser(read_file(name))
        except CheckpointError:
            raise
        except Exception as exc:  # the checksum matched: the manifest was edited to match
            raise CheckpointError(f"{location.url}/{name}", f"it cannot be parsed ({exc})",
                                  "load a checkpoint written by mpt.Runtime.save") from None

    # The two tensor files are read (and hashed) at once: sha256 of a large model's state takes
    # as long as torch.load of it, and two files on two threads take half as long.
    with ThreadPoolExecutor(2) as pool:
        state_file = pool.submit(tensorfile.read, location, STATE_TENSORS,
                                 manifest.files.get(STATE_TENSORS))
        model_file = None if manifest.sharded else pool.submit(
            tensorfile.read, location, MODEL_FILE, manifest.files.get(MODEL_FILE))
        tensors = state_file.result()
        model_state = model_file.result() if model_file else {}
    state = parse(STATE_JSON, json.loads)
    if manifest.sharded:
        from mpt.checkpoint import sharded as dcp_storage

        for name in manifest.files:
            if name.startswith(f"{SHARDED_DIR}/"):
                read_file(name)  # refuse a tampered shard before DCP opens it
        shards = location.child(SHARDED_DIR)
        if sorted(shards.listdir()) != sorted(n.split("/", 1)[1] for n in manifest.files
                                              if n.startswith(f"{SHARDED_DIR}/")):
            raise CheckpointError(shards.url, "it holds files the manifest does not list",
                                  "remove them, or load another checkpoint")
        wanted = reads(state)
        loaded = dcp_storage.load(shards.path, wanted.into, whole=wanted.whole)
        model_state = {k.removeprefix("model/"): v for k, v in loaded.items()
                       if k.startswith("model/")}
        tensors.update({k: v for k, v in loaded.items() if not k.startswith("model/")})
    if manifest.format < 2:  # one model, one optimizer, one scheduler, keys unprefixed
        model_state = {f"model/{key}": t for key, t in model_state.items()}
        state["models"] = ["model"]
        state["optimizers"] = {} if state["optimizer"] is None else {"model": state["optimizer"]}
        state["schedulers"] = {} if state["scheduler"] is None else {
            "scheduler": state["scheduler"]}
    return Contents(location=location, manifest=manifest, model=model_state, tensors=tensors,
                    state=state)
