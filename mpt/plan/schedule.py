"""A pipeline schedule's step, simulated action by action.

Each pipeline rank runs its actions in the order its schedule gives them: forwards (F), whole
backwards (B) or, under a zero-bubble schedule, the inputs' gradients (I) and later the
weights' (W) of one model chunk for one micro-batch. An action starts when its rank is free
and what it needs has arrived: a forward, the previous chunk's forward of the same
micro-batch (plus a send where another rank ran it); a backward (B or I), the next chunk's
backward of that micro-batch (plus a send back) and its own forward; a W, its I. The step of
the schedule is when the last rank finishes. Run once with the sends and once without, it
splits into the busiest rank's compute, the bubble (ranks waiting for each other) and the
sends on the critical path. The same walk counts what each rank holds for the backward: a
chunk's activations from its forward to the end of its backward (W where there is one), the
sends it keeps until its step ends (``KEPT_SENDS``), the gradients an I keeps for its W
(``ChunkCost.pending``) and, at the end, the last chunk's outputs merged
(``ChunkCost.merged``).

The orders are torch's: GPipe's and 1F1B's from their ``_step_microbatches`` loops (written
out below: torch 2.14's ``pipeline_order`` of 1F1B, used only to draw it, numbers the first
stage's forwards from 1), and the looped schedules' from the schedule classes themselves, by
torch's ``get_schedule_ops``, which builds a schedule without processes to read its actions.
A rank of 1F1B waits for each of its sends to arrive before its next action (torch posts
each send with the next receive and waits for both); the other schedules' sends run beside the
next actions. An action's own work beyond its compute is the caller's to add to its seconds
(the plan adds the calibrated ``Device.pipeline_overhead``). Not modelled: two sends that
share a link at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from mpt.pipeline.config import LOOPED, schedule_class

Action = tuple[str, int, int]
"""(kind: F, B, I or W; model chunk; micro-batch)."""
KEPT_SENDS = {"gpipe": frozenset({"input"}), "interleaved-1f1b": frozenset({"input", "output"}),
              "interleaved-zb": frozenset({"output"})}
"""What a schedule's rank keeps of what it sends until its step ends (torch waits for those
sends only there, and a send keeps its tensor until it is waited for): GPipe the backward's
input gradients (its forward's sends are waited for after the last forward, while autograd
still holds those outputs); the looped schedules (``_PipelineScheduleRuntime``) every send,
outputs and input gradients; 1F1B none (it waits for each send before the next). Zero
bubble's input gradients outlive the step: ``stage_backward_input`` leaves each on its
receive buffer's ``.grad``, which the next step clears; the caller counts them with the
stage's buffers."""
WAITS_FOR_SENDS = frozenset({"1f1b"})
"""Schedules whose rank waits for each send to arrive before its next action: torch's 1F1B
posts a forward's send with the next backward's receive and a backward's with the next
forward's, and waits for both (the others wait for their sends later, in a batch)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkCost:
    """One model chunk (a stage, or one of a rank's two under a looped schedule) for one
    micro-batch."""

    forward: float
    """Seconds of its forward."""
    backward: float
    """Seconds of its whole backward (B = I + W)."""
    weight: float
    """Seconds of the backward's weight gradients (a zero-bubble schedule's W)."""
    activations: int
    """Bytes autograd keeps from its forward to its backward."""
    output: int = 0
    """Bytes of its output, sent to the next chunk (0 for the last)."""
    input: int = 0
    """Bytes of its input's gradient, sent back to the previous chunk (0 for the first)."""
    merged: int = 0
    """Bytes of its output that torch merges with the other micro-batches' into one tensor
    after its last action: the last chunk's. The outputs themselves (``output_chunks``, which
    the stage keeps until its next step) are the caller's to count with the stage's
    buffers."""
    pending: int = 0
    """Bytes its I keeps for its W (a zero-bubble schedule's): the gradients where the
    weights' paths leave the input's."""
    send: float
    """Seconds to send its output to the next chunk, or the gradient of that back (0 for the
    last chunk)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """A schedule's step over the pipeline ranks."""

    step: float
    """Seconds from the first forward to the last rank's last action."""
    without_sends: float
    """The same with every send free: ``step - without_sends`` is the sends' share."""
    busy: tuple[float, ...]
    """Each rank's seconds of compute."""
    held: tuple[int, ...]
    """Each rank's peak bytes of activations kept for backwards, and of the sends it keeps
    to the step's end (``KEPT_SENDS``)."""

    @property
    def bubble(self) -> float:
        """Seconds the busiest rank waits for the others, sends aside."""
        return self.without_sends - max(self.busy)

    @property
    def sends(self) -> float:
        """Seconds the sends add to the step."""
        return self.step - self.without_sends


@functools.cache
def order(schedule: str, stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Every pipeline rank's actions, in the order torch's ``schedule`` runs them."""
    if schedule == "gpipe":
        return tuple(tuple([("F", s, i) for i in range(microbatches)]
                           + [("B", s, i) for i in range(microbatches)])
                     for s in range(stages))
    if schedule == "1f1b":
        return tuple(_one_f_one_b(s, stages, microbatches) for s in range(stages))
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(schedule_class(schedule), stages, microbatches,
                           num_stages_per_rank=LOOPED[schedule])
    return tuple(tuple((a.computation_type.value, a.stage_index, a.microbatch_index)
                       for a in rank if a is not None and a.computation_type.value in "FBIW")
                 for rank in ops)


def _one_f_one_b(stage: int, stages: int, microbatches: int) -> tuple[Action, ...]:
    """torch's ``Schedule1F1B``: min(M, P - s) forwards, then a backward and a forward in
    turn, then the backwards left."""
    warmup = min(microbatches, stages - stage)
    actions = [("F", stage, i) for i in range(warmup)]
    forward = warmup
    for backward in range(microbatches):
        actions.append(("B", stage, backward))
        if forward < microbatches:
            actions.append(("F", stage, forward))
            forward += 1
    return tuple(actions)


def simulate(schedule: str, stages: int, microbatches: int,
             chunks: list[ChunkCost]) -> Timeline:
    """The step of ``schedule`` over ``stages`` ranks and ``microbatches`` micro-batches of
    ``chunks`` (in forward order; chunk c runs on rank c mod P)."""
    actions = order(schedule, stages, microbatches)
    kept, waits = KEPT_SENDS.get(schedule, frozenset()), schedule in WAITS_FOR_SENDS
    step, busy, held = _walk(actions, chunks, kept, waits, sends=True)
    free, _, _ = _walk(actions, chunks, kept, waits, sends=False)
    return Timeline(step=step, without_sends=free, busy=busy, held=held)


def _walk(actions: tuple[tuple[Action, ...], ...], chunks: list[ChunkCost], kept: frozenset[str],
          waits: bool, *, sends: bool) -> tuple[float, tuple[float, ...], tuple[int, ...]]:
    """Run every rank's actions as soon as each may start: the last finish, each rank's
    compute and each rank's peak of activations and kept sends (``kept``: ``KEPT_SENDS``'s)
    held. ``waits``: a rank waits for each of its sends to arrive before its next action
    (``WAITS_FOR_SENDS``); ``sends``: sends take their time (else none)."""
    last = len(chunks) - 1
    done: dict[Action, float] = {}
    position = [0] * len(actions)
    clock = [0.0] * len(actions)
    busy = [0.0] * len(actions)
    holding = [0] * len(actions)
    peak = [0] * len(actions)
    split = {chunk for rank in actions for kind, chunk, _ in rank if kind == "W"}
    while any(p < len(rank) for p, rank in zip(position, actions, strict=True)):
        progressed = False
        for r, rank in enumerate(actions):
            while position[r] < len(rank):
                kind, c, i = rank[position[r]]
                ready = _ready(kind, c, i, last, chunks, done, sends)
                if ready is None:
                    break
                cost = chunks[c]
                seconds = {"F": cost.forward, "B": cost.backward, "W": cost.weight,
                           "I": cost.backward - cost.weight}[kind]
                clock[r] = max(clock[r], ready) + seconds
                busy[r] += seconds
                done[(kind, c, i)] = clock[r]
                if waits and sends:  # until what it sends has arrived
                    clock[r] += (cost.send if kind == "F" and c < last else
                                 chunks[c - 1].send if kind in "BI" and c else 0.0)
                if kind == "F":
                    holding[r] += cost.activations
                elif kind in "BI":  # its input's gradient is sent; its output's outlives it
                    holding[r] += cost.input if "input" in kept else 0
                    holding[r] += cost.output if "output" in kept else 0
                    holding[r] += cost.pending if kind == "I" else 0
                peak[r] = max(peak[r], holding[r])
                if kind == "W" or (kind == "B" and c not in split):
                    holding[r] -= cost.activations + (cost.pending if kind == "W" else 0)
                position[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule's actions wait on each other")
    for r, rank in enumerate(actions):  # the last chunk's outputs merged into one tensor
        merged = sum(chunks[c].merged for kind, c, _ in rank if kind == "F")
        peak[r] = max(peak[r], holding[r] + merged)
    return max(clock), tuple(busy), tuple(peak)


def _ready(kind: str, c: int, i: int, last: int, chunks: list[ChunkCost],
           done: dict[Action, float], sends: bool) -> float | None:
    """When action (kind, c, i) may start, or None while what it needs is not done."""
    if kind == "F":
        needs = [(("F", c - 1, i), chunks[c - 1].send)] if c else []
    elif kind == "W":
        needs = [(("I", c, i), 0.0)]
    else:
        needs = [(("F", c, i), 0.0)]
        if c < last:
            after = ("I", c + 1, i) if ("I", c + 1, i) in done else ("B", c + 1, i)
            needs.append((after, chunks[c].send))
    times = []
    for action, send in needs:
        if action not in done:
            return None
        times.append(done[action] + (send if sends else 0.0))
    return max(times, default=0.0)
