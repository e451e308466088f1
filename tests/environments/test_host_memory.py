"""``--host-memory``: lean hands freed large blocks back to the OS, fast (glibc's default) keeps
them but trims a heap's free top and maps a block of 32 MiB or more anew each time, steady keeps
every block, whatever its size; a bad value is one line naming the
flag, the value and the choices."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpt.environments import host_memory

MiB = 2**20
BLOCK = 8 * MiB
BLOCKS = 16

# Frees all but the last of BLOCKS tensors of 8 MiB (their pages touched) after a Runtime with
# the mode given; prints how much resident memory that left behind, in bytes.
FRAGMENT = f"""
import sys, torch, mpt
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
rt = mpt.Runtime(env={{}}, host_memory=sys.argv[1], quiet=True)
torch.ones({BLOCK} // 4)  # a freed mmap'd block: glibc's default raises its mmap threshold past it
before = rss()
blocks = [torch.ones({BLOCK} // 4) for _ in range({BLOCKS})]
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


def _each_mode(script: str) -> dict[str, int]:
    """The last number ``script`` prints, run once under each ``--host-memory``."""
    runs = {mode: subprocess.Popen([sys.executable, "-c", script, mode], text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for mode in host_memory.HOST_MEMORY}
    printed = {}
    for mode, run in runs.items():
        out, err = run.communicate(timeout=60)
        assert run.returncode == 0, err
        printed[mode] = int(out.split()[-1])
    return printed


@glibc_only
def test_lean_returns_freed_large_blocks_and_fast_and_steady_keep_them():
    kept = _each_mode(FRAGMENT)
    # fast: the 15 freed blocks stay resident (the control: this pattern does fragment)
    assert kept["fast"] >= (BLOCKS - 4) * BLOCK, kept
    # lean: only the block still held stays (and a little of the heap)
    assert kept["lean"] <= 3 * BLOCK, kept
    # steady: kept as under fast
    assert kept["steady"] >= (BLOCKS - 4) * BLOCK, kept


def _rounds(mode: str, size: int, count: int, times: int = 6) -> list[list[int]]:
    """What each round of ``STEPS`` faulted in and handed back under ``mode``."""
    return json.loads(subprocess.run(
        [sys.executable, "-c", STEPS, mode, str(size), str(count), str(times)],
        capture_output=True, text=True, timeout=60, check=True).stdout)


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
def test_steady_reuses_a_block_glibc_would_map_anew():
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
