"""Several short trainings in one 2-rank job, so that one launch compares many things.

usage: hvd_curves.py OUT_DIR [CHECKPOINT_TO_LOAD]
Under whichever backend launched it (ddp or horovod), it writes OUT_DIR/rank{r}.pt with:
- "fp32": the global loss of 20 fp32 steps (mean over ranks, as each step saw it);
- "accumulate": the parameters after 5 steps of 3 micro-batches of 2 rows per rank, and
  "one_batch": the same 5 steps with one micro-batch of 6 rows per rank, and
  "two_backwards": the same 5 steps with two backward passes of 3 rows each before each step;
- "bf16": the global loss of 8 bf16-mixed steps, and the parameters after them;
- "loaded": the parameters after loading CHECKPOINT_TO_LOAD, when given.
- "model_state"/"optimizer_state": what the backend gives a checkpoint after the fp32 run,
  which is also saved with rt.save under OUT_DIR/ckpt.
"""

import sys
from pathlib import Path

import torch
from common import global_batches, make_model, make_optimizer
from torch import nn

import mpt

out = Path(sys.argv[1])
load_from = Path(sys.argv[2]) if len(sys.argv) > 2 else None
record: dict = {}


def train(steps: int, micro: int, **runtime_args) -> tuple[mpt.Runtime, nn.Module,
                                                          torch.optim.Optimizer, list[float]]:
    rt = mpt.Runtime(**runtime_args)
    model = make_model()
    model, optimizer = rt.setup(model, make_optimizer(model))
    losses = []
    for x, y in global_batches(steps, rt.world_size * rt.accumulate * micro):
        total = torch.zeros(1)
        for j in range(rt.accumulate):
            start = (rt.rank * rt.accumulate + j) * micro
            with rt.autocast():
                loss = nn.functional.mse_loss(model(x[start:start + micro]),
                                              y[start:start + micro])
            rt.backward(loss)
            total += loss.detach().float() / rt.accumulate
            rt.step()
        losses.append(rt.all_reduce(total, op="mean").item())
    return rt, model, optimizer, losses


def params(rt: mpt.Runtime, model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in rt.backend.unwrap(model).parameters()]


rt, model, optimizer, record["fp32"] = train(20, 4)
record["model_state"] = rt.backend.model_state_dict(model)
record["optimizer_state"] = rt.backend.optimizer_state_dict(model, optimizer)
rt.save(out / "ckpt", step=20)
if load_from is not None:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # so that a load that does nothing cannot pass
    rt.load(load_from)
    record["loaded"] = params(rt, model)

rt3, model3, _, _ = train(5, 2, accumulate=3)
record["accumulate"] = params(rt3, model3)
rt1, model1, _, _ = train(5, 6)
record["one_batch"] = params(rt1, model1)
# Two backward passes before one step (half the rows each): the gradient the first backward's
# hook sent is stale by the step, which must reduce the sum of both.
rt2 = mpt.Runtime()
model2 = make_model()
model2, optimizer2 = rt2.setup(model2, make_optimizer(model2))
for x, y in global_batches(5, rt2.world_size * 6):
    mine = slice(rt2.rank * 6, (rt2.rank + 1) * 6)
    for half in (slice(0, 3), slice(3, 6)):
        rt2.backward(nn.functional.mse_loss(model2(x[mine][half]), y[mine][half]) / 2)
    rt2.step()
record["two_backwards"] = params(rt2, model2)
rtb, modelb, _, record["bf16"] = train(8, 4, precision="bf16-mixed")
record["bf16_params"] = params(rtb, modelb)
record["backend"] = rt.backend.name
torch.save(record, out / f"rank{rt.rank}.pt")
rt.close()
