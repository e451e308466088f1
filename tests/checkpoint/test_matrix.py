"""Save under one backend, load under another: every backend as saver and as loader, at world
sizes 1 and 2, on real gloo jobs (14 `mpt launch` jobs of workers/ckpt_resume.py, ~150 s on 2
cores; `make test` checks the 4 links of FAST, 6 jobs, ~80 s).

A full save-under-A, load-under-B matrix would take ~40 jobs; two chains cover every backend on
both sides instead. Each link loads the previous link's checkpoint, continues to the end and
saves mid-epoch for the next; every link must land on the uninterrupted run's curve.

fp32, against ddp(2) trained 15 steps without a stop:
    ddp(2) @8 -> ZeRO-1(1) @9 -> ZeRO-3(2) @10 -> fsdp(1) @11 -> fsdp(2) @12 -> horovod(1) @13
    -> ZeRO-2(2) @14 -> apex(2); and ZeRO-3(2) @10 -> ddp(1), fsdp(2) @12 -> ZeRO-3(2),
    fsdp(1) @11 -> HSDP 2 x 2 (4) @12 -> ddp(2).
fsdp's saves hold each rank's pieces (the sharded variant, by default for a backend that
shards), so fsdp(2) reads the pieces fsdp(1) wrote, resharded, and horovod and ZeRO-3 read
fsdp(2)'s.
Apex O2 (fp16 model, fp32 masters kept as the checkpoint's weights, dynamic loss scale), against
apex(2) O2 trained 15 steps without a stop:
    apex O2(2) @8 -> fsdp O2(2) @10 -> ddp O2(1) @11 -> horovod O2(2)
fsdp's fp32 shards are its O2 masters, which it gathers cast to fp16.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import ds_env
from test_resume import STEPS, _global_samples, _launch

MISSING = [name for name in ("deepspeed", "horovod") if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"needs {' and '.join(MISSING)} "
                                "(`make` installs both into .venv)")

# link -> (backend, world size, launch options, the link it loads, step it saves at)
FP32 = {
    "ddp": ("ddp", 2, (), None, 8),
    "zero1": ("deepspeed", 1, ("--zero-stage", "1"), "ddp", 9),
    "zero3": ("deepspeed", 2, ("--zero-stage", "3"), "zero1", 10),
    "fsdp1": ("fsdp", 1, (), "zero3", 11),
    "ddp1": ("ddp", 1, (), "zero3", 0),
    "fsdp2": ("fsdp", 2, (), "fsdp1", 12),
    "zero3-back": ("deepspeed", 2, ("--zero-stage", "3"), "fsdp2", 0),
    "horovod": ("horovod", 1, (), "fsdp2", 13),
    "zero2": ("deepspeed", 2, ("--zero-stage", "2"), "horovod", 14),
    "apex": ("apex", 2, (), "zero2", 0),
    "hsdp": ("fsdp", 4, ("--fsdp-replicate", "2"), "fsdp1", 12),
    "ddp-hsdp": ("ddp", 2, (), "hsdp", 0),
}
O2 = ("--precision", "O2")
FP16 = {
    "apex-o2": ("apex", 2, O2, None, 8),
    "fsdp-o2": ("fsdp", 2, O2, "apex-o2", 10),
    "ddp-o2": ("ddp", 1, O2, "fsdp-o2", 11),
    "horovod-o2": ("horovod", 2, O2, "ddp-o2", 0),
}
LINKS = {**FP32, **FP16}
FAST = ("zero1", "zero3", "fsdp1", "fsdp-o2", "hsdp")
"""The links `make test` checks (7 jobs with their sources: ZeRO-3's pieces read by fsdp, Apex
O2's masters read by fsdp); `make conformance` runs every link (marked slow).
tests/checkpoint/test_pieces.py reads ZeRO-3's pieces whole, as ddp does, in `make test` too."""


def _params(links: list[str]) -> list:
    return [link if link in FAST else pytest.param(link, marks=pytest.mark.slow)
            for link in links]


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, list[dict]]:
    """Every job the selected tests need: their links, and the links those load from."""
    wanted = {item.callspec.params["link"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}
    for link in list(wanted):
        while link is not None:
            wanted.add(link)
            link = LINKS[link][3]
    out = tmp_path_factory.mktemp("matrix")
    for link, (backend, ranks, options, source, save_at) in LINKS.items():
        if link not in wanted:
            continue
        checkpoints = [] if source is None else [out / f"ckpt-{source}" / "full"]
        _launch(ranks, out, link, save_at, *checkpoints, backend=backend, options=options,
                full_only=True, env=ds_env())
    found: dict[str, list[dict]] = {}
    for link, (*_, source, _save_at) in LINKS.items():
        if link not in wanted:
            continue
        run = link if source is None else f"{link}-0"
        found[link] = [json.loads(p.read_text()) for p in sorted(out.glob(f"{run}-rank*.json"))]
    return found


def _original(link: str) -> str:
    return "ddp" if link in FP32 else "apex-o2"


def _saved_at(link: str) -> int:
    return LINKS[LINKS[link][3]][4]  # the step its source saved at


RESUMED = [link for link, spec in LINKS.items() if spec[3] is not None]


@pytest.mark.parametrize("link", _params(RESUMED))
def test_the_link_ran_where_it_should_and_resumed_at_the_saved_step(runs, link):
    backend, ranks, options, _source, _save_at = LINKS[link]
    ranks_logs = runs[link]
    assert len(ranks_logs) == ranks
    first = ranks_logs[0]
    assert (first["backend"], first["world_size"]) == (backend, ranks)
    assert first["precision"] == ("O2" if options == O2 else "fp32")
    saved_at = _saved_at(link)
    assert first["info"]["step"] == saved_at and first["info"]["note"] == "mid-epoch"
    assert sorted(map(int, first["loss"])) == list(range(saved_at + 1, STEPS + 1))
    # StepLR(step_size=4, gamma=0.5) from lr 0.01, as many steps in as the save
    assert first["lr"] == [pytest.approx(0.01 * 0.5 ** (saved_at // 4))]


@pytest.mark.parametrize("link", _params([link for link in RESUMED if link in FP32]))
def test_fp32_continues_the_uninterrupted_loss_curve_within_1e_6(runs, link):
    original, resumed = runs["ddp"][0], runs[link][0]
    for step, loss in resumed["loss"].items():
        assert loss == pytest.approx(original["loss"][step], abs=1e-6), step
    for got, want in zip(resumed["params"], original["params"], strict=True):
        assert got == pytest.approx(want, abs=1e-6)
    # ... and the curve is not flat: a lost Adam state or a wrong lr would show
    assert len({round(v, 4) for v in original["loss"].values()}) == STEPS


@pytest.mark.parametrize("link", _params([link for link in RESUMED if link in FP16]))
def test_apex_o2_keeps_its_loss_scale_and_masters_across_backends(runs, link):
    """Tolerance 1e-3: the fp16 model computes every activation and gradient in fp16 (11-bit
    mantissa, 4.9e-4 relative per rounding). A 1-rank link computes each step's gradient on 8
    samples, a 2-rank job on 4 per rank and averages the halves in fp16: the same maths,
    rounded differently, and the fp16 weights copied from the masters differ by an fp16 step
    (up to ~2.4e-4 at |w| < 0.5). Measured: 1.0e-7 relative in the loss, 1.5e-5 in weights."""
    original, resumed = runs["apex-o2"][0], runs[link][0]
    # the scale starts at 1024 and doubles every 3 clean steps: a lost scale or growth
    # tracker doubles it at other steps
    assert {k: resumed["scale"][k] for k in resumed["loss"]} == {
        k: original["scale"][k] for k in resumed["loss"]}
    assert len(set(original["scale"].values())) >= 5
    for step, loss in resumed["loss"].items():
        assert loss == pytest.approx(original["loss"][step], rel=1e-3), step
    for got, want in zip(resumed["params"], original["params"], strict=True):
        assert got == pytest.approx(want, abs=1e-3)
    # the fp32 masters (not the fp16 weights re-widened) came back bit for bit
    saver = runs[LINKS[link][3]][0]
    assert resumed["loaded_masters"] == saver["saved_masters"] and saver["saved_masters"]
    widened = [torch.tensor(m).half().float().tolist() for m in saver["saved_masters"]]
    assert widened != saver["saved_masters"]  # they hold more than fp16's bits


@pytest.mark.parametrize("link", _params(RESUMED))
def test_each_step_after_the_load_sees_the_original_runs_samples(runs, link):
    original = runs[_original(link)]
    for step in range(_saved_at(link) + 1, STEPS + 1):
        assert _global_samples(runs[link], step) == _global_samples(original, step), step


@pytest.mark.parametrize("link", _params(RESUMED))
def test_each_rank_draws_what_its_saving_rank_would_have_drawn(runs, link):
    saver = runs[LINKS[link][3]]
    for rank, resumed in enumerate(runs[link]):
        if rank < len(saver):
            assert resumed["loaded_draws"] == saver[rank]["saved_draws"]
        else:  # 1 -> 2 ranks: rank 1 keeps its own stream
            assert resumed["loaded_draws"] != saver[0]["saved_draws"]
