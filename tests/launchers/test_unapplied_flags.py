"""`mpt launch` says when the flags only an ``mpt.Runtime`` applies had no effect: the script
ended without making one, and did not run the library ``--backend`` names itself (Horovod,
DeepSpeed). A script that uses torch.distributed alone is otherwise left alone."""

from __future__ import annotations

import sys
import textwrap
from types import SimpleNamespace

import pytest
from conftest import ds_env, run_mpt

from mpt.cli import _runtime_flags
from mpt.launchers.notes import MIGRATION_GUIDES, Note, library_initialised, unapplied_flags

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
    assert sorted(result.stdout.splitlines()) == [
        "[rank0]: sum 2 on rank 0", "[rank1]: sum 2 on rank 1"], result.stdout
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


HOROVOD_ITSELF = """\
import horovod.torch as hvd
import torch

hvd.init()
total = hvd.allreduce(torch.ones(1), op=hvd.Sum)
print(f"sum {total.item():g} on rank {hvd.rank()}", flush=True)
"""

DEEPSPEED_ITSELF = """\
import deepspeed
import deepspeed.comm as dist
import torch

deepspeed.init_distributed(dist_backend="gloo")
tensor = torch.ones(1)
dist.all_reduce(tensor)
print(f"sum {tensor.item():g} on rank {dist.get_rank()}", flush=True)
dist.destroy_process_group()  # DeepSpeed's query then says False: its backend object stays
"""


def test_a_script_that_ran_the_backends_library_itself_is_not_told():
    hvd, ds = Note(1, 0, 0, horovod=1), Note(1, 0, 1, deepspeed=1)
    for flags, notes in ((["--backend horovod"], {1: hvd, 2: hvd}),
                         (["--backend horovod", "--precision bf16-mixed"], {1: hvd}),
                         (["--backend deepspeed", "--zero-stage 2"], {1: ds})):
        assert unapplied_flags(flags, notes) is None, flags
    # Flags the library never saw are still said: no --backend, or another library's.
    assert unapplied_flags(["--precision bf16-mixed"], {1: hvd}) is not None
    assert unapplied_flags(["--backend horovod"], {1: ds}) is not None


def test_a_note_without_the_library_fields_still_reads(tmp_path):
    (tmp_path / "12").write_text("1 0 3 1")  # written by a worker of before these fields
    assert Note.read_all(str(tmp_path)) == {12: Note(1, 0, 3, runtime=1, horovod=0, deepspeed=0)}


def test_the_libraries_are_asked_only_where_the_script_imported_them(monkeypatch):
    for name in ("horovod.torch", "deepspeed.comm.comm"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert not library_initialised("horovod") and not library_initialised("deepspeed")
    assert "horovod.torch" not in sys.modules and "deepspeed.comm.comm" not in sys.modules
    monkeypatch.setitem(sys.modules, "horovod.torch", SimpleNamespace(is_initialized=lambda: True))
    assert library_initialised("horovod")
    ended = SimpleNamespace(is_initialized=lambda: False, cdb=object())  # group destroyed
    monkeypatch.setitem(sys.modules, "deepspeed.comm.comm", ended)
    assert library_initialised("deepspeed")
    monkeypatch.setitem(sys.modules, "deepspeed.comm.comm",
                        SimpleNamespace(is_initialized=lambda: False, cdb=None))
    assert not library_initialised("deepspeed")

    def broken() -> bool:
        raise RuntimeError("Horovod has not been initialized; use hvd.init().")

    monkeypatch.setitem(sys.modules, "horovod.torch", SimpleNamespace(is_initialized=broken))
    assert not library_initialised("horovod")
    with pytest.raises(ValueError, match="library='mpi' is not one of"):
        library_initialised("mpi")


@pytest.mark.parametrize("library", ["horovod", "deepspeed"])
def test_a_script_that_runs_horovod_or_deepspeed_itself_is_not_told(library, tmp_path,
                                                                      free_port):
    pytest.importorskip("horovod.torch" if library == "horovod" else "deepspeed")
    script = tmp_path / f"{library}_itself.py"
    script.write_text(HOROVOD_ITSELF if library == "horovod" else DEEPSPEED_ITSELF)
    plain = tmp_path / "plain.py"
    plain.write_text(PLAIN)
    for path, told in ((script, False), (plain, True)):
        result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--backend",
                         library, str(path), timeout=300, env={**ds_env(), "DS_ACCELERATOR": "cpu"})
        assert result.returncode == 0, result.stderr
        assert sorted(line for line in result.stdout.splitlines() if "sum" in line) == [
            "[rank0]: sum 2 on rank 0", "[rank1]: sum 2 on rank 1"], result.stdout
        said = [line for line in result.stderr.splitlines() if "had no effect" in line]
        assert said == ([f"mpt: --backend {library} had no effect: the script never created "
                         "mpt.Runtime, which applies it (a script that uses torch.distributed "
                         f"alone runs as under torchrun); {MIGRATION_GUIDES} shows the lines to "
                         "add"] if told else []), (path.name, result.stderr)

