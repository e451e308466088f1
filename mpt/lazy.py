"""Package attributes imported when first used (a module ``__getattr__``, PEP 562).

`mpt launch` and its worker shim import a package for one light piece (a config check, a path
helper); its heavy siblings (torch.distributed, the writers, the agent) load only when a name
that lives there is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: each name in ``homes`` is read from its submodule
    (``homes[name]``, relative to the package) when first asked for."""

    def __getattr__(name: str) -> Any:
        if name in homes:
            return getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
