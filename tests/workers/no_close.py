"""A script that trains one step and never calls rt.close(): it must still exit cleanly."""

import torch
from torch import nn

import mpt

rt = mpt.Runtime()
model = nn.Linear(4, 2)
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
rt.backward(model(torch.randn(3, 4)).sum())
rt.step()
