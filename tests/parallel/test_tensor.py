"""Tensor-parallel plans checked against the model before any weight moves (no process)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from mpt.errors import UsageError
from mpt.parallel.tensor import Split, restricted, tensor_plan

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig


def gpt(heads: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=11, block=8, layers=2, heads=heads, embed=48))


def refusal(model: nn.Module, size: int) -> str:
    with pytest.raises(UsageError) as caught:
        tensor_plan(model, size)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_gpt_plan_splits_attention_by_heads_and_the_mlp():
    plan = tensor_plan(gpt(), 2)
    assert plan["blocks.1.proj"] == "rowwise" and plan["blocks.0.mlp.0"] == "colwise"
    assert plan["blocks.0.qkv"] == Split("colwise", unit=3 * 12, what="heads")
    assert tensor_plan(gpt(), 4) == plan  # 4 heads over 4 ranks: one each


def test_heads_that_do_not_split_evenly_name_the_module_and_the_sizes_that_work():
    message = refusal(gpt(heads=6), 4)  # 6 heads: 4 ranks would cut one apart
    assert "--tensor-parallel=4" in message and "blocks.0.qkv (colwise) has 6 heads" in message
    assert "pass --tensor-parallel one of 1, 2, 3, 6" in message


def test_a_plan_naming_no_module_lists_those_that_exist():
    model = gpt()
    model.tensor_parallel_plan = lambda: {"blocks.0.attn": "colwise"}  # type: ignore[method-assign]
    message = refusal(model, 2)
    assert "tensor_parallel_plan()=blocks.0.attn" in message
    assert "name one of its Linear modules: blocks.0.qkv, blocks.0.proj" in message


def test_an_unknown_style_and_a_split_norm_are_refused():
    model = gpt()
    model.tensor_parallel_plan = lambda: {"blocks.0.proj": "diagonal"}  # type: ignore[method-assign]
    assert "use one of colwise, rowwise, sequence" in refusal(model, 2)
    model.tensor_parallel_plan = lambda: {"blocks.0.ln1": "colwise"}  # type: ignore[method-assign]
    assert "it is a LayerNorm, and colwise splits a Linear's features" in refusal(model, 2)


def test_a_model_without_a_plan_is_told_what_to_add():
    message = refusal(nn.Sequential(nn.Linear(4, 4)), 2)
    assert "Sequential declares no tensor-parallel plan" in message
    assert "add a method tensor_parallel_plan()" in message


def test_a_pipeline_stage_keeps_the_entries_of_the_modules_it_holds():
    model = gpt()
    stage = nn.Module()
    stage.blocks = nn.ModuleList([model.blocks[0]])
    kept = restricted(model.tensor_parallel_plan(), stage)
    assert sorted(kept) == ["blocks.0.mlp.0", "blocks.0.mlp.2", "blocks.0.proj", "blocks.0.qkv"]
