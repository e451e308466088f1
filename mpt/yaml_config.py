"""YAML as `mpt launch --config` reads it: YAML 1.1's safe loader without base-60 numbers.

PyYAML follows YAML 1.1, where ``2:4`` is a base-60 integer (124) and ``1:30.5`` a base-60
float; YAML 1.2 dropped both. A config file's ``nodes: 2:4`` means the elastic range, so this
loader reads such values as text, as YAML 1.2 would. Everything else resolves as in
``yaml.SafeLoader``.
"""

from __future__ import annotations

import re

import yaml

_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose ints and floats have no base-60 forms."""


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
ConfigLoader.add_implicit_resolver(_INT, re.compile(r"""^(?:[-+]?0b[0-1_]+
    |[-+]?0[0-7_]+
    |[-+]?(?:0|[1-9][0-9_]*)
    |[-+]?0x[0-9a-fA-F_]+)$""", re.X), list("-+0123456789"))
ConfigLoader.add_implicit_resolver(_FLOAT, re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*
    (?:[eE][-+][0-9]+)?
    |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))


def load(text: str) -> object:
    """The document in ``text``."""
    return yaml.load(text, Loader=ConfigLoader)
