"""`mpt install horovod`: Horovod built against the installed torch, kept in a cache, installed.

Horovod's last release, 0.28.1, is an sdist that asks for C++14, while torch's headers need C++17
since torch 2.1 and C++20 since torch 2.14: `pip install horovod` fails against torch 2.x. So:

1. check, before anything long, that the build can run here (torch, a C++ compiler, CMake, make,
   patch, and on a GPU node the CUDA toolkit), naming in one line whatever is missing;
2. take the sdist (pip downloads it, or ``--sdist FILE`` on a node without network);
3. apply ``backends/horovod/cxx20.patch`` (C++20);
4. build a wheel against this torch (``pip wheel --no-build-isolation``) with PyTorch and gloo and
   the CUDA toolkit ``backends/horovod/cuda-home`` finds, printing CMake's progress;
5. keep it in a folder named after all it was built for (Horovod, torch, Python, GPU
   architectures), where the next run, in any virtualenv, finds it; install it.

``python -m mpt.install horovod`` is the same command without the rest of `mpt` and its imports
(torch among them), as the Makefile's set-up calls it.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Annotated

import typer
from packaging import tags
from packaging.version import InvalidVersion, Version

from mpt.errors import MissingDependencyError, MptError, UsageError

HOROVOD_VERSION = "0.28.1"
"""The release built: the last one, and the one backends/horovod/cxx20.patch applies to."""

DEFAULT_CUDA_ARCHS = "75,80,90,100,120"
"""The GPU compute capabilities torch 2.14.1+cu130 is built for, less 8.6 (8.x GPUs run 8.0
code); docs/horovod.md lists the GPUs and what the list saves."""

HOROVOD_FEATURES = {"HOROVOD_WITH_PYTORCH": "1", "HOROVOD_WITH_GLOO": "1",
                    "HOROVOD_WITHOUT_MPI": "1", "HOROVOD_WITHOUT_TENSORFLOW": "1",
                    "HOROVOD_WITHOUT_MXNET": "1"}
"""What the wheel is built with: PyTorch over gloo; docs/horovod.md says how to add MPI/NCCL."""

MIN_CMAKE = Version("3.13")
"""The oldest CMake Horovod's setup.py accepts (older, it pip-installs CMake 3.13 by itself)."""

BUILT = ".built"
"""The file that marks a cache folder whose build finished."""

PROGRESS = re.compile(r"\[\s*(\d{1,3})%\]")
"""CMake's progress in its build output: ``[ 45%] Building CXX object ...``."""

Say = Callable[[str], None]


class BuildFailed(MptError):
    """A step of the build failed (not the user's input): `mpt install` exits with code 1."""


@dataclass(frozen=True)
class Target:
    """What one Horovod wheel is built for; its cache folder is named after all of it."""

    torch: str
    """torch's public version (``2.14.1`` for ``2.14.1+cu130``)."""
    python_tag: str
    """The interpreter's wheel tag, e.g. ``cp311``."""
    cuda_home: Path | None
    """The CUDA toolkit the kernels are compiled with; None builds for CPUs only."""
    cuda_archs: str
    """With a toolkit: compute capabilities, comma-separated; empty: every one nvcc knows."""

    @property
    def folder(self) -> str:
        """The cache folder's name, e.g. ``horovod-0.28.1-torch-2.14.1-cp311-sm_80_90``."""
        name = f"horovod-{HOROVOD_VERSION}-torch-{self.torch}-{self.python_tag}"
        if self.cuda_home is None:
            return name
        return f"{name}-sm_{self.cuda_archs.replace(',', '_') or 'all'}"

    def describe(self) -> str:
        """The target in words, for the progress lines."""
        gpus = ("for CPUs only" if self.cuda_home is None else
                f"with CUDA from {self.cuda_home} for compute capabilities "
                f"{self.cuda_archs or 'all nvcc knows'}")
        return f"Horovod {HOROVOD_VERSION} for torch {self.torch}, {self.python_tag}, {gpus}"

    def build_env(self, env: Mapping[str, str], path: str) -> dict[str, str]:
        """The environment of Horovod's build: ``env`` with the features, ``PATH`` as the tools
        were found on, and the toolkit (``HOROVOD_CUDA_HOME`` makes Horovod's CMake use its nvcc,
        not a wrapper on PATH). ``MAKEFLAGS`` is emptied because Horovod's setup.py compiles with
        -j8 only while it is empty, and a `make` that runs this command sets it."""
        build = {k: v for k, v in env.items() if k != "HOROVOD_BUILD_CUDA_CC_LIST"}
        # Unbuffered: pip's lines and the build's reach the log in the order they happened.
        build.update(HOROVOD_FEATURES, PATH=path, MAKEFLAGS="", PYTHONUNBUFFERED="1")
        # CMake 4 refuses projects that ask for CMake < 3.5, as Horovod's gloo does, unless
        # told this; older CMakes ignore it.
        build.setdefault("CMAKE_POLICY_VERSION_MINIMUM", "3.5")
        if self.cuda_home is not None:
            build.update(CUDA_HOME=str(self.cuda_home), HOROVOD_CUDA_HOME=str(self.cuda_home))
            if self.cuda_archs:
                build["HOROVOD_BUILD_CUDA_CC_LIST"] = self.cuda_archs
        return build


def build_file(name: str) -> Path:
    """One of Horovod's build files: in a wheel under ``mpt/_data/horovod/`` (setup.py copies
    them there), in a source tree (an editable install, the Makefile) in ``backends/horovod/``."""
    package = Path(__file__).resolve().parent
    for folder in (package / "_data" / "horovod", package.parent / "backends" / "horovod"):
        if (folder / name).is_file():
            return folder / name
    raise MissingDependencyError("mpt install horovod", f"mpt's file {name}",
                                 "reinstall mpt-train", reason="this install lacks it")


def torch_version() -> str:
    """The public version of the torch installed in this Python (what Horovod builds against)."""
    try:
        return Version(metadata.version("torch")).public
    except metadata.PackageNotFoundError:
        raise MissingDependencyError(
            "Building Horovod", "torch", "pip install torch (the version you will train with) "
            "first: Horovod is compiled against it") from None


def python_tag() -> str:
    """This interpreter's wheel tag, e.g. ``cp311``."""
    return f"{tags.interpreter_name()}{tags.interpreter_version()}"


def find_cuda_home(env: Mapping[str, str]) -> Path | None:
    """The CUDA toolkit ``backends/horovod/cuda-home`` finds in ``env`` (``CUDA_HOME``,
    ``CUDA_PATH``, the nvcc on ``PATH``, /usr/local/cuda), or None without one."""
    found = subprocess.run(["sh", str(build_file("cuda-home"))], env=dict(env),
                           capture_output=True, text=True, check=False).stdout.strip()
    return Path(found) if found else None


def parse_cuda_archs(value: str) -> str:
    """``--cuda-archs`` checked: compute capabilities without dots, comma-separated, or empty."""
    archs = value.replace(" ", "")
    if not re.fullmatch(r"(\d{2,3}(,\d{2,3})*)?", archs):
        raise UsageError("--cuda-archs", value, "it is not a list of compute capabilities",
                         "pass them without dots, comma-separated (e.g. 80,90 for A100 and "
                         "H100), or '' for every one nvcc knows")
    return archs


def default_cache(env: Mapping[str, str]) -> Path:
    """Where wheels are kept unless ``--cache-dir`` says: the user's cache, as pip's is."""
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mpt" / "wheels"


def tool_path(env: Mapping[str, str]) -> str:
    """``PATH`` with this Python's scripts folder first: a virtualenv's CMake (``pip install
    cmake``, the ``[horovod]`` extra) is found without the virtualenv activated."""
    return os.pathsep.join(filter(None, (sysconfig.get_path("scripts"), env.get("PATH", ""))))


def _cmake_version(cmake: str) -> Version | None:
    output = subprocess.run([cmake, "--version"], capture_output=True, text=True,
                            check=False).stdout
    found = re.search(r"version\s+(\d+(?:\.\d+)*)", output)
    try:
        return Version(found.group(1)) if found else None
    except InvalidVersion:
        return None


def missing_tools(env: Mapping[str, str], path: str) -> list[tuple[str, str]]:
    """The build tools not found on ``path``: (what, how to get it) for each."""
    missing = []
    compilers = env.get("CXX", "").split()[:1] or ["c++", "g++", "clang++"]
    if not any(shutil.which(c, path=path) for c in compilers):
        missing.append(("a C++ compiler", "install one (apt-get install g++) or set CXX"))
    cmake = shutil.which("cmake", path=path)
    version = _cmake_version(cmake) if cmake else None
    if version is None or version < MIN_CMAKE:
        found = f" (found {version})" if version else ""
        missing.append((f"CMake >= {MIN_CMAKE}{found}", "pip install cmake"))
    for tool, package in (("make", "make"), ("patch", "patch")):
        if not shutil.which(tool, path=path):
            missing.append((tool, f"apt-get install {package}"))
    return missing


def gpu_visible() -> bool:
    """Whether torch sees a GPU here: then a Horovod built without CUDA cannot reduce its
    tensors, and the build needs the CUDA toolkit."""
    import torch

    return bool(torch.cuda.is_available())


def check_can_build(target: Target, env: Mapping[str, str], path: str) -> None:
    """Raises one error naming everything Horovod's build lacks here, before it starts."""
    missing = missing_tools(env, path)
    if target.cuda_home is None and gpu_visible():
        missing.append(("the CUDA toolkit (a folder whose lib64/ holds libcudart), since torch "
                        "sees a GPU", "install the toolkit of torch's CUDA version and set "
                        "CUDA_HOME to it"))
    if missing:
        names = [what for what, _ in missing]
        raise MissingDependencyError("Building Horovod", " and ".join(
            filter(None, (", ".join(names[:-1]), names[-1]))), "; ".join(fix for _, fix in missing))


def cached_wheel(folder: Path) -> Path | None:
    """The wheel in ``folder`` if a build there finished, else None."""
    if not (folder / BUILT).is_file():
        return None
    wheels = sorted(folder.glob(f"horovod-{HOROVOD_VERSION}-*.whl"),
                    key=lambda wheel: wheel.stat().st_mtime)
    return wheels[-1] if wheels else None


def _record(text: str) -> set[tuple[str, str]]:
    """A RECORD's (path, hash) rows that have a hash."""
    return {(row[0], row[1]) for row in csv.reader(io.StringIO(text)) if len(row) > 1 and row[1]}


def wheel_installed(wheel: Path, installed: metadata.Distribution | None) -> bool:
    """Whether ``installed`` holds exactly ``wheel``'s files: every file the wheel records, with
    its hash, is in the installed RECORD (pip keeps them, adding its own), whichever way it was
    installed. A wheel rebuilt for other GPU architectures has the same version, so the version
    cannot tell."""
    record = None if installed is None else installed.read_text("RECORD")
    if record is None:
        return False
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
        return _record(archive.read(name).decode()) <= _record(record)


def installed_horovod() -> metadata.Distribution | None:
    """The horovod distribution of this Python, or None."""
    try:
        return metadata.distribution("horovod")
    except metadata.PackageNotFoundError:
        return None


def _minutes(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def _run(command: list[str], step: str, env: Mapping[str, str], cwd: Path | None = None) -> None:
    """Runs a short step; a failure is a BuildFailed naming the step and the tool's last line."""
    result = subprocess.run(command, capture_output=True, text=True, check=False, env=dict(env),
                            cwd=cwd)
    if result.returncode:
        last = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise BuildFailed(f"{step} failed (exit code {result.returncode}): {last[0]}")


def fetch_sdist(into: Path, env: Mapping[str, str]) -> Path:
    """Horovod's sdist, downloaded by pip into ``into``."""
    try:
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:",
              "--no-deps", "-d", str(into), f"horovod=={HOROVOD_VERSION}"],
             f"pip download horovod=={HOROVOD_VERSION}", env)
    except BuildFailed as exc:
        raise BuildFailed(f"{exc}. Fix: where there is network, `pip download --no-binary :all: "
                          f"--no-deps horovod=={HOROVOD_VERSION}`, then pass the file with "
                          "--sdist FILE") from None
    return next(into.glob("horovod-*.tar.gz"))


def unpack(sdist: Path, into: Path) -> Path:
    """The sdist's top folder, unpacked into ``into``."""
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):  # refuse links and paths that leave ``into``
            archive.extractall(into, filter="data")
        else:  # a Python without the filters (3.10 before 3.10.12)
            archive.extractall(into)
    tops = [p for p in into.iterdir() if p.is_dir()]
    if len(tops) != 1 or not (tops[0] / "setup.py").is_file():
        raise BuildFailed(f"{sdist} is not an sdist with one top folder holding setup.py")
    return tops[0]


def compile_wheel(source: Path, folder: Path, env: dict[str, str], say: Say) -> None:
    """``pip wheel`` of ``source`` into ``folder``; its output goes to ``folder/build.log``, and
    CMake's progress, every tenth of the build or every minute, to ``say``."""
    log = folder / "build.log"
    command = [sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
               "-w", str(folder), str(source)]
    start = time.monotonic()
    shown, shown_at = -10, start
    with log.open("w") as out, subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True) as pip:
        assert pip.stdout is not None  # opened with stdout=PIPE
        for line in pip.stdout:
            out.write(line)
            found = PROGRESS.search(line)
            now = time.monotonic()
            if found and (int(found.group(1)) >= shown + 10 or now - shown_at >= 60):
                shown, shown_at = int(found.group(1)), now
                say(f"mpt:       {shown}% after {_minutes(now - start)}")
    if pip.returncode:
        say("\n".join(f"  {line}" for line in _error_lines(log.read_text(errors="replace"))))
        raise BuildFailed(f"Horovod's build failed (exit code {pip.returncode}) after "
                          f"{_minutes(time.monotonic() - start)}; its last error lines are above, "
                          f"the whole log is {log}")


def _error_lines(log: str, keep: int = 20) -> list[str]:
    """The build's last lines that speak of an error (the compiler's, CMake's, setup.py's), each
    with the more indented lines that go on with it, up to pip's report of the failure, which
    quotes pip's own code and would drown them."""
    lines = log.splitlines()
    end = next((i for i, line in enumerate(lines)
                if line.strip() == "error: subprocess-exited-with-error"), len(lines))
    shown: list[str] = []
    depth: int | None = None  # the indentation of the error whose message goes on below it
    for line in lines[:end]:
        indent = len(line) - len(line.lstrip())
        if "error" in line.lower():
            shown.append(line)
            depth = indent
        elif depth is not None and line.strip() and indent > depth:
            shown.append(line)
        elif line.strip():
            depth = None
    return shown[-keep:]


def build(target: Target, folder: Path, sdist: Path | None, env: Mapping[str, str],
          path: str, say: Say) -> Path:
    """Builds the wheel into ``folder`` (steps 2-4 of the module's docstring) and returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / BUILT).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="mpt-horovod-") as scratch:
        work = Path(scratch)
        say(f"mpt: [1/3] {'downloading' if sdist is None else 'unpacking'} the Horovod "
            f"{HOROVOD_VERSION} sdist")
        sdist = sdist or fetch_sdist(work, env)
        source = unpack(sdist, work / "src")
        patch = build_file("cxx20.patch")
        say(f"mpt: [2/3] applying {patch.name} to {sdist.name} (C++20, as torch's headers need)")
        _run(["patch", "-p1", "--batch", "-i", str(patch)], f"patch -p1 -i {patch}",
             dict(env, PATH=path), cwd=source)
        say(f"mpt: [3/3] building {target.describe()} (about 3.5 minutes on 2 cores); log: "
            f"{folder / 'build.log'}")
        compile_wheel(source, folder, target.build_env(env, path), say)
    (folder / BUILT).touch()
    wheel = cached_wheel(folder)
    if wheel is None:
        raise BuildFailed(f"pip finished but left no horovod-{HOROVOD_VERSION} wheel in {folder}")
    return wheel


def install_wheel(wheel: Path, env: Mapping[str, str], say: Say) -> None:
    """Installs ``wheel`` into this Python unless it is what is installed: first by force and
    alone (a wheel rebuilt for other GPU architectures has the installed one's version), then
    again for Horovod's own dependencies."""
    if wheel_installed(wheel, installed_horovod()):
        say(f"mpt: {wheel.name} from {wheel.parent} is installed")
        return
    say(f"mpt: installing {wheel}")
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    _run([*pip, "--force-reinstall", "--no-deps", str(wheel)], "pip install", env)
    _run([*pip, str(wheel)], "pip install (Horovod's dependencies)", env)


app = typer.Typer(name="install", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)


@app.callback()
def _group() -> None:
    """Build and install what pip cannot install as published: Horovod for this torch."""


@app.command()
def horovod(
    cache_dir: Annotated[Path | None, typer.Option(
        metavar="DIR", help="Where built wheels are kept, a folder per Horovod, torch, Python and "
        "GPU architectures (default: $XDG_CACHE_HOME/mpt/wheels or ~/.cache/mpt/wheels).")] = None,
    cuda_archs: Annotated[str, typer.Option(
        metavar="CC,...", help="With a CUDA toolkit: the GPU compute capabilities Horovod's "
        "kernels are compiled for, without dots (HOROVOD_BUILD_CUDA_CC_LIST); '' for every one "
        "nvcc knows.")] = DEFAULT_CUDA_ARCHS,
    sdist: Annotated[Path | None, typer.Option(
        metavar="FILE", help=f"horovod-{HOROVOD_VERSION}.tar.gz, on a machine without network "
        "(default: pip downloads it).")] = None,
    build_only: Annotated[bool, typer.Option(
        "--build-only", help="Build (or find in the cache) the wheel and print its path; do not "
        "install it.")] = False,
    rebuild: Annotated[bool, typer.Option(
        "--rebuild", help="Build again even when the cache holds the wheel.")] = False,
) -> None:
    """Build Horovod 0.28.1 against the installed torch (patched for C++20, with the machine's
    CUDA toolkit), keep the wheel in a cache and install it."""
    env = dict(os.environ)  # the command is the edge: everything below takes env as given
    if sdist is not None and not sdist.is_file():
        raise UsageError("--sdist", sdist, "no such file",
                         f"pass the path of horovod-{HOROVOD_VERSION}.tar.gz")
    target = Target(torch=torch_version(), python_tag=python_tag(),
                    cuda_home=find_cuda_home(env), cuda_archs=parse_cuda_archs(cuda_archs))
    folder = (cache_dir or default_cache(env)) / target.folder
    try:
        wheel = None if rebuild else cached_wheel(folder)
        if wheel is None:
            path = tool_path(env)
            check_can_build(target, env, path)
            wheel = build(target, folder, sdist, env, path, _say)
        else:
            _say(f"mpt: {target.describe()}: cached in {folder}")
        if build_only:
            print(wheel)
        else:
            install_wheel(wheel, env, _say)
    except BuildFailed as exc:  # not the user's input: exit code 1, not 2
        _say(f"mpt: error: {exc}")
        raise typer.Exit(1) from None


def _say(line: str) -> None:
    """A progress line on stderr, at once (a build runs for minutes)."""
    print(line, file=sys.stderr, flush=True)


def main() -> None:
    """`python -m mpt.install`: these commands without the rest of `mpt`; errors as `mpt`
    prints them (one line, exit code 2)."""
    try:
        app(prog_name="python -m mpt.install")
    except MptError as exc:
        _say(f"mpt: error: {exc}")
        sys.exit(2)


if __name__ == "__main__":
    main()
