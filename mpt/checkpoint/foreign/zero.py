"""ZeRO's flat per-rank partitions put back together as whole tensors by parameter name.

Each rank's optimizer file holds, per param group, one flat fp32 tensor of the master weights
and one flat tensor per optimizer moment, all laid out alike. Which elements of which
parameter a rank holds is DeepSpeed's own record, used as it is:

- stages 1 and 2 (and DeepSpeed's bf16 optimizer): ``param_slice_mappings``, each parameter's
  ``(start, numel)`` in the rank's partition; the ranks' pieces, in rank order, make the
  parameter (as ``ds_to_universal`` joins them);
- stage 3: each parameter takes ``ceil(numel / world)`` slots in every rank's partition of its
  sub-group, in the order ``param_shapes`` lists them (as ``zero_to_fp32`` reads them).

Each rank's file is read as its pickled structure alone (``torchload.load(..., lazily=True)``:
no tensor data, no mapping): a parameter's masters and each moment come out as an
``imported.OnDisk``, the byte ranges of its pieces in every rank's file, in element order.
``imported.write`` copies those ranges into the checkpoint a bounded piece at a time, so a
conversion holds neither the whole state nor a whole rank's file, whatever the model's size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from mpt.checkpoint.foreign import torchload
from mpt.checkpoint.foreign.imported import OnDisk, Range
from mpt.errors import UsageError

Shapes = Sequence[Mapping[str, torch.Size]]
"""``param_shapes`` of a model-states file: per (sub-)group, each parameter's shape."""


class _Flat(NamedTuple):
    """One flat tensor of a rank's file (the masters, or a moment, of a param group)."""

    path: Path
    offset: int
    """Where its first element lies in ``path``, in bytes."""
    numel: int
    dtype: torch.dtype

    def piece(self, start: int, count: int) -> Range:
        """The bytes of elements ``start`` to ``start + count``."""
        size = self.dtype.itemsize
        return str(self.path), self.offset + start * size, count * size


class _Assembly:
    """Whole tensors as their pieces' byte ranges: ``fp32`` (the masters) and each moment, by
    name."""

    def __init__(self, shapes: Shapes, *, moments: bool) -> None:
        self.moments = moments
        """Whether the optimizer's moments are assembled too, or the masters alone."""
        self.shapes = {name: torch.Size(shape) for group in shapes for name, shape in
                       group.items()}
        self.ranges: dict[str, dict[str, list[Range]]] = {}
        """Per key (``fp32``, a moment), per parameter: its pieces, in element order."""
        self.dtypes: dict[str, dict[str, torch.dtype]] = {}
        self.scalars: dict[str, dict[str, Any]] = {}
        self.filled = dict.fromkeys(self.shapes, 0)

    def flats(self, path: Path, masters: torch.Tensor, state: Mapping[str, Any]
              ) -> dict[str, _Flat]:
        """A flat group's tensors to assemble (lazily loaded from ``path``): the masters, and its
        per-element moments (the state's tensors with elements) where ``moments``."""
        moments = {key: t for key, t in state.items()
                   if self.moments and isinstance(t, torch.Tensor) and t.dim() > 0}
        return {key: _Flat(path, torchload.where(path, t)[0], t.numel(), t.dtype)
                for key, t in {"fp32": masters, **moments}.items()}

    def put(self, key: str, name: str, flat: _Flat, start: int, count: int) -> None:
        """Append ``count`` elements of ``flat`` from ``start`` to parameter ``name``'s
        ``key``: pieces come rank by rank, in the order they make the parameter."""
        dtype = self.dtypes.setdefault(key, {}).setdefault(name, flat.dtype)
        if dtype != flat.dtype:
            raise UsageError("SRC", flat.path, f"its {key!r} of {name} is {flat.dtype}, another "
                             f"rank's is {dtype}", "convert a tag folder written by one save")
        if count:
            self.ranges.setdefault(key, {}).setdefault(name, []).append(flat.piece(start, count))

    def result(self, where: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """The masters by name, and each parameter's optimizer state."""
        short = [f"{name} ({n} of {math.prod(self.shapes[name])})"
                 for name, n in self.filled.items() if n != math.prod(self.shapes[name])]
        if short:
            raise UsageError("SRC", where, f"its ranks' files hold parts of parameters only: "
                             f"{', '.join(short[:3])} elements", "convert a complete tag folder "
                             "(every rank's file, from one save)")
        whole = {key: {name: OnDisk.of(self.shapes[name], self.dtypes[key][name],
                                       self.ranges.get(key, {}).get(name, []))
                       for name in by_name} for key, by_name in self.dtypes.items()}
        masters = whole.pop("fp32")
        state = {name: {**self.scalars.get(name, {}),
                        **{key: by_name[name] for key, by_name in whole.items()}}
                 for name in masters}
        return masters, state


def merge(files: Sequence[Path], shapes: Shapes, world: int, *, moments: bool = True
          ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, Any]:
    """The fp32 masters by name, the optimizer state by name (``mpt.state.named``'s form, with
    DeepSpeed's param-group entries as they are; None unless ``moments``) and rank 0's loss
    scaler, from every rank's optimizer file (``files``, by rank). The masters and moments are
    ``OnDisk`` tensors: their bytes stay in the files until ``imported.write`` copies them."""
    assembly = _Assembly(shapes, moments=moments)
    names = [list(group) for group in shapes]  # per flat group: stage 3's sub-groups
    groups: list[dict[str, Any]] = []
    scaler = None
    for rank, path in enumerate(files):
        saved = torchload.load(path, deepspeed=True, lazily=True)["optimizer_state_dict"]
        counts = saved["partition_count"]
        if any(int(count) != world for count in (counts if isinstance(counts, list)
                                                 else [counts])):
            raise UsageError("SRC", path, f"it was partitioned over {counts} ranks, the engine's "
                             f"files say {world}", "convert a tag folder written by one save")
        if "fp32_flat_groups" in saved:
            _stage3(saved, shapes, assembly, rank=rank, world=world, where=path)
            inner = saved["optimizer_state_dict"]
        elif "param_slice_mappings" in saved:
            _stage12(saved, shapes, assembly, where=path)
            inner = saved["base_optimizer_state"]
        else:
            raise UsageError("SRC", path, "it holds no partition layout this conversion knows "
                             "(no fp32_flat_groups, no param_slice_mappings)", "load it in "
                             "DeepSpeed 0.19 and save it again, or convert it to DeepSpeed's "
                             "universal checkpoint")
        if rank == 0:
            scaler = torchload.values(path, saved.get("loss_scaler"))
            groups = [{**torchload.values(path, group),
                       "params": [n for i in group["params"] for n in names[i]]}
                      for group in inner["param_groups"]] if moments else []
    masters, state = assembly.result(files[0].parent)
    return masters, {"state": state, "param_groups": groups} if moments else None, scaler


def _scalars(path: Path, state: Mapping[str, Any]) -> dict[str, Any]:
    """A flat group's per-group values (Adam's ``step``), read."""
    return {key: torchload.values(path, t) for key, t in state.items()
            if not (isinstance(t, torch.Tensor) and t.dim() > 0)}


def _stage12(saved: dict[str, Any], shapes: Shapes, assembly: _Assembly, *, where: Path
             ) -> None:
    """Take one rank's pieces (stages 1-2: a flat group per param group)."""
    base = saved["base_optimizer_state"]
    if not isinstance(base, Mapping) and not assembly.moments:
        base = {"state": base}  # elastic_checkpoint: a list of moments, not needed here
    if not isinstance(base, Mapping):  # elastic_checkpoint: moments without the groups' lr, ...
        raise UsageError("SRC", where, "it was saved with elastic_checkpoint, which leaves the "
                         "optimizer's hyper-parameters out", "convert with --weights-only, or "
                         "save with elastic_checkpoint off")
    states = base["state"]
    for g, mapping in enumerate(saved["param_slice_mappings"]):
        flats = assembly.flats(where, saved["single_partition_of_fp32_groups"][g], states[g])
        for name, fragment in mapping.items():
            for key, flat in flats.items():
                if fragment.start + fragment.numel > flat.numel:
                    raise _not_elementwise(where, key, flat, fragment.start + fragment.numel)
                assembly.put(key, name, flat, fragment.start, fragment.numel)
            assembly.filled[name] += fragment.numel
        if assembly.moments:
            scalars = _scalars(where, states[g])
            for name in shapes[g]:
                assembly.scalars[name] = scalars


def _stage3(saved: dict[str, Any], shapes: Shapes, assembly: _Assembly, *, rank: int,
            world: int, where: Path) -> None:
    """Take one rank's pieces (stage 3: a flat group per sub-group)."""
    inner = saved["optimizer_state_dict"]["state"]
    for index, group in enumerate(shapes):
        flats = assembly.flats(where, saved["fp32_flat_groups"][index], inner[index])
        scalars = _scalars(where, inner[index]) if assembly.moments else {}
        offset = 0
        for name, shape in group.items():
            numel = math.prod(shape)
            slots = math.ceil(numel / world)
            held = max(0, min(slots, numel - rank * slots))  # the last ranks hold padding
            for key, flat in flats.items():
                if offset + held > flat.numel:
                    raise _not_elementwise(where, key, flat, offset + held)
                assembly.put(key, name, flat, offset, held)
            assembly.filled[name] += held
            assembly.scalars[name] = scalars
            offset += slots


def _not_elementwise(where: Path, key: str, flat: _Flat, needed: int) -> UsageError:
    return UsageError("SRC", where, f"its optimizer state {key!r} holds {flat.numel} "
                      f"elements where its parameters need {needed}: not one value per "
                      "element", "convert with --weights-only (optimizers whose state is not "
                      "per element, e.g. 1-bit Adam or LAMB's, are not converted)")
