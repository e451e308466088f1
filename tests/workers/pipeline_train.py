"""Train a 6-block nn.Sequential through rt.forward_backward; rank 0 writes OUT: the loss per
step (the batch's, as every rank gets it), the final weights by name and each rank's loss.

usage: pipeline_train.py OUT [--steps N] [--clip C] [--save-at K --ckpt DIR] [--resume DIR]
                         [--meta] [--teacher]
The pipeline, precision and world come from `mpt launch`; the same script runs without a
pipeline, which is what tests/distributed/test_pipeline.py compares it with. --save-at saves at
step K into DIR; --resume loads DIR's latest checkpoint and trains on (losses keyed by step).
--meta builds the model on the meta device. Every rank reports (OUT's "sizes") how many of
the whole model's parameters it gave real values, its stage's, and the ones it holds (fewer
where --backend fsdp shards the stage). --teacher sets up a second model of other weights
without an optimizer and trains on its outputs (rt.evaluate(x, model=teacher)) as targets.
"""

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpt

GLOBAL_BATCH, FEATURES = 8, 6
TEACHER_SEED = 5


def make_model(device: str = "cpu", seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    with torch.device(device):
        return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                             nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def make_data(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(steps * GLOBAL_BATCH, FEATURES, generator=g),
                         torch.randn(steps * GLOBAL_BATCH, 1, generator=g))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--meta", action="store_true", help="build the model on the meta device")
    parser.add_argument("--teacher", action="store_true", help="targets from a frozen model")
    args = parser.parse_args()
    rt = mpt.Runtime()
    whole = make_model("meta" if args.meta else "cpu")
    model, optimizer = rt.setup(whole, torch.optim.Adam(whole.parameters(), lr=0.01))
    teacher = rt.setup(make_model(seed=TEACHER_SEED)) if args.teacher else None
    # Per rank: the parameters the whole model holds for real (on meta: this stage's only)
    real = {"materialised": sum(p.numel() for p in whole.parameters() if not p.is_meta),
            "stage": sum(p.numel() for p in model.parameters()),
            "model": sum(p.numel() for p in whole.parameters()),
            "held": sum(getattr(p, "to_local", lambda p=p: p)().numel()  # a shard's, sharded
                        for p in model.parameters())}
    sizes: list[dict] = [real]
    if rt.world_size > 1:  # one process opens no process group
        sizes = [{} for _ in range(rt.world_size)]
        torch.distributed.all_gather_object(sizes, real)
    replicas = rt.topology.dp_size
    batch = GLOBAL_BATCH // replicas // rt.accumulate
    loader = rt.setup_dataloader(DataLoader(make_data(args.steps), shuffle=False,
                                            batch_size=batch))
    step = rt.load(args.resume)["step"] if args.resume else 0
    losses, norms, evals = {}, [], []
    micro: list[tuple[torch.Tensor, ...]] = []  # this step's micro-batches and their losses
    for x, y in loader:
        if teacher is not None:
            y = rt.evaluate(x, model=teacher)
        micro.append((x, y, rt.forward_backward(x, y, nn.functional.mse_loss)))
        if args.clip is not None:
            norm = rt.clip_grad_norm_(args.clip)
            if norm is not None:
                norms.append(norm.item())
        if rt.step():
            step += 1
            # The step's loss: the mean over its micro-batches and the replicas.
            loss = torch.stack([loss for _, _, loss in micro]).mean()
            losses[step] = rt.all_reduce(loss).item()
            if step == args.save_at:
                rt.save(args.ckpt, step=step)
            evaluated = torch.stack([rt.evaluate(x, y, nn.functional.mse_loss)
                                     for x, y, _ in micro]).mean()
            evals.append(rt.all_reduce(evaluated).item())
            micro = []
    # The trained model's outputs for the first batch (no loss: the schedule's eval path; a
    # pipeline's stages keep the shapes they trained with)
    first = make_data(args.steps).tensors[0][:batch]
    outputs = rt.evaluate(first).flatten().tolist()
    weights = rt.model_state_dict(model)
    if rt.rank == 0:
        args.out.write_text(json.dumps({
            "losses": losses, "norms": norms, "evals": evals, "outputs": outputs,
            "scale": rt.precision.loss_scale,
            "sizes": sizes,
            "weights": {k: v.float().flatten().tolist() for k, v in weights.items()}}))
    rt.close()
