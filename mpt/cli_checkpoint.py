"""`mpt checkpoint inspect|convert`: look into a checkpoint, or import another framework's.

Both run without a process group or a model: they read the manifest and plain files only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(name="checkpoint", no_args_is_help=True,
                  help="Inspect mpt checkpoints, import DeepSpeed, DCP, torch.save and Hugging "
                       "Face safetensors ones into mpt's format, or export mpt's.")
out = Console(highlight=False, soft_wrap=True)


@app.command()
def inspect(
    path: Annotated[str, typer.Argument(help="A checkpoint directory, its root, or a URL; or "
                                        "a DeepSpeed, DCP, torch.save or Hugging Face "
                                        "safetensors checkpoint.")],
    verify: Annotated[bool, typer.Option(help="Also check every file's sha256.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
    tag: Annotated[str | None, typer.Option(
        help="DeepSpeed: the tag folder to inspect (default: the one 'latest' names, else "
             "'latest_universal').")] = None,
) -> None:
    """Print step, backend, world size, precision, loss scale, parameters and bytes; of
    another framework's checkpoint, what `convert` would import from it (read whole, as
    `convert` reads it, and nothing written)."""
    from mpt.checkpoint import io
    from mpt.checkpoint.format import manifest_dict
    from mpt.checkpoint.format import verify as check
    from mpt.errors import CheckpointError

    try:
        location = io.resolve(path)
    except CheckpointError:
        if not _inspect_foreign(Path(path), tag, as_json=as_json):
            raise
        return
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


def _export(src: Path, dst: Path, to: str) -> None:
    from mpt.checkpoint import io
    from mpt.checkpoint.foreign import export
    from mpt.errors import UsageError

    if io.find_latest(src) is None:
        raise UsageError("SRC", src, f"--to {to} exports an mpt checkpoint and this is none",
                         "convert it to mpt first (leave --to out), then export that")
    out.print(export.export(src, dst, to), markup=False)


def _inspect_foreign(src: Path, tag: str | None, *, as_json: bool) -> bool:
    """Print what another framework's checkpoint at ``src`` holds; False where it is in no
    format mpt imports (the caller reports it as no mpt checkpoint)."""
    from mpt.checkpoint import foreign
    from mpt.errors import UsageError

    try:
        foreign.detect(src)
    except UsageError:
        return False
    facts = {"checkpoint": os.fspath(src), **foreign.read(src, tag=tag).describe()}
    if as_json:
        out.print(json.dumps(facts, indent=1))
        return True
    for key, value in facts.items():
        shown = ", ".join(value) if isinstance(value, list) else \
            f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else value
        out.print(f"{key:>11}  {shown}")
    return True


@app.command()
def convert(
    src: Annotated[Path, typer.Argument(help="A DeepSpeed checkpoint directory (what "
                                        "engine.save_checkpoint writes, or its universal "
                                        "layout), a "
                                        "torch.distributed.checkpoint directory (dcp.save of "
                                        "get_state_dict's model and optimizer), or a torch.save "
                                        "file (a state dict, or a dict with model, optimizer, "
                                        "scheduler, amp, step, epoch), or Hugging Face "
                                        "safetensors weights (a .safetensors file, or a "
                                        "save_pretrained directory); with --to, an mpt "
                                        "checkpoint.")],
    dst: Annotated[str, typer.Argument(help="Root to write the mpt checkpoint into; with --to "
                                       "torch|dcp|safetensors|deepspeed, the file or directory "
                                       "to write.")],
    step: Annotated[int | None, typer.Option(
        help="Step to record (default: the one the checkpoint holds, else 0).")] = None,
    tag: Annotated[str | None, typer.Option(
        help="DeepSpeed: the tag folder to import (default: the one 'latest' names, else "
             "'latest_universal').")] = None,
    weights_only: Annotated[bool, typer.Option(
        "--weights-only", help="Import the weights alone: the optimizer starts afresh.")] = False,
    to: Annotated[str, typer.Option(
        help="mpt (import SRC), or export the mpt checkpoint SRC for a plain script: torch "
             "(a torch.save file), dcp (a torch.distributed.checkpoint directory), "
             "safetensors (the weights), deepspeed (a DeepSpeed checkpoint directory in its "
             "universal layout: engine.load_checkpoint resumes it at any world size).")] = "mpt",
) -> None:
    """Import another framework's checkpoint with its training state (weights, optimizer
    moments by parameter name, LR scheduler, loss scale, step) into mpt's format, for
    `--resume`, or (--to) export an mpt checkpoint in a plain script's format; every file is
    read without running pickled code."""
    from mpt.checkpoint import foreign
    from mpt.errors import UsageError

    if to != "mpt":
        if tag is not None or weights_only or step is not None:
            raise UsageError("--to", to, "--tag, --weights-only and --step choose what an "
                             "import reads; an export writes the checkpoint as it is",
                             "leave them out")
        _export(src, Path(dst), to)
        return
    imported = foreign.read(src, tag=tag, optimizer=not weights_only)
    step = step if step is not None else imported.step or 0
    where = foreign.write(imported, dst, step=step, source_path=os.fspath(src))
    out.print(f"wrote {where} from {imported.source}: {imported.summary()}; step {step}"
              + ("" if imported.epoch is None else f", epoch {imported.epoch}"))
    out.print(f"not in it (a resumed run takes them from its own seed and start): "
              f"{', '.join(imported.lacks)}")
