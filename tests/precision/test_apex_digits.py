"""O1/O2/O3 train the digits example's model about as well as fp32 (one process, CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import mpt

EXAMPLE = Path(__file__).parents[2] / "examples" / "digits.py"
TOLERANCE = 3.0
"""Percentage points of held-out accuracy an opt level may lose against fp32."""


def digits_datasets():
    spec = importlib.util.spec_from_file_location("digits_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.datasets(0)


def held_out_accuracy(precision: str, train, test, epochs: int = 8) -> float:
    torch.manual_seed(0)
    rt = mpt.Runtime(precision=precision, env={})
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))
    # SGD: Adam's eps (1e-8) is zero in fp16, so pure-fp16 O3 with Adam divides by zero.
    model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    loader = rt.setup_dataloader(DataLoader(train, batch_size=32, shuffle=True))
    for _ in range(epochs):
        for x, y in loader:
            with rt.autocast():
                loss = nn.functional.cross_entropy(model(x).float(), y)
            rt.backward(loss)
            rt.step()
    model.eval()
    x, y = test.tensors
    with torch.no_grad(), rt.autocast():
        correct = (model(x).argmax(dim=1) == y).float().mean().item()
    rt.close()
    return 100.0 * correct


def test_opt_levels_reach_fp32_accuracy_within_three_points():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train, test = digits_datasets()
        accuracy = {p: held_out_accuracy(p, train, test) for p in ("fp32", "O1", "O2", "O3")}
    finally:
        torch.set_num_threads(threads)
    assert accuracy["fp32"] >= 95.0, accuracy
    for level in ("O1", "O2", "O3"):
        assert accuracy[level] >= accuracy["fp32"] - TOLERANCE, accuracy
    print(accuracy)
