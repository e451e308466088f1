"""The pipeline schedules simulated action by action, against their closed forms: GPipe's and
1F1B's (M + P - 1) micro-batches, interleaved 1F1B's bubble over V chunks per rank (Megatron-LM,
Narayanan et al. 2021), zero bubble's below it, and what each keeps for its backwards."""

from __future__ import annotations

import pytest

from mpt.plan.schedule import ChunkCost, order, simulate

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb")


def _alike(stages: int, per_rank: int, send: float = 0.0) -> list[ChunkCost]:
    """Chunks of one stage's forward 1 s and backward 2 s (input and weight gradients 1 s
    each) split over ``per_rank`` chunks, each keeping 100 bytes a micro-batch per chunk."""
    return [ChunkCost(forward=1 / per_rank, backward=2 / per_rank, weight=1 / per_rank,
                      activations=100 // per_rank, send=send)
            for _ in range(stages * per_rank)]


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_gpipe_and_1f1b_take_m_plus_p_minus_1_micro_batches(stages: int, microbatches: int
                                                             ) -> None:
    for schedule in ("gpipe", "1f1b"):
        timeline = simulate(schedule, stages, microbatches, _alike(stages, 1))
        assert timeline.step == pytest.approx((microbatches + stages - 1) * 3)
        assert timeline.bubble == pytest.approx((stages - 1) * 3)
        assert timeline.busy == pytest.approx((microbatches * 3,) * stages)


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (4, 8), (4, 16)])
def test_interleaving_two_chunks_halves_the_bubble_and_zero_bubble_cuts_it_further(
        stages: int, microbatches: int) -> None:
    looped = simulate("interleaved-1f1b", stages, microbatches, _alike(stages, 2))
    assert looped.bubble == pytest.approx((stages - 1) * 3 / 2)
    zero = simulate("interleaved-zb", stages, microbatches, _alike(stages, 2))
    assert zero.bubble < looped.bubble / 2


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (4, 8)])
def test_what_each_schedule_keeps_for_its_backwards(stages: int, microbatches: int) -> None:
    """GPipe every micro-batch on every stage; torch's 1F1B min(M, P - s) on stage s;
    interleaved 1F1B on rank r (P - r - 1) x 2 + (V - 1) x P + 1 chunks of 1/V of a stage."""
    assert simulate("gpipe", stages, microbatches, _alike(stages, 1)).held == (
        (100 * microbatches,) * stages)
    assert simulate("1f1b", stages, microbatches, _alike(stages, 1)).held == tuple(
        100 * min(microbatches, stages - s) for s in range(stages))
    assert simulate("interleaved-1f1b", stages, microbatches, _alike(stages, 2)).held == tuple(
        50 * ((stages - r - 1) * 2 + stages + 1) for r in range(stages))


def test_sends_on_the_critical_path_are_counted_apart_from_the_bubble() -> None:
    """GPipe's first forward and last backward cross each cut once more than the others
    overlap: 2 (P - 1) sends. A 1F1B rank waits for each send to arrive before its next
    action (torch waits for it with the next receive): more of them lie on the path."""
    timeline = simulate("gpipe", 4, 8, _alike(4, 1, send=0.25))
    assert timeline.sends == pytest.approx(2 * 3 * 0.25)
    assert timeline.bubble == pytest.approx(3 * 3)
    waiting = simulate("1f1b", 4, 8, _alike(4, 1, send=0.25))
    assert waiting.bubble == pytest.approx(3 * 3)
    assert waiting.sends > 8 * 0.25  # at least each of a middle stage's forward sends


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_rank_runs_each_of_its_chunks_forward_and_backward_once_per_micro_batch(
        schedule: str) -> None:
    per_rank = 2 if schedule.startswith("interleaved") else 1
    actions = order(schedule, 4, 8)
    for rank, mine in enumerate(actions):
        chunks = {c for _, c, _ in mine}
        assert chunks == {rank + 4 * k for k in range(per_rank)}
        forwards = sorted((c, i) for kind, c, i in mine if kind == "F")
        backwards = sorted((c, i) for kind, c, i in mine if kind in "BI")
        assert forwards == backwards == sorted((c, i) for c in chunks for i in range(8))


def test_1f1b_follows_torchs_runtime_loop() -> None:
    """torch's Schedule1F1B._step_microbatches: stage s runs min(M, P - s) forwards, then a
    backward and a forward in turn, then the backwards left."""
    assert order("1f1b", 2, 4) == (
        (("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("F", 0, 3),
         ("B", 0, 2), ("B", 0, 3)),
        (("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 1, 2), ("B", 1, 2),
         ("F", 1, 3), ("B", 1, 3)))


def test_the_calibration_measures_each_schedules_own_work_per_action(free_port) -> None:
    """Two gloo processes run torch's schedules over one-Linear chunks: each action costs
    something beyond its compute and sends (its calls into the stage, autograd and gloo), and
    less than the 50 ms that would mean a hang or a wrong count."""
    from plan_pipeline_probe import measure

    found = measure(free_port)
    assert set(found) == set(SCHEDULES)
    assert all(0 < seconds < 0.05 for seconds in found.values()), found


def test_each_action_pays_the_calibrated_overhead() -> None:
    """A device that measured 1 ms per action: a 1F1B step of 2 alike stages and 4
    micro-batches runs 8 actions a rank and (4 + 2 - 1) x 2 on the critical path, zero bubble
    3 per micro-batch and chunk; the compute names them apart."""
    from dataclasses import replace

    import torch
    from plan_models import deep

    from mpt.estimate import meta_model
    from mpt.plan.network import Cluster
    from mpt.plan.planner import plan
    from mpt.plan.profiles import device_profile, link_profile

    h100 = device_profile("h100-sxm")

    def piped(device, schedule: str):
        result = plan(meta_model(deep), Cluster(nodes=1, gpus=2, device=device,
                                                link=link_profile("1gbit")),
                      precision="fp32", batch=16, input_shape=[1024], input_dtype=torch.float32)
        return next(p for p in result.fitting if p.layout.backend == "ddp"
                    and p.layout.plan.pp == 2 and p.layout.microbatches == 4
                    and p.layout.schedule == schedule)

    slow = replace(h100, pipeline_overhead={"1f1b": 1e-3, "interleaved-zb": 1e-3})
    plain, paid = piped(h100, "1f1b"), piped(slow, "1f1b")
    assert paid.terms["pipeline actions"] == pytest.approx(8e-3)
    assert paid.step - plain.step == pytest.approx(10e-3, rel=0.05)
    zero = piped(slow, "interleaved-zb")
    assert zero.terms["pipeline actions"] == pytest.approx(4 * 2 * 3 * 1e-3)
    assert piped(slow, "gpipe").terms["pipeline actions"] == 0  # none measured for it


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_what_a_schedule_keeps_of_its_sends_to_the_steps_end(schedule: str) -> None:
    """torch waits for a looped schedule's sends at the end of its step
    (``_PipelineScheduleRuntime``), for GPipe's backward sends after its last backward, for
    1F1B's before the next: with nothing else held, a rank's peak is M x what it keeps."""
    per_rank = 2 if schedule.startswith("interleaved") else 1
    chunks = [ChunkCost(forward=1.0, backward=2.0, weight=1.0, activations=0,
                        output=10 if c < 2 * per_rank - 1 else 0, input=100 if c else 0,
                        send=0.0) for c in range(2 * per_rank)]
    held = simulate(schedule, 2, 4, chunks).held
    # zero bubble's input gradients stay on the receive buffers past the step: the stage's
    # buffers, not the schedule's
    expected = {"gpipe": (0, 4 * 100), "1f1b": (0, 0),
                "interleaved-1f1b": (4 * (10 + 10 + 100), 4 * (10 + 100 + 100)),
                "interleaved-zb": (4 * (10 + 10), 4 * 10)}
    assert held == expected[schedule]


def test_the_last_stage_merges_its_outputs_after_its_last_action() -> None:
    """torch's last stage merges each micro-batch's output (``output_chunks``, the stage's
    buffers) into one tensor after its last action: M outputs once more."""
    chunks = [ChunkCost(forward=1.0, backward=2.0, weight=1.0, activations=0, send=0.0),
              ChunkCost(forward=1.0, backward=2.0, weight=1.0, activations=0, send=0.0,
                        merged=7)]
    assert simulate("1f1b", 2, 4, chunks).held == (0, 4 * 7)


def test_zero_bubble_keeps_the_gradients_an_i_leaves_its_w() -> None:
    """Each I keeps its chunk's ``pending`` gradients until its W: a rank's peak is its
    chunks' activations and those of the I's whose W has not run yet."""
    def chunks(pending: int) -> list[ChunkCost]:
        return [ChunkCost(forward=1.0, backward=2.0, weight=1.0, activations=100,
                          pending=pending if c else 0, send=0.0) for c in range(4)]

    ops = order("interleaved-zb", 2, 4)
    plain = simulate("interleaved-zb", 2, 4, chunks(0)).held
    held = simulate("interleaved-zb", 2, 4, chunks(10)).held
    for rank, actions in enumerate(ops):
        # replay the rank's own order: activations from F to W, pending from I to W
        holding = peak = 0
        for kind, c, _ in actions:
            holding += {"F": 100, "I": 10 if c else 0, "W": -(100 + (10 if c else 0))}[kind]
            peak = max(peak, holding)
        assert held[rank] == peak > plain[rank]
