"""Fault injection: real 2-rank `mpt launch` jobs (gloo, CPU) hit by the faults of issue 7.

One script, tests/workers/fault_train.py, trains 30 fp32 Adam steps on a shuffled loader and
saves every 5; its arguments pick the fault (SIGKILL, an exception, a hang, a SIGKILL inside a
save), the step and the rank, and it fires on the gang's first attempt only. Each case asserts
the exit code, the time from the fault to the launcher's exit, that no process of the job is
left, and that the last checkpoint loads (in this process, through a 1-process ``mpt.Runtime``,
with every file's checksum verified). The cases run under ``ddp`` and DeepSpeed ZeRO-2.

The figures the issue asks for (time from fault to exit, restarts survived, steps lost, steps
recomputed) are printed as a table when the module ends and written to ``fault-figures.md`` in
pytest's base temporary directory: ``pytest -s -q tests/launchers/test_faults.py``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import find_free_port, launch_env, mpt_command, pid_alive, wait_for, worker

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from common import make_model

import mpt
from mpt.checkpoint.io import LATEST, Location, complete_checkpoints, step_dir_name

STEPS, SAVE_EVERY = 30, 5  # as in fault_train.py
FAULT_AT = 13  # mid-epoch (7 steps per epoch), 3 steps after the save at 10
BACKENDS = {"ddp": ("--backend", "ddp"),
            "deepspeed": ("--backend", "deepspeed", "--zero-stage", "2")}
EXIT_BOUND = 30.0  # seconds from a fault to the launcher's exit
TIMEOUT = 5  # --timeout of the hang case


@dataclass
class Job:
    """One `mpt launch` of fault_train.py: where it wrote, how and when it ended."""

    out: Path
    ck: Path
    proc: subprocess.Popen[str]
    code: int | None = None
    stderr: str = ""
    ended: float = 0.0

    def wait(self, timeout: float = 180) -> Job:
        try:
            _, self.stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # its workers die with it (they are bound to the launcher)
            self.proc.communicate()
            raise
        self.ended, self.code = time.time(), self.proc.returncode
        return self

    def steps(self, rank: int, attempt: int = 0) -> list[int]:
        path = self.out / f"steps-rank{rank}-attempt{attempt}.txt"
        return [int(s) for s in path.read_text().split()] if path.exists() else []

    def resumed(self, rank: int, attempt: int = 0) -> int:
        return int((self.out / f"resumed-rank{rank}-attempt{attempt}").read_text())

    def fault_at(self) -> float:
        return float((self.out / "fault-at").read_text())

    def pids(self) -> list[int]:
        return [int(p.read_text()) for p in self.out.glob("pid-*")]

    def attempts(self) -> int:
        return len(list(self.out.glob("pid-rank0-attempt*")))

    def assert_no_process_left(self) -> None:
        assert self.pids(), "no worker wrote its pid"
        left = [pid for pid in self.pids() if pid_alive(pid)]
        assert not left, f"processes of the job outlived it: {left}"

    def __repr__(self) -> str:  # what a failed assertion shows: stderr without the warnings
        lines = [line for line in self.stderr.splitlines()
                 if "Warning" not in line and "return func(" not in line]
        return f"Job(code={self.code}, stderr=...\n" + "\n".join(lines)[-6000:] + ")"


def start(out: Path, backend: str, *flags: str, ck: Path | None = None,
          script_args: tuple[str, ...] = ()) -> Job:
    """``mpt launch --gpus 2`` of fault_train.py, running in the background."""
    out.mkdir(parents=True, exist_ok=True)
    ck = ck or out.parent / f"{out.name}-ck"
    where = () if "--nodes" in flags else ("--gpus", "2", "--master-port", "auto")
    command = mpt_command("launch", *where, *flags, *BACKENDS[backend], "--checkpoint-dir",
                          str(ck), worker("fault_train.py"), str(out), *script_args)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=launch_env())
    return Job(out=out, ck=ck, proc=proc)


def run(out: Path, backend: str, *script_args: str, flags: tuple[str, ...] = (),
        ck: Path | None = None, timeout: float = 180) -> Job:
    return start(out, backend, *flags, ck=ck, script_args=script_args).wait(timeout)


def load_checkpoint(ck: Path) -> int:
    """Load ``ck``'s latest checkpoint as a 1-process run would resume it; its step."""
    rt = mpt.Runtime(env={})
    model = make_model()
    model, _ = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    try:
        return rt.load(ck)["step"]
    finally:
        rt.close()


def latest(ck: Path) -> str:
    return (ck / LATEST).read_text().strip()


def assert_same_weights(final: Path, reference: dict[str, torch.Tensor]) -> None:
    got = torch.load(final)
    assert got.keys() == reference.keys()
    unequal = [k for k in got if not torch.equal(got[k], reference[k])]
    assert not unequal, f"weights differ bitwise from the uninterrupted run's: {unequal}"


# -- figures ---------------------------------------------------------------------------------
@dataclass
class Figures:
    rows: list[tuple[str, ...]] = field(default_factory=list)

    def add(self, case: str, backend: str, job: Job, seconds: float, *, restarts: int = 0,
            lost: str = "-", recomputed: str = "-") -> None:
        self.rows.append((case, backend, str(job.code), f"{seconds:.1f}", str(restarts), lost,
                          recomputed))

    def table(self) -> str:
        head = ("case", "backend", "exit", "fault -> exit (s)", "restarts survived",
                "steps lost", "steps recomputed")
        lines = [head, tuple("---" for _ in head), *self.rows]
        return "\n".join("| " + " | ".join(row) + " |" for row in lines)


@pytest.fixture(scope="module")
def figures(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Figures]:
    found = Figures()
    yield found
    text = ("Fault-injection figures (2 ranks, gloo, CPU; steps recomputed: steps done after the "
            "last checkpoint, redone by a resume; steps lost: missing from the final trajectory "
            "of a resumed run, '-' where the case does not resume)\n\n" + found.table() + "\n")
    (tmp_path_factory.getbasetemp() / "fault-figures.md").write_text(text)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("\n" + text)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory
              ) -> Callable[[str], dict[str, torch.Tensor]]:
    """The final weights of an uninterrupted run, one run per backend, on first use."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def get(backend: str) -> dict[str, torch.Tensor]:
        if backend not in cache:
            job = run(tmp_path_factory.mktemp(f"reference-{backend}") / "out", backend,
                      "--sleep", "0")
            assert job.code == 0, job
            assert job.steps(0) == list(range(1, STEPS + 1))
            cache[backend] = torch.load(job.out / "final.pt")
        return cache[backend]
    return get


# DeepSpeed goes through the same launcher and checkpoint paths as ddp: its cases run in
# `make conformance` (marked slow), ddp's in `make test`.
backends = pytest.mark.parametrize("backend", [
    pytest.param(name, marks=pytest.mark.slow) if name == "deepspeed" else name
    for name in BACKENDS])


# -- the cases -------------------------------------------------------------------------------
@backends
@pytest.mark.parametrize(("fault", "code", "how"), [
    # a SIGKILLed rank ending the job is also test_launch's; here in `make conformance`
    pytest.param("kill9", 128 + signal.SIGKILL, "was killed by SIGKILL", marks=pytest.mark.slow),
    ("raise", 1, "exited with code 1")])
def test_a_failing_rank_stops_the_job_and_leaves_a_loadable_checkpoint(
        tmp_path, figures, backend, fault, code, how):
    job = run(tmp_path / "out", backend, "--fault", fault, "--at", str(FAULT_AT))
    elapsed = job.ended - job.fault_at()
    assert job.code == code, job
    assert f"mpt: rank 1 (node 0, local rank 1) {how}" in job.stderr, job
    assert elapsed < EXIT_BOUND
    job.assert_no_process_left()
    assert job.steps(1) == list(range(1, FAULT_AT))  # the fault came before step 13's update
    assert latest(job.ck) == step_dir_name(10)
    assert load_checkpoint(job.ck) == 10
    figures.add(f"{fault} rank 1 mid-step", backend, job, elapsed,
                recomputed=str(max(job.steps(0)) - 10))


@backends
def test_a_hung_rank_becomes_a_timeout_that_names_it(tmp_path, figures, backend):
    job = run(tmp_path / "out", backend, "--fault", "hang", "--at", str(FAULT_AT),
              flags=("--timeout", str(TIMEOUT)), timeout=120)
    elapsed = job.ended - job.fault_at()
    assert job.code not in (0, None), job
    assert elapsed < TIMEOUT + 20
    assert elapsed > TIMEOUT - 1  # it was the timeout that ended it, not something sooner
    # rank 0 timed out waiting in the gradient all-reduce; the heartbeats name rank 1
    assert "mpt: rank 0 (node 0, local rank 0) exited with code 1" in job.stderr, job
    cause = [line for line in job.stderr.splitlines() if line.endswith("the likely cause")]
    assert len(cause) == 1 and cause[0].startswith(f"mpt: rank 1: step {FAULT_AT - 1}, in "), job
    assert "while rank 0 waited for it" in cause[0]
    assert f"Timed out waiting {TIMEOUT * 1000}ms" in job.stderr, job  # gloo's, in rank 0
    job.assert_no_process_left()
    assert load_checkpoint(job.ck) == 10
    figures.add(f"rank 1 hangs, --timeout {TIMEOUT}", backend, job, elapsed,
                recomputed=str(max(job.steps(0)) - 10))


@backends
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_latest(tmp_path, figures, backend):
    # rank 0 writes the checkpoint; it dies when the complete staging directory is renamed
    job = run(tmp_path / "out", backend, "--fault", "kill9_in_save", "--at", "15", "--rank", "0")
    elapsed = job.ended - job.fault_at()
    assert job.code == 128 + signal.SIGKILL, job
    assert "mpt: rank 0 (node 0, local rank 0) was killed by SIGKILL" in job.stderr, job
    assert elapsed < EXIT_BOUND
    job.assert_no_process_left()
    staged = [p.name for p in job.ck.iterdir() if p.name.startswith(".tmp-")]
    assert len(staged) == 1 and staged[0].startswith(f".tmp-{step_dir_name(15)}-")
    assert (job.ck / staged[0] / "manifest.json").exists()  # whole, but never committed
    assert latest(job.ck) == step_dir_name(10)
    assert [name for _, name in complete_checkpoints(Location.parse(job.ck))] == [
        step_dir_name(5), step_dir_name(10)]
    assert load_checkpoint(job.ck) == 10
    figures.add("kill9 rank 0 in a save", backend, job, elapsed,
                recomputed=str(max(job.steps(0)) - 10))


@pytest.mark.parametrize(("backend", "sig"), [
    pytest.param("ddp", signal.SIGTERM, id="ddp-SIGTERM"),
    pytest.param("deepspeed", signal.SIGTERM, id="deepspeed-SIGTERM", marks=pytest.mark.slow),
    pytest.param("ddp", signal.SIGUSR1, id="ddp-SIGUSR1", marks=pytest.mark.slow)])
def test_preemption_saves_one_step_on_every_rank_and_resumes_bitwise(
        tmp_path, figures, reference, backend, sig):
    ck = tmp_path / "ck"
    # 0.1 s per step: ~2 s of training left when the signal comes
    job = start(tmp_path / "first", backend, ck=ck, script_args=("--sleep", "0.1"))
    assert wait_for(lambda: len(job.steps(0)) >= 8 or job.proc.poll() is not None, 120), job
    sent = time.time()
    job.proc.send_signal(sig)
    job.wait()
    elapsed = job.ended - sent
    assert job.code == 75, job  # "requeue me"
    assert f"mpt: preempted by {sig.name}" in job.stderr, job
    assert elapsed < EXIT_BOUND
    job.assert_no_process_left()
    stopped = [json.loads((job.out / f"exit-rank{r}-attempt0.json").read_text())["global_step"]
               for r in range(2)]
    n = stopped[0]
    assert stopped == [n, n] and 8 <= n < STEPS  # both ranks stopped after the same step
    assert job.steps(0) == job.steps(1) == list(range(1, n + 1))
    assert latest(ck) == step_dir_name(n)
    assert load_checkpoint(ck) == n
    if sig != signal.SIGTERM:
        figures.add(f"{sig.name} to mpt launch", backend, job, elapsed, recomputed="0")
        return
    # the same command again: --resume auto takes step n and trains on to the end
    again = run(tmp_path / "again", backend, "--sleep", "0", ck=ck)
    assert again.code == 0, again
    assert again.resumed(0) == again.resumed(1) == n
    trajectory = job.steps(0) + again.steps(0)
    assert trajectory == list(range(1, STEPS + 1))  # none repeated, none skipped
    assert again.steps(1) == list(range(n + 1, STEPS + 1))
    assert_same_weights(again.out / "final.pt", reference(backend))
    figures.add(f"{sig.name} to mpt launch, rerun", backend, job, elapsed,
                lost=str(STEPS - len(set(trajectory))), recomputed="0")


@backends
def test_max_restarts_resumes_from_the_last_checkpoint_bitwise(
        tmp_path, figures, reference, backend):
    job = run(tmp_path / "out", backend, "--fault", "kill9", "--at", str(FAULT_AT),
              flags=("--max-restarts", "1"))
    assert job.code == 0, job
    assert job.attempts() == 2
    job.assert_no_process_left()
    recomputed = []
    for rank in range(2):
        first, resumed, second = job.steps(rank, 0), job.resumed(rank, 1), job.steps(rank, 1)
        assert resumed == 10  # the last save before the fault
        assert first[:FAULT_AT - 1] == list(range(1, FAULT_AT))  # then the failed attempt ends
        assert second == list(range(resumed + 1, STEPS + 1))
        trajectory = [s for s in first if s <= resumed] + second
        assert trajectory == list(range(1, STEPS + 1))  # none lost, none repeated
        recomputed.append(len([s for s in first if s > resumed]))
    assert_same_weights(job.out / "final.pt", reference(backend))
    assert load_checkpoint(job.ck) == STEPS
    recovered = (job.out / "resumed-rank0-attempt1").stat().st_mtime - job.fault_at()
    figures.add("kill9 rank 1, --max-restarts 1 (to resumed)", backend, job, recovered,
                restarts=job.attempts() - 1, lost="0", recomputed=str(max(recomputed)))


def test_a_node_that_never_arrives_is_one_line_after_the_rdzv_timeout(tmp_path, figures):
    port = str(find_free_port())
    began = time.time()
    job = start(tmp_path / "out", "ddp", "--nodes", "2", "--nr", "0", "--gpus", "2",
                "--master-port", port, "--rdzv-timeout", "5").wait(timeout=60)
    elapsed = job.ended - began
    assert job.code not in (0, None), job
    assert 5 <= elapsed < 20, job
    lines = [line for line in job.stderr.splitlines() if line.startswith("mpt: node 0")]
    assert len(lines) == 1 and "could not meet the other nodes" in lines[0], job
    assert "--rdzv-timeout (5 s)" in lines[0]
    assert "Traceback" not in job.stderr, job
    assert not job.pids()  # no worker ever started
    figures.add("--nodes 2, node 1 never comes (from start)", "ddp", job, elapsed)


def test_a_rank_killed_on_one_node_ends_both_launchers(tmp_path, figures):
    port, out, ck = str(find_free_port()), tmp_path / "out", tmp_path / "ck"
    jobs = [start(out, "ddp", "--nodes", "2", "--gpus", "1", "--nr", str(nr),
                  "--master-addr", "127.0.0.1", "--master-port", port, ck=ck,
                  script_args=("--fault", "kill9", "--at", str(FAULT_AT)))
            for nr in (1, 0)]  # the second node may come first
    node1, node0 = (job.wait() for job in jobs)
    fault = node1.fault_at()
    assert node1.code == 128 + signal.SIGKILL, node1
    assert "mpt: rank 1 (node 1, local rank 0) was killed by SIGKILL" in node1.stderr, node1
    assert node0.code not in (0, None), node0
    assert "a rank on another node probably failed first" in node0.stderr, node0
    for job in (node0, node1):
        assert job.ended - fault < EXIT_BOUND, job
    node0.assert_no_process_left()  # both nodes' pids: the same OUT
    assert load_checkpoint(ck) == 10
    for node, job in (("node 0", node0), ("node 1", node1)):
        figures.add(f"2 nodes, kill9 rank 1: {node}", "ddp", job, job.ended - fault)


def test_two_nodes_restart_together_and_resume_bitwise(tmp_path, figures, reference):
    port, out, ck = str(find_free_port()), tmp_path / "out", tmp_path / "ck"
    jobs = [start(out, "ddp", "--nodes", "2", "--gpus", "1", "--nr", str(nr),
                  "--master-addr", "127.0.0.1", "--master-port", port, "--max-restarts", "1",
                  ck=ck, script_args=("--fault", "kill9", "--at", str(FAULT_AT)))
            for nr in (1, 0)]
    node1, node0 = (job.wait() for job in jobs)
    assert (node0.code, node1.code) == (0, 0), (node0, node1)
    assert node0.attempts() == 2  # both nodes' files: the same OUT
    for rank in range(2):
        assert node0.resumed(rank, 1) == 10
        assert node0.steps(rank, 1) == list(range(11, STEPS + 1))
    node0.assert_no_process_left()
    assert_same_weights(out / "final.pt", reference("ddp"))  # the one-node 2-rank run's
    recovered = (out / "resumed-rank0-attempt1").stat().st_mtime - node0.fault_at()
    figures.add("2 nodes, kill9 rank 1, --max-restarts 1 (to resumed)", "ddp", node0, recovered,
                restarts=1, lost="0", recomputed=str(max(node0.steps(0)) - 10))


def test_preempting_a_hung_job_kills_it_after_the_grace_period(tmp_path, figures):
    job = start(tmp_path / "out", "ddp", "--grace-period", "3",
                script_args=("--fault", "hang", "--at", str(FAULT_AT)))
    assert wait_for(lambda: (job.out / "fault-at").exists() or job.proc.poll() is not None,
                    120), job
    time.sleep(0.5)  # rank 0 is now waiting in the all-reduce rank 1 never joins
    sent = time.time()
    job.proc.send_signal(signal.SIGTERM)
    job.wait(60)
    elapsed = job.ended - sent
    assert job.code == 128 + signal.SIGTERM, job
    assert "rank(s) 0, 1 did not save and exit within --grace-period 3 s" in job.stderr, job
    assert 3 <= elapsed < 3 + 15
    job.assert_no_process_left()
    assert latest(job.ck) == step_dir_name(10)  # no half checkpoint of the hung step
    assert load_checkpoint(job.ck) == 10
    figures.add("rank 1 hung, SIGTERM to mpt launch, --grace-period 3", "ddp", job, elapsed)
