"""`mpt plan` prices each backend by what the backend declares (``plan_variants``,
``estimate_row``, ``estimate_buffers``, ``step_traffic``) and never branches on its name, so
that a new backend prices itself without an edit to ``mpt/plan``."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

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
    assert get_backend("horovod").plan_variants(4) == [{}]
    assert get_backend("ddp").plan_variants(4) == [{}]
    assert get_backend("deepspeed").plan_variants(4) == [{"zero_stage": s} for s in range(4)]
    assert get_backend("fsdp").plan_variants(4) == [{"replicate": r} for r in (1, 2, 4)]


def test_the_row_and_the_buffers_follow_the_options() -> None:
    net = meta_model(lambda: nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))
    spec = describe("fp32")
    deepspeed = get_backend("deepspeed")
    rows = deepspeed.estimate_memory(net, spec, 2, 4, {})
    assert deepspeed.estimate_row(rows, {"zero_stage": 2}).label == "deepspeed --zero-stage 2"
    assert deepspeed.estimate_buffers(net, spec, rows[0], 1.0, {}) == Buffers()
    row = MemoryEstimate(label="ddp", parameters=10, gradients=10, optimizer=20)
    assert get_backend("apex").estimate_buffers(net, spec, row, 1.0, {}) == Buffers(held=10)
    assert get_backend("horovod").estimate_buffers(net, spec, row, 1.0, {}) == Buffers()
    gathered = get_backend("fsdp").estimate_buffers(net, spec, row, 1.0, {})
    assert gathered.released == 3 * gathered.held > 0


def test_whole_replicas_allreduce_their_gradients_behind_the_backward() -> None:
    flow = get_backend("horovod").step_traffic({}, ParallelPlan(dp_replicate=4),
                                               describe("fp32"), 1e6)
    assert [(c.kind, c.axis, c.size) for c in flow.collectives] == [
        ("all_reduce", "dp_replicate", 4e6)]
    assert flow.window == "backward" and not flow.shards_optimizer
    piped = get_backend("ddp").step_traffic({}, ParallelPlan(pp=2, dp_replicate=2),
                                            describe("fp32"), 1e6)
    assert piped.window == "none"
