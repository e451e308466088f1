"""`mpt plan` as a command: the table, --json, and bad input in one line with exit code 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mpt import cli

MODELS = Path(__file__).parent / "plan_models.py"


def _run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["mpt", "plan", *args])
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    found = capsys.readouterr()
    return exit_.value.code, found.out, found.err


def test_json_ranks_layouts_and_gives_the_launch_line(monkeypatch, capsys) -> None:
    code, out, _ = _run(monkeypatch, capsys, f"{MODELS}:mlp", "--nodes", "2", "--gpus", "2",
                        "--link", "10gbit", "--json")
    assert code == 0
    found = json.loads(out)
    steps = [entry["step_s"] for entry in found["fitting"]]
    assert steps == sorted(steps) and len(steps) > 5
    assert found["best"].startswith("mpt launch --nodes 2 --gpus 2 --nr 0 --backend ")
    assert "datasheet" in found["cluster"]["source"]
    assert all(entry["limiter"] for entry in found["fitting"])


def test_table_for_people(monkeypatch, capsys) -> None:
    code, out, _ = _run(monkeypatch, capsys, f"{MODELS}:mlp", "--gpus", "2")
    assert code == 0
    assert "limited by" in out and "best: mpt launch" in out


@pytest.mark.parametrize(("args", "words"), [
    ((f"{MODELS}:not_a_module",), "did not return an nn.Module"),
    ((f"{MODELS}:mlp", "--device", "b300"), "use one of h100-sxm"),
    ((f"{MODELS}:mlp", "--link", "fast"), "use one of nvlink4"),
    ((f"{MODELS}:huge", "--device", "a100-sxm-40gb"), "GiB short"),
])
def test_bad_input_is_one_line_and_exit_2(monkeypatch, capsys, args, words) -> None:
    code, _, err = _run(monkeypatch, capsys, *args)
    assert code == 2
    assert words in err and err.count("\n") == 1


def test_calibration_from_another_machine_is_refused(monkeypatch, capsys, tmp_path) -> None:
    from mpt.plan import calibrate

    foreign = tmp_path / "cal.json"
    found = calibrate.Calibration(
        identity={**calibrate.identity(), "host": "elsewhere"}, ranks=2, backend="gloo",
        flops={"float32": 1e11}, memory_bandwidth=1e10, op_overhead=1e-6, memory=1e10,
        collectives={"all_reduce": {"latency": 1e-4, "bus_bandwidth": 1e9}},
        matmul_sweep={}, update_seconds={})
    calibrate.save(found, foreign)
    code, _, err = _run(monkeypatch, capsys, f"{MODELS}:mlp", "--calibration", str(foreign))
    assert code == 2
    assert "'elsewhere'" in err and "--calibrate" in err


def test_calibration_of_an_older_format_is_refused(monkeypatch, capsys, tmp_path) -> None:
    """A version-1 file has no matmul sweep and no optimizer steps: one line says to measure
    again."""
    from mpt.plan import calibrate

    old = tmp_path / "old.json"
    old.write_text(json.dumps({
        "format": "mpt-plan-calibration/1", "identity": calibrate.identity(), "ranks": 2,
        "backend": "gloo", "flops": {"float32": 1e11}, "memory_bandwidth": 1e10,
        "op_overhead": 1e-6, "memory": 1e10,
        "collectives": {"all_reduce": {"latency": 1e-4, "bus_bandwidth": 1e9}}}))
    code, _, err = _run(monkeypatch, capsys, f"{MODELS}:mlp", "--calibration", str(old))
    assert code == 2 and err.count("\n") == 1
    assert "mpt-plan-calibration/1" in err and f"mpt plan --calibrate --output {old}" in err
