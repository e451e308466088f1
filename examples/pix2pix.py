"""A small pix2pix-style conditional GAN with mpt: two models, two optimizers, three losses.

The generator (a small U-Net) turns a one-channel outline of random shapes into the coloured
picture; the discriminator (a PatchGAN) judges (outline, picture) pairs patch by patch. The
training step is pix2pix's: the discriminator on a real and a fake pair, then the generator on
the adversarial loss plus 100 x L1 to the target, through a discriminator whose parameters are
frozen for that step. The paired images are drawn here, so nothing is downloaded:

    mpt launch --gpus 2 --precision bf16-mixed examples/pix2pix.py --steps 200
    mpt launch --gpus 2 --backend deepspeed examples/pix2pix.py --steps 50  # ZeRO stage 1
    mpt launch --gpus 2 --run-dir runs/pix2pix examples/pix2pix.py && mpt visualize runs/pix2pix
    mpt launch --gpus 2 --checkpoint-dir ckpt/pix2pix examples/pix2pix.py   # a rerun resumes
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpt

SIZE = 32


def paired_images(count: int, seed: int) -> TensorDataset:
    """(outline, picture) pairs: a few discs and boxes; the outline is 1 on their borders, the
    picture fills each with a colour set by its kind and size, on a dark background."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(SIZE), torch.arange(SIZE), indexing="ij")
    outlines = torch.zeros(count, 1, SIZE, SIZE)
    pictures = torch.full((count, 3, SIZE, SIZE), -0.8)
    for i in range(count):
        for _ in range(int(torch.randint(1, 4, (), generator=g))):
            cx, cy = (torch.randint(6, SIZE - 6, (2,), generator=g)).tolist()
            r = int(torch.randint(3, 8, (), generator=g))
            disc = bool(torch.rand((), generator=g) < 0.5)
            if disc:
                dist = ((xx - cx) ** 2 + (yy - cy) ** 2).float().sqrt()
                inside, border = dist <= r, (dist - r).abs() < 0.75
            else:
                dist = torch.maximum((xx - cx).abs(), (yy - cy).abs()).float()
                inside, border = dist <= r, dist == r
            colour = torch.tensor([0.9, -0.2, 0.1]) if disc else torch.tensor([-0.1, 0.2, 0.9])
            colour = colour * (0.5 + r / 14)
            pictures[i][:, inside] = colour[:, None]
            outlines[i][0, border] = 1.0
    return TensorDataset(outlines * 2 - 1, pictures.clamp(-1, 1))


def block(cin: int, cout: int, *, down: bool) -> nn.Sequential:
    conv = (nn.Conv2d(cin, cout, 4, 2, 1) if down else nn.ConvTranspose2d(cin, cout, 4, 2, 1))
    # InstanceNorm: per image, so every rank normalises exactly as one process would
    return nn.Sequential(conv, nn.InstanceNorm2d(cout), nn.LeakyReLU(0.2) if down else nn.ReLU())


class UNet(nn.Module):
    """Two levels down, two up, with skip connections (pix2pix's generator, in small)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(1, width, 4, 2, 1), nn.LeakyReLU(0.2))
        self.down2 = block(width, 2 * width, down=True)
        self.down3 = block(2 * width, 4 * width, down=True)
        self.up3 = block(4 * width, 2 * width, down=False)
        self.up2 = block(4 * width, width, down=False)
        self.up1 = nn.Sequential(nn.ConvTranspose2d(2 * width, 3, 4, 2, 1), nn.Tanh())

    def forward(self, outline: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(outline)
        d2 = self.down2(d1)
        u3 = self.up3(self.down3(d2))
        u2 = self.up2(torch.cat([u3, d2], dim=1))
        return self.up1(torch.cat([u2, d1], dim=1))


class PatchGAN(nn.Module):
    """A logit per 4x4 patch of the (outline, picture) pair: real or generated."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(4, width, 4, 2, 1), nn.LeakyReLU(0.2),
                                 block(width, 2 * width, down=True),
                                 nn.Conv2d(2 * width, 1, 3, 1, 1))

    def forward(self, outline: torch.Tensor, picture: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([outline, picture], dim=1))


def set_requires_grad(model: nn.Module, flag: bool) -> None:
    """pix2pix's trick: no gradients for the discriminator while the generator learns."""
    for param in model.parameters():
        param.requires_grad_(flag)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training iterations")
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--images", type=int, default=512, help="generated training pairs")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--l1", type=float, default=100.0, help="weight of the L1 loss")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    rt = mpt.Runtime(seed=args.seed)
    generator, discriminator = UNet(), PatchGAN()
    betas = (0.5, 0.999)  # pix2pix's Adam
    opt_g = torch.optim.Adam(generator.parameters(), lr=args.lr, betas=betas)
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=args.lr, betas=betas)
    generator, opt_g = rt.setup(generator, opt_g, name="G")
    discriminator, opt_d = rt.setup(discriminator, opt_d, name="D")
    train, held_out = paired_images(args.images, args.seed), paired_images(64, args.seed + 1)
    loader = rt.setup_dataloader(DataLoader(train, batch_size=args.batch_size, shuffle=True))
    rt.progress(total=args.steps)
    step = rt.resume()["step"]  # with --checkpoint-dir: the latest checkpoint, if any
    rt.print(f"pix2pix on {rt.world_size} process(es), backend {rt.backend.name}, precision "
             f"{rt.precision.name}, from step {step}")

    gan_loss = nn.BCEWithLogitsLoss()
    l1 = nn.L1Loss()
    while step < args.steps:
        for outline, target in loader:
            with rt.autocast():
                fake = generator(outline)
            # the discriminator: a real pair and a generated one
            set_requires_grad(discriminator, True)
            opt_d.zero_grad()
            with rt.autocast():
                pred_fake = discriminator(outline, fake.detach())
                pred_real = discriminator(outline, target)
                loss_d = 0.5 * (gan_loss(pred_fake, torch.zeros_like(pred_fake))
                                + gan_loss(pred_real, torch.ones_like(pred_real)))
            rt.backward(loss_d)
            rt.step(opt_d)
            # the generator: fool the discriminator, and stay close to the target
            set_requires_grad(discriminator, False)
            opt_g.zero_grad()
            with rt.autocast():
                pred_fake = discriminator(outline, fake)
                loss_adv = gan_loss(pred_fake, torch.ones_like(pred_fake))
                loss_l1 = l1(fake.float(), target)
                loss_g = loss_adv + args.l1 * loss_l1
            rt.backward(loss_g)
            rt.step(opt_g)
            step = rt.global_step  # iterations: one per generator and discriminator step
            if step % 10 == 0:  # rt.log reads the tensors: a wait for the device
                rt.log(loss_d=loss_d.detach(), loss_g_adv=loss_adv.detach(),
                       loss_g_l1=loss_l1.detach())
            if step % 50 == 0 or step == args.steps:
                rt.print(f"step {step:4d}  D {loss_d.item():.3f}  G adv {loss_adv.item():.3f}  "
                         f"L1 {loss_l1.item():.3f}")
            if rt.checkpoint_dir is not None and (step % 100 == 0 or step == args.steps):
                rt.save(keep=2)
            if step >= args.steps:
                break

    # Held-out L1 of the generator, over every rank's shard.
    generator.eval()
    total = torch.zeros(2, device=rt.device)
    with torch.no_grad():
        for outline, target in rt.setup_dataloader(DataLoader(held_out, batch_size=32)):
            with rt.autocast():
                fake = generator(outline)
            total += torch.stack([(fake.float() - target).abs().mean() * len(target),
                                  torch.tensor(float(len(target)), device=rt.device)])
    rt.all_reduce(total, op="sum")
    rt.log(held_out_l1=total[0] / total[1])
    rt.print(f"held-out L1: {float(total[0] / total[1]):.3f} (a blank picture scores "
             f"{float((held_out.tensors[1] + 0.8).abs().mean()):.3f})")
    rt.close()


if __name__ == "__main__":
    main()
