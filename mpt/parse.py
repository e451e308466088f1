"""Values as users write them (flags, config files, variables, options), parsed one way.

Every yes/no setting of mpt, whether a launch flag, a backend option or an Apex override,
takes the same words, and every bad value is one ``UsageError`` naming the argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpt.errors import UsageError

BOOLEANS = {"true": True, "yes": True, "on": True, "1": True,
            "false": False, "no": False, "off": False, "0": False}
"""The one vocabulary of yes/no values, matched without regard to case."""


def parse_bool(argument: str, value: Any) -> bool:
    """``value`` as a bool: a bool, or one of ``BOOLEANS``."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word not in BOOLEANS:
        raise UsageError(argument, value, "it is not a yes/no value",
                         "use true or false (also yes/no, on/off, 1/0)")
    return BOOLEANS[word]


def parse_int(argument: str, value: Any) -> int:
    """``value`` as a whole number."""
    if isinstance(value, bool):  # bool is an int subclass; True is no count
        value = str(value)
    try:
        return value if isinstance(value, int) else int(str(value).strip())
    except ValueError:
        raise UsageError(argument, value, "it is not a whole number",
                         f"pass {argument} 1, 2, ...") from None


def parse_number(argument: str, value: Any) -> float:
    """``value`` as a number."""
    if isinstance(value, bool):
        value = str(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UsageError(argument, value, "it is not a number",
                         f"pass {argument} 5, 0.5, ...") from None


def parse_text(argument: str, value: Any) -> str:
    """``value`` as text."""
    return str(value)


def one_of(*choices: str) -> Callable[[str, Any], str]:
    """A parser that takes one of ``choices``."""
    def parse(argument: str, value: Any) -> str:
        if str(value) not in choices:
            raise UsageError(argument, value, "it is not one of the choices",
                             f"use one of {', '.join(choices)}")
        return str(value)
    return parse


def parse_size(argument: str, value: Any) -> float:
    """``value`` as a number of at least 0 (sizes, durations)."""
    number = parse_number(argument, value)
    if number < 0:
        raise UsageError(argument, value, "it cannot be negative", f"pass {argument} 0 or more")
    return number


def parse_sizes(argument: str, value: str, example: str) -> list[int]:
    """Comma-separated sizes (a tensor's shape, ``8,3,224,224``)."""
    try:
        return [int(n) for n in value.split(",")]
    except ValueError:
        raise UsageError(argument, value, "it is not a list of sizes",
                         f"pass sizes separated by commas, e.g. {example}") from None
