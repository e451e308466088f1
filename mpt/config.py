"""Config files for `mpt launch --config run.yaml` (YAML or TOML, chosen by the extension).

A file's keys are the names of `mpt launch`'s options (``gpus: 2``, ``precision: bf16-mixed``;
dashes or underscores). The file becomes the command's click ``default_map``: every option,
including ones added later, is read from it without a list to keep in sync here, and a flag given
on the command line still wins because click consults the default map only for options that were
not given. ``mpt config init`` writes a commented template generated from the same option list.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperCommand

from mpt.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 ships no TOML reader
    import tomli as tomllib

FORMATS = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml"}
"""File extension -> format."""

CONFIG_OPTION = "config"
"""Name of the option that names the file; it cannot appear inside the file itself."""

_FILE_KEY = "mpt.config_file"
"""Where the file's path is kept in the click context's ``meta``, to name it in errors."""


def _format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise UsageError("--config", str(path), "the format is chosen by the extension",
                         "name the file *.yaml, *.yml or *.toml")
    return fmt


def read_config(path: Path) -> dict[str, Any]:
    """The file's top-level table as a dict; an empty file is an empty dict."""
    fmt = _format(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError("--config", str(path), f"it cannot be read ({exc.strerror})",
                         "pass the path of an existing YAML or TOML file") from None
    try:
        if fmt == "toml":
            data: object = tomllib.loads(text)
        else:
            from mpt import yaml_config

            data = yaml_config.load(text)
    except Exception as exc:  # both parsers' errors carry the line; show it, not a traceback
        problem = " ".join(str(exc).split())
        raise UsageError("--config", str(path), f"it is not valid {fmt.upper()}: {problem}",
                         "fix the line named above") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError("--config", str(path), "its top level must be a mapping of option "
                         "names to values", "write one `option: value` per line")
    return data


def launch_options(ctx: typer.Context) -> dict[str, Any]:
    """The command's options a config file may set, by parameter name."""
    return {p.name: p for p in ctx.command.get_params(ctx)
            if p.param_type_name == "option" and p.name not in (CONFIG_OPTION, "help")
            and p.name is not None}


def load_into_context(ctx: typer.Context, path: Path | None) -> Path | None:
    """Eager callback of ``--config``: check the file and make it the command's defaults.

    Runs before the other options are processed (it is eager), so their defaults come from the
    file. Each key and value is checked here, so that a typo is one error naming file and key.
    """
    if path is None or ctx.resilient_parsing:
        return path
    values = read_config(path)
    options = launch_options(ctx)
    defaults: dict[str, Any] = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in options:
            raise UsageError(f"{path}: {key}", value, "`mpt launch` has no such option",
                             f"use one of {', '.join(sorted(options))}")
        if value is None:
            continue  # `key:` with no value keeps the option's own default
        if isinstance(value, Mapping) or (isinstance(value, list) and not options[name].multiple):
            raise UsageError(f"{path}: {key}", value, "it takes one value",
                             "write a single number, word or true/false")
        try:
            options[name].process_value(ctx, value)  # its type conversion, before any use
        except typer.BadParameter as exc:
            raise UsageError(f"{path}: {key}", value, exc.message.rstrip("."),
                             f"see `mpt launch --help` for {name}'s values") from None
        defaults[name] = value
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    ctx.meta[_FILE_KEY] = path
    return path


def from_file(ctx: typer.Context, error: UsageError) -> UsageError:
    """``error`` restated to name the config file and key when the bad value came from the file.

    The checks that know what a good value is (LaunchSpec, World, ...) name the flag; a user
    who never typed that flag needs to be told which line of which file to fix.
    """
    path = ctx.meta.get(_FILE_KEY)
    name = error.argument.lstrip("-").replace("-", "_")
    source = ctx.get_parameter_source(name)
    if path is None or source is None or source.name != "DEFAULT_MAP":
        return error
    return UsageError(f"{path}: {name}", error.value, error.problem, error.hint)


class ConfigurableCommand(TyperCommand):
    """A command whose usage errors name the config file when a value came from it."""

    def invoke(self, ctx: typer.Context) -> Any:  # type: ignore[override]
        with blame_config(ctx):
            return super().invoke(ctx)


@contextmanager
def blame_config(ctx: typer.Context) -> Iterator[None]:
    try:
        yield
    except UsageError as error:
        restated = from_file(ctx, error)
        if restated is error:
            raise
        raise restated from None


def _value(value: object) -> str:
    """A default as a YAML and TOML value (the two agree on JSON scalars and lists)."""
    if isinstance(value, str) and value.isdigit():
        return value  # options that parse numbers themselves take strings: show `gpus: 1`
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


def template(ctx: typer.Context, fmt: str) -> str:
    """A commented config file with every launch option at its default, in ``fmt``."""
    sep = " = " if fmt == "toml" else ": "
    lines = [
        "# mpt launch configuration: `mpt launch --config THIS_FILE SCRIPT [SCRIPT_ARGS...]`.",
        "# Keys are `mpt launch` options (`mpt launch --help`); flags on the command line win.",
        "# Options left commented out keep their defaults.",
    ]
    for name, param in launch_options(ctx).items():
        lines.append("")
        help_text = " ".join((param.help or "").split())
        lines.append(f"# {help_text}" if help_text else f"# --{name.replace('_', '-')}")
        default = param.default
        if default is None or callable(default):
            lines.append(f"# {name}{sep}".rstrip())
        else:
            lines.append(f"{name}{sep}{_value(default)}")
    return "\n".join(lines) + "\n"


def write_template(path: Path, launch_ctx: typer.Context) -> None:
    """Write :func:`template` to ``path``; never overwrite a file that is already there."""
    fmt = _format(path)
    text = template(launch_ctx, fmt)
    try:
        with path.open("x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise UsageError("PATH", str(path), "the file already exists",
                         "pass another path, or delete the file first") from None
