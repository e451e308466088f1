"""What each rank holds of the training state, for checkpoints that neither gather nor read
more than a rank holds: its pieces and their keys (``local_state``), what it reads back of a
sharded checkpoint (``rank_reads``), the optimizers' structure united over ranks that hold
different parameters (``merged_optimizers``), and the one-line notice or refusal of a save that
must gather after all (``check_gather``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mpt.checkpoint.contents import Reads
from mpt.checkpoint.encode import encode, references
from mpt.errors import UsageError
from mpt.state.flat import FlatPiece

if TYPE_CHECKING:
    from mpt.checkpoint.state import StateHolder, TrainingState


def gather_object(backend: StateHolder, obj: Any) -> list[Any]:
    """Collective: every rank's ``obj``, by rank, on every rank."""
    world = backend.world
    return [backend.broadcast_object(obj if world.rank == r else None, src=r)
            for r in range(world.world_size)]


def check_gather(parts: TrainingState, why: str, say: Callable[[str], None] | None) -> None:
    """Collective: a save of whole tensors under a backend whose ranks hold pieces gathers the
    whole state: refused where this host lacks the memory for it, else said with its size."""
    import psutil

    sizes: dict[str, int] = {}
    for key, t in local_state(parts)[0].items():  # a DTensor's or FlatPiece's whole size
        sizes[key] = t.numel() * t.element_size()
    whole = sum({k: n for every in gather_object(parts.backend, sizes)
                 for k, n in every.items()}.values())
    available = psutil.virtual_memory().available
    gib = 2**30
    if whole > available:
        raise UsageError("sharded", False, f"{why} gathers the whole state, {whole / gib:.2f} "
                         f"GiB, and this host has {available / gib:.2f} GiB available",
                         "save to a local path every rank writes to, leaving sharded out: "
                         "each rank writes its own pieces")
    if say is not None:
        say(f"mpt: this save ({why}) gathers the whole state, {whole / gib:.2f} GiB, where "
            "each rank could write its own pieces (a local path, sharded left out)")


def merged_optimizers(every: list[dict[str, Any]]) -> dict[str, Any]:
    """``state.json``'s ``optimizers`` from every rank's, each the encoded state (``encode``) of
    the parameters that rank holds, keyed by name (``mpt.state.named``): per optimizer, the
    per-parameter state united by name and each param group's names united in order. Ranks
    that hold the same parameters (shards of them) give the same trees, whose union is any
    one of them; the stages of a pipeline give theirs, whose union is the whole model's."""
    merged: dict[str, Any] = {}
    for trees in every:
        for name, tree in trees.items():
            if name not in merged:
                merged[name] = {**tree, "state": dict(tree["state"]),
                                "param_groups": [dict(g) for g in tree["param_groups"]]}
                continue
            into = merged[name]
            into["state"].update(tree["state"])
            for group, other in zip(into["param_groups"], tree["param_groups"], strict=True):
                group["params"] = list(dict.fromkeys([*group["params"], *other["params"]]))
    return merged


def rank_reads(parts: TrainingState, saved: dict[str, Any]) -> Reads:
    """Collective: what a rank that holds pieces of the state reads of a sharded checkpoint
    whose ``state.json`` is ``saved``: its pieces in place (``_pieces``) and, whole, the rest of
    its own state (the tensors it holds whole: a pipeline stage's under ddp) and every tensor
    of the saved optimizers but the state of parameters it does not hold. Another pipeline
    stage's weights and moments stay unread: their own ranks read them."""
    found, held = local_state(parts)
    into = {key: t for key, t in found.items() if _is_piece(t)}
    if "optimizers" not in saved:  # an older layout: read the rest whole
        return Reads(into=into)
    whole = {key for key, t in found.items() if not _is_piece(t)}
    for name, tree in saved["optimizers"].items():
        if name not in held or not isinstance(tree.get("state"), dict):
            whole.update(references(tree))  # nothing to tell this rank's state by
            continue
        theirs = {param: state for param, state in tree["state"].items()
                  if param not in held[name]}
        whole.update(set(references(tree)) - set(references(theirs)))
    return Reads(into=into, whole=whole - set(into))


def local_state(parts: TrainingState) -> tuple[dict[str, Any], dict[str, set[str]]]:
    """Collective: this rank's state by checkpoint key, as ``local_model_state_dict`` and
    ``local_optimizer_state_dict(create=True)`` give it, and, by model name, the names of the
    parameters its optimizer holds."""
    backend, found, held = parts.backend, {}, {}
    for pair in parts.pairs:
        found.update({f"model/{pair.name}/{key}": t
                      for key, t in backend.local_model_state_dict(pair.model).items()})
        if pair.optimizer is not None:
            local = backend.local_optimizer_state_dict(pair.model, pair.optimizer, create=True)
            encode(local, f"optimizer/{pair.name}", found)
            held[pair.name] = {param for group in local["param_groups"]
                               for param in group["params"]}
    return found, held


def _is_piece(tensor: Any) -> bool:
    """Whether ``tensor`` is a piece of a tensor this rank holds, read in place."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor | FlatPiece)
