"""`make dist-check`: the wheel as a user gets it, in a fresh virtualenv outside the repository.

`python -m build` makes the sdist and, from it, the wheel in an isolated build environment (so
the build requirements pyproject.toml declares are all it has; the native extension is built where
there is a compiler). The wheel is installed with its `[examples]` extra and the torch version
this venv runs (pip takes it from wherever the machine's pip finds it), then `mpt --version`,
`mpt env` and the digits example on 2 processes run from a folder outside the repository.
Minutes, most of them installing torch: not part of `make test` (marked `dist`), whose
tests/test_packaging.py checks what the sdist and the wheel hold.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import mpt

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]


def run(command: list[str | Path], cwd: Path, env: dict[str, str] | None = None,
        timeout: int = 900) -> str:
    """Runs ``command``; its output, or a failure that shows it."""
    result = subprocess.run([str(part) for part in command], cwd=cwd, env=env, text=True,
                            capture_output=True, timeout=timeout, check=False)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout}\n" \
                                   f"{result.stderr}"
    return result.stdout + result.stderr


def test_the_wheel_installs_and_trains_outside_the_repository(tmp_path):
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "build", "--outdir", dist], cwd=ROOT)
    (wheel,) = dist.glob("mpt_train-*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    bin_dir = venv / "bin"
    run([bin_dir / "pip", "install", "--quiet", f"{wheel}[examples]",
         f"torch=={metadata.version('torch')}"], cwd=tmp_path)

    work = tmp_path / "work"  # a user's folder: the example copied, nothing of the repository
    work.mkdir()
    shutil.copy(ROOT / "examples" / "digits.py", work)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    where = run([bin_dir / "python", "-c", "import mpt; print(mpt.__file__)"], work, env)
    assert Path(where.strip()).is_relative_to(venv)
    assert run([bin_dir / "mpt", "--version"], work, env).startswith(f"mpt {mpt.__version__} (")
    # The isolated build compiled mpt._C where it could (setup.py's rule: cmake and a compiler).
    native = "yes" if shutil.which("cmake") and shutil.which("c++") else "no"
    report = run([bin_dir / "mpt", "env"], work, env)
    assert f"{mpt.__version__} (native extension: {native})" in report
    trained = run([bin_dir / "mpt", "launch", "--gpus", "2", "--precision", "bf16-mixed",
                   "digits.py"], work, env)
    assert "held-out accuracy" in trained
