"""``--host-memory``: lean hands freed large blocks back to the OS, fast (glibc's default) keeps
them; a bad value is one line naming the flag, the value and the choices."""

from __future__ import annotations

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


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_memory._glibc() is None,
                    reason="glibc's allocator and /proc only")
def test_lean_returns_freed_large_blocks_and_fast_keeps_them():
    runs = {mode: subprocess.Popen([sys.executable, "-c", FRAGMENT, mode], text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for mode in host_memory.HOST_MEMORY}
    kept = {}
    for mode, run in runs.items():
        out, err = run.communicate(timeout=60)
        assert run.returncode == 0, err
        kept[mode] = int(out.split()[-1])
    # fast: the 15 freed blocks stay resident (the control: this pattern does fragment)
    assert kept["fast"] >= (BLOCKS - 4) * BLOCK, kept
    # lean: only the block still held stays (and a little of the heap)
    assert kept["lean"] <= 3 * BLOCK, kept


def test_lean_says_where_it_cannot_apply(monkeypatch):
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    assert "--host-memory lean has no effect here" in host_memory.apply_host_memory("lean")
    assert host_memory.apply_host_memory("fast") is None


def test_a_bad_value_is_refused_in_one_line(run_cli):
    result = run_cli("launch", "--gpus", "1", "--host-memory", "huge", "train.py")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "--host-memory=huge" in lines[0] and "fast, lean" in lines[0]
