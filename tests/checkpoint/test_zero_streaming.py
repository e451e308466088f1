"""`mpt checkpoint convert` of a ZeRO-3 checkpoint streams it: the state is never held (slow).

The source is DeepSpeed's own: benchmarks/zero_conversion.py --make (a plain ZeRO-3 script, no
mpt: ``deepspeed.zero.Init``, torch's AdamW, one step, ``engine.save_checkpoint`` from 4
processes; 8 x ``nn.Linear(2048, 2048)``, 33.6 M parameters, 403 MB of masters and moments).
The conversion reads each rank file's structure alone and copies every parameter's pieces from
the four files into the checkpoint a bounded piece at a time (issue 35): its peak memory must
stay far below the state, its masters must be what DeepSpeed's own ``zero_to_fp32`` reads, and
its model file must be the very bytes that writing the assembled tensors whole gives.
"""

from __future__ import annotations

import io
import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import ds_env, mpt_command

from mpt.checkpoint import tensorfile
from mpt.checkpoint.foreign import deepspeed
from mpt.checkpoint.foreign.imported import OnDisk

pytestmark = pytest.mark.slow
BENCHMARK = Path(__file__).parents[2] / "benchmarks" / "zero_conversion.py"
LAYERS, WIDTH = 8, 2048
STATE_BYTES = 3 * 4 * LAYERS * (WIDTH * WIDTH + WIDTH)  # fp32 masters, exp_avg, exp_avg_sq


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero3") / "ds"
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--make", str(out), "--layers", str(LAYERS),
         "--width", str(WIDTH)], capture_output=True, text=True, timeout=600,
        env={**os.environ, "DS_ACCELERATOR": "cpu", **ds_env()})
    tag = out / "global_step1"
    files = sorted(tag.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    # gloo may abort a rank at interpreter exit, after the save: the files are what counts
    assert len(files) == 4 and "saved" in result.stdout, result.stdout[-3000:] + result.stderr[
        -3000:]
    return out


def peak_rss(cmd: list[str]) -> int:
    """The peak resident memory of ``cmd``'s process, in bytes (the kernel's ``ru_maxrss``)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "COLUMNS": "200"})
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, proc.stderr.read().decode()[-3000:]
    proc.stdout.close()
    proc.stderr.close()
    return usage.ru_maxrss * 1024


def whole(tensor: OnDisk) -> torch.Tensor:
    """The tensor ``tensor`` stands for, read from its ranges."""
    data = bytearray()
    for path, offset, count in tensor.ranges:
        with open(path, "rb") as f:
            data += os.pread(f.fileno(), count, offset)
    return torch.frombuffer(data, dtype=tensor.dtype).view(tensor.shape)


def test_a_zero3_conversion_holds_a_bounded_buffer_not_the_state(source, tmp_path):
    floor = peak_rss(mpt_command("checkpoint", "--help"))  # the interpreter and its imports
    peak = peak_rss(mpt_command("checkpoint", "convert", str(source), str(tmp_path / "mpt")))
    # the whole state, once, is what assembling it before writing held (and one rank's file)
    assert peak - floor < STATE_BYTES / 2, (peak, floor, STATE_BYTES)
    written = sum(f.stat().st_size for f in (tmp_path / "mpt").glob("step-*/*.safetensors"))
    assert written > STATE_BYTES  # masters and both moments were written, not left out


def test_the_masters_are_deepspeeds_and_the_files_what_whole_tensors_give(source, tmp_path,
                                                                           run_cli,
                                                                           monkeypatch):
    result = run_cli("checkpoint", "convert", str(source), str(tmp_path / "mpt"))
    assert result.returncode == 0, result.stderr
    assert f"{LAYERS * 2} tensors, AdamW state of {LAYERS * 2} parameters" in result.stdout
    step = next((tmp_path / "mpt").glob("step-*"))
    imported = deepspeed.read(source)
    assert all(isinstance(t, OnDisk) for t in imported.weights.values())  # nothing read yet
    masters = {f"model/{name}": whole(t) for name, t in imported.weights.items()}
    expected = io.BytesIO()
    tensorfile.write(expected, masters)
    assert (step / "model.safetensors").read_bytes() == expected.getvalue()
    moments = load_file(step / "state.safetensors")
    for name, state in imported.optimizer["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[f"optimizer/model/state/{name}/{key}"],
                               whole(state[key])), (name, key)
    assert math.prod(masters["model/0.weight"].shape) == WIDTH * WIDTH
    # DeepSpeed's own reading of the same files, by the script save_checkpoint copied there
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    zero_to_fp32 = runpy.run_path(str(source / "zero_to_fp32.py"), run_name="zero_to_fp32")
    theirs = zero_to_fp32["get_fp32_state_dict_from_zero_checkpoint"](str(source))
    assert theirs.keys() == imported.weights.keys()
    for name, want in theirs.items():
        assert torch.equal(masters[f"model/{name}"], want), name
