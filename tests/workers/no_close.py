"""A script that trains one step and never calls rt.close(): it must still exit cleanly."""

import torch, mpt
from torch import nn
rt = mpt.Runtime()
m = nn.Linear(4, 2)
m, opt = rt.setup(m, torch.optim.SGD(m.parameters(), lr=0.1))
rt.backward(m(torch.randn(3, 4)).sum()); rt.step()
