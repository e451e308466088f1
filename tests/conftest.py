"""Shared test helpers: run `mpt` as a real command, find free ports, check for leftovers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

WORKERS = Path(__file__).parent / "workers"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def find_free_port() -> int:
    """A port nothing listens on now (the kernel picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    return find_free_port()


def mpt_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "mpt", *args]


def run_mpt(*args: str, timeout: float = 120, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    """Run `mpt ARGS...` to the end, capturing its output."""
    return subprocess.run(mpt_command(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


def worker(name: str) -> str:
    return str(WORKERS / name)


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """Run `mpt ARGS...` in this process, as the console script would: its exit code and output."""
    from mpt.cli import main

    def run(*args: str) -> SimpleNamespace:
        monkeypatch.setattr(sys, "argv", ["mpt", *args])
        with pytest.raises(SystemExit) as exit_:
            main()
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=exit_.value.code, stdout=captured.out,
                               stderr=captured.err)
    return run


def ds_env() -> dict[str, str]:
    """Where DeepSpeed caches its JIT-built C++ op: `make` exports it; a bare pytest run gets
    the same folder inside the venv (git-ignored), so only the very first run builds it."""
    return {"TORCH_EXTENSIONS_DIR": os.environ.get(
        "TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))}


def launch_env() -> dict[str, str]:
    """The environment of an `mpt launch` a test starts itself: this one, wide output, and
    DeepSpeed's op cache (``ds_env``)."""
    return {**os.environ, "COLUMNS": "200", **ds_env()}
