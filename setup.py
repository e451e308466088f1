"""Build steps of the `mpt-train` distribution that pyproject.toml cannot declare.

pyproject.toml holds the metadata (name, version from `mpt.__version__`, dependencies, extras,
the `mpt` console script). This file adds two build steps:

- the optional native extension `mpt._C` from `backends/csrc`, built by driving CMake
  (Horovod-style: a build_ext subclass runs `cmake` configure + build into the extension's path).
  The extension is optional: with MPT_SKIP_COMPILE=1, without cmake or a C++ compiler, or when
  its build fails, the install goes on without it and mpt uses its pure-Python fallbacks.
- the files `mpt install horovod` builds Horovod with (`backends/horovod/`), copied into the
  package as `mpt/_data/horovod/`, so that an installed wheel has them outside the repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
HOROVOD_BUILD_FILES = ("cxx20.patch", "cuda-home")
"""The files of `backends/horovod/` that `mpt install horovod` needs (see mpt/install.py)."""


class CMakeExtension(Extension):
    """An extension whose sources CMakeLists.txt lists, so setuptools compiles nothing itself."""

    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


def _skip_reason() -> str | None:
    """Why the optional extension cannot or must not be built here, or None to build it."""
    if os.environ.get("MPT_SKIP_COMPILE", "0").strip().lower() not in ("", "0", "false", "no"):
        return "MPT_SKIP_COMPILE is set"
    if shutil.which("cmake") is None:
        return "cmake is not on PATH"
    cxx = os.environ.get("CXX", "").split()
    candidates = cxx[:1] or ["c++", "g++", "clang++", "cl"]
    if not any(shutil.which(c) for c in candidates):
        return f"no C++ compiler on PATH, looked for {'/'.join(candidates)}"
    return None


class CMakeBuild(build_ext):
    """Builds CMakeExtensions with CMake; drops (never fails on) the ones it cannot build."""

    def run(self) -> None:
        reason = _skip_reason()
        if reason is not None:
            for ext in self.extensions:
                self._announce_skip(ext, reason)
            self.extensions = []  # nothing left to build, copy in place or list as output
        super().run()

    def build_extensions(self) -> None:
        built = []
        for ext in self.extensions:
            build_dir = Path(self.build_temp).resolve() / "cmake"
            try:
                self._build_with_cmake(ext, build_dir)
            except subprocess.CalledProcessError as exc:
                step = "build" if "--build" in exc.cmd else "configure"
                reason = f"cmake {step} failed with exit code {exc.returncode}, output above"
            except OSError as exc:
                reason = f"its CMake build failed: {exc}"
            else:
                built.append(ext)
                continue
            # A failed configure caches bad findings (e.g. the compiler): start afresh next time.
            shutil.rmtree(build_dir, ignore_errors=True)
            self._announce_skip(ext, reason)
        self.extensions = built

    def _build_with_cmake(self, ext: Extension, build_dir: Path) -> None:
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        config = "Debug" if self.debug else "Release"
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",  # same interpreter -> same SOABI
            f"-DMPT_OUTPUT_DIR={target.parent}",
            f"-DCMAKE_BUILD_TYPE={config}",
        ]  # fmt: skip
        jobs = str(int(self.parallel or 0) or os.cpu_count() or 1)
        build = ["cmake", "--build", str(build_dir), "--config", config, "-j", jobs]
        subprocess.run(configure, check=True)
        subprocess.run(build, check=True)
        if not target.is_file():
            raise OSError(f"CMake finished but did not produce {target}")

    @staticmethod
    def _announce_skip(ext: Extension, reason: str) -> None:
        print(f"mpt: skipped the optional extension {ext.name} ({reason}); using Python fallbacks")


class BuildPy(build_py):
    """Also copies the Horovod build's files into the package. An editable install skips them:
    there `mpt install horovod` reads them from `backends/horovod/` in the source tree."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        target = Path(self.build_lib) / "mpt" / "_data" / "horovod"
        self.mkpath(str(target))
        for name in HOROVOD_BUILD_FILES:
            self.copy_file(str(ROOT / "backends" / "horovod" / name), str(target / name))


setup(
    ext_modules=[CMakeExtension("mpt._C")],
    cmdclass={"build_ext": CMakeBuild, "build_py": BuildPy},
)
