"""``--host-memory``: lean hands freed large blocks back to the OS, fast (glibc's default) keeps
them but trims a heap's free top and maps a block of 32 MiB or more anew each time, steady keeps
every block, whatever its size: in jemalloc, which `mpt launch` preloads where the machine has
it, else in glibc's heaps, and says so; a bad value is one line naming the flag, the value and
the choices."""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys

import pytest
from conftest import run_mpt

from mpt.environments import host_memory

MiB = 2**20
BLOCK = 8 * MiB
BLOCKS = 16

# Frees all but the last of BLOCKS tensors of argv 2 bytes (their pages touched) after a
# Runtime with the mode given (argv 1); prints how much resident memory that left behind, in
# bytes.
FRAGMENT = f"""
import sys, torch, mpt
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
rt = mpt.Runtime(env={{}}, host_memory=sys.argv[1], quiet=True)
block = int(sys.argv[2])
torch.ones(block // 4)  # a freed mmap'd block: glibc's default raises its mmap threshold past it
before = rss()
blocks = [torch.ones(block // 4) for _ in range({BLOCKS})]
del blocks[:-1]  # the last one pins the heap's top: no trim can release the others
print(rss() - before)
rt.close()
"""


# ROUNDS times (argv 4), as a training loop's steps do: allocates COUNT tensors of SIZE bytes
# (argv 2 and 3; their pages touched), then frees them all, so the heap's top is free. Prints,
# per round, the bytes that round faulted in and the resident bytes its free handed back.
STEPS = """
import json, resource, sys, torch
from mpt.environments.host_memory import apply_host_memory
apply_host_memory(sys.argv[1])
size, count, times = (int(a) for a in sys.argv[2:5])
def faulted():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt * resource.getpagesize()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
rounds = []
for _ in range(times):
    before = faulted()
    blocks = [torch.ones(size // 4) for _ in range(count)]
    held = rss()
    del blocks
    rounds.append((faulted() - before, held - rss()))
print(json.dumps(rounds))
"""

glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or host_memory._glibc() is None,
    reason="glibc's allocator and /proc only")


def _each_mode(script: str, *args: str) -> dict[str, int]:
    """The last number ``script`` prints, run once under each ``--host-memory`` (its first
    argument), ``args`` after it."""
    runs = {mode: subprocess.Popen([sys.executable, "-c", script, mode, *args], text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for mode in host_memory.HOST_MEMORY}
    printed = {}
    for mode, run in runs.items():
        out, err = run.communicate(timeout=60)
        assert run.returncode == 0, err
        printed[mode] = int(out.split()[-1])
    return printed


@glibc_only
@pytest.mark.parametrize("block", [BLOCK, 512 << 10],
                         ids=["8MiB", "512KiB: a pipeline's micro-batch output"])
def test_lean_returns_freed_large_blocks_and_fast_and_steady_keep_them(block):
    kept = _each_mode(FRAGMENT, str(block))
    # fast: the 15 freed blocks stay resident (the control: this pattern does fragment)
    assert kept["fast"] >= (BLOCKS - 4) * block, kept
    # lean: only the block still held stays (and a little of the heap)
    assert kept["lean"] <= 3 * block, kept
    # steady: kept as under fast
    assert kept["steady"] >= (BLOCKS - 4) * block, kept


jemalloc_only = pytest.mark.skipif(
    ctypes.util.find_library("jemalloc") is None,
    reason="needs jemalloc (Debian's libjemalloc2; make setup installs it where apt-get runs "
    "as root)")


def _rounds(mode: str, size: int, count: int, times: int = 6,
            env: dict[str, str] | None = None) -> list[list[int]]:
    """What each round of ``STEPS`` faulted in and handed back under ``mode``, the process
    started with ``env`` added to this one's."""
    return json.loads(subprocess.run(
        [sys.executable, "-c", STEPS, mode, str(size), str(count), str(times)],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, **(env or {})}).stdout)


@glibc_only
def test_steady_keeps_what_a_step_freed_and_stops_faulting_it_in():
    rounds = {mode: _rounds(mode, BLOCK, BLOCKS) for mode in ("lean", "steady")}
    # lean (the control: this loop does free memory the OS takes back): every round hands its
    # blocks back and faults them in again
    for faulted, returned in rounds["lean"]:
        assert faulted >= (BLOCKS - 1) * BLOCK and returned >= (BLOCKS - 1) * BLOCK, rounds
    # steady never trims the heap's free top; once the heap holds a round's blocks, a round
    # reuses them (glibc's default does either, depending on what pins the top: not asserted)
    assert all(returned <= 0 for _, returned in rounds["steady"]), rounds
    assert rounds["steady"][-1][0] <= BLOCK, rounds


@glibc_only
def test_steady_without_jemalloc_reuses_a_block_glibc_would_map_anew():
    """A 64 MiB block, above glibc's highest mmap threshold (32 MiB), allocated and freed 16
    times."""
    size = 64 * MiB
    rounds = {mode: _rounds(mode, size, 1, 16) for mode in ("fast", "steady")}
    # fast (the control): mapped at each allocation, unmapped when freed, faulted in each round
    for faulted, returned in rounds["fast"]:
        assert faulted >= size - MiB and returned >= size - MiB, rounds
    # steady: from the heap, kept when freed. torch asks glibc for 64-byte aligned blocks,
    # which glibc serves from a free region a little larger than the block: the first rounds'
    # freed blocks fall short, and the heap grows until two of them merge (measured: after
    # 3-8 rounds in 40 runs); from then on each round writes the same pages again
    assert all(returned <= 0 for _, returned in rounds["steady"]), rounds
    assert all(faulted <= MiB for faulted, _ in rounds["steady"][-4:]), rounds


@jemalloc_only
def test_steady_in_jemalloc_faults_nothing_in_from_the_second_round():
    """The same 64 MiB block, 16 times, in a process started as `mpt launch` starts a worker
    under steady: jemalloc preloaded with its decay off."""
    size = 64 * MiB
    preload = host_memory.host_memory_env("steady", os.environ)
    assert "libjemalloc" in preload["LD_PRELOAD"], preload
    rounds = {"fast": _rounds("fast", size, 1, 16),
              "steady": _rounds("steady", size, 1, 16, env=preload)}
    # fast (the control, glibc's defaults): each round maps and faults the block in anew
    assert all(faulted >= size - MiB for faulted, _ in rounds["fast"]), rounds
    # jemalloc serves the freed block's pages to the next request of its size at once
    assert all(returned <= 0 for _, returned in rounds["steady"]), rounds
    assert all(faulted <= MiB for faulted, _ in rounds["steady"][1:]), rounds


@jemalloc_only
def test_launch_preloads_jemalloc_under_steady_only(tmp_path):
    script = tmp_path / "which.py"
    script.write_text("import mpt\n"
                      "from mpt.environments.host_memory import on_jemalloc\n"
                      "rt = mpt.Runtime()\n"
                      "print('on jemalloc:', on_jemalloc(), flush=True)\n"
                      "rt.close()\n")
    result = run_mpt("launch", "--gpus", "1", "--host-memory", "steady", str(script))
    assert result.returncode == 0, result.stderr[-2000:]
    said = result.stdout + result.stderr
    assert "on jemalloc: True" in said, said
    assert "glibc's heaps" not in said  # no fallback note where jemalloc runs
    # the other modes preload nothing (this suite's other launches run them on glibc)
    assert host_memory.host_memory_env("fast", os.environ) == {}
    assert host_memory.host_memory_env("lean", os.environ) == {}


@glibc_only
def test_steady_says_when_it_falls_back_to_glibc():
    note = subprocess.run(
        [sys.executable, "-c", "from mpt.environments.host_memory import apply_host_memory; "
         "print(apply_host_memory('steady'))"],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "LD_PRELOAD": ""}).stdout
    assert "keeps blocks in glibc's heaps here" in note and "libjemalloc2" in note, note


def test_lean_says_where_it_cannot_apply(monkeypatch):
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    for mode in ("lean", "steady"):
        assert f"--host-memory {mode} has no effect here" in host_memory.apply_host_memory(mode)
    assert host_memory.apply_host_memory("fast") is None


def test_a_bad_value_is_refused_in_one_line(run_cli):
    result = run_cli("launch", "--gpus", "1", "--host-memory", "huge", "train.py")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "--host-memory=huge" in lines[0] and "fast, lean, steady" in lines[0]
