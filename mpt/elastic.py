"""Elastic jobs: `mpt launch --nodes MIN:MAX`, a world that shrinks and grows between restarts.

Every node runs the same `mpt launch` (no ``--nr``); torch's c10d rendezvous at
``--master-addr:--master-port`` hands out node ranks, and when a node is lost the survivors' agents
meet again at the smaller size and restart their workers, which resume from the newest
checkpoint (checkpoints restore at any world size). This module holds what mpt adds to that:

- the range itself, parsed and checked before any process starts;
- the batch plan of every size in the range, so that a global batch that cannot be divided at
  some size is refused at launch rather than at the restart that reaches it;
- the rendezvous settings, tuned so that a lost node costs seconds, not a minute;
- on the worker side, the one line (and metrics record) that says a run was resized.

It imports no launcher and no backend, so both sides can use it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpt.errors import UsageError
from mpt.parallel import ParallelPlan
from mpt.scaling import BatchPlan, lr_factor, plan_batch

if TYPE_CHECKING:
    from mpt.checkpoint.format import Manifest

EXTRA_RESTARTS = 3
"""Restarts an elastic job gets on top of one per node it may lose (transient failures)."""

KEEP_ALIVE_INTERVAL = 2
"""Seconds between an agent's keep-alive writes to the rendezvous store (torch: 5)."""
KEEP_ALIVE_MAX_ATTEMPT = 3
"""Missed keep-alives after which the rendezvous drops a node: a dead node is forgotten
``KEEP_ALIVE_INTERVAL x KEEP_ALIVE_MAX_ATTEMPT`` = 6 s after it died (torch: 15 s)."""
LAST_CALL = 5
"""Seconds a rendezvous that reached MIN nodes still waits for more before it completes, unless
MAX arrive first (torch: 30). A node arriving later joins at the next step boundary (a grow)."""

ELASTIC_AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""Set in an elastic job's `mpt launch` before torch's agent starts. With the rendezvous store
shared (torch's default), an agent keeps the workers' store address of the first round it
joined unless it becomes node 0: after node 0 is lost, its survivors' workers would meet at a
dead address. Unshared, each round's node 0 publishes a fresh one."""


@dataclass(frozen=True, slots=True)
class NodeRange:
    """``--nodes``: one count (a static job, node ranks from ``--nr``) or ``MIN:MAX``."""

    min: int
    max: int
    elastic: bool
    """True when given as MIN:MAX: ranks come from the rendezvous, the size may change."""

    @property
    def sizes(self) -> range:
        return range(self.min, self.max + 1)

    def __str__(self) -> str:
        return f"{self.min}:{self.max}" if self.elastic else str(self.max)


def _count(value: str, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise UsageError("--nodes", value, "it is neither a whole number N nor a range "
                         "MIN:MAX of them", "pass --nodes 2, or --nodes 2:4 for an elastic job"
                         ) from None


def parse_nodes(value: str | int) -> NodeRange:
    """``--nodes N`` or ``--nodes MIN:MAX`` (1 <= MIN <= MAX)."""
    text = str(value)
    low, sep, high = text.partition(":")
    if not sep:
        count = _count(text, text)
        return NodeRange(count, count, elastic=False)
    least, most = _count(text, low), _count(text, high)
    if least < 1:
        raise UsageError("--nodes", text, "MIN must be at least 1",
                         f"pass --nodes 1:{max(most, 1)}")
    if least > most:
        raise UsageError("--nodes", text, "MIN is larger than MAX",
                         f"pass --nodes {most}:{least}")
    return NodeRange(least, most, elastic=True)


def check_node_rank(nodes: NodeRange, nr: str | None) -> None:
    """A range assigns node ranks at the rendezvous: ``--nr`` with it is refused."""
    if nodes.elastic and nr is not None:
        raise UsageError("--nr", nr, f"with --nodes {nodes} the rendezvous assigns node ranks",
                         "start every node with the same command, without --nr (or pass a "
                         "fixed --nodes N with --nr R)")


def check_elastic(nodes: NodeRange, backend: str) -> None:
    """Refuse what an elastic job cannot run: a range out of order (a LaunchSpec built in
    code), and a backend that declares it cannot resize (Horovod, whose rendezvous serves one
    fixed round of workers: see ``mpt.launchers.horovod_join``)."""
    if not 1 <= nodes.min <= nodes.max:
        raise UsageError("--nodes", nodes, "it needs 1 <= MIN <= MAX", "pass --nodes 2:4, "
                         "for example")
    from mpt.backends import get_backend, offering

    if not get_backend(backend).elastic:
        raise UsageError("--nodes", nodes, f"--backend {backend} cannot change its world size "
                         "under mpt launch", "pass a fixed --nodes N with --nr R, or "
                         f"--backend {offering('elastic')}")


def default_max_restarts(nodes: NodeRange) -> int:
    """``--max-restarts`` when not given: 0 for a static job; for a range, one per node the job
    may lose before it falls below MIN, plus ``EXTRA_RESTARTS``.

    torch's agent counts every failure of its worker group against the limit, a lost node
    included (the survivors' workers fail in a collective first); a node that joins restarts
    the group without counting.
    """
    return nodes.max - nodes.min + EXTRA_RESTARTS if nodes.elastic else 0


def rendezvous_configs(join_timeout: int) -> dict[str, Any]:
    """torch's c10d rendezvous settings of an elastic job (``LaunchConfig.rdzv_configs``)."""
    return {"join_timeout": join_timeout, "last_call_timeout": LAST_CALL,
            "keep_alive_interval": KEEP_ALIVE_INTERVAL,
            "keep_alive_max_attempt": KEEP_ALIVE_MAX_ATTEMPT}


def plan_sizes(global_batch_size: int, nodes: NodeRange, gpus: int,
               layout: Callable[[int], ParallelPlan] | None = None,
               accumulate: int | None = None) -> dict[int, BatchPlan]:
    """The batch plan at every node count of ``nodes`` (``layout``: the job's layout at a
    world size, ``RunConfig.layout``; default: data parallelism alone), or one UsageError
    naming the counts at which ``global_batch_size`` does not divide and those at which it
    does."""
    layout = layout or (lambda world: ParallelPlan(dp_replicate=world))
    replicas = {count: layout(count * gpus).dp_size for count in nodes.sizes}
    plans: dict[int, BatchPlan] = {}
    bad: list[int] = []
    for count in nodes.sizes:
        try:
            plans[count] = plan_batch(global_batch_size, replicas[count], accumulate=accumulate)
        except UsageError:
            bad.append(count)
    if bad:
        good = ", ".join(map(str, plans)) or "none"
        step = math.lcm(*(size * (accumulate or 1) for size in replicas.values()))
        fits = max(step, round(global_batch_size / step) * step)
        raise UsageError("--global-batch-size", global_batch_size, "it cannot be divided over "
                         f"{', '.join(map(str, bad))} node(s) of --nodes {nodes} (the node counts "
                         f"that work: {good})", f"pass --global-batch-size {fits} (it divides at "
                         "every size), or a --nodes range of the counts that work")
    return plans


def describe_sizes(nodes: NodeRange, gpus: int, layout: Callable[[int], ParallelPlan],
                   global_batch_size: int | None, accumulate: int | None) -> list[str]:
    """One line per node count of an elastic job: its world and how its batch splits (the
    ``--dry-run`` of ``--nodes MIN:MAX``)."""
    plans = ({} if global_batch_size is None
             else plan_sizes(global_batch_size, nodes, gpus, layout, accumulate))
    layouts = {count: layout(count * gpus) for count in nodes.sizes}
    split = any(plan.model_size > 1 for plan in layouts.values())  # then say each size's layout
    lines = []
    for count, plan in layouts.items():
        how = (plans[count].describe() if count in plans else
               f"the script's per-rank batch, global batch {plan.dp_size} x that x accumulation")
        at = f" ({plan.describe()})" if split else ""
        lines.append(f"{count} node(s), {count * gpus} process(es){at}: {how}")
    return lines


@dataclass(frozen=True, slots=True)
class Resize:
    """A run resumed at another world size than the one that saved its checkpoint."""

    old_world: int
    """Processes of the run that saved the checkpoint."""
    new_world: int
    """Processes now."""
    step: int
    """The restored step."""
    time_lost: float
    """Seconds from that checkpoint's commit to the resume: the steps done after it (redone
    now), noticing the loss, the rendezvous, the restart and the load."""
    global_batch: int | None
    """Samples per optimizer step now (None: the script's loader is not known to mpt)."""
    plan: str
    """How the global batch splits now."""
    lr_ratio: float = 1.0
    """What the learning rates are multiplied by: ``--lr-scaling``'s factor at the new
    data-parallel size over the old one, where the global batch followed the world."""

    def line(self) -> str:
        return (f"mpt: resized from {self.old_world} to {self.new_world} process(es) at step "
                f"{self.step}: {self.time_lost:.1f} s since that step was saved; {self.plan}")

    def metrics(self) -> dict[str, float]:
        """The resize as a metrics record (``mpt visualize`` marks ``resize_world``)."""
        values = {"resize_world": float(self.new_world), "resize_from": float(self.old_world),
                  "resize_time_lost_s": round(self.time_lost, 3)}
        if self.global_batch is not None:
            values["global_batch"] = float(self.global_batch)
        return values


def resize(manifest: Mapping[str, Any], *, world_size: int, plan: BatchPlan | None,
           samples_per_step: int | None, lr_scaling: str | None = None,
           layout: Callable[[int], ParallelPlan] | None = None,
           now: float | None = None) -> Resize | None:
    """The resize a resume from a checkpoint with ``manifest`` (its ``world_size``, ``step``,
    ``saved_at``) makes, or None at the same world size. With a ``plan`` the global batch is
    kept, and the learning rate; without one the per-rank batch is kept, the global batch
    follows the world and ``lr_scaling`` (``--lr-scaling``) rescales the learning rate to the
    new data-parallel size (``layout``: the job's layout at a world, ``RunConfig.layout``, whose
    stages may differ between the two; default: data parallelism alone)."""
    old = int(manifest["world_size"])
    if old == world_size:
        return None
    lost = (time.time() if now is None else now) - float(manifest["saved_at"])
    ratio = 1.0
    if plan is not None:
        how = f"{plan.describe()} (kept; lr unchanged)"
        total: int | None = plan.global_batch_size
    else:
        at = layout or (lambda world: ParallelPlan(dp_replicate=world))
        ratio = (lr_factor(lr_scaling, at(world_size).dp_size)
                 / lr_factor(lr_scaling, at(old).dp_size))
        lr = f"; lr x {ratio:.4g} (--lr-scaling {lr_scaling})" if lr_scaling else ""
        if samples_per_step:
            before = samples_per_step * old // world_size
            how = (f"per-rank batch kept: global batch {samples_per_step} (it was {before}; "
                   f"--global-batch-size keeps it){lr}")
            total = samples_per_step
        else:
            how, total = f"per-rank batch kept{lr}", None
    return Resize(old_world=old, new_world=world_size, step=int(manifest["step"]),
                  time_lost=lost, global_batch=total, plan=how, lr_ratio=ratio)


def report_resize(manifest: Manifest, *, world_size: int, plan: BatchPlan | None,
                  samples_per_step: int | None, lr_scaling: str | None,
                  layout: Callable[[int], ParallelPlan],
                  say: Callable[[str], None],
                  log: Callable[[dict[str, float]], None]) -> Resize | None:
    """After ``rt.resume()`` loaded the checkpoint of ``manifest``: say and log a resize, if
    it was one (the caller applies its ``lr_ratio``)."""
    done = resize({"world_size": manifest.world_size, "step": manifest.step,
                   "saved_at": manifest.saved_at}, world_size=world_size, plan=plan,
                  samples_per_step=samples_per_step, lr_scaling=lr_scaling, layout=layout)
    if done is not None:
        say(done.line())
        log(done.metrics())
    return done


def below_min(nodes: NodeRange, waited: int, checkpoint_dir: str | None) -> str:
    """The line an elastic job ends with when fewer than MIN nodes met again."""
    from mpt.checkpoint import io  # the package (torch, fsspec) only on the way out

    latest = None if checkpoint_dir is None else io.find_latest(checkpoint_dir)
    kept = (f"the newest checkpoint, {latest}, is intact: run the same command on {nodes.min} "
            "or more nodes to resume it" if latest else "there is no checkpoint to resume")
    return (f"mpt: fewer than {nodes.min} node(s) (--nodes {nodes}) met again within "
            f"--rdzv-timeout {waited} s: the job ended; {kept}")
