"""One layout's predicted step: memory per rank, time split into compute, exposed communication
and pipeline bubble, bytes on the links, and what limits it.

The step, for a rank of the slowest pipeline stage:

- compute: every op of the stage's forward and backward (``mpt.plan.workload``) at
  ``max(FLOPs / matmul throughput, bytes / memory bandwidth) + op overhead``, the throughput the
  compute dtype's at the matmul's shape (a convolution's: its im2col GEMM's) where the device was
  calibrated (a skinny matmul runs far below a square one), its peak otherwise; the ops a
  tensor-parallel plan splits divided by T; then the optimizer step: the calibrated seconds
  per parameter of torch's own step, or, on a datasheet profile, 4 x (3 + 2 x states) bytes
  per parameter it steps (read weight, gradient and states, write weight and states) at the
  memory bandwidth; where the calibration timed this model's own step (``MeasuredStep``),
  the forward and backward scaled by what it measured over what the ops price at its
  micro-batch (and at that micro-batch cut into 2 to 16 accumulated pieces: the scale at the
  layout's micro-batch, interpolated), and the optimizer step at its measured seconds per
  parameter (``Model``'s ``compute_scales`` and ``update_seconds``); then the backend's
  copies into and out of its collectives' buffers (``Traffic.copies``: DDP's buckets, fsdp's
  all-gather and reduce-scatter inputs and outputs), read and written once each at the memory
  bandwidth, never hidden (they run on the rank's own cores or stream); under fsdp and
  DeepSpeed ZeRO-3 (a backend's ``timed_alone`` options), what its step of the model at one
  rank took beyond the plain step and the copies priced there, per micro-batch and per step
  (``Model.own_work``: fully_shard's hooks and DTensor parameters, ZeRO-3's hooks); where a
  backend offloads (``--fsdp-cpu-offload``, DeepSpeed's ``--offload``), what it moves between
  host and device (``Traffic.host_copies``) at the device's host link, not hidden, and the
  optimizer step at the host's rate (nothing moves, and the step is the device's, where the
  device's memory is the host's: a CPU rank).
- tensor parallelism: the plan's allreduces of activations, in the forward and the backward, on
  the critical path (each waits for its matmul and the next op waits for it).
- pipeline (P stages, M micro-batches, the layout's ``--pipeline-schedule``): the schedule
  simulated action by action over the model's chunks (``mpt.plan.schedule``: P stages, or 2P
  chunks under a looped schedule, each with its own forward, backward and send of its output):
  the busiest rank's M micro-batches of compute, the bubble it waits for the others, and the
  sends on the critical path, taken as exposed; on a calibrated device each action also costs
  the schedule's own work measured there (``Device.pipeline_overhead``: "pipeline actions",
  in the compute).
- data parallelism: the collectives of the backend's ``step_traffic`` (in the dtype they
  send: ``--grad-compression``'s cast, priced by that dtype's calibrated fit where there is
  one), less the part that hides behind its window (the backward, the whole step, or none)
  times the device's ``overlap``.

Memory per rank, at the higher of two peaks: the backend's ``estimate_row`` of its
``estimate_memory`` for the stage's blocks at the shard size (what it offloads counted where
the device's memory is the host's, else checked against the host's memory per rank, and an
offloaded optimizer's temporaries on the host), its tp-split parameters over T, and its
``estimate_buffers`` (DDP's buckets, fsdp's prefetched unit and reduce-scatter input or, under
a pipeline, its stage kept gathered, Horovod's copies and fusion buffer, ZeRO-1/2/3's
buckets and ZeRO-3's gathered parameters); under a pipeline what torch's stage keeps from
step to step, per micro-batch (its receive buffers, the last stage's outputs, zero bubble's
input gradients); the replica's batch of input, which the script holds; then either the
backward's activations (what autograd saves, a tensor two blocks save counted once, the
batch's own saved input not again; under a pipeline the most the schedule keeps at once for
its backwards on that rank, from the simulation: 1F1B min(M, P - s) micro-batches on stage
s, GPipe M, the looped schedules their warm-up's chunks; and the sends it keeps until its
step ends, GPipe its backward's, the looped schedules every one; zero bubble's gradients
kept from I to W; the last stage's outputs merged; under tp, the activations of split ops
over T by their share of the forward's bytes; 16-bit under a cast model) or the optimizer
step's temporaries, less what the backward frees before the step (fsdp's gathered units). Not
counted: the allocator's slack, the process, the target, DeepSpeed ZeRO-0's buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from mpt.backends import get_backend
from mpt.comm import GradComm
from mpt.estimate import MemoryEstimate, parameter_counts
from mpt.parallel import ParallelPlan
from mpt.parallel.traffic import Traffic
from mpt.pipeline.config import LOOPED, ZERO_BUBBLE
from mpt.plan.network import Cluster, collective, send
from mpt.plan.profiles import Device, interpolate
from mpt.plan.schedule import ChunkCost, simulate
from mpt.plan.workload import BlockCost, Op, Workload
from mpt.precision import PrecisionSpec
from mpt.precision.base import dtype_name


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """One way to run the model on the cluster, as mpt would lay it out."""

    backend: str
    """``--backend``."""
    options: Mapping[str, Any]
    """The backend's options the layout sets (``zero_stage``, ``replicate``)."""
    plan: ParallelPlan
    """The mesh ``RunConfig.layout`` built for it."""
    microbatches: int
    """Micro-batches per step: a pipeline's, or without one ``--accumulate``'s."""
    micro_batch: int
    """Samples per micro-batch on each rank."""
    schedule: str
    """``--pipeline-schedule`` (mpt's default where there is no pipeline)."""
    flags: tuple[str, ...]
    """The `mpt launch` flags that choose it."""
    comm: GradComm = field(default_factory=GradComm)
    """Its ``--grad-compression`` (the backend's default buckets)."""

    @property
    def label(self) -> str:
        return " ".join(self.flags)


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    """What the cost model says of one layout."""

    layout: Layout
    """The layout."""
    memory: Held
    """What one rank of the fullest stage holds at its peak."""
    capacity: float
    """Bytes one rank may fill."""
    host_capacity: float
    """Bytes of host memory one rank may fill with what it offloads (``Device.host_memory``),
    beside a device with memory of its own."""
    compute: float
    """Seconds of forward, backward, optimizer step, the backend's buffer copies, what it
    offloads moving between host and device, and the backend's own work."""
    exposed: float
    """Seconds of communication not hidden behind compute."""
    hidden: float
    """Seconds of data-parallel communication hidden behind compute."""
    bubble: float
    """Seconds the pipeline's stages wait for each other."""
    link_bytes: float
    """Bytes the busiest node's link carries per step (each direction)."""
    rank_bytes: float
    """Bytes each rank sends per step."""
    terms: Mapping[str, float]
    """Every term of the step, in seconds, by name."""
    limiter: str
    """The one thing that limits the layout."""

    @property
    def total_memory(self) -> int:
        """The per-rank peak (``Held.peak``)."""
        return self.memory.peak

    @property
    def host_short(self) -> int:
        """Bytes of what a rank offloads that do not fit in its host memory (0 where they
        do, and where the device's memory is the host's: there they are in the peak)."""
        if self.memory.offloaded or not self.memory.row.host:
            return 0
        return max(0, int(self.memory.row.host - self.host_capacity))

    @property
    def short(self) -> int:
        """Bytes that do not fit on a rank, on its device and in its host memory (0 where
        all fit)."""
        return max(0, int(self.total_memory - self.capacity)) + self.host_short

    @property
    def step(self) -> float:
        return self.compute + self.exposed + self.bubble


@dataclass(frozen=True, kw_only=True, slots=True)
class OwnWork:
    """A backend's own work, beyond the plain step and the copies the plan prices, under some
    of its options, as a calibration timed it at one rank (``planner.own_work``)."""

    backend: str
    """``--backend``."""
    options: Mapping[str, Any]
    """The options it was timed under: a layout with the same values of these pays it."""
    per_microbatch: float
    """Seconds it adds to each micro-batch."""
    per_step: float
    """Seconds it adds once a step."""

    def charged(self, layout: Layout) -> bool:
        """Whether ``layout`` runs the backend under these options."""
        return layout.backend == self.backend and all(
            layout.options.get(key) == value for key, value in self.options.items())


@dataclass(frozen=True, kw_only=True, slots=True)
class Model:
    """The model as the cost model needs it."""

    net: nn.Module
    """The model, on the meta device."""
    stages: Callable[[int], list[list[str]]]
    """The block names of each of n pipeline chunks (mpt's own split: P stages, or 2P chunks
    under a looped schedule)."""
    workload: Callable[[int], Workload]
    """The model's cost at a micro-batch size (cached by the caller)."""
    tp_plan: Mapping[str, str]
    """Module name -> tp style."""
    optimizer_states: int
    """fp32 values the optimizer keeps per parameter."""
    optimizer: str = "adam"
    """``--optimizer``: which calibrated step cost applies."""
    compute_scales: Mapping[int, float] = field(default_factory=dict)
    """By micro-batch size: the model's own forward and backward as a calibration timed them
    over what the ops price on that device (``measured_scales``); empty: the ops alone."""
    update_seconds: float | None = None
    """Seconds per parameter of the model's own optimizer step and ``zero_grad`` as a
    calibration timed them; None: the device's figure for ``optimizer``."""
    own_work: tuple[OwnWork, ...] = ()
    """What each backend with options that a calibration timed at one rank
    (``MeasuredStep.alone``) adds beyond what the plan prices there; a pipeline stage pays its
    share of the parameters."""

    def compute_scale(self, micro_batch: int) -> float:
        """``compute_scales`` at ``micro_batch``: linear in the log of the size between two
        sizes timed, the nearest one's beyond them; 1 where none was timed."""
        if not self.compute_scales:
            return 1.0
        return interpolate(sorted(self.compute_scales.items()), micro_batch)


def activation_width(spec: PrecisionSpec) -> float:
    """Bytes of an activation in ``spec`` over its fp32 bytes (what meta records): a model
    cast to 16 bits (O2, O3) runs every op in 16 bits; under autocast only the matmuls are,
    and the rest is counted in fp32 (norms and softmax are; the rest varies: an upper bound)."""
    return 1.0 if spec.autocast else spec.compute.itemsize / 4


def op_seconds(op: Op, cluster: Cluster, spec: PrecisionSpec, tp: int) -> float:
    """One op's time: its roofline, split ops over the tp ranks, plus the op's overhead."""
    device = cluster.device
    matmul = op.flops > 0
    width = spec.compute.itemsize / 4 if matmul else activation_width(spec)
    dtype = dtype_name(spec.compute) if matmul else "float32"
    seconds = max(op.flops / device.matmul_flops(dtype, op.shape),
                  op.bytes * width / device.memory_bandwidth)
    return (seconds / tp if op.split else seconds) + device.op_overhead


def _pass_seconds(ops: tuple[Op, ...], cluster: Cluster, spec: PrecisionSpec, tp: int) -> float:
    return sum(op_seconds(op, cluster, spec, tp) for op in ops)


def _block_seconds(block: BlockCost, cluster: Cluster, spec: PrecisionSpec, tp: int
                   ) -> tuple[float, float]:
    """A block's forward and backward seconds. The backward's ops are not attributed to
    modules, so they split over the tp ranks in the forward's proportion."""
    forward = _pass_seconds(block.forward, cluster, spec, tp)
    whole = _pass_seconds(block.forward, cluster, spec, 1)
    backward = _pass_seconds(block.backward, cluster, spec, 1)
    return forward, backward * (forward / whole if whole else 1.0)


def _split_share(block: BlockCost) -> float:
    """The share of the block's forward bytes that tp splits."""
    total = sum(op.bytes for op in block.forward)
    return sum(op.bytes for op in block.forward if op.split) / total if total else 0.0


def predict(layout: Layout, model: Model, cluster: Cluster, spec: PrecisionSpec) -> Prediction:
    """The cost model's answer for ``layout``."""
    plan, tp = layout.plan, layout.plan.tp
    work = model.workload(layout.micro_batch)
    by_name = {block.name: block for block in work.blocks}
    per_rank = LOOPED.get(layout.schedule, 1) if plan.pp > 1 else 1
    # each action of the schedule costs its own work beyond its compute (calibrated)
    action = cluster.device.pipeline_overhead.get(layout.schedule, 0.0) if plan.pp > 1 else 0.0
    split = layout.schedule in ZERO_BUBBLE  # the backward is two actions
    chunks = (model.stages(plan.pp * per_rank) if plan.pp > 1
              else [[b.name for b in work.blocks]])
    passes, tp_times, costs = [], [], []
    for index, names in enumerate(chunks):
        blocks = [by_name[name] for name in names]
        timed = [_block_seconds(b, cluster, spec, tp) for b in blocks]
        forward = model.compute_scale(layout.micro_batch) * sum(f for f, _ in timed)
        backward = model.compute_scale(layout.micro_batch) * sum(b for _, b in timed)
        width = spec.compute.itemsize / 4
        tp_forward = sum(b.tp_forward_bytes for b in blocks) * width
        tp_backward = sum(b.tp_backward_bytes for b in blocks) * width
        tp_time = collective("all_reduce", tp_forward + tp_backward, plan, "tp", cluster)
        # each tp allreduce waits for its matmul and the next op for it: in its own pass
        share = tp_forward / (tp_forward + tp_backward) if tp_time.seconds else 0.0
        out = blocks[-1].output_bytes * activation_width(spec) if index < len(chunks) - 1 else 0
        received = (by_name[chunks[index - 1][-1]].output_bytes * activation_width(spec)
                    if index else 0)
        passes.append((forward, backward))
        tp_times.append(tp_time)
        costs.append(ChunkCost(forward=forward + share * tp_time.seconds + action,
                               backward=backward + (1 - share) * tp_time.seconds
                               + (2 if split else 1) * action,
                               # torch's first stage runs no I (its input needs no
                               # gradient): its W is the whole backward
                               weight=(backward if index == 0 else backward / 2) + action,
                               activations=_saved(blocks, spec, plan.tp, first=index == 0),
                               pending=_pending(blocks, spec, plan.tp) if index else 0,
                               output=int(out),
                               input=int(received), send=send(out, plan, cluster).seconds,
                               merged=0 if out else int(blocks[-1].output_bytes
                                                        * activation_width(spec))))
    m = layout.microbatches
    ranks = [[c for c in range(len(chunks)) if c % plan.pp == r] for r in range(plan.pp)]
    if plan.pp > 1:
        timeline = simulate(layout.schedule, plan.pp, m, costs)
        bubble, sends, activations = timeline.bubble, timeline.sends, timeline.held
        slowest = max(range(plan.pp), key=lambda r: timeline.busy[r])
    else:
        bubble, sends, activations, slowest = 0.0, 0.0, (costs[0].activations,), 0
    mine = ranks[slowest]
    terms: dict[str, float] = {}
    terms["forward"] = m * sum(passes[c][0] for c in mine)
    terms["backward"] = m * sum(passes[c][1] for c in mine)
    terms["tensor-parallel allreduces"] = m * sum(tp_times[c].seconds for c in mine)
    terms["pipeline actions"] = m * len(mine) * (3 if split else 2) * action
    terms["pipeline sends"] = sends
    cut = max((by_name[names[-1]].output_bytes for names in chunks[:-1]), default=0)
    p2p = send(cut * activation_width(spec), plan, cluster)
    stages = [[name for c in held_chunks for name in chunks[c]] for held_chunks in ranks]
    # a pipeline's rank holds the replica's batch; an accumulating script one micro-batch
    data = (m if plan.pp > 1 else 1) * work.input_bytes
    held, trained = _memory(layout, model, stages, ranks, costs, activations, spec, slowest,
                            cluster.device, batch=data)
    stage = model.net if plan.pp == 1 else _stage_module(model, stages[slowest])
    backend = get_backend(layout.backend)
    flow = backend.step_traffic(layout.options, plan, spec, trained, m, module=stage,
                                comm=layout.comm)
    dp_seconds, dp_link, dp_rank, crosses = _data_parallel(flow, plan, cluster)
    # accumulated without a pipeline, gradients are reduced in the last micro-batch's backward
    last = terms["backward"] / (m if plan.pp == 1 else 1)
    window = {"backward": last, "step": terms["forward"] + terms["backward"],
              "none": 0.0}[flow.window] * cluster.device.overlap
    stepped = trained / plan.dp_shard if flow.shards_optimizer else trained
    terms["optimizer step"] = optimizer_seconds(stepped, model, cluster, flow.steps_on_host)
    terms["buffer copies"] = copy_seconds(flow, cluster)
    terms["host-device copies"] = host_seconds(flow, cluster)
    # a pipeline stage's units and parameters: its share of the model's
    share = parameter_counts(stage)[0] / max(1, parameter_counts(model.net)[0])
    terms["the backend's own work"] = share * sum(
        m * own.per_microbatch + own.per_step for own in model.own_work if own.charged(layout))
    terms["backend matmuls"] = matmul_seconds(flow, cluster, spec)
    terms["data-parallel communication"] = max(0.0, dp_seconds - window)
    compute = (terms["forward"] + terms["backward"] + terms["optimizer step"]
               + terms["buffer copies"] + terms["host-device copies"]
               + terms["the backend's own work"]
               + terms["backend matmuls"] + terms["pipeline actions"])
    exposed = (terms["data-parallel communication"] + terms["tensor-parallel allreduces"]
               + terms["pipeline sends"])
    terms["pipeline bubble"] = bubble
    kinds = "/".join(dict.fromkeys(c.kind.replace("_", "-") for c in flow.collectives))
    where = f"{cluster.link.name} node link" if crosses else "in-node link"
    sent = 2 * m * per_rank  # an activation and its gradient per micro-batch and chunk
    prediction = Prediction(
        layout=layout, memory=held, capacity=cluster.device.memory,
        host_capacity=cluster.device.host_memory, compute=compute,
        exposed=exposed,
        hidden=dp_seconds - terms["data-parallel communication"], bubble=bubble,
        link_bytes=dp_link + sent * p2p.link_bytes
        + m * sum(tp_times[c].link_bytes for c in mine),
        rank_bytes=dp_rank + sent * p2p.per_rank + m * sum(tp_times[c].per_rank for c in mine),
        terms=terms, limiter="")
    return _with_limiter(prediction, slowest, f"dp {kinds} ({where})")


def copy_seconds(flow: Traffic, cluster: Cluster) -> float:
    """The backend's copies into and out of its collectives' buffers (``Traffic.copies``):
    each byte read and written once, at the memory bandwidth (which counts both: the
    calibration's is twice a 64 MiB copy's bytes over its time, a datasheet's HBM's)."""
    return 2 * flow.copies / cluster.device.memory_bandwidth


def host_seconds(flow: Traffic, cluster: Cluster) -> float:
    """What offloading moves between host and device (``Traffic.host_copies``) at the
    device's host link, never hidden (torch and DeepSpeed start these copies on another
    stream, but the next gather or the step waits for them). Where the device's memory is
    the host's: copies in memory into a backend's own host buffers (``host_buffers``), as
    ``copy_seconds`` prices them, else nothing."""
    device = cluster.device
    if device.host_link is None:  # the device's memory is the host's
        return 2 * flow.host_copies / device.memory_bandwidth if flow.host_buffers else 0.0
    return flow.host_copies / device.host_link


def matmul_seconds(flow: Traffic, cluster: Cluster, spec: PrecisionSpec) -> float:
    """The backend's own matmuls (``Traffic.matmuls``), in the gradients' dtype, each priced
    as a model's matmul is (``op_seconds``)."""
    reduced = replace(spec, compute=spec.reduce)
    return sum(op_seconds(Op(flops=2 * rows * inner * columns,
                             bytes=4 * (rows * inner + inner * columns + rows * columns),
                             shape=(rows, inner, columns)), cluster, reduced, 1)
               for rows, inner, columns in flow.matmuls)


def optimizer_seconds(parameters: float, model: Model, cluster: Cluster,
                      on_host: bool = False) -> float:
    """The optimizer step over ``parameters``: torch's step as calibrated (per parameter, its
    own path and passes), else its bytes (read weight, gradient and states, write weight and
    states) at the memory bandwidth. ``on_host``: the step of an offloaded optimizer, on the
    host's cores (the same as the device's where its memory is the host's): the host's
    calibrated step, else those bytes at the host's memory bandwidth."""
    device = cluster.device
    streamed = parameters * 4 * (3 + 2 * model.optimizer_states)
    if on_host and not device.shares_host_memory:
        if model.optimizer in device.host_update_seconds:
            return parameters * device.host_update_seconds[model.optimizer]
        return streamed / device.host_bandwidth
    if model.update_seconds is not None:
        return parameters * model.update_seconds
    if model.optimizer in device.update_seconds:
        return parameters * device.update_seconds[model.optimizer]
    return streamed / device.memory_bandwidth


def modelled_compute(model: Model, cluster: Cluster, spec: PrecisionSpec, micro_batch: int
                     ) -> float:
    """The whole model's forward and backward on one rank, op by op (no tp, no scale)."""
    timed = [_block_seconds(b, cluster, spec, 1) for b in model.workload(micro_batch).blocks]
    return sum(f + b for f, b in timed)


def _data_parallel(flow: Traffic, plan: ParallelPlan, cluster: Cluster
                   ) -> tuple[float, float, float, bool]:
    """Seconds, busiest link's bytes and a rank's bytes of the backend's collectives."""
    seconds = link = rank = 0.0
    crosses = False
    for c in flow.collectives:
        moved = collective(c.kind, c.size, plan, c.axis, cluster, c.library, c.dtype, c.calls)
        seconds, link, rank = seconds + moved.seconds, link + moved.link_bytes, \
            rank + moved.per_rank
        crosses = crosses or moved.crosses
    return seconds, link, rank, crosses


def _with_limiter(p: Prediction, stage: int, dp_words: str) -> Prediction:
    """``p`` with its limiter: memory where it does not fit, else its largest term."""
    if p.host_short:
        return replace(p, limiter=f"host memory: {p.host_short / 2**30:.2f} GiB short per "
                                  "rank")
    if p.short:
        return replace(p, limiter=f"memory: {p.short / 2**30:.2f} GiB short per rank")
    candidates = {"compute": p.compute, dp_words: p.terms["data-parallel communication"],
                  "tp all-reduces": p.terms["tensor-parallel allreduces"],
                  "pipeline sends": p.terms["pipeline sends"], "pipeline bubble": p.bubble}
    name = max(candidates, key=lambda k: candidates[k])
    suffix = f" (stage {stage})" if p.layout.plan.pp > 1 and name == "compute" else ""
    return replace(p, limiter=name + suffix)


@dataclass(frozen=True, kw_only=True, slots=True)
class Held:
    """What one rank of a stage holds at its peak."""

    row: MemoryEstimate
    """Parameters, gradients and optimizer state (the backend's ``estimate_memory`` row)."""
    activations: int
    """What autograd keeps for the backward, over the micro-batches in flight."""
    buffers: int
    """What the backend holds beyond its row (``Backend.estimate_buffers``; on a device with
    memory of its own what it allocates whole, ``Buffers.reserved``, too), and under a
    pipeline torch's receive buffers."""
    transient: int
    """The optimizer step's temporaries (``_step_transient``)."""
    released: int
    """What the backward holds (in the row and the buffers) and frees before the step (fsdp's
    gathered units)."""
    between: int
    """What the backend holds only between the backward and the step (``Buffers.between``)."""
    stepping: int
    """What the backend allocates after the backward and holds through the step
    (``Buffers.stepping``); like ``transient``, 0 where the optimizer steps on a host that is
    not the rank's memory."""
    offloaded: int
    """What offloading keeps in host memory (the row's ``host``) where that is the rank's own
    memory (a CPU rank): counted in the peak; 0 on a device with memory of its own."""

    batch: int
    """The batch of input the script holds through its step: under a pipeline the replica's
    (each pipeline rank loads it), else one micro-batch's."""
    accumulating: int
    """Beside the activations, over several micro-batches: a backward after the first computes
    each weight's gradient into a new tensor and adds it to the one held (autograd's
    ``AccumulateGrad``), the largest weight's at most; none where the backend's row counts it
    (``Backend.fresh_gradient_in_row``)."""

    @property
    def before_step(self) -> int:
        """The peak up to the optimizer step: the row, the buffers and the batch, with the
        backward's activations or what lies between it and the step (``between``)."""
        return self._held + max(self.activations + self.accumulating, self.between)

    @property
    def in_step(self) -> int:
        """The optimizer step's peak: the row, the buffers and the batch, without what the
        backward released, with the step's temporaries and ``stepping``."""
        return self._held + self.transient + self.stepping - self.released

    @property
    def peak(self) -> int:
        """The higher of ``before_step`` and ``in_step``."""
        return max(self.before_step, self.in_step)

    @property
    def _held(self) -> int:
        return self.row.device + self.offloaded + self.buffers + self.batch


def _saved(blocks: list[BlockCost], spec: PrecisionSpec, tp: int, first: bool) -> int:
    """What autograd keeps of one micro-batch through ``blocks`` (a chunk's; ``first``: the
    model's first): each block's saved tensors, a split op's over T, in the precision's
    width."""
    # A later chunk's first block receives its input: the previous block's copy is
    # elsewhere. The model's first block saves the batch itself (``Held.batch``) where it
    # computes in fp32; in 16 bits it saves a cast copy.
    batch_saved = first and spec.compute == torch.float32 and not spec.autocast
    return int(activation_width(spec) * sum(
        (b.activations - (b.shared_input if i or batch_saved else 0))
        * (1 - _split_share(b) + _split_share(b) / tp) for i, b in enumerate(blocks)))


def _pending(blocks: list[BlockCost], spec: PrecisionSpec, tp: int) -> int:
    """What a zero-bubble I of one micro-batch through ``blocks`` keeps for its W: the
    gradient of each weighted op's output (a split op's over T), in the precision's width."""
    return int(activation_width(spec) * sum(
        op.results[0] / (tp if op.split else 1)
        for b in blocks for op in b.forward if op.weighted and op.results))


def _memory(layout: Layout, model: Model, stages: list[list[str]], ranks: list[list[int]],
            costs: list[ChunkCost], activations: tuple[int, ...], spec: PrecisionSpec,
            slowest: int, device: Device, batch: int) -> tuple[Held, float]:
    """What a rank of the fullest stage holds, and the parameters a rank of stage ``slowest``
    (the one whose time the step is) trains: its tp share. ``stages``: each pipeline rank's
    block names; ``ranks``: the chunks (of ``costs``) it runs; ``activations``: its peak of
    what its backwards need (the schedule's)."""
    plan = layout.plan
    cls = get_backend(layout.backend)
    flow = cls.step_traffic(layout.options, plan, spec, 0.0)
    own = device.shares_host_memory
    # an optimizer stepping on the host keeps its temporaries and buffers there
    stepping = own or not flow.steps_on_host
    best: Held | None = None
    trained = 0.0
    for index, names in enumerate(stages):
        stage = _stage_module(model, names)
        share, params = _tp_share(stage, model, plan.tp)
        rows = cls.estimate_memory(stage, spec, model.optimizer_states, plan.dp_shard,
                                   dict(layout.options))
        row = _scaled(cls.estimate_row(rows, layout.options), share)
        beyond = cls.estimate_buffers(stage, spec, row, share, plan, layout.options,
                                      layout.comm, microbatches=layout.microbatches)
        kept = sum(_stage_buffers(costs[c], layout) for c in ranks[index])
        largest = max((p.numel() for p in stage.parameters() if p.requires_grad), default=0)
        found = Held(row=row, activations=activations[index], batch=batch,
                     accumulating=int(largest * spec.params.itemsize * share)
                     if layout.microbatches > 1
                     and not cls.fresh_gradient_in_row(layout.options) else 0,
                     buffers=beyond.held + kept + (0 if own else beyond.reserved),
                     transient=_step_transient(
                         stage, model.optimizer_states, share,
                         plan.dp_shard if flow.shards_optimizer else 1,
                         device.device_type, flow.flat_step) if stepping else 0,
                     released=beyond.released, between=beyond.between,
                     stepping=beyond.stepping if stepping else 0,
                     offloaded=row.host if own else 0)
        if best is None or found.peak > best.peak:
            best = found
        if index == slowest:
            trained = params * share
    assert best is not None  # at least one stage
    return best, trained


def _stage_buffers(chunk: ChunkCost, layout: Layout) -> int:
    """What torch's ``PipelineStage`` of ``chunk`` keeps from one step into the next, for each
    micro-batch: its receive buffers (allocated at its first step: its input where another
    chunk sends it, the gradient of its output where another chunk sends that back); the last
    chunk's output (``output_chunks``, what it merges); under a zero-bubble schedule its
    input's gradient, left on the receive buffer's ``.grad``. The next step clears the last
    two."""
    if layout.plan.pp == 1:
        return 0
    inputs = chunk.input * (2 if layout.schedule in ZERO_BUBBLE else 1)
    return layout.microbatches * (inputs + chunk.output + chunk.merged)


def _stage_module(model: Model, names: list[str]) -> nn.Module:
    """The blocks ``names`` of ``model`` as one module (a block not found: the whole net)."""
    modules = dict(model.net.named_modules())
    return nn.ModuleList(modules.get(n, model.net) for n in names)


def _step_transient(stage: nn.Module, states: int, share: float, shards: int,
                    device_type: str, flat: float | None = None) -> int:
    """Adam's temporaries while it steps the ``shards``-th part of each parameter it holds,
    from torch.optim.adam: on CUDA (its foreach path) sqrt(v) of every stepped tensor at once;
    elsewhere (its single-tensor path) sqrt(v) and its quotient of one tensor at a time, in
    fp32. Where the backend steps its own flat tensors of at most ``flat`` elements
    (``Traffic.flat_step``), each is one such tensor. Other optimizers step in place: none
    counted."""
    if states != 2:
        return 0
    sizes = [p.numel() * share / shards for p in stage.parameters() if p.requires_grad]
    if flat is not None:  # the rank's part in flat pieces
        sizes = [min(sum(sizes), flat)]
    if device_type == "cuda":
        return int(4 * sum(sizes))
    return int(2 * 4 * max(sizes, default=0))


def _tp_share(stage: nn.Module, model: Model, tp: int) -> tuple[float, int]:
    """The share of the stage's parameters a tp rank holds, and the stage's parameters."""
    owners = {id(m): n for n, m in model.net.named_modules()}
    split = {id(p) for m in stage.modules() if owners.get(id(m)) in model.tp_plan
             for p in m.parameters()}
    params = {id(p): p.numel() for p in stage.parameters()}
    total = sum(params.values())
    if tp == 1 or not total:
        return 1.0, total
    cut = sum(n for key, n in params.items() if key in split)
    return (total - cut + cut / tp) / total, total


def _scaled(row: MemoryEstimate, share: float) -> MemoryEstimate:
    """``row`` with every part times ``share`` (a tp rank's share of the parameters)."""
    return MemoryEstimate(label=row.label, parameters=int(row.parameters * share),
                          gradients=int(row.gradients * share),
                          optimizer=int(row.optimizer * share), host=int(row.host * share))
