"""Backend registry: maps ``--backend`` names to classes.

Backends shipped with mpt are listed in ``BUILTIN``; third-party packages add theirs through the
entry-point group ``mpt.backends`` (``name = "package.module:BackendClass"``) and are found on the
first lookup, so `--backend NAME` works as soon as the package is installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from mpt.backends.apex import ApexBackend
from mpt.backends.base import Availability, Backend
from mpt.backends.ddp import DDPBackend
from mpt.backends.deepspeed import DeepSpeedBackend
from mpt.backends.fsdp import FSDPBackend
from mpt.backends.horovod import HorovodBackend  # imports horovod only when used
from mpt.errors import MissingDependencyError, UsageError
from mpt.parallel import Topology
from mpt.precision import LossScaleConfig, Precision, make_precision

BUILTIN: dict[str, type[Backend]] = {DDPBackend.name: DDPBackend,
                                     DeepSpeedBackend.name: DeepSpeedBackend}
"""deepspeed is listed even where it is not installed: it imports deepspeed only when used."""
BUILTIN[ApexBackend.name] = ApexBackend
BUILTIN[HorovodBackend.name] = HorovodBackend
BUILTIN[FSDPBackend.name] = FSDPBackend
ENTRY_POINT_GROUP = "mpt.backends"

_registry: dict[str, type[Backend]] = dict(BUILTIN)
_broken: dict[str, str] = {}
"""Entry points that failed to load, with the reason: listed by `mpt backends`, never fatal."""
_plugins_loaded = False


def register(cls: type[Backend]) -> type[Backend]:
    """Add a backend class under ``cls.name`` (usable as a class decorator)."""
    _registry[cls.name] = cls
    return cls


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _registry:
            continue
        try:
            _registry[ep.name] = ep.load()
        except Exception as exc:  # a broken plugin must not take the other backends down
            _broken[ep.name] = f"entry point {ep.value} failed to load: {exc}"


def broken() -> dict[str, str]:
    """Backends whose entry point failed to load, with the reason."""
    _load_plugins()
    return dict(_broken)


def registered() -> dict[str, type[Backend]]:
    """Every backend by name, built-in and from entry points."""
    _load_plugins()
    return dict(_registry)


def offering(capability: str) -> str:
    """The registered backends whose class declares ``capability`` (a true ``ClassVar`` such
    as ``pipelines``, ``snapshots`` or ``elastic``), as a fix names them: ``ddp or fsdp``."""
    names = sorted(name for name, cls in registered().items() if getattr(cls, capability))
    return " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))


def get_backend(name: str) -> type[Backend]:
    """The class registered as ``name``; a UsageError lists the valid names otherwise."""
    backends = registered()
    if name in _broken:
        raise MissingDependencyError(f"backend {name!r}", "its plugin package", "reinstall the "
                                     "package that provides it", reason=_broken[name])
    if name not in backends:
        raise UsageError("--backend", name, "unknown backend",
                         f"use one of {', '.join(sorted(backends))}, or install a package that "
                         f"registers it in the '{ENTRY_POINT_GROUP}' entry-point group")
    return backends[name]


def checked_precision(backend: str, precision: str | None, *, device_type: str,
                      loss_scale: LossScaleConfig | None = None,
                      precision_options: Mapping[str, Any] | None = None,
                      backend_options: Mapping[str, Any] | None = None) -> Precision:
    """The precision a run of ``backend`` trains in, made for ``device_type``: ``precision``,
    else the one the backend's own config asks for, else fp32; refused (UsageError) where the
    backend would train it wrong.

    The one check `mpt launch`, `mpt horovodrun` and the Runtime make, before any process or
    any model exists; the Runtime trains with what it returns.
    """
    cls = get_backend(backend)
    options = backend_options or {}
    made = make_precision(precision or cls.default_precision(options) or "fp32", device_type,
                          loss_scale, precision_options)
    cls.check_precision(made.spec, device_type, options)
    if cls.casts_model(made.spec):
        made.leave_cast_to_backend()
    return made


def resolve_precision(backend: str, precision: str | None, *, device_type: str,
                      loss_scale: LossScaleConfig | None = None,
                      precision_options: Mapping[str, Any] | None = None,
                      backend_options: Mapping[str, Any] | None = None) -> str:
    """The name of ``checked_precision``'s precision: what launchers hand their workers."""
    return checked_precision(backend, precision, device_type=device_type, loss_scale=loss_scale,
                             precision_options=precision_options,
                             backend_options=backend_options).name


__all__ = ["Availability", "Backend", "DDPBackend", "DeepSpeedBackend", "FSDPBackend", "Topology",
           "broken", "checked_precision", "get_backend", "offering", "register", "registered",
           "resolve_precision"]
