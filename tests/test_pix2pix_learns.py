"""examples/pix2pix.py visibly learns in `make examples`' run: with the Makefile's arguments on
2 CPU processes, its held-out L1 ends below the blank picture's (about 30 s; `make conformance`)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from conftest import run_mpt

ROOT = Path(__file__).parents[1]


def make_examples_args() -> list[str]:
    """``ARGS_pix2pix`` of the Makefile: what `make examples` runs."""
    found = re.search(r"^ARGS_pix2pix\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert found, "the Makefile has no ARGS_pix2pix"
    return shlex.split(found[1])


@pytest.mark.slow
def test_pix2pix_beats_the_blank_picture_in_make_examples_run(free_port):
    script, *args = make_examples_args()
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--quiet",
                     str(ROOT / script), *args, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.search(r"held-out L1: ([\d.]+) \(a blank picture scores ([\d.]+)\)", result.stdout)
    assert found, result.stdout[-2000:]
    assert float(found[1]) < float(found[2]), found[0]
