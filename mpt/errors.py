"""mpt's exceptions.

Every error a user can cause names the argument, the value it had and a fix, in one line, so the
CLI can print it without a traceback (exit code 2) and a library caller can catch it by type.
"""

from __future__ import annotations


class MptError(Exception):
    """Base class of every error mpt raises on purpose."""


class UsageError(MptError, ValueError):
    """Bad input: a flag, a setting or an environment variable with a value mpt cannot use."""

    def __init__(self, argument: str, value: object, problem: str, hint: str) -> None:
        self.argument = argument
        self.value = value
        self.problem = problem
        self.hint = hint
        super().__init__(f"{argument}={value} is invalid: {problem}. Fix: {hint}")


class MissingDependencyError(MptError, ImportError):
    """An optional package a backend or precision needs is not installed (or cannot run here)."""

    def __init__(self, what: str, package: str, install: str, reason: str = "") -> None:
        self.package = package
        self.install = install
        why = f" ({reason})" if reason else ""
        super().__init__(f"{what} needs {package}, which is not usable here{why}. Fix: {install}")


class CheckpointError(MptError):
    """A checkpoint that is missing, incomplete, tampered with or from an unknown format."""

    def __init__(self, path: str, problem: str, hint: str) -> None:
        self.path = path
        self.problem = problem
        self.hint = hint
        super().__init__(f"checkpoint {path}: {problem}. Fix: {hint}")
