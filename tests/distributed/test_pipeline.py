"""Pipeline stages over real gloo ranks train exactly as one process on the same global batch.

workers/pipeline_train.py trains a 7-module nn.Sequential through rt.forward_backward; each job
is compared with the same loop in plain torch, in this process: losses, clipped gradient norms,
evaluation losses and the final weights. A checkpoint moves between pipelines and backends.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import find_free_port, run_mpt, worker
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from pipeline_train import GLOBAL_BATCH, TEACHER_SEED, make_data, make_model

STEPS = 4


def reference(steps: int = STEPS, clip: float | None = None, teacher: bool = False) -> dict:
    """The loop in plain torch, one process, the whole global batch per step (``teacher``:
    towards a frozen model's outputs); at the end, its outputs for the first batch."""
    model = make_model()
    frozen = make_model(seed=TEACHER_SEED) if teacher else None
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    data = make_data(steps)
    losses, norms, evals = {}, [], []
    for step in range(steps):
        x, y = (t[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH] for t in data.tensors)
        if frozen is not None:
            with torch.no_grad():
                y = frozen(x)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses[str(step + 1)] = loss.item()
        with torch.no_grad():
            evals.append(nn.functional.mse_loss(model(x), y).item())
    with torch.no_grad():
        outputs = model(data.tensors[0][:GLOBAL_BATCH]).flatten().tolist()
    return {"losses": losses, "norms": norms, "evals": evals, "outputs": outputs,
            "weights": {k: v.flatten().tolist() for k, v in model.state_dict().items()}}


def launch(out: Path, gpus: int, *flags: str, script_args: tuple[str, ...] = ()) -> dict:
    result = run_mpt("launch", "--gpus", str(gpus), "--master-port", str(find_free_port()),
                     *flags, worker("pipeline_train.py"), str(out), *script_args, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def assert_close(got: dict, want: dict, rel: float) -> None:
    for key in ("losses", "norms", "evals"):
        assert got[key] == pytest.approx(want[key], rel=rel), key
    # evaluated without a loss on one replica's batch: the first rows (one output each)
    assert got["outputs"] == pytest.approx(want["outputs"][:len(got["outputs"])], rel=rel,
                                           abs=rel)
    assert got["weights"].keys() == want["weights"].keys()
    for name, values in want["weights"].items():
        assert got["weights"][name] == pytest.approx(values, rel=rel, abs=rel), name


CASES = [pytest.param(2, "1f1b", (), id="P2xD1-1f1b", marks=pytest.mark.slow),
         pytest.param(4, "gpipe", (), id="P2xD2-gpipe"),
         pytest.param(2, "gpipe", (), id="P2xD1-gpipe", marks=pytest.mark.slow),
         pytest.param(4, "1f1b", (), id="P2xD2-1f1b", marks=pytest.mark.slow),
         pytest.param(2, "interleaved-1f1b", (), id="P2xD1-interleaved",
                      marks=pytest.mark.slow),
         pytest.param(4, "interleaved-1f1b", ("--microbatches", "2"), id="P2xD2-interleaved-M2",
                      marks=pytest.mark.slow),
         pytest.param(2, "interleaved-zb", (), id="P2xD1-interleaved-zb",
                      marks=pytest.mark.slow),
         pytest.param(4, "interleaved-zb", (), id="P2xD2-interleaved-zb",
                      marks=pytest.mark.slow),
         pytest.param(2, "1f1b", ("--accumulate", "2"), id="P2xD1-1f1b-accumulate2",
                      marks=pytest.mark.slow),
         pytest.param(2, "1f1b", ("--pipeline-split", "4"), id="P2xD1-split-by-name",
                      marks=pytest.mark.slow),
         # fsdp as the data dimension: each stage sharded over its replicas
         pytest.param(2, "gpipe", ("--backend", "fsdp"), id="fsdp-P2xD1-gpipe",
                      marks=pytest.mark.slow),
         pytest.param(4, "interleaved-1f1b", ("--backend", "fsdp", "--microbatches", "2"),
                      id="fsdp-P2xD2-interleaved-M2", marks=pytest.mark.slow),
         pytest.param(4, "interleaved-zb", ("--backend", "fsdp"), id="fsdp-P2xD2-interleaved-zb",
                      marks=pytest.mark.slow),
         pytest.param(4, "1f1b", ("--backend", "fsdp", "--accumulate", "2", "--microbatches",
                                  "2"), id="fsdp-P2xD2-1f1b-accumulate2",
                      marks=pytest.mark.slow),
         # resharded and reduce-scattered after every micro-batch's backward
         pytest.param(4, "1f1b", ("--backend", "fsdp", "--fsdp-reshard-after-forward", "yes",
                                  "--accumulate", "2", "--microbatches", "2"),
                      id="fsdp-P2xD2-1f1b-resharded", marks=pytest.mark.slow),
         pytest.param(4, "interleaved-1f1b", ("--backend", "fsdp", "--fsdp-reshard-after-forward",
                                              "yes", "--microbatches", "2"),
                      id="fsdp-P2xD2-interleaved-resharded", marks=pytest.mark.slow),
         # the shards, their gradients and the step in host memory (`mpt plan` ranks it)
         pytest.param(4, "1f1b", ("--backend", "fsdp", "--fsdp-cpu-offload",
                                  "--microbatches", "2"),
                      id="fsdp-P2xD2-1f1b-cpu-offload", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("gpus", "schedule", "flags"), CASES)
def test_a_pipeline_trains_as_one_process_on_the_global_batch(tmp_path, gpus, schedule, flags):
    got = launch(tmp_path / "out.json", gpus, "--pipeline-stages", "2", "--pipeline-schedule",
                 schedule, *flags, script_args=("--clip", "0.5"))
    assert_close(got, reference(clip=0.5), rel=1e-5)


def test_fsdp_shards_each_stage_over_its_replicas(tmp_path):
    """P = 2 x D = 2 under --backend fsdp: each rank holds half its stage's parameters (one
    more where a tensor's rows do not halve), and the job trains as one process does."""
    got = launch(tmp_path / "out.json", 4, "--backend", "fsdp", "--pipeline-stages", "2",
                 "--pipeline-schedule", "1f1b", script_args=("--clip", "0.5"))
    assert_close(got, reference(clip=0.5), rel=1e-5)
    for stage in (got["sizes"][:2], got["sizes"][2:]):  # rank = stage x 2 + replica
        assert stage[0]["stage"] == stage[1]["stage"], got["sizes"]
        assert sum(rank["held"] for rank in stage) == stage[0]["stage"], got["sizes"]
        assert max(rank["held"] for rank in stage) < stage[0]["stage"], got["sizes"]


@pytest.mark.slow
def test_hsdp_under_a_pipeline_shards_each_stage_within_its_replicas(tmp_path):
    """P = 2 x HSDP 2 x 2 (8 processes): each stage is held by 2 replicas of 2 shards, and
    the job trains as one process does."""
    got = launch(tmp_path / "out.json", 8, "--backend", "fsdp", "--pipeline-stages", "2",
                 "--fsdp-replicate", "2", "--microbatches", "2", script_args=("--clip", "0.5"))
    assert_close(got, reference(clip=0.5), rel=1e-5)
    for replica in (got["sizes"][0:2], got["sizes"][2:4], got["sizes"][4:6], got["sizes"][6:]):
        assert sum(rank["held"] for rank in replica) == replica[0]["stage"], got["sizes"]


@pytest.mark.parametrize("backend", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_a_frozen_model_beside_the_pipeline_is_whole_on_every_rank(tmp_path, backend):
    """A teacher set up without an optimizer is placed whole on every rank (not cut), and
    rt.evaluate(x, model=teacher) runs it there: the student, cut over 2 stages x 2 replicas,
    trains on its outputs as one process does (1e-5)."""
    got = launch(tmp_path / "out.json", 4, "--backend", backend, "--pipeline-stages", "2",
                 script_args=("--clip", "0.5", "--teacher"))
    assert_close(got, reference(clip=0.5, teacher=True), rel=1e-5)


PREAMBLE = "import torch\nimport mpt\nrt = mpt.Runtime()\nnn = torch.nn\n"


def refusal(tmp_path: Path, body: str) -> str:
    """stderr of a 2-stage job running ``body`` after a Runtime is made; it must exit 2."""
    script = tmp_path / "script.py"
    script.write_text(PREAMBLE + body)
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(find_free_port()),
                     "--pipeline-stages", "2", str(script), timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    return result.stderr


def test_a_second_trained_model_under_a_pipeline_is_refused_in_one_line(tmp_path):
    stderr = refusal(tmp_path, (
        "g, d = (nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)) for _ in range(2))\n"
        "g, g_opt = rt.setup(g, torch.optim.SGD(g.parameters(), lr=0.1))\n"
        "d, d_opt = rt.setup(d, torch.optim.SGD(d.parameters(), lr=0.1))\n"))
    assert "a pipeline cuts one model with its optimizer over the ranks, and one is set up " \
        "already" in stderr


def test_a_batch_of_another_shape_is_refused_in_one_line_not_a_gloo_abort(tmp_path):
    """torch's stages send the shapes of their first call: an evaluation on a batch of
    another size would break the peer's receive (gloo aborts the process)."""
    stderr = refusal(tmp_path, (
        "m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))\n"
        "m, opt = rt.setup(m, torch.optim.SGD(m.parameters(), lr=0.1))\n"
        "rt.forward_backward(torch.ones(4, 2), torch.ones(4, 1), nn.functional.mse_loss)\n"
        "rt.step()\n"
        "rt.evaluate(torch.ones(8, 2))\n"))
    assert "inputs=a batch of shape (8, 2) is invalid" in stderr
    assert "SIGABRT" not in stderr


def test_training_a_frozen_model_beside_the_pipeline_is_refused_in_one_line(tmp_path):
    stderr = refusal(tmp_path, (
        "m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))\n"
        "m, opt = rt.setup(m, torch.optim.SGD(m.parameters(), lr=0.1))\n"
        "teacher = rt.setup(nn.Linear(2, 1))\n"
        "rt.forward_backward(torch.ones(4, 2), torch.ones(4, 1), nn.functional.mse_loss,\n"
        "                    model=teacher)\n"))
    assert "it was set up without an optimizer, whole on every rank" in stderr


def test_a_meta_model_materialises_only_each_ranks_stage(tmp_path):
    """Built on the meta device, each rank gives real weights to its own stage only (the other
    stages' modules go back to meta once they drew their numbers), and they are the weights
    the CPU build draws: the job trains as one process does (1e-5)."""
    got = launch(tmp_path / "out.json", 2, "--pipeline-stages", "2",
                 script_args=("--clip", "0.5", "--meta"))
    assert_close(got, reference(clip=0.5), rel=1e-5)
    for size in got["sizes"]:
        assert size["materialised"] == size["stage"] < size["model"], got["sizes"]
    assert sum(size["stage"] for size in got["sizes"]) == got["sizes"][0]["model"]


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "rel", "flags"), [
    ("bf16-mixed", 5e-2, ()), ("fp16-mixed", 5e-3, ()), ("O1", 5e-3, ()),
    ("bf16-mixed", 5e-2, ("--backend", "fsdp")), ("fp16-mixed", 5e-3, ("--backend", "fsdp"))])
def test_mixed_precision_pipelines_train_within_the_conformance_tolerance(tmp_path, precision,
                                                                          rel, flags):
    got = launch(tmp_path / "out.json", 2, "--pipeline-stages", "2", "--precision", precision,
                 *flags)
    want = reference()
    assert got["losses"] == pytest.approx(want["losses"], rel=rel)
    if precision != "bf16-mixed":
        assert got["scale"] == 65536.0  # one verdict for both stages: no step was skipped


@pytest.mark.slow
def test_an_overflow_on_any_replica_skips_the_step_alike_under_ddp_and_fsdp(tmp_path):
    """fp16 at P = 2 x D = 2: micro-batches of one sample overflow the first step at the
    initial scale. Every rank skips it and halves its scale, whether the stage's replicas are
    whole (ddp) or shards (fsdp, where each rank sees only its shard's gradients)."""
    runs = {backend: launch(tmp_path / f"{backend}.json", 4, "--backend", backend,
                            "--pipeline-stages", "2", "--precision", "fp16-mixed")
            for backend in ("ddp", "fsdp")}
    assert runs["ddp"]["scale"] == runs["fsdp"]["scale"] == 32768.0  # one skip, one halving
    assert len(runs["fsdp"]["losses"]) == STEPS - 1
    assert runs["fsdp"]["losses"] == pytest.approx(runs["ddp"]["losses"], rel=1e-5)
    for name, values in runs["ddp"]["weights"].items():
        assert runs["fsdp"]["weights"][name] == pytest.approx(values, rel=1e-5, abs=1e-6), name


P2 = (2, ("--pipeline-stages", "2"))
CHAIN = [pytest.param(P2, ("ddp", 1, ()), id="P2xD1-to-ddp-P1"),
         *(pytest.param(P2, to, id=f"P2xD1-to-{to[0]}-{to[1]}", marks=pytest.mark.slow)
           for to in (("ddp", 4, ("--pipeline-stages", "2")), ("fsdp", 2, ()),
                      ("deepspeed", 2, ("--zero-stage", "2")),
                      ("fsdp", 4, ("--pipeline-stages", "2")))),
         pytest.param((1, ()), ("ddp", 2, ("--pipeline-stages", "2")), id="P1-to-P2xD1",
                      marks=pytest.mark.slow),
         pytest.param((4, ("--backend", "fsdp", "--pipeline-stages", "2")), ("ddp", 1, ()),
                      id="fsdp-P2xD2-to-ddp-P1", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("source", "target"), CHAIN)
def test_a_pipeline_checkpoint_resumes_on_the_uninterrupted_curve(tmp_path, source, target):
    steps = ("--steps", "6")
    gpus, flags = source
    whole = launch(tmp_path / "whole.json", gpus, *flags,
                   script_args=(*steps, "--save-at", "3", "--ckpt", str(tmp_path / "ckpt")))
    backend, gpus, flags = target
    resumed = launch(tmp_path / "resumed.json", gpus, "--backend", backend, *flags,
                     script_args=(*steps, "--resume", str(tmp_path / "ckpt")))
    assert sorted(resumed["losses"], key=int) == ["4", "5", "6"]
    assert [resumed["losses"][s] for s in "456"] == pytest.approx(
        [whole["losses"][s] for s in "456"], rel=1e-6)
    for name, values in whole["weights"].items():
        assert resumed["weights"][name] == pytest.approx(values, rel=1e-6, abs=1e-7), name


@pytest.mark.parametrize(("flags", "words"), [
    (("--gpus", "3", "--pipeline-stages", "2"), "--pipeline-stages=2 is invalid"),
    (("--gpus", "2", "--pipeline-stages", "2", "--microbatches", "1"),
     "--microbatches=1 is invalid"),
    (("--gpus", "2", "--pipeline-stages", "2", "--pipeline-schedule", "zb"),
     "--pipeline-schedule=zb is invalid"),
    (("--gpus", "2", "--pipeline-stages", "2", "--backend", "deepspeed"),
     "--backend deepspeed cannot cut a model into pipeline stages"),
    (("--gpus", "2", "--pipeline-stages", "2", "--grad-compression", "powersgd"),
     "--grad-compression=powersgd is invalid"),
    (("--gpus", "2", "--pipeline-stages", "2", "--precision", "O2"),
     "--precision=O2 is invalid"),
    (("--gpus", "2", "--pipeline-stages", "2", "--backend", "fsdp", "--pipeline-schedule",
      "interleaved-zb", "--fsdp-reshard-after-forward", "yes"),
     "--fsdp-reshard-after-forward=yes is invalid")])
def test_bad_pipeline_flags_are_refused_before_any_process_starts(tmp_path, flags, words):
    result = run_mpt("launch", *flags, worker("pipeline_train.py"), str(tmp_path / "out.json"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr
    assert not (tmp_path / "out.json").exists()


def test_a_model_that_cannot_be_split_names_the_blocks_that_exist(tmp_path):
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(find_free_port()),
                     "--pipeline-stages", "2", "--pipeline-split", "9",
                     worker("pipeline_train.py"), str(tmp_path / "out.json"), timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--pipeline-split=9 is invalid" in result.stderr
    assert "name blocks among: 1, 2, 3, 4, 5, 6" in result.stderr


def test_dry_run_and_estimate_memory_show_each_stage(tmp_path):
    plan = run_mpt("launch", "--dry-run", "--gpus", "4", "--pipeline-stages", "2",
                   worker("pipeline_train.py"), str(tmp_path / "out.json"))
    assert plan.returncode == 0, plan.stderr
    rows = [line.split("│")[1:-2] for line in plan.stdout.splitlines() if line.startswith("│")]
    assert [[cell.strip() for cell in row[-2:]] for row in rows] == [
        ["0", "0"], ["0", "1"], ["1", "0"], ["1", "1"]]  # rank = stage x replicas + replica
    assert "pipeline: 2 stages x 2 data-parallel replica(s), 1f1b, 4 micro-batches" in plan.stdout
    estimate = run_mpt("estimate-memory", f"{worker('pipeline_train.py')}:make_model",
                       "--pipeline-stages", "2")
    assert estimate.returncode == 0, estimate.stderr
    assert "per-stage memory, 2 pipeline stages" in estimate.stdout
    # Balanced by parameter count: 112 + 272 parameters, then 272 + 17.
    assert re.search(r"│\s+0 │ 0 \.\. 3 \(4\) │\s+384 │", estimate.stdout), estimate.stdout
    assert re.search(r"│\s+1 │ 4 \.\. 6 \(3\) │\s+289 │", estimate.stdout), estimate.stdout
