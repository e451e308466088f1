"""`mpt launch` says when the flags only an ``mpt.Runtime`` applies had no effect: the script
ended without making one. A script that uses torch.distributed alone is otherwise left alone."""

from __future__ import annotations

import re
import textwrap

from conftest import run_mpt

from mpt.cli import _runtime_flags
from mpt.launchers.notes import MIGRATION_GUIDES, Note, unapplied_flags

PLAIN = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
tensor = torch.ones(1)
dist.all_reduce(tensor)
print(f"sum {tensor.item():g} on rank {dist.get_rank()}", flush=True)
dist.destroy_process_group()
"""


def test_the_flags_listed_are_those_given_that_only_the_runtime_applies():
    given = {"backend": "ddp", "precision": "bf16-mixed", "loss_scale": "dynamic",
             "accumulate": "2", "checkpoint_dir": None, "quiet": True, "async_save": False,
             "keep_batchnorm_fp32": "true"}
    assert _runtime_flags(given, {}, "ddp") == (
        "--precision bf16-mixed", "--accumulate 2", "--quiet", "--keep-batchnorm-fp32 true")
    assert _runtime_flags({"backend": "deepspeed"}, {"zero_stage": "2"}, "deepspeed") == (
        "--backend deepspeed", "--zero-stage 2")
    assert _runtime_flags({"backend": "ddp"}, {}, "ddp") == ()


def test_the_line_needs_flags_ended_ranks_and_no_runtime():
    made, plain = Note(1, 0, 0, runtime=1), Note(1, 0, 1)
    assert unapplied_flags(["--precision bf16-mixed"], {1: plain, 2: made}) is None
    assert unapplied_flags([], {1: plain}) is None
    assert unapplied_flags(["--precision bf16-mixed"], {}) is None  # no rank said how it ended
    line = unapplied_flags(["--precision bf16-mixed"], {1: plain, 2: plain})
    assert line is not None and line.startswith("mpt: --precision bf16-mixed had no effect")
    assert MIGRATION_GUIDES in line


def test_a_plain_script_under_runtime_flags_trains_and_is_told_once(tmp_path, free_port):
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--backend",
                     "fsdp", "--precision", "bf16-mixed", "--global-batch-size", "8",
                     str(script))
    assert result.returncode == 0, result.stderr
    # The two ranks share the console: one's text may land before the other's newline.
    assert sorted(re.findall(r"sum 2 on rank \d", result.stdout)) == [
        "sum 2 on rank 0", "sum 2 on rank 1"], result.stdout
    told = [line for line in result.stderr.splitlines() if "had no effect" in line]
    assert told == [f"mpt: --backend fsdp --precision bf16-mixed --global-batch-size 8 had no "
                    f"effect: the script never created mpt.Runtime, which applies them (a script "
                    f"that uses torch.distributed alone runs as under torchrun); "
                    f"{MIGRATION_GUIDES} shows the lines to add"], result.stderr


def test_a_script_that_makes_the_runtime_is_not_told(tmp_path, free_port):
    script = tmp_path / "with_runtime.py"
    script.write_text(textwrap.dedent("""\
        import mpt

        rt = mpt.Runtime(quiet=True)
        rt.print(f"precision {rt.precision.spec.name}")
        """))
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--precision",
                     "bf16-mixed", str(script))
    assert result.returncode == 0, result.stderr
    assert "precision bf16-mixed" in result.stdout
    assert "had no effect" not in result.stderr, result.stderr
