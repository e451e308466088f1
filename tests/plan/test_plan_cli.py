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
    assert "powersgd is priced once it has started" in " ".join(out.split())
    code, alone, _ = _run(monkeypatch, capsys, f"{MODELS}:mlp", "--gpus", "1")
    assert code == 0 and "powersgd" not in alone  # one replica: nothing to compress


def test_the_table_shows_the_top_layouts_and_says_how_many_it_leaves_out(monkeypatch,
                                                                         capsys) -> None:
    """Every schedule and M multiplies a pipeline's rows: the table keeps the --top fastest,
    written short (P=2 interleaved-zb M=4), and --json keeps every one."""
    code, out, _ = _run(monkeypatch, capsys, f"{MODELS}:mlp", "--gpus", "2", "--top", "3")
    assert code == 0
    code, every, _ = _run(monkeypatch, capsys, f"{MODELS}:mlp", "--gpus", "2", "--json")
    count = len(json.loads(every)["fitting"])
    assert f"the 3 fastest of {count} layouts" in out and count > 40
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 3
    code, whole, _ = _run(monkeypatch, capsys, f"{MODELS}:mlp", "--gpus", "2", "--top", "0")
    assert "P=2 interleaved-zb M=4" in whole and "fastest of" not in whole


@pytest.mark.parametrize(("args", "words"), [
    ((f"{MODELS}:not_a_module",), "did not return an nn.Module"),
    ((f"{MODELS}:mlp", "--device", "b300"), "use one of h100-sxm"),
    ((f"{MODELS}:mlp", "--link", "fast"), "use one of nvlink4"),
    ((f"{MODELS}:huge", "--device", "a100-sxm-40gb"), "GiB short"),
    # a calibration that times the model's step checks the model and batch before it starts
    ((f"{MODELS}:not_a_module", "--calibrate"), "did not return an nn.Module"),
    ((f"{MODELS}:mlp", "--calibrate", "--gpus", "2", "--batch", "3"),
     "does not split over 2 rank(s)"),
    ((f"{MODELS}:mlp", "--input-shape", "5"), "refuses a sample of that shape"),
    ((f"{MODELS}:mlp", "--calibrate", "--input-shape", "5"), "refuses a sample of that shape"),
    ((f"{MODELS}:mlp", "--top", "-1"), "cannot be negative"),
])
def test_bad_input_is_one_line_and_exit_2(monkeypatch, capsys, args, words) -> None:
    code, _, err = _run(monkeypatch, capsys, *args)
    assert code == 2
    assert words in err and err.count("\n") == 1


def test_a_model_that_starts_without_weights_and_has_batch_norm_plans(monkeypatch,
                                                                       capsys) -> None:
    """The input check runs two samples (batch norm refuses one); the profile of a first
    block without weights (a Flatten) records no backward instead of failing."""
    code, out, err = _run(monkeypatch, capsys, f"{MODELS}:normed", "--input-shape", "3,2,2",
                          "--json")
    assert code == 0, err
    assert json.loads(out)["fitting"]


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


def _calibration(tmp_path: Path, **fields) -> Path:
    from mpt.plan import calibrate

    fit = {"latency": 1e-4, "bus_bandwidth": 1e9}
    path = tmp_path / "cal.json"
    calibrate.save(calibrate.Calibration(
        identity=calibrate.identity(), ranks=1, backend="gloo", flops={"float32": 1e11},
        memory_bandwidth=1e10, op_overhead=1e-6, memory=1e10,
        collectives={"all_reduce": fit}, matmul_sweep={}, update_seconds={}, **fields), path)
    return path


def test_a_calibration_with_a_term_no_longer_priced_still_loads(monkeypatch, capsys,
                                                                 tmp_path) -> None:
    """Files measured before the calibration ran under --host-memory steady carry
    fresh_bandwidth: the plan skips it and prices as for a file without it."""
    path = _calibration(tmp_path)
    code, plain, _ = _run(monkeypatch, capsys, f"{MODELS}:mlp", "--calibration", str(path),
                          "--json")
    path.write_text(json.dumps({**json.loads(path.read_text()), "fresh_bandwidth": 2e9}))
    code_old, old, _ = _run(monkeypatch, capsys, f"{MODELS}:mlp", "--calibration", str(path),
                            "--json")
    assert code == code_old == 0 and old == plain


def test_a_cpu_hosts_launch_line_keeps_glibcs_heap_as_it_was_priced(monkeypatch, capsys,
                                                                     tmp_path) -> None:
    """A calibrated CPU's plan prices steps that fault no memory in again, as its calibration
    ran them: its launch line carries --host-memory steady, and the plan says the resident set
    under it exceeds the memory counted; a GPU's does neither."""
    code, out, _ = _run(monkeypatch, capsys, f"{MODELS}:mlp", "--calibration",
                        str(_calibration(tmp_path)), "--json")
    found = json.loads(out)
    assert code == 0 and found["best"].endswith(f"--host-memory steady {MODELS}")
    assert "resident set under --host-memory steady" in found["cluster"]["source"]
    assert "launch with --host-memory lean" in found["cluster"]["source"]
    code, out, _ = _run(monkeypatch, capsys, f"{MODELS}:mlp", "--gpus", "2", "--json")
    found = json.loads(out)
    assert code == 0 and "--host-memory" not in found["best"]
    assert "--host-memory" not in found["cluster"]["source"]


def test_a_link_measured_across_nodes_prices_the_plan_unless_link_is_given(
        monkeypatch, capsys, tmp_path) -> None:
    from mpt.plan import calibrate

    slow = {name: {"latency": 1e-3, "bus_bandwidth": 1e8}
            for name in ("all_reduce", "all_gather", "reduce_scatter")}
    path = _calibration(tmp_path, nodes=2, hosts=[calibrate.identity()["host"], "node1"],
                        link=slow)
    args = (f"{MODELS}:mlp", "--nodes", "2", "--calibration", str(path), "--json")
    code, out, _ = _run(monkeypatch, capsys, *args)
    measured = json.loads(out)
    assert code == 0 and measured["cluster"]["link"] == "measured across 2 nodes (gloo)"
    code, out, _ = _run(monkeypatch, capsys, *args, "--link", "100gbit")
    given = json.loads(out)
    assert code == 0 and "measured" not in given["cluster"]["link"]
    # 0.1 GB/s against 100 Gbit/s: the same layout's step is slower on the measured link
    assert measured["fitting"][0]["step_s"] > given["fitting"][0]["step_s"]


def test_a_calibration_of_several_nodes_serves_each_of_them(monkeypatch, capsys,
                                                            tmp_path) -> None:
    from mpt.plan import calibrate

    here = calibrate.identity()["host"]
    path = tmp_path / "cal.json"
    _calibration(tmp_path, nodes=2, hosts=["node0", here]).replace(path)
    found = json.loads(path.read_text())
    found["identity"]["host"] = "node0"  # node 0 wrote it; this machine was node 1
    path.write_text(json.dumps(found))
    code, _, err = _run(monkeypatch, capsys, f"{MODELS}:mlp", "--calibration", str(path))
    assert code == 0, err


@pytest.mark.slow
def test_calibrate_across_two_nodes_measures_the_link_between_them(tmp_path, free_port) -> None:
    """Two `mpt plan MODEL --calibrate --nodes 2` on this host, as on two nodes: node 0 writes
    the file, with the sweep across the nodes and the model's step at the batch over the
    ranks; node 1 writes nothing."""
    import subprocess

    from mpt.plan import calibrate

    outputs = [tmp_path / f"node{nr}.json" for nr in range(2)]
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "mpt", "plan", f"{MODELS}:small", "--calibrate", "--nodes", "2",
         "--nr", str(nr), "--master-port", str(free_port), "--output", str(outputs[nr]),
         "--batch", "4", "--optimizer", "adamw"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for nr in range(2)]
    said = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], said
    assert not outputs[1].exists() and "across 2 nodes: allreduce bus bandwidth" in said[0]
    found = calibrate.load(outputs[0])
    assert found.nodes == 2 and found.ranks == 1 and found.hosts == [found.identity["host"]]
    assert {"all_reduce", "all_gather", "reduce_scatter", "all_reduce/bfloat16",
            "reduce_scatter/float16"} <= set(found.link)
    assert all(fit["bus_bandwidth"] > 0 for fit in found.link.values())
    assert found.collectives == found.link  # one process per node: no collective within one
    # the two nodes' ranks ran each pipeline schedule's probe across the link
    assert set(found.pipeline_overhead) == {"gpipe", "1f1b", "interleaved-1f1b",
                                            "interleaved-zb"}
    step = found.measured_step()
    assert step is not None and step.spec.micro_batch == 2 and step.spec.optimizer == "adamw"
    assert step.parameters == 1024 * 64 + 64 + 64 * 8 + 8 and step.forward_backward > 0
    assert "small's step at micro-batch 2" in said[0]
    # and under fsdp's fully_shard and DeepSpeed ZeRO-3 at one rank, on node 0, whole and in
    # two micro-batches
    assert {(a.backend, str(a.options)) for a in step.alone} == {
        ("fsdp", "{}"), ("deepspeed", "{'zero_stage': 3}")}
    assert all(a.step > 0 and a.accumulated > 0 for a in step.alone)
    assert "under --backend deepspeed {'zero_stage': 3} at one rank" in said[0]
    assert "under --backend fsdp {} at one rank" in said[0]
    try:  # Horovod's own allreduce, across the nodes, where it is installed
        import horovod.torch  # noqa: F401
    except ImportError:
        assert "horovod:all_reduce" not in found.link
    else:
        for name in ("horovod:all_reduce", "horovod:all_reduce/float16"):
            assert found.link[name]["bus_bandwidth"] > 0


def test_a_horovod_sweep_that_fails_costs_the_calibration_only_its_fits(capfd) -> None:
    """Horovod's sweep runs in processes of its own: one whose rendezvous is gone (Horovod
    aborts the process) ends with no fits and one line saying so, and the calibration that
    called it goes on."""
    import socket

    pytest.importorskip("horovod.torch")
    from mpt.environments import World
    from mpt.plan.calibrate import horovod_fits

    with socket.socket() as probe:  # a port nothing serves
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    assert horovod_fits(World(gpus=2, source="test"), f"127.0.0.1:{dead}") == {}
    said = [line for line in capfd.readouterr().err.splitlines()
            if line.startswith("mpt plan --calibrate:")]
    assert len(said) == 1 and "Horovod's allreduce sweep failed on node 0" in said[0]
    assert said[0].endswith("--backend horovod is priced by torch's allreduce instead")


@pytest.mark.slow
def test_a_model_whose_step_fails_on_the_device_is_one_line_and_exit_2(tmp_path) -> None:
    import subprocess

    out = tmp_path / "cal.json"
    run = subprocess.run([sys.executable, "-m", "mpt", "plan", f"{MODELS}:meta_only",
                          "--calibrate", "--output", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 2 and not out.exists()
    assert run.stderr.splitlines()[-1].startswith("mpt: error: MODEL=")
    assert "its step did not run on this device (RuntimeError: this layer runs on the meta " \
        "device only)" in run.stderr
