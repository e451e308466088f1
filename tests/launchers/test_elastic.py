"""`mpt launch --nodes MIN:MAX`: the checks before start, and real elastic jobs that lose a node.

The jobs are several one-process `mpt launch` nodes on 127.0.0.1 (gloo, CPU), all started with
the same command, running tests/workers/elastic_train.py with a global batch of 12. Another
node's launcher and its worker are SIGKILLed mid-run.

- Shrink (3 nodes, ``--nodes 2:3``), a checkpoint after every step; the node started first hosts
  the c10d store and stays: the job finishes at 2; its loss curve equals (1e-5) a run of 3
  processes to the restored step and 2 processes from its checkpoint, in this test; at most one
  step (the checkpoint interval) is redone; every sample of every epoch is trained on once.
- Shrink from snapshots (``--snapshot-every 1``, no checkpoint on disk before the last step; the
  rendezvous on a store of its own): the node of rank 0 is lost with its memory; the same
  checks, the job resumed from the copy on the next node.
- Grow: the lost node comes back and the job grows to 3, on a static 3-process run's curve.
- Below MIN (2 nodes, ``--nodes 2:2``): the survivor ends in one line with a non-zero code, and
  the newest checkpoint still loads.

Every case: no process outlives the job. Under ddp both shrinks and below MIN run in `make
test`, the grow in `make conformance` (slow), as do both shrinks under fsdp and DeepSpeed
ZeRO-2. The kill-to-next-step figure is printed with ``-s``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import find_free_port, launch_env, mpt_command, pid_alive, wait_for, worker

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from common import make_model

import mpt
from mpt.elastic import (
    LAST_CALL,
    NodeRange,
    default_max_restarts,
    parse_nodes,
    plan_sizes,
    resize,
)
from mpt.errors import UsageError
from mpt.fault import REQUEUE_EXIT_CODE
from mpt.launchers import LaunchSpec
from mpt.launchers.elastic import (
    Failure,
    PreemptionRelay,
    agent_log,
    describe,
    torch_launch_config,
)
from mpt.launchers.notes import Note
from mpt.parallel import ParallelPlan
from mpt.scaling import plan_batch

STEPS = 10
GLOBAL_BATCH = 12  # 3 x 4 and 2 x 6
SAMPLES, PER_EPOCH = 48, 4  # as in elastic_train.py: 4 steps per epoch
BACKENDS = {"ddp": ("--backend", "ddp"), "fsdp": ("--backend", "fsdp"),
            "deepspeed": ("--backend", "deepspeed", "--zero-stage", "2"),
            # no pipeline at 3 processes (2 stages do not divide them), 2 stages x fsdp 1 at 2
            "fsdp-pp": ("--backend", "fsdp", "--pipeline-stages", "2,1")}
WORKER_FLAGS = {"fsdp-pp": ("--forward-backward",)}
"""The worker's own flags where a backend's layout needs them."""
JOB_TIMEOUT = 240  # seconds any launcher of a case may run (2 busy cores)


# -- before any process starts ----------------------------------------------------------------
def test_nodes_parses_a_count_or_a_range():
    assert parse_nodes("2") == NodeRange(2, 2, elastic=False)
    assert parse_nodes("2:4") == NodeRange(2, 4, elastic=True)
    assert list(parse_nodes(" 1:3").sizes) == [1, 2, 3]
    assert str(parse_nodes("2:4")) == "2:4"


@pytest.mark.parametrize(("value", "says"), [("3:2", "MIN is larger than MAX"),
                                              ("0:2", "MIN must be at least 1"),
                                              ("2:x", "neither a whole number"),
                                              ("two", "neither a whole number")])
def test_a_bad_range_is_one_line_naming_nodes(run_cli, value, says):
    result = run_cli("launch", "--nodes", value, "--dry-run", worker("elastic_train.py"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and f"--nodes={value}" in result.stderr
    assert says in result.stderr


def test_nr_with_a_range_is_refused(run_cli):
    result = run_cli("launch", "--nodes", "2:3", "--nr", "1", "--dry-run",
                     worker("elastic_train.py"))
    assert result.returncode == 2
    assert "--nr=1 is invalid" in result.stderr and "without --nr" in result.stderr


def test_horovod_is_refused_with_a_range(run_cli):
    result = run_cli("launch", "--nodes", "2:3", "--backend", "horovod", "--dry-run",
                     worker("elastic_train.py"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--backend horovod" in result.stderr


def test_dry_run_shows_the_plan_of_every_size(run_cli):
    result = run_cli("launch", "--nodes", "2:4", "--global-batch-size", "12", "--dry-run",
                     worker("elastic_train.py"))
    assert result.returncode == 0, result.stderr
    for count, per_rank in ((2, 6), (3, 4), (4, 3)):
        assert (f"{count} node(s), {count} process(es): global batch 12 = {count} process(es) x "
                f"{per_rank} per micro-batch") in result.stdout
    assert f"up to {default_max_restarts(parse_nodes('2:4'))} restart(s)" in result.stdout


def test_a_global_batch_that_does_not_divide_at_some_size_names_the_sizes_that_work(run_cli):
    result = run_cli("launch", "--nodes", "2:4", "--global-batch-size", "10", "--dry-run",
                     worker("elastic_train.py"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "cannot be divided over 3, 4 node(s)" in result.stderr
    assert "the node counts that work: 2)" in result.stderr
    assert "--global-batch-size 12" in result.stderr  # 12 divides by 2, 3 and 4


def test_plans_follow_the_world_and_keep_the_global_batch():
    plans = plan_sizes(24, parse_nodes("2:3"), gpus=2)
    assert {n: (p.world_size, p.batch_size, p.accumulate) for n, p in plans.items()} == {
        2: (4, 6, 1), 3: (6, 4, 1)}
    with pytest.raises(UsageError, match=r"cannot be divided over 2 node.*that work: 3\)"):
        plan_sizes(24, parse_nodes("2:3"), gpus=2, accumulate=4)  # 4 x 4 does not divide 24


def test_restarts_default_to_one_per_node_it_may_lose_plus_three():
    assert default_max_restarts(parse_nodes("2")) == 0
    assert default_max_restarts(parse_nodes("2:5")) == 6


def test_a_range_gets_torchs_c10d_rendezvous_and_a_count_the_static_one(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    elastic = torch_launch_config(LaunchSpec(script=script, nodes=3, min_nodes=2,
                                             master_port=29555, rdzv_timeout=40,
                                             local_addr="10.0.0.7"))
    assert elastic.local_addr == "10.0.0.7"
    assert (elastic.min_nodes, elastic.max_nodes, elastic.rdzv_backend) == (2, 3, "c10d")
    assert elastic.rdzv_endpoint == "127.0.0.1:29555"
    assert elastic.rdzv_configs["join_timeout"] == 40
    assert elastic.rdzv_configs["last_call_timeout"] == LAST_CALL
    static = torch_launch_config(LaunchSpec(script=script, nodes=2, nr=1))
    assert (static.min_nodes, static.max_nodes, static.rdzv_backend) == (2, 2, "static")
    assert static.rdzv_configs["rank"] == 1


def test_an_elastic_nodes_reports_name_the_ranks_it_got_at_the_rendezvous(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    spec = LaunchSpec(script=script, nodes=3, min_nodes=2)
    failure = Failure(rank=2, local_rank=0, exit_code=1)
    assert describe(failure, spec, {})[0] == ("mpt: rank 2 (this node, local rank 0) exited with "
                                              "code 1; the job was stopped")
    relay = PreemptionRelay()
    try:
        relay.received = "SIGTERM"
        # Rank 2 is this node's rank in the world the rendezvous formed; rank 0 is elsewhere.
        saved = relay.outcome(spec, {7: Note(failed_at=1, exit_code=REQUEUE_EXIT_CODE, rank=2)})
    finally:
        relay.restore()
    assert saved.exit_code == REQUEUE_EXIT_CODE


def test_each_nodes_agent_log_has_a_name_of_its_own_in_a_shared_log_dir(tmp_path):
    """Static nodes by --nr; elastic ones (no --nr) by their address: nodes sharing --log-dir
    on a shared file system do not write into one file."""
    script = tmp_path / "train.py"
    script.write_text("")
    for spec, name in ((LaunchSpec(script=script, nodes=2, nr=1, log_dir=tmp_path),
                        "elastic.node1.log"),
                       (LaunchSpec(script=script, nodes=3, min_nodes=2, local_addr="10.0.0.7",
                                   log_dir=tmp_path), "elastic.10.0.0.7.log")):
        with agent_log(spec):
            logging.getLogger("torch.distributed.elastic.agent").info("hello from %s", name)
        assert f"hello from {name}" in (tmp_path / name).read_text()


def test_a_resize_keeps_the_global_batch_or_else_the_per_rank_batch():
    saved = {"world_size": 3, "step": 7, "saved_at": 100.0}
    kept = resize(saved, world_size=2, plan=plan_batch(12, 2), samples_per_step=12, now=104.5)
    assert kept is not None and kept.line() == (
        "mpt: resized from 3 to 2 process(es) at step 7: 4.5 s since that step was saved; "
        "global batch 12 = 2 process(es) x 6 per micro-batch x 1 accumulation step(s) (kept; "
        "lr unchanged)")
    assert kept.metrics() == {"resize_world": 2.0, "resize_from": 3.0,
                              "resize_time_lost_s": 4.5, "global_batch": 12.0}
    assert kept.lr_ratio == 1.0
    grown = resize(saved, world_size=4, plan=None, samples_per_step=16, now=101.0)
    assert grown is not None and "global batch 16 (it was 12" in grown.line()
    assert grown.lr_ratio == 1.0 and "lr x" not in grown.line()
    assert resize(saved, world_size=3, plan=None, samples_per_step=12) is None
    scaled = resize(saved, world_size=4, plan=None, samples_per_step=16, lr_scaling="linear")
    assert scaled is not None and scaled.lr_ratio == pytest.approx(4 / 3)
    assert scaled.line().endswith("(--lr-scaling linear)")
    assert resize(saved, world_size=6, plan=None, samples_per_step=None, lr_scaling="sqrt",
                  layout=lambda world: ParallelPlan.for_world(world, pp=3)
                  ).lr_ratio == pytest.approx((2 / 1) ** 0.5)  # replicas 1 -> 2
    stages = mpt.RunConfig.parse({"pipeline_stages": "2,1"}).layout  # 2 stages at 4, none at 3
    assert resize(saved | {"world_size": 4}, world_size=3, plan=None, samples_per_step=None,
                  lr_scaling="linear", layout=stages).lr_ratio == pytest.approx(3 / 2)


def test_a_resize_without_a_global_batch_rescales_lr_of_optimizer_and_scheduler(tmp_path):
    """--lr-scaling linear, no --global-batch-size: a checkpoint of 4 processes resumed by 1
    (its manifest says 4) runs at a quarter of the saved learning rates."""
    rt = mpt.Runtime(lr_scaling="linear", checkpoint_dir=str(tmp_path), env={})
    model = make_model()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.4))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    try:
        scheduler.step()  # lr 0.2 from base 0.4
        where = Path(rt.save(step=3, scheduler=scheduler))
        manifest = json.loads((where / "manifest.json").read_text())
        (where / "manifest.json").write_text(json.dumps({**manifest, "world_size": 4}))
        optimizer.param_groups[0]["lr"] = 1.0  # what a fresh start would have
        assert rt.resume(scheduler=scheduler)["step"] == 3
    finally:
        rt.close()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2 / 4)
    assert scheduler.base_lrs == [pytest.approx(0.4 / 4)]
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4 / 4 * 0.25)


def test_visualize_marks_a_resize_on_every_plot_and_gives_it_no_plot_of_its_own():
    from mpt.metrics.reader import RankMetrics
    from mpt.visualize import metric_names, plot_metric

    plain = RankMetrics(rank=0, series={"loss": ([1, 2, 3, 4], [1.0, 0.9, 0.8, 0.7])})
    resized = RankMetrics(rank=0, series={**plain.series, "resize_world": ([2], [2.0]),
                                          "resize_from": ([2], [3.0]),
                                          "resize_time_lost_s": ([2], [4.5])})
    assert metric_names([resized]) == ["loss"]
    unmarked = plot_metric("loss", [plain])
    assert plot_metric("loss", [plain]) == unmarked  # a plot's bytes are repeatable: the
    assert plot_metric("loss", [resized]) != unmarked  # difference is the resize's mark


# -- real jobs --------------------------------------------------------------------------------
def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a launcher's workers)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Node:
    """One `mpt launch` of the job."""

    proc: subprocess.Popen[str]
    output: str = ""

    def wait(self, timeout: float) -> int:
        try:
            self.output, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.output, _ = self.proc.communicate()
            raise
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the launcher and its workers, as a lost machine would end them."""
        for pid in [*children(self.proc.pid), self.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class Job:
    """Nodes of one elastic job on this host, started one after the other."""

    def __init__(self, tmp: Path, nodes: str, count: int, backend: str, *flags: str,
                 steps: int = STEPS, sleep: float = 0.2, save_every: int = 1,
                 snapshots: bool = False) -> None:
        """``snapshots``: ``--snapshot-every 1``, each node's store in ``tmp/memory<i>``, and
        the rendezvous on a store of its own (any node may be lost, the one of rank 0 too)."""
        self.out, self.ck, self.run_dir = tmp / "out", tmp / "ck", tmp / "run"
        self.out.mkdir(parents=True)
        port = find_free_port()
        self.store = subprocess.Popen([sys.executable, "-c", STORE, str(port)]) if snapshots \
            else None
        self.memory = [tmp / f"memory{index}" for index in range(count)]
        self.nodes: list[Node] = []
        for index in range(count):
            node_flags = ["--snapshot-every", "1", "--snapshot-dir", str(self.memory[index])
                          ] if snapshots else []
            command = mpt_command(
                "launch", "--nodes", nodes, "--master-port", str(port), *BACKENDS[backend],
                "--global-batch-size", str(GLOBAL_BATCH), "--checkpoint-dir", str(self.ck),
                "--run-dir", str(self.run_dir), *flags, *node_flags, worker("elastic_train.py"),
                str(self.out), "--steps", str(steps), "--sleep", str(sleep), "--save-every",
                str(save_every), *WORKER_FLAGS.get(backend, ()))
            # TMPDIR: a node this test SIGKILLs leaves its launch folder in tmp, not in /tmp
            self.nodes.append(Node(subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env={**launch_env(), "TMPDIR": str(tmp)})))
            if index == 0:  # the first node (or the store) hosts the rendezvous
                assert wait_for(lambda: listening(port), 60), "node 0 never bound the port"

    def node_of_rank(self, rank: int) -> int:
        """Which of the nodes runs the worker that wrote ``rank`` into its pid file."""
        pids = {int(p.name) for p in (self.out / "pids").iterdir()
                if p.read_text() == str(rank)}
        return next(i for i, node in enumerate(self.nodes)
                    if pids & set(children(node.proc.pid)))

    def curve(self) -> list[tuple[int, int, float, float]]:
        return read_curve(self.out)

    def pids(self) -> list[int]:
        return [int(p.name) for p in (self.out / "pids").iterdir()]

    def assert_no_process_left(self) -> None:
        left = [pid for pid in [*self.pids(), *(n.proc.pid for n in self.nodes)]
                if pid_alive(pid)]
        assert not left, f"processes of the job outlived it: {left}"

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                node.kill()
                node.proc.communicate()
        if self.store is not None:
            self.store.kill()
            self.store.wait()


STORE = """import sys, time
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False)
time.sleep(3600)
"""
"""A rendezvous store outside the nodes (as an external one would be): every node's c10d
rendezvous finds the port taken and joins it as a client."""


def read_curve(out: Path) -> list[tuple[int, int, float, float]]:
    """``out/curve.txt`` (elastic_train.py's): (step, world size, loss, time) per line."""
    path = out / "curve.txt"
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(int(s), int(w), float(loss), float(t)) for s, w, loss, t in rows if t]


def last_values(curve: list[tuple[int, int, float, float]]) -> dict[int, float]:
    """The loss of every step as the run that went on from it computed it (redone steps:
    the later value)."""
    return {step: loss for step, _, loss, _ in curve}


def reference_curve(tmp: Path, backend: str, segments: tuple[tuple[int, int], ...],
                    steps: int = STEPS) -> dict[int, float]:
    """A run of static one-node jobs, each ``(processes, stop at step)`` going on from the one
    before's checkpoint (0: to the end), e.g. 3 processes to the restored step, then 2."""
    out, ck = tmp / "out", tmp / "ck"
    out.mkdir(parents=True)
    for gpus, stop in segments:
        command = mpt_command("launch", "--gpus", str(gpus), "--master-port", "auto",
                              *BACKENDS[backend], "--global-batch-size", str(GLOBAL_BATCH),
                              "--checkpoint-dir", str(ck), worker("elastic_train.py"),
                              str(out), "--steps", str(steps), "--stop-at", str(stop),
                              "--sleep", "0", *WORKER_FLAGS.get(backend, ()))
        done = subprocess.run(command, capture_output=True, text=True, timeout=JOB_TIMEOUT,
                              env=launch_env())
        assert done.returncode == 0, done.stderr[-4000:]
    return last_values(read_curve(out))


def assert_every_sample_once_per_epoch(out: Path, steps: int = STEPS) -> None:
    """Per step, the samples of the latest gang start that ran it; per epoch, each sample once."""
    latest: dict[int, tuple[float, list[int]]] = {}
    for path in out.glob("seen-rank*.txt"):
        for line in path.read_text().splitlines():
            start, step, sample = line.split()
            begun, samples = latest.get(int(step), (-1.0, []))
            if float(start) > begun:
                latest[int(step)] = (float(start), [int(sample)])
            elif float(start) == begun:
                samples.append(int(sample))
    assert sorted(latest) == list(range(1, steps + 1))
    for first in range(1, steps + 1, PER_EPOCH):
        epoch = [s for step in range(first, min(first + PER_EPOCH, steps + 1))
                 for s in latest[step][1]]
        if first + PER_EPOCH <= steps + 1:
            assert sorted(epoch) == list(range(SAMPLES)), f"epoch from step {first}"
        else:  # the last, partial epoch: no sample twice
            assert len(epoch) == len(set(epoch)) == GLOBAL_BATCH * (steps + 1 - first)


def shrink(tmp_path: Path, backend: str) -> None:
    job = Job(tmp_path / "elastic", "2:3", 3, backend)
    try:
        # Lose the last node once the 3-process world has done a few steps.
        assert wait_for(lambda: sum(w == 3 for _, w, _, _ in job.curve()) >= 3, 150), \
            "the 3-node world never trained"
        job.nodes[2].kill()
        killed_at = time.time()
        codes = [node.wait(JOB_TIMEOUT) for node in job.nodes[:2]]
        job.nodes[2].wait(10)
    finally:
        job.stop()
    output = "\n".join(node.output for node in job.nodes[:2])
    assert codes == [0, 0], output[-6000:]
    job.assert_no_process_left()

    check_shrunk(tmp_path, job.out, job.run_dir, backend, killed_at, output, "")


def check_shrunk(tmp_path: Path, out: Path, run_dir: Path, backend: str, killed_at: float,
                 output: str, how: str, worlds: tuple[int, int] = (3, 2)) -> int:
    """What every shrink from ``worlds[0]`` to ``worlds[1]`` processes must show (``out``, the
    worker's records; ``run_dir``, the launches'); returns the restored step."""
    old, new = worlds
    curve = read_curve(out)
    assert curve[-1][:2] == (STEPS, new), f"the job did not finish at {new} processes"
    before = [step for step, world, _, t in curve if world == old and t <= killed_at]
    restored = int((out / "resumed.txt").read_text().splitlines()[-1].split()[2])
    assert 0 < restored <= max(before)
    assert max(before) - restored <= 1, "more steps redone than the interval (1)"
    assert f"resized from {old} to {new} process(es) at step {restored}" in output
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text()
               .splitlines()]
    assert any(r.get("resize_world") == new and r.get("resize_from") == old for r in records)

    assert_every_sample_once_per_epoch(out)
    reference = reference_curve(tmp_path / "reference", backend, ((old, restored), (new, 0)))
    got = last_values(curve)
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1))
    worst = max(abs(got[s] - reference[s]) for s in got)
    assert worst <= 1e-5, {s: (got[s], reference[s]) for s in got}

    first_after = min(t for step, world, _, t in curve if world == new and t > killed_at)
    print(f"\nelastic shrink{how} ({backend}): {old} -> {new} nodes, kill to next completed "
          f"step {first_after - killed_at:.1f} s; steps redone {max(before) - restored}; worst "
          f"loss difference {worst:.1e}")
    return restored


@pytest.mark.slow  # `make test` keeps the same shrink restored from snapshots (below)
def test_a_lost_node_shrinks_the_job_which_keeps_the_global_batch_and_the_curve(tmp_path):
    shrink(tmp_path, "ddp")


def snapshot_shrink(tmp_path: Path, backend: str) -> None:
    """No checkpoint on disk after the first step's; a snapshot after every step. The node of
    rank 0, which writes the first copy of every snapshot, is lost with its memory: the
    survivors resume from the copy on the next node, at most one step back."""
    job = Job(tmp_path / "elastic", "2:3", 3, backend, save_every=STEPS, snapshots=True)
    try:
        assert wait_for(lambda: sum(w == 3 for _, w, _, _ in job.curve()) >= 3, 150), \
            "the 3-node world never trained"
        lost = job.node_of_rank(0)
        job.nodes[lost].kill()
        killed_at = time.time()
        shutil.rmtree(job.memory[lost])  # its memory is gone with it
        survivors = [node for i, node in enumerate(job.nodes) if i != lost]
        codes = [node.wait(JOB_TIMEOUT) for node in survivors]
        job.nodes[lost].wait(10)
    finally:
        job.stop()
    output = "\n".join(node.output for node in survivors)
    assert codes == [0, 0], output[-6000:]
    job.assert_no_process_left()

    restored = check_shrunk(tmp_path, job.out, job.run_dir, backend, killed_at, output,
                            " from snapshots, rank 0's node lost")
    assert f"resumed from memory://mpt-snapshot/step-{restored:09d}" in output
    assert not any(path.name.startswith("step-") and path.name != "step-000000010"
                   for path in job.ck.iterdir()), "a checkpoint on disk served the restore"


def test_a_lost_node_costs_at_most_one_step_with_snapshots_on_the_next_node(tmp_path):
    snapshot_shrink(tmp_path, "ddp")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_snapshot_shrink_under_sharding_backends(tmp_path, backend):
    snapshot_shrink(tmp_path, backend)


@pytest.mark.slow
def test_a_lost_node_changes_the_layout_to_the_stages_the_new_world_holds(tmp_path):
    """fsdp at 3 processes, a pipeline of 2 stages at 2: the survivors restore the peers'
    snapshot into the other layout, on the curve of static runs of the two."""
    snapshot_shrink(tmp_path, "fsdp-pp")
    starts = (tmp_path / "elastic" / "out" / "resumed.txt").read_text().splitlines()
    assert [line.split()[1::2] for line in (starts[0], starts[-1])] == [["3", "1"], ["2", "2"]]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_shrink_under_sharding_backends(tmp_path, backend):
    shrink(tmp_path, backend)


@pytest.mark.slow
def test_a_node_that_returns_grows_the_job_back(tmp_path):
    steps = 30
    job = Job(tmp_path / "elastic", "2:3", 3, "ddp", "--rdzv-timeout", "60", steps=steps,
              sleep=1.0)  # the returning node's start-up takes seconds of steps
    command = job.nodes[2].proc.args
    try:
        assert wait_for(lambda: sum(w == 3 for _, w, _, _ in job.curve()) >= 3, 150), \
            "the 3-node world never trained"
        job.nodes[2].kill()
        assert wait_for(lambda: any(w == 2 for _, w, _, _ in job.curve()), 120), \
            "the job never went on at 2"
        job.nodes.append(Node(subprocess.Popen(command, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True,
                                               env=launch_env())))
        codes = [node.wait(JOB_TIMEOUT) for node in (*job.nodes[:2], job.nodes[3])]
        job.nodes[2].wait(10)
    finally:
        job.stop()
    output = "\n".join(node.output for node in job.nodes)
    assert codes == [0, 0, 0], output[-6000:]
    job.assert_no_process_left()
    worlds = [world for _, world, _, _ in job.curve()]
    assert worlds[-1] == 3 and 2 in worlds, "the job did not grow back to 3"
    assert "resized from 2 to 3 process(es)" in output
    assert_every_sample_once_per_epoch(job.out, steps)
    # The global batch is kept: a static 3-process run's curve, up to the reduction order.
    reference = reference_curve(tmp_path / "reference", "ddp", ((3, 0),), steps)
    got = last_values(job.curve())
    assert max(abs(got[s] - reference[s]) for s in reference) <= 1e-5


def test_below_min_the_job_ends_in_one_line_and_the_checkpoint_stays(tmp_path):
    job = Job(tmp_path, "2:2", 2, "ddp", "--rdzv-timeout", "8", steps=60)
    try:
        # Step 2 on the curve: step 1's checkpoint is committed (the worker saves after it
        # writes a step's line, so the first line alone may come before any checkpoint).
        assert wait_for(lambda: len(job.curve()) >= 2, 150), "the job never trained"
        job.nodes[1].kill()
        killed_at = time.time()
        code = job.nodes[0].wait(JOB_TIMEOUT)
        ended_at = time.time()
        job.nodes[1].wait(10)
    finally:
        job.stop()
    lines = [line for line in job.nodes[0].output.splitlines() if line.startswith("mpt: ")]
    assert code == 1, job.nodes[0].output[-6000:]
    assert lines[-1].startswith("mpt: fewer than 2 node(s) (--nodes 2:2) met again within "
                                "--rdzv-timeout 8 s: the job ended; the newest checkpoint, ")
    assert ended_at - killed_at < 8 + 30, "the survivor waited far past --rdzv-timeout"
    job.assert_no_process_left()

    rt = mpt.Runtime(env={})  # the newest checkpoint loads, in a 1-process run
    model = make_model()
    model, _ = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    try:
        step = rt.load(job.ck)["step"]
    finally:
        rt.close()
    assert step >= max(s for s, _, _, _ in job.curve()) - 1
    by_step: dict[int, int] = defaultdict(int)
    for s, _, _, _ in job.curve():
        by_step[s] += 1
    assert max(by_step.values()) == 1, "a step ran twice: the survivor restarted training alone"
