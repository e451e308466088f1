"""One conformance cell: the fixed job of conformance_model.py, trained through mpt.

usage: mpt launch --gpus WS --backend B --precision P conformance_job.py OUT_DIR ACCUMULATE
Each process first writes OUT_DIR/started-<pid> (a refusal must come before any of them), then
trains STEPS optimizer steps of GLOBAL_BATCH samples in ACCUMULATE micro-batches per
data-parallel replica, through ``rt.forward_backward`` (which pipelines under
``--pipeline-stages``), and writes OUT_DIR/rank<R>.json: per ``rt.forward_backward`` its loss,
the sample indices of each micro-batch it ran (the schedule's M under a pipeline, else one), and
what each ``rt.step()`` returned. Rank 0 also writes the final weights (fp32) to
OUT_DIR/weights.safetensors.
"""

import json
import os
import sys
from pathlib import Path

out, accumulate = Path(sys.argv[1]), int(sys.argv[2])
(out / f"started-{os.getpid()}").touch()  # before mpt is imported

from conformance_model import GLOBAL_BATCH, Images, loss_fn, make_model, make_optimizer  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import mpt  # noqa: E402

rt = mpt.Runtime(accumulate=accumulate, quiet=True)
model = make_model()
names = [name for name, _ in model.named_parameters()]
model, optimizer = rt.setup(model, make_optimizer(model.parameters()))
micro = GLOBAL_BATCH // (rt.topology.dp_size * accumulate)
loader = rt.setup_dataloader(DataLoader(Images(), batch_size=micro, shuffle=True,
                                        drop_last=True))
# torch's schedule cuts a batch into M consecutive chunks (tensor_split along dim 0)
pipeline = rt.config.pipeline_at(rt.world_size)
chunks = pipeline.microbatches if pipeline else 1
losses, indices, stepped = [], [], []
for x, y, index in loader:
    loss = rt.forward_backward(x, y, loss_fn)
    stepped.append(rt.step())
    losses.append(loss.item())
    indices.append([part.tolist() for part in index.tensor_split(chunks)])

state = rt.model_state_dict(model)  # collective: full weights on every rank
if rt.rank == 0:
    save_file({name: state[name].detach().float().cpu().contiguous() for name in names},
              str(out / "weights.safetensors"))
(out / f"rank{rt.rank}.json").write_text(json.dumps({
    "rank": rt.rank, "world_size": rt.world_size, "accumulate": rt.accumulate,
    "stage": rt.topology.stage, "tp": rt.topology.plan.coords(rt.rank)["tp"],
    "backend": rt.backend.name, "precision": rt.precision.name,
    "compression": rt.config.grad_compression,
    "losses": losses, "indices": indices, "stepped": stepped}))
rt.close()
