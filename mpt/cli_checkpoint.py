"""`mpt checkpoint inspect|convert`: look into a checkpoint, or import an older one.

Both run without a process group or a model: they read the manifest and plain files only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from mpt.errors import UsageError

app = typer.Typer(name="checkpoint", no_args_is_help=True,
                  help="Inspect mpt checkpoints or convert older ones into mpt's format.")
out = Console(highlight=False, soft_wrap=True)


@app.command()
def inspect(
    path: Annotated[str, typer.Argument(help="A checkpoint directory, its root, or a URL.")],
    verify: Annotated[bool, typer.Option(help="Also check every file's sha256.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
) -> None:
    """Print step, backend, world size, precision, loss scale, parameters and bytes."""
    from mpt.checkpoint import io
    from mpt.checkpoint.format import manifest_dict
    from mpt.checkpoint.format import verify as check

    location = io.resolve(path)
    manifest = location.manifest()
    if verify:
        for name, entry in manifest.files.items():
            check(location.url, name, location.read(name), entry)
    if as_json:
        out.print(json.dumps({"path": location.url, **manifest_dict(manifest)}, indent=1))
        return
    total = sum(entry.bytes for entry in manifest.files.values())
    rows = [("checkpoint", location.url), ("step", manifest.step), ("epoch", manifest.epoch),
            ("backend", manifest.backend), ("world size", manifest.world_size),
            ("precision", manifest.precision), ("loss scale", f"{manifest.loss_scale:g}"),
            ("parameters", f"{manifest.parameters:,}"), ("bytes", f"{total:,}"),
            ("files", len(manifest.files)), ("sharded", manifest.sharded),
            ("format", f"{manifest.format} (mpt {manifest.mpt_version})")]
    if verify:
        rows.append(("checksums", "all match"))
    for key, value in rows:
        out.print(f"{key:>11}  {value}")


@app.command()
def convert(
    src: Annotated[Path, typer.Argument(help="A DeepSpeed ZeRO checkpoint directory (what "
                                        "engine.save_checkpoint writes), or a torch .pt file: "
                                        "a plain state dict, or an apex-era dict with "
                                        "model/optimizer/amp keys.")],
    dst: Annotated[str, typer.Argument(help="Root to write the mpt checkpoint into.")],
    step: Annotated[int | None, typer.Option(
        help="Step to record (default: the DeepSpeed tag's global_stepN, else 0).")] = None,
    tag: Annotated[str | None, typer.Option(
        help="DeepSpeed: the tag folder to import (default: the one 'latest' names).")] = None,
) -> None:
    """Import a DeepSpeed ZeRO directory or a torch checkpoint (read with weights_only=True)
    into mpt's format: weights (and an apex-era loss scale), not the optimizer's state."""
    if src.is_dir():
        from mpt.backends.deepspeed_import import is_zero_checkpoint, read_zero_checkpoint

        if not is_zero_checkpoint(src):
            raise UsageError("SRC", src, "this directory is not a DeepSpeed checkpoint (no "
                             "'latest' file, no *_model_states.pt)", "pass the folder "
                             "engine.save_checkpoint wrote, or a .pt file")
        weights, tag_step = read_zero_checkpoint(src, tag)
        step = step if step is not None else tag_step or 0
        _write_converted(src, dst, step, weights, None, 0,
                         "; optimizer state not converted (DeepSpeed keeps it in flat shards)")
        return
    _convert_file(src, dst, 0 if step is None else step)


def _convert_file(src: Path, dst: str, step: int) -> None:
    import torch

    if not src.is_file():
        raise UsageError("SRC", src, "no such file", "pass a .pt file torch.save wrote")
    try:
        # weights_only: a checkpoint is data; unpickling arbitrary objects would run code
        loaded = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a bad or unsafe file
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError("SRC", src, f"torch.load(weights_only=True) refused it: {reason}",
                         "pass a state dict of tensors, or a dict with a 'model' state dict"
                         ) from None
    weights, loss_scale, tracker = _split(loaded, src)
    _write_converted(src, dst, step, weights, loss_scale, tracker,
                     "; optimizer state not converted (its entries are numbered, not named)")


def _write_converted(src: Path, dst: str, step: int, weights: dict[str, Any],
                     loss_scale: float | None, tracker: int, note: str) -> None:
    """Commit ``weights`` (and a loss scale) as an mpt checkpoint under root ``dst``."""
    from mpt.checkpoint import io
    from mpt.checkpoint.format import MODEL_FILE, STATE_JSON, STATE_TENSORS
    from mpt.checkpoint.state import write_directory
    from mpt.precision import LossScaleState

    precision: dict[str, Any] = {"skipped_steps": 0}
    if loss_scale is not None:
        precision["scaler"] = LossScaleState(scale=loss_scale, clean_steps=tracker).state_dict()
    # One model named "model", as a one-model run names it; no optimizer state.
    state = {"models": ["model"], "optimizers": {}, "precision": precision, "schedulers": {},
             "loaders": [], "rng": [], "extra": {"converted_from": os.fspath(src)}}
    blobs: dict[str, Any] = {MODEL_FILE: {f"model/{k}": v for k, v in weights.items()},
                             STATE_TENSORS: {},
                             STATE_JSON: json.dumps(state).encode()}
    root = io.Location.parse(dst)
    root.makedirs()
    final = io.step_dir_name(step)
    staging = io.staging_name(step) if root.local else final
    write_directory(root, staging, final, blobs, manifest=dict(
        backend="converted", world_size=1, step=step, epoch=None, sharded=False,
        precision="fp16-mixed" if loss_scale is not None else "fp32",
        loss_scale=loss_scale or 1.0, parameters=sum(t.numel() for t in weights.values())))
    out.print(f"wrote {root.child(final).url}: {len(weights)} tensors"
              + ("" if loss_scale is None else f", loss scale {loss_scale:g}") + note)


def _split(loaded: object, src: Path) -> tuple[dict[str, Any], float | None, int]:
    """Weights, apex loss scale and its clean-step count from a loaded torch checkpoint."""
    import torch

    if not isinstance(loaded, dict):
        raise UsageError("SRC", src, f"it holds a {type(loaded).__name__}, not a dict",
                         "pass a state dict, or a dict with a 'model' state dict")
    model = loaded.get("model", loaded.get("state_dict", loaded))
    weights = {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}
    if weights and all(k.startswith("module.") for k in weights):  # saved from a DDP wrapper
        weights = {k.removeprefix("module."): v for k, v in weights.items()}
    if not weights:
        raise UsageError("SRC", src, "it holds no tensors under 'model', 'state_dict' or at the "
                         "top", "pass a state dict of tensors")
    amp = loaded.get("amp") or {}
    scaler = next((v for k, v in amp.items() if k.startswith("loss_scaler")), None)
    if scaler is None:
        return weights, None, 0
    return weights, float(scaler["loss_scale"]), int(scaler.get("unskipped", 0))
