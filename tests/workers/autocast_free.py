"""Worker: one model trained with ``rt.autocast()`` and its copy trained without, side by side.

argv: OUT_DIR. Both copies start from the same weights and see the same batches: ``ctx`` runs
forward and loss under ``rt.autocast()``, ``bare`` as a one-device script does, with no
context. Each rank writes OUT_DIR/rank{r}.json: both per-step loss curves, the dtypes the bare
copy's hidden layer computed in and its output left in, and the first loss of the same model in
plain fp32 torch on this rank's first batch.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import mpt

STEPS, ROWS, FEATURES, CLASSES = 8, 16, 12, 5

torch.manual_seed(0)
base = nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU(), nn.Linear(32, CLASSES))
ctx, bare = copy.deepcopy(base), copy.deepcopy(base)
hidden: list[str] = []
bare[0].register_forward_hook(lambda _m, _i, out: hidden.append(str(out.dtype)))

with mpt.Runtime() as rt:
    generator = torch.Generator().manual_seed(1 + rt.rank)
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))
    inputs = [torch.randn(ROWS, FEATURES, generator=generator) for _ in range(STEPS)]
    batches = [(x, (x @ teacher).argmax(dim=1)) for x in inputs]  # learnable labels
    plain = F.cross_entropy(base(batches[0][0]), batches[0][1]).item()  # fp32, no mpt
    ctx, opt_ctx = rt.setup(ctx, torch.optim.SGD(ctx.parameters(), lr=0.5), name="ctx")
    bare, opt_bare = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.5), name="bare")
    curves: dict[str, list[float]] = {"ctx": [], "bare": []}
    out_dtype = ""
    for x, y in batches:
        x, y = x.to(rt.device), y.to(rt.device)
        with rt.autocast():
            loss = F.cross_entropy(ctx(x), y)
        rt.backward(loss, model=ctx)
        rt.step(opt_ctx)
        curves["ctx"].append(loss.item())
        output = bare(x)
        out_dtype = str(output.dtype)
        loss = F.cross_entropy(output, y)
        rt.backward(loss, model=bare)
        rt.step(opt_bare)
        curves["bare"].append(loss.item())
    (Path(sys.argv[1]) / f"rank{rt.rank}.json").write_text(json.dumps({
        **curves, "hidden": sorted(set(hidden)), "output": out_dtype, "plain_fp32": plain}))
