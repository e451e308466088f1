"""Mixed precision with no ``rt.autocast()`` in the script, under every backend (2 ranks).

The worker trains one model with ``rt.autocast()`` and its copy without: the copy must compute
in the low dtype and follow exactly the same loss curve, which differs from fp32's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import find_free_port, launch_env, run_mpt, worker

LOW = {"bf16-mixed": "torch.bfloat16", "fp16-mixed": "torch.float16"}
FAST = {("ddp", "fp16-mixed"), ("fsdp", "bf16-mixed")}
CELLS = [pytest.param(backend, precision, id=f"{backend}-{precision}",
                      marks=() if (backend, precision) in FAST else pytest.mark.slow)
         for backend in ("ddp", "apex", "horovod", "fsdp", "deepspeed")
         for precision in LOW if (backend, precision) != ("deepspeed", "fp16-mixed")]
# DeepSpeed refuses fp16 on a CPU ("Type fp16 is not supported on your device"): GPU only.


@pytest.mark.parametrize(("backend", "precision"), CELLS)
def test_forward_autocasts_without_context(tmp_path: Path, backend: str, precision: str) -> None:
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(find_free_port()),
                     "--backend", backend, "--precision", precision,
                     worker("autocast_free.py"), str(tmp_path), timeout=300, env=launch_env())
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["hidden"] == [LOW[precision]]  # the bare forward ran under autocast
        assert got["output"] == "torch.float32"  # and left in fp32 for the script's loss
        assert got["bare"] == got["ctx"]  # exactly the curve of the script with the context
        assert len(set(got["bare"])) > 1 and got["bare"][-1] < got["bare"][0]
        assert got["bare"][0] != got["plain_fp32"]  # not fp32 under another name
