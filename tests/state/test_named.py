"""Optimizer state keyed by parameter name survives a change of parameter order."""

from __future__ import annotations

import pytest
import torch

from mpt.errors import UsageError
from mpt.state.named import from_named, to_named


def adam_after_one_step(params: list[torch.nn.Parameter]) -> torch.optim.Adam:
    opt = torch.optim.Adam([{"params": params[:1], "lr": 0.1}, {"params": params[1:]}], lr=0.01)
    sum((p * (i + 1)).sum() for i, p in enumerate(params)).backward()
    opt.step()
    return opt


def test_state_moves_to_an_optimizer_holding_the_parameters_in_another_order():
    a, b, c = (torch.nn.Parameter(torch.full((2,), float(i))) for i in range(3))
    named = to_named(adam_after_one_step([a, b, c]).state_dict(), ["a", "b", "c"])
    assert named["param_groups"][1]["params"] == ["b", "c"]
    # The same parameters, held as [a] and [c, b]: positions 1 and 2 swap.
    target = torch.optim.Adam([{"params": [a], "lr": 0.1}, {"params": [c, b]}], lr=0.01)
    target.load_state_dict(from_named(named, ["a", "c", "b"]))
    # c's moments were made with gradient 3, b's with gradient 2.
    assert torch.allclose(target.state[c]["exp_avg"], torch.full((2,), 0.3))
    assert torch.allclose(target.state[b]["exp_avg"], torch.full((2,), 0.2))
    assert target.param_groups[0]["lr"] == 0.1


def test_a_model_with_other_parameters_is_refused_by_name():
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    named = to_named(adam_after_one_step(params).state_dict(), ["a", "b"])
    with pytest.raises(UsageError, match=r"checkpoint.*z"):
        from_named(named, ["a", "z"])
