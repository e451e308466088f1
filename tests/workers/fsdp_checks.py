"""What --backend fsdp must do besides training like ddp (the conformance grid checks that).

usage: mpt launch --gpus 2 --backend fsdp [--fsdp-wrap Linear] [--precision P] fsdp_checks.py
       OUT_DIR MODE
MODE clip: fp32, 2 micro-batches per step, gradients clipped below their norm; the same loop in
plain torch on the whole batch runs in this process beside it. Writes what each rank holds.
MODE overflow: fp16-mixed on one Linear(4, 8) whose weight rows 0-3 are rank 0's shard and
4-7 rank 1's; at step 2 rank 1's batch makes output 0's gradient infinite, which reaches rank 0's
shard only. Both ranks must skip that step.
MODE cast: the launch's --precision (O2, O3, ...) on Linear, BatchNorm1d, ReLU, Linear, 3 SGD
steps on one batch; writes the dtypes each layer computes in, those of the optimizer's weights
and gradients, and what a checkpoint keeps.
"""

import functools
import json
import sys
from pathlib import Path

import torch
from common import global_batches, make_model, make_optimizer
from torch import nn
from torch.distributed.fsdp import FSDPModule

import mpt
from mpt.precision import LossScaleConfig

out, mode = Path(sys.argv[1]), sys.argv[2]
STEPS, MICRO, MAX_NORM = 5, 4, 0.05


def local_numel(model: nn.Module) -> int:
    return sum(p.to_local().numel() for p in model.parameters())


def clip() -> dict:
    rt = mpt.Runtime(accumulate=2, quiet=True)
    model = make_model()
    model, _ = rt.setup(model, make_optimizer(model))
    plain = make_model()
    plain_opt = make_optimizer(plain)
    norms, plain_norms = [], []
    for x, y in global_batches(STEPS, rt.world_size * 2 * MICRO):
        for j in range(2):
            start = (rt.rank * 2 + j) * MICRO
            rt.backward(nn.functional.mse_loss(model(x[start:start + MICRO]),
                                               y[start:start + MICRO]))
            norm = rt.clip_grad_norm_(MAX_NORM)
            if norm is not None:
                norms.append(norm.item())
            rt.step()
        nn.functional.mse_loss(plain(x), y).backward()
        plain_norms.append(nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM).item())
        plain_opt.step()
        plain_opt.zero_grad()
    full = rt.backend.model_state_dict(model)
    result = {
        "rank": rt.rank,
        "units": [name for name, m in model.named_modules() if isinstance(m, FSDPModule)],
        "local_numel": local_numel(model),
        "numel": sum(p.numel() for p in plain.parameters()),
        "norms": norms, "plain_norms": plain_norms,
        "max_diff": max((full[n] - p).abs().max().item() for n, p in plain.named_parameters()),
    }
    rt.close()
    return result


def overflow() -> dict:
    rt = mpt.Runtime(precision="fp16-mixed", loss_scale=LossScaleConfig(init_scale=1024.0),
                     quiet=True)
    torch.manual_seed(0)
    linear = nn.Linear(4, 8)
    model, _ = rt.setup(linear, torch.optim.SGD(linear.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1)
    stepped, scales, rows = [], [], []
    for step in range(4):
        x, y = torch.randn(2, 4, generator=g), torch.randn(2, 8, generator=g)
        if step == 2 and rt.rank == 1:
            y[:, 0] = -1e5  # output 0's gradient overflows fp16: row 0 of the weight
        with rt.autocast():
            loss = nn.functional.mse_loss(model(x), y)
        rt.backward(loss)
        stepped.append(rt.step())
        scales.append(rt.precision.loss_scale)
        rows.append(model.weight.to_local().tolist())
    result = {"rank": rt.rank, "stepped": stepped, "scales": scales, "rows": rows,
              "shard_rows": model.weight.to_local().shape[0]}
    rt.close()
    return result


def cast() -> dict:
    rt = mpt.Runtime(quiet=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen: dict[str, list[str]] = {}

    def record(name: str, layer: nn.Module, args: tuple) -> None:
        seen[name] = [str(layer.weight.dtype), str(args[0].dtype)]

    for name, layer in model.named_modules():
        if isinstance(layer, (nn.Linear, nn.BatchNorm1d)):
            layer.register_forward_pre_hook(functools.partial(record, name))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=g)
    y = x[:, :2] * 2 + 1  # one batch, fitted step by step
    losses = []
    for _ in range(3):
        with rt.autocast():
            output = model(x)
            loss = nn.functional.mse_loss(output, y)
        rt.backward(loss)
        grads = [str(p.grad.dtype) for p in optimizer.param_groups[0]["params"]]
        rt.step()
        losses.append(loss.item())
    path = rt.save(out / "ckpt")
    result = {"rank": rt.rank, "seen": seen, "output": str(output.dtype), "losses": losses,
              "weights": sorted({f"{type(p).__name__} {p.dtype}"
                                 for p in optimizer.param_groups[0]["params"]}),
              "grads": sorted(set(grads)), "precision_state": sorted(rt.precision.state_dict()),
              "saved": str(path)}
    rt.close()
    return result


result = {"clip": clip, "overflow": overflow, "cast": cast}[mode]()
(out / f"{mode}-rank{result['rank']}.json").write_text(json.dumps(result))
