"""`mpt plan`'s datasheet predictions beside published training results at scales no one here
can run (issue 36).

    .venv/bin/python benchmarks/plan_published.py

Each published run is rebuilt on the meta device (nothing allocated), laid out as it was
published (backend, tensor and pipeline parallel sizes, nodes x GPUs, batch, micro-batches)
through mpt's own ``layout`` and priced by ``mpt.plan.cost.predict`` with the datasheet
profiles of ``mpt/plan/profiles.py``, which were set before this comparison and are not fitted
to it. The published figure is then recomputed from the predicted step (tokens/s per GPU,
TFLOP/s per GPU in the source's own FLOP count, or the scaling efficiency) and printed beside
it, with the ratio predicted / published.

A datasheet prediction is a roofline of every op at the vendor's peak, with nothing for kernel
launches, the framework, the input pipeline or stragglers: it is a lower bound of the step, so
the ratio of a throughput is expected above 1; how far above is the error stated.

Sources (each figure is read from the source as quoted; of the Megatron-LM rows, what was
checked and what is as remembered is said below):

- torchtitan: pytorch/torchtitan, ``benchmarks/llama3_h100_202412_torchtitan.md`` (December
  2024; the same tables as the TorchTitan paper, Liang et al., ICLR 2025), Table 1 (8 GPUs) and
  Table 3 (128 GPUs): Llama 3.1 8B, FSDP, local batch 2, sequence 8192 (the 8B config's
  default), selective activation checkpointing, no torch.compile, no Float8: 5,762 and 5,605
  tokens/s per GPU. Hardware: H100 SXM with 95 GiB HBM2e (2.4 TB/s), at a 500 W power limit,
  8 per host over NVSwitch, 400 Gbit/s RDMA per GPU.
- Megatron-LM: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC 2021 (arXiv 2104.04473), Table 1: GPT of 1.7 B (32 GPUs,
  batch 512, no model parallelism), 18.4 B (tp 8, 256 GPUs, batch 1024) and 145.6 B (tp 8,
  pp 8, 1536 GPUs, batch 2304) parameters, sequence 2048, vocabulary 51,200: 137, 135 and 148
  TFLOP/s per GPU, counted by the paper's equation 96 B s l h^2 (1 + s/6h + V/16lh), which
  includes the forward that activation recomputation repeats. The layers, widths, tp, pp, GPU
  counts, TFLOP/s and the equation agree with a public transcription of Table 1 and the
  appendix; Megatron-LM's README states the 145B row's tp 8 x pp 8. The batches and the
  heads (24, 48, 96) were in neither and are as remembered. Selene: DGX A100 80 GB, 8 GPUs
  per node over NVSwitch, 8 x 200 Gbit/s HDR InfiniBand per node.
- Horovod: horovod/horovod, ``docs/benchmarks.rst`` (Sergeev and Del Balso, "Horovod: fast and
  easy distributed deep learning in TensorFlow", arXiv 1802.05799, 2018): 128 servers with 4
  Pascal GPUs each over RoCE-capable 25 Gbit/s, tf_cnn_benchmarks ``--model resnet101
  --batch_size 64`` (per GPU, synthetic data, fp32): 90 % scaling efficiency at 512 GPUs. Which
  Pascal GPU is not said: the P100 PCIe profile is assumed.

What the cost model cannot express, and so leaves out (each makes the prediction faster than
the run): activation checkpointing (torchtitan's selective, Megatron's full recomputation:
one more forward of what is recomputed), Megatron's interleaved schedule and its micro-batch
size (assumed 1 under a pipeline, the whole replica's batch without one: the model has no
gradient accumulation), torchtitan's 500 W power limit and HBM2e, TensorFlow for Horovod.
"""

from __future__ import annotations

import argparse
import math
import runpy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mpt.estimate import meta_model
from mpt.plan.cost import Prediction, predict
from mpt.plan.layouts import layout
from mpt.plan.network import Cluster
from mpt.plan.planner import model_of
from mpt.plan.profiles import device_profile, link_profile
from mpt.precision import describe

GIB = 2.0**30


# -- Llama 3.1 8B, as torchtitan builds it -------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaConfig:
    """Llama 3.1 8B's shape (Meta's params.json for Llama 3.1 8B)."""

    vocab: int = 128_256
    """Tokens of the vocabulary."""
    dim: int = 4096
    """Model width."""
    layers: int = 32
    """Transformer blocks."""
    heads: int = 32
    """Query heads."""
    kv_heads: int = 8
    """Key and value heads (grouped-query attention)."""
    hidden: int = 14_336
    """The SwiGLU feed-forward's width."""


class LlamaBlock(nn.Module):
    """RMSNorm, grouped-query attention with rotary embeddings, RMSNorm, SwiGLU: torchtitan's
    ``TransformerBlock``. Keys and values are repeated to every query head before the fused
    attention kernel, as torchtitan did for SDPA in 2024."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.dim // c.heads
        self.attention_norm = nn.RMSNorm(c.dim)
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)
        self.ffn_norm = nn.RMSNorm(c.dim)
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.head_dim)
        k = self.wk(h).view(b, t, self.kv_heads, self.head_dim)
        v = self.wv(h).view(b, t, self.kv_heads, self.head_dim)
        q, k = _rotary(q), _rotary(k)
        repeat = self.heads // self.kv_heads
        k, v = (z.repeat_interleave(repeat, dim=2) for z in (k, v))
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        y = _flash_attention(q, k, v)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


def _rotary(x: torch.Tensor, theta: float = 500_000.0) -> torch.Tensor:
    """Rotary position embedding of (batch, tokens, heads, head_dim), in real arithmetic."""
    half = x.shape[-1] // 2
    frequencies = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)[:, None] * frequencies
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention by the FlashAttention kernel SDPA runs on an H100. Called by its aten
    op: on the meta device SDPA would take its math path, whose score matrices the run never
    materializes."""
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]


class LlamaEmbed(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)


class LlamaHead(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


class Llama(nn.Module):
    """Embedding, blocks, norm and output layer (not tied), in forward order for
    ``pipeline_blocks`` (the fsdp backend wraps each block as a unit)."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.embed = LlamaEmbed(c)
        self.layers = nn.ModuleList(LlamaBlock(c) for _ in range(c.layers))
        self.head = LlamaHead(c)

    def pipeline_blocks(self) -> list[nn.Module]:
        return [self.embed, *self.layers, self.head]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for block in self.pipeline_blocks():
            x = block(x)
        return x


# -- Megatron-LM's GPT: mpt's own example GPT at the paper's shapes -------------------------------
def megatron_gpt(layers: int, width: int, heads: int) -> Callable[[], nn.Module]:
    """examples/gpt.py's GPT (pre-norm, GELU, biases, tied embeddings, Megatron's tp plan) at a
    row of the paper's Table 1: vocabulary 51,200, sequence 2048."""
    example = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "gpt.py"),
                             run_name="plan_published")
    config = example["GPTConfig"](vocab=51_200, block=2048, layers=layers, heads=heads,
                                  embed=width)
    return lambda: example["GPT"](config)


def megatron_flops(batch: int, layers: int, width: int, seq: int = 2048,
                   vocab: int = 51_200) -> float:
    """FLOPs of one step as the Megatron-LM paper counts them (its equation 3, with the
    recomputed forward): 96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    return (96 * batch * seq * layers * width**2
            * (1 + seq / (6 * width) + vocab / (16 * layers * width)))


# -- the comparisons -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Published:
    """One published result and the layout it was measured at."""

    name: str
    """What ran, for the table."""
    source: str
    """Where the figure is published (file or table)."""
    figure: float
    """The published figure."""
    unit: str
    """Its unit: ``tokens/s/GPU``, ``TFLOP/s/GPU`` or ``scaling efficiency``."""
    build: Callable[[], nn.Module]
    """Builds the model (run on the meta device)."""
    input_shape: tuple[int, ...]
    """One sample's shape."""
    input_dtype: torch.dtype
    """The sample's dtype (int64 for tokens)."""
    device: str
    """Datasheet device profile."""
    link: str
    """Each node's link (all its NICs together)."""
    nodes: int
    """Nodes of the run."""
    gpus: int
    """GPUs per node."""
    backend: str
    """mpt's backend closest to the run's data parallelism."""
    batch: int
    """Global batch, in samples."""
    precision: str
    """mpt's precision closest to the run's."""
    optimizer: str = "adam"
    """The optimizer (its state per parameter)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """The backend's options."""
    pp: int = 1
    """Pipeline stages."""
    tp: int = 1
    """Tensor-parallel size."""
    microbatches: int | None = None
    """Micro-batches per step under a pipeline."""
    flops: float = 0.0
    """FLOPs of one step as the source counts them (for a TFLOP/s figure)."""
    recomputes: bool = False
    """Whether the run recomputes every block's forward in its backward (full activation
    checkpointing), which mpt does not do."""


def cases() -> list[Published]:
    llama = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
    megatron = "Narayanan et al. SC'21 (arXiv 2104.04473) Table 1"
    common_llama = dict(build=lambda: Llama(LlamaConfig()), input_shape=(8192,),
                        input_dtype=torch.int64, device="h100-sxm", gpus=8, backend="fsdp",
                        precision="O2-bf16", optimizer="adamw")
    common_gpt = dict(input_shape=(2048,), input_dtype=torch.int64, device="a100-sxm-80gb",
                      link="1600gbit", gpus=8, backend="ddp", precision="fp16-mixed")
    rows = [
        Published(name="Llama 3.1 8B, FSDP, 8 H100", source=f"{llama} Table 1",
                  figure=5762, unit="tokens/s/GPU", link="3200gbit", nodes=1, batch=16,
                  **common_llama),
        Published(name="Llama 3.1 8B, FSDP, 128 H100", source=f"{llama} Table 3",
                  figure=5605, unit="tokens/s/GPU", link="3200gbit", nodes=16, batch=256,
                  **common_llama),
    ]
    for (params, layers, width, heads, tp, pp, gpus, batch, tflops) in (
            ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137.0),
            ("18.4B", 40, 6144, 48, 8, 1, 256, 1024, 135.0),
            ("145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 148.0)):
        replicas = gpus // (tp * pp)
        rows.append(Published(
            name=f"GPT {params}, tp {tp} pp {pp}, {gpus} A100", source=megatron,
            figure=tflops, unit="TFLOP/s/GPU", build=megatron_gpt(layers, width, heads),
            nodes=gpus // 8, batch=batch, tp=tp, pp=pp,
            microbatches=batch // replicas if pp > 1 else None,
            flops=megatron_flops(batch, layers, width), recomputes=True, **common_gpt))
    rows.append(Published(
        name="ResNet-101, Horovod, 512 P100 (128 x 4)", source="horovod/horovod "
        "docs/benchmarks.rst", figure=0.90, unit="scaling efficiency", build=_resnet101,
        input_shape=(3, 224, 224), input_dtype=torch.float32, device="p100-pcie",
        link="25gbit", nodes=128, gpus=4, backend="horovod", batch=64 * 512, precision="fp32",
        optimizer="sgd-momentum"))
    return rows


def _resnet101() -> nn.Module:
    from torchvision.models import resnet101

    return resnet101()


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """A published figure beside its prediction."""

    case: Published
    """The published result."""
    prediction: Prediction
    """The cost model's answer at the published layout."""
    predicted: float
    """The published figure, recomputed from the predicted step."""
    with_recompute: float | None
    """The same with one more forward of every micro-batch (the run's recomputation, beyond
    what mpt runs); None where the run recomputes nothing."""

    @property
    def ratio(self) -> float:
        return self.predicted / self.case.figure


def run(case: Published) -> Outcome:
    net = meta_model(case.build)
    model = model_of(net, case.input_shape, case.input_dtype, case.optimizer)
    spec = describe(case.precision)
    device = device_profile(case.device)

    def step(nodes: int, gpus: int, batch: int) -> Prediction:
        cluster = Cluster(nodes=nodes, gpus=gpus, device=device, link=link_profile(case.link))
        chosen = layout(net, case.backend, case.options, case.pp, case.tp,
                        world=nodes * gpus, precision=case.precision, batch=batch,
                        microbatches=case.microbatches)
        return predict(chosen, model, cluster, spec)

    world = case.nodes * case.gpus
    prediction = step(case.nodes, case.gpus, case.batch)

    def figure(seconds: float) -> float:
        if case.unit == "tokens/s/GPU":
            return case.batch * math.prod(case.input_shape) / seconds / world
        if case.unit == "TFLOP/s/GPU":
            return case.flops / seconds / world / 1e12
        # weak scaling: one GPU with the same per-GPU batch, over the whole cluster
        return step(1, 1, case.batch // world).step / seconds

    with_recompute = None
    if case.recomputes:
        # One more forward per micro-batch, on the critical path as the backward that needs
        # it, in every micro-batch slot of the schedule, the bubble's included.
        m, p = prediction.layout.microbatches, prediction.layout.plan.pp
        again = prediction.terms["forward"] / m * (m + p - 1)
        with_recompute = figure(prediction.step + again)
    return Outcome(case=case, prediction=prediction, predicted=figure(prediction.step),
                   with_recompute=with_recompute)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    outcomes = [run(case) for case in cases()]
    print(f"{'published run':<40} {'unit':<19} {'published':>9} {'predicted':>9} "
          f"{'pred/pub':>8} {'+recompute':>10}  {'step ms':>8} {'compute':>8} {'exposed':>8} "
          f"{'bubble':>8} {'GiB/rank':>8}  step limited by")
    for o in outcomes:
        p = o.prediction
        terms = {"compute": p.compute, "exposed communication": p.exposed, "bubble": p.bubble}
        again = "-" if o.with_recompute is None else f"{o.with_recompute / o.case.figure:.2f}"
        print(f"{o.case.name:<40} {o.case.unit:<19} {o.case.figure:>9,.2f} {o.predicted:>9,.2f} "
              f"{o.ratio:>8.2f} {again:>10}  {p.step * 1e3:>8.1f} {p.compute * 1e3:>8.1f} "
              f"{p.exposed * 1e3:>8.1f} {p.bubble * 1e3:>8.1f} {p.total_memory / GIB:>8.1f}  "
              f"{max(terms, key=lambda k: terms[k])}")
    print("\nsources:")
    for o in outcomes:
        print(f"  {o.case.name}: {o.case.source}; mpt layout {o.prediction.layout.label}, "
              f"{o.case.nodes} x {o.case.gpus} {o.case.device}, node link {o.case.link}, "
              f"{o.case.precision}, micro-batch {o.prediction.layout.micro_batch} x "
              f"{o.prediction.layout.microbatches}")
    print("datasheet peaks: every prediction is a lower bound of the step (pred/pub of a "
          "throughput above 1); no figure above was fitted. +recompute: one more forward per "
          "micro-batch, as the run's full activation checkpointing (mpt has none). GiB/rank: "
          "without the runs' activation checkpointing, and without gradient accumulation (the "
          "whole replica's batch in one micro-batch where there is no pipeline): not the "
          "runs' memory.")


if __name__ == "__main__":
    main()
