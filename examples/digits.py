"""Train a small MLP on scikit-learn's 8x8 handwritten digits with mpt.

The data ships inside scikit-learn, so nothing is downloaded. Run it on two CPU processes in bf16:

    mpt launch --gpus 2 --precision bf16-mixed examples/digits.py
    mpt launch --gpus 2 --precision bf16-mixed --run-dir runs/digits examples/digits.py
    mpt visualize runs/digits        # runs/digits/plots/index.html; or tensorboard --logdir ...
    mpt launch --gpus 2 --checkpoint-dir ckpt/digits --max-restarts 2 examples/digits.py
                                     # a checkpoint per epoch; a restart or a rerun goes on from it

or alone (`python examples/digits.py`). The backend and precision come from the launch flags;
the script never names them.
"""

from __future__ import annotations

import argparse
import math

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpt


def datasets(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """1,797 digits, 80 % for training and 20 % held out, pixels scaled to [0, 1]."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--steps", type=int, default=0,
                        help="stop after this many optimizer steps (default: --epochs)")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default="", help="checkpoint directory (as `mpt launch "
                        "--checkpoint-dir`): a checkpoint per epoch, resumed from by a rerun")
    args = parser.parse_args()

    torch.manual_seed(args.seed)  # same initial weights on every rank
    rt = mpt.Runtime(seed=args.seed, checkpoint_dir=args.save or None)
    train, test = datasets(args.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.setup_dataloader(DataLoader(train, batch_size=args.batch_size, shuffle=True))
    rt.print(f"rank 0 of {rt.world_size}: backend {rt.backend.name}, precision "
             f"{rt.precision.name}, {len(train)} training digits, {len(loader)} steps per epoch")
    steps = args.steps or args.epochs * len(loader)
    epochs = math.ceil(steps / len(loader))
    rt.progress(total=steps)  # the progress bar's ETA

    loss_fn = nn.CrossEntropyLoss()
    step = rt.resume()["step"]  # with a checkpoint directory: its latest checkpoint, if any
    for epoch in range(loader.epoch, epochs):  # a resumed loader finishes its epoch first
        if step >= steps:
            break
        total = torch.zeros(2, device=rt.device)
        for x, y in loader:
            loss = loss_fn(model(x), y)  # the forward autocasts under bf16/fp16-mixed
            rt.backward(loss)
            rt.clip_grad_norm_(1.0)
            rt.step()
            n = torch.tensor(len(y), device=rt.device)
            total += torch.stack([loss.detach().float() * n, n])
            step += 1
            if step == steps:  # --steps: stop mid-epoch
                break
        rt.all_reduce(total, op="sum")
        rt.log(epoch=epoch + 1, train_loss=total[0] / total[1])  # with `mpt launch --run-dir`
        if epoch % 5 == 4 or epoch == epochs - 1:
            rt.print(f"epoch {epoch + 1:3d}  train loss {total[0] / total[1]:.4f}")
        if rt.checkpoint_dir is not None:
            rt.save(keep=2)

    # Every rank scores its shard of the held-out set; the counts are summed across ranks.
    model.eval()
    counts = torch.zeros(2, device=rt.device)
    with torch.no_grad():
        for x, y in rt.setup_dataloader(DataLoader(test, batch_size=256)):
            pred = model(x).argmax(dim=1)
            n = torch.tensor(len(y), device=rt.device)
            counts += torch.stack([(pred == y).sum(), n]).float()
    rt.all_reduce(counts, op="sum")
    rt.log(held_out_accuracy=counts[0] / counts[1])
    rt.print(f"held-out accuracy: {counts[0] / counts[1]:.2%} on {int(counts[1])} digits")
    rt.close()


if __name__ == "__main__":
    main()
