"""`mpt horovodrun ... python SCRIPT`: the workers run in the interpreter mpt is installed in,
whatever ``python`` names on PATH (a virtualenv that is not activated)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import run_mpt

from mpt.cli import _with_this_python

HOROVOD_SCRIPT = """\
import horovod.torch as hvd
import torch

hvd.init()
total = hvd.allreduce(torch.ones(1), op=hvd.Sum)
print(f"sum {total.item():g} on rank {hvd.rank()}", flush=True)
"""


def test_a_bare_python_of_this_version_becomes_this_interpreter():
    major, minor = sys.version_info[:2]
    for name in ("python", f"python{major}", f"python{major}.{minor}"):
        assert _with_this_python(["-np", "2", "-H", "localhost:2", name, "-u", "train.py",
                                  "python"]) == [
            "-np", "2", "-H", "localhost:2", sys.executable, "-u", "train.py", "python"], name
    # A path, another version, or no Python at all: the user's choice, left as it is.
    for args in (["-np", "2", "/opt/py/bin/python3", "train.py"],
                 ["-np", "2", f"python{major}.{minor + 1}", "train.py"],
                 ["-np", "2", "./train.sh"]):
        assert _with_this_python(args) == args


def test_horovodrun_finds_mpt_with_the_virtualenv_off_path(tmp_path):
    """Before: ``env: 'python': No such file or directory`` (or, where PATH has another Python,
    ``No module named 'mpt'``) on every rank."""
    pytest.importorskip("horovod.torch")
    script = tmp_path / "hvd_sum.py"
    script.write_text(HOROVOD_SCRIPT)
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if p != venv_bin and "pyenv" not in p) or "/usr/bin:/bin"
    result = run_mpt("horovodrun", "-np", "2", "-H", "localhost:2", "python", str(script),
                     timeout=180, env={"PATH": path, "VIRTUAL_ENV": ""})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No module named" not in result.stdout + result.stderr
    assert sorted(line for line in result.stdout.splitlines() if "sum" in line) == [
        "[0]<stdout>:sum 2 on rank 0", "[1]<stdout>:sum 2 on rank 1"], result.stdout
