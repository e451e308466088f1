"""What benchmarks/plan_published.py needs of the cost model: a fused kernel's causal attention,
a published run's micro-batches, and a model cast to 16 bits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpt.errors import UsageError
from mpt.estimate import meta_model
from mpt.plan.cost import activation_width
from mpt.plan.layouts import layout
from mpt.plan.profiles import device_profile
from mpt.plan.workload import profile
from mpt.precision import describe


class Attention(nn.Module):
    """Flash attention of its input as query, key and value: (batch, heads, tokens, dim)."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._scaled_dot_product_flash_attention(x, x, x, 0.0,
                                                                   self.causal)[0]


def _flops(causal: bool) -> tuple[float, float]:
    # The second block: its input needs a gradient, so its backward runs.
    net = meta_model(lambda: nn.Sequential(nn.Linear(64, 64), Attention(causal)))
    work = profile(net, [4, 256, 64], torch.float32, 1)
    block = work.blocks[1]
    return sum(op.flops for op in block.forward), sum(op.flops for op in block.backward)


def test_causal_flash_attention_counts_half_the_scores() -> None:
    full, causal = _flops(False), _flops(True)
    assert full[0] > 0 and full[1] > 0
    assert causal[0] == pytest.approx(full[0] / 2)
    assert causal[1] == pytest.approx(full[1] / 2)


def test_layout_takes_the_published_microbatches() -> None:
    net = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    chosen = layout(net, "ddp", {}, 2, 1, world=8, precision="fp32", batch=96,
                    microbatches=12)
    assert (chosen.microbatches, chosen.micro_batch, chosen.plan.dp_size) == (12, 2, 4)
    with pytest.raises(UsageError, match="micro-batch"):
        layout(net, "ddp", {}, 2, 1, world=8, precision="fp32", batch=96, microbatches=7)


def test_only_a_cast_model_moves_16_bit_activations() -> None:
    assert activation_width(describe("fp32")) == 1.0
    assert activation_width(describe("bf16-mixed")) == 1.0
    assert activation_width(describe("O2-bf16")) == 0.5


def test_p100_has_no_bf16_units() -> None:
    p100 = device_profile("p100-pcie")
    assert p100.matmul_flops("bfloat16") == p100.matmul_flops("float32") == 9.3e12
