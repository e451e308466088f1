"""The main job, as `make demo` runs it: 2 CPU processes, bf16-mixed, at least 95 % held out."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import run_mpt

EXAMPLE = Path(__file__).parents[1] / "examples" / "digits.py"


def test_digits_example_reaches_95_percent_on_two_processes_in_bf16(tmp_path, free_port):
    ckpt = tmp_path / "digits"
    result = run_mpt("launch", "--gpus", "2", "--precision", "bf16-mixed", "--master-port",
                     str(free_port), str(EXAMPLE), "--save", str(ckpt))
    assert result.returncode == 0, result.stderr
    assert "rank 0 of 2: backend ddp, precision bf16-mixed" in result.stdout
    accuracy = float(re.search(r"held-out accuracy: ([\d.]+)%", result.stdout).group(1))
    assert accuracy >= 95.0, result.stdout
    assert (ckpt / "latest").is_file()
