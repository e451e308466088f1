"""`mpt install horovod` with real processes: pip, patch and the build run for real on a small
stand-in for Horovod's sdist (the real build takes ~15 minutes), with stand-ins for the compiler,
CMake and make it only looks for."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from mpt import install
from mpt.errors import MissingDependencyError, UsageError

COMMAND = [sys.executable, "-m", "mpt.install", "horovod"]
ROOT = Path(__file__).resolve().parents[1]

# The stand-in's setup.py: it checks the patch, records the environment the command gave the
# build, prints CMake-style progress, then makes a pure wheel named as Horovod's.
SETUP = """
import json, os, sys
from pathlib import Path
from setuptools import setup
for cmake in ("CMakeLists.txt", "horovod/torch/CMakeLists.txt"):
    assert "CMAKE_CXX_STANDARD 20" in Path(cmake).read_text(), cmake
keys = ("HOROVOD_WITH_PYTORCH", "HOROVOD_WITHOUT_MPI", "MAKEFLAGS", "CUDA_HOME",
        "HOROVOD_CUDA_HOME", "HOROVOD_BUILD_CUDA_CC_LIST", "CMAKE_POLICY_VERSION_MINIMUM")
Path("horovod/build_env.py").write_text("ENV = " + json.dumps({k: os.environ.get(k) for k in keys}))
if "bdist_wheel" in sys.argv:  # as Horovod's, whose CMake runs in build_ext
    for percent in range(0, 101, 5):
        print(f"[{percent:3d}%] Building CXX object step{percent}.o", flush=True)
    FAIL
setup(name="horovod", version="0.28.1", packages=["horovod"])
"""


def preimages(patch: Path) -> dict[str, str]:
    """The files ``patch`` changes, as they are before it: each hunk's context and removed lines
    (patch finds them at any line, so the hunks alone make a file it applies to)."""
    files: dict[str, list[str]] = {}
    name = ""
    for line in patch.read_text().splitlines():
        if line.startswith("--- a/"):
            name = line.removeprefix("--- a/")
            files[name] = []
        elif name and line[:1] in (" ", "-") and not line.startswith("---"):
            files[name].append(line[1:])
    return {path: "\n".join(lines) + "\n" for path, lines in files.items()}


def fake_sdist(tmp_path: Path, fail: bool = False) -> Path:
    """A tarball shaped as horovod-0.28.1.tar.gz that builds in a second or two."""
    top = tmp_path / "sdist" / "horovod-0.28.1"
    for path, text in preimages(install.build_file("cxx20.patch")).items():
        (top / path).parent.mkdir(parents=True, exist_ok=True)
        (top / path).write_text(text)
    (top / "horovod" / "__init__.py").write_text("")
    (top / "setup.py").write_text(SETUP.replace(
        "FAIL", "sys.exit('error: the stand-in failed')" if fail else "pass"))
    sdist = tmp_path / "horovod-0.28.1.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        archive.add(top, arcname=top.name)
    return sdist


def stub(folder: Path, name: str, output: str = "") -> None:
    """An executable ``name`` in ``folder`` that prints ``output``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(f"#!/bin/sh\necho '{output}'\n")
    (folder / name).chmod(0o755)


@pytest.fixture
def machine(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine with a CUDA toolkit at a known place and build tools that
    are stand-ins (found first on PATH); the real patch, sh and pip do the work."""
    toolkit = tmp_path / "cuda" / "lib64"
    toolkit.mkdir(parents=True)
    (toolkit / "libcudart.so.13").touch()
    tools = tmp_path / "tools"
    stub(tools, "c++")
    stub(tools, "make")
    stub(tools, "cmake", "cmake version 3.28.3")
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "PYTHONPATH")}
    env.update(PATH=f"{tools}{os.pathsep}{env['PATH']}", CUDA_HOME=str(toolkit.parent),
               MAKEFLAGS="-j1 --jobserver-auth=3,4", HOROVOD_BUILD_CUDA_CC_LIST="junk",
               PYTHONPATH=str(ROOT))
    return env


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*COMMAND, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs patch")
def test_builds_with_the_patch_and_progress_then_finds_the_cache(tmp_path, machine):
    cache = tmp_path / "cache"
    args = ["--cache-dir", str(cache), "--sdist", str(fake_sdist(tmp_path)), "--cuda-archs",
            "80,90", "--build-only"]
    first = run(args, machine, tmp_path)
    assert first.returncode == 0, first.stderr
    target = install.Target(install.torch_version(), install.python_tag(), Path("/"), "80,90")
    folder = cache / target.folder
    wheel = Path(first.stdout.strip())
    assert wheel.parent == folder and wheel.name.startswith("horovod-0.28.1-")
    assert (folder / install.BUILT).is_file() and "[100%]" in (folder / "build.log").read_text()
    steps = [line for line in first.stderr.splitlines() if line.startswith("mpt: [")]
    assert [s[:10] for s in steps] == ["mpt: [1/3]", "mpt: [2/3]", "mpt: [3/3]"]
    assert "cxx20.patch" in steps[1] and "compute capabilities 80,90" in steps[2]
    assert [line.split()[1] for line in first.stderr.splitlines() if " after " in line] == [
        "0%", "10%", "20%", "30%", "40%", "50%", "60%", "70%", "80%", "90%", "100%"]
    with zipfile.ZipFile(wheel) as archive:
        built_with = json.loads(archive.read("horovod/build_env.py").decode()[len("ENV = "):])
    toolkit = str(Path(machine["CUDA_HOME"]).resolve())
    assert built_with == {"HOROVOD_WITH_PYTORCH": "1", "HOROVOD_WITHOUT_MPI": "1",
                          "MAKEFLAGS": "", "CUDA_HOME": toolkit, "HOROVOD_CUDA_HOME": toolkit,
                          "HOROVOD_BUILD_CUDA_CC_LIST": "80,90",
                          "CMAKE_POLICY_VERSION_MINIMUM": "3.5"}

    # The second run takes the wheel from the cache: no build, so no build tools needed.
    bare = tmp_path / "bare"
    for tool in ("sh", "ls"):
        bare.mkdir(exist_ok=True)
        (bare / tool).symlink_to(shutil.which(tool))
    start = time.monotonic()
    second = run(args, {**machine, "PATH": str(bare)}, tmp_path)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == str(wheel) and f"cached in {folder}" in second.stderr
    assert time.monotonic() - start < 30


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs patch")
def test_a_failed_build_shows_its_last_lines_and_leaves_no_cache(tmp_path, machine):
    cache = tmp_path / "cache"
    result = run(["--cache-dir", str(cache), "--sdist", str(fake_sdist(tmp_path, fail=True)),
                  "--build-only"], machine, tmp_path)
    assert result.returncode == 1
    shown = [line.strip() for line in result.stderr.splitlines()]
    assert "error: the stand-in failed" in shown and "full command" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("mpt: error: Horovod's build failed (exit code 1)")
    assert last.endswith("build.log")
    assert not list(cache.glob(f"*/{install.BUILT}"))


def test_missing_tools_are_named_in_one_line_before_anything_runs(tmp_path, machine):
    tools = tmp_path / "old"
    stub(tools, "cmake", "cmake version 3.10.2")
    for tool in ("sh", "ls"):
        (tools / tool).symlink_to(shutil.which(tool))
    result = run(["--cache-dir", str(tmp_path / "cache")], {**machine, "PATH": str(tools)},
                 tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("mpt: error: Building")
    for missing in ("a C++ compiler", "CMake >= 3.13 (found 3.10.2)", "make", "patch",
                    "pip install cmake"):
        assert missing in result.stderr
    assert not (tmp_path / "cache").exists()


def test_a_gpu_node_without_the_cuda_toolkit_is_refused(monkeypatch):
    monkeypatch.setattr(install, "gpu_visible", lambda: True)
    monkeypatch.setattr(install, "missing_tools", lambda env, path: [])
    target = install.Target(torch="2.14.1", python_tag="cp311", cuda_home=None, cuda_archs="")
    with pytest.raises(MissingDependencyError, match=r"the CUDA toolkit .* CUDA_HOME"):
        install.check_can_build(target, {}, "")


def test_bad_input_is_one_line_with_exit_code_2(tmp_path, machine):
    for args, named in ((["--cuda-archs", "8.0"], "--cuda-archs=8.0"),
                        (["--sdist", str(tmp_path / "none.tar.gz")], "--sdist=")):
        result = run(args, machine, tmp_path)
        assert result.returncode == 2
        assert result.stderr.startswith(f"mpt: error: {named}") and "Fix:" in result.stderr
        assert result.stderr.count("\n") == 1


def test_cache_folders_are_named_after_what_the_wheel_is_built_for():
    cuda = Path("/usr/local/cuda-13.0")
    assert install.Target("2.14.1", "cp311", cuda, install.DEFAULT_CUDA_ARCHS).folder == (
        "horovod-0.28.1-torch-2.14.1-cp311-sm_75_80_90_100_120")
    assert install.Target("2.14.1", "cp311", cuda, "").folder.endswith("-cp311-sm_all")
    assert install.Target("2.13.0", "cp310", None, "90").folder == (
        "horovod-0.28.1-torch-2.13.0-cp310")


def test_the_build_environment_without_a_toolkit_names_none():
    env = install.Target("2.14.1", "cp311", None, "90").build_env(
        {"HOROVOD_BUILD_CUDA_CC_LIST": "90", "MAKEFLAGS": "-j1", "HOME": "/h"}, "/bin")
    assert "HOROVOD_BUILD_CUDA_CC_LIST" not in env and "HOROVOD_CUDA_HOME" not in env
    assert env["MAKEFLAGS"] == "" and env["PATH"] == "/bin" and env["HOME"] == "/h"


def test_a_failed_builds_error_lines_keep_what_follows_them():
    log = """\
  -- Detecting CUDA compile features - done
  CMake Error at third_party/gloo/CMakeLists.txt:1 (cmake_minimum_required):
    Compatibility with CMake < 3.5 has been removed from CMake.

    Or, add -DCMAKE_POLICY_VERSION_MINIMUM=3.5 to try configuring anyway.
  -- Configuring incomplete, errors occurred!
  -- Build files have been written
  error: subprocess-exited-with-error
  # - It provides a clear error message when setuptools is not installed.
"""
    assert [line.strip() for line in install._error_lines(log)] == [
        "CMake Error at third_party/gloo/CMakeLists.txt:1 (cmake_minimum_required):",
        "Compatibility with CMake < 3.5 has been removed from CMake.",
        "Or, add -DCMAKE_POLICY_VERSION_MINIMUM=3.5 to try configuring anyway.",
        "-- Configuring incomplete, errors occurred!"]


def test_cuda_archs_are_checked():
    assert install.parse_cuda_archs("80, 90") == "80,90"
    assert install.parse_cuda_archs("") == ""
    with pytest.raises(UsageError, match="--cuda-archs"):
        install.parse_cuda_archs("sm_80")


def test_a_wheel_is_installed_when_its_recorded_files_are(tmp_path):
    rows = "horovod/__init__.py,sha256=abc,0\nhorovod-0.28.1.dist-info/RECORD,,\n"
    wheel = tmp_path / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("horovod-0.28.1.dist-info/RECORD", rows)
    dist_info = tmp_path / "site" / "horovod-0.28.1.dist-info"
    dist_info.mkdir(parents=True)
    installed = metadata.PathDistribution(dist_info)
    assert not install.wheel_installed(wheel, installed)  # no RECORD
    (dist_info / "RECORD").write_text(rows + "horovod-0.28.1.dist-info/INSTALLER,sha256=x,4\n")
    assert install.wheel_installed(wheel, installed)
    (dist_info / "RECORD").write_text(rows.replace("abc", "rebuilt"))
    assert not install.wheel_installed(wheel, installed)
    assert not install.wheel_installed(wheel, None)


def test_mpt_install_is_the_same_command():
    from typer.testing import CliRunner

    from mpt.cli import app

    result = CliRunner().invoke(app, ["install", "horovod", "--help"])
    assert result.exit_code == 0
    for option in ("--cache-dir", "--cuda-archs", "--sdist", "--build-only", "--rebuild"):
        assert option in result.output
