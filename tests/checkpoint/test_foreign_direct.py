"""``rt.load``/``--resume`` of another framework's checkpoint as it is, at 2 ranks (slow).

The sources are written by the libraries themselves (workers/foreign_deepspeed.py: DeepSpeed's
engine at ZeRO-3 on 2 CPU ranks; workers/foreign_fsdp2.py: ``fully_shard`` + ``dcp.save``),
after step 3 of 8. mpt then loads each with real processes (2 ranks, gloo) under backends whose
ranks hold pieces of the state (fsdp, DeepSpeed ZeRO-3), each rank restoring its own pieces
straight from the source: the fp32 masters and Adam moments restored must be the source's, bit
for bit, no rank may write a temporary mpt copy, a rank must read less of a DCP directory's
files than all of them (only the chunks that overlap its pieces), and the resumed run must
follow the plain script's own curve (1e-5 relative). The same under layouts that split the
model over the ranks (2 pipeline stages; tensor parallelism over 2 ranks): each rank reads its
stage's state or its rows or columns of each layer, and no stage another's.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from common import FEATURES
from conftest import ds_env, find_free_port, run_mpt, worker

pytestmark = pytest.mark.slow
SAVE_AT, STEPS = 3, 8
JOB = worker("foreign_direct.py")
NAMES = ["0.bias", "0.weight", "2.bias", "2.weight"]
STATE = 12 * (FEATURES * 16 + 16 + 16 + 1)
"""A source's bytes of the fp32 weights and two Adam moments of every parameter."""
SPLIT = [("pp2", ("--pipeline-stages", "2")), ("tp2", ("--tensor-parallel", "2"))]
"""Layouts that split the model itself over the 2 ranks (over ddp)."""


def launch(*args: str, gpus: int = 2, flags: tuple[str, ...] = (),
           env: dict[str, str] | None = None, ok: bool = True):
    result = run_mpt("launch", "--gpus", str(gpus), "--master-port", str(find_free_port()),
                     *flags, *args, timeout=300, env={**ds_env(), **(env or {})})
    if ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def zero3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero3")
    launch(worker("foreign_deepspeed.py"), str(out), "3", str(SAVE_AT), str(STEPS))
    return out


@pytest.fixture(scope="module")
def fsdp2_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2")
    launch(worker("foreign_fsdp2.py"), str(out), str(SAVE_AT), str(STEPS))
    return out


@pytest.fixture(scope="module")
def fsdp2_expected(fsdp2_dcp: Path) -> Path:
    """The DCP source's full weights and Adam moments, as torch's own ``dcp_to_torch_save``
    reads them, in ``expected.pt``'s layout (``foreign_direct.py``)."""
    whole = fsdp2_dcp / "whole.pt"
    dcp_to_torch_save(fsdp2_dcp / "dcp", whole)
    state = torch.load(whole, weights_only=True)
    moments = state["optimizer"]["state"]
    expected = fsdp2_dcp / "expected.pt"
    torch.save({"fp32": state["model"], **{key: {name: s[key] for name, s in moments.items()}
                                          for key in ("exp_avg", "exp_avg_sq")}}, expected)
    return expected


def check_curve(out: Path, reference: list[float], backend: str, world: int) -> None:
    resumed = json.loads((out / f"mpt-{backend}-{world}.json").read_text())
    assert resumed["step"] == SAVE_AT
    assert [int(s) for s in resumed["loss"]] == list(range(SAVE_AT + 1, STEPS + 1))
    for step, loss in resumed["loss"].items():
        want = reference[int(step) - 1]
        assert abs(loss - want) <= 1e-5 * abs(want), (backend, world, step, loss, want)


BACKENDS = [("fsdp", ()), ("deepspeed", ("--zero-stage", "3"))]


@pytest.mark.parametrize(("backend", "flags"), BACKENDS, ids=[b for b, _ in BACKENDS])
def test_each_rank_restores_deepspeeds_own_state_without_a_copy(zero3, backend, flags,
                                                                tmp_path):
    launch(JOB, str(zero3 / "ds"), str(tmp_path), str(zero3 / "expected.pt"),
           flags=("--backend", backend, *flags),
           env={"PYTHONDONTWRITEBYTECODE": "1"})  # a module's .pyc is no copy
    said = json.loads((tmp_path / f"direct-{backend}-2.json").read_text())
    assert said["step"] == SAVE_AT and said["differ"] == [] and said["moments"] == NAMES
    # a temporary mpt copy of even this state writes 68 KiB; a few pages of other writes pass
    assert said["wrote"] < 32 << 10, said["wrote"]


@pytest.mark.parametrize(("backend", "flags"), BACKENDS, ids=[b for b, _ in BACKENDS])
def test_a_zero3_run_resumed_as_it_is_goes_on_on_deepspeeds_curve(zero3, backend, flags,
                                                                 tmp_path):
    launch(worker("foreign_resume.py"), str(tmp_path), str(STEPS),
           flags=("--backend", backend, *flags, "--resume", str(zero3 / "ds")))
    reference = json.loads((zero3 / "deepspeed.json").read_text())["loss"]
    check_curve(tmp_path, reference, backend, 2)


@pytest.mark.parametrize(("backend", "flags"), BACKENDS, ids=[b for b, _ in BACKENDS])
def test_each_rank_restores_an_fsdp2_dcp_state_reading_only_its_chunks(
        fsdp2_dcp, fsdp2_expected, backend, flags, tmp_path):
    launch(JOB, str(fsdp2_dcp / "dcp"), str(tmp_path), str(fsdp2_expected),
           flags=("--backend", backend, *flags), env={"PYTHONDONTWRITEBYTECODE": "1"})
    said = json.loads((tmp_path / f"direct-{backend}-2.json").read_text())
    assert said["step"] == SAVE_AT and said["differ"] == [] and said["moments"] == NAMES
    assert said["wrote"] < 32 << 10, said["wrote"]
    stored = sum(p.stat().st_size for p in (fsdp2_dcp / "dcp").glob("*.distcp"))
    # whole, each rank would read every blob: all the files' bytes; DCP's own reader reads
    # them with read(), which leaves the count at 0
    assert all(0 < read < stored for read in said["read"]), (said["read"], stored)


def test_an_fsdp2_dcp_run_resumed_as_it_is_goes_on_on_its_curve(fsdp2_dcp, tmp_path):
    launch(worker("foreign_resume.py"), str(tmp_path), str(STEPS),
           flags=("--backend", "fsdp", "--resume", str(fsdp2_dcp / "dcp")))
    reference = json.loads((fsdp2_dcp / "fsdp2.json").read_text())["loss"]
    check_curve(tmp_path, reference, "fsdp", 2)


@pytest.mark.parametrize(("layout", "flags"), SPLIT, ids=[s for s, _ in SPLIT])
def test_a_split_model_restores_deepspeeds_state_each_rank_its_part(zero3, layout, flags,
                                                                   tmp_path):
    launch(JOB, str(zero3 / "ds"), str(tmp_path), str(zero3 / "expected.pt"), flags=flags,
           env={"PYTHONDONTWRITEBYTECODE": "1"})
    said = json.loads((tmp_path / "direct-ddp-2.json").read_text())
    assert said["step"] == SAVE_AT and said["differ"] == [] and said["moments"] == NAMES
    assert said["wrote"] < 32 << 10, said["wrote"]
    # each rank reads its stage, or its rows or columns of each layer: never all of it
    assert all(0 < n < STATE for n in said["read"]), said["read"]
    if layout == "pp2":  # and no stage reads another's weights
        assert sum(said["read"]) == STATE, said["read"]


SOURCES = {"zero3": ("ds", "deepspeed.json"), "fsdp2_dcp": ("dcp", "fsdp2.json")}
"""Each source fixture's checkpoint folder and the plain script's own curve."""


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize(("layout", "flags"), SPLIT, ids=[s for s, _ in SPLIT])
def test_a_split_model_resumed_as_it_is_goes_on_on_the_sources_curve(source, layout, flags,
                                                                     request, tmp_path):
    folder, curve = SOURCES[source]
    made = request.getfixturevalue(source)
    launch(worker("foreign_resume.py"), str(tmp_path), str(STEPS),
           flags=(*flags, "--resume", str(made / folder)))
    check_curve(tmp_path, json.loads((made / curve).read_text())["loss"], "ddp", 2)


def test_a_truncated_rank_file_is_refused_in_one_line(zero3, tmp_path):
    source = tmp_path / "ds"
    shutil.copytree(zero3 / "ds", source)
    victim = next((source / "global_step3").glob("*zero_pp_rank_1_*optim_states.pt"))
    os.truncate(victim, victim.stat().st_size // 2)
    result = launch(JOB, str(source), str(tmp_path), flags=("--backend", "fsdp"), ok=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert victim.name in result.stderr
    assert not (tmp_path / "direct-fsdp-2.json").exists()
