"""`mpt plan` prices each backend by what the backend declares (``plan_variants``,
``estimate_row``, ``estimate_buffers``, ``step_traffic``) and never branches on its name, so
that a new backend prices itself without an edit to ``mpt/plan``."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from torch import nn

import mpt.plan
from mpt.backends import get_backend, registered
from mpt.estimate import Buffers, MemoryEstimate, meta_model
from mpt.parallel import ParallelPlan
from mpt.precision import describe

PLAN = Path(mpt.plan.__file__).parent


def _compared(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every string a comparison (``==``, ``in``, ...) of ``tree`` tests against, by line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                for leaf in ast.walk(side):
                    if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str):
                        yield node.lineno, leaf.value


@pytest.mark.parametrize("path", sorted(PLAN.glob("*.py")), ids=lambda p: p.name)
def test_the_planner_branches_on_no_backend_name(path: Path) -> None:
    names = set(registered())
    found = [f"{path.name}:{line}: compares with {value!r}"
             for line, value in _compared(ast.parse(path.read_text())) if value in names]
    assert not found, "\n".join(found)


def test_each_backend_declares_the_options_worth_comparing() -> None:
    assert get_backend("horovod").plan_variants(4, 1) == [{}]
    assert get_backend("ddp").plan_variants(4, 2) == [{}]
    assert get_backend("deepspeed").plan_variants(4, 1) == [
        *({"zero_stage": s} for s in range(4)),
        *({"zero_stage": s, "offload": "optimizer"} for s in (1, 2, 3)),
        {"zero_stage": 3, "offload": "optimizer,parameters"}]
    # without a pipeline fsdp may offload its shards and their step to the host
    assert get_backend("fsdp").plan_variants(4, 1) == [
        *({"replicate": r} for r in (1, 2, 4)),
        *({"replicate": r, "cpu_offload": True} for r in (1, 2, 4))]
    # under a pipeline fsdp keeps each stage gathered over the micro-batches, or reshards,
    # and may offload there too
    assert get_backend("fsdp").plan_variants(2, 2) == [
        {"replicate": 1}, {"replicate": 2},
        {"replicate": 1, "reshard_after_forward": True},
        {"replicate": 2, "reshard_after_forward": True},
        {"replicate": 1, "cpu_offload": True}, {"replicate": 2, "cpu_offload": True}]


def test_the_row_and_the_buffers_follow_the_options() -> None:
    net = meta_model(lambda: nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))
    spec = describe("fp32")
    deepspeed = get_backend("deepspeed")
    rows = deepspeed.estimate_memory(net, spec, 2, 4, {})
    assert deepspeed.estimate_row(rows, {"zero_stage": 2}).label == "deepspeed --zero-stage 2"
    alone, four = ParallelPlan(), ParallelPlan(dp_shard=4)

    def buffers(name: str, row: MemoryEstimate, plan: ParallelPlan, **options: Any) -> Buffers:
        return get_backend(name).estimate_buffers(net, spec, row, 1.0, plan, options)

    # after the backward ZeRO-1's bucket of every gradient and the rank's quarter flattened
    # in fp32 for the optimizer, which keeps the quarter through its step; in bf16 the
    # bucket in bf16, the quarter still in fp32. The model's gradients are let go before it
    trained = 2 * (64 * 64 + 64)
    zero1 = deepspeed.estimate_row(rows, {"zero_stage": 1})
    assert zero1.gradients == 4 * trained
    assert buffers("deepspeed", zero1, four, zero_stage=1) == Buffers(
        between=5 * trained, stepping=trained, released=4 * trained)
    assert get_backend("deepspeed").estimate_buffers(
        net, describe("bf16-mixed"), zero1, 1.0, four, {"zero_stage": 1}) == Buffers(
        between=2 * trained + trained, stepping=trained, released=zero1.gradients)
    # ZeRO-2 accumulating: the reduced partition copied out beside the one kept
    zero2 = deepspeed.estimate_row(rows, {"zero_stage": 2})
    assert get_backend("deepspeed").estimate_buffers(
        net, spec, zero2, 1.0, four, {"zero_stage": 2}, microbatches=4).between == (
        5 * trained + zero2.gradients)
    # offloaded, the buffer of the largest gradient too, counted from the backward on
    assert buffers("deepspeed", zero1, four, zero_stage=1, offload="optimizer") == Buffers(
        held=5 * trained + 4 * 64 * 64, released=8 * trained)
    # ZeRO-3 keeps every parameter gathered through the backward, fills its bucket with every
    # gradient and concatenates a copy of it to reduce-scatter; before the step all but the
    # bucket go, and the step flattens the rank's quarter of the gradients in fp32
    assert buffers("deepspeed", rows[0], four, zero_stage=3) == Buffers(
        held=4 * trained * 3, released=4 * trained * 2, stepping=trained)
    assert buffers("deepspeed", rows[0], four, zero_stage=0) == Buffers()
    row = MemoryEstimate(label="ddp", parameters=10, gradients=10, optimizer=20)
    assert buffers("apex", row, alone) == Buffers(held=10)
    # the gradients' copies and the fusion buffer they fill, at most Horovod's 128 MiB; the
    # rest of the buffer where a device allocates it whole
    assert buffers("horovod", row, alone) == Buffers(held=20, reserved=2**27 - 10)
    big = replace(row, gradients=2**30)
    assert buffers("horovod", big, alone) == Buffers(held=2**30 + 2**27)
    # Linears too small for units of their own: the root's, with nothing beside it; the step
    # frees its gathered weights and whole gradients
    unit = 4 * trained
    assert buffers("fsdp", row, alone) == Buffers(held=0, released=2 * unit)
    # under a pipeline the stage stays gathered, weights and gradients, over the micro-batches
    piped = buffers("fsdp", row, ParallelPlan(pp=2, dp_shard=2))
    whole = 4 * 2 * trained
    assert piped == Buffers(held=whole - unit, released=whole + unit)
    assert buffers("fsdp", row, ParallelPlan(pp=2, dp_shard=2),
                   reshard_after_forward="yes") == Buffers(held=unit, released=3 * unit)


def test_whole_replicas_allreduce_their_gradients_behind_the_backward() -> None:
    flow = get_backend("horovod").step_traffic({}, ParallelPlan(dp_replicate=4),
                                               describe("fp32"), 1e6)
    assert [(c.kind, c.axis, c.size) for c in flow.collectives] == [
        ("all_reduce", "dp_replicate", 4e6)]
    assert flow.window == "backward" and not flow.shards_optimizer
    piped = get_backend("ddp").step_traffic({}, ParallelPlan(pp=2, dp_replicate=2),
                                            describe("fp32"), 1e6)
    assert piped.window == "none"
