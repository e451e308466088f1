"""The sdist and the wheel `python -m build` makes: what an install outside the repository needs.

The wheel is built as `python -m build` builds it, from the sdist (so a file the sdist lacks is
missing from the wheel too), without the native extension (MPT_SKIP_COMPILE=1): the fast path,
and the one that shows the wheel still works on the extension's Python fallback.
`make dist-check` (tests/test_dist.py) installs a wheel into a fresh virtualenv and trains.
"""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.metadata import Metadata
from typer.testing import CliRunner

import mpt

ROOT = Path(__file__).resolve().parents[1]
DIST_INFO = f"mpt_train-{mpt.__version__}.dist-info"


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder holding the sdist and the wheel."""
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "MPT_SKIP_COMPILE": "1"}
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out)],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def wheel(dist: Path) -> zipfile.ZipFile:
    (path,) = dist.glob("mpt_train-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_every_module_and_the_package_data(wheel):
    names = set(wheel.namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "mpt").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert modules - names == set()
    assert {"mpt/py.typed", "mpt/_native.py"} <= names  # typed; the extension's fallback
    assert not [n for n in names if n.startswith("mpt/_C")]  # built without the extension
    for name in ("cxx20.patch", "cuda-home"):  # what `mpt install horovod` builds with
        assert wheel.read(f"mpt/_data/horovod/{name}") == (
            ROOT / "backends" / "horovod" / name).read_bytes()
    assert {n.split("/")[0] for n in names} == {"mpt", DIST_INFO}  # no top-level backends/


def test_the_wheel_has_its_name_version_license_and_command(wheel):
    meta = Metadata.from_email(wheel.read(f"{DIST_INFO}/METADATA"), validate=False)
    assert (str(meta.name), str(meta.version)) == ("mpt-train", mpt.__version__)
    assert meta.license_expression == "Apache-2.0"
    assert wheel.read(f"{DIST_INFO}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    required = {requirement.name for requirement in meta.requires_dist or []}
    assert "torch" in required and "horovod" not in required  # Horovod: `mpt install horovod`
    entry_points = configparser.ConfigParser()
    entry_points.read_string(wheel.read(f"{DIST_INFO}/entry_points.txt").decode())
    assert entry_points["console_scripts"]["mpt"] == "mpt.__main__:run"


def test_the_sdist_holds_what_building_needs(dist):
    (path,) = dist.glob("mpt_train-*.tar.gz")
    with tarfile.open(path) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"setup.py", "pyproject.toml", "CMakeLists.txt", "README.md", "LICENSE",
            "CHANGELOG.md", "backends/csrc/module.cpp", "backends/horovod/cxx20.patch",
            "backends/horovod/cuda-home", "mpt/py.typed"} <= names


def test_the_unpacked_wheel_works_outside_the_repository(wheel, tmp_path):
    site = tmp_path / "site"
    wheel.extractall(site)
    probe = ("import mpt, mpt._native as n, mpt.install as i, signal; print(mpt.__file__); "
             "print(n.NATIVE_AVAILABLE, n.bind_to_parent(signal.SIGTERM)); "
             "print(i.build_file('cxx20.patch'))")
    # -S: no .pth files, so no editable install of mpt can answer for the wheel's modules; the
    # dependencies still come from this Python's site-packages.
    path = os.pathsep.join((str(site), sysconfig.get_paths()["purelib"]))
    result = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, text=True,
                            capture_output=True, env={**os.environ, "PYTHONPATH": path},
                            timeout=60, check=True)
    package, native, patch = result.stdout.splitlines()
    assert Path(package).is_relative_to(site) and Path(patch).is_relative_to(site)
    assert native == "False True"  # no mpt._C: the ctypes fallback bound the process


def test_version_names_mpt_torch_deepspeed_and_horovod(monkeypatch):
    from mpt.cli import app

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    line = result.output.strip()
    assert line.startswith(f"mpt {mpt.__version__} (torch {metadata.version('torch')}, ")
    assert "DeepSpeed " in line and "Horovod " in line
    real = metadata.version

    def without_horovod(name: str) -> str:
        if name == "horovod":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", without_horovod)
    result = CliRunner().invoke(app, ["--version"])
    assert result.output.strip().endswith("Horovod not installed)"), result.output