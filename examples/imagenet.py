"""Train a torchvision ResNet on an image folder with mpt (ImageNet's layout, or generated shapes).

With ``--data DIR`` it reads an ``ImageFolder``: ``DIR/train/<class>/*.png|jpg`` and
``DIR/val/<class>/...`` (ImageNet's layout), or one ``DIR/<class>/...`` of which ``--val-fraction``
is held out. Without it, it first writes a small folder of generated images (coloured shapes and
patterns on noise, one class per shape; nothing is downloaded) and trains on that:

    mpt launch --gpus 2 --precision bf16-mixed examples/imagenet.py --steps 300
    mpt launch --gpus 2 examples/imagenet.py     # fp32: on a CPU without bf16 units, far faster
    mpt launch --gpus 2 --backend deepspeed --zero-stage 2 --precision bf16-mixed \\
        examples/imagenet.py --steps 300
    mpt launch --gpus 8 --precision bf16-mixed --lr-scaling linear --checkpoint-dir ckpt/rn50 \\
        examples/imagenet.py --data /datasets/imagenet --arch resnet50 --image-size 224 --epochs 90

What it shows: channels_last, mixed precision through ``rt.autocast()``, a learning rate warmed
up linearly then decayed on a cosine and scaled with the world size (``rt.scale_lr``, under
``--lr-scaling``), top-1/top-5 accuracy on the held-out split, and checkpoints (``--save DIR``
or ``--checkpoint-dir``) from which a rerun goes on (``rt.resume()``). ``--steps N`` stops after
N optimizer steps. torchvision is imported here, inside the example, never by mpt itself.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, Subset

import mpt

SHAPES = ("circle", "square", "triangle", "cross", "ring", "stripes", "checker", "diamond")
"""The generated classes: a shape or pattern each, in a random colour, size and place."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="", help="an ImageFolder root (DIR/train + DIR/val, "
                        "or DIR/<class>); default: generated shapes")
    parser.add_argument("--generate-dir", default="", help="where the generated folder goes "
                        "(default: a folder in the system's temporary directory, reused)")
    parser.add_argument("--classes", type=int, default=len(SHAPES),
                        help=f"generated classes (at most {len(SHAPES)})")
    parser.add_argument("--per-class", type=int, default=200, help="generated images per class")
    parser.add_argument("--val-fraction", type=float, default=0.2,
                        help="held out when the folder has no train/val split")
    parser.add_argument("--arch", default="resnet18", help="a torchvision.models classifier")
    parser.add_argument("--image-size", type=int, default=0,
                        help="pixels (default: 224 with --data, 32 for the generated shapes)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=0,
                        help="stop after this many optimizer steps (default: --epochs)")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05, help="before rt.scale_lr")
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--weight-decay", type=float, default=5e-5)
    parser.add_argument("--workers", type=int, default=-1,
                        help="DataLoader workers per process (default: 4 on CUDA, 0 on CPU)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="optimizer steps between evaluations (default: once per epoch)")
    parser.add_argument("--save", default="", help="checkpoint directory (as `mpt launch "
                        "--checkpoint-dir`), written at every evaluation; a rerun resumes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.image_size = args.image_size or (224 if args.data else 32)
    if not 1 <= args.classes <= len(SHAPES):
        parser.error(f"--classes {args.classes}: give 1 to {len(SHAPES)} (the shapes drawn)")
    return args


# -- generated data -----------------------------------------------------------------------------
def draw(shape: str, size: int, rng: random.Random) -> Any:
    """One image of ``shape``: random colours, scale, place and pixel noise, so that the class is
    the shape alone and a network has to look at the spatial pattern to tell them apart."""
    from PIL import Image, ImageDraw

    def colour(lo: int, hi: int) -> tuple[int, int, int]:
        return (rng.randint(lo, hi), rng.randint(lo, hi), rng.randint(lo, hi))

    image = Image.new("RGB", (size, size), colour(0, 110))
    pen = ImageDraw.Draw(image)
    fg = colour(130, 255)
    r = rng.uniform(0.22, 0.4) * size
    cx, cy = rng.uniform(r, size - r), rng.uniform(r, size - r)
    box = (cx - r, cy - r, cx + r, cy + r)
    w = max(2, int(r / 3))
    if shape == "circle":
        pen.ellipse(box, fill=fg)
    elif shape == "square":
        pen.rectangle(box, fill=fg)
    elif shape == "triangle":
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    elif shape == "cross":
        pen.rectangle((cx - r, cy - w / 2, cx + r, cy + w / 2), fill=fg)
        pen.rectangle((cx - w / 2, cy - r, cx + w / 2, cy + r), fill=fg)
    elif shape == "ring":
        pen.ellipse(box, outline=fg, width=w)
    elif shape == "stripes":
        for y in range(int(cy - r), int(cy + r), 2 * w):
            pen.rectangle((cx - r, y, cx + r, y + w - 1), fill=fg)
    elif shape == "checker":
        for i, y in enumerate(range(int(cy - r), int(cy + r), w)):
            for j, x in enumerate(range(int(cx - r), int(cx + r), w)):
                if (i + j) % 2 == 0:
                    pen.rectangle((x, y, x + w - 1, y + w - 1), fill=fg)
    else:  # diamond
        pen.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fg)
    noise = Image.effect_noise((size, size), 24).convert("RGB")
    return Image.blend(image, noise, 0.15)


def generate(root: Path, classes: int, per_class: int, size: int, seed: int) -> Path:
    """Write ``root/<shape>/<i>.png`` once; a complete folder (``.done``) is reused.

    Written to a sibling temporary folder and renamed, so two jobs sharing the machine never see
    half a folder.
    """
    if (root / ".done").exists():
        return root
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
    for shape in SHAPES[:classes]:
        (tmp / shape).mkdir()
        for i in range(per_class):
            draw(shape, size, rng).save(tmp / shape / f"{i:05d}.png")
    (tmp / ".done").touch()
    try:
        tmp.rename(root)
    except OSError:  # another job finished first: use its folder
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def default_generate_dir(args: argparse.Namespace) -> Path:
    name = f"mpt-shapes-{args.classes}x{args.per_class}-{args.image_size}px-seed{args.seed}"
    return Path(args.generate_dir or tempfile.gettempdir()) / name


# -- data -----------------------------------------------------------------------------------------
def datasets(root: Path, args: argparse.Namespace) -> tuple[Dataset[Any], Dataset[Any], int]:
    """Training and held-out sets (ImageFolder's train/ and val/, or one folder split by a seeded
    shuffle) and the number of classes."""
    from torchvision import datasets as tv_datasets
    from torchvision import transforms as T

    normalize = T.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    train_tf = T.Compose([T.RandomResizedCrop(args.image_size, scale=(0.35, 1.0)),
                          T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    val_tf = T.Compose([T.Resize(int(args.image_size / 0.875)), T.CenterCrop(args.image_size),
                        T.ToTensor(), normalize])
    if (root / "train").is_dir() and (root / "val").is_dir():
        train = tv_datasets.ImageFolder(str(root / "train"), train_tf)
        return train, tv_datasets.ImageFolder(str(root / "val"), val_tf), len(train.classes)
    # One folder: the same files twice, each with its own transform, split by index.
    plain = tv_datasets.ImageFolder(str(root), train_tf)
    order = torch.randperm(len(plain), generator=torch.Generator().manual_seed(args.seed))
    n_val = max(1, int(len(plain) * args.val_fraction))
    held_out = tv_datasets.ImageFolder(str(root), val_tf)
    return (Subset(plain, order[n_val:].tolist()), Subset(held_out, order[:n_val].tolist()),
            len(plain.classes))


class BatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that also runs with bf16 weights beside fp32 running statistics.

    DeepSpeed's bf16 mode casts a model's parameters to bf16 but not its buffers, and torch's
    batch norm refuses that mix ("expected scalar type BFloat16 but found Float"). Normalising
    with fp32 copies of the weight and bias (the statistics' dtype) is what autocast does for
    batch norm anyway; the input keeps its dtype. With matching dtypes this is the parent's
    forward, unchanged.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = self.running_mean
        if self.weight is None or stats is None or self.weight.dtype == stats.dtype:
            return super().forward(x)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average, as the parent computes it
                momentum = 1.0 / float(self.num_batches_tracked)
        return F.batch_norm(x, stats, self.running_var, self.weight.to(stats.dtype),
                            self.bias.to(stats.dtype), self.training, momentum, self.eps)


def with_mixed_dtype_batchnorm(model: nn.Module) -> nn.Module:
    """Make every ``nn.BatchNorm2d`` of ``model`` the class above (same state, same maths)."""
    for module in model.modules():
        if type(module) is nn.BatchNorm2d:
            module.__class__ = BatchNorm2d
    return model


def warmup_cosine(warmup: int, total: int) -> Any:
    """LR factor: linear from 1/warmup up to 1 over ``warmup`` steps, then a cosine down to 0 at
    ``total``. Warm-up matters because the scaled LR of a large world is too much for the first
    steps of a freshly initialised network (Goyal et al., 2017)."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


@torch.no_grad()
def evaluate(rt: mpt.Runtime, model: nn.Module, held_out: Dataset[Any], batch_size: int,
             workers: int) -> tuple[float, float]:
    """Top-1 and top-5 accuracy over the held-out set: each rank scores every world_size-th
    image (no padding, so no image counts twice), and the counts are summed across ranks."""
    n = len(held_out)  # type: ignore[arg-type]
    shard = Subset(held_out, list(range(rt.rank, n, rt.world_size)))
    model.eval()
    counts = torch.zeros(3, device=rt.device)
    for x, y in DataLoader(shard, batch_size=batch_size, num_workers=workers):
        x = x.to(rt.device, memory_format=torch.channels_last)
        y = y.to(rt.device)
        with rt.autocast():
            logits = model(x)
        k = min(5, logits.shape[1])
        top = logits.float().topk(k, dim=1).indices
        hits = top == y[:, None]
        counts += torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum(),
                               torch.tensor(len(y), device=rt.device)]).float()
    model.train()
    rt.all_reduce(counts, op="sum")
    return float(counts[0] / counts[2]), float(counts[1] / counts[2])


def main() -> None:
    args = parse_args()
    import torchvision  # here, not at mpt's module level: a CPU-only torch may lack it

    torch.manual_seed(args.seed)  # same initial weights on every rank
    rt = mpt.Runtime(seed=args.seed, checkpoint_dir=args.save or None)
    workers = args.workers if args.workers >= 0 else (4 if rt.device.type == "cuda" else 0)
    if args.data:
        root = Path(args.data)
    else:
        root = default_generate_dir(args)
        if rt.local_rank == 0:  # one writer per node; the others wait at the barrier
            root.parent.mkdir(parents=True, exist_ok=True)
            started = time.perf_counter()
            made = not (root / ".done").exists()
            generate(root, args.classes, args.per_class, args.image_size, args.seed)
            if made:
                rt.print(f"generated {args.classes} x {args.per_class} images in {root} "
                         f"({time.perf_counter() - started:.1f} s)")
        rt.barrier()
    train, held_out, classes = datasets(root, args)

    # channels_last (NHWC) is set on the input batches: convolutions then keep their outputs in
    # it, so every activation is NHWC, the layout tensor cores and oneDNN run fastest. The
    # weights stay contiguous (a per-call transpose of small tensors): DeepSpeed 0.19's
    # deepspeed.initialize refuses channels_last weights (it broadcasts each as a byte view).
    model = with_mixed_dtype_batchnorm(
        torchvision.models.get_model(args.arch, weights=None, num_classes=classes))
    # A 1x1 kernel's gradient is equally contiguous with strides (C, 1, C, C) or (C, 1, 1, 1);
    # DDP compares strides literally and warns once per process about what costs nothing.
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    # Weight decay on every parameter, as torchvision's reference recipe does by default.
    optimizer = torch.optim.SGD(model.parameters(), lr=rt.scale_lr(args.lr), momentum=0.9,
                                nesterov=True, weight_decay=args.weight_decay)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.setup_dataloader(DataLoader(train, batch_size=args.batch_size, shuffle=True,
                                            drop_last=True, num_workers=workers))
    total = args.steps or args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(min(args.warmup_steps, total), total))
    eval_every = args.eval_every or len(loader)
    sizes = len(train), len(held_out)  # type: ignore[arg-type]
    rt.print(f"rank 0 of {rt.world_size}: backend {rt.backend.name}, precision "
             f"{rt.precision.name}, {args.arch} on {sizes[0]} training / {sizes[1]} held-out "
             f"images of {classes} classes at {args.image_size} px, "
             f"{len(loader)} steps per epoch, {total} steps, lr {rt.scale_lr(args.lr):g}")
    rt.progress(total=total)

    loss_fn = nn.CrossEntropyLoss()
    step = rt.resume(scheduler=scheduler)["step"]  # 0, or where the last checkpoint was
    started = time.perf_counter()
    top1 = top5 = float("nan")
    while step < total:
        for x, y in loader:
            x = x.contiguous(memory_format=torch.channels_last)
            with rt.autocast():
                loss = loss_fn(model(x), y)
            rt.backward(loss)
            rt.clip_grad_norm_(5.0)
            rt.step()
            scheduler.step()
            step += 1
            if step % eval_every == 0 or step == total:
                top1, top5 = evaluate(rt, model, held_out, args.batch_size, workers)
                rt.log(top1=top1, top5=top5)
                rt.print(f"step {step:5d}  loss {loss.item():.4f}  held-out top-1 {top1:.2%}  "
                         f"top-5 {top5:.2%}  ({time.perf_counter() - started:.0f} s)")
                if rt.checkpoint_dir is not None:
                    rt.save(step=step, scheduler=scheduler, keep=2)
            if step == total:
                break
    if math.isnan(top1):  # resumed at the end: nothing was trained, score what was loaded
        top1, top5 = evaluate(rt, model, held_out, args.batch_size, workers)
    rt.print(f"held-out top-1 {top1:.2%}, top-5 {top5:.2%} after {step} steps "
             f"({time.perf_counter() - started:.0f} s of training on {rt.world_size} processes)")
    rt.close()


if __name__ == "__main__":
    main()
