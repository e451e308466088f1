"""Loss curves of several runs, ddp and DeepSpeed, in one job (one process group, one start-up).

usage: ds_curves.py OUT_DIR SUITE
  equivalence: ddp and ZeRO 0-3 from the same weights on the same data, in fp32 (plain, with
               CPU offload of the optimizer at ZeRO 1-3 and of the weights too at 3, and with
               accumulation 2 + clipping) and bf16; the ZeRO-2 run saves a
               checkpoint at step 10.
  resume:      fresh runs that load that checkpoint and train steps 10-19: ZeRO-2 again, ZeRO-3
               and ddp.
  fp16:        (GPUs) ddp and ZeRO 2-3 in fp16-mixed, with the loss scale before and after a
               save/load round trip.
Each rank writes OUT_DIR/SUITE-rank{r}.pt: {label: {"losses", "norms", "params", "stepped",
"scale"}}.
A run's losses are this rank's micro-batch losses, one per optimizer step (the last micro-batch).
"""

import gc
import sys
import time
from pathlib import Path

import torch
from common import global_batches, make_model
from torch import nn

import mpt

STEPS, MICRO, SAVE_AT, CLIP = 20, 4, 10, 1.0

out, suite = Path(sys.argv[1]), sys.argv[2]
checkpoint = out / "zero2-step10.pt"


def train(label: str, backend: str, precision: str = "fp32", stage: int | None = None,
          accumulate: int = 1, clip: float | None = None, start: int = 0,
          save_at: int | None = None, offload: str | None = None) -> dict:
    options = {} if stage is None else {"zero_stage": stage}
    if offload:
        options["offload"] = offload
    rt = mpt.Runtime(backend=backend, precision=precision, accumulate=accumulate,
                     backend_options=options)
    model = make_model()
    model, _ = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    if start:
        assert rt.load(checkpoint)["step"] == start
    per_step = rt.world_size * accumulate * MICRO
    losses, norms, stepped = [], [], []
    began = time.perf_counter()
    for step, (x, y) in enumerate(global_batches(STEPS, per_step)):
        if step < start:
            continue
        if step == save_at:
            rt.save(checkpoint, step=step)
        for j in range(accumulate):
            first = (rt.rank * accumulate + j) * MICRO
            xs, ys = x[first:first + MICRO].to(rt.device), y[first:first + MICRO].to(rt.device)
            with rt.autocast():
                loss = nn.functional.mse_loss(model(xs).float(), ys)
            rt.backward(loss)
            norm = rt.clip_grad_norm_(clip) if clip is not None else None
            stepped.append(rt.step())
        losses.append(loss.item())
        norms.append(None if norm is None else float(norm))
    params = [p.detach().cpu().clone() for p in rt.backend.model_state_dict(model).values()]
    rt.print(f"{label}: {time.perf_counter() - began:.2f} s")
    run = {"losses": losses, "norms": norms, "params": params, "stepped": stepped,
           "scale": rt.precision.loss_scale}
    if precision == "fp16-mixed":  # the loss scale survives a save/load round trip
        rt.save(out / f"{label}.pt", step=STEPS)
        spoilt = rt.precision.state_dict()
        rt.precision.load_state_dict({**spoilt, "scaler": {**spoilt["scaler"], "scale": 1.0}})
        rt.load(out / f"{label}.pt")
        run["restored_scale"] = rt.precision.loss_scale
    return run


runs: dict[str, dict] = {}
if suite == "equivalence":
    for precision in ("fp32", "bf16-mixed"):
        runs[f"ddp-{precision}"] = train("ddp", "ddp", precision)
        for stage in range(4):
            runs[f"zero{stage}-{precision}"] = train(
                f"zero{stage} {precision}", "deepspeed", precision, stage,
                save_at=SAVE_AT if (stage, precision) == (2, "fp32") else None)
    # every offload `mpt plan` ranks
    for stage in (1, 2, 3):
        runs[f"zero{stage}-offload-fp32"] = train(f"zero{stage} offload", "deepspeed", stage=stage,
                                                  offload="optimizer")
    runs["zero3-offload-all-fp32"] = train("zero3 offload all", "deepspeed", stage=3,
                                           offload="optimizer,parameters")
    runs["ddp-acc-clip"] = train("ddp acc clip", "ddp", accumulate=2, clip=CLIP)
    for stage in range(4):
        runs[f"zero{stage}-acc-clip"] = train(f"zero{stage} acc clip", "deepspeed", stage=stage,
                                              accumulate=2, clip=CLIP)
elif suite == "resume":
    runs["zero2-resumed"] = train("zero2 resumed", "deepspeed", stage=2, start=SAVE_AT)
    runs["zero3-resumed"] = train("zero3 resumed", "deepspeed", stage=3, start=SAVE_AT)
    runs["ddp-resumed"] = train("ddp resumed", "ddp", start=SAVE_AT)
elif suite == "fp16":  # GPUs only: DeepSpeed refuses fp16 on CPU
    runs["ddp-fp16-mixed"] = train("ddp fp16", "ddp", "fp16-mixed")
    for stage in (2, 3):
        runs[f"zero{stage}-fp16-mixed"] = train(f"zero{stage} fp16", "deepspeed", "fp16-mixed",
                                                stage)
else:
    raise SystemExit(f"unknown suite {suite!r}")

import torch.distributed as dist  # noqa: E402

torch.save(runs, out / f"{suite}-rank{dist.get_rank()}.pt")
dist.barrier()
dist.destroy_process_group()
gc.collect()  # gloo's work objects, freed at teardown, can abort the exit
