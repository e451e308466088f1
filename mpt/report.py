"""`mpt env`: what a bug report needs, in the spirit of `accelerate env`, `ds_report` and
`horovodrun --check-build`.

:func:`collect` gathers plain JSON-able facts (so ``mpt env --json`` and the tables show the same
thing); :func:`tables` renders them. Nothing here fails on a broken setup: a part that cannot be
inspected is reported with the reason, because the report is what one runs when things break.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from rich.table import Table

OPTIONAL_PACKAGES = ("deepspeed", "horovod", "apex", "pyyaml", "tensorboard", "safetensors",
                     "numpy")
"""Packages whose installed versions are listed (read from metadata, never imported)."""


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def _torch() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    facts: dict[str, Any] = {
        "version": torch.__version__,
        "cuda_build": torch.version.cuda or "",
        "cuda_available": torch.cuda.is_available(),
        "cudnn": str(torch.backends.cudnn.version() or "") if torch.cuda.is_available() else "",
        "nccl": "",
        "distributed": {name: bool(getattr(dist, f"is_{name}_available", lambda: False)())
                        for name in ("gloo", "nccl", "mpi")} if dist.is_available() else {},
        "bf16_supported": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    }
    if torch.cuda.is_available():
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError) as exc:  # a CUDA build without NCCL
            facts["nccl"] = f"unavailable ({exc})"
    return facts


def _devices() -> list[dict[str, Any]]:
    import os

    import torch

    if not torch.cuda.is_available():
        return [{"index": "cpu", "name": platform.processor() or platform.machine(),
                 "memory_gib": None, "capability": "", "cores": os.cpu_count()}]
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append({"index": index, "name": props.name,
                        "memory_gib": round(props.total_memory / 2**30, 1),
                        "capability": f"{props.major}.{props.minor}", "cores": None})
    return devices


def _backends() -> list[dict[str, Any]]:
    from mpt.backends import broken, registered

    rows = []
    for name, cls in sorted(registered().items()):
        try:
            info = cls.availability()
        except Exception as exc:  # a backend's own check failing is itself the finding
            rows.append({"name": name, "available": False, "version": "",
                         "reason": f"its availability check failed: {exc}", "install": ""})
            continue
        rows.append({"name": name, "available": info.available, "version": info.version,
                     "reason": info.reason, "install": info.install})
    rows += [{"name": name, "available": False, "version": "", "reason": reason, "install": ""}
             for name, reason in sorted(broken().items())]
    return rows


def _world(env: Mapping[str, str]) -> dict[str, Any]:
    from mpt.environments import detect_world
    from mpt.errors import MptError
    from mpt.run_config import RunConfig

    try:
        world = detect_world(env)
    except MptError as exc:  # inconsistent launcher variables: say so, do not crash the report
        return {"source": "error", "error": str(exc), "settings": {}}
    try:  # the settings a launcher handed over, defaults left out
        default, given = RunConfig().values(), RunConfig.from_env(env).values()
        settings: dict[str, Any] = {k: v for k, v in given.items() if v != default[k]}
    except MptError as exc:
        settings = {"error": str(exc)}
    return {"source": world.source, "nodes": world.nodes, "gpus": world.gpus, "nr": world.nr,
            "local_rank": world.local_rank, "rank": world.rank, "world_size": world.world_size,
            "master_addr": world.master_addr, "master_port": world.master_port,
            "settings": settings}


def collect(env: Mapping[str, str]) -> dict[str, Any]:
    """Every fact of the report; ``env`` is the environment whose launcher is detected."""
    from mpt import __version__
    from mpt._native import NATIVE_AVAILABLE

    return {
        "mpt": {"version": __version__, "native_extension": NATIVE_AVAILABLE},
        "python": {"version": platform.python_version(), "implementation":
                   platform.python_implementation(), "executable": sys.executable},
        "platform": {"system": platform.platform(), "machine": platform.machine()},
        "torch": _torch(),
        "devices": _devices(),
        "backends": _backends(),
        "packages": {name: _version(name) for name in OPTIONAL_PACKAGES},
        "environment": _world(env),
    }


def _two_columns(title: str, rows: Mapping[str, object]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in rows.items():
        shown = value if value not in (None, "") else "-"
        table.add_row(key, str(shown))
    return table


def tables(facts: Mapping[str, Any]) -> list[Table]:
    """The report as rich tables: system, devices, backends, cluster environment."""
    t, mpt = facts["torch"], facts["mpt"]
    system = _two_columns("system", {
        "mpt": f"{mpt['version']} (native extension: {'yes' if mpt['native_extension'] else 'no'})",
        "python": f"{facts['python']['version']} ({facts['python']['executable']})",
        "platform": facts["platform"]["system"],
        "torch": t["version"],
        "CUDA": (f"{t['cuda_build']} (available)" if t["cuda_available"]
                 else f"{t['cuda_build'] or 'CPU build'} (no device visible)"),
        "cuDNN": t["cudnn"],
        "NCCL": t["nccl"],
        "torch.distributed": ", ".join(k for k, v in t["distributed"].items() if v) or "none",
        **{name: version or "not installed" for name, version in facts["packages"].items()},
    })
    devices = Table(title="devices", title_justify="left")
    for column in ("index", "name", "memory (GiB)", "capability / cores"):
        devices.add_column(column)
    for d in facts["devices"]:
        devices.add_row(str(d["index"]), d["name"] or "-",
                        "-" if d["memory_gib"] is None else str(d["memory_gib"]),
                        d["capability"] or f"{d['cores']} cores")
    backends = Table(title="backends", title_justify="left")
    for column in ("backend", "available", "version", "reason / install"):
        backends.add_column(column)
    for b in facts["backends"]:
        note = "" if b["available"] else "; ".join(x for x in (b["reason"], b["install"]) if x)
        backends.add_row(b["name"], "yes" if b["available"] else "no", b["version"], note)
    world = dict(facts["environment"])
    settings = world.pop("settings", {})
    environment = _two_columns("world (detected)", {
        **world, **{f"mpt launch {k}": v for k, v in settings.items()}})
    return [system, devices, backends, environment]
