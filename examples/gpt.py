"""Train a small GPT (a nanoGPT-style decoder) on a character-level text corpus with mpt.

The corpus ships with the repository (``examples/data/corpus.txt``, ~25 KB of public-domain and
newly written English); ``--data FILE`` trains on any UTF-8 text instead. Meant for bf16:

    mpt launch --gpus 2 --precision bf16-mixed examples/gpt.py --steps 300
    mpt launch --gpus 2 --backend deepspeed --zero-stage 2 --precision bf16-mixed \\
        examples/gpt.py --steps 300
    mpt launch --gpus 2 --pipeline-stages 2 examples/gpt.py --steps 300   # blocks over 2 ranks
    mpt launch --gpus 8 --precision bf16-mixed --run-dir runs/gpt examples/gpt.py \\
        --data big.txt --layers 12 --heads 12 --embed 768 --block 1024 --batch-size 16

Started without `mpt launch` (``python examples/gpt.py``) it trains in bf16-mixed too; under
`mpt launch` the launch's ``--precision`` decides, as for every mpt script. ``--steps N`` stops
after N optimizer steps.

Besides the loss, it reports throughput in tokens/s (all ranks) and the model FLOPs utilisation
(MFU): achieved model FLOPs over the peak of the devices. The model FLOPs per token are PaLM's
estimate (Chowdhery et al., 2022, appendix B), as nanoGPT uses it: ``6 N + 12 L d T`` for N
non-embedding-position parameters, L layers, width d and context T (the second term is the
attention's scores and weighted sum, forward and backward). The peak is ``--peak-tflops`` per
device when given; else a table of datasheet dense bf16/fp16 peaks for known GPUs; else (CPUs,
unknown GPUs) a peak measured at start-up: the best square matmul this process achieves, in
fp32 or the run's compute dtype. The source is printed, since an MFU is only as good as its peak.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import mpt
from mpt.run_config import VARIABLE as LAUNCH_SETTINGS

CORPUS = Path(__file__).parent / "data" / "corpus.txt"

DATASHEET_TFLOPS = {  # dense bf16 (fp16 alike) tensor-core peak per GPU, no sparsity
    "H200": 989.0, "H100": 989.0, "H800": 989.0, "GH200": 989.0, "A100": 312.0, "A800": 312.0,
    "A10G": 70.0, "A10": 125.0, "L40S": 362.0, "L4": 121.0, "V100": 125.0, "T4": 65.0,
}
"""Keyed by a name fragment of ``torch.cuda.get_device_name``; longer fragments are tried first.
(fp32 runs are measured against the same bf16 peak: that is what MFU compares with.)"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(CORPUS), help="a UTF-8 text file")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embed", type=int, default=128, help="model width d")
    parser.add_argument("--block", type=int, default=128, help="context length T, in characters")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=400, help="stop after N optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per process")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak, before rt.scale_lr")
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-batches", type=int, default=8, help="per process")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="peak TFLOP/s of one device for MFU (default: datasheet or measured)")
    parser.add_argument("--save", default="", help="checkpoint directory (as `mpt launch "
                        "--checkpoint-dir`), written at every evaluation; a rerun resumes")
    parser.add_argument("--sample", type=int, default=200,
                        help="characters to generate at the end (rank 0); 0 for none")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.embed % args.heads:
        parser.error(f"--embed {args.embed} must be a multiple of --heads {args.heads}")
    return args


# -- data -----------------------------------------------------------------------------------------
class CharTokenizer:
    """One token per distinct character of the corpus: nothing to download or train."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every window of ``block + 1`` tokens: input ``block`` tokens, target shifted by one.

    A map-style dataset (not a random-batch function as in nanoGPT) so that mpt's loader shards,
    shuffles and checkpoints its position like any other."""

    def __init__(self, tokens: torch.Tensor, block: int) -> None:
        self.tokens, self.block = tokens, block

    def __len__(self) -> int:
        return len(self.tokens) - self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i:i + self.block + 1]
        return chunk[:-1], chunk[1:]


# -- model ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    block: int
    layers: int
    heads: int
    embed: int
    dropout: float = 0.0


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP.

    ``qkv`` holds each head's query, key and value rows together (Megatron's layout), so that
    a split of its rows over tensor-parallel ranks gives each rank whole heads; the forward
    reads the heads it holds from the shape (all of them without tensor parallelism)."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads, self.dropout = c.heads, c.dropout
        self.ln1 = nn.LayerNorm(c.embed)
        self.qkv = nn.Linear(c.embed, 3 * c.embed)
        self.proj = nn.Linear(c.embed, c.embed)
        self.ln2 = nn.LayerNorm(c.embed)
        self.mlp = nn.Sequential(nn.Linear(c.embed, 4 * c.embed), nn.GELU(),
                                 nn.Linear(4 * c.embed, c.embed), nn.Dropout(c.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        head = d // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, t, -1, 3, head).unbind(3)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    """Token and learned position embeddings."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(c.vocab, c.embed)
        self.wpe = nn.Embedding(c.block, c.embed)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class Head(nn.Module):
    """The final LayerNorm and the output layer."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(c.embed)
        self.head = nn.Linear(c.embed, c.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


class GPT(nn.Module):
    """Embeddings, ``layers`` blocks, and an output layer that shares the token embedding's
    weights (as GPT-2). ``pipeline_blocks`` lists them in forward order, so `mpt launch
    --pipeline-stages P` can cut the model between any two of them (the shared weights' gradients
    are summed across the stages that hold them)."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.embed = Embed(c)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.out = Head(c)
        self.out.head.weight = self.embed.wte.weight
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual outputs
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def pipeline_blocks(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.out]

    def tensor_parallel_plan(self) -> dict[str, str | mpt.Split]:
        """`mpt launch --tensor-parallel T`: Megatron's split of each block. Attention's
        projection splits by heads, its output projection by its inputs (one allreduce); the
        MLP likewise. Embeddings and norms stay whole on every rank."""
        qkv = mpt.Split("colwise", unit=3 * self.config.embed // self.config.heads,
                        what="heads")
        return {f"blocks.{i}.{name}": style for i in range(len(self.blocks))
                for name, style in (("qkv", qkv), ("proj", "rowwise"), ("mlp.0", "colwise"),
                                    ("mlp.2", "rowwise"))}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        for block in self.pipeline_blocks():
            idx = block(idx)
        return idx


def flops_per_token(model: GPT) -> float:
    """PaLM's model FLOPs per trained token: 6 N + 12 L d T (N without position embeddings;
    the tied output layer counts once, through the token embedding)."""
    c = model.config
    n = sum(p.numel() for p in model.parameters()) - model.embed.wpe.weight.numel()
    return 6.0 * n + 12.0 * c.layers * c.embed * c.block


def peak_flops(rt: mpt.Runtime, given_tflops: float) -> tuple[float, str]:
    """One device's peak FLOP/s and where the figure comes from."""
    if given_tflops > 0:
        return given_tflops * 1e12, "--peak-tflops"
    if rt.device.type == "cuda":
        name = torch.cuda.get_device_name(rt.device)
        for key in sorted(DATASHEET_TFLOPS, key=len, reverse=True):
            if key in name:
                return DATASHEET_TFLOPS[key] * 1e12, f"datasheet dense bf16 peak of {name}"
    # A CPU without bf16/fp16 units emulates them ~30x slower than fp32: its peak is still the
    # fp32 one, so measure both and take the better.
    dtypes = {torch.float32, {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(
        rt.precision.name, torch.float32)}
    best, dtype = max(((measured_matmul_flops(rt.device, d), d) for d in dtypes),
                      key=lambda pair: pair[0])
    return best, f"measured {str(dtype)[6:]} matmul peak of this process"


def measured_matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The best of a few square matmuls, in FLOP/s: a practical peak where no datasheet is at
    hand (a CPU's depends on its cores, clock and vector units; this measures them all). Large
    enough to be compute-bound (4096 on GPUs, 512 on CPUs), and at most about a second."""
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best, spent = float("inf"), 0.0
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = time.perf_counter() - t0
        best, spent = min(best, took), spent + took
        if spent > 1.0:
            break
    return 2.0 * n ** 3 / best


def next_token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's next character, in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(rt: mpt.Runtime, model: nn.Module, held_out: Windows, batches: int,
             batch_size: int, seed: int) -> float:
    """Mean loss over ``batches`` fixed random batches of held-out windows per rank, averaged
    over ranks (the same windows at every evaluation, so the curve is comparable)."""
    model.eval()
    # By replica, not rank: the stages of a pipelined replica must read the same rows.
    gen = torch.Generator().manual_seed(seed + 1000 + rt.topology.dp_rank)
    total = torch.zeros(1, device=rt.device)
    for _ in range(batches):
        rows = torch.randint(len(held_out), (batch_size,), generator=gen).tolist()
        x = torch.stack([held_out[i][0] for i in rows]).to(rt.device)
        y = torch.stack([held_out[i][1] for i in rows]).to(rt.device)
        total += rt.evaluate(x, y, next_token_loss)
    model.train()
    return float(rt.all_reduce(total / batches, op="mean"))


@torch.no_grad()
def sample(model: nn.Module, rt: mpt.Runtime, tok: CharTokenizer, prompt: str, length: int,
           block: int, batch_size: int) -> str:
    """Greedy-ish continuation of ``prompt`` (temperature 0.8), for a look at what was learnt.

    Each token is one ``rt.evaluate`` of a window of the same shape, so that a model cut into
    pipeline stages samples too (its stages send the shapes they trained with: ``batch_size``
    rows of ``block`` tokens): the last ``block`` tokens, padded on the right (attention is
    causal, so what follows the last token does not change its logits)."""
    model.eval()
    gen = torch.Generator(device=rt.device).manual_seed(0)
    idx = tok.encode(prompt)[None].to(rt.device)
    rows = batch_size if rt.topology.stages > 1 else 1
    for _ in range(length):
        window = idx[:, -block:]
        last = window.shape[1] - 1
        padded = F.pad(window, (0, block - 1 - last)).expand(rows, -1)
        logits = rt.evaluate(padded)[:1, last].to(rt.device).float()  # every rank, every stage
        probs = F.softmax(logits / 0.8, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=gen)], dim=1)
    model.train()
    return tok.decode(idx[0].tolist())


def lr_factor(warmup: int, total: int) -> Any:
    """Linear warm-up to the peak, then a cosine down to a tenth of it (as nanoGPT)."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))
    return factor


def main() -> None:
    args = parse_args()
    text = Path(args.data).read_text(encoding="utf-8")
    tok = CharTokenizer(text)
    tokens = tok.encode(text)
    split = int(len(tokens) * 0.9)  # the last tenth is held out
    train, held_out = Windows(tokens[:split], args.block), Windows(tokens[split:], args.block)

    torch.manual_seed(args.seed)  # same initial weights on every rank
    # bf16-mixed unless a launcher handed over a precision (`mpt launch` always does).
    launched = LAUNCH_SETTINGS in os.environ
    rt = mpt.Runtime(precision=None if launched else "bf16-mixed", seed=args.seed,
                     checkpoint_dir=args.save or None)
    model = GPT(GPTConfig(vocab=len(tok.chars), block=args.block, layers=args.layers,
                          heads=args.heads, embed=args.embed, dropout=args.dropout))
    fpt = flops_per_token(model)
    n_params = sum(p.numel() for p in model.parameters())  # before a pipeline keeps a stage
    # One parameter group, decaying biases and LayerNorm gains too (nanoGPT spares them): mpt's
    # deepspeed backend cannot yet checkpoint the optimizer state of several groups at ZeRO
    # stages >= 1. Over a few hundred steps the difference is a few per cent of their size.
    optimizer = torch.optim.AdamW(model.parameters(), lr=rt.scale_lr(args.lr), betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.setup_dataloader(DataLoader(train, batch_size=args.batch_size, shuffle=True,
                                            drop_last=True))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_factor(min(args.warmup_steps, args.steps), args.steps))
    peak, peak_source = peak_flops(rt, args.peak_tflops)
    # Each data-parallel replica reads its own batch (a pipeline's stages share theirs).
    tokens_per_step = args.batch_size * args.block * rt.topology.dp_size * rt.accumulate
    rt.print(f"rank 0 of {rt.world_size}: backend {rt.backend.name}, precision "
             f"{rt.precision.name}; GPT {args.layers} layers x {args.embed} wide, "
             f"{args.heads} heads, context {args.block}, {n_params / 1e6:.2f} M parameters, "
             f"vocabulary {len(tok.chars)} characters; {len(tokens):,} tokens "
             f"({len(train):,} training windows); {tokens_per_step:,} tokens per step; "
             f"{fpt / 1e6:.2f} MFLOP per token; peak {peak / 1e12:.3g} TFLOP/s per device "
             f"({peak_source})")
    rt.progress(total=args.steps, samples_per_step=tokens_per_step)  # its "samples/s" = tokens/s

    step = rt.resume(scheduler=scheduler)["step"]
    val_loss = float("nan")
    clock, clock_step = time.perf_counter(), step
    while step < args.steps:
        for x, y in loader:
            loss = rt.forward_backward(x, y, next_token_loss)  # pipelined or not, one call
            rt.clip_grad_norm_(1.0)
            rt.step()
            scheduler.step()
            step += 1
            if step % args.eval_every == 0 or step == args.steps:
                elapsed = time.perf_counter() - clock
                tokens_per_s = (step - clock_step) * tokens_per_step / elapsed
                mfu = tokens_per_s * fpt / (peak * rt.world_size)
                val_loss = evaluate(rt, model, held_out, args.eval_batches, args.batch_size,
                                    args.seed)
                rt.log(val_loss=val_loss, tokens_per_s=tokens_per_s, mfu=mfu)
                rt.print(f"step {step:5d}  train loss {loss.item():.4f}  val loss "
                         f"{val_loss:.4f}  {tokens_per_s:,.0f} tokens/s  MFU {mfu:.2%}")
                if rt.checkpoint_dir is not None:
                    rt.save(step=step, scheduler=scheduler, keep=2)
                clock, clock_step = time.perf_counter(), step  # evaluation is not throughput
            if step == args.steps:
                break
    if math.isnan(val_loss):  # resumed at the end: score what was loaded
        val_loss = evaluate(rt, model, held_out, args.eval_batches, args.batch_size, args.seed)
    if args.sample:  # every rank runs the forwards (ZeRO-3 gathers weights collectively)
        rt.print(sample(model, rt, tok, "The ", args.sample, args.block, args.batch_size))
    rt.print(f"final val loss {val_loss:.4f} after {step} steps")
    rt.close()


if __name__ == "__main__":
    main()
